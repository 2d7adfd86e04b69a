"""DeepSpeed's multi-GPU inference snippet, run by torchrun with ``import splice as deepspeed`` (on CPU, so the
pipeline gets no ``device=local_rank``); prints each rank's greedy tokens as ``SNIPPET {json}``.
``argv[1]``: "inject" or "plain" (replace_with_kernel_inject)."""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
torch.set_num_threads(1)

from transformers import pipeline  # noqa: E402

import splice as deepspeed  # noqa: E402
from tests.snippet_models import byte_tokenizer, generated_ids, snippet_llama  # noqa: E402

if __name__ == "__main__":
    local_rank = int(os.getenv("LOCAL_RANK", "0"))
    world_size = int(os.getenv("WORLD_SIZE", "1"))
    generator = pipeline("text-generation", model=snippet_llama(), tokenizer=byte_tokenizer())
    generator.model = deepspeed.init_inference(generator.model, mp_size=world_size, dtype=torch.float,
                                               replace_with_kernel_inject=sys.argv[1] == "inject")
    shards = type(generator.model.module.lm_head).__name__
    print("SNIPPET " + json.dumps({"rank": int(os.environ["RANK"]), "local_rank": local_rank, "world": world_size,
                                   "ids": generated_ids(generator), "lm_head": shards}), flush=True)
