"""DeepSpeed's multi-process inference snippets, run by torchrun with ``import splice as deepspeed`` (on CPU, so the
pipeline gets no ``device=local_rank``); each rank writes its greedy tokens as JSON to ``$SNIPPET_OUT/<rank>.json``.

``argv[1]``: "inject" or "plain" (replace_with_kernel_inject) for the pipeline snippet; "checkpoint" for the big-model
one (a model built on meta with ``OnDevice``, then ``checkpoint=argv[2]``, a checkpoints JSON whose files are under
``base_dir=argv[3]``, kernel-injected); "t5" or "bart" for DeepSpeedExamples' text2text-generation snippets (their
injection_policy), on a tiny random model.
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
torch.set_num_threads(1)

from transformers import AutoConfig, AutoModelForCausalLM, pipeline  # noqa: E402

import splice as deepspeed  # noqa: E402
from tests.snippet_models import (PROMPTS, Text2TextPipe, byte_tokenizer, generated_ids, snippet_llama,  # noqa: E402
                                  tiny_bart, tiny_t5)


def pipeline_snippet(world_size: int, mode: str):
    generator = pipeline("text-generation", model=snippet_llama(), tokenizer=byte_tokenizer())
    generator.model = deepspeed.init_inference(generator.model, mp_size=world_size, dtype=torch.float,
                                               replace_with_kernel_inject=mode == "inject")
    return generator


def checkpoint_snippet(world_size: int, checkpoints_json: str, repo_root: str):
    config = AutoConfig.from_pretrained(repo_root)
    with deepspeed.OnDevice(dtype=torch.float32, device="meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = deepspeed.init_inference(model, mp_size=world_size, base_dir=repo_root, dtype=torch.float32,
                                     checkpoint=checkpoints_json, replace_with_kernel_inject=True)
    return pipeline("text-generation", model=model, tokenizer=byte_tokenizer())


def t5_snippet(world_size: int):
    from transformers.models.t5.modeling_t5 import T5Block

    pipe = Text2TextPipe(tiny_t5())
    # DeepSpeedExamples inference/huggingface/text2text-generation/test-t5.py, verbatim:
    pipe.model = deepspeed.init_inference(
        pipe.model,
        mp_size=world_size,
        dtype=torch.float,
        injection_policy={T5Block: ('SelfAttention.o', 'EncDecAttention.o', 'DenseReluDense.wo')}
    )
    return pipe


def bart_snippet(world_size: int):
    from transformers.models.bart.modeling_bart import BartEncoderLayer, BartDecoderLayer

    pipe = Text2TextPipe(tiny_bart())
    # DeepSpeedExamples inference/huggingface/text2text-generation/test-bart.py, verbatim:
    pipe.model = deepspeed.init_inference(
        pipe.model,
        mp_size=world_size,
        dtype=torch.float,
        injection_policy={
            BartEncoderLayer: ('.fc2', 'self_attn.out_proj'),
            BartDecoderLayer: ('encoder_attn.out_proj', '.fc2', 'self_attn.out_proj')
        }
    )
    return pipe


def text2text_result(pipe) -> dict:
    return {"ids": [pipe(prompt) for prompt in PROMPTS], "lm_head": type(pipe.model.module.lm_head).__name__}


if __name__ == "__main__":
    local_rank = int(os.getenv("LOCAL_RANK", "0"))
    world_size = int(os.getenv("WORLD_SIZE", "1"))
    if sys.argv[1] in ("t5", "bart"):
        outputs = text2text_result({"t5": t5_snippet, "bart": bart_snippet}[sys.argv[1]](world_size))
    else:
        if sys.argv[1] == "checkpoint":
            generator = checkpoint_snippet(world_size, sys.argv[2], sys.argv[3])
        else:
            generator = pipeline_snippet(world_size, sys.argv[1])
        outputs = {"ids": generated_ids(generator), "lm_head": type(generator.model.module.lm_head).__name__}
    rank = int(os.environ["RANK"])
    result = {"rank": rank, "local_rank": local_rank, "world": world_size, **outputs}
    with open(os.path.join(os.environ["SNIPPET_OUT"], f"{rank}.json"), "w") as f:
        json.dump(result, f)
