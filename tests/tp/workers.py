"""Functions run on every rank by tests.tp.launch.run_ranks (module level so spawned processes can import them)."""
from __future__ import annotations

import torch

from tests.tp.models import build

PROMPT = [[5, 17, 33, 9, 90, 41, 7]]

#: injection_policy row-parallel names per family (the block class is found from the model).
POLICY_ROWS = {
    "llama": ("self_attn.o_proj", "mlp.down_proj"), "qwen2": ("self_attn.o_proj", "mlp.down_proj"),
    "gpt2": ("attn.c_proj", "mlp.c_proj"), "gpt_neox": ("attention.dense", "mlp.dense_4h_to_h"),
    "bloom": ("self_attention.dense", "mlp.dense_4h_to_h"), "falcon": ("self_attention.dense", "mlp.dense_4h_to_h"),
    "opt": ("self_attn.out_proj", "fc2"), "phi3": ("self_attn.o_proj", "mlp.down_proj"),
}


def shard(model, tp: int, device="cpu", **config):
    """Run splice's tensor_parallel step (check, then shard) on this rank; returns (model, pipeline context)."""
    from splice.config import resolve_config
    from splice.distributed import build_parallel_context
    from splice.pipeline import PipelineContext
    from splice.transforms import tensor_parallel

    config = resolve_config({"tensor_parallel": {"tp_size": tp, **config.pop("tensor_parallel", {})}, **config})
    ctx = PipelineContext(device=torch.device(device), parallel=build_parallel_context(config, device))
    tensor_parallel.check(model, config, ctx)
    return tensor_parallel.shard_model(model, config, ctx), ctx


def policy_for(model, family: str) -> dict:
    from splice.tp.autotp import find_blocks

    blocks, _ = find_blocks(model)
    return {type(model.get_submodule(blocks[0])): POLICY_ROWS[family]}


def reference(model, new_tokens: int = 5):
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return logits, tokens


def compare(model, ref, new_tokens: int = 5) -> dict:
    logits, tokens = reference(model, new_tokens)
    return {"max_diff": float((logits - ref[0]).abs().max()), "tokens_equal": bool(torch.equal(tokens, ref[1]))}


def parity(rank: int, world: int, cases: list[tuple[str, str, dict]]) -> dict:
    """For each (family, mode, config overrides): single-process reference, then shard and compare."""
    results = {}
    for family, mode, overrides in cases:
        model = build(family, **overrides)
        ref = reference(model)
        total = sum(p.numel() for p in model.parameters())
        extra = {"injection_policy": policy_for(model, family)} if mode == "policy" else {}
        model, ctx = shard(model, world, **extra)
        local = sum(p.numel() for p in model.parameters())
        results[f"{family}/{mode}{overrides or ''}"] = {**compare(model, ref), "param_ratio": local / total,
                                                        "plan": ctx.extras["tp_plan"].source}
    return results


def head_counts(rank: int, world: int) -> dict:
    """Uneven GQA (6 KV heads over 4 ranks), KV replication (2 KV heads over 4 ranks) and uneven MLP grains; the
    per-rank head attributes on the attention modules; the shared config untouched."""
    out = {}
    cases = {"kv6": dict(num_attention_heads=12, num_key_value_heads=6, head_dim=8, intermediate_size=320),
             "kv2": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8)}
    for name, overrides in cases.items():
        model = build("llama", **overrides)
        ref = reference(model)
        model, ctx = shard(model, world)
        attn = model.model.layers[0].self_attn
        out[name] = {**compare(model, ref), "q_rows": attn.q_proj.out_features // 8,
                     "kv_rows": attn.k_proj.out_features // 8, "groups": attn.num_key_value_groups,
                     "mlp": model.model.layers[0].mlp.up_proj.out_features,
                     "config_heads": (model.config.num_attention_heads, model.config.num_key_value_heads)}
    return out


def replicas(rank: int, world: int, tp: int) -> dict:
    """world = replicas x tp: each consecutive group of tp ranks holds one copy of the model."""
    model = build("llama")
    ref = reference(model)
    model, ctx = shard(model, tp)
    p = ctx.parallel
    return {**compare(model, ref), "tp_rank": p.rank, "replica": p.replica, "replicas": p.replicas}


def peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def checkpoint_roundtrip(rank: int, world: int, family: str, overrides: dict, folder: str, saved: str) -> dict:
    """Meta model + HF safetensors folder -> this rank's slices only; save_mp_checkpoint_path; reload the saved
    shards from their manifest; both equal the single-process model."""
    ref = reference(build(family, **overrides))
    model, ctx = shard(build(family, meta=True, **overrides), world, checkpoint=folder, save_mp_checkpoint_path=saved)
    first = compare(model, ref)
    again, _ = shard(build(family, meta=True, **overrides), world, checkpoint=f"{saved}/splice_tp.json")
    logits = [reference(m)[0] for m in (model, again)]
    tied = getattr(model, "lm_head", None)
    return {"first": first, "reloaded": compare(again, ref), "bitwise_same": bool(torch.equal(*logits)),
            "tied": tied is not None and tied.linear.weight is model.get_input_embeddings().weight,
            "meta_left": any(p.is_meta for p in again.parameters()), "loaded": ctx.extras.get("checkpoint_loaded")}


def bad_inputs(rank: int, world: int) -> dict:
    """Errors every rank must raise, before any collective: the messages, per case."""
    cases = {
        "too_many_ranks_for_heads": lambda: shard(build("llama", num_attention_heads=1, num_key_value_heads=1,
                                                        head_dim=64), world),
        "policy_bad_name": lambda: shard(build("llama"), world, injection_policy={
            type(build("llama").model.layers[0]): ("self_attn.o_proj", "mlp.down")}),
        "policy_wrong_class": lambda: shard(build("llama"), world, injection_policy={torch.nn.GRU: ("x",)}),
        "tp_larger_than_world": lambda: shard(build("llama"), world + 1),
    }
    out = {}
    for name, case in cases.items():
        try:
            case()
            out[name] = "no error"
        except (ValueError, TypeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def heads_then_replicas(rank: int, world: int) -> dict:
    return {"heads": head_counts(rank, world), "replicas": replicas(rank, world, 2)}


def checkpoints(rank: int, world: int, models: list, index_files: dict, root: str) -> dict:
    return {family: checkpoint_roundtrip(rank, world, family, overrides,
                                         f"{root}/{family}/hf/{index_files.get(family, '')}".rstrip("/"),
                                         f"{root}/{family}/tp")
            for family, overrides in models}


def distributed_checks(rank: int, world: int) -> dict:
    """ParallelContext behaviour with a user-made group: tp_group and mpu honoured (same object, never replaced),
    uneven all-gather, rank 0's RNG state broadcast. Initialises the default group itself, as a user would."""
    from datetime import timedelta

    import torch.distributed as dist

    from splice.config import resolve_config
    from splice.distributed import build_parallel_context

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    group = dist.new_group(list(range(world)))
    config = resolve_config({"tensor_parallel": {"tp_group": group}})
    ctx = build_parallel_context(config, "cpu")

    class MPU:
        def get_model_parallel_group(self):
            return group

    by_mpu = build_parallel_context(resolve_config({"tensor_parallel": {"mpu": MPU()}}), "cpu")
    try:
        build_parallel_context(resolve_config({"tensor_parallel": {"tp_group": group, "tp_size": world + 1}}), "cpu")
        mismatch = "no error"
    except ValueError as e:
        mismatch = str(e)
    gathered = ctx.all_gather_last(torch.full((2, rank + 1), float(rank)), [r + 1 for r in range(world)])
    torch.manual_seed(100 + rank)
    ctx.sync_rng()
    return {"same_group": ctx.group is group and config.tensor_parallel.tp_group is group,
            "mpu_group": by_mpu.group is group, "rank": ctx.rank, "size": ctx.world_size, "mismatch": mismatch,
            "gathered": gathered[0].tolist(), "random": torch.rand(3).tolist()}


def tp2_suite(rank: int, world: int, cases: list, models: list, index_files: dict, root: str) -> dict:
    """Everything the tests run at tp=2, in one pair of processes (process start-up dominates on 2 cores)."""
    return {"distributed": distributed_checks(rank, world), "parity": parity(rank, world, cases),
            "checkpoints": checkpoints(rank, world, models, index_files, root), "bad": bad_inputs(rank, world),
            "fused": fused_block_parity(rank, world), "sampled": sampling(rank, world),
            "quantized": quantized_parity(rank, world), "pipeline": pipeline_parity(rank, world)}


def raise_after_parity(rank: int, world: int) -> None:
    """Shard, check parity, then rank 1 raises while rank 0 enters a collective: both must end, not hang."""
    model = build("llama")
    ref = reference(model)
    model, ctx = shard(model, world)
    result = compare(model, ref)
    assert result["tokens_equal"] and result["max_diff"] < 1e-4, result
    print(f"PARITY ok rank {rank}", flush=True)
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    reference(model)


def fused_block_parity(rank: int, world: int, families: tuple = ("llama", "qwen2", "phi3")) -> dict:
    """Fused-block TP: the tensor_parallel step shards the HF model, then kernel injection (the next pipeline step)
    fuses each rank's q/k/v and gate/up shards into SpliceBlocks; o/down stay row-parallel (two all-reduces a block).
    Called through splice.transforms.inject.inject directly (its check still refuses world_size > 1)."""
    from splice.tp.layers import RowParallelLinear
    from splice.transforms.inject import inject

    out = {}
    for family in families:
        model = build(family)
        ref = reference(model)
        model, ctx = shard(model, world)
        runtime = inject(model, 64)
        block = runtime.blocks[0]
        out[family] = {**compare(model, ref), "shape": (block.shape.n_heads, block.shape.n_kv_heads),
                       "row_parallel": [isinstance(m, RowParallelLinear) for m in (block.o, block.down)]}
    return out


def sampling(rank: int, world: int) -> list[int]:
    """Ranks seeded differently still sample the same tokens: the step gives every rank rank 0's RNG state."""
    torch.manual_seed(1234 + rank)
    model, _ = shard(build("llama"), world)
    with torch.no_grad():
        out = model.generate(torch.tensor(PROMPT), do_sample=True, top_k=0, max_new_tokens=8, pad_token_id=0)
    return out[0].tolist()


def quantized_parity(rank: int, world: int) -> dict:
    """Shard first, then quantize (int8 weight-only, groups of 16 that line up with the shards): equals quantizing
    the whole model in one process, and the row-parallel wrappers keep their all-reduce around the quantized
    inner linear."""
    from splice.quant import QuantConfig, quantize
    from splice.tp.layers import RowParallelLinear

    qconfig = QuantConfig(bits=8, group_size=16, quantize_lm_head=True)
    whole = build("llama")
    quantize(whole, qconfig)
    ref = reference(whole)
    model, _ = shard(build("llama"), world)
    report = quantize(model, qconfig)
    o_proj = model.model.layers[0].self_attn.o_proj
    return {**compare(model, ref), "wrapper_kept": isinstance(o_proj, RowParallelLinear),
            "inner": type(o_proj.linear).__name__, "quantized": len(report.quantized)}


def pipeline_parity(rank: int, world: int) -> dict:
    """The whole splice pipeline (dtype -> tensor_parallel -> ... -> placement) with the ParallelContext that
    init_inference is to build with splice.distributed.build_parallel_context."""
    from splice.config import resolve_config
    from splice.distributed import build_parallel_context
    from splice.pipeline import PipelineContext, run_pipeline

    model = build("qwen2")
    ref = reference(model)
    config = resolve_config({"tensor_parallel": {"tp_size": world}, "dtype": "fp32", "device": "cpu"})
    ctx = PipelineContext(device=torch.device("cpu"), parallel=build_parallel_context(config, "cpu"))
    model = run_pipeline(model, config, ctx)
    return {**compare(model, ref), "steps": [step for step, _ in ctx.report]}
