#!/usr/bin/env bash
# One short GPU check, for a session lent the device machine: splice's CUDA paths (tests/quant/test_cuda.py and the
# CUDA cases elsewhere in the suite), then batch-1 timings of the quantized linears against bf16 on the GPU.
#
# The machine's own python3 holds PyTorch with CUDA and transformers but not pydantic or gguf, and it reaches no
# package index: carry those as wheels. Here, in the repository root, once:
#     echo /.whl/ >> .git/info/exclude
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#         pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection gguf
# Then with the device tool: run command "bash benchmarks/device_check.sh", carry [".whl"], timeout_s 540.
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl > /dev/null 2>&1; then python3 -m pip install --quiet --no-deps .whl/*.whl; fi
export PYTHONPATH=src SPLICE_CACHE="${OUT:-/tmp}/splice-cache"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__)"

timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/quant/test_cuda.py tests/test_init.py tests/test_engine.py \
    tests/steps/test_compile.py tests/layers/test_cuda_graphs.py 2>&1 | tail -25

timeout 120 python3 - <<'PY'
"""Decode tokens/s of a SmolLM2-shaped random Llama (bf16, batch 1, kernel-injected): eager steps vs CUDA graph
replay (enable_cuda_graph=True), same prompt, greedy; the tokens must agree."""
import time
import torch
import splice
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
prompt = torch.randint(100, config.vocab_size, (1, 128), device="cuda")
results = {}
for graphs in (False, True):
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    engine = splice.init_inference(model, replace_with_kernel_inject=True, enable_cuda_graph=graphs,
                                   max_out_tokens=512)
    run = lambda: engine.generate(prompt, max_new_tokens=128, min_new_tokens=128, do_sample=False)
    run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = run()
    torch.cuda.synchronize()
    results[graphs] = (out, 128 / (time.perf_counter() - start))
same = torch.equal(results[False][0], results[True][0])
print(f"decode tok/s, batch 1 bf16: eager {results[False][1]:.0f}, CUDA graphs {results[True][1]:.0f} "
      f"({results[True][1] / results[False][1]:.2f}x); tokens identical: {same}")
PY

timeout 180 python3 - <<'PY'
"""Batch-1 and batch-8 time of one TinyLlama-shaped block's fused projections (x22 layers), bf16 vs quantized."""
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
