"""The JSON document ``kvcore plan --json`` prints, and its schema.

The document is versioned (``schema``) and described by the JSON Schema
shipped at ``kvcore/tools/schemas/plan.v1.json``; :func:`load_schema` reads it.
Its ``plan`` member is the plan itself, as :func:`kvcore.dump_config` writes
it, so a scheduler can load it with :func:`kvcore.load_config` and ship it
to its workers.
"""

from __future__ import annotations

import json
from collections import Counter
from importlib import resources
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

from kvcore.serialize import make_converter
from kvcore.tools.cli.options import Planned
from kvcore.tools.cli.parsers import PLAN_SCHEMA_VERSION
from kvcore.tools.summary import PlanSummary

__all__ = ["SCHEMA_VERSION", "load_schema", "plan_document"]

#: The ``schema`` member of every document; bumped when a field changes meaning.
SCHEMA_VERSION = PLAN_SCHEMA_VERSION


def _version() -> str:
    try:
        return version("kvcore")
    except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "unknown"


def load_schema() -> dict[str, Any]:
    """The JSON Schema of the document (draft 2020-12)."""
    text = resources.files("kvcore.tools.schemas").joinpath("plan.v1.json").read_text()
    schema: dict[str, Any] = json.loads(text)
    return schema


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def plan_document(
    planned: Planned, summary: PlanSummary, *, dtype_name: str = "auto"
) -> dict[str, Any]:
    """The document: model, settings, notes, the plan, its summary and the
    capacity rows."""
    choices = planned.choices
    plan = make_converter(planned.registry).unstructure(planned.plan)
    return {
        "schema": SCHEMA_VERSION,
        "kvcore_version": _version(),
        "verdict": summary.verdict(),
        "model": {
            "name": planned.model.name,
            "source": str(planned.source),
            "num_layers": len(planned.model.layers),
            "kinds": dict(Counter(s.kind for s in planned.model.layers.values())),
        },
        "settings": {
            "memory": planned.budget.to_dict(),
            "tensor_parallel_size": choices.tensor_parallel_size,
            "kv_cache_dtype": dtype_name,
            "kv_cache_dtype_resolved": _dtype_name(choices.kv_cache_dtype),
            "block_size": choices.block_size,
            "contexts": list(planned.contexts),
            "max_num_batched_tokens": planned.config.max_num_batched_tokens,
            "packing_policy": planned.config.cache_config.packing_policy,
            "layout": plan["kv_cache_layout"],
            "enable_prefix_caching": planned.config.cache_config.enable_prefix_caching,
            "max_block_growth": planned.config.cache_config.max_block_growth,
            "pipeline_parallel_size": (
                planned.config.parallel_config.pipeline_parallel_size
            ),
            "pipeline_stage": None if planned.stage is None else planned.stage[0],
            "max_model_len": planned.config.max_model_len,
            "max_num_seqs": planned.max_num_seqs,
            "mamba_ssm_cache_dtype": _dtype_name(choices.mamba_ssm_cache_dtype),
        },
        "notes": list(summary.notes),
        "plan": plan,
        "summary": summary.to_dict(),
        "capacity": [row.to_dict() for row in summary.rows],
    }
