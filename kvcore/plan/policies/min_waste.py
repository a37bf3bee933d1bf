"""The ``min_waste`` policy: the grouping that holds the most requests of a
target context length, by exact search over one-stride plans.

Concurrency at context ``T`` is the pool's bytes over the bytes one request
holds: the block stride ``S`` times the blocks every group holds at ``T``.  A
group of a bucket holds the bucket's blocks-per-request at ``T`` (all of
``T`` for full attention, a window's blocks, a fixed state), so a bucket cut
into ``n`` groups costs ``S * n * blocks(T)``.

For every candidate stride (every width a bucket can take, rounded to the
plan's alignment), each bucket takes its cheapest option that fits: the
fewest groups whose widest fits the stride, jointly with a block-size growth
factor where its kind declares one (:meth:`KVCacheSpec.grown`).  The stride
and choices with the fewest bytes per request win.  Plans within
:data:`TIE_TOLERANCE` of the best are ties and go to fewer groups, then to
smaller blocks (finer prefix hits), but never to a plan that holds fewer
requests than ``seed`` would.  No plan has more than
``CacheConfig.max_kv_cache_groups`` groups (each costs the scheduler a block
table and a manager) unless the model has more buckets than that.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

import attrs

from kvcore.config import EngineConfig
from kvcore.errors import KvcoreError
from kvcore.plan.buckets import Bucket, bucket_layers, widest_of
from kvcore.plan.capacity import serving_blocks, steady_blocks
from kvcore.plan.declarations import checked_grown
from kvcore.plan.groups import make_group
from kvcore.plan.placement import kv_cache_bytes_per_block
from kvcore.spec import KVCacheSpec, cdiv, round_up
from kvcore.structs import KVCacheGroupSpec

__all__ = ["TIE_TOLERANCE", "Option", "min_waste_groups", "search"]

#: Plans whose bytes per request are within this fraction of the best are
#: ties (and go to fewer groups).
TIE_TOLERANCE = 1e-3


@attrs.frozen
class Option:
    """One way to cut a bucket: ``groups`` groups at block growth ``factor``,
    the widest ``width`` bytes, holding ``cost`` blocks per request."""

    width: int
    cost: int
    groups: int
    factor: int


@attrs.frozen
class Choice:
    """The search's answer: the stride and each bucket's option."""

    stride: int
    options: tuple[Option, ...]

    @property
    def bytes_per_request(self) -> int:
        return self.stride * sum(o.cost for o in self.options)

    @property
    def num_groups(self) -> int:
        return sum(o.groups for o in self.options)


def min_waste_groups(
    config: EngineConfig, specs: Mapping[str, KVCacheSpec]
) -> list[KVCacheGroupSpec]:
    """Group the model for the most concurrent requests at the target context
    (``CacheConfig.target_context``, else ``max_model_len``)."""
    cache = config.cache_config
    pages = {s.page_size_bytes for s in specs.values()}
    layout = cache.kv_cache_layout
    packing = layout is not None and layout.can_pack
    if len(pages) > 1 and not packing:
        # Mixed pages need a packing layout: the reference rules say so
        # (or plan the single group a layer-outer layout can hold).
        from kvcore.plan.policies.seed import seed_groups

        return seed_groups(config, specs)
    buckets = bucket_layers(specs)
    context = config.resolved_target_context()
    dcp = config.parallel_config.decode_context_parallel_size
    choice = search(
        buckets,
        context=context,
        alignment=_alignment(specs.values()),
        max_groups=cache.max_kv_cache_groups,
        dcp=dcp,
        max_growth=cache.max_block_growth if packing else 1,
        ceiling=_seed_bytes_per_request(config, specs, context, dcp),
    )
    groups: list[KVCacheGroupSpec] = []
    for bucket, option in zip(buckets, choice.options, strict=True):
        grown = _grown_bucket(bucket, option.factor)
        wrap = len(pages) > 1 or option.factor > 1
        groups.extend(
            make_group(grown, names, wrap=wrap) for names in grown.split(option.groups)
        )
    return groups


def _seed_bytes_per_request(
    config: EngineConfig, specs: Mapping[str, KVCacheSpec], context: int, dcp: int
) -> int | None:
    """Bytes per request of the ``seed`` plan, which a tie must not exceed
    (``None`` where ``seed`` cannot plan the model)."""
    from kvcore.plan.policies.seed import seed_groups

    try:
        groups = seed_groups(config, specs)
        stride = kv_cache_bytes_per_block(groups, config.cache_config.kv_cache_layout)
    except KvcoreError:
        return None
    return stride * sum(steady_blocks(groups, context, dcp=dcp))


def _alignment(specs: object) -> int:
    values = [
        math.lcm(s.stride_alignment(), s.element_size)
        for s in specs  # type: ignore[attr-defined]
    ]
    return math.lcm(*values) if values else 1


def _grown_bucket(bucket: Bucket, factor: int) -> Bucket:
    if factor == 1:
        return bucket
    cache: dict[KVCacheSpec, KVCacheSpec] = {}
    grown: dict[str, KVCacheSpec] = {}
    for name, spec in bucket.specs.items():
        if spec not in cache:
            g = checked_grown(spec, factor)
            if g is None:  # pragma: no cover - the search only offers valid factors
                msg = f"{spec.kind} cannot grow by {factor}"
                raise AssertionError(msg)
            cache[spec] = g
        grown[name] = cache[spec]
    return Bucket(grown)


def _factors(
    bucket: Bucket, context: int, max_growth: int
) -> dict[int, tuple[KVCacheSpec, list[tuple[int, int]]]]:
    """Growth factor -> (the bucket's first spec, its page profile
    ``[(page, count)]``) at that factor.

    A factor is offered when every distinct spec of the bucket grows by it
    and the grown block stays within the target context.
    """
    distinct: dict[KVCacheSpec, int] = {}
    for spec in bucket.specs.values():
        distinct[spec] = distinct.get(spec, 0) + 1
    first = bucket.first
    out = {1: (first, _profile((s.page_size_bytes, c) for s, c in distinct.items()))}
    for factor in range(2, min(first.max_block_growth, max_growth) + 1):
        if first.block_size * factor > max(context, first.block_size):
            break
        grown: list[tuple[KVCacheSpec, int]] = []
        for spec, count in distinct.items():
            g = checked_grown(spec, factor)
            if g is None:
                break
            grown.append((g, count))
        else:
            out[factor] = (
                grown[0][0],
                _profile((g.page_size_bytes, c) for g, c in grown),
            )
    return out


def _profile(pairs: object) -> list[tuple[int, int]]:
    counts: dict[int, int] = {}
    for page, count in pairs:  # type: ignore[attr-defined]
        counts[page] = counts.get(page, 0) + count
    return list(counts.items())


def _candidate_splits(profile: list[tuple[int, int]], total: int) -> list[int]:
    """Group counts worth trying: all of them for small buckets; for a big
    one-page bucket only the counts where the widest group changes."""
    if total <= 1024 or len(profile) > 1:
        return list(range(1, total + 1))
    return sorted({cdiv(total, q) for q in range(1, total + 1)})


def _options(bucket: Bucket, context: int, dcp: int, max_growth: int) -> list[Option]:
    """Every (groups, factor) option of a bucket, pruned to those that are
    best for some stride: sorted by width, each cheaper (or as cheap with
    fewer groups) than every narrower one."""
    first = bucket.first
    total = len(bucket)
    scale = dcp if first.scales_with_context_parallel else 1
    raw: list[tuple[int, int, int, int]] = []
    for factor, (spec, profile) in _factors(bucket, context, max_growth).items():
        held = serving_blocks(spec, context, spec.block_size * scale)
        key = tuple(profile)
        for n in _candidate_splits(profile, total):
            raw.append((_widest(key, n), n * held, n, factor))
    raw.sort()
    frontier: list[Option] = []
    best = (-1, -1)
    for width, cost, groups, factor in raw:
        if frontier and (cost, groups) >= best:
            continue
        best = (cost, groups)
        frontier.append(Option(width, cost, groups, factor))
    return frontier


@functools.lru_cache(maxsize=65536)
def _widest(profile: tuple[tuple[int, int], ...], n: int) -> int:
    return widest_of(profile, n)


def search(
    buckets: Sequence[Bucket],
    *,
    context: int,
    alignment: int,
    max_groups: int,
    dcp: int = 1,
    max_growth: int = 64,
    tie_tolerance: float = TIE_TOLERANCE,
    ceiling: int | None = None,
) -> Choice:
    """The stride and per-bucket options with the fewest bytes per request
    at ``context`` tokens (see the module docstring for ties and the cap).

    Strides are swept upwards; each bucket's option changes only where the
    stride passes one of its frontier widths, so the totals are kept as
    running sums (linear in the options, not in options x buckets).

    :param tie_tolerance: plans within this fraction of the best are ties.
    :param ceiling: a tie never costs more than this many bytes per request
        (the plan another policy already reaches).
    """
    frontiers = [_options(b, context, dcp, max_growth) for b in buckets]
    fewest = [_fewest_frontier(f) for f in frontiers]
    floor = round_up(max(f[0].width for f in frontiers), alignment)
    cap = max(max_groups, len(buckets))
    # events: (stride at which it applies, bucket, option, which frontier)
    events: list[tuple[int, int, int, int]] = []
    for b, (front, few) in enumerate(zip(frontiers, fewest, strict=True)):
        for i, option in enumerate(front):
            events.append((max(round_up(option.width, alignment), floor), b, i, 0))
        for i, option in enumerate(few):
            events.append((max(round_up(option.width, alignment), floor), b, i, 1))
    events.sort()
    lists = (frontiers, fewest)
    at = ([-1] * len(buckets), [-1] * len(buckets))
    cost = [0, 0]
    groups = [0, 0]
    # (bytes per request, groups, stride, which list) at every stride
    found: list[tuple[int, int, int, int]] = []
    k = 0
    while k < len(events):
        stride = events[k][0]
        while k < len(events) and events[k][0] == stride:
            _, b, i, which = events[k]
            k += 1
            if at[which][b] >= 0:
                old = lists[which][b][at[which][b]]
                cost[which] -= old.cost
                groups[which] -= old.groups
            at[which][b] = i
            cost[which] += lists[which][b][i].cost
            groups[which] += lists[which][b][i].groups
        for which in (0, 1):
            if groups[which] <= cap:
                found.append((stride * cost[which], groups[which], stride, which))
                break
    best = min(f[0] for f in found)
    limit = best * (1 + tie_tolerance)
    if ceiling is not None:
        limit = min(limit, max(ceiling, best))
    _, _, stride, which = min(
        (f for f in found if f[0] <= limit),
        key=lambda f: (f[1], f[0], f[2]),
    )
    picks = []
    for options in lists[which]:
        fitting = [
            o for o in options if max(round_up(o.width, alignment), floor) <= stride
        ]
        picks.append(fitting[-1])
    return Choice(stride, tuple(picks))


def _fewest_frontier(frontier: list[Option]) -> list[Option]:
    """The options that have the fewest groups for some stride (the fallback
    when the cheapest options pass the group cap): by width, each with fewer
    groups than every narrower one."""
    out: list[Option] = []
    for option in frontier:
        if not out or option.groups < out[-1].groups:
            out.append(option)
    return out
