"""Pipeline stages: a model's layers split into contiguous stages, each
stage planned on its own, with groups that line up across stages.

An engine running ``P`` pipeline stages gives each stage (one GPU, or one
tensor-parallel team) a contiguous range of the model's layers.  The
scheduler still runs one block pool and one manager per group, so a block id
of group ``g`` names a page of group ``g``'s layers on *every* stage at once:
each stage's plan must have the same number of groups, and group ``g`` must
run the same manager (the same kind, block size and hit rules) on every
stage.  Each stage's own group ``g`` holds that stage's share of the group's
layers, so no stage carries an empty (padding) group.

The split rule (:func:`split_pipeline_stages`): layers belong to the model
layer whose index is the first dotted integer in their name
(``model.layers.12.self_attn`` is layer 12; a model layer's cache layers
never split across stages).  ``N`` model layers over ``P`` stages give each
stage ``N // P`` layers, and the ``N % P`` stages just before the last take
one more (the first stage also runs the embedding and the last the LM head,
so those are the stages left lighter).  ``stage_sizes`` overrides it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import attrs

from kvcore.config import EngineConfig
from kvcore.errors import PlanError
from kvcore.plan.capacity import min_blocks_for_one_request
from kvcore.plan.grouping import get_kv_cache_groups
from kvcore.plan.placement import build_kv_cache_tensors
from kvcore.plan.plan import get_kv_cache_config_from_groups
from kvcore.registry import KindRegistry
from kvcore.spec import KVCacheSpec, UniformTypeKVCacheSpecs
from kvcore.structs import KVCacheConfig, KVCacheGroupSpec

__all__ = [
    "PipelinePlan",
    "combine_stage_plans",
    "line_up_problem",
    "model_layer_index",
    "plan_pipeline_stages",
    "split_pipeline_stages",
    "stage_sizes_for",
    "with_num_blocks",
]

_INDEX = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def model_layer_index(name: str) -> int:
    """The model layer a cache layer belongs to: the first dotted integer of
    its name (``model.layers.12.attn.indexer`` -> 12)."""
    found = _INDEX.search(name)
    if found is None:
        msg = (
            f"cache layer {name!r} names no model layer index (a dotted integer "
            "such as 'model.layers.12.self_attn'), so it cannot be placed on a "
            "pipeline stage; rename the layers or pass stage_layers explicitly"
        )
        raise PlanError(msg)
    return int(found.group(1))


def stage_sizes_for(num_layers: int, num_stages: int) -> list[int]:
    """Model layers per stage under the default rule: ``N // P`` each, one
    more on each of the ``N % P`` stages just before the last."""
    if num_stages < 1 or num_layers < num_stages:
        msg = (
            f"{num_layers} model layers cannot fill {num_stages} pipeline stages; "
            "every stage needs at least one layer: use fewer stages"
        )
        raise PlanError(msg)
    base, extra = divmod(num_layers, num_stages)
    sizes = [base] * num_stages
    for i in range(num_stages - 1 - extra, num_stages - 1):
        sizes[i] += 1
    return sizes


def split_pipeline_stages(
    layer_names: Sequence[str],
    num_stages: int,
    *,
    stage_sizes: Sequence[int] | None = None,
) -> list[list[str]]:
    """The cache layers of each stage, in model order.

    :param layer_names: every cache layer of the model.
    :param num_stages: the pipeline-parallel size.
    :param stage_sizes: model layers per stage (overrides the default rule);
        they must be positive and add up to the model's layers.
    """
    by_index: dict[int, list[str]] = {}
    for name in layer_names:
        by_index.setdefault(model_layer_index(name), []).append(name)
    indices = sorted(by_index)
    if stage_sizes is None:
        sizes = stage_sizes_for(len(indices), num_stages)
    else:
        sizes = list(stage_sizes)
        if (
            len(sizes) != num_stages
            or any(type(s) is not int or s < 1 for s in sizes)
            or sum(sizes) != len(indices)
        ):
            msg = (
                f"stage_sizes {sizes} must give {num_stages} positive layer counts "
                f"adding up to the model's {len(indices)} layers (the default rule "
                f"gives {stage_sizes_for(len(indices), num_stages)})"
            )
            raise PlanError(msg)
    stages: list[list[str]] = []
    start = 0
    for size in sizes:
        stages.append([n for i in indices[start : start + size] for n in by_index[i]])
        start += size
    return stages


def with_num_blocks(plan: KVCacheConfig, num_blocks: int) -> KVCacheConfig:
    """``plan`` re-placed for ``num_blocks`` blocks (at most its own count),
    as when every worker takes the smallest worker's block count."""
    if type(num_blocks) is not int or not 2 <= num_blocks <= plan.num_blocks:
        msg = (
            f"a plan of {plan.num_blocks} blocks can only shrink to between 2 and "
            f"{plan.num_blocks} blocks, not {num_blocks!r}"
        )
        raise PlanError(msg)
    if num_blocks == plan.num_blocks or plan.kv_cache_layout is None:
        return plan
    tensors = build_kv_cache_tensors(
        plan.kv_cache_groups,
        num_blocks=num_blocks,
        size=plan.bytes_per_block * num_blocks,
        layout=plan.kv_cache_layout,
        bytes_per_block=plan.bytes_per_block,
    )
    return attrs.evolve(plan, num_blocks=num_blocks, kv_cache_tensors=tensors)


def _restricted(group: KVCacheGroupSpec, names: set[str]) -> KVCacheGroupSpec | None:
    kept = [n for n in group.layer_names if n in names]
    if not kept:
        return None
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        members = {n: spec.kv_cache_specs[n] for n in kept}
        spec = UniformTypeKVCacheSpecs(
            block_size=spec.block_size, kv_cache_specs=members
        )
    return KVCacheGroupSpec(kept, spec)


def line_up_problem(stage_groups: Sequence[Sequence[KVCacheGroupSpec]]) -> str | None:
    """Why the stages' groups do not line up (``None`` when they do): equal
    group counts, and group ``g`` running the same manager spec on every
    stage."""
    first = stage_groups[0]
    for s, groups in enumerate(stage_groups[1:], start=1):
        if len(groups) != len(first):
            return (
                f"stage 0 has {len(first)} cache groups but stage {s} has {len(groups)}"
            )
        for g, (a, b) in enumerate(zip(first, groups, strict=True)):
            if a.manager_spec != b.manager_spec:
                return (
                    f"group {g} runs {_difference(a.manager_spec, b.manager_spec)} "
                    f"on stage 0 but {_difference(b.manager_spec, a.manager_spec)} "
                    f"on stage {s}"
                )
    return None


def _difference(spec: KVCacheSpec, other: KVCacheSpec) -> str:
    """``spec`` in a few words that tell it from ``other``: its kind and
    block size, and the fields whose values differ when those match."""
    label = f"{spec.kind} (block {spec.block_size})"
    if type(spec) is not type(other) or spec.block_size != other.block_size:
        return label
    differ = [
        f"{f.name}={getattr(spec, f.name)!r}"
        for f in attrs.fields(type(spec))
        if getattr(spec, f.name) != getattr(other, f.name)
    ]
    return f"{label} with {', '.join(differ)}" if differ else label


def _stage_groups(
    config: EngineConfig,
    specs: Mapping[str, KVCacheSpec],
    stages: list[list[str]],
    registry: KindRegistry | None,
) -> list[list[KVCacheGroupSpec]]:
    """Each stage's own grouping when those line up; else the whole model's
    grouping cut at the stage boundaries, when no group is then empty on a
    stage; else a :class:`PlanError` with both reasons."""
    own = [
        get_kv_cache_groups(config, {n: specs[n] for n in names}, registry=registry)
        for names in stages
    ]
    own_problem = line_up_problem(own)
    if own_problem is None:
        return own
    whole = get_kv_cache_groups(config, specs, registry=registry)
    cut: list[list[KVCacheGroupSpec]] = []
    whole_problem = None
    for s, names in enumerate(stages):
        keep = set(names)
        groups = [_restricted(g, keep) for g in whole]
        empty = [g for g, group in enumerate(groups) if group is None]
        if empty:
            whole_problem = (
                f"the whole model's groups {empty[:5]} have no layer on stage {s}"
            )
            break
        cut.append([g for g in groups if g is not None])
    if whole_problem is None:
        whole_problem = line_up_problem(cut)
    if whole_problem is None:
        return cut
    sizes = [len({model_layer_index(n) for n in names}) for names in stages]
    msg = (
        f"the {len(stages)} pipeline stages (model layers per stage {sizes}) give "
        f"cache groups that do not line up: planned per stage, {own_problem}; "
        f"planned whole, {whole_problem}. Put the stage boundaries on repeats of "
        "the model's layer pattern (stage_sizes), or use fewer stages"
    )
    raise PlanError(msg)


@attrs.frozen(kw_only=True)
class PipelinePlan:
    """One plan per pipeline stage, all of one block count.

    :param stages: stage ``s``'s plan (its own layers, tensors and block
        stride); every plan records ``pipeline_stage`` and
        ``pipeline_stages``.
    """

    stages: tuple[KVCacheConfig, ...]

    @property
    def num_blocks(self) -> int:
        """The block count every stage (and the scheduler) runs."""
        return self.stages[0].num_blocks

    @property
    def stage_layers(self) -> list[list[str]]:
        """The cache layers each stage holds, in stage and model order."""
        recorded = self.stages[0].pipeline_stages
        if recorded is not None:
            return [list(names) for names in recorded]
        return [
            [n for g in plan.kv_cache_groups for n in g.layer_names]
            for plan in self.stages
        ]

    def stage_of(self, layer: str) -> int:
        """The stage holding ``layer``."""
        for s, names in enumerate(self.stage_layers):
            if layer in names:
                return s
        msg = f"layer {layer!r} is on no pipeline stage of this plan"
        raise PlanError(msg)

    def scheduler_config(self) -> KVCacheConfig:
        """The scheduler's view (see :func:`combine_stage_plans`)."""
        return combine_stage_plans(self.stages)


def combine_stage_plans(plans: Sequence[KVCacheConfig]) -> KVCacheConfig:
    """The scheduler's one config for the stages' plans: group ``g`` holds
    group ``g``'s layers of every stage and runs their common manager spec.

    It places no tensors (each stage allocates its own); ``bytes_per_block``
    is the widest stage's.
    """
    from kvcore.plan.block_sizes import _check_agreed

    if not plans:
        msg = "combine_stage_plans needs at least one stage plan"
        raise PlanError(msg)
    first = plans[0]
    for s, plan in enumerate(plans[1:], start=1):
        if plan.num_blocks != first.num_blocks:
            msg = (
                f"stage {s} has {plan.num_blocks} blocks but stage 0 has "
                f"{first.num_blocks}; give every stage the smallest count "
                "(kvcore.integrations.stages.with_num_blocks)"
            )
            raise PlanError(msg)
        _check_agreed(plan, first, "stage", s)
    problem = line_up_problem([p.kv_cache_groups for p in plans])
    if problem is not None:
        msg = f"the stages' cache groups do not line up: {problem}"
        raise PlanError(msg)
    groups = [
        KVCacheGroupSpec(
            [n for p in plans for n in p.kv_cache_groups[g].layer_names],
            group.manager_spec,
        )
        for g, group in enumerate(first.kv_cache_groups)
    ]
    return attrs.evolve(
        first,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        bytes_per_block=max(p.bytes_per_block for p in plans),
        available_memory=None,
        pipeline_stage=None,
    )


def plan_pipeline_stages(
    config: EngineConfig,
    specs: Mapping[str, KVCacheSpec],
    available_memory: int | Sequence[int],
    *,
    stage_sizes: Sequence[int] | None = None,
    registry: KindRegistry | None = None,
) -> PipelinePlan:
    """Split ``specs`` into ``config.parallel_config.pipeline_parallel_size``
    stages and plan each, with lined-up groups and one block count (the
    smallest stage's).

    :param available_memory: bytes for every stage, or one count per stage.
    :param stage_sizes: model layers per stage (see
        :func:`split_pipeline_stages`).
    """
    pp = config.parallel_config.pipeline_parallel_size
    memory = (
        [available_memory] * pp
        if isinstance(available_memory, int)
        else list(available_memory)
    )
    if len(memory) != pp:
        msg = (
            f"available_memory gives {len(memory)} stage budgets for "
            f"pipeline_parallel_size={pp}; give one int, or one per stage"
        )
        raise PlanError(msg)
    stages = split_pipeline_stages(list(specs), pp, stage_sizes=stage_sizes)
    stage_groups = _stage_groups(config, specs, stages, registry)
    plans = [
        attrs.evolve(
            get_kv_cache_config_from_groups(config, groups, mem),
            pipeline_stage=s,
            pipeline_stages=[list(names) for names in stages],
        )
        for s, (groups, mem) in enumerate(zip(stage_groups, memory, strict=True))
    ]
    num_blocks = min(p.num_blocks for p in plans)
    if config.max_model_len is not None:
        need = max(
            min_blocks_for_one_request(
                p.kv_cache_groups,
                config.max_model_len,
                config.max_num_batched_tokens,
                dcp=config.parallel_config.decode_context_parallel_size,
            )
            for p in plans
        )
        if num_blocks < need:
            msg = (
                f"the smallest pipeline stage holds {num_blocks} blocks, but one "
                f"request of max_model_len={config.max_model_len} tokens needs "
                f"{need} (with its prefill step and the null block); give the "
                "stages more memory, or lower max_model_len"
            )
            raise PlanError(msg)
    return PipelinePlan(stages=tuple(with_num_blocks(p, num_blocks) for p in plans))
