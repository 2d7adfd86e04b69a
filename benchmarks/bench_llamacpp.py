"""llama.cpp beside splice on the same model, the same CPU and the same thread count: decode and prefill tokens/s.

The model (``--model``) is by default the random-weight TinyLlama-shaped Llama that ``splice bench --model llama-1b``
uses (22 layers, hidden 2048, 32 heads / 4 KV heads, vocab 32000; built once by ``splice.bench.llama_1b_folder``);
``--model smollm2-135m-instruct`` takes splice's built-in model instead, whose wheel ships it as a Q4_1 GGUF, and
``--model path/to/model.gguf`` any GGUF of a family splice loads: llama.cpp runs the file as it is for the row of its
own type (Q4_1 for the built-in model) and files requantized from it (``llama-quantize --allow-requantize``) for the
others, and splice loads its conversion of the same file (the same weights, de-quantised), as ``splice generate``
does. Four formats, each engine in its own, paired so both read the same bytes per weight with the same scheme:

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

Each row also gives the bytes one decode step reads in each engine's format (llama.cpp: the GGUF's tensors but the
token embedding, plus its f16 KV cache; splice: ``splice bench``'s step bytes, weights and KV cache) and the read
speed each engine's decode reached with them (bytes a token x tokens/s). "bytes x" is llama.cpp's bytes over
splice's: the decode ratio at which both engines read at the same speed, so where both are bound by the memory's
speed that is about the ratio to expect.

``--pairs N`` measures decode only, in pairs seconds apart instead of sittings minutes apart: one splice process
holds every format's compiled engine, and each round runs, per format, one ``llama-bench`` decode and one splice
decode of the same length back to back (which goes first alternates by round). Each pair's ratio is taken before the
host's bandwidth has had minutes to move (on a shared host it still moves within seconds). The table gives the median
of the pairs' ratios and their range, each engine's median tokens/s and read speed, and each one's share of splice's
bandwidth probe, read right before and right after each pair::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_llamacpp.py --pairs 5

``--level avx2`` holds both engines to what an AVX2-only laptop runs, on any CPU that has AVX2: llama.cpp built
without ``-march=native`` (its AVX2, FMA, F16C and BMI2 code, a build of its own beside the native one) and splice's
kernels at the avx2 level with oneDNN held to AVX2 (``SPLICE_NATIVE_ISA=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``)::

    PYTHONPATH=src .venv/bin/python benchmarks/bench_llamacpp.py --pairs 5 --level avx2 --eager
    PYTHONPATH=src .venv/bin/python benchmarks/bench_llamacpp.py --pairs 5 --eager --model smollm2-135m-instruct
    PYTHONPATH=src .venv/bin/python benchmarks/bench_llamacpp.py --pairs 5 --eager --model path/to/model.Q4_0.gguf

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
import math
import os
import re
import shutil
import statistics
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


@dataclass(frozen=True)
class Level:
    """The instructions both engines may use: llama.cpp's build (its folder under the cache and CMake flags) and the
    variables splice's processes run with."""
    name: str
    build_dir: str
    cmake_flags: tuple[str, ...]
    splice_env: tuple[tuple[str, str], ...]
    cpu_flags: tuple[str, ...]  # /proc/cpuinfo flags the level needs
    description: str


#: ``native``: each engine's best on this CPU. ``avx2``: an AVX2-only laptop's instructions, no AVX-512 (AVX-VNNI
#: where the CPU has it: see level_cmake_flags).
LEVELS = {
    "native": Level("native", "build", CMAKE_FLAGS, (), (), "each engine's best on this CPU"),
    "avx2": Level("avx2", "build-avx2",
                  ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                   "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF") + CMAKE_FLAGS[1:],
                  (("SPLICE_NATIVE_ISA", "avx2"), ("ONEDNN_MAX_CPU_ISA", "AVX2")), ("avx2", "fma", "f16c", "bmi2"),
                  "both engines at AVX2 (llama.cpp without -march=native, splice's avx2 level, oneDNN AVX2)"),
}
TARGETS = ("llama-bench", "llama-quantize")
BUILD_JOBS = 2
#: ``--model``: the random llama-1b (converted to GGUF here), splice's built-in model (its wheel's GGUF) or a GGUF
#: file (is_gguf_file).
LLAMA_1B = "llama-1b"
BUILTIN_MODEL = "smollm2-135m-instruct"
MODELS = (LLAMA_1B, BUILTIN_MODEL)


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
    #: bytes one decode step reads (weights, KV cache) in each engine's format, and their ratio llama.cpp / splice
    llamacpp_step_bytes: float = math.nan
    splice_step_bytes: float = math.nan
    bytes_ratio: float = math.nan
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
    parser.add_argument("--pairs", type=int, default=0,
                        help="decode only, in N rounds of back-to-back llama.cpp / splice pairs (default 0: sittings)")
    parser.add_argument("--eager", action="store_true",
                        help="with --pairs: splice's decode steps eager, not compiled (faster where every block runs "
                             "in native calls)")
    parser.add_argument("--splice-worker", action="store_true", help=argparse.SUPPRESS)  # the pairs' splice process
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated subset of {','.join(FORMATS)}")
    parser.add_argument("--model", default=LLAMA_1B,
                        help=f"{', '.join(MODELS)} or a .gguf file (default {LLAMA_1B})")
    parser.add_argument("--level", default="native",
                        help="native (default: each engine's best here) or avx2 (both held to an AVX2-only CPU's "
                             "instructions)")
    parser.add_argument("--json", default="bench_out/llamacpp.json", help="where to write the results")
    args = parser.parse_args(argv)
    validate(args)
    args.formats = parse_formats(args.formats)
    return args


def validate(args: argparse.Namespace) -> None:
    """Bad numbers fail here, before anything is built; ``--new`` needs 2 (splice's decode rate leaves out the first
    token, which the prefill produces)."""
    least = {"threads": 1, "new": 2, "prompt": 1, "sittings": 1, "reps": 1, "pairs": 0}
    for name, minimum in least.items():
        value = getattr(args, name)
        if value < minimum:
            raise ValueError(f"--{name}={value}: must be at least {minimum}")
    if args.eager and not (args.pairs or args.splice_worker):
        raise ValueError("--eager: only with --pairs (the sittings take splice bench's compiled rows)")
    if args.level not in LEVELS:
        raise ValueError(f"--level={args.level!r}: one of {', '.join(LEVELS)}")
    if args.model not in MODELS and not is_gguf_file(args.model):
        raise ValueError(f"--model={args.model!r}: one of {', '.join(MODELS)} or a .gguf file")
    parse_formats(args.formats)


def is_gguf_file(model: str) -> bool:
    path = Path(model)
    return path.suffix.lower() == ".gguf" and path.is_file()


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


def check_cpu_flags(level: Level, have: frozenset[str]) -> None:
    """A level this CPU cannot run fails before anything is built, naming the flags it lacks."""
    missing = [flag for flag in level.cpu_flags if flag not in have]
    if missing:
        raise ValueError(f"--level {level.name}: this CPU lacks {', '.join(missing)}")


def level_cmake_flags(level: Level, have: frozenset[str]) -> tuple[str, ...]:
    """``level``'s CMake flags on a CPU with ``have``: at the avx2 level llama.cpp takes AVX-VNNI where the CPU has it,
    as splice's avx2 level does (vpdpbusd on 256-bit registers), and vpmaddubsw where it has not, as splice does."""
    if level.name != "avx2":
        return level.cmake_flags
    return level.cmake_flags + (f"-DGGML_AVX_VNNI={'ON' if 'avx_vnni' in have else 'OFF'}",)


def build_tools(root: Path, source: Path, commit: str, flags: tuple[str, ...] = CMAKE_FLAGS,
                build_dir: str = "build") -> dict[str, Path]:
    """``llama-bench`` and ``llama-quantize`` built with ``flags`` in ``root / build_dir``, the commit stamped so
    llama-bench reports it. Configured once; the build runs every time (a no-op when nothing changed, a rebuild of
    what a patch touched)."""
    build = root / build_dir
    if not (build / "CMakeCache.txt").exists():
        print(f"configuring llama.cpp {commit} (llama-cpp-python {LLAMA_CPP_PYTHON}) in {build}", flush=True)
        run([CMAKE, "-S", str(source / "vendor" / "llama.cpp"), "-B", str(build), *flags,
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


def gguf_files(root: Path, source: Path, tools: dict[str, Path], formats: list[str], threads: int,
               model: str = LLAMA_1B) -> dict[str, Path]:
    """One GGUF per format, each made once. llama-1b: BF16 converted from the checkpoint, the others quantized from it.
    The built-in model or a .gguf file: that file for the format it is in, the others requantized from it (named by
    the model, or by the file's name and the start of its sha256)."""
    from splice.models import cached_sha256

    folder = root / "gguf"
    folder.mkdir(parents=True, exist_ok=True)
    if model == LLAMA_1B:
        source_file, shipped, requantize = folder / "llama-1b-bf16.gguf", "BF16", False
        if not source_file.exists():
            convert_to_bf16(source, llama_1b_checkpoint(), source_file)
    else:
        source_file, requantize = builtin_gguf() if model == BUILTIN_MODEL else Path(model).resolve(), True
        shipped = gguf_file_type(source_file)
    stem = model if model in MODELS else f"{source_file.stem}-{cached_sha256(source_file)[:12]}"
    files = {}
    for name in formats:
        gguf_type = FORMATS[name].gguf_type
        path = source_file if gguf_type == shipped else folder / f"{stem}-{gguf_type.lower()}.gguf"
        if not path.exists():
            quantize(tools["llama-quantize"], source_file, path, gguf_type, threads, requantize)
        files[name] = path
    return files


def builtin_gguf() -> Path:
    """The built-in model's GGUF inside its wheel (found through the wheel's metadata, never imported)."""
    from splice.models import BUILTIN_MODELS, builtin_gguf_path

    return builtin_gguf_path(BUILTIN_MODELS[BUILTIN_MODEL])


def gguf_file_type(path: Path) -> str:
    """The type most of a GGUF's matrices are stored in (its format: a Q4_1 file keeps norms in F32 and may keep the
    embedding in another type)."""
    import gguf

    types = [t.tensor_type.name for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2]
    return max(set(types), key=types.count)


def convert_to_bf16(source: Path, checkpoint: Path, out: Path) -> None:
    llama_dir = source / "vendor" / "llama.cpp"
    tmp = out.with_suffix(".tmp")
    env = dict(os.environ, PYTHONPATH=str(llama_dir / "gguf-py"))  # the vendored gguf, not any installed one
    print(f"converting {checkpoint} to {out}", flush=True)
    run([sys.executable, "-c", CONVERT, str(llama_dir), str(checkpoint), "--outtype", "bf16", "--outfile", str(tmp)],
        env=env)
    tmp.rename(out)


def quantize(tool: Path, source: Path, out: Path, gguf_type: str, threads: int, requantize: bool = False) -> None:
    """``llama-quantize`` from ``source`` (BF16, or with ``requantize`` an already quantized file) to ``out``."""
    tmp = out.with_suffix(".tmp")
    print(f"quantizing to {out}", flush=True)
    run([str(tool)] + (["--allow-requantize"] if requantize else []) + [str(source), str(tmp), gguf_type, str(threads)],
        capture=True)
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


def gguf_step_bytes(path: Path, slots: float) -> int:
    """Bytes one llama.cpp decode step reads from a GGUF: every tensor but the token embedding (a lookup reads one row;
    without an ``output.weight`` the embedding is also the output head and counts), plus the f16 KV cache (llama-bench's
    default) over ``slots`` positions."""
    import gguf

    reader = gguf.GGUFReader(path)
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    weights = sum(int(t.n_bytes) for t in reader.tensors if tied or t.name != "token_embd.weight")
    arch = reader.fields["general.architecture"].contents()

    def value(key: str):
        field = reader.fields.get(f"{arch}.{key}")
        return None if field is None else field.contents()

    heads = value("attention.head_count")
    head_dim = value("attention.key_length") or value("embedding_length") // heads
    kv_heads = value("attention.head_count_kv") or heads
    return int(weights + 2 * value("block_count") * kv_heads * head_dim * 2 * slots)


def decode_slots(args: argparse.Namespace) -> float:
    """KV positions llama-bench's decode steps attend over, on average: ``--prompt`` of context, growing by one a
    step."""
    return args.prompt + (args.new - 1) / 2


def run_splice(args: argparse.Namespace) -> dict:
    """``splice bench``'s JSON report for ``--model`` in bf16, kernel-injected, decode step compiled, with the quantized
    formats asked for (the bf16 rows run even when bf16 is not asked for: they are splice bench's base)."""
    schemes = [FORMATS[name].splice_quant for name in args.formats if FORMATS[name].splice_quant]
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "splice.json"
        command = [sys.executable, "-m", "splice.cli", "bench", "--model", args.model, "--dtype", "bf16",
                   "--modes", "inject", "--compile", "--new", str(args.new), "--prompt", str(args.prompt),
                   "--threads", str(args.threads), "--json", str(report)]
        run(command + (["--quant", ",".join(schemes)] if schemes else []), env=splice_env(args.level))
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
        if row.get("step_bytes"):
            result[name]["step_bytes"] = row["step_bytes"]
    return result


# ---------------------------------------------------------------------------------------------------- pairs

#: The splice worker's answer lines start with this; anything else it prints (progress bars, warnings) is not read.
ANSWER = "splice-pair "


def splice_worker(args: argparse.Namespace) -> None:
    """The pairs' splice side: every format's kernel-injected engine, decode step compiled (eager with ``--eager``) and
    warmed up once; then one request per line of stdin: a format name, answered with one timed decode (a ``generate``
    of ``--new`` tokens after ``--prompt``; tokens/s over the steps after the first) and the bytes a step reads, or
    ``probe``, answered with one reading of ``splice bench``'s bandwidth probe (on half a GiB)."""
    import torch

    import splice
    from splice.bench import (QUANT_SCHEMES, attended_slots, kv_bytes_per_step, load_model, read_bandwidth_gbs,
                              slots_run, stored_weight_bytes, time_generate)

    torch.set_num_threads(args.threads)
    engines, step_bytes = {}, {}
    for name in args.formats:
        scheme = FORMATS[name].splice_quant
        model = load_model(args.model, "bf16")
        prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt),  # the same ids for every format
                               generator=torch.Generator().manual_seed(0))
        engine = splice.init_inference(model, replace_with_kernel_inject=True,
                                       max_out_tokens=args.prompt + args.new,
                                       **(QUANT_SCHEMES[scheme] if scheme else {}))
        if not args.eager:
            engine.runtime.compile_decode()
        time_generate(engine.generate, prompt, args.new, 1)  # compiles, then one run
        engines[name] = engine
        slots = attended_slots(args, slots_run(engine, "eager" if args.eager else "compile", 1))
        step_bytes[name] = stored_weight_bytes(engine.module) + kv_bytes_per_step(engine.module, 1, slots)
    print(ANSWER + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        name = line.strip()
        if name == "probe":
            print(ANSWER + json.dumps({"probe_gbs": read_bandwidth_gbs(gib=0.5, repeats=2)}), flush=True)
            continue
        _, decode, _ = time_generate(engines[name].generate, prompt, args.new, 1, warm_up=False)
        print(ANSWER + json.dumps({"format": name, "decode": decode, "step_bytes": step_bytes[name]}), flush=True)


class SpliceWorker:
    """The parent's handle on :func:`splice_worker`, a child process of this script."""

    def __init__(self, args: argparse.Namespace):
        command = [sys.executable, str(Path(__file__).resolve()), "--splice-worker",
                   "--formats", ",".join(args.formats), "--prompt", str(args.prompt), "--new", str(args.new),
                   "--threads", str(args.threads), "--model", args.model] + (["--eager"] if args.eager else [])
        self.process = subprocess.Popen(command, env=splice_env(args.level), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        self.answer()  # ready

    def answer(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(ANSWER):
                return json.loads(line[len(ANSWER):])
        raise RuntimeError(f"the splice worker ended (exit status {self.process.wait()}) without answering")

    def ask(self, request: str) -> dict:
        self.process.stdin.write(request + "\n")
        self.process.stdin.flush()
        return self.answer()

    def decode(self, name: str) -> dict:
        return self.ask(name)

    def probe(self) -> float:
        return self.ask("probe")["probe_gbs"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def llamacpp_decode(tool: Path, path: Path, args: argparse.Namespace) -> float:
    """One ``llama-bench`` decode of ``--new`` tokens after ``--prompt`` of context, tokens/s."""
    command = [str(tool), "-m", str(path), "-t", str(args.threads), "-r", "1", "-o", "json", "-p", "0",
               "-n", str(args.new), "-d", str(args.prompt)]
    [record] = json.loads(run(command, capture=True))
    return max(record["samples_ts"])


def run_pairs(args: argparse.Namespace, bench: Path, files: dict[str, Path]) -> dict[str, list[dict]]:
    """``{format: [{"llama.cpp": tok/s, "splice": tok/s, "splice_step_bytes": bytes, "probe_gbs": GB/s,
    "probe_before_after": [GB/s, GB/s]}, ...]}``, one entry per round; within a round each format's two runs go back
    to back, llama.cpp first in even rounds, splice first in odd, with the probe read right before and right after the
    pair (``probe_gbs``: their mean)."""
    pairs: dict[str, list[dict]] = {name: [] for name in args.formats}
    worker = SpliceWorker(args)
    try:
        for round_ in range(args.pairs):
            print(f"round {round_ + 1}/{args.pairs}", flush=True)
            for name in args.formats:
                before = worker.probe()
                if round_ % 2 == 0:
                    theirs = llamacpp_decode(bench, files[name], args)
                    ours = worker.decode(name)
                else:
                    ours = worker.decode(name)
                    theirs = llamacpp_decode(bench, files[name], args)
                after = worker.probe()
                pairs[name].append({"llama.cpp": theirs, "splice": ours["decode"],
                                    "splice_step_bytes": ours["step_bytes"], "probe_gbs": (before + after) / 2,
                                    "probe_before_after": [before, after]})
    finally:
        worker.close()
    return pairs


@dataclass
class PairRow:
    format: str
    llamacpp_decode: float  # medians of the pairs
    splice_decode: float
    ratio: float  # the median of the pairs' splice / llama.cpp ratios
    ratio_low: float
    ratio_high: float
    llamacpp_step_bytes: float
    splice_step_bytes: float
    probe_gbs: float  # the median of the pairs' probe readings (each the mean of one before and one after the pair)
    llamacpp_share: float  # the median of each pair's read speed over its probe reading
    splice_share: float


def make_pair_rows(pairs: dict[str, list[dict]], llamacpp_bytes: dict[str, int]) -> list[PairRow]:
    rows = []
    for name, runs in pairs.items():
        ratios = [r["splice"] / r["llama.cpp"] for r in runs]
        theirs, ours = float(llamacpp_bytes[name]), float(runs[0]["splice_step_bytes"])
        rows.append(PairRow(FORMATS[name].label, statistics.median(r["llama.cpp"] for r in runs),
                            statistics.median(r["splice"] for r in runs), statistics.median(ratios), min(ratios),
                            max(ratios), theirs, ours, statistics.median(r["probe_gbs"] for r in runs),
                            statistics.median(r["llama.cpp"] * theirs / 1e9 / r["probe_gbs"] for r in runs),
                            statistics.median(r["splice"] * ours / 1e9 / r["probe_gbs"] for r in runs)))
    return rows


def format_pair_table(rows: list[PairRow], cpu: str, threads: int, pairs: int) -> str:
    width = max([len("format")] + [len(r.format) for r in rows])
    header = (f"{'format':<{width}} {'llama.cpp tok/s':>15} {'GB/s':>6} {'splice tok/s':>12} {'GB/s':>6} "
              f"{'decode x':>9} {'range':>13} {'bytes x':>8} {'probe GB/s':>10} {'llama.cpp %':>11} {'splice %':>8}")
    lines = [f"CPU: {cpu}, {threads} threads; decode in {pairs} back-to-back pairs per format (medians; x = splice / "
             "llama.cpp, the median of the pairs' ratios and their range; bytes x = llama.cpp's bytes a step / "
             "splice's; % = each engine's read speed over the probe read around its pair)", header,
             "-" * len(header)]
    for r in rows:
        their_speed, our_speed = r.llamacpp_decode * r.llamacpp_step_bytes, r.splice_decode * r.splice_step_bytes
        lines.append(f"{r.format:<{width}} {r.llamacpp_decode:>15.2f} {their_speed / 1e9:>6.1f} "
                     f"{r.splice_decode:>12.2f} {our_speed / 1e9:>6.1f} "
                     f"{r.ratio:>8.2f}x {f'{r.ratio_low:.2f}-{r.ratio_high:.2f}x':>13} "
                     f"{r.llamacpp_step_bytes / r.splice_step_bytes:>7.2f}x {r.probe_gbs:>10.1f} "
                     f"{r.llamacpp_share:>10.0%} {r.splice_share:>8.0%}")
    return "\n".join(lines)


def splice_env(level: str = "native") -> dict[str, str]:
    """This checkout's ``src`` first on the path, so the children run the splice being measured, with ``level``'s
    variables."""
    paths = [str(REPO / "src")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths), **dict(LEVELS[level].splice_env))


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


def make_rows(llamacpp: list[dict], splice: list[dict], formats: list[str],
              llamacpp_bytes: dict[str, int] | None = None) -> list[Row]:
    """One row per format: each figure the best of its sittings, the decode ratio of each sitting, and the bytes a
    decode step reads in each engine (``llamacpp_bytes``: :func:`gguf_step_bytes` per format; splice's from its
    report)."""
    rows = []
    for name in formats:
        theirs = {phase: best_of(llamacpp, name, phase) for phase in PHASES}
        ours = {phase: best_of(splice, name, phase) for phase in PHASES}
        by_sitting = [s[name]["decode"] / t[name]["decode"] for t, s in zip(llamacpp, splice)
                      if "decode" in t.get(name, {}) and "decode" in s.get(name, {})]
        their_bytes = float((llamacpp_bytes or {}).get(name, math.nan))
        our_bytes = float(next((s[name]["step_bytes"] for s in splice if "step_bytes" in s.get(name, {})), math.nan))
        rows.append(Row(FORMATS[name].label, theirs["decode"], theirs["prefill"], ours["decode"], ours["prefill"],
                        ours["decode"] / theirs["decode"], ours["prefill"] / theirs["prefill"],
                        llamacpp_step_bytes=their_bytes, splice_step_bytes=our_bytes,
                        bytes_ratio=their_bytes / our_bytes, decode_ratio_by_sitting=by_sitting))
    return rows


def format_table(rows: list[Row], cpu: str, threads: int) -> str:
    """The tokens/s table, then the bytes each engine's decode step reads and the speed it read them at."""
    width = max([len("format")] + [len(r.format) for r in rows])
    header = (f"{'format':<{width}} {'llama.cpp decode':>16} {'prefill':>9} {'splice decode':>14} {'prefill':>9} "
              f"{'decode x':>9} {'prefill x':>9}  decode x by sitting")
    lines = [f"CPU: {cpu}, {threads} threads (tokens/s; x = splice / llama.cpp)", header, "-" * len(header)]
    for r in rows:
        by_sitting = " ".join(f"{ratio:.2f}x" for ratio in r.decode_ratio_by_sitting)
        lines.append(f"{r.format:<{width}} {r.llamacpp_decode:>16.2f} {r.llamacpp_prefill:>9.1f} "
                     f"{r.splice_decode:>14.2f} {r.splice_prefill:>9.1f} {r.decode_ratio:>8.2f}x "
                     f"{r.prefill_ratio:>8.2f}x  {by_sitting}".rstrip())
    header = (f"{'format':<{width}} {'llama.cpp MB/token':>18} {'GB/s':>6} {'splice MB/token':>15} {'GB/s':>6} "
              f"{'bytes x':>8}")
    lines += ["", "bytes one decode step reads, the read speed it reached (MB/token x tokens/s), and bytes x = "
              "llama.cpp's MB/token / splice's (the decode x at equal read speeds)", header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r.format:<{width}} {r.llamacpp_step_bytes / 1e6:>18.1f} "
                     f"{r.llamacpp_step_bytes * r.llamacpp_decode / 1e9:>6.1f} {r.splice_step_bytes / 1e6:>15.1f} "
                     f"{r.splice_step_bytes * r.splice_decode / 1e9:>6.1f} {r.bytes_ratio:>7.2f}x")
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
    from splice import native

    level, have = LEVELS[args.level], native._cpu_flags()
    check_cpu_flags(level, have)
    flags = level_cmake_flags(level, have)
    root = llamacpp_root()
    source = fetch_source(root)
    commit = changelog_commit((source / "CHANGELOG.md").read_text(), LLAMA_CPP_PYTHON)
    patched = patch_source(source / "vendor" / "llama.cpp")
    tools = build_tools(root, source, commit, flags, level.build_dir)
    files = gguf_files(root, source, tools, args.formats, args.threads, args.model)
    facts = {"llama_cpp_python": LLAMA_CPP_PYTHON, "commit": commit, "cmake_flags": list(flags), "model": args.model,
             "level": args.level, "splice_env": dict(level.splice_env),
             "patched": patched, "gguf": {name: str(path) for name, path in files.items()},
             "splice_step": "eager" if args.eager else "compiled"}
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
    if args.splice_worker:
        splice_worker(args)
        return 0
    facts, tools, files = prepare(args)
    if args.pairs:
        return main_pairs(args, facts, tools, files)
    done = run_sittings(args, tools["llama-bench"], files)
    step_bytes = {name: gguf_step_bytes(files[name], decode_slots(args)) for name in args.formats}
    rows = make_rows(done.llamacpp, done.splice, args.formats, step_bytes)
    cpu = cpu_model()
    publish(facts, format_table(rows, cpu, args.threads), report(args, facts, done, rows, cpu), Path(args.json))
    return 0


def publish(facts: dict, table: str, report_: dict, out: Path) -> None:
    """The table under a line naming both engines, and the JSON report written to ``out``."""
    step = "eager" if facts.get("splice_step") == "eager" else "compiled"
    level = LEVELS[facts.get("level", "native")].description
    model = Path(facts.get("model", LLAMA_1B)).name
    print(f"{model}: llama.cpp {facts['commit']} (llama-cpp-python {LLAMA_CPP_PYTHON}), splice decode step {step}; "
          f"{level}")
    print(table)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report_, indent=2))
    print(f"wrote {out}")


def main_pairs(args: argparse.Namespace, facts: dict, tools: dict[str, Path], files: dict[str, Path]) -> int:
    pairs = run_pairs(args, tools["llama-bench"], files)
    step_bytes = {name: gguf_step_bytes(files[name], decode_slots(args)) for name in args.formats}
    rows = make_pair_rows(pairs, step_bytes)
    cpu = cpu_model()
    publish(facts, format_pair_table(rows, cpu, args.threads, args.pairs),
            {"cpu": cpu, "threads": args.threads,
             "settings": {"prompt": args.prompt, "new": args.new, "pairs": args.pairs}, "llama_cpp": facts,
             "rows": [asdict(r) for r in rows], "pairs": pairs}, Path(args.json))
    return 0


if __name__ == "__main__":
    sys.exit(main())
