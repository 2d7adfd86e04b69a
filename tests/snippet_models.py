"""What DeepSpeed's inference snippets need, offline: a byte-level BPE tokenizer trained in memory (any text encodes)
and a tiny random Llama over its vocabulary whose logits have clear winners (so greedy tokens in bf16/fp16 can be
compared with fp32's without ties deciding them)."""
from __future__ import annotations

import functools

import torch

from .conftest import build_tiny, tiny_llama_config

PROMPTS = ["DeepSpeed is", "Once upon a time, there was a little", "The capital of France is"]
CORPUS = ["DeepSpeed is a deep learning optimization library that makes distributed inference easy.",
          "Once upon a time, there was a little girl who loved to play in the sun.",
          "The capital of France is Paris, and the capital of Italy is Rome."]


@functools.lru_cache(maxsize=1)
def _tokenizer_object():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<pad>", "<s>", "</s>"], show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def byte_tokenizer():
    """A fresh GPT-2-style byte-level BPE tokenizer (pad 0, bos 1, eos 2), the same in every process."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=_tokenizer_object(), bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def snippet_llama(seed: int = 0, dtype=torch.float32, **overrides):
    """A tiny random Llama over :func:`byte_tokenizer`'s vocabulary; ``initializer_range`` large enough that each
    step's top logit stands clear of the next."""
    values = dict(vocab_size=len(byte_tokenizer()), initializer_range=0.2, num_attention_heads=4,
                  num_key_value_heads=2)
    values.update(overrides)
    return build_tiny(tiny_llama_config(**values), seed=seed, dtype=dtype)


def generated_ids(pipe, prompts=PROMPTS, max_new_tokens: int = 20) -> list[list[int]]:
    """The new token ids the text-generation pipeline ``pipe`` makes for each prompt, greedily (the snippet's call)."""
    out = [pipe(prompt, do_sample=False, max_new_tokens=max_new_tokens, return_tensors=True)[0] for prompt in prompts]
    lengths = [len(pipe.tokenizer(prompt).input_ids) for prompt in prompts]
    return [list(o["generated_token_ids"][n:]) for o, n in zip(out, lengths)]


MASKED_WORDS = "[PAD] [UNK] [CLS] [SEP] [MASK] the capital of france is paris a city in europe".split()


def wordpiece_tokenizer():
    """A BERT-style WordPiece tokenizer over :data:`MASKED_WORDS` (``[CLS] text [SEP]``, lower-cased)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {word: index for index, word in enumerate(MASKED_WORDS)}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


def tiny_bert(seed: int = 0):
    """A tiny random BERT masked LM over :func:`wordpiece_tokenizer`'s vocabulary."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(MASKED_WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    return BertForMaskedLM(config).eval()


def tiny_t5(seed: int = 0):
    """A tiny random T5 v1.1-style model (gated-GELU feed-forward, as DeepSpeed's T5 snippet's t5-v1_1-small) over
    :func:`byte_tokenizer`'s vocabulary (relative position bias, 4 heads); ``initializer_factor`` large enough that
    each step's top logit stands clear of the next."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    config = T5Config(vocab_size=len(byte_tokenizer()), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      feed_forward_proj="gated-gelu", initializer_factor=8.0, decoder_start_token_id=0, pad_token_id=0,
                      eos_token_id=2)
    return T5ForConditionalGeneration(config).eval()


def tiny_bart(seed: int = 0, family: str = "bart"):
    """A tiny random BART over :func:`byte_tokenizer`'s vocabulary (tied, scaled embeddings, learned positions);
    ``family="mvp"``: MVP, a BART-family model whose attention reshapes its output by ``embed_dim``."""
    from transformers import BartConfig, BartForConditionalGeneration, MvpConfig, MvpForConditionalGeneration

    config_class, model_class = {"bart": (BartConfig, BartForConditionalGeneration),
                                 "mvp": (MvpConfig, MvpForConditionalGeneration)}[family]
    torch.manual_seed(seed)
    config = config_class(vocab_size=len(byte_tokenizer()), d_model=32, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                        max_position_embeddings=64, init_std=0.2, scale_embedding=True, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)
    return model_class(config).eval()


class Text2TextPipe:
    """transformers 5 removed the "text2text-generation" pipeline the seq2seq snippets build: a stand-in holding the
    model as ``.model``, whose call generates greedily from a prompt and returns the new token ids."""

    def __init__(self, model):
        self.model, self.tokenizer = model, byte_tokenizer()

    def __call__(self, text: str) -> list[int]:
        batch = self.tokenizer(text, return_tensors="pt")
        return self.model.generate(**batch, do_sample=False, max_new_tokens=8)[0].tolist()
