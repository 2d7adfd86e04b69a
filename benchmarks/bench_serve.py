"""Serving benchmark: ``splice serve`` under concurrent streaming clients.

Starts the server (a subprocess) and, for each concurrency level, runs that many clients, each sending
``--requests-per-client`` streaming completions one after the other (prompt ``--prompt-tokens`` ± ``--prompt-spread``
random token ids, ``--new-tokens`` new, end-of-sequence ignored). Reports per level: aggregate generated tokens/s
(all clients' tokens over the level's wall time), time to first token p50/p99, inter-token latency p50/p99, 429
answers (retried after their Retry-After) and failed requests (anything else that did not complete). Time to first
token is also split into the first wave (each client's first request: all of them arrive together) and the later
requests (which arrive one at a time, as requests end), and set against a lone request's (the p50 at 1 client; that
level is added when ``--concurrency`` lacks it).

    python benchmarks/bench_serve.py                                   # llama-1b (random weights) bf16
    python benchmarks/bench_serve.py --quant int4 --json out.json      # int4; the figures also as JSON
    python benchmarks/bench_serve.py --model smollm2-135m-instruct --dtype fp32 --concurrency 1,4 --new-tokens 8
    python benchmarks/bench_serve.py --url http://127.0.0.1:8000       # a server that is already running

The default model is the random-weight TinyLlama-shaped Llama ``splice bench --model llama-1b`` uses
(``splice.bench.llama_1b_folder``), served from a temporary folder that links its weights beside SmolLM2's tokenizer
(the server detokenizes; the prompts are token ids below the model's vocabulary). Token ids are counted exactly
(``logprobs: 0`` with ``return_tokens_as_token_ids``), so a chunk holding several tokens counts them all.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


@dataclass
class Outcome:
    """One request: when it started, its first token and each later token arrived (seconds), how it ended."""
    started: float
    first: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    rejected: int = 0  # 429 answers before it was accepted
    error: str | None = None


@dataclass
class Level:
    concurrency: int
    requests: int
    generated_tokens: int
    wall_s: float
    tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_first_wave_p50_ms: float  # each client's first request
    ttft_later_p50_ms: float  # the requests after it
    itl_p50_ms: float
    itl_p99_ms: float
    rejected_429: int
    failed: int


def parse_args(argv=None) -> argparse.Namespace:
    from splice.cli import POSITIVE_INT

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="benchmark this running server instead of starting one")
    parser.add_argument("--model", default="llama-1b",
                        help="llama-1b (random TinyLlama-shaped weights) or any MODEL splice serve takes")
    parser.add_argument("--dtype", default="bf16", help="passed to splice serve (default: bf16)")
    parser.add_argument("--quant", help="passed to splice serve: int8, w8a8, int4, int4-g128")
    parser.add_argument("--compile", action="store_true", help="passed to splice serve")
    parser.add_argument("--max-batch", type=int, default=16, help="passed to splice serve (default: 16)")
    parser.add_argument("--max-queue", type=int, default=64, help="passed to splice serve (default: 64)")
    parser.add_argument("--max-out-tokens", type=int, default=512, help="passed to splice serve (default: 512)")
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for the server (default: torch's choice)")
    parser.add_argument("--concurrency", default="1,4,8,16,64", help="comma-separated client counts")
    parser.add_argument("--requests-per-client", type=POSITIVE_INT, default=2,
                        help="requests each client sends one after the other (default: 2, so each level has a first "
                             "wave arriving together and later requests arriving as earlier ones end)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--prompt-spread", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-vocab", type=int, default=32000,
                        help="prompt token ids are drawn from [3, N) (default: 32000, llama-1b's vocabulary)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH ('-': stdout)")
    return parser.parse_args(argv)


# --- the server -----------------------------------------------------------------------------------------------------
def model_folder(name: str, scratch: Path) -> str:
    """``llama-1b``: its cached weights and SmolLM2's tokenizer side by side in ``scratch``; any other name as is."""
    if name != "llama-1b":
        return name
    from splice.bench import llama_1b_folder
    from splice.models import resolve_checkpoint

    weights, tokenizer = llama_1b_folder(), resolve_checkpoint("smollm2-135m-instruct")[0]
    folder = scratch / "llama-1b"
    folder.mkdir()
    for source in [*tokenizer.glob("tokenizer*"), *tokenizer.glob("special_tokens_map.json"), *weights.iterdir()]:
        target = folder / source.name
        if not target.exists():
            target.symlink_to(source)
    return str(folder)


def start_server(args: argparse.Namespace, scratch: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "splice.cli", "serve", model_folder(args.model, scratch), "--port", str(port),
               "--dtype", args.dtype, "--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue),
               "--max-out-tokens", str(args.max_out_tokens), "--served-model-name", "bench", "--log-level", "warning"]
    command += ["--quant", args.quant] if args.quant else []
    command += ["--compile"] if args.compile else []
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    print("starting:", " ".join(command), file=sys.stderr, flush=True)
    process = subprocess.Popen(command, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_server(process)
    raise SystemExit("the server did not start within 900 s")


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


# --- the clients ----------------------------------------------------------------------------------------------------
async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], new_tokens: int) -> Outcome:
    body = {"model": "bench", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True}
    outcome = Outcome(started=time.perf_counter())
    while True:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code == 429:
                outcome.rejected += 1
                await asyncio.sleep(float(response.headers.get("retry-after", "1")))
                continue
            if response.status_code != 200:
                outcome.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return outcome
            last = None
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[len("data: "):])
                if "error" in data:
                    outcome.error = data["error"]["message"]
                    return outcome
                logprobs = data["choices"][0].get("logprobs") if data["choices"] else None
                count = len(logprobs["tokens"]) if logprobs else 0
                if not count:
                    continue
                now = time.perf_counter()
                if outcome.first is None:
                    outcome.first = now - outcome.started
                else:  # a chunk of several tokens (text held back by a partial character) spreads its gap over them
                    outcome.gaps += [(now - last) / count] * count
                last = now
                outcome.tokens += len(logprobs["tokens"])
        if outcome.tokens != new_tokens:
            outcome.error = f"{outcome.tokens} of {new_tokens} tokens"
        return outcome


def prompts(args: argparse.Namespace, count: int, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    lengths = [max(1, args.prompt_tokens + rng.randint(-args.prompt_spread, args.prompt_spread))
               for _ in range(count)]
    return [[rng.randrange(3, vocab) for _ in range(length)] for length in lengths]


async def run_level(url: str, concurrency: int, args: argparse.Namespace, vocab: int) -> Level:
    work = prompts(args, concurrency * args.requests_per_client, vocab)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        async def client_loop(index: int) -> list[Outcome]:
            mine = work[index::concurrency]
            return [await one_request(client, url, prompt, args.new_tokens) for prompt in mine]

        start = time.perf_counter()
        results = await asyncio.gather(*(client_loop(i) for i in range(concurrency)))
        wall = time.perf_counter() - start
    outcomes = [outcome for batch in results for outcome in batch]
    done = [o for o in outcomes if o.error is None]
    ttfts = [o.first for o in done if o.first is not None]
    first_wave = [o.first for o in (batch[0] for batch in results if batch) if o.error is None and o.first is not None]
    later = [o.first for batch in results for o in batch[1:] if o.error is None and o.first is not None]
    gaps = [gap for o in done for gap in o.gaps]
    tokens = sum(o.tokens for o in outcomes)
    for failure in (o for o in outcomes if o.error is not None):
        print(f"  failed: {failure.error}", file=sys.stderr)
    return Level(concurrency, len(outcomes), tokens, round(wall, 3), round(tokens / wall, 2),
                 ms(percentile(ttfts, 50)), ms(percentile(ttfts, 99)), ms(percentile(first_wave, 50)),
                 ms(percentile(later, 50)), ms(percentile(gaps, 50)),
                 ms(percentile(gaps, 99)), sum(o.rejected for o in outcomes), len(outcomes) - len(done))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[min(98, max(0, round(q) - 1))]


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 2)


def table(levels: list[Level], lone: Level) -> str:
    """One row per level; "x 1 client" columns are that level's figure over the 1-client level's (throughput, and
    time to first token p50 over a lone request's)."""
    header = (f"{'clients':>7} {'requests':>8} {'tok/s':>7} {'x 1 client':>10} {'TTFT p50 ms':>11} {'x lone':>6} "
              f"{'TTFT p99 ms':>11} {'1st wave p50':>12} {'later p50':>9} {'ITL p50 ms':>10} {'ITL p99 ms':>10} "
              f"{'429s':>5} {'failed':>6}")
    rows = [f"{l.concurrency:>7} {l.requests:>8} {l.tok_s:>7.1f} {l.tok_s / lone.tok_s:>9.2f}x "
            f"{l.ttft_p50_ms:>11.1f} {l.ttft_p50_ms / lone.ttft_p50_ms:>5.2f}x {l.ttft_p99_ms:>11.1f} "
            f"{l.ttft_first_wave_p50_ms:>12.1f} {l.ttft_later_p50_ms:>9.1f} {l.itl_p50_ms:>10.1f} "
            f"{l.itl_p99_ms:>10.1f} {l.rejected_429:>5} {l.failed:>6}" for l in levels]
    return "\n".join([f"lone request: time to first token p50 {lone.ttft_p50_ms:.1f} ms (1 client)", header,
                      "-" * len(header), *rows])


def main(argv=None) -> int:
    args = parse_args(argv)
    levels = [int(value) for value in args.concurrency.split(",")]
    levels = levels if 1 in levels else [1, *levels]  # the lone request every level is compared with
    with tempfile.TemporaryDirectory(prefix="splice-bench-serve-") as scratch:
        process = None
        url = args.url
        if url is None:
            process, url = start_server(args, Path(scratch))
        try:
            vocab = args.prompt_vocab
            warm = argparse.Namespace(**{**vars(args), "requests_per_client": 1, "new_tokens": 4})
            asyncio.run(run_level(url, 1, warm, vocab))  # first-call costs out of the figures
            results = []
            for concurrency in levels:
                results.append(asyncio.run(run_level(url, concurrency, args, vocab)))
                print(f"  {concurrency} clients: {results[-1].tok_s} tok/s", file=sys.stderr, flush=True)
        finally:
            if process is not None:
                stop_server(process)
    lone = next(level for level in results if level.concurrency == 1)
    print(table(results, lone))
    if args.json:
        report = {"model": args.model, "dtype": args.dtype, "quant": args.quant, "compile": args.compile,
                  "max_batch": args.max_batch, "prompt_tokens": f"{args.prompt_tokens}±{args.prompt_spread}",
                  "new_tokens": args.new_tokens, "levels": [asdict(level) for level in results]}
        text = json.dumps(report, indent=1)
        print(text) if args.json == "-" else Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
