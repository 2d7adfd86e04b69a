"""Shared fixtures: a tiny random-weight Llama (from ``tests.arch.tiny_models``, the one tiny-model factory) and the
real default model."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tests.arch.tiny_models import build_tiny, tiny_llama_config  # noqa: E402  (the one tiny-model factory)

__all__ = ["build_tiny", "tiny_llama_config"]


@pytest.fixture
def tiny_llama():
    return build_tiny(tiny_llama_config())


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (fp32) and its tokenizer, from splice's converted cache."""
    from splice.models import load

    return load("smollm2-135m-instruct")


@pytest.fixture
def fresh_compiles():
    """torch.compile starts from empty caches and leaves none behind: dynamo may hand one engine's decode step a
    graph compiled for another engine's (its inductor options, its weights' layout)."""
    import torch

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``splice argv`` in this process: (exit code, stdout, stderr)."""
    from splice.cli import main

    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def on_threads(call, count: int = 2) -> tuple[list, list]:
    """``call()`` on ``count`` threads at once: (the results, the exceptions raised), once all have ended."""
    import threading

    results, errors = [], []

    def run():
        try:
            results.append(call())
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            errors.append(error)

    threads = [threading.Thread(target=run) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, errors
