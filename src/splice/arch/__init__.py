"""Architecture records and their registry, keyed on the model config's ``model_type``."""
from __future__ import annotations

from typing import Any

from .families import RECORDS
from .record import (ArchRecord, ModelDims, RopeSpec, check_fits, learned_positions, model_dims, rooted,
                     tensor_parallel_plan)

REGISTRY: dict[str, ArchRecord] = {record.model_type: record for record in RECORDS}

__all__ = ["ArchRecord", "ModelDims", "RopeSpec", "REGISTRY", "check_fits", "find", "learned_position_limit", "lookup",
           "model_dims", "record_for", "rooted", "supported", "tensor_parallel_plan"]


def supported() -> list[str]:
    return sorted(REGISTRY)


def find(config: Any) -> ArchRecord | None:
    """The record for ``config.model_type``, or None where kernel injection has none."""
    return REGISTRY.get(getattr(config, "model_type", None))


def lookup(config: Any) -> ArchRecord:
    """The record for ``config.model_type``; raises ``ValueError`` naming the supported families otherwise."""
    model_type = getattr(config, "model_type", None)
    record = find(config)
    if record is None:
        raise ValueError(
            f"kernel injection has no architecture record for model_type={model_type!r}; "
            f"supported: {', '.join(supported())} (use replace_with_kernel_inject=False for other models)"
        )
    return record


def record_for(model: Any) -> ArchRecord:
    """The record for ``model`` (by its config's ``model_type``), its paths rooted at ``model`` itself."""
    return rooted(lookup(model.config), model)


def learned_position_limit(model: Any) -> int | None:
    """How many positions ``model`` has learned embeddings for (GPT-2's ``n_positions``, OPT's
    ``max_position_embeddings``: the families whose record says ``positions="learned"``, as kernel injection reads
    it); None for a model that computes its positions (rotary, ALiBi) or whose family splice has no record of."""
    config = getattr(model, "config", None)
    record = find(config)
    return None if record is None else learned_positions(record, config)
