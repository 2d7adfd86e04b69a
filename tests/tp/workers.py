"""Functions run on every rank by tests.tp.launch.run_ranks (module level so spawned processes can import them)."""
from __future__ import annotations

import torch

from tests.arch.tiny_models import MOE_FAMILIES, build

PROMPT = [[5, 17, 33, 9, 90, 41, 7]]

#: injection_policy row-parallel names per family (the block class is found from the model).
POLICY_ROWS = {
    "llama": ("self_attn.o_proj", "mlp.down_proj"), "qwen2": ("self_attn.o_proj", "mlp.down_proj"),
    "gpt2": ("attn.c_proj", "mlp.c_proj"), "gpt_neox": ("attention.dense", "mlp.dense_4h_to_h"),
    "bloom": ("self_attention.dense", "mlp.dense_4h_to_h"), "falcon": ("self_attention.dense", "mlp.dense_4h_to_h"),
    "opt": ("self_attn.out_proj", "fc2"), "phi3": ("self_attn.o_proj", "mlp.down_proj"),
    "gemma": ("self_attn.o_proj", "mlp.down_proj"),
}


def shard(model, tp: int, device="cpu", **config):
    """Resolve a plan and run splice's shard step on this rank; returns (model, plan, shard report)."""
    from splice.config import resolve_config
    from splice.distributed import build_parallel_context
    from splice.plan import resolve
    from splice.steps import Stage
    from splice.steps.shard import shard as shard_step

    config = resolve_config({"tensor_parallel": {"tp_size": tp, **config.pop("tensor_parallel", {})}, **config})
    plan = resolve(config, model, build_parallel_context(config, device), torch.device(device))
    stage, report = shard_step(Stage(model), plan)
    return stage.model, plan, report


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
        model, plan, _ = shard(model, world, **extra)
        local = sum(p.numel() for p in model.parameters())
        results[f"{family}/{mode}{overrides or ''}"] = {**compare(model, ref), "param_ratio": local / total,
                                                        "plan": plan.tp_plan.source}
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
        model, _, _ = shard(model, world)
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
    model, plan, _ = shard(model, tp)
    p = plan.parallel
    return {**compare(model, ref), "tp_rank": p.rank, "replica": p.replica, "replicas": p.replicas}


def peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def checkpoint_roundtrip(rank: int, world: int, family: str, overrides: dict, folder: str, saved: str) -> dict:
    """Meta model + HF safetensors folder -> this rank's slices only; save_mp_checkpoint_path; reload the saved
    shards from their manifest; both equal the single-process model."""
    ref = reference(build(family, **overrides))
    model, _, report = shard(build(family, meta=True, **overrides), world, checkpoint=folder,
                             save_mp_checkpoint_path=saved)
    first = compare(model, ref)
    again, _, _ = shard(build(family, meta=True, **overrides), world, checkpoint=f"{saved}/splice_tp.json")
    logits = [reference(m)[0] for m in (model, again)]
    tied = getattr(model, "lm_head", None)
    return {"first": first, "reloaded": compare(again, ref), "bitwise_same": bool(torch.equal(*logits)),
            "tied": tied is not None and tied.linear.weight is model.get_input_embeddings().weight,
            "meta_left": any(p.is_meta for p in again.parameters()), "loaded": report.loaded_from}


def experts_roundtrip(rank: int, world: int, root: str) -> dict:
    """Mixtures of experts: a model in memory sharded (every expert's features split) and saved with
    save_mp_checkpoint_path, then its shards reloaded into a meta model; both equal the single-process model, and so
    does a meta model filled with its rank's slices from the Hugging Face checkpoint (per-expert tensors, which
    transformers' conversion stacks). Sharded then quantized (int8 in groups of 16), it equals the whole model
    quantized in one process, its experts keeping the all-reduce."""
    from splice.quant import QuantConfig, quantize

    qconfig = QuantConfig(bits=8, group_size=16)  # groups that line up with the ranks' shares of the features
    results = {}
    for family in MOE_FAMILIES:
        whole = build(family)
        quantize(whole, qconfig)
        quantized, _, _ = shard(build(family), world)
        quantize(quantized, qconfig)
        ref = reference(build(family))
        saved = f"{root}/{family}-experts"
        model, _, _ = shard(build(family), world, save_mp_checkpoint_path=saved)
        again, _, _ = shard(build(family, meta=True), world, checkpoint=f"{saved}/splice_tp.json")
        from_hf = from_hf_checkpoint(family, rank, world, root)
        experts = again.model.layers[0].mlp.experts
        results[family] = {"first": compare(model, ref), "reloaded": compare(again, ref),
                           "from_hf": compare(from_hf, ref),
                           "hf_features": from_hf.model.layers[0].mlp.experts.down_proj.shape[2],
                           "meta_left": any(p.is_meta for p in again.parameters()),
                           "features": (experts.down_proj.shape[2], experts.intermediate_dim),
                           "quantized": compare(quantized, reference(whole)),
                           "quantized_hooks": len(quantized.model.layers[0].mlp.experts._forward_hooks),
                           "native_bf16": native_experts_error(quantized, whole)}
    return results


def from_hf_checkpoint(family: str, rank: int, world: int, root: str):
    """A meta model of ``family`` sharded and filled from the tiny model's Hugging Face checkpoint (rank 0 writes it;
    the process group must be up)."""
    folder = f"{root}/{family}-hf"
    if rank == 0:
        build(family).save_pretrained(folder)
    torch.distributed.barrier()
    return shard(build(family, meta=True), world, checkpoint=folder)[0]


def native_experts_error(sharded, whole) -> float | None:
    """Relative difference of the first layer's quantized experts on bf16 decode rows, this rank's share (its
    experts in one native call, then the module's all-reduce) against the whole module's; None without the native
    kernels."""
    from splice import native

    if not native.available():
        return None
    x = (torch.randn(3, whole.config.hidden_size, generator=torch.Generator().manual_seed(3)) * 0.5).bfloat16()
    index = torch.tensor([[0, 1], [2, 3], [1, 3]])
    weights = torch.tensor([[0.6, 0.4], [0.3, 0.7], [0.5, 0.5]])
    with torch.inference_mode():
        expected = whole.model.layers[0].mlp.experts(x, index, weights).float()
        got = sharded.model.layers[0].mlp.experts(x, index, weights).float()
    return float((got - expected).norm() / expected.norm())


def attention_sinks(rank: int, world: int, root: str) -> dict:
    """GPT-OSS (a learned logit per head added to the scores; biased experts kept whole) sharded by AutoTP, and a meta
    model of it filled from its Hugging Face checkpoint (AutoTP tracing the meta model's experts)."""
    ref = reference(build("gpt_oss"))
    model, _, _ = shard(build("gpt_oss"), world)
    from_hf = from_hf_checkpoint("gpt_oss", rank, world, root)
    return {**compare(model, ref), "sinks": tuple(model.model.layers[0].self_attn.sinks.shape),
            "from_hf": compare(from_hf, ref)}


def grain_roundtrip(rank: int, world: int, root: str) -> dict:
    """Shards saved at tp_grain_size 32 where it splits the MLP and the vocabulary otherwise than the default 64 (96
    columns: 64 + 32 against 48 + 48; 160 rows: 96 + 64 against 80 + 80) reload at the saved grain without naming it;
    naming 64 raises before any change."""
    family, overrides, saved = "llama", {"intermediate_size": 96, "vocab_size": 160}, f"{root}/grain/tp"
    ref = reference(build(family, **overrides))
    model, _, _ = shard(build(family, **overrides), world, tensor_parallel={"tp_grain_size": 32},
                        save_mp_checkpoint_path=saved)
    again, _, _ = shard(build(family, meta=True, **overrides), world, checkpoint=f"{saved}/splice_tp.json")
    other = error_of(lambda: shard(build(family, meta=True, **overrides), world, checkpoint=saved,
                                   tensor_parallel={"tp_grain_size": 64}))
    return {"mlp_columns": model.model.layers[0].mlp.gate_proj.weight.shape[0],
            "vocab_rows": (model.lm_head.linear.weight.shape[0], again.lm_head.linear.weight.shape[0]),
            "saved": compare(model, ref),
            "reloaded": compare(again, ref), "other_grain": other}


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
            "grain": grain_roundtrip(rank, world, root), "experts": experts_roundtrip(rank, world, root),
            "sinks": attention_sinks(rank, world, root),
            "fused": fused_pipeline(rank, world),
            "fused_families": fused_pipeline(rank, world, TP_VARIANTS),
            "fused_extra": {**fused_sampling_and_packing(rank, world),
                            "checkpoint": fused_from_checkpoint(rank, world, root),
                            "compiled": compiled_decode(rank, world)},
            "sampled": sampling(rank, world), "reseeded": reseeded_after_init(rank, world),
            "quantized": quantized_parity(rank, world), "gptq": gptq_calibration(rank, world),
            "pipeline": pipeline_parity(rank, world), "hf_generate": hf_generate_fallback(rank, world),
            "encoders": encoder_parity(rank, world)}


def tp3_suite(rank: int, world: int, cases: list) -> dict:
    """Everything the tests run at tp=3, in one set of processes."""
    return {"parity": parity(rank, world, cases), "fused": fused_pipeline(rank, world),
            "fused_families": fused_pipeline(rank, world, TP3_VARIANTS),
            "hf_generate": hf_generate_fallback(rank, world, ("llama",), {"beams": HF_ONLY_OPTIONS["beams"]}),
            "not_divisible": error_of(lambda: shard(build("llama"), 2)),
            "encoders": encoder_parity(rank, world, ("inject",))}


def error_of(case) -> str:
    """The ValueError/TypeError ``case()`` raises, as text ("no error" if none)."""
    try:
        case()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def raise_after_parity(rank: int, world: int) -> None:
    """Shard, check parity, then rank 1 raises while rank 0 enters a collective: both must end, not hang."""
    model = build("llama")
    ref = reference(model)
    model, _, _ = shard(model, world)
    result = compare(model, ref)
    assert result["tokens_equal"] and result["max_diff"] < 1e-4, result
    print(f"PARITY ok rank {rank}", flush=True)
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    reference(model)


def sampling(rank: int, world: int) -> list[int]:
    """Ranks seeded differently still sample the same tokens: the step gives every rank rank 0's RNG state."""
    torch.manual_seed(1234 + rank)
    model, _, _ = shard(build("llama"), world)
    with torch.no_grad():
        out = model.generate(torch.tensor(PROMPT), do_sample=True, top_k=0, max_new_tokens=8, pad_token_id=0)
    return out[0].tolist()


def reseeded_after_init(rank: int, world: int) -> dict:
    """A user who reseeds each rank differently *after* init_inference still gets the same samples on every rank:
    engine.generate gives all ranks rank 0's random state before each request. Also the engine's ``mp_group`` (a
    group of the whole world here), as DeepSpeed's engine gives it."""
    import torch.distributed as dist

    import splice

    engine = splice.init_inference(build("llama"), tensor_parallel={"tp_size": world})
    torch.manual_seed(4321 + rank)
    out = engine.generate(torch.tensor(PROMPT), do_sample=True, top_k=0, max_new_tokens=8, pad_token_id=0)
    group = engine.mp_group
    return {"tokens": out[0].tolist(), "group_size": None if group is None else dist.get_world_size(group)}


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
    model, _, _ = shard(build("llama"), world)
    report = quantize(model, qconfig)
    o_proj = model.model.layers[0].self_attn.o_proj
    return {**compare(model, ref), "wrapper_kept": isinstance(o_proj, RowParallelLinear),
            "inner": type(o_proj.linear).__name__, "quantized": len(report.quantized)}


def gptq_calibration(rank: int, world: int) -> dict:
    """GPTQ under tensor parallelism: each rank calibrates its shard on the same ids (greedy tokens as the fp32
    model's); ids that differ on one rank make every rank raise, each model left as it was."""
    import splice

    def engine(ids):
        return splice.init_inference(model, tensor_parallel={"tp_size": world}, max_out_tokens=64,
                                     replace_with_kernel_inject=True,
                                     quant={"enabled": True, "weight": {"num_bits": 4, "group_size": 32,
                                                                        "calibration_ids": ids}})

    same = torch.arange(3, 3 + 2 * 16).reshape(2, 16)
    model = build("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    error = error_of(lambda: engine(same + rank))  # rank 1's ids are other tokens
    unchanged = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    ref = reference(build("llama"))
    quantized = compare(engine(same), ref)
    return {"error": error, "unchanged": unchanged, **quantized}


def pipeline_parity(rank: int, world: int) -> dict:
    """The whole splice pipeline (dtype -> load -> shard -> ... -> compile) with the ParallelContext that
    init_inference is to build with splice.distributed.build_parallel_context."""
    from splice.config import resolve_config
    from splice.distributed import build_parallel_context
    from splice.pipeline import run_pipeline
    from splice.plan import resolve

    model = build("qwen2")
    ref = reference(model)
    config = resolve_config({"tensor_parallel": {"tp_size": world}, "dtype": "fp32", "device": "cpu"})
    plan = resolve(config, model, build_parallel_context(config, "cpu"), torch.device("cpu"))
    stage, reports = run_pipeline(model, plan)
    return {**compare(stage.model, ref), "steps": [report.step for report in reports]}


#: kernel-injection TP: every family with a fused-block record (tests.arch.tiny_models), new tokens per row
FUSED_NEW_TOKENS = 12
#: variants of the other fused families run at tp=2: per-head and multi-query fused q/k/v (the shared K/V head
#: replicated), Conv1D, post-norm with OPT's projections, ALiBi, soft-capping, a multimodal model's language part
#: (its vision tower replicated); at tp=3 (uneven heads) the
#: multi-query, per-KV-group (a group's query heads split over two ranks) and ALiBi ones (each rank's slopes follow
#: its heads)
TP_VARIANTS = ("gpt_neox", "gpt2", "opt:post_norm", "falcon", "falcon:alibi", "bloom", "gemma2", "gemma3",
               "gpt_bigcode", "phi", "gptj", "gemma3_text", "gpt_neo", "olmo", "starcoder2", "stablelm", "granite",
               "cohere", "cohere2", "granitemoe", "gpt_oss", *MOE_FAMILIES)
TP3_VARIANTS = ("falcon", "falcon:new_architecture", "falcon:alibi", "bloom", "gpt_neox", "gpt2", "opt:post_norm",
                "gemma2", "gemma3", "gpt_bigcode", "phi", "gptj", "gemma3_text", "gpt_neo", "olmo", "starcoder2",
                "stablelm:parallel", "cohere", "cohere2", "gpt_oss", *MOE_FAMILIES)


def fused_pipeline(rank: int, world: int, families: tuple | None = None) -> dict:
    """``init_inference(model, tensor_parallel={"tp_size": world}, replace_with_kernel_inject=True)`` on each family
    with a fused-block record, against the single-process unmodified HF model (built from the same seed on every
    rank): logits through the HF forward and through splice's native path, greedy tokens of ``engine.generate`` (the
    native loop) on a left-padded batch, all-reduces per forward counted at ``torch.distributed.all_reduce``."""
    import splice
    from tests.arch.tiny_models import FAMILIES as INJECT_FAMILIES, build_family, padded_batch

    out = {}
    from splice.arch import lookup, model_dims

    for family in families or INJECT_FAMILIES:
        model = build_family(family)
        ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(7))
        prompt, mask = padded_batch(batch=3, length=10)
        options = dict(max_new_tokens=FUSED_NEW_TOKENS, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            ref_logits = model(ids).logits
            ref_tokens = model.generate(prompt, attention_mask=mask, **options)
        engine = splice.init_inference(model, tensor_parallel={"tp_size": world}, replace_with_kernel_inject=True,
                                       max_out_tokens=64)
        runtime = engine.runtime
        with count_collectives() as counts:
            native = native_logits(runtime, ids)
        with count_collectives() as embed_counts:
            runtime.embed(ids)
        tokens = engine.generate(prompt, attention_mask=mask, **options)
        scale = ref_logits.std()
        block = runtime.blocks[0]
        dims = model_dims(lookup(model.config), model.config)  # read after sharding: the config is left as it was
        out[family] = {
            "hf_forward": float((engine(ids).logits - ref_logits).abs().max() / scale),
            "native": float((native - ref_logits).abs().max() / scale),
            "tokens_equal": bool(torch.equal(tokens, ref_tokens)), "native_loop": runtime._cache is not None,
            "all_reduce": counts["all_reduce"], "embed_all_reduce": embed_counts["all_reduce"],
            "all_gather": counts["all_gather"], "layers": len(runtime.blocks),
            "shape": (block.shape.n_heads, block.shape.n_kv_heads),
            "modules": [type(m).__name__ for m in (runtime.embed, runtime.lm_head, block.o, block.down)],
            "shared_expert": hasattr(block.moe, "shared_expert"),
            "config_heads": (dims.n_heads, dims.n_kv_heads),
            "tied": runtime.lm_head.linear.weight is runtime.embed.weight}
    return out


#: (encoder, task head) run at tp=2, kernel-injected and through AutoTP
TP_ENCODERS = (("bert", "masked_lm"), ("roberta", "base"), ("distilbert", "sequence_classification"))


ENCODER_MODES = {"inject": {"replace_with_kernel_inject": True}, "autotp": {"replace_with_kernel_inject": False},
                 "inject_int8": {"replace_with_kernel_inject": True, "dtype": torch.int8}}


def encoder_parity(rank: int, world: int, modes: tuple[str, ...] = tuple(ENCODER_MODES)) -> dict:
    """Each encoder with a task head, sharded (``replace_with_kernel_inject`` True: the record's plan and fused
    blocks; False: AutoTP's plan on the model's own layers), against the single-process unmodified model on a
    right-padded batch: the task's output (real tokens only), the blocks' per-rank heads and all-reduces per forward,
    and an int8 engine's agreement."""
    import splice
    from splice.layers.block import SpliceBlock
    from tests.arch.tiny_models import build_encoder, padded_batch

    ids, mask = padded_batch(batch=3, length=12, side="right")
    out = {}
    for name, task in TP_ENCODERS:
        key = "last_hidden_state" if task == "base" else "logits"
        real = slice(None) if task == "sequence_classification" else mask.bool()
        for mode in modes:
            config = ENCODER_MODES[mode]
            model = build_encoder(name, task)
            with torch.no_grad():
                expected = model(ids, attention_mask=mask)[key][real]
            engine = splice.init_inference(model, tensor_parallel={"tp_size": world}, **config)
            with count_collectives() as counts, torch.no_grad():
                got = engine(ids, attention_mask=mask)[key][real].float()
            blocks = [m for m in engine.module.modules() if isinstance(m, SpliceBlock)]
            out[(name, mode)] = {
                "error": float((got - expected).abs().max() / expected.std()),
                "relative": float((got - expected).norm() / expected.norm()),
                "blocks": len(blocks), "shape": [(b.shape.n_heads, b.shape.n_kv_heads) for b in blocks],
                "row_parallel": [type(m).__name__ for b in blocks for m in (b.o, b.down)],
                "all_reduce": counts["all_reduce"], "runtime": engine.runtime is not None}
    return out


def native_logits(runtime, ids: torch.Tensor) -> torch.Tensor:
    """All positions' logits of an unpadded batch through splice's native forward (a fresh cache)."""
    cache = runtime.new_cache(ids.shape[0])
    cache.start(torch.ones_like(ids))
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.inference_mode():
        return runtime.forward(ids, positions, cache.slot_ids[: ids.shape[1]], cache, ids.shape[1], last_only=False,
                               dense=True)


class count_collectives:
    """Counts ``torch.distributed.all_reduce`` / ``all_gather`` calls inside the ``with`` (ParallelContext calls them
    through the module attribute, so wrapping it sees every call)."""

    def __enter__(self) -> dict:
        import torch.distributed as dist

        self.counts = {"all_reduce": 0, "all_gather": 0}
        self.saved = {name: getattr(dist, name) for name in self.counts}
        for name, fn in self.saved.items():
            setattr(dist, name, self._counting(name, fn))
        return self.counts

    def _counting(self, name, fn):
        def wrapper(*args, **kwargs):
            self.counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def fused_sampling_and_packing(rank: int, world: int) -> dict:
    """Ranks seeded differently before init_inference sample the same tokens in the native loop; bf16 blocks packed
    for oneDNN keep the row-parallel all-reduce (only the inner linear is packed) and still match fp32."""
    import splice
    from tests.arch.tiny_models import build_family

    torch.manual_seed(1234 + rank)
    engine = splice.init_inference(build_family("llama"), tensor_parallel={"tp_size": world},
                                   replace_with_kernel_inject=True, max_out_tokens=64)
    sampled = engine.generate(torch.tensor(PROMPT), do_sample=True, top_k=0, max_new_tokens=8, pad_token_id=0)
    reference = build_family("llama")
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        ref_logits = reference(ids).logits
    engine = splice.init_inference(build_family("llama", dtype=torch.bfloat16), tensor_parallel={"tp_size": world},
                                   replace_with_kernel_inject=True, max_out_tokens=64)
    block = engine.runtime.blocks[0]
    with count_collectives() as counts:
        logits = engine(ids).logits.float()
    head = engine.runtime.lm_head
    return {"sampled": sampled[0].tolist(), "o": type(block.o).__name__, "o_inner": type(block.o.linear).__name__,
            "qkv": type(block.qkv).__name__, "head": type(head).__name__, "head_inner": type(head.linear).__name__,
            "all_reduce": counts["all_reduce"],
            "bf16_error": float((logits - ref_logits).abs().max() / ref_logits.std())}


def compiled_decode(rank: int, world: int) -> dict:
    """compile_decode=True on each rank's shard: greedy tokens against HF single-process, and no graph breaks (the
    collectives are traced into the graph)."""
    import splice
    from tests.arch.tiny_models import build_family
    from torch._dynamo.utils import counters

    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        expected = build_family("llama").generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                                  do_sample=False, pad_token_id=0)
    engine = splice.init_inference(build_family("llama"), tensor_parallel={"tp_size": world},
                                   replace_with_kernel_inject=True, compile_decode=True, max_out_tokens=64)
    breaks_before = sum(counters["graph_break"].values())
    tokens = engine.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    return {"tokens_equal": torch.equal(tokens, expected), "compiled": bool(engine.runtime._compiled_keys),
            "graph_breaks": sum(counters["graph_break"].values()) - breaks_before}


def fused_from_checkpoint(rank: int, world: int, root: str) -> dict:
    """A meta model and a sharded HF safetensors checkpoint: the tensor_parallel step loads this rank's slices, then
    kernel injection fuses them (no rank holds the whole model); logits and native greedy tokens as single process."""
    import splice

    family, overrides = "llama", {"tie_word_embeddings": True}
    ref = reference(build(family, **overrides))
    engine = splice.init_inference(build(family, meta=True, **overrides), tensor_parallel={"tp_size": world},
                                   checkpoint=f"{root}/{family}/hf/model.safetensors.index.json",
                                   replace_with_kernel_inject=True, max_out_tokens=64)
    ids = torch.tensor(PROMPT)
    with torch.inference_mode():
        logits = engine(ids).logits
    tokens = engine.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    runtime = engine.runtime
    return {"max_diff": float((logits - ref[0]).abs().max()), "tokens_equal": bool(torch.equal(tokens, ref[1])),
            "injected": runtime is not None, "tied": runtime.lm_head.linear.weight is runtime.embed.weight,
            "meta_left": any(p.is_meta for p in engine.module.parameters())}


#: generate options the native loop does not implement: engine.generate must run Hugging Face's generate for them
HF_ONLY_OPTIONS = {"beams": dict(num_beams=3), "beams_return_2": dict(num_beams=3, num_return_sequences=2),
                   "beams_length_penalty": dict(num_beams=3, length_penalty=0.5, early_stopping=True),
                   "no_repeat_ngram": dict(no_repeat_ngram_size=2), "bad_words": dict(bad_words_ids=[[5], [9, 27]])}


def hf_generate_fallback(rank: int, world: int, families=("llama", "gemma"), options=None) -> dict:
    """``engine.generate`` with options only Hugging Face's generate has (beam search, ...) on a tensor-parallel model,
    plain AutoTP (HF generate directly) and kernel-injected (the native loop hands over to HF generate on the fused
    model), on a left-padded batch: tokens against the single-process HF model, beam scores and beam *sampling*
    (ranks seeded differently before init_inference) compared across ranks by the test."""
    import splice
    from tests.arch.tiny_models import build_family, padded_batch

    options = HF_ONLY_OPTIONS if options is None else options
    prompt, mask = padded_batch(batch=2, length=8)
    common = dict(attention_mask=mask, max_new_tokens=6, pad_token_id=0)
    out = {}
    for family in families:
        model = build_family(family)
        with torch.no_grad():
            refs = {k: model.generate(prompt, do_sample=False, **common, **o) for k, o in options.items()}
        for inject in (False, True):
            torch.manual_seed(4321 + rank)
            engine = splice.init_inference(build_family(family), tensor_parallel={"tp_size": world},
                                           replace_with_kernel_inject=inject, max_out_tokens=64)
            tokens = {k: engine.generate(prompt, do_sample=False, **common, **o) for k, o in options.items()}
            scored = engine.generate(prompt, num_beams=3, do_sample=False, return_dict_in_generate=True,
                                     output_scores=True, **common)
            sampled = engine.generate(prompt, num_beams=3, do_sample=True, top_k=0, **common)
            runtime = engine.runtime
            out[f"{family}/{'inject' if inject else 'autotp'}"] = {
                "equal": {k: bool(torch.equal(tokens[k], refs[k])) for k in options},
                "beam_scores": scored.sequences_scores.tolist(), "beam_sampled": sampled.tolist(),
                "injected": runtime is not None, "native_loop_ran": runtime is not None and runtime._cache is not None,
                "embedding": type(engine.module.get_input_embeddings()).__name__}
    return out


def deepspeed_seq2seq_policies() -> dict:
    """DeepSpeed's published injection policies for T5 (inference and AutoTP tutorials) and BART (DeepSpeedExamples
    inference/huggingface/text2text-generation/test-bart.py), verbatim."""
    from transformers.models.bart.modeling_bart import BartDecoderLayer, BartEncoderLayer
    from transformers.models.t5.modeling_t5 import T5Block

    return {"t5": {T5Block: ('SelfAttention.o', 'EncDecAttention.o', 'DenseReluDense.wo')},
            "bart": {BartEncoderLayer: ('.fc2', 'self_attn.out_proj'),
                     BartDecoderLayer: ('encoder_attn.out_proj', '.fc2', 'self_attn.out_proj')}}


def encoder_decoder_parity(rank: int, world: int) -> dict:
    """A tiny T5 (relative position bias, tied embeddings), BART and MVP through ``init_inference`` at tp=``world``,
    by AutoTP and (T5, BART) by DeepSpeed's published policy, against the unmodified single-process fp32 model on a
    padded batch: logits for given decoder ids (largest difference over the logits' spread), greedy tokens of
    ``engine.generate``, the per-rank share of the weights."""
    import splice
    from tests.snippet_models import byte_tokenizer, tiny_bart, tiny_t5

    batch = byte_tokenizer()(["DeepSpeed is", "The capital of France is"], return_tensors="pt", padding=True)
    options = dict(max_new_tokens=8, do_sample=False)
    out = {}
    for name, build_model in (("t5", tiny_t5), ("bart", tiny_bart), ("mvp", lambda: tiny_bart(family="mvp"))):
        model = build_model()
        with torch.no_grad():
            tokens = model.generate(**batch, **options)
            logits = model(**batch, decoder_input_ids=tokens).logits
        total = sum(p.numel() for p in model.parameters())
        policies = {"policy": {"injection_policy": deepspeed_seq2seq_policies()[name]}} if name != "mvp" else {}
        for mode, extra in {"autotp": {}, **policies}.items():
            engine = splice.init_inference(build_model(), tensor_parallel={"tp_size": world}, dtype=torch.float,
                                           **extra)
            with torch.no_grad():
                got = engine(**batch, decoder_input_ids=tokens).logits
            local = sum(p.numel() for p in engine.module.parameters())
            out[f"{name}/{mode}"] = {"error": float((got - logits).abs().max() / logits.std()),
                                     "tokens_equal": bool(torch.equal(engine.generate(**batch, **options), tokens)),
                                     "param_ratio": local / total,
                                     "source": next(r.plan_source for r in engine.reports if r.step == "shard")}
    return out


def policy_with_kernel_injection(rank: int, world: int, families=("llama", "gpt2", "falcon")) -> dict:
    """``injection_policy`` together with ``replace_with_kernel_inject=True`` (DeepSpeed refuses the pair): the
    policy's plan shards the model, then its blocks are fused; logits and greedy tokens against the unmodified
    single-process fp32 model."""
    import splice

    out = {}
    for family in families:
        model = build(family)
        ref = reference(model)
        engine = splice.init_inference(model, tensor_parallel={"tp_size": world}, replace_with_kernel_inject=True,
                                       injection_policy=policy_for(model, family), max_out_tokens=64)
        out[family] = {**compare(engine, ref), "injected": engine.runtime is not None,
                       "source": next(r.plan_source for r in engine.reports if r.step == "shard")}
    return out


def seq2seq_and_policy_injection(rank: int, world: int) -> dict:
    """The tp=2 checks of tests/tp/test_seq2seq_tp.py, in one pair of processes."""
    return {"seq2seq": encoder_decoder_parity(rank, world), "policy_inject": policy_with_kernel_injection(rank, world)}
