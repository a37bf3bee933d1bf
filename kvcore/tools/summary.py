"""What a person reads about a plan: groups, the stride, and capacity.

:func:`summarize` turns a plan and its capacity rows into a
:class:`PlanSummary`, the one value the text report, the JSON document and
the picture are all drawn from, so they never disagree.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from kvcore.length_mix import LengthMix
from kvcore.plan.block_sizes import effective_block_size, plan_hit_granularity
from kvcore.plan.capacity import (
    Capacity,
    MixCapacity,
    min_blocks_for_one_request,
    mix_capacity,
    plan_capacity,
)
from kvcore.plan.declarations import layer_alignment
from kvcore.spec import HitPolicy, KVCacheSpec
from kvcore.structs import KVCacheConfig, KVCacheGroupSpec
from kvcore.tools.records import Record, record
from kvcore.tools.units import format_size, format_sizes, format_tokens

if TYPE_CHECKING:
    from kvcore.registry import KindRegistry

__all__ = [
    "CapacityRow",
    "GroupSummary",
    "PlanSummary",
    "compact_layer_names",
    "summarize",
]

_NUMBER = re.compile(r"\d+")


def _ranges(values: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2,5,7-8"``; an even stride of four or
    more, ``[2, 6, 10, 14]``, -> ``"2,6,...,14"``."""
    steps = {b - a for a, b in itertools.pairwise(values)}
    if len(values) >= 4 and len(steps) == 1 and steps != {1}:
        return f"{values[0]},{values[1]},...,{values[-1]}"
    out: list[str] = []
    start = prev = values[0]
    for v in values[1:]:
        if v == prev + 1:
            prev = v
            continue
        out.append(f"{start}-{prev}" if prev != start else str(start))
        start = prev = v
    out.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(out)


def compact_layer_names(names: Iterable[str]) -> list[str]:
    """Layer names folded on their first number, in first-seen order:
    ``model.layers.0.attn``, ``model.layers.1.attn`` ->
    ``model.layers.{0-1}.attn``."""
    templates: dict[str, list[int]] = {}
    singles: list[str] = []
    for name in names:
        match = _NUMBER.search(name)
        if match is None:
            singles.append(name)
            continue
        key = name[: match.start()] + "{}" + name[match.end() :]
        templates.setdefault(key, []).append(int(match.group()))
    out = []
    for template, numbers in templates.items():
        numbers = sorted(set(numbers))
        if len(numbers) == 1:
            out.append(template.replace("{}", str(numbers[0])))
        else:
            out.append(template.replace("{}", "{" + _ranges(numbers) + "}"))
    return out + singles


@attrs.frozen
class GroupSummary(Record):
    """One cache group as a person reads it."""

    index: int
    layer_names: tuple[str, ...]
    layer_ranges: tuple[str, ...]
    kinds: Mapping[str, int]
    block_size: int
    packed_bytes: int
    fill: float
    prefix_cacheable: bool

    @property
    def role(self) -> str:
        """``cacheable`` (its blocks serve prefix hits) or ``scratch``."""
        return "cacheable" if self.prefix_cacheable else "scratch"

    json_fields: ClassVar[str] = (
        "index layers=layer_names layer_ranges kinds block_size packed_bytes "
        "fill prefix_cacheable"
    )


@attrs.frozen
class CapacityRow(Record):
    """Requests of one length the plan holds, beside the physical limit."""

    capacity: Capacity
    bytes_for_one: int

    @property
    def context(self) -> int:
        return self.capacity.context

    @property
    def concurrency(self) -> int:
        return self.capacity.concurrency

    @property
    def limit(self) -> int:
        """Whole requests the same memory holds at the physical limit."""
        return math.floor(self.capacity.ideal_concurrency + 1e-9)

    @property
    def ratio(self) -> float:
        """:attr:`Capacity.ratio <kvcore.plan.capacity.Capacity.ratio>`:
        ``unreserved_concurrency / ideal_concurrency`` (1.0 is the limit)."""
        return self.capacity.ratio

    @property
    def fits(self) -> bool:
        return self.concurrency > 0

    json_fields: ClassVar[str] = (
        "context concurrency tokens=capacity.tokens "
        "physical_limit=capacity.ideal_concurrency physical_limit_requests=limit "
        "ratio unreserved_concurrency=capacity.unreserved_concurrency "
        "blocks_per_request=capacity.blocks_per_request "
        "bytes_per_request=capacity.bytes_per_request "
        "prefill_peak_blocks=capacity.prefill_peak_blocks fits "
        "bytes_for_one_request=bytes_for_one"
    )


@attrs.frozen
class PlanSummary:
    """A plan, its groups, what set its stride, and its capacity rows."""

    model_name: str
    setting: str
    memory: int
    plan: KVCacheConfig
    groups: tuple[GroupSummary, ...]
    widest_group: int
    stride_alignment: int
    rows: tuple[CapacityRow, ...]
    notes: tuple[str, ...] = ()
    #: Capacity under a mix of lengths (``--context lognormal:8k,1.0``).
    workload: MixCapacity | None = None

    @property
    def hit_granularity(self) -> int | None:
        return plan_hit_granularity(self.plan)

    def stride_reason(self) -> str:
        """What set the stride: the widest group, and any rounding."""
        widest = self.groups[self.widest_group]
        text = (
            f"group {widest.index} is the widest ({format_size(widest.packed_bytes)}"
            f" of pages)"
        )
        padding = self.plan.bytes_per_block - widest.packed_bytes
        if padding > 0:
            text += (
                f", rounded up by {padding} B to the layout's alignment"
                if self.stride_alignment > 1
                else f", plus {padding} B of per-page alignment"
            )
        return text

    def verdict(self) -> str:
        """The line a person reads first."""
        row = self.rows[0]
        head = f"{self.model_name}{self.setting}"
        if not row.fits:
            have, need = format_sizes(self.memory, row.bytes_for_one)
            return (
                f"{head}: no request of {format_tokens(row.context)} tokens fits in "
                f"{have}; one needs {need}"
            )
        plural = "request" if row.concurrency == 1 else "requests"
        return (
            f"{head}: {row.concurrency} {plural} of {format_tokens(row.context)} "
            f"tokens (limit {row.limit}, {row.ratio:.2f})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            **record(
                self,
                "bytes_per_block=plan.bytes_per_block num_blocks=plan.num_blocks "
                "memory widest_group stride_alignment",
            ),
            "stride_reason": self.stride_reason(),
            **record(self, "hit_granularity groups"),
            "verdict": self.verdict(),
        } | ({} if self.workload is None else {"workload": self.workload.to_dict()})


def _group_summary(
    index: int, group: KVCacheGroupSpec, bytes_per_block: int, dcp: int
) -> GroupSummary:
    kinds = Counter(group.layer_spec(n).kind for n in group.layer_names)
    packed = group.packed_bytes
    return GroupSummary(
        index=index,
        layer_names=tuple(group.layer_names),
        layer_ranges=tuple(compact_layer_names(group.layer_names)),
        kinds=dict(kinds),
        block_size=effective_block_size(group, dcp),
        packed_bytes=packed,
        fill=packed / bytes_per_block if bytes_per_block else 0.0,
        prefix_cacheable=bool(group.manager_spec.prefix_cacheable),
    )


def summarize(
    plan: KVCacheConfig,
    contexts: Sequence[int],
    *,
    model_name: str,
    specs: Mapping[str, KVCacheSpec] | None = None,
    memory: int | None = None,
    setting: str = "",
    notes: Sequence[str] = (),
    registry: KindRegistry | None = None,
    mix: LengthMix | None = None,
) -> PlanSummary:
    """The summary of ``plan`` at each of ``contexts``.

    :param specs: the layers at their own block sizes, for the physical limit
        (default: the plan's).
    :param memory: the bytes compared against the limit (default: the
        plan's).
    :param setting: text after the model name in the verdict, such as
        ``" on 2x H100 80GB (TP 2)"``.
    :param registry: the registry the plan was made with, whose overridden
        kinds become notes (default: the process's default registry, if it
        has been built).
    :param mix: a mix of lengths to report the capacity under
        (:func:`~kvcore.plan.capacity.mix_capacity`).
    """
    if memory is None:
        memory = plan.available_memory or plan.num_blocks * plan.bytes_per_block
    dcp = plan.decode_context_parallel_size
    groups = tuple(
        _group_summary(i, g, plan.bytes_per_block, dcp)
        for i, g in enumerate(plan.kv_cache_groups)
    )
    widest = max(range(len(groups)), key=lambda i: groups[i].packed_bytes)
    layout = plan.kv_cache_layout
    alignment = (
        math.lcm(
            *(layer_alignment(s) for g in plan.kv_cache_groups for s in g.layer_specs())
        )
        if layout is None or layout.is_block_outermost
        else 1
    )
    notes = list(notes)
    from kvcore.registry import default_registry

    if registry is None and default_registry.cache_info().currsize:
        registry = default_registry()
    if registry is not None:
        used = {s.kind for g in plan.kv_cache_groups for s in g.layer_specs()}
        notes.extend(registry.override_notes(used))
    blockers = [
        g
        for g in plan.kv_cache_groups
        if g.manager_spec.hit_policy is HitPolicy.BLOCKS_HITS
    ]
    if plan.enable_prefix_caching and blockers:
        kinds = sorted({g.manager_spec.kind for g in blockers})
        notes.append(
            f"no prefix hits for this model: {', '.join(kinds)} declares hit policy "
            "BLOCKS_HITS (it needs a request's whole prefix but keeps no state of "
            "it to restore), so kvcore computes every prompt in full"
        )
    states = [
        g
        for g in plan.kv_cache_groups
        if g.manager_spec.hit_policy is HitPolicy.CHECKPOINT
    ]
    if plan.enable_prefix_caching and states and not blockers:
        kinds = sorted({g.manager_spec.kind for g in states})
        policies = sorted(
            {
                name
                for g in states
                if (name := g.manager_spec.checkpoint_policy_name) is not None
            }
        )
        named = f" (policy {', '.join(policies)})" if policies else ""
        notes.append(
            f"{', '.join(kinds)} states are checkpointed for prefix hits{named} "
            f"in {len(states)} groups: each kept state is one "
            "evictable block per group; a request holds at most its live state, "
            "the one it writes, and the checkpoints inside its step"
        )
    batched = plan.max_num_batched_tokens or 8192
    rows = []
    for context in contexts:
        capacity = plan_capacity(plan, context, specs=specs, memory=memory)
        need_blocks = min_blocks_for_one_request(
            plan.kv_cache_groups, context, batched, dcp=dcp
        )
        rows.append(CapacityRow(capacity, need_blocks * plan.bytes_per_block))
    return PlanSummary(
        model_name=model_name,
        setting=setting,
        memory=memory,
        plan=plan,
        groups=groups,
        widest_group=widest,
        stride_alignment=alignment,
        rows=tuple(rows),
        notes=tuple(notes),
        workload=None if mix is None else mix_capacity(plan, mix, memory=memory),
    )
