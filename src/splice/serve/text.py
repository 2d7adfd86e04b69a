"""Token ids to the text a client sees: incremental detokenization, stop strings, logprob entries.

:class:`IncrementalDecoder` turns one token at a time into text without ever splitting a multi-byte character (a
token that ends inside one yields nothing until the character is complete). :class:`StopStrings` cuts the text
exactly as OpenAI does (the text ends right before the first stop string, which is not returned) and, for
streaming, holds back any suffix that could still grow into a stop string, so nothing emitted is ever taken back.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

#: Prompt tokens decoded with the generated ones: a tokenizer may drop a word's leading space when it starts the
#: decoded text (SentencePiece), which the prompt's last tokens in front prevent.
CONTEXT_TOKENS = 4


class IncrementalDecoder:
    """Text of the generated ids as they arrive (the offsets method vLLM and TGI use): decode the ids since the last
    emitted boundary, with the text before that boundary as context, and emit what grew, unless it ends in an
    incomplete character (U+FFFD), which the next tokens complete."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix = 0  # ids[prefix:read] decode to text already emitted (the context)
        self.read = len(self.ids)
        self.emitted = 0  # characters returned so far
        self._held = ""  # the decoded text of ids[read:], held back because it ends in an unfinished character

    @property
    def offset(self) -> int:
        """Where the next token's text starts in the text returned (OpenAI's ``text_offset``): the characters the
        tokens so far complete, returned or held back. A token that continues or completes an unfinished character
        starts where that character starts."""
        return self.emitted + len(self._held.rstrip("\ufffd"))

    def push(self, token_id: int) -> str:
        """Add one token; the new text that is now complete ("" while a character is unfinished)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        grown = now[len(before):] if len(now) > len(before) else ""
        if grown and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            self.emitted += len(grown)
            self._held = ""
            return grown
        self._held = grown
        return ""

    def flush(self) -> str:
        """The text still held back (an unfinished character at the end of generation, as the tokenizer decodes
        it)."""
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        out = now[len(before):] if len(now) > len(before) else ""
        self.emitted += len(out)
        self._held = ""
        return out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


class StopStrings:
    """The generated text, cut at the first stop string; :meth:`feed` returns only text no stop string can take
    back."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.text = ""
        self.emitted = 0  # text[:emitted] was returned; no stop string starts before it
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Append ``delta``; the text now safe to emit. Sets :attr:`stopped` when a stop string appeared (the text
        then ends right before it)."""
        self.text += delta
        found = [index for stop in self.stops if (index := self.text.find(stop, self.emitted)) >= 0]
        if found:
            self.text = self.text[:min(found)]
            self.stopped = True
            return self.flush()
        safe = max(self.emitted, len(self.text) - self._longest_partial_stop())
        out, self.emitted = self.text[self.emitted:safe], safe
        return out

    def flush(self) -> str:
        """The text held back (generation ended without a stop string completing)."""
        out, self.emitted = self.text[self.emitted:], len(self.text)
        return out

    def _longest_partial_stop(self) -> int:
        """The length of the longest suffix of the text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token with its logprob and the top alternatives, as token strings; ``offset``: where the
    token's text starts in the generated text (:attr:`IncrementalDecoder.offset` before the token)."""
    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[int, str, float], ...]  # (id, token string, logprob), most likely first
    offset: int = 0


class TokenText:
    """Token ids to the strings and bytes OpenAI's logprobs carry: the token decoded alone, and its raw bytes (for a
    byte-level BPE token that is part of a multi-byte character, the bytes that part holds)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.string = lru_cache(maxsize=65536)(self._string)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _string(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _bytes(self, token_id: int) -> list[int]:
        text = self.string(token_id)
        if "\ufffd" in text:
            raw = byte_level_bytes(self.tokenizer.convert_ids_to_tokens(token_id))
            if raw is not None:
                return list(raw)
        return list(text.encode("utf-8"))

    def entry(self, token_id: int, logprob: float, top: Sequence[tuple[int, float]], as_ids: bool = False,
              offset: int = 0) -> TokenLogprob:
        """A token's logprob entry; ``as_ids`` names the tokens "token_id:ID" instead of by their text."""
        name = (lambda tid: f"token_id:{tid}") if as_ids else self.string
        return TokenLogprob(token_id, name(token_id), logprob, tuple((tid, name(tid), value) for tid, value in top),
                            offset)


def byte_level_bytes(token: str | None) -> bytes | None:
    """A GPT-2 byte-level BPE token's bytes (each byte is stored as one printable character), or None when the token
    is not written that way."""
    if not token:
        return None
    decoder = _byte_decoder()
    if not all(char in decoder for char in token):
        return None
    return bytes(decoder[char] for char in token)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    try:
        from transformers.convert_slow_tokenizer import bytes_to_unicode
    except ImportError:  # older transformers
        from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def completion_logprobs(entries: Sequence[TokenLogprob], start_offset: int = 0) -> dict:
    """OpenAI's completions ``logprobs`` object: tokens, token_logprobs, top_logprobs, text_offset (each token's
    character offset in the choice's text, whose generated part starts at ``start_offset``)."""
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token: value for _, token, value in e.top} for e in entries],
            "text_offset": [start_offset + e.offset for e in entries]}


def chat_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText) -> dict:
    """OpenAI's chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}, ...]}``."""
    def item(token_id: int, token: str, value: float) -> dict:
        return {"token": token, "logprob": value, "bytes": token_text.bytes(token_id)}

    return {"content": [{**item(e.token_id, e.token, e.logprob),
                         "top_logprobs": [item(tid, token, value) for tid, token, value in e.top]} for e in entries]}
