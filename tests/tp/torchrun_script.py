"""Run under torchrun by the tests: shard a tiny llama with splice's tensor_parallel step (the group comes from
torchrun's environment), check parity, then rank 1 raises while rank 0 enters a collective."""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
torch.set_num_threads(1)

from tests.tp.workers import raise_after_parity  # noqa: E402

if __name__ == "__main__":
    raise_after_parity(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
