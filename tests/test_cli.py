"""The command line: run as a user runs it (in a subprocess), and in this process with a tiny model for its habits."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from splice import native
from tests.conftest import run_cli

SPLICE = str(Path(sys.executable).parent / "splice")


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([SPLICE, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("command", [[], ["generate"], ["serve"], ["info"], ["bench"]])
def test_help_everywhere(command):
    result = run(*command, "--help")
    assert result.returncode == 0 and "usage: splice" in result.stdout


#: Modules a command that does not run a model has no need for: torch itself, and the generation stack.
HEAVY_MODULES = ("torch", "splice.engine", "splice.generation", "transformers.generation")
#: Runs ``splice.cli.main`` on its arguments as the ``splice`` script does, then prints (last line, JSON) which of
#: HEAVY_MODULES were imported.
IMPORTS_OF_A_COMMAND = f"""
import json, sys
from splice.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps([m for m in {HEAVY_MODULES!r} if m in sys.modules]))
"""


@pytest.mark.parametrize("command, shows, loads", [
    (["--help"], "usage: splice", []),
    (["generate", "--help"], "usage: splice generate", []),
    (["bench", "--help"], "usage: splice bench", []),
    (["serve", "--port", "70000"], "splice: error: argument --port", []),
    (["bench", "--batch", "0"], "splice: error: argument --batch", []),
    (["info", "--bogus"], "splice: error: unrecognized arguments: --bogus", []),
    (["info", "--machine"], "machine", ["torch"]),  # the machine section reports torch's threads and CPU capability
])
def test_help_and_errors_leave_out_torch_and_the_machine_the_generation_stack(command, shows, loads):
    result = subprocess.run([sys.executable, "-c", IMPORTS_OF_A_COMMAND, *command], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and shows in result.stdout + result.stderr, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == loads


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
    result = run("info", "--machine", timeout=120)
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


@pytest.mark.parametrize("options, named", [
    (["--dtype", "bf16"], "which --dtype does not change"),
    (["--model", "/nonexistent", "--quant", "int4"], "which --model, --quant do not change"),
    (["--config", "bf16.json"], "which --config does not change"),
    (["--kernel-inject", "--tp", "2", "--max-out-tokens", "64", "--device", "cpu", "--compile"],
     "which --kernel-inject, --compile, --tp, --max-out-tokens, --device do not change"),
])
def test_info_machine_refuses_the_model_options_it_has_no_use_for(capsys, monkeypatch, options, named):
    from splice import machine

    monkeypatch.setattr(machine, "describe_machine", lambda: pytest.fail("the machine was described"))
    code, out, err = run_cli(["info", "--machine", *options], capsys)
    assert code == 2 and out == "" and named in err and "allowed with it: --json" in err, err


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
    assert config_from_args(parse(["info", "--quant", "int8", "--dtype", "int8"])) == {"dtype": "int8"}
    for dtype in ("bf16", "fp32"):  # int8 weights, activations in the dtype asked for (the README's example)
        assert config_from_args(parse(["generate", "hi", "--quant", "int8", "--dtype", dtype])) == {
            "dtype": dtype, "quant": {"enabled": True, "weight": {"num_bits": 8}}}


def test_generate_int8_beside_a_float_dtype_runs_int8_weights(tiny_cli, capsys):
    """``splice generate --kernel-inject --dtype bf16 --quant int8`` (README) quantizes the weights to int8."""
    code, out, err = run_cli(["info", "--kernel-inject", "--dtype", "bf16", "--quant", "int8"], capsys)
    assert code == 0, err
    assert "int8_weight_only" in out
    code, _, err = run_cli(["generate", "Hi", "--max-new-tokens", "2", "--kernel-inject", "--dtype", "bf16",
                            "--quant", "int8"], capsys)
    assert code == 0, err


@pytest.mark.slow
def test_generate_int4_says_paris():
    result = run("generate", "The capital of France is", "--max-new-tokens", "4", "--kernel-inject", "--dtype", "bf16",
                 "--quant", "int4")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("The capital of France is Paris")


@pytest.mark.slow
@pytest.mark.skipif(not native.available(), reason="splice's native kernels are not available here")
def test_generate_compiled_on_native_kernels_says_paris_and_compiles_nothing():
    """On splice's native kernels every step is one native call, which a compiled engine runs eagerly: no graph is
    compiled, and the timings do not say one was (runtime.graphs_compiled)."""
    result = run("generate", "The capital of France is", "--max-new-tokens", "3", "--kernel-inject", "--dtype", "bf16",
                 "--compile")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("The capital of France is Paris")
    assert "decode includes compiling" not in result.stdout and "tokens/s" in result.stdout


# ---- habits: [MODEL] PROMPT, greedy, errors on their own line, the default context --------------------------------
@pytest.fixture
def tiny_cli(monkeypatch):
    """``splice.load`` answering every name with a tiny random Llama that uses SmolLM2's tokenizer (its vocabulary
    size, context 256), so CLI runs take a moment."""
    from transformers import AutoTokenizer

    import splice
    from splice.models import resolve_checkpoint

    from .conftest import build_tiny, tiny_llama_config

    tokenizer = AutoTokenizer.from_pretrained(resolve_checkpoint("smollm2-135m-instruct")[0])
    loaded = []

    def load(name):
        loaded.append(name)
        return build_tiny(tiny_llama_config(vocab_size=len(tokenizer))), tokenizer

    monkeypatch.setattr(splice, "load", load)
    return loaded


@pytest.mark.parametrize("argv, model, prompt", [
    (["generate", "hi"], "smollm2-135m-instruct", "hi"),
    (["generate", "some-model", "hi"], "some-model", "hi"),
    (["generate", "some-model", "--dtype", "bf16", "hi"], "some-model", "hi"),
    (["generate", "--model", "some-model", "hi"], "some-model", "hi"),
    (["generate", "some-model", "--model", "some-model", "hi"], "some-model", "hi"),
])
def test_the_model_can_come_first_as_a_positional(argv, model, prompt):
    from splice.cli import build_parser, parse, prompt_and_model

    assert prompt_and_model(parse(build_parser(), argv)) == (prompt, model)


@pytest.mark.parametrize("flags, expected", [
    ([], {"do_sample": False}),
    (["--greedy"], {"do_sample": False}),
    (["--temperature", "0"], {"do_sample": False}),
    (["--greedy", "--temperature", "0", "--repetition-penalty", "1.2"],
     {"do_sample": False, "repetition_penalty": 1.2}),
    (["--temperature", "0.7"], {"do_sample": True, "temperature": 0.7}),
    (["--top-p", "1"], {"do_sample": True, "top_p": 1.0}),
])
def test_greedy_is_the_default_and_temperature_0_means_greedy(flags, expected):
    from splice.cli import build_parser, parse, sampling_options

    assert sampling_options(parse(build_parser(), ["generate", *flags, "hi"])) == expected


def test_the_default_max_out_tokens_is_the_context_and_info_prints_the_kv_cache(tiny_cli, capsys):
    code, out, err = run_cli(["info", "--model", "tiny"], capsys)
    assert code == 0, err
    kv = 2 * 2 * 2 * 16 * 256 * 4  # (keys, values) x layers x kv heads x head dim x 256 positions x fp32
    assert "max_out_tokens   256\n" in out and f"kv_cache_bytes   {kv:,} per sequence at max_out_tokens" in out
    code, out, err = run_cli(["info", "--model", "tiny", "--max-out-tokens", "100", "--json"], capsys)
    assert code == 0 and json.loads(out)["kv_cache_bytes"] == kv * 100 // 256


def test_an_error_after_streamed_text_gets_its_own_line(tiny_cli, capsys, monkeypatch):
    from splice.engine import InferenceEngine

    def fail_midway(self, *args, streamer=None, **kwargs):
        streamer.put(kwargs["input_ids"])
        streamer.put(torch.tensor([42]))
        raise ValueError("a failure halfway")

    monkeypatch.setattr(InferenceEngine, "generate", fail_midway)
    code, out, err = run_cli(["generate", "Hi", "--max-new-tokens", "3"], capsys)
    assert code == 2 and out.startswith("Hi") and out.endswith("\n")
    assert err == "splice: error: a failure halfway\n"


def test_a_long_prompt_is_not_echoed_when_refused(tiny_cli, capsys):
    prompt = "word " * 400
    code, out, err = run_cli(["generate", prompt, "--max-out-tokens", "64"], capsys)
    assert code == 2 and out == "" and "word word" not in err
    assert re.fullmatch(r"splice: error: prompt length \d+ \+ 32 new tokens = \d+ exceeds max_out_tokens=64; .*\n", err)


def test_a_long_prompt_taken_for_a_model_is_not_echoed(capsys):
    prompt = "word " * 400
    code, out, err = run_cli(["generate", prompt, "hi"], capsys)
    assert code == 2 and out == "" and len(err) < 400 and "unknown model 'word word" in err and "(2000 characters)" in err


def test_an_empty_prompt_starts_from_bos(tiny_cli, capsys):
    code, out, err = run_cli(["generate", "", "--max-new-tokens", "3", "--kernel-inject"], capsys)
    assert code == 0, err
    assert "3 new tokens]" in out


def generate_events(flags: list[str], capsys, monkeypatch) -> list[str]:
    """What ``splice generate FLAGS`` did, in order: "kernels" for each question to splice's native kernels (the first
    builds or loads them; here they answer not available), "clock" when the timing started."""
    from splice import native
    from splice.streaming import StepClock

    events = []
    monkeypatch.setattr(native, "available", lambda: events.append("kernels") or False)
    start = StepClock.start
    monkeypatch.setattr(StepClock, "start", lambda self: events.append("clock") or start(self))
    code, _, err = run_cli(["generate", "Hi", "--max-new-tokens", "2", *flags], capsys)
    assert code == 0, err
    return events


@pytest.mark.parametrize("flags", [["--kernel-inject"], ["--quant", "int8"], ["--dtype", "int8"]])
def test_the_native_kernels_are_ready_before_the_clock_starts(tiny_cli, capsys, monkeypatch, flags):
    """A first build (or load) of the native kernels must not count in the prefill time or decode speed."""
    events = generate_events(flags, capsys, monkeypatch)
    assert events[0] == "kernels" and "clock" in events


@pytest.mark.parametrize("flags", [[], ["--dtype", "bf16"]])
def test_a_run_without_kernel_injection_or_quantization_never_builds_the_native_kernels(tiny_cli, capsys, monkeypatch,
                                                                                       flags):
    """The model's own layers run on torch's kernels: neither the CLI nor init_inference asks for splice's native
    kernels, so a plain run needs no C++ compiler and waits for no build."""
    events = generate_events(flags, capsys, monkeypatch)
    assert "kernels" not in events and "clock" in events


# ---- splice serve: its options and wiring (the server itself: tests/serve/test_server.py) -------------------------
@pytest.fixture(autouse=True)
def splice_logging_restored():
    """``splice serve`` points the splice logger at the stderr of its moment (here, a capture that is closed once the
    test ends); later tests log through the logger as it was."""
    import logging

    logger = logging.getLogger("splice")
    state = (list(logger.handlers), logger.level, logger.propagate, logger.disabled)
    yield
    logger.handlers[:] = state[0]
    logger.level, logger.propagate, logger.disabled = state[1:]


def test_serve_builds_an_injected_engine_and_serves_it(tiny_cli, capsys, monkeypatch):
    import uvicorn

    from tests.tp.launch import free_port

    served = {}
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: served.update(config=self.config,
                                                                                        sockets=sockets))
    port = free_port()
    code, _, err = run_cli(["serve", "some-model", "--port", str(port), "--max-batch", "3", "--max-queue", "5",
                            "--max-prefills", "2", "--prefill-batch", "2", "--served-model-name", "mine"], capsys)
    assert code == 0, err
    assert tiny_cli == ["some-model"] and served["config"].port == port
    [sock] = served["sockets"]  # bound before the model loaded, handed to uvicorn, closed once it is done
    assert sock.fileno() == -1
    service = served["config"].app.state.service
    assert service.model_name == "mine" and service.scheduler.runtime is not None  # kernel injection is on
    assert (service.scheduler.max_batch, service.scheduler.max_queue) == (3, 5)
    assert (service.scheduler.max_prefills, service.scheduler.prefill_batch) == (2, 2)


@pytest.mark.parametrize("argv, named", [
    (["serve", "a", "b"], "at most one MODEL"),
    (["serve", "a", "--model", "b"], "given twice"),
    (["serve", "--port", "70000"], "70000"),
    (["serve", "--max-batch", "0"], "0 is not allowed"),
    (["serve", "--prefill-batch", "0"], "0 is not allowed"),
    (["serve", "--served-model-name", ""], "argument --served-model-name: '' is not allowed; allowed: a non-empty"),
    (["serve", "--served-model-name", " "], "' ' is not allowed; allowed: a non-empty name"),
])
def test_serve_bad_options_are_one_line_errors(tiny_cli, capsys, argv, named):
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and named in err and "Traceback" not in err


def test_serve_refuses_a_prefill_batch_above_max_prefills_before_loading(capsys, monkeypatch):
    from splice import cli

    monkeypatch.setattr(cli, "build_engine", lambda args: pytest.fail("the model loaded before the check"))
    code, _, err = run_cli(["serve", "--prefill-batch", "2"], capsys)
    assert code == 2 and "prefill_batch=2 (--prefill-batch) exceeds max_prefills=1" in err


@pytest.mark.parametrize("argv, named", [
    (["generate", "--compile", "hi"], "--compile compiles splice's own decode step, which needs kernel injection; "
                                      "allowed: --compile with --kernel-inject, or no --compile"),
    (["info", "--compile"], "--compile compiles splice's own decode step"),
    (["generate", "--kernel-inject", "--device", "cuda:7", "hi"], "device='cuda:7'"),
])
def test_options_that_need_no_model_are_refused_before_it_loads(capsys, monkeypatch, argv, named):
    import splice

    monkeypatch.setattr(splice, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and named in err and "Traceback" not in err


@pytest.mark.parametrize("file, flags, named", [
    ({"dtype": "bf16"}, ["--dtype", "fp32"], "--dtype fp32 on the command line contradicts dtype='bf16' in --config "),
    ({"dtype": "bf16"}, ["--quant", "int8"], "--quant int8 on the command line contradicts dtype='bf16' in --config "),
    ({"max_out_tokens": 64}, ["--max-out-tokens", "32"], "--max-out-tokens 32 on the command line contradicts "
                                                        "max_out_tokens=64"),
])
def test_a_flag_against_the_config_file_is_named_by_the_flag(tmp_path, capsys, monkeypatch, file, flags, named):
    import splice

    config = tmp_path / "config.json"
    config.write_text(json.dumps(file))
    monkeypatch.setattr(splice, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))
    code, _, err = run_cli(["generate", "--config", str(config), *flags, "hi"], capsys)
    assert code == 2 and named in err and "allowed: one of them, or the same value in both" in err, err
    assert "keyword arguments" not in err
    if "--dtype" in flags:
        assert "--dtype takes fp32, bf16, fp16 or int8" in err


def test_a_request_too_long_is_named_by_the_flags(tiny_cli, capsys, tmp_path):
    code, _, err = run_cli(["generate", "hi", "--max-out-tokens", "8", "--max-new-tokens", "20"], capsys)
    assert code == 2 and "allowed: prompt length + --max-new-tokens <= 8" in err, err
    assert "(raise --max-out-tokens, lower --max-new-tokens or shorten the prompt)" in err and "config" not in err
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"max_out_tokens": 8}))
    code, _, err = run_cli(["generate", "hi", "--config", str(config), "--max-new-tokens", "20"], capsys)
    assert code == 2 and f"(raise max_out_tokens in --config {config}, lower --max-new-tokens" in err, err


@pytest.mark.parametrize("flags, warned", [
    (["--max-out-tokens", "300"], "--max-out-tokens 300 exceeds the model's context length of 256 positions"),
    (["--max-out-tokens", "300", "--kernel-inject"], "--max-out-tokens 300 exceeds the model's context length"),
    (["--max-out-tokens", "256"], None),
    ([], None),
])
def test_max_out_tokens_past_the_context_warns(tiny_cli, capsys, flags, warned):
    code, _, err = run_cli(["generate", "hi", "--max-new-tokens", "2", *flags], capsys)
    assert code == 0, err
    assert (f"splice: warning: {warned}" in err and "allowed: at most 256" in err) if warned else "warning" not in err


@pytest.mark.parametrize("flags, warned", [
    (["--seed", "5"], True),
    (["--seed", "5", "--greedy"], True),
    (["--seed", "5", "--temperature", "0.7"], False),
    (["--seed", "5", "--top-k", "3"], False),
    ([], False),
])
def test_a_seed_with_greedy_decoding_warns(tiny_cli, capsys, flags, warned):
    code, _, err = run_cli(["generate", "hi", "--max-new-tokens", "2", *flags], capsys)
    assert code == 0, err
    assert ("splice: warning: --seed 5 has no effect: decoding is greedy" in err) == warned, err


def test_a_prompt_cannot_come_with_a_prompt_file(tmp_path, capsys, monkeypatch):
    import splice
    from splice.cli import build_parser, parse, prompt_and_model

    monkeypatch.setattr(splice, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    prompt = tmp_path / "p.txt"
    prompt.write_text("Once upon a time")
    code, _, err = run_cli(["generate", "--prompt-file", str(prompt), "Tell me a story"], capsys)
    assert code == 2 and "'Tell me a story' is not a model" in err and "unknown model" not in err, err
    assert f"a PROMPT cannot be given as well as --prompt-file {prompt}" in err
    for model in ("smollm2-135m-instruct", str(tmp_path)):  # a built-in name, a folder: the model
        args = parse(build_parser(), ["generate", "--prompt-file", str(prompt), model])
        assert prompt_and_model(args) == ("Once upon a time", model)


#: Runs ``splice info`` with its work replaced by printing more than a pipe holds.
PRINTING_COMMAND = """
import sys
from splice import cli
cli.run_info = lambda args: [print("many words " * 10) for _ in range(100000)] and 0
sys.exit(cli.main(["info"]))
"""


def test_a_closed_output_pipe_ends_quietly_with_sigpipes_status():
    process = subprocess.Popen([sys.executable, "-c", PRINTING_COMMAND], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    try:
        assert process.stdout.read(3) == b"man"
        process.stdout.close()  # as `| head -c 3` does
        err = process.stderr.read().decode()
        process.wait(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 141 and err == "", err


def test_warnings_are_one_splice_warning_line_each(capsys, monkeypatch):
    import warnings

    from splice import cli

    def warns_then_refuses(args):
        warnings.warn("the native kernels\n are not used", RuntimeWarning)
        raise ValueError("stop here")

    monkeypatch.setattr(cli, "run_info", warns_then_refuses)
    monkeypatch.delenv("SPLICE_DEBUG", raising=False)
    code, _, err = run_cli(["info"], capsys)
    assert code == 2 and err.splitlines() == ["splice: warning: the native kernels are not used",
                                              "splice: error: stop here"]
    assert warnings.showwarning is not cli._show_warning  # put back after the command


@pytest.mark.parametrize("key", ["replace_with_kernel_inject", "kernel_inject"])
def test_serve_refuses_a_config_without_kernel_injection_by_name_before_loading(tmp_path, capsys, monkeypatch, key):
    from splice import cli

    config = tmp_path / "config.json"
    config.write_text(json.dumps({key: False}))
    monkeypatch.setattr(cli, "build_engine", lambda args: pytest.fail("the model loaded before the check"))
    code, _, err = run_cli(["serve", "--config", str(config)], capsys)
    assert code == 2 and "sets replace_with_kernel_inject to false" in err and "needs kernel injection" in err
    assert "keyword arguments" not in err and "Traceback" not in err


def test_serve_exits_1_when_the_scheduler_failed(tiny_cli, capsys, monkeypatch):
    import uvicorn

    def run(self, sockets=None):
        self.config.app.state.service.scheduler.failed = RuntimeError("rank 1 is gone")

    monkeypatch.setattr(uvicorn.Server, "run", run)
    code, _, err = run_cli(["serve", "--port", "0"], capsys)
    assert code == 1 and "rank 1 is gone" in err and "Traceback" not in err


def test_serve_on_a_busy_port_is_a_one_line_error_before_the_model_loads(tiny_cli, capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, _, err = run_cli(["serve", "--port", str(port)], capsys)
    assert code == 2 and tiny_cli == [] and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert f"splice: error: the server cannot listen on 127.0.0.1:{port}: " in err and "allowed: a free port" in err


@pytest.mark.parametrize("host", ["256.1.1.1", "a" * 64])
def test_serve_on_a_host_that_does_not_resolve_is_refused_before_the_model_loads(tiny_cli, capsys, host):
    code, _, err = run_cli(["serve", "--host", host, "--port", "0"], capsys)
    assert code == 2 and tiny_cli == [] and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert f"splice: error: --host {host!r} is neither an address nor a name that resolves" in err
    assert "allowed: an address or host name of this machine" in err


# ---- interruptions and failures nobody anticipated: one line, never a traceback -----------------------------------
def test_ctrl_c_while_streaming_ends_the_line_and_exits_130(tiny_cli, capsys, monkeypatch):
    from splice.engine import InferenceEngine

    def interrupted_midway(self, *args, streamer=None, **kwargs):
        streamer.put(kwargs["input_ids"])
        streamer.put(torch.tensor([42]))
        raise KeyboardInterrupt

    monkeypatch.setattr(InferenceEngine, "generate", interrupted_midway)
    code, out, err = run_cli(["generate", "Hi", "--max-new-tokens", "3"], capsys)
    assert code == 130 and out.startswith("Hi") and out.endswith("\n")
    assert err == "splice: interrupted\n"


#: Runs ``splice info`` with its work replaced by a long sleep, announcing on stdout when it has started.
# SIGINT raises KeyboardInterrupt as it does under a terminal (a shell's background job, CI's for one, starts with
# SIGINT ignored, and Python then leaves it ignored)
SLEEPING_COMMAND = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from splice import cli
cli.run_info = lambda args: print("started", flush=True) or time.sleep(60)
sys.exit(cli.main(["info"]))
"""


def test_sigint_to_a_running_command_is_one_line_and_exit_130():
    import signal

    process = subprocess.Popen([sys.executable, "-c", SLEEPING_COMMAND], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "started\n"
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130 and err == "splice: interrupted\n", err


def test_an_unexpected_failure_is_one_line_exit_1_unless_splice_debug(capsys, monkeypatch):
    from splice import cli

    def fail(args):
        raise RuntimeError("the disk is gone\nsecond line")

    monkeypatch.setattr(cli, "run_info", fail)
    monkeypatch.delenv("SPLICE_DEBUG", raising=False)
    code, out, err = run_cli(["info"], capsys)
    assert code == 1 and out == ""
    assert err == "splice: error: RuntimeError: the disk is gone second line (SPLICE_DEBUG=1 shows where)\n"
    monkeypatch.setenv("SPLICE_DEBUG", "1")
    with pytest.raises(RuntimeError, match="the disk is gone"):
        cli.main(["info"])
    monkeypatch.setattr(cli, "run_info", lambda args: int("x"))  # bad input too: its traceback, for developers
    with pytest.raises(ValueError, match="invalid literal"):
        cli.main(["info"])


def test_a_checkpoint_that_does_not_fit_its_config_is_one_line(tmp_path, capsys):
    from .conftest import build_tiny, tiny_llama_config
    from .test_models import tiny_tokenizer

    build_tiny(tiny_llama_config()).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 2 * config["intermediate_size"]}))
    capsys.readouterr()  # saving's progress bars
    code, out, err = run_cli(["info", "--model", str(tmp_path)], capsys)
    assert code == 2 and out == "" and "Traceback" not in err and len(err.splitlines()) == 1
    assert err.startswith(f"splice: error: checkpoint {str(tmp_path)!r} does not fit its config.json")
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": "abc"}))
    code, out, err = run_cli(["info", "--model", str(tmp_path)], capsys)
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert err.startswith(f"splice: error: checkpoint {str(tmp_path)!r}: its config.json cannot be loaded")
    assert "'hidden_size'" in err and "'abc'" in err


@pytest.mark.parametrize("seed", [str(2**64), str(-2**63 - 1), "100000000000000000000000", "1.5"])
def test_a_seed_torch_cannot_take_is_refused_while_parsing(seed, capsys):
    from splice.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["generate", "hi", f"--seed={seed}"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "argument --seed" in err and "allowed: an integer in [-2**63, 2**64)" in err


def test_the_seed_takes_torchs_whole_range():
    from splice.cli import build_parser

    for seed in (2**64 - 1, -2**63, 0):
        args = build_parser().parse_args(["generate", "hi", f"--seed={seed}"])
        assert args.seed == seed
        torch.manual_seed(args.seed)


# ---- splice info --tp N outside torchrun: the plan init_inference would apply ---------------------------------------
@pytest.fixture
def outside_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_info_tp_prints_the_plan_its_options_pick(tiny_cli, capsys, outside_torchrun):
    code, out, err = run_cli(["info", "--tp", "2", "--model", "tiny", "--json"], capsys)
    assert code == 0, err
    report = json.loads(out)
    assert report["tp_size"] == 2 and report["plan"]["source"] == "autotp" and report["source"].startswith("AutoTP")
    assert report["plan"]["rules"]["model.layers.*.mlp.down_proj"]["style"] == "row"
    code, out, err = run_cli(["info", "--tp", "2", "--model", "tiny", "--kernel-inject", "--json"], capsys)
    assert code == 0, err
    report = json.loads(out)
    assert report["plan"]["source"] == "record" and report["source"] == "the llama family record (kernel injection)"
    code, out, err = run_cli(["info", "--tp", "2", "--model", "tiny", "--kernel-inject"], capsys)
    assert code == 0, err
    assert out.startswith("tensor-parallel plan for tp_size=2 from the llama family record (kernel injection)")
    assert "tensor-parallel plan (record;" in out and "model.layers.*.self_attn.o_proj  row" in out


def test_info_tp_takes_the_config_files_tp_size_and_refuses_a_bad_one(tiny_cli, capsys, outside_torchrun, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"tensor_parallel": {"tp_size": 2}, "replace_with_kernel_inject": True}))
    code, out, err = run_cli(["info", "--config", str(config), "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["plan"]["source"] == "record"
    code, out, err = run_cli(["info", "--config", str(config), "--tp", "3"], capsys)
    assert code == 2 and "tp_size" in err and tiny_cli == ["smollm2-135m-instruct"]  # refused before loading


def test_info_tp_injection_policy_comes_before_the_record(tiny_cli, capsys, outside_torchrun):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from splice.cli import build_parser, print_tp_plan
    from splice.config import resolve_config

    args = build_parser().parse_args(["info", "--tp", "2", "--kernel-inject", "--json"])
    config = resolve_config({"injection_policy": {LlamaDecoderLayer: ("self_attn.o_proj", "mlp.down_proj")}},
                            tensor_parallel={"tp_size": 2}, replace_with_kernel_inject=True)
    assert print_tp_plan(args, config) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["plan"]["source"] == "policy" and report["source"] == "the injection_policy of the config"


@pytest.mark.parametrize("option", [["--dtype", "bf16"], ["--quant", "int8"], ["--compile"], ["--device", "cpu"],
                                    ["--max-out-tokens", "64"]])
def test_info_tp_refuses_options_a_plan_does_not_use(tiny_cli, capsys, outside_torchrun, option):
    code, out, err = run_cli(["info", "--tp", "2", *option], capsys)
    assert code == 2 and out == "" and tiny_cli == []  # refused before any model loads
    assert f"which {option[0]} does not change; allowed with it: --model, --config, --kernel-inject, --json" in err


@pytest.mark.parametrize("file, flags, named", [
    ({"dtype": "bf16", "max_out_tokens": 64}, ["--tp", "2"],
     "which dtype, max_out_tokens in --config {config} do not change"),
    ({"tensor_parallel": {"tp_size": 2}, "quant": {"enabled": True}}, [], "which quant in --config {config} does not"),
    ({"tensor_parallel": {"tp_size": 2}, "keep_module_on_host": True}, ["--device", "cpu"],
     "which --device, keep_module_on_host in --config {config} do not change"),
])
def test_info_tp_refuses_config_file_keys_a_plan_does_not_use(tiny_cli, capsys, outside_torchrun, tmp_path, file,
                                                               flags, named):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(file))
    code, out, err = run_cli(["info", "--config", str(config), *flags], capsys)
    assert code == 2 and out == "" and tiny_cli == [], err
    assert named.format(config=config) in err and "the keys a plan reads (tensor_parallel" in err, err


# ---- --tp N: launch errors before the model loads, one message per torchrun job ------------------------------------
@pytest.fixture
def loading_fails(monkeypatch):
    """``splice.load`` failing loudly: a command that reaches it did not refuse its launch first."""
    import splice

    def load(name, *args, **kwargs):
        raise AssertionError(f"the model {name} was loaded before the launch was checked")

    monkeypatch.setattr(splice, "load", load)


def as_torchrun_rank(monkeypatch, rank: int, world: int) -> None:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")


def test_tp_outside_torchrun_is_refused_before_the_model_loads(loading_fails, capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    code, _, err = run_cli(["generate", "--tp", "2", "Hi"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "not started by torchrun" in err and "torchrun --nproc-per-node 2 -m splice.cli generate" in err
    assert "tp_group" not in err  # a command line cannot pass one


@pytest.mark.parametrize("rank", [0, 1])
def test_a_launch_error_under_torchrun_is_said_by_rank_zero_alone(loading_fails, capsys, monkeypatch, rank):
    as_torchrun_rank(monkeypatch, rank, world=2)
    code, _, err = run_cli(["generate", "--tp", "4", "Hi"], capsys)
    said = "splice: error: tensor_parallel.tp_size=4 is larger than the world size 2"
    assert code == 2 and (err == "" if rank else err.startswith(said) and err.count("\n") == 1), err


@pytest.mark.parametrize("rank", [0, 1])
def test_under_torchrun_an_error_names_its_rank_and_ctrl_c_is_said_once(tiny_cli, capsys, monkeypatch, rank):
    from splice.engine import InferenceEngine

    as_torchrun_rank(monkeypatch, rank, world=2)
    code, _, err = run_cli(["generate", "--temperature", "0", "--top-k", "3", "Hi"], capsys)
    assert code == 2 and err.startswith(f"splice: error: {'rank 1: ' if rank else ''}--temperature 0"), err

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(InferenceEngine, "generate", interrupted)
    code, _, err = run_cli(["generate", "Hi", "--max-new-tokens", "2"], capsys)
    assert code == 130 and err == ("" if rank else "splice: interrupted\n"), err
