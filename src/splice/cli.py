"""Command line: ``splice generate | info | bench``."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Sequence

import torch

from .bench import QUANT_SCHEMES, add_bench_parser
from .models import DEFAULT_MODEL


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        return args.run(args) or 0
    except (ValueError, TypeError, NotImplementedError) as error:
        print(f"splice: error: {error}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splice", description="Fast inference for PyTorch / Hugging Face models.")
    commands = parser.add_subparsers(title="commands")
    add_generate_parser(commands)
    add_info_parser(commands)
    add_bench_parser(commands)
    return parser


# --- options shared by the commands ---------------------------------------------------------------------------------
def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"built-in name, Hugging Face checkpoint folder or .gguf file (default: {DEFAULT_MODEL})")
    parser.add_argument("--config", dest="config_file", help="a JSON file of init_inference options")
    parser.add_argument("--dtype", help="fp32 | bf16 | fp16 | int8 (default: the model's own)")
    parser.add_argument("--kernel-inject", action="store_true", help="replace_with_kernel_inject=True")
    parser.add_argument("--quant", choices=tuple(QUANT_SCHEMES),
                        help="quantize: int8 (= --dtype int8), w8a8, int4 (g32 asymmetric), int4-g128 (as splice bench "
                             "--quant; other schemes through --config)")
    parser.add_argument("--compile", action="store_true",
                        help="compile_decode=True: torch.compile the decode step (needs --kernel-inject)")
    parser.add_argument("--tp", type=int, help="tensor_parallel.tp_size (run under torchrun)")
    parser.add_argument("--max-out-tokens", type=int, help="max_out_tokens: the longest prompt + continuation")
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
    for key, value in QUANT_SCHEMES.get(getattr(args, "quant", None), {}).items():
        if options.get(key, value) != value:
            raise ValueError(f"--quant {args.quant} sets {key}={value!r}, but --{key} {options[key]!r} was given; "
                             f"drop one of them")
        options[key] = value
    return options


def build_engine(args: argparse.Namespace):
    import splice

    model, tokenizer = splice.load(args.model)
    engine = splice.init_inference(model, config=args.config_file, **config_from_args(args))
    return engine, tokenizer


# --- splice generate ------------------------------------------------------------------------------------------------
def add_generate_parser(commands) -> None:
    parser = commands.add_parser("generate", help="stream a continuation of PROMPT",
                                 description="Stream a continuation of PROMPT, then print prefill time and decode speed.")
    parser.add_argument("prompt", help="the text to continue")
    add_model_options(parser)
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default: 32)")
    parser.add_argument("--chat", action="store_true", help="wrap PROMPT in the model's chat template")
    parser.add_argument("--temperature", type=float, help="sample with this temperature (default: greedy)")
    parser.add_argument("--top-k", type=int, help="sample from the K most likely tokens")
    parser.add_argument("--top-p", type=float, help="sample from the smallest set of tokens with probability >= P")
    parser.add_argument("--seed", type=int, default=0, help="random seed for sampling (default: 0)")
    parser.set_defaults(run=run_generate)


def sampling_options(args: argparse.Namespace) -> dict[str, Any]:
    chosen = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    chosen = {key: value for key, value in chosen.items() if value is not None}
    return {"do_sample": True, **chosen} if chosen else {"do_sample": False}


def encode_prompt(tokenizer, prompt: str, chat: bool) -> dict[str, torch.Tensor]:
    if not chat:
        return dict(tokenizer(prompt, return_tensors="pt"))
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
    return dict(encoded)


def run_generate(args: argparse.Namespace) -> int:
    from .streaming import TimingStreamer

    engine, tokenizer = build_engine(args)
    inputs = encode_prompt(tokenizer, args.prompt, args.chat)
    torch.manual_seed(args.seed)
    speaker = _global_rank() == 0  # under torchrun every rank generates; one prints
    streamer = TimingStreamer(tokenizer, skip_special_tokens=True) if speaker else None
    if speaker and not args.chat:
        print(args.prompt, end="", flush=True)
    if streamer is not None:
        streamer.start()
    engine.generate(**inputs, max_new_tokens=args.max_new_tokens, streamer=streamer,
                    pad_token_id=tokenizer.pad_token_id, **sampling_options(args))
    if streamer is not None:
        print()
        compiled = " (decode includes compiling the decode step, done on its first call)" if args.compile else ""
        print(streamer.summary() + compiled)
    return 0


def _global_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def print_tp_plan(args: argparse.Namespace) -> int:
    """Outside torchrun, ``info --tp N`` shows the tensor-parallel plan without sharding anything."""
    import splice
    from .plan import describe_tensor_parallel

    model, _ = splice.load(args.model)
    print(f"tensor-parallel plan for tp_size={args.tp} (run under `torchrun --nproc-per-node {args.tp}` to apply it):")
    print(describe_tensor_parallel(model, args.tp))
    return 0


# --- splice info ----------------------------------------------------------------------------------------------------
def add_info_parser(commands) -> None:
    parser = commands.add_parser("info", help="show what the pipeline does to a model, and what the machine gives",
                                 description="Run init_inference on the model and print what each step did, then "
                                             "the machine: CPU, instruction sets, splice's native kernels and the "
                                             "kernel each kind of linear runs.")
    add_model_options(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--machine", action="store_true",
                        help="print only the machine section, without loading a model (model options are ignored)")
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
        "pipeline": [{"did": report.summary(), **asdict(report)} for report in engine.reports],
    }


def run_info(args: argparse.Namespace) -> int:
    from .machine import describe_machine, render_machine

    if args.machine:
        machine = describe_machine()
        print(json.dumps({"machine": machine}, indent=2) if args.json else render_machine(machine))
        return 0
    if args.tp is not None and args.tp > 1 and "WORLD_SIZE" not in os.environ:
        return print_tp_plan(args)
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
    for key in ("model", "dtype", "device", "parameters", "parameter_bytes", "buffer_bytes", "init_seconds"):
        print(f"{key:<16} {info[key]:,}" if isinstance(info[key], int) else f"{key:<16} {info[key]}")
    print(render_machine(info["machine"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
