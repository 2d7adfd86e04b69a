"""``quantize(model, QuantConfig)``: replace every eligible linear by the quantized layer of the scheme's handler.

Eligible: modules whose type is exactly ``nn.Linear``, Hugging Face's ``Conv1D`` (GPT-2 style, weight stored
``[in, out]``) or one of :data:`PLAIN_LINEAR_SUBCLASSES` (model code's ``nn.Linear`` subclasses whose forward is
``F.linear``: Falcon's ``FalconLinear``), except the output head unless ``quantize_lm_head`` and q/k/v projections when
``quantize_qkv`` is False. Other subclasses of ``nn.Linear`` are left alone and reported (noted, and warned by
``plan``, where they hold a material share of the weights): they may carry behaviour (a tensor-parallel all-reduce,
say) that a replacement would drop. Parallel layers should wrap a plain ``nn.Linear`` instead; that inner linear is
then quantized and the wrapper's collective is kept ("shard first, then quantize").

A mixture of experts' experts module (transformers' experts interface: every expert's weights in 3-D tensors) is
quantized too, one quantized linear per expert and matrix (:mod:`splice.quant.experts`); GPTQ calibrates linears only,
so with calibration ids the experts are rounded to nearest (noted in the report). Other weight matrices held as
parameters of other modules stay in float: the report lists them. What cannot apply as asked (those weights,
``quantize_qkv=False`` on a model without a recognised q/k/v projection) is a note of the report; ``plan`` also warns
it (``init_inference`` calls ``plan`` when it resolves, so it warns once, before the model changes).
"""
from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import native
from ..arch import learned_position_limit
from ..arch.paths import input_embeddings
from ..config import SpliceIgnoredOptionWarning, caller_stacklevel
from ..kernel_choice import KernelChoice, quant_kernel
from ..layers.conv1d import is_conv1d, linear_weight
from ..layers.experts import experts_matrices, experts_of_linears
from ..native.memory import SMALL_TENSOR_BYTES, gather_on_huge_pages
from . import gptq
from .experts import reason_experts_stay_float
from .layers import Int4WeightOnlyLinear, Int8DynamicLinear, Int8WeightOnlyLinear, QuantizedLinear
from .scheme import ATTENTION_QKV_NAMES, QuantConfig, is_qkv_projection

#: scheme kind -> the layer class that quantizes a float weight for it.
HANDLERS: dict[str, type[QuantizedLinear]] = {
    cls.kind: cls for cls in (Int8WeightOnlyLinear, Int4WeightOnlyLinear, Int8DynamicLinear)
}

#: ``nn.Linear`` subclasses of model code, as ``(module, class name)``, whose forward computes exactly
#: ``F.linear(x, weight, bias)`` and which add no other behaviour, so a quantized layer replaces them as it does
#: ``nn.Linear``: transformers' ``FalconLinear`` (``input @ weight.T + bias``; tests check its output against
#: ``F.linear``). Only these exact classes: a subclass of one of them may add behaviour of its own.
PLAIN_LINEAR_SUBCLASSES = (("transformers.models.falcon.modeling_falcon", "FalconLinear"),)


@dataclass
class QuantReport:
    """What ``quantize`` did: the layers it replaced, those it left in float (with why), and the weight bytes."""

    kind: str
    quantized: list[str] = field(default_factory=list)
    kept_float: dict[str, str] = field(default_factory=dict)
    float_bytes: int = 0
    quantized_bytes: int = 0
    calibration: str = "round-to-nearest"
    huge_page_bytes: int = 0  # quantized weights gathered into buffers on 2 MiB pages (CPU)
    kernel: KernelChoice | None = None  # which kernels the layers call, and why (None: no layer was replaced)
    head: str = ""  # the output head, where it has a scheme of its own (int8 per channel)
    notes: list[str] = field(default_factory=list)  # what cannot apply as asked (``plan`` warns each)

    @property
    def ratio(self) -> float:
        return self.quantized_bytes / self.float_bytes if self.float_bytes else 1.0

    def summary(self) -> str:
        kept = "; ".join(f"{name} ({why})" for name, why in list(self.kept_float.items())[:5])
        more = f" and {len(self.kept_float) - 5} more" if len(self.kept_float) > 5 else ""
        return (f"{self.kind} ({self.calibration}): {len(self.quantized)} linears, weights "
                f"{self.float_bytes / 2**20:.1f} MiB -> {self.quantized_bytes / 2**20:.1f} MiB ({self.ratio:.3f}x); "
                f"kept in float: {kept or 'none'}{more}"
                + (f"; on 2 MiB pages: {self.huge_page_bytes / 2**20:.0f} MiB" if self.huge_page_bytes else "")
                + (f"; kernels: {self.kernel.kernel}" if self.kernel else "")
                + (f"; output head {self.head}" if self.head else "")
                + "".join(f"; note: {note}" for note in self.notes))


def quantize(model: nn.Module, config: QuantConfig, device: torch.device | str | None = None,
             calibration_ids: torch.Tensor | None = None, act_order: bool = True,
             kernel: KernelChoice | None = None) -> QuantReport:
    """Quantize ``model`` in place. ``device``: where the packed weights go (default: each weight's own device);
    pack on the device the model will run on, since int4 layouts differ between CPU and CUDA.

    ``calibration_ids`` (int4 only): token ids ``[sequences, tokens]`` to calibrate on with GPTQ (``gptq.py``): the
    model's own float forward runs over them once, and each linear's rounding is chosen to minimise its output
    error on its inputs there. ``None``: round-to-nearest. ``act_order`` (GPTQ only; default on): quantize columns by
    decreasing activation energy with group scales fixed up front; without it GPTQ made SmolLM2-135M int4 g64
    asymmetric worse than round-to-nearest (README). Either way the layers, kernels and saved form are the same.

    ``kernel``: which kernels the layers call (``splice.kernel_choice.quant_kernel``'s choice for ``config`` on the
    packing device when None; ``report.kernel`` says which, and why).

    What cannot apply as asked is in ``report.notes`` (and its summary); call :func:`plan` first to have it warned.
    """
    if not isinstance(config, QuantConfig):
        raise TypeError(f"quantize expects a splice.quant.QuantConfig, got {type(config).__name__}")
    check_not_quantized(model, config)
    targets, report = _plan(model, config)
    hessians = {}
    head = output_head(model)
    if calibration_ids is not None:
        ids = check_calibration_ids(calibration_ids, config, model)
        calibrated = {name: m for name, m in targets if not _is_head(m, head) or config.head_scheme() is config}
        hessians = gptq.run_calibration(model, ids, calibrated, head_needed=any(m is head for m in calibrated.values()))
        report.calibration = f"GPTQ on {ids.shape[0]}x{ids.shape[1]} tokens" + (", act-order" if act_order else "")
    experts = experts_targets(model, config)
    if experts and calibration_ids is not None:
        report.notes.append(f"GPTQ calibrates linear layers; the {len(experts)} experts modules' weights are rounded "
                            "to nearest")
    replaced = []
    try:
        for name, module in experts:
            _replace_experts(model, name, module, config, device, kernel, report)
            replaced.append((name, module))
        for name, module in targets:
            scheme = config.head_scheme() if _is_head(module, head) else config
            hessian = hessians.pop(name, None)
            if scheme is not config:  # the head's own scheme: int8 per channel, round-to-nearest
                kernel_of_layer, hessian = None, None
            else:
                kernel_of_layer = kernel
            _replace(model, name, module, scheme, device, kernel_of_layer, report, hessian, act_order)
            replaced.append((name, module))
    except BaseException:
        for name, module in reversed(replaced):  # a failed call (GPTQ's Hessian, say) leaves the model as it was
            model.set_submodule(name, module)
        raise
    report.huge_page_bytes = gather_on_huge_pages(
        [b for m in model.modules() if isinstance(m, QuantizedLinear) for b in m.buffers()
         if b.nbytes >= SMALL_TENSOR_BYTES])
    return report


def _replace(model: nn.Module, name: str, module: nn.Module, config: QuantConfig, device, kernel: KernelChoice | None,
             report: QuantReport, hessian: torch.Tensor | None = None, act_order: bool = False) -> None:
    """``module`` replaced by its quantized layer in ``config``'s scheme (the output head's own, where that differs)."""
    weight, bias = float_weight(module)
    layer, kernel = _quantized_layer(weight, bias, config, device, kernel, report, hessian, act_order)
    if config.kind == report.kind:
        report.kernel = report.kernel or kernel
    else:
        report.head = f"{name}: {config.kind} per output channel ({kernel.kernel} kernels)"
    model.set_submodule(name, layer)
    native.page_out(float_weight(module)[0])  # a memory-mapped float weight's pages: resident no more
    report.quantized.append(name)


def _quantized_layer(weight: torch.Tensor, bias: torch.Tensor | None, config: QuantConfig, device,
                     kernel: KernelChoice | None, report: QuantReport, hessian: torch.Tensor | None = None,
                     act_order: bool = False) -> tuple[QuantizedLinear, KernelChoice]:
    """``weight [out, in]`` (and ``bias``) as ``config``'s quantized layer, packed on ``device`` (default: the
    weight's) for ``kernel`` (default: ``quant_kernel``'s choice there), its bytes counted in ``report``; with the
    kernel it calls."""
    if device is not None:
        weight, bias = weight.to(device), None if bias is None else bias.to(device)
    kernel = kernel or quant_kernel(config, weight.device)
    handler = HANDLERS[config.kind]
    if hessian is None:
        layer = handler.from_float(weight, bias, config, native=kernel.native, dot_products=kernel.dot_products)
    else:
        layer = handler.from_float(weight, bias, config, native=kernel.native, dot_products=kernel.dot_products,
                                   hessian=hessian, act_order=act_order)
    report.float_bytes += weight.numel() * 2  # against bf16, the dtype these kernels replace
    report.quantized_bytes += layer.weight_nbytes()
    return layer, kernel


def experts_targets(model: nn.Module, config: QuantConfig) -> list[tuple[str, nn.Module]]:
    """The experts modules ``quantize`` replaces (see :mod:`splice.quant.experts`); raises where the scheme's groups
    do not fit one of their matrices, naming it."""
    found = []
    for name, module in model.named_modules():
        weights = experts_matrices(module)
        if weights is None or reason_experts_stay_float(module) is not None:
            continue
        for matrix, (weight, _) in weights.items():
            _check_scheme_fits(f"{name}.{matrix}", config, weight.shape[2])
        found.append((name, module))
    return found


def _replace_experts(model: nn.Module, name: str, module: nn.Module, config: QuantConfig, device,
                     kernel: KernelChoice | None, report: QuantReport) -> None:
    """The experts ``module`` replaced by a copy holding one quantized linear per expert and matrix."""
    def make_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> QuantizedLinear:
        nonlocal kernel
        layer, kernel = _quantized_layer(weight, bias, config, device, kernel, report)
        return layer

    quantized = experts_of_linears(module, make_linear)
    report.kernel = report.kernel or kernel
    model.set_submodule(name, quantized)
    for matrix, layers in ((n, getattr(quantized, n)) for n in experts_matrices(module)):
        report.quantized += [f"{name}.{matrix}.{expert}" for expert in range(len(layers))]
        native.page_out(getattr(module, matrix))


def check_not_quantized(model: nn.Module, config: QuantConfig) -> None:
    """A model with splice's quantized layers would keep them as they are (they are not linears), and the call would
    report nothing done: refused, naming one, before the model changes."""
    found = first_quantized_layer(model)
    if found is not None:
        name, layer = found
        raise ValueError(f"quantize ({config.kind}) was given a model that is already quantized: layer "
                         f"{name or '(the model itself)'} is {type(layer).__name__} ({layer.kind}); allowed: the "
                         "float model (load it again, or load_quantized into a float skeleton)")


def first_quantized_layer(model: nn.Module) -> tuple[str, QuantizedLinear] | None:
    """The first of splice's quantized layers in ``model``, with its name; None for a float model."""
    return next(((name, module) for name, module in model.named_modules() if isinstance(module, QuantizedLinear)),
                None)


def check_calibration_ids(ids, config: QuantConfig, model: nn.Module | None = None) -> torch.Tensor:
    """``ids`` as a ``[sequences, tokens]`` LongTensor, checked against ``config`` and, where given, ``model`` (a
    token embedding to feed them to, its vocabulary, its learned positions): ``ValueError``/``TypeError`` naming what
    is wrong, before any calibration forward."""
    if config.kind != "int4_weight_only":
        raise ValueError(f"calibration_ids (GPTQ) is supported for int4 weights only, not {config.kind!r}; allowed: "
                         "QuantConfig(bits=4, ...), or calibration_ids=None (round-to-nearest)")
    ids = _as_id_tensor(ids)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.numel() == 0 or not _is_integer_dtype(ids.dtype):
        raise ValueError(f"calibration_ids must be a non-empty [sequences, tokens] integer tensor (not bool, not "
                         f"float), got dtype={ids.dtype}, shape={tuple(ids.shape)}")
    ids = ids.long()
    if model is not None:
        _check_takes_token_ids(model)
        _check_ids_in_vocabulary(model, ids)
        _check_ids_within_positions(model, ids)
    return ids


def _as_id_tensor(ids) -> torch.Tensor:
    """A tensor of ``ids`` in the dtype its values have (nested lists of bools or floats stay so, to be refused)."""
    if isinstance(ids, torch.Tensor):
        return ids
    try:
        return torch.as_tensor(ids)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(f"calibration_ids must be a [sequences, tokens] integer tensor or nested lists of equal "
                        f"length, got {type(ids).__name__}: {err}") from None


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    """Integer token ids; bool (True/False would read as ids 1 and 0), float and complex refused."""
    return dtype != torch.bool and not dtype.is_floating_point and not dtype.is_complex


def _check_takes_token_ids(model: nn.Module) -> None:
    """GPTQ calibrates on the model's forward over token ids: a model without a token embedding cannot take them."""
    if input_embeddings(model) is None and not any(isinstance(m, nn.Embedding) for m in model.modules()):
        raise ValueError(f"calibration_ids need a model with a token embedding (GPTQ runs its forward over the ids), "
                         f"but {type(model).__name__} has none (no get_input_embeddings(), no nn.Embedding); "
                         "allowed: calibration_ids=None (round-to-nearest) for this model")


def _check_ids_within_positions(model: nn.Module, ids: torch.Tensor) -> None:
    """Sequences longer than a model's learned position table (GPT-2's, OPT's) would fail in the calibration forward
    as a bare IndexError."""
    limit = learned_position_limit(model)
    if limit is not None and ids.shape[1] > limit:
        raise ValueError(f"calibration_ids of shape {tuple(ids.shape)} hold sequences of {ids.shape[1]} tokens, past "
                         f"the {limit} learned positions of this {model.config.model_type} model; allowed: at most "
                         f"{limit} tokens per sequence")


def _check_ids_in_vocabulary(model: nn.Module, ids: torch.Tensor) -> None:
    """Token ids outside the input embedding's rows would fail in the calibration forward as a bare IndexError."""
    embeddings = input_embeddings(model)
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is None:
        return
    bad = ids[(ids < 0) | (ids >= rows)]
    if bad.numel():
        raise ValueError(f"calibration_ids hold token id {int(bad[0])} ({bad.numel()} out of range); allowed: "
                         f"0..{rows - 1}, the rows of the model's input embedding")


def plan(model: nn.Module, config: QuantConfig) -> tuple[list[tuple[str, nn.Module]], QuantReport]:
    """The linears ``quantize`` would replace, and a report naming those it keeps in float (weight matrices held
    outside linears included). Validates the scheme against every target's shape (raises ``ValueError``) and warns
    (``SpliceIgnoredOptionWarning``) each of the report's notes, without changing the model."""
    targets, report = _plan(model, config)
    for note in report.notes:
        warnings.warn(note, SpliceIgnoredOptionWarning, stacklevel=caller_stacklevel())
    return targets, report


def _plan(model: nn.Module, config: QuantConfig) -> tuple[list[tuple[str, nn.Module]], QuantReport]:
    report = QuantReport(config.kind)
    head = output_head(model)
    modules = dict(model.named_modules())
    targets = []
    for name, module in modules.items():
        reason = reason_to_skip(name, module, head, config, _parent(modules, name))
        if reason == "":
            scheme = config.head_scheme() if _is_head(module, head) else config
            _check_scheme_fits(name, scheme, float_weight(module)[0].shape[1])
            targets.append((name, module))
        elif reason is not None:
            report.kept_float[name] = reason
    experts_targets(model, config)  # the scheme must fit the experts' matrices too
    if not config.quantize_qkv and not _has_qkv_projection(modules):
        report.notes.append(_no_qkv_note(model))
    routers = _router_weights(modules)
    report.kept_float.update(dict.fromkeys(routers, "a router's weight (it picks the experts each token runs "
                                                    "through; rounded, it could pick others): kept in float"))
    outside = {path: found for path, found in _weights_outside_linears(modules).items() if path not in routers}
    report.kept_float.update({name: reason for name, (_, reason) in outside.items()})
    share = _share_outside_linears(modules, outside) if outside else 0.0
    if share >= NOTED_SHARE_OUTSIDE_LINEARS:
        report.notes.append(_outside_linears_note(outside, share))
    subclassed = _skipped_subclasses(modules)
    share = _share_of_linear_weights(modules, outside, subclassed) if subclassed else 0.0
    if share >= NOTED_SHARE_OUTSIDE_LINEARS:
        report.notes.append(_skipped_subclasses_note(subclassed, share))
    return targets, report


def reason_to_skip(name: str, module: nn.Module, head: nn.Module | None, config: QuantConfig,
                   parent: nn.Module | None = None) -> str | None:
    """'' to quantize; a reason to keep it in float; None for modules that are not linears at all. ``parent``: the
    module holding it, where known (it tells T5's attention ``q`` from other modules named ``q``)."""
    if not isinstance(module, nn.Linear) and not _is_conv1d(module):
        return None
    if not is_plain_linear(module):
        return f"{type(module).__name__} subclasses nn.Linear; wrap a plain nn.Linear to have it quantized"
    if _is_head(module, head) and config.head_scheme() is None:
        return "output head; set quantize_lm_head=True (the scheme) or lm_head_int8=True to quantize it"
    if not config.quantize_qkv and is_qkv_projection(name, parent):
        return "q/k/v projection with quant.qkv.enabled=False"
    return ""


def is_plain_linear(module: nn.Module) -> bool:
    """``module`` computes ``F.linear`` and nothing more: an ``nn.Linear``, a ``Conv1D``, or one of
    :data:`PLAIN_LINEAR_SUBCLASSES` (exactly; their modules are imported wherever a model holds one)."""
    if type(module) is nn.Linear or _is_conv1d(module):
        return True
    return any(type(module) is getattr(sys.modules.get(path), name, None) for path, name in PLAIN_LINEAR_SUBCLASSES)


def _parent(modules: dict[str, nn.Module], name: str) -> nn.Module | None:
    return modules.get(name.rpartition(".")[0]) if name else None


def _check_scheme_fits(name: str, scheme: QuantConfig, in_features: int) -> None:
    """The scheme's groups must fit the layer; the error names the layer, which the scheme's own check cannot."""
    try:
        scheme.group_for(in_features)
    except ValueError as error:
        raise ValueError(f"layer {name} (in_features={in_features}): {error}") from None


def _has_qkv_projection(modules: dict[str, nn.Module]) -> bool:
    return any(_is_linear_like(module) and is_qkv_projection(name, _parent(modules, name))
               for name, module in modules.items())


def _no_qkv_note(model: nn.Module) -> str:
    """``quant.qkv.enabled=False`` that matches no linear would otherwise quantize every projection without a word."""
    return (f"quant.qkv.enabled=False (QuantConfig.quantize_qkv=False) has no effect on {type(model).__name__}: no "
            f"query/key/value projection was recognised among its linear layers (leaf names in "
            f"splice.quant.scheme.QKV_NAMES, or {'/'.join(ATTENTION_QKV_NAMES)} inside an attention module), so "
            "every linear is quantized; allowed: remove the setting for this model")


def _weights_outside_linears(modules: dict[str, nn.Module]) -> dict[str, tuple[torch.Tensor, str]]:
    """``{parameter path: (parameter, why it stays in float)}`` for weight matrices (2-D, or 3-D stacks of them, as
    a mixture-of-experts block holds its experts) that are parameters of a module other than a linear, an
    embedding, a norm or a convolution: ``quantize`` replaces linear layers only, so these stay in float."""
    found = {}
    for module_name, module in modules.items():
        if _is_linear_like(module) or _holds_no_matrices(module):
            continue
        if experts_matrices(module) is not None:
            why = reason_experts_stay_float(module)
            if why is not None:
                found.update({f"{module_name}.{matrix}": (weight, why)
                              for matrix, (weight, _) in experts_matrices(module).items()})
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if _is_weight_matrix(param_name, param):
                path = f"{module_name}.{param_name}" if module_name else param_name
                found[path] = (param, f"a {'x'.join(map(str, param.shape))} weight held by {type(module).__name__}, "
                                      "not an nn.Linear; splice quantizes linear layers only")
    return found


def _router_weights(modules: dict[str, nn.Module]) -> set[str]:
    """Parameter paths of routers: a matrix held outside linears, next to an experts module (same parent), with a row
    per expert."""
    found = set()
    for name, module in modules.items():
        parent = _parent(modules, name)
        experts = [experts_matrices(sibling) for sibling in (parent.children() if parent is not None else ())]
        counts = {next(iter(weights.values()))[0].shape[0] for weights in experts if weights is not None}
        if not counts or _is_linear_like(module) or experts_matrices(module) is not None:
            continue
        found.update(f"{name}.{param_name}" for param_name, param in module.named_parameters(recurse=False)
                     if param.dim() == 2 and param.shape[0] in counts)
    return found


#: The share of a model's linear-like weights held outside linears from which the report notes it and ``plan`` warns:
#: a mixture of experts' experts are most of the model; a state-space layer's few small matrices (Mamba's A_log)
#: are listed under 'kept in float' alone.
NOTED_SHARE_OUTSIDE_LINEARS = 0.01


def _share_outside_linears(modules: dict[str, nn.Module], outside: dict[str, tuple[torch.Tensor, str]]) -> float:
    kept = sum(param.numel() for param, _ in outside.values())
    return kept / (kept + sum(_linear_weight_count(module) for module in modules.values()))


def _skipped_subclasses(modules: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """The float ``nn.Linear`` subclasses (and ``Conv1D`` ones) that ``quantize`` leaves alone: not plain linears."""
    return {name: module for name, module in modules.items()
            if (isinstance(module, nn.Linear) or is_conv1d(module)) and not is_plain_linear(module)}


def _share_of_linear_weights(modules: dict[str, nn.Module], outside: dict[str, tuple[torch.Tensor, str]],
                             kept: dict[str, nn.Module]) -> float:
    """The share of the model's linear-like weights (those held outside linears included) that ``kept`` hold."""
    total = sum(_linear_weight_count(module) for module in modules.values())
    total += sum(param.numel() for param, _ in outside.values())
    return sum(_linear_weight_count(module) for module in kept.values()) / max(total, 1)


def _skipped_subclasses_note(kept: dict[str, nn.Module], share: float) -> str:
    """How much of the model's linear-like weights (``share`` of them) stays in float in ``nn.Linear`` subclasses."""
    classes = sorted({type(module).__name__ for module in kept.values()})
    largest = max(kept, key=lambda name: _linear_weight_count(kept[name]))
    return (f"{len(kept)} linear layer(s) ({share:.0%} of the model's linear-like weights; classes "
            f"{', '.join(classes)}; the largest: {largest}) stay in float: they subclass nn.Linear, and a subclass may "
            "carry behaviour a quantized layer would drop, so splice quantizes nn.Linear itself, Conv1D and the "
            "subclasses in splice.quant.api.PLAIN_LINEAR_SUBCLASSES only; allowed: wrap a plain nn.Linear (the "
            "quantize report lists these under 'kept in float')")


def _outside_linears_note(outside: dict[str, tuple[torch.Tensor, str]], share: float) -> str:
    """How much of the model's linear-like weights (``share`` of them) stays in float, held outside linears."""
    kept = sum(param.numel() for param, _ in outside.values())
    largest = max(outside, key=lambda name: outside[name][0].numel())
    return (f"{kept:,} parameters in {len(outside)} tensors ({share:.0%} of the model's linear-like weights) stay "
            f"in float: splice quantizes nn.Linear/Conv1D layers only, and these are "
            f"parameters of other modules (a mixture-of-experts block's experts, say; the largest here: {largest}, "
            f"{outside[largest][1]}); the quantize report lists them under 'kept in float'")


def _is_linear_like(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, QuantizedLinear)) or is_conv1d(module)


def _linear_weight_count(module: nn.Module) -> int:
    if isinstance(module, QuantizedLinear):
        return module.in_features * module.out_features
    return float_weight(module)[0].numel() if _is_linear_like(module) else 0


#: Modules whose matrices are not linear weights (lookup tables, per-channel scales, convolution kernels).
_NOT_LINEAR_MODULES = (nn.Embedding, nn.EmbeddingBag, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm,
                       nn.modules.conv._ConvNd, nn.modules.batchnorm._NormBase)


def _holds_no_matrices(module: nn.Module) -> bool:
    """Embeddings and norms (by type, or by a class name that says so, as model code's own norms do), convolutions."""
    name = type(module).__name__.lower()
    return isinstance(module, _NOT_LINEAR_MODULES) or "embedding" in name or "norm" in name


def _is_weight_matrix(name: str, param: torch.Tensor) -> bool:
    """A floating matrix (or a stack of them) of at least 2 x 2; biases, embeddings tables and norm scales excluded
    by name where a module holds them next to its weights."""
    if not param.is_floating_point() or param.dim() not in (2, 3) or min(param.shape[-2:]) < 2:
        return False
    return not any(word in name.lower() for word in ("bias", "embed", "norm"))


def output_head(model: nn.Module) -> nn.Module | None:
    return model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None


def _is_head(module: nn.Module, head: nn.Module | None) -> bool:
    """``module`` is the output head, or the plain linear inside a vocab-parallel one."""
    return head is not None and (module is head or module is getattr(head, "linear", None))


def float_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight [out, in], bias)`` of an ``nn.Linear`` or a ``Conv1D`` (whose weight is stored ``[in, out]``)."""
    return linear_weight(module)


def _is_conv1d(module: nn.Module) -> bool:
    """A ``Conv1D`` itself: like ``nn.Linear``, a subclass may carry behaviour a replacement would drop."""
    return is_conv1d(module, exact=True)
