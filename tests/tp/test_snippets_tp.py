"""DeepSpeed's multi-process inference snippets (``tests/tp/snippet_script.py``, ``import splice as deepspeed``,
``mp_size=world_size``) under torchrun: two processes on one node (the pipeline snippet with and without injection,
and the big-model one: a meta model filled from a checkpoints JSON), and two single-process nodes joined by a c10d
rendezvous as multi-node users launch it (``torchrun --nnodes 2 --node-rank i``, both on this machine), and
DeepSpeedExamples' T5 and BART text2text snippets with their injection_policy. Every rank gets the unmodified
single-process model's greedy tokens."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import pipeline

from tests.snippet_models import (PROMPTS, Text2TextPipe, byte_tokenizer, generated_ids, snippet_llama, tiny_bart,
                                  tiny_t5)
from tests.tp.launch import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
SCRIPT = Path(__file__).with_name("snippet_script.py")
ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


@pytest.fixture(scope="module")
def reference_ids():
    return generated_ids(pipeline("text-generation", model=snippet_llama(), tokenizer=byte_tokenizer()))


def snippet_results(out: Path) -> list[dict]:
    return sorted((json.loads(path.read_text()) for path in out.glob("*.json")), key=lambda row: row["rank"])


def env(out: Path) -> dict:
    out.mkdir()
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "SNIPPET_OUT": str(out)}


def checkpoint_args(folder: Path) -> list[str]:
    """Save the snippet model as shards and write DeepSpeed's checkpoints JSON for it; the script's arguments."""
    repo_root = folder / "repo"
    snippet_llama().save_pretrained(repo_root, max_shard_size="100KB")
    checkpoints_json = folder / "checkpoints.json"
    files = sorted(p.name for p in repo_root.glob("*.safetensors"))
    checkpoints_json.write_text(json.dumps({"type": "ds_model", "checkpoints": files, "version": 1.0}))
    return [str(checkpoints_json), str(repo_root)]


@pytest.mark.parametrize("mode", ["inject", "plain", "checkpoint"])
def test_one_node_two_processes(mode, reference_ids, tmp_path):
    args = checkpoint_args(tmp_path) if mode == "checkpoint" else []
    done = subprocess.run([*TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()), str(SCRIPT), mode,
                           *args], capture_output=True, text=True, timeout=240, env=env(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-3000:]
    results = snippet_results(tmp_path / "out")
    assert [(r["rank"], r["local_rank"], r["world"]) for r in results] == [(0, 0, 2), (1, 1, 2)]
    assert all(r["lm_head"] != "Linear" for r in results)  # sharded: the head is vocab-parallel
    assert all(r["ids"] == reference_ids for r in results)


@pytest.mark.parametrize("model", ["t5", "bart"])
def test_text2text_snippets_with_their_injection_policy(model, tmp_path):
    """DeepSpeedExamples' T5 and BART snippets (their injection_policy verbatim, "SelfAttention.o", ".fc2", ...) at
    mp_size=2 give the unmodified single-process model's greedy tokens on every rank."""
    reference = [Text2TextPipe({"t5": tiny_t5, "bart": tiny_bart}[model]())(prompt) for prompt in PROMPTS]
    done = subprocess.run([*TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()), str(SCRIPT), model],
                          capture_output=True, text=True, timeout=240, env=env(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-3000:]
    results = snippet_results(tmp_path / "out")
    assert [r["rank"] for r in results] == [0, 1] and all(r["lm_head"] == "VocabParallelLinear" for r in results)
    assert all(r["ids"] == reference for r in results)


def test_two_nodes_c10d_rendezvous(reference_ids, tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    environment = env(tmp_path / "out")
    launchers = [subprocess.Popen([*TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                                   "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "splice-snippet",
                                   "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", "127.0.0.1",
                                   str(SCRIPT), "inject"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)
                 for node in (0, 1)]
    try:
        outputs = [launcher.communicate(timeout=240) for launcher in launchers]
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
    assert all(launcher.returncode == 0 for launcher in launchers), [err[-3000:] for _, err in outputs]
    results = snippet_results(tmp_path / "out")
    assert [(r["rank"], r["local_rank"], r["world"]) for r in results] == [(0, 0, 2), (1, 0, 2)]
    assert all(r["ids"] == reference_ids for r in results)
