"""llama.cpp beside splice on the same model, the same CPU and the same thread count: decode and prefill tokens/s.

The model is the random-weight TinyLlama-shaped Llama that ``splice bench --model llama-1b`` uses (22 layers, hidden
2048, 32 heads / 4 KV heads, vocab 32000; built once by ``splice.bench.llama_1b_folder``). Four formats, each engine
in its own, paired so both read the same bytes per weight with the same scheme:

    bf16                   splice bf16 (kernel-injected)          llama.cpp BF16 GGUF
    int8 vs Q8_0           splice int8 (per output channel)       llama.cpp Q8_0 (blocks of 32, one scale each)
    int4 g32 sym vs Q4_0   splice int4 (groups of 32, symmetric:  llama.cpp Q4_0 (blocks of 32, one scale each;
                           one scale each; 4.5 bits a weight)     4.5 bits a weight)
    int4 g32 vs Q4_1       splice int4 (groups of 32, asymmetric, llama.cpp Q4_1 (blocks of 32, a scale and a
                           its default: scale and zero; 5 bits)   minimum; 5 bits)

The output head: splice's quantized models put it in int8 per output channel (``init_inference``'s default);
``llama-quantize`` makes it Q8_0 in the Q8_0 file and Q6_K in the Q4_0 and Q4_1 files.

llama.cpp: ``llama-bench`` runs a ``--prompt``-token prefill from an empty context, and ``--new`` decode steps after
``--prompt`` tokens of context (``-d``, not timed), as splice's decode follows its prompt. splice: ``splice bench
--modes inject --compile --quant ...``, the rows with the decode step compiled; its prefill is the time to the first
token. Each engine keeps its best repetition (``llama-bench -r``, ``splice bench --repeat``), and the table shows the
best of the sittings; ``--sittings`` alternates the engines (llama.cpp, splice, llama.cpp, ...) so load from other
processes hits both. The ratio is splice / llama.cpp (above 1: splice is faster); the last column gives it per sitting
as well, each engine's figure of that sitting alone, whose spread shows how much the host moved.

The first run downloads the ``llama-cpp-python`` source distribution (pinned below) from PyPI, builds ``llama-bench``
and ``llama-quantize`` from the llama.cpp it vendors, converts the checkpoint to a BF16 GGUF with the vendored
``convert_hf_to_gguf.py`` and quantizes it to Q8_0, Q4_0 and Q4_1; all of it is cached under
``$SPLICE_CACHE/llamacpp/<version>`` (delete that folder to rebuild; the build takes minutes on 2 cores). Writes JSON
(default ``bench_out/llamacpp.json``)::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_llamacpp.py                  # 2 threads, 2 sittings
    PYTHONPATH=src .venv/bin/python benchmarks/bench_llamacpp.py --sittings 1 --new 32 --formats int8,int4
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: The PyPI source distribution whose ``vendor/llama.cpp`` is built; its CHANGELOG names the llama.cpp commit.
LLAMA_CPP_PYTHON = "0.3.36"
CMAKE = "/usr/bin/cmake"
#: Only the two tools are built, statically linked, for this CPU. ``-march=native`` (GGML_NATIVE) turns on every ISA
#: extension the CPU has, AMX included where present (the GGML_AMX_* options only matter without it). The pinned
#: version dropped LLAMA_CURL (CMake warns and goes on); it stays for older pins, which download through curl.
CMAKE_FLAGS = ("-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_BUILD_SERVER=OFF")
TARGETS = ("llama-bench", "llama-quantize")
BUILD_JOBS = 2


@dataclass(frozen=True)
class Format:
    label: str
    gguf_type: str  # llama.cpp's name for the GGUF tensor type
    splice_mode: str  # the ``splice bench`` row (decode step compiled)
    splice_quant: str | None  # its ``--quant`` scheme


FORMATS = {
    "bf16": Format("bf16", "BF16", "inject+compile", None),
    "int8": Format("int8 vs Q8_0", "Q8_0", "inject+int8+compile", "int8"),
    "int4-sym": Format("int4 g32 sym vs Q4_0", "Q4_0", "inject+int4-sym+compile", "int4-sym"),
    "int4": Format("int4 g32 vs Q4_1", "Q4_1", "inject+int4+compile", "int4"),
}
PHASES = ("decode", "prefill")


@dataclass
class Row:
    format: str
    llamacpp_decode: float
    llamacpp_prefill: float
    splice_decode: float
    splice_prefill: float
    decode_ratio: float
    prefill_ratio: float
    #: splice / llama.cpp decode within each sitting (the two engines minutes apart, not the best of each): on a host
    #: whose bandwidth moves, their spread shows how far the best-of ratio can be trusted
    decode_ratio_by_sitting: list[float] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="threads for both engines (default 2)")
    parser.add_argument("--new", type=int, default=64, help="decode steps (default 64)")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    parser.add_argument("--sittings", type=int, default=2, help="rounds of llama.cpp then splice (default 2)")
    parser.add_argument("--reps", type=int, default=3, help="llama-bench repetitions per test (default 3)")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated subset of {','.join(FORMATS)}")
    parser.add_argument("--json", default="bench_out/llamacpp.json", help="where to write the results")
    args = parser.parse_args(argv)
    validate(args)
    args.formats = parse_formats(args.formats)
    return args


def validate(args: argparse.Namespace) -> None:
    """Bad numbers fail here, before anything is built; ``--new`` needs 2 (splice's decode rate leaves out the first
    token, which the prefill produces)."""
    least = {"threads": 1, "new": 2, "prompt": 1, "sittings": 1, "reps": 1}
    for name, minimum in least.items():
        value = getattr(args, name)
        if value < minimum:
            raise ValueError(f"--{name}={value}: must be at least {minimum}")
    parse_formats(args.formats)


def parse_formats(text: str) -> list[str]:
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    bad = [c for c in chosen if c not in FORMATS]
    if bad or not chosen or len(set(chosen)) != len(chosen):
        raise ValueError(f"--formats={text!r}: give distinct values from {', '.join(FORMATS)}")
    return chosen


# ---------------------------------------------------------------------------------------------------- llama.cpp


def llamacpp_root() -> Path:
    from splice.models import cache_dir

    return cache_dir() / "llamacpp" / LLAMA_CPP_PYTHON


def fetch_source(root: Path) -> Path:
    """The sdist's top folder (``vendor/llama.cpp`` and ``CHANGELOG.md`` inside), downloaded and unpacked once."""
    source = root / "src"
    if (source / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        return source
    sdist_dir = root / "sdist"
    run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--dest", str(sdist_dir),
         f"llama-cpp-python=={LLAMA_CPP_PYTHON}"])
    archive = sdist_dir / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    unpacked = root / "src.tmp"
    shutil.rmtree(unpacked, ignore_errors=True)
    with tarfile.open(archive) as tar:
        tar.extractall(unpacked, members=_wanted_members(tar), filter="data")
    (unpacked / f"llama_cpp_python-{LLAMA_CPP_PYTHON}").rename(source)
    unpacked.rmdir()
    return source


def _wanted_members(tar: tarfile.TarFile) -> list[tarfile.TarInfo]:
    top = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/"
    return [m for m in tar.getmembers()
            if m.name.startswith(top + "vendor/llama.cpp/") or m.name == top + "CHANGELOG.md"]


def changelog_commit(changelog: str, version: str) -> str:
    """The llama.cpp commit a llama-cpp-python release vendors, from its CHANGELOG section ("update llama.cpp to
    ggml-org/llama.cpp@<sha>", the first one listed is the last update)."""
    section = re.search(rf"^## \[{re.escape(version)}\]\n(.*?)(?=^## \[|\Z)", changelog, re.M | re.S)
    found = re.search(r"llama\.cpp@([0-9a-f]{7,40})", section.group(1)) if section else None
    if found is None:
        raise ValueError(f"no llama.cpp commit for version {version!r} in the CHANGELOG")
    return found.group(1)


#: (file, text, replacement) applied to the unpacked copy before building. GCC 12's ``_tile_loadconfig`` declares
#: that it reads only a pointer's worth of its 64-byte operand, so GCC drops the stores of the row and column sizes into
#: llama.cpp's tile config on the stack and ``ldtilecfg`` loads garbage: a general-protection fault (SIGSEGV) in the
#: first Q8_0/Q4_0 matmul on a CPU with AMX. An empty asm that reads the whole config keeps those stores.
PATCHES = (
    ("ggml/src/ggml-cpu/amx/mmq.cpp", "    _tile_loadconfig(&tc);\n",
     '    __asm__ volatile("" : : "m"(tc));  // splice bench_llamacpp: keep the stores (GCC 12 _tile_loadconfig)\n'
     "    _tile_loadconfig(&tc);\n"),
)


def patch_source(llama_dir: Path) -> list[str]:
    """Apply :data:`PATCHES` once (a patched file is left alone); the files patched, for the report. A patch whose
    text is missing is an error: the pinned version changed under it."""
    done = []
    for relative, text, replacement in PATCHES:
        path = llama_dir / relative
        content = path.read_text()
        if replacement not in content:
            if content.count(text) != 1:
                raise ValueError(f"{path}: expected one {text.strip()!r} to patch, found {content.count(text)}")
            path.write_text(content.replace(text, replacement))
        done.append(relative)
    return done


def build_tools(root: Path, source: Path, commit: str) -> dict[str, Path]:
    """``llama-bench`` and ``llama-quantize``, the commit stamped so llama-bench reports it. Configured once; the build
    runs every time (a no-op when nothing changed, a rebuild of what a patch touched)."""
    build = root / "build"
    if not (build / "CMakeCache.txt").exists():
        print(f"configuring llama.cpp {commit} (llama-cpp-python {LLAMA_CPP_PYTHON}) in {build}", flush=True)
        run([CMAKE, "-S", str(source / "vendor" / "llama.cpp"), "-B", str(build), *CMAKE_FLAGS,
             f"-DLLAMA_BUILD_COMMIT={commit}"])
    print("building llama-bench and llama-quantize (cached after the first time)", flush=True)
    run([CMAKE, "--build", str(build), "--target", *TARGETS, "-j", str(BUILD_JOBS)], capture=True)
    return {target: build / "bin" / target for target in TARGETS}


# ---------------------------------------------------------------------------------------------------- the model

#: Runs the vendored converter. The random checkpoint has no tokenizer, so the Llama family's vocabulary comes from
#: llama.cpp's own copy of the Llama SentencePiece vocabulary (models/ggml-vocab-llama-spm.gguf, 32000 tokens, the one
#: TinyLlama uses); llama-bench feeds random token ids, so only its size matters. ``sys.path[0]`` is where the
#: converter finds its ``conversion`` package and that vocabulary.
CONVERT = """
import sys
sys.path[0] = sys.argv[1]
from conversion.llama import LlamaModel
LlamaModel.set_vocab = lambda self: self._set_vocab_builtin("llama-spm", self.hparams["vocab_size"])
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert_hf_to_gguf.main()
"""


def llama_1b_checkpoint() -> Path:
    """The folder ``splice bench --model llama-1b`` loads (built on first use), from a child process so this one
    never holds the model."""
    code = "from splice.bench import llama_1b_folder; print(llama_1b_folder())"
    out = run([sys.executable, "-c", code], env=splice_env(), capture=True)
    return Path(out.strip().splitlines()[-1])


def gguf_files(root: Path, source: Path, tools: dict[str, Path], formats: list[str], threads: int) -> dict[str, Path]:
    """One GGUF per format: BF16 converted from the checkpoint, the others quantized from it (each made once)."""
    folder = root / "gguf"
    folder.mkdir(parents=True, exist_ok=True)
    bf16 = folder / "llama-1b-bf16.gguf"
    if not bf16.exists():
        convert_to_bf16(source, llama_1b_checkpoint(), bf16)
    files = {}
    for name in formats:
        gguf_type = FORMATS[name].gguf_type
        path = folder / f"llama-1b-{gguf_type.lower()}.gguf"
        if not path.exists():
            quantize(tools["llama-quantize"], bf16, path, gguf_type, threads)
        files[name] = path
    return files


def convert_to_bf16(source: Path, checkpoint: Path, out: Path) -> None:
    llama_dir = source / "vendor" / "llama.cpp"
    tmp = out.with_suffix(".tmp")
    env = dict(os.environ, PYTHONPATH=str(llama_dir / "gguf-py"))  # the vendored gguf, not any installed one
    print(f"converting {checkpoint} to {out}", flush=True)
    run([sys.executable, "-c", CONVERT, str(llama_dir), str(checkpoint), "--outtype", "bf16", "--outfile", str(tmp)],
        env=env)
    tmp.rename(out)


def quantize(tool: Path, bf16: Path, out: Path, gguf_type: str, threads: int) -> None:
    tmp = out.with_suffix(".tmp")
    print(f"quantizing to {out}", flush=True)
    run([str(tool), str(bf16), str(tmp), gguf_type, str(threads)], capture=True)
    tmp.rename(out)


# ---------------------------------------------------------------------------------------------------- the runs


def run_llamacpp(tool: Path, files: dict[str, Path], args: argparse.Namespace) -> list[dict]:
    """llama-bench's JSON records: prefill from an empty context, then decode after ``--prompt`` tokens of context."""
    models = ",".join(str(files[name]) for name in args.formats)
    common = [str(tool), "-m", models, "-t", str(args.threads), "-r", str(args.reps), "-o", "json"]
    records = []
    for tests in (["-p", str(args.prompt), "-n", "0"], ["-p", "0", "-n", str(args.new), "-d", str(args.prompt)]):
        records += json.loads(run(common + tests, capture=True))
    return records


def parse_llama_bench(records: list[dict], files: dict[str, Path]) -> dict[str, dict[str, float]]:
    """``{format: {"decode": tok/s, "prefill": tok/s}}``, each the best repetition; records of other files or of
    mixed tests (prompt and generation together) are ignored."""
    by_file = {Path(path).name: name for name, path in files.items()}
    result: dict[str, dict[str, float]] = {}
    for record in records:
        name = by_file.get(Path(record["model_filename"]).name)
        phase = _phase(record)
        if name is not None and phase is not None:
            result.setdefault(name, {})[phase] = max(record["samples_ts"])
    return result


def _phase(record: dict) -> str | None:
    prompt, new = record["n_prompt"], record["n_gen"]
    if prompt > 0 and new == 0:
        return "prefill"
    if new > 0 and prompt == 0:
        return "decode"
    return None


def run_splice(args: argparse.Namespace) -> dict:
    """``splice bench``'s JSON report for llama-1b bf16, kernel-injected, decode step compiled, with the quantized
    formats asked for (the bf16 rows run even when bf16 is not asked for: they are splice bench's base)."""
    schemes = [FORMATS[name].splice_quant for name in args.formats if FORMATS[name].splice_quant]
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "splice.json"
        command = [sys.executable, "-m", "splice.cli", "bench", "--model", "llama-1b", "--dtype", "bf16",
                   "--modes", "inject", "--compile", "--new", str(args.new), "--prompt", str(args.prompt),
                   "--threads", str(args.threads), "--json", str(report)]
        run(command + (["--quant", ",".join(schemes)] if schemes else []), env=splice_env())
        return json.loads(report.read_text())


def parse_splice(report: dict, formats: list[str], prompt: int) -> dict[str, dict[str, float]]:
    """``{format: {"decode": tok/s, "prefill": tok/s}}`` from the compiled rows of a ``splice bench`` report."""
    rows = {row["mode"]: row for row in report["results"]}
    result = {}
    for name in formats:
        row = rows.get(FORMATS[name].splice_mode)
        if row is None:
            raise ValueError(f"splice bench report has no {FORMATS[name].splice_mode!r} row; it has {sorted(rows)}")
        result[name] = {"decode": row["decode_tok_s"], "prefill": prompt / (row["prefill_ms"] / 1e3)}
    return result


def splice_env() -> dict[str, str]:
    """This checkout's ``src`` first on the path, so the children run the splice being measured."""
    paths = [str(REPO / "src")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


def run(command: list[str], env: dict[str, str] | None = None, capture: bool = False) -> str:
    """Run a child; its stdout when ``capture``. A child that fails or dies raises, naming the command and how."""
    result = subprocess.run(command, env=env, text=True, stdout=subprocess.PIPE if capture else None,
                            stderr=subprocess.PIPE if capture else None)
    if result.returncode != 0:
        how = f"signal {-result.returncode}" if result.returncode < 0 else f"exit status {result.returncode}"
        tail = (result.stderr or "")[-2000:]
        raise RuntimeError(f"{' '.join(command[:3])} ... failed with {how}\n{tail}")
    return result.stdout or ""


# ---------------------------------------------------------------------------------------------------- the report


def best_of(sittings: list[dict[str, dict[str, float]]], name: str, phase: str) -> float:
    values = [s[name][phase] for s in sittings if phase in s.get(name, {})]
    return max(values) if values else float("nan")


def make_rows(llamacpp: list[dict], splice: list[dict], formats: list[str]) -> list[Row]:
    """One row per format: each figure the best of its sittings, and the decode ratio of each sitting."""
    rows = []
    for name in formats:
        theirs = {phase: best_of(llamacpp, name, phase) for phase in PHASES}
        ours = {phase: best_of(splice, name, phase) for phase in PHASES}
        by_sitting = [s[name]["decode"] / t[name]["decode"] for t, s in zip(llamacpp, splice)
                      if "decode" in t.get(name, {}) and "decode" in s.get(name, {})]
        rows.append(Row(FORMATS[name].label, theirs["decode"], theirs["prefill"], ours["decode"], ours["prefill"],
                        ours["decode"] / theirs["decode"], ours["prefill"] / theirs["prefill"], by_sitting))
    return rows


def format_table(rows: list[Row], cpu: str, threads: int) -> str:
    width = max([len("format")] + [len(r.format) for r in rows])
    header = (f"{'format':<{width}} {'llama.cpp decode':>16} {'prefill':>9} {'splice decode':>14} {'prefill':>9} "
              f"{'decode x':>9} {'prefill x':>9}  decode x by sitting")
    lines = [f"CPU: {cpu}, {threads} threads (tokens/s; x = splice / llama.cpp)", header, "-" * len(header)]
    for r in rows:
        by_sitting = " ".join(f"{ratio:.2f}x" for ratio in r.decode_ratio_by_sitting)
        lines.append(f"{r.format:<{width}} {r.llamacpp_decode:>16.2f} {r.llamacpp_prefill:>9.1f} {r.splice_decode:>14.2f} "
                     f"{r.splice_prefill:>9.1f} {r.decode_ratio:>8.2f}x {r.prefill_ratio:>8.2f}x  {by_sitting}".rstrip())
    return "\n".join(lines)


def cpu_model(cpuinfo: str | None = None) -> str:
    """The ``model name`` of /proc/cpuinfo."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "unknown"
    found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    return found.group(1).strip() if found else "unknown"


@dataclass
class Sittings:
    """What the alternating runs gave, one entry per sitting."""
    llamacpp: list[dict] = field(default_factory=list)  # parse_llama_bench of each
    splice: list[dict] = field(default_factory=list)  # parse_splice of each
    load: list[float] = field(default_factory=list)  # 1-minute load average after each
    records: list[list[dict]] = field(default_factory=list)  # llama-bench's own JSON, for the report


def prepare(args: argparse.Namespace) -> tuple[dict, dict[str, Path], dict[str, Path]]:
    """Source, patches, build and GGUF files (each cached): the llama.cpp facts for the report, the tools, the files."""
    root = llamacpp_root()
    source = fetch_source(root)
    commit = changelog_commit((source / "CHANGELOG.md").read_text(), LLAMA_CPP_PYTHON)
    patched = patch_source(source / "vendor" / "llama.cpp")
    tools = build_tools(root, source, commit)
    files = gguf_files(root, source, tools, args.formats, args.threads)
    facts = {"llama_cpp_python": LLAMA_CPP_PYTHON, "commit": commit, "cmake_flags": list(CMAKE_FLAGS),
             "patched": patched, "gguf": {name: str(path) for name, path in files.items()}}
    return facts, tools, files


def run_sittings(args: argparse.Namespace, bench: Path, files: dict[str, Path]) -> Sittings:
    """llama.cpp, splice, llama.cpp, splice, ...: ``--sittings`` rounds."""
    done = Sittings()
    for sitting in range(1, args.sittings + 1):
        print(f"sitting {sitting}/{args.sittings}: llama.cpp", flush=True)
        records = run_llamacpp(bench, files, args)
        done.records.append(records)
        done.llamacpp.append(parse_llama_bench(records, files))
        print(f"sitting {sitting}/{args.sittings}: splice", flush=True)
        done.splice.append(parse_splice(run_splice(args), args.formats, args.prompt))
        done.load.append(os.getloadavg()[0])  # other processes share the cores: how busy they were, for the reader
    return done


def report(args: argparse.Namespace, facts: dict, done: Sittings, rows: list[Row], cpu: str) -> dict:
    sittings = [{"llama.cpp": theirs, "splice": ours, "load_average_1min": load}
                for theirs, ours, load in zip(done.llamacpp, done.splice, done.load)]
    return {"cpu": cpu, "threads": args.threads,
            "settings": {"prompt": args.prompt, "new": args.new, "sittings": args.sittings, "reps": args.reps},
            "llama_cpp": facts, "rows": [asdict(r) for r in rows], "sittings": sittings,
            "llama_bench_records": done.records}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    facts, tools, files = prepare(args)
    done = run_sittings(args, tools["llama-bench"], files)
    rows = make_rows(done.llamacpp, done.splice, args.formats)
    cpu = cpu_model()
    print(f"llama.cpp {facts['commit']} (llama-cpp-python {LLAMA_CPP_PYTHON}), splice decode step compiled")
    print(format_table(rows, cpu, args.threads))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report(args, facts, done, rows, cpu), indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
