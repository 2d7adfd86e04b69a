"""splice's inference configuration: every key of DeepSpeed's ``DeepSpeedInferenceConfig``, checked and explained.

A DeepSpeed user only changes the import: the same dict, JSON file or keyword arguments work. Each option is either
honoured by a pipeline stage, accepted with a warning that it has no effect in splice, or rejected as unsupported;
``FIELD_SUPPORT`` says which. ``resolve_config`` merges a dict / JSON file / ``InferenceConfig`` with keyword
arguments. Validation never writes into the objects the user passed in. As in DeepSpeed, a top-level value
``"auto"`` asks for the key's default.

``python -m splice.config`` prints the reference table (the one in docs/configuration.md).
"""
from __future__ import annotations

import difflib
import json
import os
import sys
import sysconfig
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, NamedTuple, get_args, get_origin

import pydantic
import torch
from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, field_validator,
                      model_validator)
from pydantic.fields import FieldInfo


class SpliceDeprecationWarning(FutureWarning):
    """A deprecated DeepSpeed option name was used; its value was moved to the new place."""


class SpliceIgnoredOptionWarning(UserWarning):
    """An option was set to a non-default value that has no effect in splice."""


HONOURED, IGNORED, UNSUPPORTED = "honoured", "ignored", "unsupported"

#: A top-level value that stands for the key's default, as in DeepSpeed's config models.
AUTO = "auto"

#: What splice does with each option (dotted path; a section's entry covers its fields unless they have their own).
#: honoured: a pipeline stage reads it (and raises "not yet" for what isn't built).
#: ignored: a non-default value warns with ``SpliceIgnoredOptionWarning``.
#: unsupported: a non-default value raises ``ValueError`` saying why.
FIELD_SUPPORT: dict[str, str] = {
    "replace_with_kernel_inject": HONOURED,
    "dtype": HONOURED,
    "tensor_parallel": HONOURED,
    "enable_cuda_graph": HONOURED,
    "compile_decode": HONOURED,
    "use_triton": IGNORED,
    "triton_autotune": IGNORED,
    "zero.enabled": UNSUPPORTED,
    "zero.stage": UNSUPPORTED,
    "triangular_masking": IGNORED,
    "moe.enabled": UNSUPPORTED,
    "moe.ep_size": IGNORED,
    "moe.moe_experts": IGNORED,
    "moe.type": IGNORED,
    "moe.ep_mp_group": IGNORED,
    "moe.ep_group": IGNORED,
    "keep_module_on_host": HONOURED,
    "quant": HONOURED,
    "quant.weight.quantized_initialization": IGNORED,
    "quant.weight.post_init_quant": IGNORED,
    "checkpoint": HONOURED,
    "base_dir": HONOURED,
    "set_empty_params": IGNORED,
    "save_mp_checkpoint_path": HONOURED,
    "checkpoint_config": HONOURED,
    "checkpoint_config.save_mp_checkpoint_path": IGNORED,
    "return_tuple": IGNORED,
    "training_mp_size": UNSUPPORTED,
    "replace_method": IGNORED,
    "injection_policy": HONOURED,
    "injection_policy_tuple": IGNORED,
    "config": IGNORED,
    "max_out_tokens": HONOURED,
    "min_out_tokens": IGNORED,
    "transposed_mode": IGNORED,
    "device": HONOURED,
}

#: Deprecated top-level DeepSpeed names and where their value now lives.
DEPRECATED: dict[str, str] = {
    "mp_size": "tensor_parallel.tp_size",
    "mpu": "tensor_parallel.mpu",
    "ep_size": "moe.ep_size",
    "ep_group": "moe.ep_group",
    "expert_group": "moe.ep_group",
    "ep_mp_group": "moe.ep_mp_group",
    "expert_mp_group": "moe.ep_mp_group",
    "moe_experts": "moe.moe_experts",
    "moe_type": "moe.type",
}

#: Top-level keys DeepSpeed's init_inference rejects too, which its users still pass: one it removed (its inference
#: tutorial still shows it) and deepspeed.initialize's training keys; each with what to give init_inference instead.
_TRAINING_KEY = "it is a deepspeed.initialize (training) key, which init_inference does not take"
FOREIGN_KEYS: dict[str, str] = {
    "quantization_setting": "DeepSpeed's init_inference no longer takes it either; quantize with dtype=torch.int8 "
                            "and quant={'weight': {'q_groups': N}} (MoQ's mlp_extra_grouping has no counterpart)",
    "fp16": f"{_TRAINING_KEY}; use dtype=torch.float16",
    "bf16": f"{_TRAINING_KEY}; use dtype=torch.bfloat16",
    "zero_optimization": f"{_TRAINING_KEY}; splice does not implement ZeRO-Inference (the 'zero' section)",
    "train_batch_size": f"{_TRAINING_KEY}; the batch is the input's first dimension",
    "train_micro_batch_size_per_gpu": f"{_TRAINING_KEY}; the batch is the input's first dimension",
}

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "bfloat": torch.bfloat16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "int8": torch.int8,
}
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8)
_DEVICE_TYPES = ("cpu", "cuda")
_DTYPE_HELP = "torch.float32/float16/bfloat16/int8 or one of 'fp32', 'float32', 'float', 'fp16', 'float16', " \
              "'half', 'bf16', 'bfloat16', 'int8' (any case, 'torch.' prefix allowed)"


def parse_dtype(value: Any) -> torch.dtype | None:
    """A supported ``torch.dtype`` from a dtype or its name; None stays None."""
    if value is None or value in _DTYPES:
        return value
    if isinstance(value, str):
        name = value.strip().lower().removeprefix("torch.")
        if name in _DTYPE_NAMES:
            return _DTYPE_NAMES[name]
    raise ValueError(f"{value!r} is not a supported dtype; allowed: {_DTYPE_HELP}")


def _note(deepspeed: str) -> dict[str, str]:
    """Field metadata: how splice differs from DeepSpeed for this option."""
    return {"deepspeed": deepspeed}


# --------------------------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------------------------
class _ReadableErrors(type(BaseModel)):
    """Turns pydantic's ValidationError from ``Section(...)`` into a ValueError naming each key.

    (A metaclass rather than ``__init__``: a custom ``__init__`` makes pydantic call it for nested sections too and
    run the model validators twice.)
    """

    def __call__(cls, *args: Any, **kwargs: Any):
        try:
            return super().__call__(*args, **kwargs)
        except ValidationError as error:
            raise ValueError(describe_errors(error, cls)) from None


class _Section(BaseModel, metaclass=_ReadableErrors):
    """Strict base: unknown keys are errors, aliases and names both work, errors name the key."""

    model_config = ConfigDict(
        extra="forbid", populate_by_name=True, arbitrary_types_allowed=True, validate_default=True
    )

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any):
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as error:
            raise ValueError(describe_errors(error, cls)) from None

    @model_validator(mode="before")
    @classmethod
    def _prepare(cls, data: Any) -> Any:
        return canonical_keys(cls, data) if isinstance(data, Mapping) else data

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, value: Any, info: ValidationInfo) -> Any:
        """A bool where a number is wanted is a mistake (pydantic would read True as 1), unless bool is allowed."""
        kinds = _annotation_types(cls.model_fields[info.field_name].annotation)
        if isinstance(value, bool) and bool not in kinds and kinds & {int, float}:
            raise ValueError(f"{value!r} is a bool; allowed: a number")
        return value


class TensorParallelConfig(_Section):
    enabled: bool = Field(True, description="Turn tensor parallelism on or off.", json_schema_extra=_note(
        "DeepSpeed ignores enabled=False; splice raises if enabled=False while tp_size > 1."))
    tp_size: int = Field(1, ge=1, description="Number of processes (ranks) the model is split across.")
    tp_grain_size: int = Field(64, ge=1, description=(
        "Granularity of uneven MLP / vocabulary splits: per-rank sizes are rounded to multiples of it (an MLP "
        "width it does not divide is split by single columns; the vocabulary rows past the last whole unit go to the "
        "last rank). At tp_size 1 "
        "nothing is split, and a non-default value warns. A splice_tp.json checkpoint records the one its shards "
        "were cut with, which loading uses; another value given explicitly raises."))
    mpu: Any = Field(None, description=(
        "A Megatron-style model-parallel unit (get_model_parallel_group/_rank/_world_size); the tensor-parallel "
        "group is taken from it."))
    tp_group: Any = Field(None, description=(
        "An existing torch.distributed process group to shard over; None means one is created."),
        json_schema_extra=_note("DeepSpeed writes the group it creates back into this field; splice never "
                                "writes into the config (the group lives in its ParallelContext)."))

    @model_validator(mode="after")
    def _enabled_matches_size(self) -> TensorParallelConfig:
        if not self.enabled and self.tp_size > 1:
            raise ValueError(f"tensor_parallel.enabled=False contradicts tensor_parallel.tp_size={self.tp_size}; "
                             "allowed: enabled=True with tp_size > 1, or tp_size=1")
        return self


class ZeroConfig(_Section):
    enabled: bool = Field(False, description="ZeRO-Inference: partition parameters across ranks / offload them.",
                          json_schema_extra=_note(
                              "splice does not implement ZeRO-Inference; split a model with tensor_parallel, keep "
                              "weights in host memory with keep_module_on_host."))
    stage: int = Field(0, ge=0, le=3, description="ZeRO stage (0-3).", json_schema_extra=_note(
        "splice does not implement ZeRO-Inference; only stage 0 is accepted. DeepSpeed's other ZeRO keys "
        "(offload_param, ...) are rejected as unknown."))


#: what the moe section's fields other than enabled say
NOT_DEEPSPEED_MOE = "only used with DeepSpeed-MoE layers, which splice does not implement"


class MoEConfig(_Section):
    enabled: bool = Field(False, description="The model is a mixture of experts.", json_schema_extra=_note(
        "DeepSpeed defaults to True and uses it only for models with DeepSpeed-MoE layers, which splice does not "
        "implement (nor expert parallelism), so enabling it raises; Hugging Face mixtures of experts (Mixtral, "
        "Qwen2-MoE, Qwen3-MoE, ...) need no moe section."))
    ep_size: int = Field(1, ge=1, description="Expert-parallel group size.", json_schema_extra=_note(
        NOT_DEEPSPEED_MOE))
    moe_experts: list[int] = Field(default_factory=lambda: [1], alias="num_experts",
                                   description="Global number of experts per MoE layer.",
                                   json_schema_extra=_note(NOT_DEEPSPEED_MOE))
    type: Literal["standard", "residual"] = Field("standard", description="MoE layer type.",
                                                  json_schema_extra=_note(NOT_DEEPSPEED_MOE))
    ep_mp_group: Any = Field(None, description="Expert model-parallel process group.",
                             json_schema_extra=_note(NOT_DEEPSPEED_MOE))
    ep_group: Any = Field(None, alias="expert_group", description="Expert-parallel process group.",
                          json_schema_extra=_note(NOT_DEEPSPEED_MOE))


class WeightQuantConfig(_Section):
    enabled: bool = Field(True, description=(
        "Quantize the linear weights (when the section applies: see quant.enabled). False with dtype=int8 raises; "
        "False with quant.enabled=True quantizes nothing, and the weight, qkv and lm_head settings given warn."))
    num_bits: Literal[8, 4] = Field(8, description="Bits per quantized weight.")
    q_type: Literal["symmetric", "asymmetric"] | None = Field(None, description=(
        "Zero-point scheme. None picks the most accurate one the kernels take at num_bits: 'asymmetric' for 4 bits "
        "(the int4 kernels take a zero point), 'symmetric' for 8 (the int8 kernels take none)."),
        json_schema_extra=_note("DeepSpeed defaults to 'symmetric'; splice defaults to None, i.e. 'asymmetric' for "
                                "int4, which reproduces weights more closely (see docs/quantization.md). "
                                "An explicit 'symmetric' is honoured; on the native CPU kernels a symmetric int4 "
                                "weight keeps its scales alone (4.5 bits a weight at group 32 against 5), so its "
                                "decode reads a tenth fewer bytes."))
    q_groups: int = Field(1, ge=1, description=(
        "Quantization groups per output row: each row's inputs are split into q_groups groups of in_features / "
        "q_groups, one scale each. 1: one scale per output channel for int8, int4's default group of 32. With "
        "tensor parallelism each rank splits its own share of a row-parallel layer's inputs so."),
        json_schema_extra=_note("DeepSpeed splits the whole matrix into q_groups bands of rows (1: one scale for "
                                "the matrix); splice's q_groups=1 is already one scale per output channel."))
    group_size: int | None = Field(None, ge=1, description=(
        "Input elements per quantization group (e.g. 32, 64, 128); overrides q_groups. None uses q_groups."),
        json_schema_extra=_note("splice extra"))
    q_dtype: torch.dtype | None = Field(None, description=(
        "Storage dtype of quantized weights, checked against num_bits: torch.int8 for 8 bits, torch.uint8 for 4 "
        "(two codes a byte); the other raises. None: the scheme's own."),
        json_schema_extra=_note("splice extra"))
    calibration_ids: list[list[int]] | None = Field(None, description=(
        "Token ids [sequences][tokens] (a LongTensor or nested lists) to calibrate int4 weights on with GPTQ; "
        "None rounds to nearest. See docs/quantization.md."), json_schema_extra=_note("splice extra"))
    quantized_initialization: dict = Field(default_factory=dict, description=(
        "DeepSpeed's quantize-while-loading options."), json_schema_extra=_note(
        "splice quantizes after loading and sharding; use the other quant.weight keys"))
    post_init_quant: dict = Field(default_factory=dict, description="DeepSpeed's per-module post-init options.",
                                  json_schema_extra=_note("splice quantizes every linear of the transformer blocks; "
                                                          "use the other quant.weight keys"))

    @model_validator(mode="after")
    def _warn_q_groups_overridden(self) -> WeightQuantConfig:
        if self.group_size is not None and "q_groups" in self.model_fields_set and self.q_groups != 1:
            warnings.warn(f"quant.weight.q_groups={self.q_groups} has no effect in splice: quant.weight.group_size="
                          f"{self.group_size} sets the groups; allowed: one of the two", SpliceIgnoredOptionWarning,
                          stacklevel=caller_stacklevel())
        return self

    @field_validator("calibration_ids", mode="before")
    @classmethod
    def _ids_to_lists(cls, value: Any) -> Any:
        return value.tolist() if isinstance(value, torch.Tensor) else value

    @field_validator("q_dtype", mode="before")
    @classmethod
    def _check_q_dtype(cls, value: Any) -> Any:
        if value is None or value in (torch.int8, torch.uint8):
            return value
        names = {"int8": torch.int8, "uint8": torch.uint8}
        if isinstance(value, str) and value.lower().removeprefix("torch.") in names:
            return names[value.lower().removeprefix("torch.")]
        raise ValueError(f"{value!r} is not a supported quantized storage dtype; allowed: torch.int8, torch.uint8, "
                         "None")


class ActivationQuantConfig(_Section):
    enabled: bool = Field(False, description=("Quantize activations (when the section applies: see quant.enabled); "
                                              "while False, the keys below warn."),
                          json_schema_extra=_note("DeepSpeed defaults to True; splice quantizes weights only "
                                                  "unless asked."))
    num_bits: Literal[8] = Field(8, description="Bits per quantized activation: 8 only (int8 activations).")
    q_type: Literal["symmetric", "asymmetric"] = Field("symmetric", description=(
        "Zero-point scheme: 'symmetric' only (one scale per row and block of inputs); 'asymmetric' raises when "
        "activations are quantized."))
    q_groups: int = Field(1, ge=1, description=(
        "Number of quantization groups: 1 only (the blocks of inputs set the scales); another value raises when "
        "activations are quantized."))


class QKVQuantConfig(_Section):
    enabled: bool = Field(True, description="Also quantize the attention q/k/v projections.")


class QuantizationConfig(_Section):
    enabled: bool | None = Field(None, description=(
        "Quantize the model with the weight / activation / qkv settings below. None: with dtype=int8 they apply, "
        "otherwise nothing is quantized (and settings given here warn). True: quantize, whatever the dtype (with "
        "dtype=int8, num_bits must be 8). False: the section is off; dtype=int8 alone then gives int8 weights, one "
        "scale per output channel (quantize_lm_head still applies), and the other settings given here raise; with "
        "a float dtype they warn."),
        json_schema_extra=_note("DeepSpeed defaults to True and quantizes only with dtype=int8, which None "
                                "reproduces; splice's True also quantizes a float model (keeping activations in "
                                "its dtype)."))
    weight: WeightQuantConfig = Field(default_factory=WeightQuantConfig, description="Weight quantization.")
    activation: ActivationQuantConfig = Field(default_factory=ActivationQuantConfig,
                                              description="Activation quantization.")
    qkv: QKVQuantConfig = Field(default_factory=QKVQuantConfig, description="q/k/v projection quantization.")
    quantize_lm_head: bool | None = Field(None, description=(
        "The output head (lm_head) when quantizing: None puts it in int8 per output channel (whatever the weight "
        "scheme; it costs about as much perplexity as rounding noise and halves the bytes each token reads there), "
        "True quantizes it with the weight scheme, False keeps it in float. Embeddings always stay in float."),
        json_schema_extra=_note("splice extra"))


_UNUSED_CKPT = ("DeepSpeed declares this section but its engine ignores it; splice reads checkpoint_dir and "
                "base_dir as the top-level checkpoint and base_dir (a value given in both places must agree)")
_UNUSED_CKPT_SAVE = "DeepSpeed's engine ignores it too; use the top-level save_mp_checkpoint_path"


class InferenceCheckpointConfig(_Section):
    checkpoint_dir: str | None = Field(None, description=(
        "Checkpoint to load when checkpoint is not given; with checkpoint, both must name the same path (else "
        "ValueError)."))
    save_mp_checkpoint_path: str | None = Field(None, description="Where to save a resharded checkpoint.",
                                                json_schema_extra=_note(_UNUSED_CKPT_SAVE))
    base_dir: str | None = Field(None, description=(
        "Root directory for a relative checkpoint or checkpoint_dir (and a load policy's files) when the top-level "
        "base_dir is empty; with both set, they must name the same path (else ValueError). Without a checkpoint it "
        "warns."))


# --------------------------------------------------------------------------------------------------------------------
# The configuration
# --------------------------------------------------------------------------------------------------------------------
class InferenceConfig(_Section):
    """Everything ``init_inference`` accepts. Build it with ``resolve_config``."""

    replace_with_kernel_inject: bool = Field(False, alias="kernel_inject", description=(
        "Replace each transformer block with splice's fused inference block."))
    dtype: torch.dtype | None = Field(None, description=(
        "Convert the model to this dtype (fp32, fp16, bf16, int8). None keeps the model's own dtype "
        "(DeepSpeed defaults to fp16, which breaks on CPUs)."),
        json_schema_extra=_note("DeepSpeed defaults to torch.float16, which breaks or crawls on CPUs; splice "
                                "defaults to None (keep the model's dtype)."))
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig, alias="tp",
                                                  description="Tensor parallelism: split the model across ranks.")
    enable_cuda_graph: bool = Field(False, description=(
        "Replay CUDA graphs (CUDA, tp_size 1): generate's decode step (kernel-injected models; one graph per batch "
        "size and attended length) and engine(...) calls (one graph per argument signature), each captured when "
        "first called; what cannot be captured runs eagerly and the log says so."),
        json_schema_extra=_note("run on an H200 (benchmarks/device_check.sh); DeepSpeed replays one graph of the "
                                "first engine(...) call's shapes and hands back its static output, splice a copy"))
    compile_decode: bool = Field(False, description=(
        "Compile splice's decode step with torch.compile (static shapes; needs replace_with_kernel_inject=True). "
        "It attends over the filled KV-cache slots rounded up to a power of two (at least 256): one graph per such "
        "length, compiled when a generate call first reaches it (tens of seconds on a small CPU; torch's inductor "
        "cache makes later processes faster). A step whose blocks all run in one native call (on CPU, the Llama-like "
        "families in bf16 on splice's native kernels, quantized or not) runs eagerly even so: the graph would hold "
        "the same call with next to nothing around it to fuse, and its inputs and guards cost more than that "
        "(measured in turns, the eager step took 0.81x the compiled one's time a token on SmolLM2-135M int4, 0.98x "
        "on llama-1b; docs/benchmarks.md). Other steps (other families, fp32, more rows than the kernels take in one "
        "call) run the compiled graph; engine.runtime.compile_native_steps = True sends every step through it."),
        json_schema_extra=_note("splice extra"))
    use_triton: bool = Field(False, description="Use Triton kernels.", json_schema_extra=_note(
        "splice has no Triton kernels; its fused block uses torch ops"))
    triton_autotune: bool = Field(False, description="Autotune Triton kernels.", json_schema_extra=_note(
        "splice has no Triton kernels"))
    zero: ZeroConfig = Field(default_factory=ZeroConfig, description="ZeRO-Inference settings.")
    triangular_masking: bool = Field(True, alias="tm", description="Use a causal (triangular) attention mask.",
                                     json_schema_extra=_note("splice takes the mask from the model's architecture "
                                                             "record"))
    moe: MoEConfig = Field(default_factory=MoEConfig, description=(
        "Mixture-of-experts settings; true/false is shorthand for {'enabled': ...}."))
    keep_module_on_host: bool = Field(False, description=(
        "Keep loaded weights in host memory instead of moving them to the device. With quantization on a device "
        "other than the CPU it raises ValueError: quantized weights are packed for the device that runs them."))
    quant: QuantizationConfig = Field(default_factory=QuantizationConfig, description="Quantization settings.")
    checkpoint: str | os.PathLike | dict | None = Field(None, description=(
        "Checkpoint to load: a path (folder, file or JSON load policy) or a load-policy dict."))
    base_dir: str = Field("", description=(
        "Root directory for the relative file names in checkpoint (or checkpoint_config.base_dir; see there). "
        "Without a checkpoint it warns."))
    set_empty_params: bool = Field(False, description="Create the inference modules with empty tensors.",
                                   json_schema_extra=_note("splice materialises weights from meta itself when a "
                                                           "checkpoint is given"))
    save_mp_checkpoint_path: str | None = Field(None, description=(
        "Save the sharded (per-rank) model here after loading, to load faster next time (a folder, created if "
        "needed, loaded back with checkpoint=<folder>). Needs tensor_parallel.tp_size > 1: at tp_size=1 it raises "
        "ValueError."), json_schema_extra=_note(
        "DeepSpeed writes its own format (a ds_inference_config.json listing non_tp / tp .pt files), also at one "
        "rank; splice writes safetensors shards with a splice_tp.json manifest, and reads neither DeepSpeed's "
        "format nor any pickle checkpoint"))
    checkpoint_config: InferenceCheckpointConfig = Field(default_factory=InferenceCheckpointConfig,
                                                         alias="ckpt_config", description="Checkpoint settings.",
                                                         json_schema_extra=_note(_UNUSED_CKPT))
    return_tuple: bool = Field(True, description="Transformer blocks return a tuple rather than a tensor.",
                               json_schema_extra=_note("splice blocks keep the return type of the blocks they "
                                                       "replace"))
    training_mp_size: int = Field(1, ge=1, description="Model-parallel size the checkpoint was saved with.",
                                  json_schema_extra=_note(
                                      "splice loads unsharded checkpoints and shards them itself; merging "
                                      "checkpoints saved with another model-parallel size is not supported. "
                                      "Use the unsharded checkpoint."))
    replace_method: str = Field("auto", description="Deprecated in DeepSpeed; no longer needed.",
                                json_schema_extra=_note("deprecated; remove it"))
    injection_policy: dict | None = Field(None, alias="injection_dict", description=(
        "Map of block class to the names of its output linears (attention out, MLP out), for manual tensor "
        "parallelism (tp_size > 1); a class or name that matches nothing in the model, two names of one linear, "
        "and an empty dict raise ValueError."),
        json_schema_extra=_note(
            "at tensor_parallel.tp_size=1 it is checked, then warns (SpliceIgnoredOptionWarning) that it has no "
            "effect: splice's kernel injection does not read it, and DeepSpeed too only slices by it at "
            "mp_size > 1. With a splice_tp.json checkpoint the stored plan is loaded; a policy that splits "
            "differently from it raises ValueError. Keys must be classes and a bare string value stands for a "
            "one-name tuple, as in DeepSpeed. A name is a linear's path in the block or its end in whole segments "
            "('layer.0.SelfAttention.o' or 'SelfAttention.o'), a leading dot anchoring it at the block ('.fc2'), "
            "as in DeepSpeed's T5 and BART policies; one naming no linear in any instance of the class, or two "
            "linears of one block, raises ValueError. DeepSpeed refuses an injection_policy with "
            "replace_with_kernel_inject=True; splice accepts the pair: the policy's plan shards, then the blocks "
            "are fused"))
    injection_policy_tuple: tuple | None = Field(None, description="DeepSpeed-internal form of injection_policy.",
                                                 json_schema_extra=_note("use injection_policy"))
    config: dict | None = Field(None, alias="args", description="Model config dict to use instead of the model's.",
                                json_schema_extra=_note("splice reads the model's own config"))
    max_out_tokens: int = Field(1024, ge=1, alias="max_tokens", description=(
        "Maximum tokens (prompt + generated) per sequence: sizes a kernel-injected model's KV cache, and generate "
        "refuses longer requests; without kernel injection (the model's own cache grows) only when given, and never "
        "for an encoder-decoder (its input is not part of the generated sequence)."))
    min_out_tokens: int = Field(1, ge=1, alias="min_tokens", description="Minimum tokens you expect to generate.",
                                json_schema_extra=_note("splice sizes its KV cache from max_out_tokens up front"))
    transposed_mode: bool = Field(False, description="Store weights transposed.", json_schema_extra=_note(
        "splice chooses weight layouts itself"))
    device: str | torch.device | None = Field(None, description=(
        "Where the model runs: 'cpu', 'cuda', 'cuda:1', ...; None means CUDA if present, else CPU. Other device "
        "types ('meta', 'mps', ...) and a CUDA index the machine lacks raise."),
        json_schema_extra=_note("splice extra"))

    #: its keys as validated (a copy of ``_plain``'s dict), so that resolve_config, which validates it again, gives
    #: only the warnings that keys assigned since then add
    _as_built: dict = PrivateAttr(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _prepare(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = canonical_keys(cls, _without_auto(data))
        if isinstance(data.get("moe"), bool):
            data["moe"] = {"enabled": data["moe"]}
        return _move_deprecated(data)

    @field_validator("dtype", mode="before")
    @classmethod
    def _check_dtype(cls, value: Any) -> torch.dtype | None:
        return parse_dtype(value)

    @field_validator("device", mode="before")
    @classmethod
    def _check_device(cls, value: Any) -> str | None:
        if value is None:
            return None
        if isinstance(value, (str, torch.device)):
            try:
                device = torch.device(value)
            except (RuntimeError, ValueError):
                device = None
            # splice's steps and kernels run on the CPU and CUDA only; 'meta' would move the weights away for good
            if device is not None and device.type in _DEVICE_TYPES:
                return str(device)
        raise ValueError(f"{value!r} is not a device splice runs on; allowed: None, or a torch.device or string of "
                         f"type {' or '.join(map(repr, _DEVICE_TYPES))}, such as 'cpu', 'cuda', 'cuda:1'")

    @field_validator("checkpoint", mode="before")
    @classmethod
    def _check_checkpoint(cls, value: Any) -> Any:
        if isinstance(value, (str, os.PathLike)) and not os.fspath(value):
            raise ValueError("an empty path is not a checkpoint (it would read the current directory); allowed: "
                             "None, a path to a checkpoint folder, file or index JSON, or a load-policy dict")
        if value is None or isinstance(value, (str, os.PathLike, dict)):
            return value
        raise ValueError(f"{value!r} ({type(value).__name__}) is not a checkpoint; allowed: None, a path "
                         "(str or os.PathLike) or a load-policy dict")

    @model_validator(mode="after")
    def _check_quant_section(self) -> InferenceConfig:
        """Settings of a quant section that is off must not vanish: they raise or warn (see quant.enabled)."""
        settings = _quant_settings(self.quant)
        int8 = self.dtype == torch.int8
        if not settings or self.quant.enabled or (self.quant.enabled is None and int8):
            _warn_idle_activation_settings(self.quant, settings)
            _warn_idle_weight_settings(self.quant, settings, int8)
            return self  # nothing given, or the section applies
        if int8:  # quant.enabled=False: dtype=int8 quantizes per channel; only quantize_lm_head still applies
            conflicting = [s for s in settings if not s.startswith("quant.quantize_lm_head=")]
            if conflicting:
                raise ValueError(f"quant.enabled=False turns the quant section off, but dtype=torch.int8 quantizes "
                                 f"and the section sets {', '.join(conflicting)}, which would be dropped; allowed: "
                                 "quant.enabled=True (or unset) to apply them with dtype=int8, or remove them")
            return self
        warnings.warn(f"{', '.join(settings)} has no effect in splice: nothing is quantized (quant.enabled="
                      f"{self.quant.enabled}, dtype={self.dtype}); allowed: quant.enabled=True, or dtype=int8 with "
                      "quant.enabled unset, to quantize with these settings", SpliceIgnoredOptionWarning,
                      stacklevel=caller_stacklevel())
        return self

    @model_validator(mode="after")
    def _check_support(self) -> InferenceConfig:
        for path, support in FIELD_SUPPORT.items():
            value = _value_at(self, path)
            if support == HONOURED or _same(value, _default_at(path)):
                continue
            note = _field_at(path).json_schema_extra["deepspeed"]
            if support == UNSUPPORTED:
                raise ValueError(f"{path}={value!r} is not supported by splice: {note}")
            warnings.warn(f"{path}={value!r} has no effect in splice: {note}", SpliceIgnoredOptionWarning,
                          stacklevel=caller_stacklevel())
        return self

    # defined last, so that it wraps every other validator (pydantic nests the later ones outside)
    @model_validator(mode="wrap")
    @classmethod
    def _remember_keys(cls, data: Any, handler: Any) -> InferenceConfig:
        config = handler(data)
        config._as_built = _copied(_plain(config))
        return config


def _copied(value: Any) -> Any:
    """``value`` with its dicts and lists copied (their items as they are): a record that assignments into the
    config's own containers do not change."""
    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()}
    return [_copied(item) for item in value] if isinstance(value, list) else value


def _validated_again(config: InferenceConfig, data: dict) -> InferenceConfig:
    """``data`` (``config``'s keys, and those merged onto them) validated, giving only the warnings that the keys as
    ``config`` was built did not give: those it gave when built are not given twice."""
    _, built = _recorded_warnings(lambda: InferenceConfig.model_validate(config._as_built))
    resolved, caught = _recorded_warnings(lambda: InferenceConfig.model_validate(data))
    said = {str(warning.message) for warning in built}
    for warning in caught:
        if str(warning.message) not in said:
            _warn_again(warning)
    return resolved


def _recorded_warnings(call: Callable[[], Any]) -> tuple[Any, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        return call(), caught


def _warn_again(warning: warnings.WarningMessage) -> None:
    """A recorded warning given at the line it named, with that line's module and registry (as ``warnings.warn``
    would: the caller's filters and its once-per-line rule apply)."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename, frame.f_lineno) != (warning.filename, warning.lineno):
        frame = frame.f_back
    scope = frame.f_globals if frame is not None else {}
    warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno,
                           module=scope.get("__name__"), registry=scope.setdefault("__warningregistry__", {}),
                           module_globals=scope or None)


def caller_stacklevel() -> int:
    """The ``stacklevel`` for a warning raised here that points at the user's line: the first frame outside splice,
    pydantic and the standard library, however deep in validation the warning is raised (called by the function that
    calls ``warnings.warn``)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


_LIBRARY_DIRS = (str(Path(__file__).parent), str(Path(pydantic.__file__).parent), sysconfig.get_paths()["stdlib"])


# --------------------------------------------------------------------------------------------------------------------
# Keys: aliases, deprecated names, paths
# --------------------------------------------------------------------------------------------------------------------
def _aliases(model: type[BaseModel]) -> dict[str, str]:
    """alias -> field name."""
    return {info.alias: name for name, info in model.model_fields.items() if info.alias}


def canonical_keys(model: type[BaseModel], data: Mapping) -> dict:
    """A new dict with aliases replaced by field names; alias and name with different values raise."""
    aliases = _aliases(model)
    out: dict = {}
    spelled: dict = {}
    for key, value in data.items():
        name = aliases.get(key, key)
        if name in out and not _same(out[name], value, key=name):
            raise ValueError(f"'{spelled[name]}' and '{key}' name the same option '{name}' but have different "
                             f"values: {out[name]!r} and {value!r}; give it once")
        out[name] = value
        spelled[name] = key
    return out


def _without_auto(data: Mapping) -> dict:
    """``data`` without its top-level keys whose value is ``"auto"`` (but ``replace_method``, whose default that is):
    as DeepSpeed's config models do, ``"auto"`` asks for the key's default. Sections are not searched; DeepSpeed's are
    not either, so ``"auto"`` inside one is an invalid value there as here."""
    return {key: value for key, value in data.items()
            if not (isinstance(value, str) and value == AUTO) or key == "replace_method"}


def _section_dict(data: dict, section: str) -> dict:
    """The current content of a section as a new plain dict of the keys given."""
    value = data.get(section, {})
    model = _section_model(InferenceConfig.model_fields[section].annotation)
    if isinstance(value, BaseModel):
        return {name: getattr(value, name) for name in value.model_fields_set}
    if isinstance(value, Mapping):
        return canonical_keys(model, value)
    raise ValueError(f"'{section}' must be a dict or {model.__name__}, got {value!r}")


def _move_deprecated(data: dict) -> dict:
    """Move each deprecated top-level name to its new place in ``data`` (a dict we own), warning."""
    for old in [key for key in data if key in DEPRECATED]:
        new = DEPRECATED[old]
        section, key = new.split(".")
        current = _section_dict(data, section)
        if key in current:  # even with equal values, as DeepSpeed: give the option once
            raise ValueError(f"'{old}' is deprecated and moves to '{new}', but '{new}' is also given "
                             f"({old}={data[old]!r}, {new}={current[key]!r}); keep only '{new}'")
        value = data.pop(old)
        warnings.warn(f"'{old}' is deprecated; use '{new}' (moved {old}={value!r} there)", SpliceDeprecationWarning,
                      stacklevel=caller_stacklevel())
        data[section] = {**current, key: value}
    return data


def _annotation_types(annotation: Any) -> set:
    """The plain types an annotation allows (``int | None`` -> {int, NoneType}); Literal values' types too."""
    if isinstance(annotation, type):
        return {annotation}
    if get_origin(annotation) is Literal:
        return {type(value) for value in get_args(annotation)}
    return {kind for arg in get_args(annotation) for kind in _annotation_types(arg)}


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The section model inside a field annotation (``X``, ``X | None``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _section_model(arg)
        if found is not None:
            return found
    return None


def _field_at(path: str, root: type[BaseModel] | None = None) -> FieldInfo:
    model = root or InferenceConfig
    *parents, last = path.split(".")
    for part in parents:
        model = _section_model(model.model_fields[part].annotation)
    return model.model_fields[last]


def _default_at(path: str) -> Any:
    return _field_at(path).get_default(call_default_factory=True)


def _value_at(config: BaseModel, path: str) -> Any:
    value: Any = config
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _quant_settings(quant: QuantizationConfig) -> list[str]:
    """``path=value`` for each honoured key of the quant section other than ``enabled`` whose value is not its
    default (the ignored DeepSpeed keys are left out: they warn on their own)."""
    paths = [f"quant.{section}.{name}" for section in ("weight", "activation", "qkv")
             for name in _section_model(QuantizationConfig.model_fields[section].annotation).model_fields]
    given = []
    for path in paths + ["quant.quantize_lm_head"]:
        value = _value_at(quant, path.removeprefix("quant."))
        if field_support(path) == HONOURED and not _same(value, _default_at(path)):
            given.append(f"{path}={_short(value, 60)}")
    return given


def _warn_idle_activation_settings(quant: QuantizationConfig, settings: list[str]) -> None:
    """quant.activation's keys other than ``enabled`` only shape activation quantization: while it is off they would
    vanish, so they warn."""
    idle = [s for s in settings if s.startswith("quant.activation.")]
    if idle and not quant.activation.enabled:
        warnings.warn(f"{', '.join(idle)} has no effect in splice: activations are not quantized "
                      "(quant.activation.enabled=False); allowed: quant.activation.enabled=True to quantize them "
                      "with these settings, or remove them", SpliceIgnoredOptionWarning,
                      stacklevel=caller_stacklevel())


def _warn_idle_weight_settings(quant: QuantizationConfig, settings: list[str], int8: bool) -> None:
    """With quant.weight.enabled=False (and a float dtype: dtype=int8 then raises) nothing is quantized, so the
    weight, qkv and lm_head settings would vanish: they warn. (quant.activation.enabled=True then raises.)"""
    if quant.weight.enabled or int8 or quant.activation.enabled:
        return
    idle = [s for s in settings if not s.startswith(("quant.weight.enabled=", "quant.activation."))]
    if idle:
        warnings.warn(f"{', '.join(idle)} has no effect in splice: nothing is quantized (quant.weight.enabled=False); "
                      "allowed: quant.weight.enabled=True to quantize with these settings, or remove them",
                      SpliceIgnoredOptionWarning, stacklevel=caller_stacklevel())


def _covered(path: str) -> bool:
    parts = path.split(".")
    return any(".".join(parts[:end]) in FIELD_SUPPORT for end in range(1, len(parts) + 1))


def field_support(path: str) -> str:
    """honoured / ignored / unsupported for a dotted option path (the most specific entry of FIELD_SUPPORT)."""
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in FIELD_SUPPORT:
            return FIELD_SUPPORT[prefix]
    raise KeyError(f"no FIELD_SUPPORT entry covers {path!r}")


# --------------------------------------------------------------------------------------------------------------------
# Comparing values
# --------------------------------------------------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    """A section as a nested dict of the keys that were set (a section counts as set where a key inside it was, as
    by assignment to a default section); anything else unchanged."""
    if not isinstance(value, BaseModel):
        return value
    out = {}
    for name in type(value).model_fields:
        field = _plain(getattr(value, name))
        if name in value.model_fields_set or (isinstance(getattr(value, name), BaseModel) and field):
            out[name] = field
    return out


def _same(a: Any, b: Any, key: str = "") -> bool:
    if key == "dtype":
        a, b = _dtype_or_raw(a), _dtype_or_raw(b)
    if isinstance(a, BaseModel) and isinstance(b, BaseModel):
        return a == b
    a, b = _plain(a), _plain(b)
    if a is b:
        return True
    if isinstance(a, (str, os.PathLike)) and isinstance(b, (str, os.PathLike)):
        return os.fspath(a) == os.fspath(b)  # a checkpoint path as str or Path
    try:
        return bool(a == b)
    except Exception:  # e.g. tensors: ambiguous truth value
        return False


def _dtype_or_raw(value: Any) -> Any:
    try:
        return parse_dtype(value)
    except ValueError:
        return value


# --------------------------------------------------------------------------------------------------------------------
# Readable errors
# --------------------------------------------------------------------------------------------------------------------
def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _walk_loc(model: type[BaseModel], loc: tuple) -> tuple[str, type[BaseModel] | None, tuple]:
    """(dotted field path, model holding the last part, the rest of loc) for a pydantic error location."""
    names: list[str] = []
    for index, part in enumerate(loc):
        if model is None or not isinstance(part, str):
            return ".".join(names), model, loc[index:]
        name = _aliases(model).get(part, part)
        if name not in model.model_fields:
            return ".".join(names), model, loc[index:]
        names.append(name)
        if index < len(loc) - 1:
            model = _section_model(model.model_fields[name].annotation)
    return ".".join(names), model, ()


def _valid_keys(model: type[BaseModel]) -> list[str]:
    keys = list(model.model_fields) + list(_aliases(model))
    return keys + list(DEPRECATED) if model is InferenceConfig else keys


def _nested_paths(model: type[BaseModel] | None, key: str) -> list[str]:
    """The dotted paths, relative to ``model``, of the fields or aliases named ``key`` inside its sections."""
    paths = []
    for name, info in (model.model_fields if model is not None else {}).items():
        section = _section_model(info.annotation)
        if section is None:
            continue
        if key in section.model_fields or key in _aliases(section):
            paths.append(f"{name}.{_aliases(section).get(key, key)}")
        paths += [f"{name}.{path}" for path in _nested_paths(section, key)]
    return paths


def _unknown_key_message(parent: str, model: type[BaseModel], key: Any) -> str:
    full = f"{parent}.{key}" if parent else str(key)
    valid = _valid_keys(model)
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
    prefix = f"{parent}." if parent else ""
    nested = _nested_paths(model, str(key))
    if model is InferenceConfig and key in FOREIGN_KEYS:
        hint = FOREIGN_KEYS[key]
    elif nested:  # a section's key given one level too high, e.g. tp_size for tensor_parallel.tp_size
        hint = "did you mean " + " or ".join(f"'{prefix}{path}'" for path in nested) + "?"
    elif close:
        hint = f"did you mean '{prefix}{close[0]}'?"
    else:
        hint = f"valid keys here: {', '.join(sorted(valid))}"
    if parent == "zero":
        hint += " (splice does not implement ZeRO-Inference, so DeepSpeed's other ZeRO keys are not accepted)"
    return f"unknown config key '{full}'; {hint}"


def _error_message(model: type[BaseModel], item: dict) -> str:
    path, holder, rest = _walk_loc(model, tuple(item["loc"]))
    if item["type"] == "extra_forbidden":
        return _unknown_key_message(path, holder, rest[0] if rest else path)
    if item["type"] == "value_error":
        message = str(item["ctx"]["error"])
        return f"invalid value for '{path}': {message}" if path else message
    message = item["msg"][:1].lower() + item["msg"][1:]
    return f"invalid value for '{path or '<config>'}': {_short(item['input'])} ({message})"


def describe_errors(error: ValidationError, model: type[BaseModel]) -> str:
    """One readable line per problem, each naming the key, the bad value and what is allowed."""
    messages = [_error_message(model, item) for item in error.errors()]
    return "; ".join(dict.fromkeys(messages))


# --------------------------------------------------------------------------------------------------------------------
# resolve_config
# --------------------------------------------------------------------------------------------------------------------
def _load_json(path: str | os.PathLike) -> dict:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"config file '{os.fspath(path)}' does not exist") from None
    except OSError as error:
        raise ValueError(f"cannot read config file '{os.fspath(path)}': {error}") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"config file '{os.fspath(path)}' is not UTF-8 text (byte {error.object[error.start]:#04x} "
                         f"at offset {error.start}); allowed: a UTF-8 JSON object") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"config file '{os.fspath(path)}' is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file '{os.fspath(path)}' holds a JSON {type(data).__name__}; allowed: a JSON object "
                         "of init_inference options")
    return data


def _as_dict(config: Any) -> dict:
    """The user's config as a new top-level dict (nested values are shared, never modified)."""
    if config is None:
        return {}
    if isinstance(config, InferenceConfig):
        return _plain(config)
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        return _load_json(config)
    raise TypeError(f"config must be None, a dict, a path to a JSON file (str or os.PathLike) or an "
                    f"InferenceConfig; got {type(config).__name__}")


def _merge(base: dict, overrides: dict) -> dict:
    """``base`` updated with ``overrides``; the same key with different values raises (values compared as they
    validate: ``'cpu'`` and ``torch.device('cpu')`` are the same value; ``"auto"`` is a value of its own, as in
    DeepSpeed)."""
    base, overrides = canonical_keys(InferenceConfig, base), canonical_keys(InferenceConfig, overrides)
    for key in base.keys() & overrides.keys():
        if not _same_validated(key, base[key], overrides[key]):
            raise ValueError(f"config key '{key}' is given twice with different values: {_short(base[key])} in "
                             f"config and {_short(overrides[key])} in keyword arguments")
    return {**base, **overrides}


def _same_validated(key: str, a: Any, b: Any) -> bool:
    """Whether two values of top-level ``key`` are the same once validated (each alone, quietly: the whole config
    is validated next, and warns then); values that do not validate alone are compared as given."""
    if _same(a, b, key=key):
        return True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            first, second = (InferenceConfig.model_validate({key: value}) for value in (a, b))
    except (ValueError, TypeError):
        return False
    return _same(_plain(getattr(first, key)), _plain(getattr(second, key)), key=key)


def resolve_config(config: Any = None, **kwargs: Any) -> InferenceConfig:
    """One ``InferenceConfig`` from a dict, JSON file path or ``InferenceConfig`` (or None), plus keyword arguments.

    Keyword arguments are merged on top; the same key given both ways with different values raises ``ValueError``.
    Nothing the caller passed in is modified.
    """
    data = _merge(_as_dict(config), kwargs)
    if isinstance(config, InferenceConfig):
        # validated again too: its fields may have been assigned since it was built, unchecked
        return _validated_again(config, data)
    return InferenceConfig.model_validate(data)


# --------------------------------------------------------------------------------------------------------------------
# Reference table
# --------------------------------------------------------------------------------------------------------------------
class FieldRow(NamedTuple):
    key: str
    aliases: tuple[str, ...]
    default: str
    meaning: str
    deepspeed_difference: str
    support: str


def _default_text(info: FieldInfo) -> str:
    if _section_model(info.annotation) is not None:
        return "(section)"
    value = info.get_default(call_default_factory=True)
    return str(value) if isinstance(value, torch.dtype) else repr(value)


def _rows(model: type[BaseModel], prefix: str) -> list[FieldRow]:
    rows = []
    for name, info in model.model_fields.items():
        key = prefix + name
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        aliases = tuple(a for a in [info.alias] if a)
        section = _section_model(info.annotation)
        support = field_support(key) if section is None or _covered(key) else "see its fields"
        rows.append(FieldRow(key, aliases, _default_text(info), info.description or "",
                             extra.get("deepspeed", ""), support))
        if section is not None:
            rows.extend(_rows(section, key + "."))
    return rows


def field_reference() -> list[FieldRow]:
    """Every option (nested ones dotted), then the deprecated names, built from the fields' metadata."""
    rows = _rows(InferenceConfig, "")
    for old, new in DEPRECATED.items():
        rows.append(FieldRow(old, (), "-", f"Deprecated: use {new}.", "same as DeepSpeed (also deprecated there)",
                             "deprecated"))
    return rows


def reference_markdown() -> str:
    """The reference table as Markdown."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = [
        "## Configuration reference",
        "",
        "Generated by `python -m splice.config` (a test keeps this copy current). Every key of DeepSpeed's "
        "`DeepSpeedInferenceConfig` is accepted.",
        "*honoured*: a pipeline stage uses it. *ignored*: a non-default value warns (`SpliceIgnoredOptionWarning`). "
        "*unsupported*: a non-default value raises `ValueError`. *deprecated*: moved to its new key with a "
        "`SpliceDeprecationWarning`.",
        "",
        "| key | aliases | default | splice | meaning | difference from DeepSpeed |",
        "|---|---|---|---|---|---|",
    ]
    for row in field_reference():
        aliases = ", ".join(f"`{a}`" for a in row.aliases)
        lines.append(f"| `{row.key}` | {aliases} | `{cell(row.default)}` | {row.support} | {cell(row.meaning)} | "
                     f"{cell(row.deepspeed_difference)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference_markdown(), end="")
