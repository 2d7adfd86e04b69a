"""Command line: ``splice generate | serve | info | bench``."""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging.config
import math
import os
import re
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from .cli_options import DEFAULT_MODEL, QUANT_SCHEMES, add_bench_parser, launched_rank

if TYPE_CHECKING:
    import torch

# What a command needs to run (torch, the engine, transformers) is imported inside the function that runs it, so that
# building the parser (--help, a bad option) loads as little as possible.


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse(parser, argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        with one_line_warnings():
            return args.run(args) or 0
    except KeyboardInterrupt:  # Ctrl-C: the user stopped it, no traceback (serve handles its own signals)
        if launched_rank() == 0:  # torchrun passes Ctrl-C to every rank: the job says it once
            print("splice: interrupted", file=sys.stderr, flush=True)
        return 130  # as a shell reports a process ended by SIGINT
    except BrokenPipeError:  # the reader of stdout went away (`splice generate ... | head`): end quietly, as cat does
        silence_stdout()
        return 141  # as a shell reports a process ended by SIGPIPE
    except (ValueError, TypeError, NotImplementedError) as error:  # bad input, named by the check that refused it
        if debugging():
            raise
        if not said_by_rank_zero(error):
            print(f"splice: error: {rank_prefix()}{error_message(str(error), args)}", file=sys.stderr, flush=True)
        return 2
    except Exception as error:  # anything else (the environment, a bug): one line; SPLICE_DEBUG=1 shows the traceback
        if debugging():
            raise
        message = error_message(" ".join(f"{type(error).__name__}: {error}".split()), args)  # on one line
        print(f"splice: error: {rank_prefix()}{message} (SPLICE_DEBUG=1 shows where)", file=sys.stderr, flush=True)
        return 1


def silence_stdout() -> None:
    """Points stdout at the null device: the interpreter flushes stdout as it exits, which on the closed pipe would
    fail again and print its own error."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # a stdout with no file descriptor (replaced in-process) has none
        pass


def rank_prefix() -> str:
    """``rank N: `` on the ranks other than 0 under torchrun, whose errors interleave with rank 0's."""
    rank = launched_rank()
    return f"rank {rank}: " if rank else ""


def said_by_rank_zero(error: BaseException) -> bool:
    """A launch error (too few processes, a world tp_size does not divide) is the same on every rank: rank 0 prints
    it for the job, the others only exit non-zero."""
    from .distributed import LaunchError

    return isinstance(error, LaunchError) and launched_rank() != 0


@contextlib.contextmanager
def one_line_warnings() -> Iterator[None]:
    """Warnings as ``splice: warning: ...`` lines on stderr, like the errors (Python's own format adds the file, line
    and source line of the call that warned, which reads as part of a traceback); SPLICE_DEBUG=1 keeps that format."""
    with warnings.catch_warnings():
        if not debugging():
            warnings.showwarning = _show_warning
        yield


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"splice: warning: {' '.join(str(message).split())}", file=file or sys.stderr, flush=True)


def debugging() -> bool:
    """``SPLICE_DEBUG=1``: errors propagate with their traceback instead of ending in one line."""
    return os.environ.get("SPLICE_DEBUG", "") not in ("", "0")


def error_message(message: str, args: argparse.Namespace) -> str:
    """``message`` with long command-line words (a prompt taken for a model name, say) not echoed in full."""
    for word in getattr(args, "words", []):
        message = message.replace(word, shorten(word, 80)) if len(word) > 80 else message
    return message


class Parser(argparse.ArgumentParser):
    """argparse with errors as ``splice: error: ...`` (as the commands' own errors), long values shortened."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(2, f"splice: error: {shorten(message)}\n")


def shorten(text: str, limit: int = 300) -> str:
    """``text`` cut to ``limit`` characters (a long prompt in an error message would bury the message)."""
    return text if len(text) <= limit else f"{text[:limit - 30]}... ({len(text)} characters)"


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv``; ``generate``'s positionals may come on either side of options (``MODEL --dtype bf16 PROMPT``),
    which argparse alone leaves unrecognized."""
    args, extra = parser.parse_known_args(argv)
    if hasattr(args, "words"):
        args.words += [word for word in extra if not word.startswith("-")]
        extra = [word for word in extra if word.startswith("-")]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="splice", description="Fast inference for PyTorch / Hugging Face models.")
    commands = parser.add_subparsers(title="commands")
    add_generate_parser(commands)
    add_serve_parser(commands)
    add_info_parser(commands)
    add_bench_parser(commands)
    return parser


# --- options shared by the commands ---------------------------------------------------------------------------------
def checked(kind: Callable[[str], Any], allowed: Callable[[Any], bool], description: str) -> Callable[[str], Any]:
    """An argparse ``type`` that parses with ``kind`` and refuses values ``allowed`` rejects (NaN always)."""
    def parse_value(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{shorten(text, 40)!r} is not allowed; allowed: {description}") from None
        if (isinstance(value, float) and not math.isfinite(value)) or not allowed(value):
            raise argparse.ArgumentTypeError(f"{shorten(text, 40)} is not allowed; allowed: {description}")
        return value

    return parse_value


POSITIVE_INT = checked(int, lambda v: v >= 1, "an integer >= 1")
#: What torch.manual_seed takes (the server's ``seed`` has the same range).
SEED = checked(int, lambda v: -2**63 <= v < 2**64, "an integer in [-2**63, 2**64)")


def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help=f"built-in name, Hugging Face checkpoint folder or .gguf file "
                                         f"(default: {DEFAULT_MODEL})")
    parser.add_argument("--config", dest="config_file", help="a JSON file of init_inference options")
    parser.add_argument("--dtype", help="fp32 | bf16 | fp16 | int8 (default: the model's own)")
    parser.add_argument("--kernel-inject", action="store_true", help="replace_with_kernel_inject=True")
    parser.add_argument("--quant", choices=tuple(QUANT_SCHEMES),
                        help="quantize: int8 (= --dtype int8; beside a float --dtype, int8 weights with activations "
                             "in it), w8a8, int4 (g32 asymmetric), int4-sym (g32 symmetric), int4-g128 (as splice "
                             "bench --quant; other schemes through --config)")
    parser.add_argument("--compile", action="store_true",
                        help="compile_decode=True: torch.compile the decode step (needs --kernel-inject)")
    parser.add_argument("--tp", type=POSITIVE_INT, help="tensor_parallel.tp_size (run under torchrun)")
    parser.add_argument("--max-out-tokens", type=POSITIVE_INT,
                        help="max_out_tokens: the longest prompt + continuation (default: the model's context "
                             "length, max_position_embeddings)")
    parser.add_argument("--device", help="cpu | cuda | cuda:N (default: CUDA if present, else CPU)")


def config_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The init_inference keyword arguments the command-line options ask for (unset options are left out)."""
    options = {
        "dtype": args.dtype,
        "replace_with_kernel_inject": True if args.kernel_inject else None,
        "compile_decode": True if getattr(args, "compile", False) else None,
        "tensor_parallel": {"tp_size": args.tp} if args.tp is not None else None,
        "max_out_tokens": args.max_out_tokens,
        "device": args.device,
    }
    options = {key: value for key, value in options.items() if value is not None}
    for key, value in quant_scheme(args).items():
        if options.get(key, value) != value:
            raise ValueError(f"--quant {args.quant} sets {key}={value!r}, but --{key} {options[key]!r} was given; "
                             f"drop one of them")
        options[key] = value
    return options


#: --quant int8 beside a float --dtype: int8 weights, activations in that dtype (dtype=int8 picks bf16 on a CPU)
INT8_BESIDE_FLOAT = {"quant": {"enabled": True, "weight": {"num_bits": 8}}}


def quant_scheme(args: argparse.Namespace) -> dict[str, Any]:
    """The init_inference keys ``--quant`` sets: its scheme, where int8 (``dtype=int8``) beside a float ``--dtype``
    keeps that dtype for the activations instead."""
    scheme = QUANT_SCHEMES.get(getattr(args, "quant", None), {})
    if scheme.get("dtype") == "int8" and args.dtype not in (None, "int8"):
        return INT8_BESIDE_FLOAT
    return scheme


def flags_by_key(args: argparse.Namespace) -> dict[str, str]:
    """The init_inference keys the command line's options set, each with the option as it was given."""
    flags = {
        "dtype": args.dtype and f"--dtype {args.dtype}",
        "replace_with_kernel_inject": args.kernel_inject and "--kernel-inject",
        "compile_decode": getattr(args, "compile", False) and "--compile",
        "tensor_parallel": args.tp is not None and f"--tp {args.tp}",
        "max_out_tokens": args.max_out_tokens is not None and f"--max-out-tokens {args.max_out_tokens}",
        "device": args.device and f"--device {args.device}",
    }
    for key in quant_scheme(args):
        flags[key] = flags[key] or f"--quant {args.quant}"
    return {key: flag for key, flag in flags.items() if flag}


#: What each engine option takes, for messages that refuse a value given as a flag.
FLAG_VALUES = {
    "--dtype": "fp32, bf16, fp16 or int8",
    "--quant": ", ".join(QUANT_SCHEMES),
    "--tp": "an integer >= 1",
    "--max-out-tokens": "an integer >= 1",
    "--device": "cpu, cuda or cuda:N",
}

#: init_inference's refusal of a key the config file and a flag both set, to be reworded in the flag's terms.
GIVEN_TWICE = re.compile(r"config key '(?P<key>[\w.]+)' is given twice with different values: (?P<file>.*) in config "
                         r"and (?P<flag>.*) in keyword arguments")


def in_flag_terms(message: str, args: argparse.Namespace) -> str:
    """``message`` (init_inference's or generate's) with the settings the command line made named by their flags."""
    twice = GIVEN_TWICE.fullmatch(message)
    flag = twice and flags_by_key(args).get(twice["key"])
    if flag:
        name = flag.split()[0]
        takes = f" ({name} takes {FLAG_VALUES[name]})" if name in FLAG_VALUES else ""
        return (f"{flag} on the command line contradicts {twice['key']}={twice['file']} in --config "
                f"{args.config_file}; allowed: one of them, or the same value in both{takes}")
    too_long = "(raise max_out_tokens in the config, or shorten the request)"
    if too_long not in message:
        return message
    raise_it = ("--max-out-tokens" if "max_out_tokens" not in config_file_keys(args)
                else f"max_out_tokens in --config {args.config_file}")
    return (message.replace("prompt length + max_new_tokens <=", "prompt length + --max-new-tokens <=")
            .replace(too_long, f"(raise {raise_it}, lower --max-new-tokens or shorten the prompt)"))


def config_file_keys(args: argparse.Namespace) -> set[str]:
    """The init_inference keys the --config file sets (read again quietly: its warnings were given already)."""
    if args.config_file is None:
        return set()
    from .config import resolve_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return set(resolve_config(args.config_file).model_fields_set)


@contextlib.contextmanager
def flag_terms(args: argparse.Namespace) -> Iterator[None]:
    """A ValueError raised inside comes out with the settings the command line made named by their flags."""
    try:
        yield
    except ValueError as error:
        message = in_flag_terms(str(error), args)
        if message == str(error):
            raise
        raise ValueError(message) from None


def cli_config(args: argparse.Namespace):
    """The engine configuration of the --config file and the flags, checked before any model loads; a conflict
    between them, or between flags, is named by the flags."""
    from .config import resolve_config

    with flag_terms(args):
        config = resolve_config(args.config_file, **config_from_args(args))
    if getattr(args, "compile", False) and not config.replace_with_kernel_inject:
        raise ValueError("--compile compiles splice's own decode step, which needs kernel injection; allowed: "
                         "--compile with --kernel-inject, or no --compile")
    return config


def build_engine(args: argparse.Namespace):
    import splice

    from . import native
    from .distributed import check_launch, user_group
    from .plan import check_graphs, resolve_device

    config = cli_config(args)  # checked before the model loads
    device = resolve_device(config)
    check_graphs(config, device, config.tensor_parallel.tp_size)  # the checks that need no model
    if user_group(config.tensor_parallel) is None:
        check_launch(config.tensor_parallel.tp_size, f"-m splice.cli {args.run.__name__.removeprefix('run_')} ...")
    if runs_native_kernels(config, device):
        native.available()  # build (once per machine) and load the native kernels before anything is timed
    model, tokenizer = splice.load(args.model or DEFAULT_MODEL)
    length = context_length(model, bool(config.replace_with_kernel_inject))
    if "max_out_tokens" not in config.model_fields_set and length:
        config = config.model_copy(update={"max_out_tokens": length})
    else:
        warn_past_the_context(args, config.max_out_tokens, context_length(model, kernel_inject=False))
    return splice.init_inference(model, config=config), tokenizer


def warn_past_the_context(args: argparse.Namespace, max_out_tokens: int, length: int | None) -> None:
    """A max_out_tokens beyond the model's context is allowed (a rope that extends, a deliberate experiment), but
    said: the positions past it are ones the model never saw, and each sequence's KV cache is sized for all of
    them."""
    if length is None or max_out_tokens <= length:
        return
    given = (f"--max-out-tokens {max_out_tokens}" if args.max_out_tokens is not None
             else f"max_out_tokens={max_out_tokens} in --config {args.config_file}")
    warnings.warn(f"{given} exceeds the model's context length of {length} positions (max_position_embeddings): "
                  f"positions past it are ones the model was not trained on, and each sequence's KV cache is sized "
                  f"for all {max_out_tokens}; allowed: at most {length} (leaving max_out_tokens out gives the model's "
                  "context length)")


def runs_native_kernels(config, device) -> bool:
    """Whether the engine ``config`` asks for runs splice's native kernels: on the CPU, those of a kernel-injected
    model and of quantized linears. A model left as it is runs its own layers on torch's kernels, so a plain run
    neither builds them nor needs a C++ compiler."""
    from .quant import QuantConfig

    return device.type == "cpu" and bool(config.replace_with_kernel_inject
                                         or QuantConfig.from_inference_config(config) is not None)


def context_length(model, kernel_inject: bool) -> int | None:
    """The model's context length (``max_position_embeddings``); with kernel injection at most what its rope type
    reaches with a fixed table."""
    config = getattr(model, "config", None)
    length = getattr(config, "max_position_embeddings", None)
    if not isinstance(length, int) or length < 1:
        return None
    if kernel_inject:
        from .arch.record import rope_spec

        length = min(length, rope_spec(config).max_positions)
    return length


# --- splice generate ------------------------------------------------------------------------------------------------
def add_generate_parser(commands) -> None:
    parser = commands.add_parser("generate", help="stream a continuation of PROMPT",
                                 description="Stream a continuation of PROMPT, then print prefill time and decode "
                                             "speed.")
    parser.add_argument("words", nargs="*", metavar="[MODEL] PROMPT",
                        help="the model (as --model) and the text to continue; an empty PROMPT starts from the "
                             "model's BOS token, as transformers' text-generation pipeline does")
    parser.add_argument("--prompt-file", help="read PROMPT from this UTF-8 text file ('-': standard input)")
    add_model_options(parser)
    parser.add_argument("--max-new-tokens", type=POSITIVE_INT, default=32, help="tokens to generate (default: 32)")
    parser.add_argument("--chat", action="store_true", help="wrap PROMPT in the model's chat template")
    parser.add_argument("--greedy", action="store_true", help="always take the most likely token (the default)")
    parser.add_argument("--temperature", type=checked(float, lambda v: v >= 0, "a number >= 0"),
                        help="sample with this temperature; 0 means greedy (default: greedy)")
    parser.add_argument("--top-k", type=checked(int, lambda v: v >= 1, "an integer >= 1"),
                        help="sample from the K most likely tokens")
    parser.add_argument("--top-p", type=checked(float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
                        help="sample from the smallest set of tokens with probability >= P, 0 < P <= 1")
    parser.add_argument("--repetition-penalty", type=checked(float, lambda v: v > 0, "a number > 0"),
                        help="divide the scores of tokens already present by this (1: off)")
    parser.add_argument("--seed", type=SEED, help="random seed for sampling (default: 0); greedy decoding draws "
                                                  "nothing at random, so a seed with it warns")
    parser.set_defaults(run=run_generate)


def sampling_options(args: argparse.Namespace) -> dict[str, Any]:
    """``do_sample`` and the sampling values: greedy unless a temperature > 0, top-k or top-p asks to sample;
    ``--greedy`` or ``--temperature 0`` with a sampling option is a contradiction and raises."""
    chosen = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    chosen = {key: value for key, value in chosen.items() if value is not None}
    penalty = {} if args.repetition_penalty is None else {"repetition_penalty": args.repetition_penalty}
    greedy = "--greedy" if args.greedy else "--temperature 0" if args.temperature == 0 else None
    if greedy is None:
        return {"do_sample": bool(chosen), **chosen, **penalty}
    conflicting = [f"--{key.replace('_', '-')} {value}" for key, value in chosen.items() if key != "temperature"
                   or (args.greedy and value != 0)]
    if conflicting:
        raise ValueError(f"{greedy} asks for greedy decoding, which {', '.join(conflicting)} does not apply to; "
                         f"allowed: one of them (a temperature > 0 to sample)")
    return {"do_sample": False, **penalty}


def warn_unused_seed(args: argparse.Namespace, sampling: bool) -> None:
    """A --seed given for greedy decoding changes nothing: said, not silently dropped."""
    if args.seed is not None and not sampling:
        warnings.warn(f"--seed {args.seed} has no effect: decoding is greedy, which draws nothing at random; allowed: "
                      "--seed with --temperature > 0, --top-k or --top-p, or no --seed")


def prompt_and_model(args: argparse.Namespace) -> tuple[str, str]:
    """``[MODEL] PROMPT`` (or ``[MODEL]`` with ``--prompt-file``) and ``--model``: the prompt and the model name."""
    words = list(args.words)
    most = 1 if args.prompt_file is not None else 2
    if len(words) > most or (most == 2 and not words):
        usage = "[MODEL] with --prompt-file" if most == 1 else "[MODEL] PROMPT"
        raise ValueError(f"expected {usage}, got {len(words)} positional argument(s); allowed: {usage} (quote a "
                         "prompt that has spaces)")
    if args.prompt_file is not None and words and not names_a_model(words[0]):
        raise ValueError(f"{shorten(words[0], 80)!r} is not a model (no such built-in name, folder or .gguf file), "
                         f"and a PROMPT cannot be given as well as --prompt-file {args.prompt_file}; allowed: [MODEL] "
                         "--prompt-file FILE, or [MODEL] PROMPT")
    prompt = read_prompt_file(args.prompt_file) if args.prompt_file is not None else words.pop()
    model = words[0] if words else None
    if model is not None and args.model is not None and model != args.model:
        raise ValueError(f"the model is given twice, {shorten(model, 80)!r} and --model {shorten(args.model, 80)!r}; "
                         "allowed: one of them")
    check_utf8(prompt, "PROMPT")
    return prompt, model or args.model or DEFAULT_MODEL


def names_a_model(word: str) -> bool:
    """Whether ``word`` can name a model: a built-in name, or a path that exists (a folder or a .gguf file)."""
    from .models import BUILTIN_MODELS

    try:
        return word in BUILTIN_MODELS or Path(word).expanduser().exists()
    except (OSError, ValueError):  # a name that cannot be a path here (too long, a NUL byte)
        return False


def read_prompt_file(path: str) -> str:
    data = sys.stdin.buffer.read() if path == "-" else _read_bytes(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"--prompt-file {path}: byte {data[error.start]:#04x} at offset {error.start} is not UTF-8; "
                         "allowed: UTF-8 text") from None


def _read_bytes(path: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as error:
        raise ValueError(f"--prompt-file {path}: cannot read it ({error.strerror}); allowed: a readable text file"
                         ) from None


def check_utf8(text: str, what: str) -> None:
    """Command-line text that was not UTF-8 arrives with its bytes as lone surrogates (Python's surrogateescape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{what} is not UTF-8 text (character {error.start} is not); allowed: UTF-8 text") from None


def encode_prompt(tokenizer, prompt: str, chat: bool) -> dict[str, torch.Tensor]:
    if not chat:
        return dict(tokenizer(prompt, return_tensors="pt"))
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
    return dict(encoded)


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from .generation import check_request
    from .streaming import TimingStreamer

    prompt, args.model = prompt_and_model(args)
    options = {"max_new_tokens": args.max_new_tokens, **sampling_options(args)}
    warn_unused_seed(args, options["do_sample"])
    engine, tokenizer = build_engine(args)
    inputs = encode_prompt(tokenizer, prompt, args.chat)
    if inputs["input_ids"].shape[-1] == 0:
        inputs = {}  # an empty prompt: generate starts from the model's BOS token
        if engine.module.generation_config.bos_token_id is None:
            raise ValueError("PROMPT is empty and the model has no BOS token to start from; allowed: a prompt of at "
                             "least one token")
    options["pad_token_id"] = tokenizer.pad_token_id
    with flag_terms(args):
        check_request(engine.module, (), {**inputs, **options}, engine.vocab_size,
                      engine.inference_config.max_out_tokens)
    torch.manual_seed(0 if args.seed is None else args.seed)
    speaker = _global_rank() == 0  # under torchrun every rank generates; one prints
    streamer = TimingStreamer(tokenizer, skip_special_tokens=True) if speaker else None
    try:
        if speaker and not args.chat:
            print(prompt, end="", flush=True)
        if streamer is not None:
            streamer.start()
        engine.generate(**inputs, **options, streamer=streamer)
    except BaseException:
        if speaker:
            print(flush=True)  # end the streamed line: the error gets a line of its own
        raise
    if streamer is not None:
        print()
        graphs = args.compile and engine.runtime is not None and engine.runtime.graphs_compiled
        print(streamer.summary() + (" (decode includes compiling the decode step, done on its first call)" if graphs
                                    else ""))
    return 0


def _global_rank() -> int:
    import torch

    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


#: Options that change nothing in a tensor-parallel plan, refused by ``info --tp N`` outside torchrun.
NOT_IN_A_TP_PLAN = ("dtype", "quant", "compile", "max_out_tokens", "device")
#: The init_inference keys that change nothing in a tensor-parallel plan, refused in the --config file of
#: ``info --tp N`` outside torchrun (the plan reads tensor_parallel, replace_with_kernel_inject, injection_policy and
#: the checkpoint keys; the keys splice ignores warn wherever they are given).
KEYS_NOT_IN_A_TP_PLAN = ("dtype", "quant", "compile_decode", "max_out_tokens", "device", "enable_cuda_graph",
                         "keep_module_on_host")
#: The options ``info --machine`` has no use for: it loads no model.
MODEL_OPTIONS = ("model", "config_file", "dtype", "kernel_inject", "quant", "compile", "tp", "max_out_tokens",
                 "device")


def print_tp_plan(args: argparse.Namespace, config) -> int:
    """Outside torchrun, ``info --tp N`` shows the tensor-parallel plan ``init_inference`` would apply at N ranks,
    picked as it picks it (a tensor-parallel checkpoint's manifest, the config's injection_policy, the family record
    with kernel injection, else AutoTP), without sharding anything."""
    import splice

    from .plan import checkpoint_source, resolve_tensor_parallel, tp_manifest

    tp = config.tensor_parallel.tp_size
    checkpoint = checkpoint_source(config)
    manifest = tp_manifest(checkpoint)
    model, _ = splice.load(args.model or DEFAULT_MODEL)
    plan = resolve_tensor_parallel(config, model, tp, manifest)
    if manifest is not None:  # the stored plan keeps the source it was made from
        source = f"the manifest of the tensor-parallel checkpoint {str(checkpoint)!r}"
    else:
        source = {"policy": "the injection_policy of the config",
                  "record": f"the {model.config.model_type} family record (kernel injection)",
                  "autotp": "AutoTP (traced from the model)"}[plan.source]
    if args.json:
        print(json.dumps({"tp_size": tp, "source": source, "plan": plan.to_dict()}, indent=2))
        return 0
    print(f"tensor-parallel plan for tp_size={tp} from {source} (run under `torchrun --nproc-per-node {tp}` to "
          "apply it):")
    print(plan.describe())
    return 0


def given_options(args: argparse.Namespace, names: Sequence[str]) -> list[str]:
    """The options among ``names`` (``args`` attributes) that the command line gave, as flags."""
    return [option_flag(name) for name in names if getattr(args, name, None) not in (None, False)]


def option_flag(name: str) -> str:
    return "--config" if name == "config_file" else f"--{name.replace('_', '-')}"


def do_not(names: list[str], count: int | None = None) -> str:
    """``--a does not`` / ``--a, --b do not`` (``count``: how many options ``names`` name, if not one each)."""
    return f"{', '.join(names)} {'does' if (count or len(names)) == 1 else 'do'} not"


def refuse_outside_a_tp_plan(args: argparse.Namespace, tp: int, config=None) -> None:
    """``info --tp N`` outside torchrun prints a plan, which the options in NOT_IN_A_TP_PLAN and (once ``config``
    is read) the --config file's keys in KEYS_NOT_IN_A_TP_PLAN do not change."""
    given = given_options(args, NOT_IN_A_TP_PLAN)
    flag_keys = flags_by_key(args)
    keys = [key for key in KEYS_NOT_IN_A_TP_PLAN
            if config is not None and key in config.model_fields_set and key not in flag_keys]
    named = given + ([f"{', '.join(keys)} in --config {args.config_file}"] if keys else [])
    if named:
        raise ValueError(f"splice info --tp {tp} outside torchrun prints the tensor-parallel plan, which "
                         f"{do_not(named, len(given) + len(keys))} change; allowed with it: --model, --config, "
                         "--kernel-inject, --json, and in the --config file the keys a plan reads (tensor_parallel, "
                         "replace_with_kernel_inject, injection_policy, the checkpoint keys) (run `torchrun "
                         f"--nproc-per-node {tp} -m splice.cli info --tp {tp} ...` to apply every option)")


def refuse_model_options_for_the_machine(args: argparse.Namespace) -> None:
    """``info --machine`` loads no model: a model option given with it would change nothing."""
    given = given_options(args, MODEL_OPTIONS)
    if given:
        raise ValueError(f"splice info --machine prints the machine section without loading a model, which "
                         f"{do_not(given)} change; allowed with it: --json (leave out --machine to see the model "
                         "these options give, then the machine)")


# --- splice serve ---------------------------------------------------------------------------------------------------
def add_serve_parser(commands) -> None:
    parser = commands.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                                 usage="splice serve [MODEL] [engine options] [--host HOST] [--port PORT] "
                                       "[--max-batch N] [--max-queue N] [--max-prefills N] [--prefill-batch N] "
                                       "[--served-model-name NAME]",
                                 description="Serve MODEL over an OpenAI-compatible HTTP API (/v1/completions, "
                                             "/v1/chat/completions, /v1/models, /health, /metrics) with continuous "
                                             "batching. Under torchrun with --tp N, rank 0 serves HTTP and every rank "
                                             "steps the same batch. docs/serving.md describes it.")
    parser.add_argument("words", nargs="*", metavar="MODEL", help="the model (as --model)")
    add_model_options(parser)
    parser.set_defaults(kernel_inject=True)  # the scheduler steps the fused model's native decode runtime
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=checked(int, lambda v: 0 <= v <= 65535, "an integer in [0, 65535]"),
                        default=8000, help="port to listen on (default: 8000)")
    parser.add_argument("--max-batch", type=POSITIVE_INT, default=8,
                        help="requests stepped together in one batch (default: 8)")
    parser.add_argument("--max-queue", type=checked(int, lambda v: v >= 0, "an integer >= 0"), default=64,
                        help="requests waiting for a batch slot before new ones get HTTP 429 (default: 64)")
    parser.add_argument("--max-prefills", type=POSITIVE_INT, default=1,
                        help="waiting prompts admitted per scheduler iteration, before its decode step (default: 1; "
                             "more lets a burst in sooner, at the cost of the running requests' next tokens)")
    parser.add_argument("--prefill-batch", type=POSITIVE_INT, default=1,
                        help="of the prompts admitted together, how many are prefilled in one forward (default: 1; "
                             "cheaper in total, but none gets its first token before the group is done)")
    parser.add_argument("--served-model-name", type=served_model_name,
                        help="the name clients pass as `model` (default: MODEL as given)")
    parser.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="info",
                        help="server log level (default: info; info logs one line per request)")
    parser.epilog = "Kernel injection is always on: the scheduler steps splice's fused decode runtime."
    parser.set_defaults(run=run_serve)


def served_model_name(text: str) -> str:
    """An argparse ``type``: the name clients pass as ``model``, which an empty one could not match."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: a non-empty name (default: MODEL as "
                                         "given)")
    return text


def serve_model(args: argparse.Namespace) -> str:
    """``MODEL`` (positional) and ``--model``: the model to serve."""
    if len(args.words) > 1:
        raise ValueError(f"expected at most one MODEL, got {len(args.words)} positional arguments; allowed: "
                         "splice serve [MODEL] [options]")
    model = args.words[0] if args.words else None
    if model is not None and args.model is not None and model != args.model:
        raise ValueError(f"the model is given twice, {shorten(model, 80)!r} and --model {shorten(args.model, 80)!r}; "
                         "allowed: one of them")
    return model or args.model or DEFAULT_MODEL


def check_serve_config(config_file: str | None) -> None:
    """The scheduler steps the fused model's native decode runtime: a --config file that turns kernel injection off
    is refused by name, before the model loads."""
    if config_file is None:
        return
    from .config import resolve_config

    if resolve_config(config_file).replace_with_kernel_inject is False:
        raise ValueError(f"--config {config_file} sets replace_with_kernel_inject to false, but splice serve steps "
                         "the fused model's decode runtime, which needs kernel injection; allowed: a config that "
                         "leaves replace_with_kernel_inject out or sets it to true")


def run_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from .serve import app
        from .serve.listen import Server, bind
        from .serve.scheduler import check_prefill_batch, follow
    except ImportError as error:
        raise ValueError(f"splice serve needs the serve extra ({error.name} is missing); allowed: after "
                         "pip install 'splice[serve]'") from None
    check_prefill_batch(args.prefill_batch, args.max_prefills)  # before the model loads
    check_serve_config(args.config_file)
    args.model = serve_model(args)
    # rank 0 serves HTTP: its address and port are checked (and kept) before the model loads
    sockets = bind(args.host, args.port) if launched_rank() == 0 else []
    try:
        logging.config.dictConfig(serve_log_config(args.log_level))  # before the engine: its steps log too
        engine, tokenizer = build_engine(args)
        if _global_rank() != 0:
            return follow_rank_zero(follow, engine)
        api = app(engine, tokenizer, model_name=args.served_model_name or args.model, max_batch=args.max_batch,
                  max_queue=args.max_queue, max_prefills=args.max_prefills, prefill_batch=args.prefill_batch)
        server = Server(uvicorn.Config(api, host=args.host, port=args.port, log_level=args.log_level,
                                       log_config=None))  # configured above
        return run_server(server, sockets, api.state.service.scheduler, args)
    finally:
        for sock in sockets:
            sock.close()


def run_server(server, sockets: list, scheduler, args: argparse.Namespace) -> int:
    """Serves on ``sockets`` until a signal or a failed scheduler ends ``server``; the exit status."""
    watcher = threading.Thread(target=stop_when_failed, args=(scheduler, server), daemon=True)
    watcher.start()
    try:
        with signals_end_quietly():
            server.run(sockets=sockets)
    except SystemExit as exit_:  # uvicorn exits when it cannot start (the app's startup failed), after logging
        if exit_.code:
            print(f"splice: error: the server could not start on {args.host}:{args.port} (the reason is logged "
                  "above)", file=sys.stderr, flush=True)
            return 2
    if scheduler.failed is not None:
        print(f"splice: error: the server stopped because the scheduler failed: {scheduler.failed}", file=sys.stderr,
              flush=True)
        return 1
    return 0


@contextlib.contextmanager
def signals_end_quietly():
    """uvicorn re-raises the SIGTERM / SIGINT it shut down for once it is done, under the handlers that were in place
    before it: a drained server then exits 0 rather than dying of the signal it already honoured."""
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in handled}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def follow_rank_zero(follow: Callable, engine) -> int:
    """A rank other than 0 steps the batches rank 0 decides until it shuts down; a failure ends it non-zero."""
    try:
        follow(engine)
    except Exception as error:  # a lost rank 0 or a collective that timed out: one line, no traceback
        print(f"splice: error: rank {_global_rank()} stopped following rank 0: {error}", file=sys.stderr, flush=True)
        return 1
    return 0


def stop_when_failed(scheduler, server, period_s: float = 0.5) -> None:
    """Ends ``server`` once ``scheduler`` failed (a tensor-parallel rank died): requests cannot be served any more."""
    while scheduler.failed is None:
        time.sleep(period_s)
    server.should_exit = True


def serve_log_config(level: str) -> dict:
    """uvicorn's logging configuration with splice's loggers added (one line per request at info), on its handler."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["splice"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return config


# --- splice info ----------------------------------------------------------------------------------------------------
def add_info_parser(commands) -> None:
    parser = commands.add_parser("info", help="show what the pipeline does to a model, and what the machine gives",
                                 description="Run init_inference on the model and print what each step did, then "
                                             "the machine: CPU, instruction sets, splice's native kernels and the "
                                             "kernel each kind of linear runs. Outside torchrun, --tp N prints the "
                                             "tensor-parallel plan init_inference would apply at N ranks instead "
                                             "(AutoTP's, the family record's with --kernel-inject, or the "
                                             "config's injection_policy), sharding nothing.")
    add_model_options(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--machine", action="store_true",
                        help="print only the machine section, without loading a model (model options are refused)")
    parser.set_defaults(run=run_info)


def describe_engine(engine) -> dict[str, Any]:
    from dataclasses import asdict

    from .checkpoint import parameter_bytes
    from .steps.dtype import model_dtype

    module = engine.module
    first = next(module.parameters(), None)
    return {
        "model": type(module).__name__,
        "dtype": str(model_dtype(module)),
        "device": str(first.device) if first is not None else "none",
        "parameters": sum(p.numel() for p in module.parameters()),
        "parameter_bytes": parameter_bytes(module),
        "buffer_bytes": sum(b.numel() * b.element_size() for b in module.buffers()),
        "max_out_tokens": engine.inference_config.max_out_tokens,
        "kv_cache_bytes": kv_cache_bytes(module, engine.inference_config.max_out_tokens),
        "pipeline": [{"did": report.summary(), **asdict(report)} for report in engine.reports],
    }


def kv_cache_bytes(module, tokens: int) -> int | None:
    """Bytes the keys and values of one sequence of ``tokens`` take (layers x 2 x kv heads x head dim, in the
    model's float dtype), or None where the config does not say its attention shape."""
    import torch

    from .arch.record import head_size

    config = getattr(module, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers, heads = getattr(config, "num_hidden_layers", None), getattr(config, "num_attention_heads", None)
    if not layers or not heads:
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = head_size(config)
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    return 2 * layers * kv_heads * head_dim * tokens * dtype.itemsize


def run_info(args: argparse.Namespace) -> int:
    from .machine import describe_machine, render_machine

    if args.machine:
        refuse_model_options_for_the_machine(args)
        machine = describe_machine()
        print(json.dumps({"machine": machine}, indent=2) if args.json else render_machine(machine))
        return 0
    if "WORLD_SIZE" not in os.environ:  # not under torchrun: a tensor-parallel size > 1 prints its plan
        if args.tp is not None and args.tp > 1:
            refuse_outside_a_tp_plan(args, args.tp)  # the flags, before the config file is read
        config = cli_config(args)
        if config.tensor_parallel.tp_size > 1:
            refuse_outside_a_tp_plan(args, config.tensor_parallel.tp_size, config)
            return print_tp_plan(args, config)
    start = time.perf_counter()
    engine, _ = build_engine(args)
    info = describe_engine(engine)
    info["init_seconds"] = round(time.perf_counter() - start, 2)
    info["machine"] = describe_machine()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for step in info["pipeline"]:
        print(f"  {step['step']:<16} {step['did']}")
    for key in ("model", "dtype", "device", "parameters", "parameter_bytes", "buffer_bytes", "max_out_tokens",
                "init_seconds"):
        print(f"{key:<16} {info[key]:,}" if isinstance(info[key], int) else f"{key:<16} {info[key]}")
    kv = info["kv_cache_bytes"]
    print(f"{'kv_cache_bytes':<16} " + (f"{kv:,} per sequence at max_out_tokens ({kv / 2**20:,.0f} MiB)"
                                        if kv is not None else "unknown (the config has no attention shape)"))
    print(render_machine(info["machine"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
