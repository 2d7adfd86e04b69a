"""Stop strings and incremental detokenization, in isolation."""
from __future__ import annotations

import pytest

from splice.serve.text import StopStrings, byte_level_bytes


def feed_all(stops, deltas):
    cutter = StopStrings(stops)
    emitted = []
    for delta in deltas:
        emitted.append(cutter.feed(delta))
        if cutter.stopped:
            break
    if not cutter.stopped:
        emitted.append(cutter.flush())
    return emitted, cutter.stopped


@pytest.mark.parametrize("stops, deltas, text, stopped", [
    (["END"], ["ab", "cE", "N", "Dxyz"], "abc", True),
    (["END"], ["ab", "cE", "N", "x"], "abcENx", False),
    (["xy", "b"], ["a", "bxy"], "a", True),  # the earliest stop string wins, whichever is listed first
    (["\n\n"], ["one\n", "\ntwo"], "one", True),
    (["aab"], ["a", "a", "a", "b"], "a", True),  # a partial match that fails still holds back the next candidate
])
def test_text_is_cut_before_the_first_stop_string(stops, deltas, text, stopped):
    emitted, did_stop = feed_all(stops, deltas)
    assert "".join(emitted) == text and did_stop == stopped
    for index in range(len(emitted)):  # nothing emitted is ever taken back
        assert text.startswith("".join(emitted[:index + 1]))


def test_only_a_possible_stop_prefix_is_held_back():
    cutter = StopStrings(["STOP"])
    assert cutter.feed("hello ST") == "hello "
    assert cutter.feed("X") == "STX"


def test_byte_level_tokens_give_their_bytes():
    assert byte_level_bytes("ĠParis") == b" Paris"
    assert byte_level_bytes("Ġæ") == b" \xe6"
    assert byte_level_bytes("▁Paris") is None  # SentencePiece, not byte-level
