"""quantize: integer weight (and activation) kernels, after sharding and fusing.

Hands the model to ``splice.quant.quantize`` with the plan's scheme (``QuantConfig``; how DeepSpeed's keys map to it
is documented in ``splice/quant/scheme.py``). Runs after the shard step, so each rank quantizes its own shard, and
after fusing, so fused q/k/v and gate/up linears are quantized as one matrix each. Packs for the device the model
computes on. With calibration ids (int4), GPTQ calibrates on the model's own forward over them (on every rank, on its
shard, when sharded: all ranks must pass the same ids, checked before calibrating).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..distributed import ParallelContext
from ..plan import Plan
from ..quant import QuantReport, quantize
from . import Stage, StepReport


@dataclass(frozen=True)
class QuantizeReport(StepReport):
    quant: QuantReport | None  # None: no quantization asked for

    def summary(self) -> str:
        return "skipped (no quantization asked for)" if self.quant is None else self.quant.summary()


def quantize_weights(stage: Stage, plan: Plan) -> tuple[Stage, QuantizeReport]:
    if plan.quant is None:
        return stage, QuantizeReport("quantize", None)
    check_same_ids_on_every_rank(plan.calibration_ids, plan.parallel)
    report = quantize(stage.model, plan.quant, device=plan.device, calibration_ids=plan.calibration_ids,
                      kernel=plan.quant_kernel)
    if stage.runtime is not None:  # with quantize_lm_head the head was replaced: the runtime decodes with the new one
        stage.runtime.lm_head = stage.model.get_output_embeddings()
    return stage, QuantizeReport("quantize", report)


def check_same_ids_on_every_rank(ids: torch.Tensor | None, parallel: ParallelContext) -> None:
    """GPTQ's calibration forward joins every rank in its collectives: ranks given other ids would calibrate their
    shards on other tokens, or (other shapes) wait on each other. Every rank learns whether any rank's ids differ
    from rank 0's, so that all of them raise together."""
    if ids is None or not parallel.enabled:
        return
    differs = torch.tensor([0 if torch.equal(parallel.broadcast_object(ids), ids) else 1])
    if parallel.all_reduce(differs).item():
        raise ValueError(f"quant.weight.calibration_ids differ between the ranks ({int(differs.item())} of "
                         f"{parallel.world_size} differ from rank 0's; this rank's shape {tuple(ids.shape)}); "
                         "allowed: the same ids on every rank")
