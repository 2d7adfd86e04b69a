"""place: put the model's weights on their home device (the plan's device, or the CPU with keep_module_on_host).

A float model kept on the CPU runs there, or on the device once the caller moves it. Quantized weights are never
moved off an accelerator here: they were packed on it for its kernels, so ``plan.resolve`` refuses
keep_module_on_host with quantization there (``check_quantized_on_host``)."""
from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint import parameter_bytes
from ..plan import Plan
from . import Stage, StepReport


@dataclass(frozen=True)
class PlaceReport(StepReport):
    device: str
    keep_module_on_host: bool
    parameter_bytes: int

    def summary(self) -> str:
        host = " (keep_module_on_host)" if self.keep_module_on_host else ""
        return f"on {self.device}{host}; {self.parameter_bytes / 2**20:.1f} MiB of parameters"


def place(stage: Stage, plan: Plan) -> tuple[Stage, PlaceReport]:
    model = stage.model.to(plan.home)
    return stage.with_(model=model), PlaceReport("place", str(plan.home), plan.keep_on_host, parameter_bytes(model))
