"""The command line, run as a user runs it: in a subprocess."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SPLICE = str(Path(sys.executable).parent / "splice")


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([SPLICE, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("command", [[], ["generate"], ["info"]])
def test_help_everywhere(command):
    result = run(*command, "--help")
    assert result.returncode == 0 and "usage: splice" in result.stdout


@pytest.mark.slow
def test_generate_streams_paris_and_timings():
    result = run("generate", "The capital of France is", "--max-new-tokens", "6")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("The capital of France is Paris")
    assert "prefill" in result.stdout and "tokens/s" in result.stdout


@pytest.mark.slow
def test_info_reports_pipeline_as_json():
    result = run("info", "--dtype", "bf16", "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["dtype"] == "torch.bfloat16" and info["device"] == "cpu"
    assert [s["step"] for s in info["pipeline"]][0] == "dtype"
    assert info["parameter_bytes"] == info["parameters"] * 2
    assert set(info["machine"]) >= {"cpu", "native", "kernels"}


def _machine_here() -> dict:
    from splice.machine import describe_machine

    return describe_machine()


def test_info_machine_prints_cpu_and_level_without_a_model():
    result = run("info", "--machine", "--model", "no-such-model", timeout=120)
    assert result.returncode == 0, result.stderr
    here = _machine_here()
    assert result.stdout.startswith("machine\n") and here["cpu"]["model"] in result.stdout
    native = here["native"]
    assert (f"level            {native['level']} " in result.stdout if native["available"]
            else native["reason"] in result.stdout)
    assert "pipeline" not in result.stdout and "parameters" not in result.stdout


def test_info_machine_json_has_the_machine_only():
    result = run("info", "--machine", "--json", timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    here = _machine_here()
    assert list(report) == ["machine"]
    assert report["machine"]["cpu"]["model"] == here["cpu"]["model"]
    assert report["machine"]["native"]["level"] == here["native"]["level"]


def test_bad_option_is_a_clear_error():
    result = run("info", "--model", "no-such-model")
    assert result.returncode == 2
    assert "no-such-model" in result.stderr and "smollm2-135m-instruct" in result.stderr


@pytest.mark.slow
def test_info_tp_prints_the_plan_without_processes():
    result = run("info", "--tp", "2")
    assert result.returncode == 0, result.stderr
    assert "model.layers.*.self_attn.o_proj  row" in result.stdout
    assert "model.layers.*.mlp.gate_proj     column" in result.stdout


def test_compile_flag_asks_for_compile_decode():
    from splice.cli import build_parser, config_from_args

    args = build_parser().parse_args(["generate", "hi", "--kernel-inject", "--compile"])
    assert config_from_args(args) == {"replace_with_kernel_inject": True, "compile_decode": True}
    assert "compile_decode" not in config_from_args(build_parser().parse_args(["info"]))


def test_quant_flag_asks_for_the_bench_schemes():
    from splice.bench import QUANT_SCHEMES
    from splice.cli import build_parser, config_from_args

    parse = build_parser().parse_args
    assert config_from_args(parse(["generate", "hi", "--quant", "int4", "--dtype", "bf16"])) == {
        "dtype": "bf16", **QUANT_SCHEMES["int4"]}
    assert config_from_args(parse(["info", "--quant", "int8"])) == {"dtype": "int8"}
    with pytest.raises(ValueError, match="--quant int8 sets dtype='int8', but --dtype 'bf16' was given"):
        config_from_args(parse(["generate", "hi", "--quant", "int8", "--dtype", "bf16"]))


@pytest.mark.slow
def test_generate_int4_says_paris():
    result = run("generate", "The capital of France is", "--max-new-tokens", "4", "--kernel-inject", "--dtype", "bf16",
                 "--quant", "int4")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("The capital of France is Paris")
