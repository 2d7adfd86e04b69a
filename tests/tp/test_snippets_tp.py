"""DeepSpeed's multi-process inference snippet (``tests/tp/snippet_script.py``, ``import splice as deepspeed``,
``mp_size=world_size``) under torchrun: two processes on one node, and two single-process nodes joined by a c10d
rendezvous as multi-node users launch it (``torchrun --nnodes 2 --node-rank i``, both on this machine). Every rank
gets the unmodified single-process pipeline's greedy tokens."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import pipeline

from tests.snippet_models import byte_tokenizer, generated_ids, snippet_llama
from tests.tp.launch import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
SCRIPT = Path(__file__).with_name("snippet_script.py")
ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


@pytest.fixture(scope="module")
def reference_ids():
    return generated_ids(pipeline("text-generation", model=snippet_llama(), tokenizer=byte_tokenizer()))


def snippet_results(outputs: list[str]) -> list[dict]:
    rows = [json.loads(line[len("SNIPPET "):]) for out in outputs for line in out.splitlines()
            if line.startswith("SNIPPET ")]
    return sorted(rows, key=lambda row: row["rank"])


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("mode", ["inject", "plain"])
def test_one_node_two_processes(mode, reference_ids):
    done = subprocess.run([*TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()), str(SCRIPT), mode],
                          capture_output=True, text=True, timeout=240, env=env())
    assert done.returncode == 0, done.stderr[-3000:]
    results = snippet_results([done.stdout])
    assert [(r["rank"], r["local_rank"], r["world"]) for r in results] == [(0, 0, 2), (1, 1, 2)]
    assert all(r["lm_head"] != "Linear" for r in results)  # sharded: the head is vocab-parallel
    assert all(r["ids"] == reference_ids for r in results)


def test_two_nodes_c10d_rendezvous(reference_ids):
    endpoint = f"127.0.0.1:{free_port()}"
    launchers = [subprocess.Popen([*TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                                   "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "splice-snippet",
                                   "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", "127.0.0.1",
                                   str(SCRIPT), "inject"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
                 for node in (0, 1)]
    try:
        outputs = [launcher.communicate(timeout=240) for launcher in launchers]
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
    assert all(launcher.returncode == 0 for launcher in launchers), [err[-3000:] for _, err in outputs]
    results = snippet_results([out for out, _ in outputs])
    assert [(r["rank"], r["local_rank"], r["world"]) for r in results] == [(0, 0, 2), (1, 0, 2)]
    assert all(r["ids"] == reference_ids for r in results)
