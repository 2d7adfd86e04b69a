"""``resolve(config, model, parallel) -> Plan``: every decision ``init_inference`` makes, and every check, up front.

The plan is frozen; the steps (``splice.steps``) only apply it and never read the raw config. Everything that can
fail on the user's input fails here, while the model is still untouched: a bad checkpoint, a family kernel injection
does not know, a quantization scheme that does not fit a layer, a tensor-parallel size that does not match the
processes, a compile option without its prerequisite.
"""
from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .arch import check_fits, model_dims, record_for, tensor_parallel_plan
from .arch.paths import misfits
from .checkpoint import (check_checkpoint, checkpoint_files, differing_tied_names, has_meta_tensors,
                         load_policy_files)
from .config import InferenceConfig, SpliceIgnoredOptionWarning, TensorParallelConfig
from .distributed import ParallelContext
from .kernel_choice import KernelChoice, attention_kernel, float_kernel, layer_kernel, quant_kernel
from .layers.block import activation, has_fused_blocks
from .layers.conv1d import in_out_features
from .native import onednn_computes_in
from .quant import QuantConfig
from .quant import plan as quant_targets
from .quant.api import check_calibration_ids, first_quantized_layer
from .tp.autotp import autotp_plan, trace_model
from .tp.loading import manifest_grain_size, manifest_plan, read_manifest
from .layers.experts import experts_features
from .tp.plan import TPPlan, experts_grain, verify
from .tp.plan import resolve as tp_rules
from .tp.split import layout_ranges, width
from .tp.policy import check_policy, policy_plan

CheckpointSource = Path | list[Path]


@dataclass(frozen=True)
class Plan:
    """Every decision, made once. ``config`` is kept for the engine's per-request checks; the steps read the fields."""

    config: InferenceConfig
    device: torch.device  # where the model computes
    home: torch.device  # where its weights live: ``device``, or the CPU with keep_module_on_host
    keep_on_host: bool  # keep_module_on_host
    parallel: ParallelContext
    dtype: torch.dtype | None  # floating weights are converted to this (None: kept)
    int8: bool  # dtype=int8: int8 weights from the quantize step, activations in ``dtype``
    checkpoint: CheckpointSource | None
    checkpoint_loader: str | None  # "load" (whole checkpoint), "shard" (each rank its slices), None (no checkpoint)
    tp_manifest: dict | None  # a splice tensor-parallel checkpoint's manifest, read once by resolve; else None
    tp_plan: TPPlan | None  # None at tp_size 1
    tp_grain_size: int
    save_shards_to: str | None
    fuse: bool  # kernel injection
    max_out_tokens: int
    quant: QuantConfig | None
    calibration_ids: torch.Tensor | None
    float_kernel: KernelChoice  # the float linears of a fused model
    quant_kernel: KernelChoice | None  # the quantized linears (None without quantization)
    attention_kernel: KernelChoice  # a fused decoder's decode-step attention
    layer_kernel: KernelChoice  # a fused decoder's decode-step blocks: native calls, or their own ops
    compile_decode: bool
    cuda_graph: bool = False

    @property
    def tp_size(self) -> int:
        return self.parallel.world_size


def resolve(config: InferenceConfig, model: nn.Module, parallel: ParallelContext, device: torch.device) -> Plan:
    """Decide and check everything; raises ``ValueError`` / ``TypeError`` naming the bad value and what is allowed."""
    tp = tensor_parallel_size(config, parallel)
    dtype = activation_dtype(config.dtype, device)
    warn_without_fp16_arithmetic(dtype or _model_float_dtype(model), device)
    checkpoint = checkpoint_source(config)
    manifest = tp_manifest(checkpoint)  # read once: every check, and the plan, see the same file
    tp_plan = resolve_tensor_parallel(config, model, tp, manifest)
    check_weights(model, checkpoint, tp, manifest)
    if config.replace_with_kernel_inject:
        check_fusable(model, config)
    quant = QuantConfig.from_inference_config(config)
    check_quantized_on_host(config, quant, device)
    calibration_ids = resolve_quantization(model, quant, config, tp_plan, tp, resolve_grain_size(config, manifest))
    check_graphs(config, device, tp)
    compute_dtype = dtype or _model_float_dtype(model)
    fused_float, fused_attention, fused_layer = fused_kernels(compute_dtype, device,
                                                              bool(config.replace_with_kernel_inject))
    return Plan(
        config=config, device=device, home=torch.device("cpu") if config.keep_module_on_host else device,
        keep_on_host=bool(config.keep_module_on_host),
        parallel=parallel, dtype=dtype, int8=config.dtype == torch.int8, checkpoint=checkpoint,
        checkpoint_loader=None if checkpoint is None else ("shard" if tp > 1 else "load"), tp_manifest=manifest,
        tp_plan=tp_plan, tp_grain_size=resolve_grain_size(config, manifest),
        save_shards_to=config.save_mp_checkpoint_path or None,
        fuse=bool(config.replace_with_kernel_inject), max_out_tokens=config.max_out_tokens, quant=quant,
        calibration_ids=calibration_ids, float_kernel=fused_float,
        quant_kernel=None if quant is None else quant_kernel(quant, device), attention_kernel=fused_attention,
        layer_kernel=fused_layer,
        compile_decode=bool(config.compile_decode), cuda_graph=bool(config.enable_cuda_graph))


def resolve_device(config: InferenceConfig) -> torch.device:
    """The device the model runs on: the configured one, else CUDA if present, else CPU."""
    if config.device is not None:
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={config.device!r} was asked for but CUDA is not available; allowed: 'cpu'")
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise ValueError(f"device={config.device!r}, but this machine has {count} CUDA device(s); allowed: "
                             f"'cuda', 'cuda:0' ... 'cuda:{count - 1}', or 'cpu'")
        return device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# ---- dtype ----------------------------------------------------------------------------------------------------------
def activation_dtype(dtype: torch.dtype | None, device: torch.device) -> torch.dtype | None:
    """The float dtype to convert to: ``dtype`` itself, or for int8 the dtype its activations run in (bf16 where the
    device supports it: torch's int8 weight-only kernels are fast only with bf16 activations)."""
    if dtype != torch.int8:
        return dtype
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16


def warn_without_fp16_arithmetic(dtype: torch.dtype | None, device: torch.device) -> None:
    """Warn when fp16 is asked of a CPU without fp16 arithmetic (no AVX512-FP16 or AVX-NE-CONVERT: AMD Zen 4, Intel
    before Sapphire Rapids): it runs correctly, through conversions, but slower than the dtype the CPU computes in."""
    if device.type != "cpu" or dtype != torch.float16 or onednn_computes_in(torch.float16):
        return
    faster = "torch.bfloat16" if onednn_computes_in(torch.bfloat16) else "torch.float32"
    warnings.warn(f"dtype=torch.float16 runs on this CPU (no AVX512-FP16 or AVX-NE-CONVERT) through conversions: "
                  f"correct, but slower than dtype={faster}, which this CPU computes in natively (without kernel "
                  "injection, prompts are several times slower)", stacklevel=4)


def _model_float_dtype(model: nn.Module) -> torch.dtype | None:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


# ---- checkpoint -----------------------------------------------------------------------------------------------------
def checkpoint_source(config: InferenceConfig) -> CheckpointSource | None:
    """What to load: ``config.checkpoint`` or ``config.checkpoint_config.checkpoint_dir`` (the same path when both are
    given, else ``ValueError``); None if neither is set.

    The root is ``config.base_dir`` or ``config.checkpoint_config.base_dir`` (the same when both are given, else
    ``ValueError``). A relative path is resolved against it; a DeepSpeed load-policy dict (``{"checkpoints": [...]}``),
    or a JSON file holding one while a root is set, becomes its list of safetensors files under the root.
    """
    checkpoint = getattr(config, "checkpoint", None)
    checkpoint_config = getattr(config, "checkpoint_config", None)
    base_dir = getattr(config, "base_dir", "") or ""
    config_base_dir = getattr(checkpoint_config, "base_dir", None) or ""
    if base_dir and config_base_dir and _under("", base_dir) != _under("", config_base_dir):
        raise ValueError(f"base_dir={base_dir!r} and checkpoint_config.base_dir={config_base_dir!r} name different "
                         "roots for the checkpoint files; allowed: one of them, or both the same path")
    base_dir = base_dir or config_base_dir
    checkpoint_dir = getattr(checkpoint_config, "checkpoint_dir", None)
    if checkpoint is None:
        checkpoint = checkpoint_dir
    elif checkpoint_dir is not None and not _same_place(base_dir, checkpoint, checkpoint_dir):
        raise ValueError(f"checkpoint={_shown(checkpoint)} and checkpoint_config.checkpoint_dir={checkpoint_dir!r} "
                         "name different checkpoints; allowed: one of them, or both naming the same path")
    if checkpoint is None:
        if base_dir:  # a root for checkpoint files, with no checkpoint to read them from
            name = "base_dir" if getattr(config, "base_dir", "") else "checkpoint_config.base_dir"
            warnings.warn(f"{name}={base_dir!r} has no effect: no checkpoint is given (checkpoint and "
                          "checkpoint_config.checkpoint_dir are None); allowed: a checkpoint to read under it, or "
                          "no base_dir", SpliceIgnoredOptionWarning, stacklevel=4)
        return None
    if isinstance(checkpoint, dict):
        return load_policy_files(checkpoint, base_dir)
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(f"checkpoint must be a path or a load-policy dict, got {type(checkpoint).__name__}: "
                        f"{checkpoint!r}")
    path = _under(base_dir, checkpoint)
    policy = _policy_in_json(path) if base_dir else None
    if policy is not None:  # as DeepSpeed: the files a checkpoints JSON lists are relative to base_dir
        return load_policy_files(policy, policy.get("base_dir") or base_dir)
    return path


def _under(base_dir: str, path: str | os.PathLike) -> Path:
    """``path`` (``~`` expanded), under ``base_dir`` when it is relative and ``base_dir`` is set."""
    path = Path(path).expanduser()
    return path if path.is_absolute() or not base_dir else Path(base_dir).expanduser() / path


def _same_place(base_dir: str, checkpoint: object, checkpoint_dir: str) -> bool:
    """Whether ``checkpoint`` is the path ``checkpoint_dir`` names (a load-policy dict is not)."""
    if not isinstance(checkpoint, (str, os.PathLike)):
        return False
    return _under(base_dir, checkpoint) == _under(base_dir, checkpoint_dir)


def _shown(value: object) -> str:
    text = repr(os.fspath(value)) if isinstance(value, os.PathLike) else repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _policy_in_json(path: Path) -> dict | None:
    """A DeepSpeed checkpoints JSON's content (``{"type": ..., "checkpoints": [...], "version": ...}``), or None for
    any other file (the checkpoint reader says what is wrong with a bad one)."""
    if path.suffix != ".json" or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "checkpoints" in data and "weight_map" not in data else None


def tp_manifest(source: CheckpointSource | None) -> dict | None:
    """A splice tensor-parallel checkpoint's manifest (``splice_tp.json``), or None."""
    return read_manifest(source) if isinstance(source, Path) else None


def check_weights(model: nn.Module, checkpoint: CheckpointSource | None, tp: int, manifest: dict | None) -> None:
    """A meta model needs a checkpoint; a whole-model checkpoint must fit the model (headers only, nothing loaded).
    ``manifest`` is the checkpoint's :func:`tp_manifest`: its per-rank shards are checked as each rank loads them."""
    if checkpoint is None:
        if has_meta_tensors(model):
            raise ValueError("the model has tensors on the meta device (no weights) and no checkpoint was given; "
                             "pass checkpoint=<safetensors folder, file or index JSON> so splice can load them, "
                             "or give a model with real weights")
        return
    if tp == 1 or manifest is None:
        match = check_checkpoint(model, checkpoint)
        if tp > 1:
            check_ties_hold(model, checkpoint, match)


def check_ties_hold(model: nn.Module, checkpoint: CheckpointSource, match) -> None:
    """Sharded loading reads one tensor for each group of tied names, so a checkpoint holding tied names with
    different values (saved from an untied model), which tp_size 1 unties as transformers does, is refused."""
    differing = differing_tied_names(model, checkpoint_files(checkpoint), match.names)
    if differing:
        pairs = "; ".join(f"{name} differs from {kept}" for name, kept in differing.items())
        raise ValueError(f"checkpoint {str(checkpoint)!r} holds tied tensors with different values ({pairs}), which "
                         "sharded loading cannot untie; allowed: tie_word_embeddings=False in the model's config "
                         "(the model built untied), or tensor_parallel.tp_size=1")


# ---- tensor parallelism ---------------------------------------------------------------------------------------------
def tensor_parallel_size(config: InferenceConfig, parallel: ParallelContext) -> int:
    """The effective tensor-parallel size; the config and the parallel context must agree."""
    wanted, have = config.tensor_parallel.tp_size, parallel.world_size
    given_group = config.tensor_parallel.tp_group is not None or config.tensor_parallel.mpu is not None
    if wanted != have and not (given_group and wanted == 1):
        raise ValueError(f"tensor_parallel.tp_size={wanted}, but this process's parallel context has {have} rank(s); "
                         f"launch {wanted} processes with `torchrun --nproc-per-node {wanted}` so init_inference can "
                         "build the group, or pass tp_group")
    return have


def resolve_tensor_parallel(config: InferenceConfig, model: nn.Module, tp: int,
                            manifest: dict | None) -> TPPlan | None:
    """The verified plan at ``tp`` ranks (None at 1): the stored one of a tensor-parallel checkpoint's ``manifest``
    (:func:`tp_manifest`), else the injection_policy's, else with kernel injection the family record's, else AutoTP's
    (as DeepSpeed: its injection containers carry their own policies, AutoTP serves the models it does not inject). A
    mixture of experts' record leaves its plan to AutoTP, which reads each layer's MLP module as it is (experts split
    by their features, routers whole, a dense layer's MLP by columns and rows).
    An injection_policy is checked in every case: at tp 1 it then warns (it has no effect), with a manifest it must
    give the stored plan's split. A manifest's shards load only at the tp_size they were saved for, 1 included.
    Any injection_policy but None counts as given: an empty one raises (it names nothing to shard)."""
    policy = config.injection_policy
    if policy is not None:
        check_policy(policy)  # before any trace: an empty dict raises here, as a bad class or name does below
    if tp == 1:
        if manifest is not None:
            manifest_plan(manifest, tp)  # raises unless the checkpoint was saved for one rank
        if config.save_mp_checkpoint_path:
            raise ValueError(f"save_mp_checkpoint_path={config.save_mp_checkpoint_path!r} writes tensor-parallel "
                             "shards and needs tensor_parallel.tp_size > 1; at tp_size=1 save the model with "
                             "save_pretrained instead")
        grain, default_grain = config.tensor_parallel.tp_grain_size, _default_grain_size()
        if grain != default_grain:
            warnings.warn(f"tensor_parallel.tp_grain_size={grain} has no effect at tensor_parallel.tp_size=1: it "
                          "rounds the per-rank sizes of split layers, and nothing is split; allowed: tp_size > 1, or "
                          f"tp_grain_size={default_grain}", SpliceIgnoredOptionWarning, stacklevel=4)
        if policy is not None:
            # Checked as at tp > 1 (bad classes and names raise), then warned about: neither kernel injection nor
            # anything else reads the policy at one rank; DeepSpeed, too, only slices its linears at mp_size > 1.
            checked_policy_plan(model, policy, tp)
            warnings.warn(f"injection_policy={_policy_text(policy)} has no effect at "
                          "tensor_parallel.tp_size=1: it only says which linears to shard, which needs tp_size > 1; "
                          "remove it, or launch with tp_size > 1", SpliceIgnoredOptionWarning, stacklevel=4)
        return None
    if config.save_mp_checkpoint_path:
        check_shard_folder(config.save_mp_checkpoint_path)
    if manifest is not None:
        plan = manifest_plan(manifest, tp)
        if policy is not None:
            check_policy_fits_manifest(checked_policy_plan(model, policy, tp), plan, manifest, policy)
    elif policy is not None:
        plan = policy_plan(model, policy, trace_model(model))
    elif config.replace_with_kernel_inject and record_for(model).moe is None:
        plan = tensor_parallel_plan(record_for(model), model.config)
    else:
        plan = autotp_plan(model, trace_model(model))
    verify(plan, model, tp)
    return plan


def resolve_grain_size(config: InferenceConfig, manifest: dict | None) -> int:
    """tensor_parallel.tp_grain_size, or the one the shards of a tensor-parallel checkpoint's ``manifest`` were cut
    with."""
    grain = config.tensor_parallel.tp_grain_size
    if manifest is None:
        return grain
    return manifest_grain_size(manifest, grain, "tp_grain_size" in config.tensor_parallel.model_fields_set)


def _default_grain_size() -> int:
    return TensorParallelConfig.model_fields["tp_grain_size"].default


def check_shard_folder(path: str) -> None:
    """``save_mp_checkpoint_path`` must be a folder or become one (created when the shards are written): checked
    here, before any step changes the model, rather than failing in the shard step."""
    folder = Path(path).expanduser()
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"save_mp_checkpoint_path={path!r}: {str(existing)!r} is a file; allowed: a folder, or a path "
                         "whose existing part is a folder (the rest is created)")


def checked_policy_plan(model: nn.Module, policy: dict, tp: int) -> TPPlan:
    """The verified plan of ``injection_policy`` ``policy`` at ``tp`` ranks; traces one forward, shards nothing."""
    plan = policy_plan(model, policy, trace_model(model))
    verify(plan, model, tp)
    return plan


def check_policy_fits_manifest(wanted: TPPlan, stored: TPPlan, manifest: dict, policy: dict) -> None:
    """A saved tensor-parallel checkpoint's shards are cut by its stored plan, so a policy asking for another split
    cannot be honoured from it: raise naming both (the same split is fine)."""
    def differences(label: str, stored_map: dict, wanted_map: dict) -> list[str]:
        return [f"{label}{k}: stored {stored_map.get(k)}, policy {wanted_map.get(k)}"
                for k in dict.fromkeys([*stored_map, *wanted_map]) if stored_map.get(k) != wanted_map.get(k)]

    differ = differences("", stored.rules, wanted.rules) + differences("attention ", stored.attention, wanted.attention)
    if differ:
        raise ValueError(f"checkpoint {manifest['folder']!r} holds shards cut by its stored tensor-parallel plan "
                         f"({stored.source}), which splits differently from injection_policy="
                         f"{_policy_text(policy)}: {'; '.join(differ[:4])}"
                         f"{f'; ... ({len(differ) - 4} more)' if len(differ) > 4 else ''}; allowed: no "
                         "injection_policy (the stored plan is used), or the original unsharded checkpoint to shard "
                         "by the policy")


def _policy_text(policy: object) -> str:
    """``{LlamaDecoderLayer: ('self_attn.o_proj',)}``: an injection_policy with its classes by name."""
    if not isinstance(policy, dict):
        return _shown(policy)
    return "{" + ", ".join(f"{getattr(k, '__name__', repr(k))}: {v!r}" for k, v in policy.items()) + "}"


def describe_tensor_parallel(model: nn.Module, tp_size: int, injection_policy: dict | None = None) -> str:
    """The plan splice would apply at ``tp_size`` (for ``splice info --tp N``); runs nothing distributed."""
    trace = trace_model(model)
    plan = policy_plan(model, injection_policy, trace) if injection_policy is not None else autotp_plan(model, trace)
    verify(plan, model, tp_size)
    return plan.describe()


# ---- kernel injection -----------------------------------------------------------------------------------------------
#: The kernels of a model left as it is (no kernel injection): its own layers, on torch's kernels.
UNFUSED = KernelChoice("torch", "not fused (replace_with_kernel_inject=False): the model's own layers")


def fused_kernels(dtype: torch.dtype | None, device: torch.device,
                  fuse: bool) -> tuple[KernelChoice, KernelChoice, KernelChoice]:
    """(float linears, decode-step attention, decode-step blocks) of a kernel-injected model. A model left as it is
    keeps its own layers, which never run splice's native kernels: nothing is chosen for it, so nothing is built for
    it either."""
    if not fuse:
        return UNFUSED, UNFUSED, UNFUSED
    return float_kernel(dtype, device), attention_kernel(dtype, device), layer_kernel(dtype, device)


def splice_replaced_layer(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The first submodule of ``model`` that is one of splice's own layers (a quantized, sharded or native linear
    an earlier ``init_inference`` put in), with its name; None for a model as transformers builds it."""
    return next(((name, module) for name, module in model.named_modules()
                 if type(module).__module__.startswith("splice.")), None)


def check_fusable(model: nn.Module, config: InferenceConfig) -> None:
    """A known family, an activation and rope the fused block supports, no decode-step option for an encoder (meta
    weights are fine: they are loaded before fusing)."""
    model_config = getattr(model, "config", None)
    if model_config is None:
        raise TypeError(f"kernel injection needs a transformers model with a .config, got {type(model).__name__}")
    if has_fused_blocks(model):
        raise ValueError(f"this {type(model).__name__} was already kernel-injected by an earlier init_inference (its "
                         "layers are splice's fused blocks); allowed: the original model, or the engine that call "
                         "returned")
    replaced = splice_replaced_layer(model)
    if replaced:
        name, module = replaced
        raise ValueError(f"this {type(model).__name__} was already changed by splice (an earlier init_inference or "
                         f"splice.quant.quantize: {name} is splice's {type(module).__name__}), and kernel injection "
                         "fuses the original model's layers; allowed: the original model, with every option in one "
                         "init_inference call, or the engine that call returned")
    record = record_for(model)
    check_fits(record, model_config)
    if record.encoder and config.compile_decode:
        raise ValueError(f"compile_decode=True compiles the decode step of a generating model, but model_type="
                         f"{record.model_type!r} is an encoder (no generate, no decode step); allowed: "
                         "compile_decode=False for it")
    dims = model_dims(record, model_config)
    wrong = misfits(record, dims, model)
    if wrong:
        raise ValueError(f"kernel injection cannot fuse this {record.model_type} model, whose layout is not the one "
                         f"its record describes: {'; '.join(wrong)}; use replace_with_kernel_inject=False for it")
    activation(dims.activation)
    if dims.position_limit is not None and config.max_out_tokens > dims.position_limit:
        raise ValueError(f"max_out_tokens={config.max_out_tokens} exceeds the {dims.position_limit} learned positions "
                         f"of this {record.model_type} model; allowed: max_out_tokens <= {dims.position_limit}")
    if config.max_out_tokens > dims.rope.max_positions:
        raise ValueError(f"max_out_tokens={config.max_out_tokens} exceeds {dims.rope.max_positions}, past which "
                         f"rope_type={dims.rope.rope_type!r} rescales itself; allowed: max_out_tokens <= "
                         f"{dims.rope.max_positions}")


# ---- quantization ---------------------------------------------------------------------------------------------------
def resolve_quantization(model: nn.Module, quant: QuantConfig | None, config: InferenceConfig,
                         tp_plan: TPPlan | None = None, tp: int = 1, grain: int = 1) -> torch.Tensor | None:
    """Check the scheme against every linear it would replace (each rank's shard of it under ``tp_plan``); return the
    GPTQ calibration ids, if any."""
    if quant is None:
        return None
    check_not_requantized(model, quant)
    targets, _ = quant_targets(model, quant)
    if tp_plan is not None:
        check_quantized_shards(model, targets, quant, tp_plan, tp, grain)
    ids = config.quant.weight.calibration_ids
    return None if ids is None else check_calibration_ids(ids, quant, model)


def check_not_requantized(model: nn.Module, quant: QuantConfig) -> None:
    """Quantizing a model splice has already quantized would leave its quantized layers as they are (they are not
    linears) and report the new scheme: refused, naming one."""
    quantized = first_quantized_layer(model)
    if quantized is None:
        return
    name, module = quantized
    raise ValueError(f"quantization ({quant.kind}) asked for a model splice has already quantized (an earlier "
                     f"init_inference or splice.quant.quantize: {name} is {type(module).__name__}); allowed: the "
                     "float model, or no quantization options (a float dtype, quant disabled) to run this one as it is")


def check_quantized_shards(model: nn.Module, targets: list[tuple[str, nn.Module]], quant: QuantConfig,
                           tp_plan: TPPlan, tp: int, grain: int) -> None:
    """Each rank quantizes its own shard (the quantize step runs after shard), so a row-parallel linear's scheme must
    fit every rank's share of its inputs, not only its whole width: checked for each rank's share as the shard step
    will cut it, before the model changes."""
    rules = tp_rules(tp_plan, model)
    for name, module in targets:
        rule = rules.get(name)
        if rule is None or rule.style != "row":
            continue
        in_features = in_out_features(module)[0]
        shares = [width(layout_ranges(rule.layout, in_features, tp, rank, rule.heads, grain)) for rank in range(tp)]
        _check_shares(quant, shares, lambda rank, share: (
            f"layer {name} is split by its inputs over tensor_parallel.tp_size={tp} ranks (row-parallel), and rank "
            f"{rank} quantizes {share} of its {in_features}"))
    for name, rule in rules.items():  # experts: each expert's down projection on the rank's share of its features
        if rule.style == "experts":
            features = experts_features(model.get_submodule(name))
            unit = experts_grain(features, tp, grain)
            shares = [width(layout_ranges("plain", features, tp, rank, None, unit)) for rank in range(tp)]
            _check_shares(quant, shares, lambda rank, share: (
                f"the experts of {name} are split by their {features} intermediate features over "
                f"tensor_parallel.tp_size={tp} ranks, and rank {rank} quantizes each expert's down projection on "
                f"{share} of them"))


def _check_shares(quant: QuantConfig, shares: list[int], what: Callable[[int, int], str]) -> None:
    """Raise, saying ``what(rank, share)`` and why, where the scheme's groups do not fit a rank's share of inputs."""
    for rank, share in enumerate(shares):
        try:
            quant.group_for(share)
        except ValueError as error:
            raise ValueError(f"{what(rank, share)}: {error}") from None


def check_quantized_on_host(config: InferenceConfig, quant: QuantConfig | None, device: torch.device) -> None:
    """keep_module_on_host with quantization on an accelerator raises: no packing fits both places the weights are.
    The quantize step packs each weight on the device the model computes on, for that device's kernels (it needs the
    weight there to do so); keep_module_on_host then moves it back to the CPU, where the engine as returned runs it.
    int4's layout differs between CPU and CUDA (a layer refuses to run on the other), so int4 packed for CUDA cannot
    run on the CPU, and packed for the CPU could not run on CUDA once moved there; int8 would run on the CPU on the
    kernels chosen for the accelerator. A float model is fine: its weights and torch's kernels run on either."""
    if quant is None or not config.keep_module_on_host or device.type == "cpu":
        return
    raise ValueError(f"keep_module_on_host=True with quantization ({quant.kind}) on device {str(device)!r}: "
                     f"quantizing packs the weights on {device.type} for its kernels, then keep_module_on_host would "
                     "move them to the CPU, where the model as returned runs (int4 packed for CUDA cannot run there, "
                     f"int8 would run on kernels chosen for {device.type}); allowed: keep_module_on_host=False "
                     f"(quantized for and placed on {str(device)!r}), device='cpu' (quantized for the CPU and kept "
                     "there), or keep_module_on_host=True without quantization")


# ---- graphs ---------------------------------------------------------------------------------------------------------
def check_graphs(config: InferenceConfig, device: torch.device, tp: int) -> None:
    """compile_decode compiles splice's own decode step, so it needs kernel injection; CUDA graphs need the model on
    a CUDA device, one rank (a graph would capture one rank's collectives) and its weights there."""
    if config.enable_cuda_graph:
        if device.type != "cuda":
            raise ValueError(f"enable_cuda_graph=True on device {str(device)!r}: CUDA graphs need a CUDA device; "
                             "allowed: enable_cuda_graph=False (on the CPU compile_decode=True compiles the decode "
                             "step instead), or device='cuda'")
        if tp > 1:
            raise ValueError(f"enable_cuda_graph=True with tensor_parallel.tp_size={tp}: CUDA graphs are not "
                             "supported with tensor parallelism; allowed: tp_size=1, or enable_cuda_graph=False")
        if config.keep_module_on_host:
            raise ValueError("enable_cuda_graph=True with keep_module_on_host=True: a graph replays on weights "
                             "that stay on the GPU; allowed: one of the two")
    if config.compile_decode and not config.replace_with_kernel_inject:
        raise ValueError("compile_decode=True compiles splice's own decode step, which needs "
                         "replace_with_kernel_inject=True; allowed: replace_with_kernel_inject=True, or "
                         "compile_decode=False")
