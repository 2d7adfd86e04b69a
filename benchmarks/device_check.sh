#!/usr/bin/env bash
# One short GPU check, for a session lent the device machine: splice's CUDA tests (CUDA graph replay, the quantized
# CUDA kernels, CUDA-event timing; tests/layers/test_cuda_graphs.py also runs its CPU cases), then generate tokens/s
# of HF eager, splice eager and CUDA graph replay, then batch-1 timings of the quantized linears against bf16. The
# three parts together are bounded by their timeouts (210 + 90 + 60 s) to finish inside a 420 s device call, which
# leaves a session's 15 minutes of device time room for a second machine to rerun what failed. Arguments, if any,
# replace the test selection of part 1 (for example one test's node id).
#
# The machine's own python3 holds PyTorch with CUDA and transformers but not pydantic or gguf, and it reaches no
# package index: carry those as wheels. Here, in the repository root, once:
#     echo /.whl/ >> .git/info/exclude
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#         pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
#         typing-extensions==4.16.0 gguf==0.19.0 pytest-timeout==2.4.0
# Then with the device tool: run command "bash benchmarks/device_check.sh", carry [".whl"], timeout_s 420.
# The full pytest log comes back as pytest.log among the run's files.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/device_check}"
mkdir -p "$OUT"
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || { echo "device_check: installing the carried wheels failed"; exit 1; }
fi
export PYTHONPATH="src:/tmp/site" SPLICE_CACHE=/tmp/splice-cache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers, pydantic, gguf; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'transformers', transformers.__version__, 'pydantic', pydantic.VERSION)" \
    || { echo "device_check: imports failed"; exit 1; }

echo "== 1/3 CUDA tests (full log: pytest.log)"
# -k cuda: every case of the two CUDA test files, and the CUDA ones of the others
# pyproject.toml's addopts pass --timeout: pytest-timeout comes with the carried wheels
if [ $# -gt 0 ]; then
    selection=("$@")
else
    selection=(-k cuda tests/layers/test_cuda_graphs.py tests/quant/test_cuda.py tests/steps/test_compile.py
               tests/test_engine.py tests/test_plan.py)
fi
timeout 210 python3 -m pytest -q -p no:cacheprovider -rs --timeout=120 --durations=15 "${selection[@]}" \
    > "$OUT/pytest.log" 2>&1
echo "pytest exit status $? (124: stopped at its 210 s limit)"
grep -E "^(FAILED|ERROR)|passed|failed|error" "$OUT/pytest.log" | tail -30

echo "== 2/3 generate tokens/s: HF eager, splice eager, splice CUDA graph replay"
timeout 90 python3 - <<'PY'
"""New tokens per second of whole generate calls (a 128-token prompt, 128 new tokens, greedy) on a SmolLM2-shaped
random Llama in bf16, batch 1 and 8: the unmodified HF model, then splice kernel-injected with eager decode steps and
with CUDA graph replay (enable_cuda_graph=True). Each is run once to warm up (with graphs: the capture) and once
timed."""
import time
import torch
import splice
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
NEW = 128


def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()


def timed(generate, prompt):
    generate(prompt)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = generate(prompt)
    torch.cuda.synchronize()
    return out, NEW * prompt.shape[0] / (time.perf_counter() - start)


greedy = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
engines = {"HF eager": model()}
for name, graphs in (("splice eager", False), ("splice CUDA graphs", True)):
    engines[name] = splice.init_inference(model(), replace_with_kernel_inject=True, enable_cuda_graph=graphs,
                                          max_out_tokens=512)
for batch in (1, 8):
    prompt = torch.randint(100, config.vocab_size, (batch, 128), device="cuda")
    results = {name: timed(lambda ids: engine.generate(ids, **greedy), prompt) for name, engine in engines.items()}
    rate = {name: r[1] for name, r in results.items()}
    same = {name: torch.equal(r[0], results["HF eager"][0]) for name, r in results.items()}
    print(f"batch {batch}: " + ", ".join(f"{name} {rate[name]:.0f} tok/s ({rate[name] / rate['HF eager']:.2f}x HF, "
                                         f"tokens as HF's: {same[name]})" for name in rate))
runtime = engines["splice CUDA graphs"].runtime
print(f"decode graphs captured: {len(runtime.graphs.graphs)}, eager signatures: {len(runtime.graphs.eager)} "
      "(bf16: tokens may part from HF's after a near tie)")
PY
echo "decode timing exit status $?"

echo "== 3/3 quantized linears vs bf16"
timeout 60 python3 - <<'PY'
"""Batch-1 and batch-8 time of one TinyLlama-shaped block's fused projections (x22 layers), bf16 vs quantized (and
torch's int8 kernel beside splice's int8 layers, which widen the weight instead on CUDA)."""
import torch
from splice.quant import HANDLERS, QuantConfig

shapes = [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]  # qkv, o, gate+up, down
schemes = {"int8": QuantConfig(), "int4-g32": QuantConfig(bits=4, group_size=32, symmetric=False),
           "int4-g128": QuantConfig(bits=4, group_size=128), "w8a8": QuantConfig(activations=True)}
torch.manual_seed(0)
weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(22) for n, k in shapes]
rows = {"bf16": [torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="cuda", dtype=torch.bfloat16)
                 for w in weights]}
for layer, w in zip(rows["bf16"], weights):
    layer.weight.data.copy_(w)
for name, config in schemes.items():
    rows[name] = [HANDLERS[config.kind].from_float(w, None, config) for w in weights]


class TorchInt8(torch.nn.Module):
    """An int8 layer on torch's int8 kernel (_weight_int8pack_mm), which splice's int8 layers do not call on CUDA
    (they widen the weight to bf16 on every call, then one matmul): timed beside them to keep that choice checked."""

    def __init__(self, layer):
        super().__init__()
        self.layer, self.in_features = layer, layer.in_features

    def forward(self, x):
        return torch._weight_int8pack_mm(x, self.layer.qweight, self.layer.scales.to(x.dtype))


rows["int8 torch kernel"] = [TorchInt8(layer) for layer in rows["int8"]]
for batch in (1, 8):
    xs = {k: torch.randn(batch, k, device="cuda", dtype=torch.bfloat16) for k in (2048, 5632)}
    times = {}
    for name, layers in rows.items():
        def step():
            for layer in layers:
                layer(xs[layer.in_features])
        for _ in range(3):
            step()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            step()
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / 10
    print(f"batch {batch}: " + ", ".join(f"{n} {t:.2f} ms ({times['bf16'] / t:.2f}x)" for n, t in times.items()))
PY
echo "quantized timing exit status $?"
