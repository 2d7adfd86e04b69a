"""Kernel injection: swap transformer blocks for splice's fused inference block."""
from __future__ import annotations


def check(model, config, ctx) -> None:
    if config.replace_with_kernel_inject:
        raise NotImplementedError(
            "replace_with_kernel_inject=True is not available yet in this splice version; "
            "use replace_with_kernel_inject=False"
        )


def inject_kernels(model, config, ctx):
    ctx.record("inject", "skipped (replace_with_kernel_inject=False)")
    return model
