"""Quantization: integer weight (and activation) kernels behind one entry point.

    from splice.quant import QuantConfig, quantize
    report = quantize(model, QuantConfig(bits=4, group_size=64))   # in place; report.summary() says what it did
    quantize(model, QuantConfig(bits=4, group_size=64), calibration_ids=ids)  # int4 with GPTQ (gptq.py)

Schemes (``QuantConfig.kind``; ``HANDLERS`` maps each to its layer): ``int8_weight_only`` (per output channel or
grouped), ``int4_weight_only`` (groups of 32/64/128/256) and ``int8_dynamic`` (W8A8). ``save_quantized`` /
``load_quantized`` write and read packed checkpoints. See ``scheme.py`` for the mapping from splice's config keys
and ``kernels.py`` for which torch kernel runs at which batch size, and why.
"""
from .api import HANDLERS, QuantReport, plan, quantize
from .layers import Int4WeightOnlyLinear, Int8DynamicLinear, Int8WeightOnlyLinear, QuantizedLinear
from .qmath import sqnr_db
from .saving import load_quantized, read_scheme, save_quantized
from .scheme import QuantConfig

__all__ = [
    "HANDLERS", "Int4WeightOnlyLinear", "Int8DynamicLinear", "Int8WeightOnlyLinear", "QuantConfig", "QuantReport",
    "QuantizedLinear", "load_quantized", "plan", "quantize", "read_scheme", "save_quantized", "sqnr_db",
]
