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
smaller blocks (finer prefix hits).  No plan has more than
``CacheConfig.max_kv_cache_groups`` groups (each costs the scheduler a block
table and a manager) unless the model has more buckets than that.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence

import attrs

from kvcore.config import EngineConfig
from kvcore.plan.buckets import Bucket, bucket_layers, widest_of
from kvcore.plan.groups import make_group
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
    choice = search(
        buckets,
        context=config.resolved_target_context(),
        alignment=_alignment(specs.values()),
        max_groups=cache.max_kv_cache_groups,
        dcp=config.parallel_config.decode_context_parallel_size,
        allow_growth=packing,
    )
    groups: list[KVCacheGroupSpec] = []
    for bucket, option in zip(buckets, choice.options, strict=True):
        grown = _grown_bucket(bucket, option.factor)
        wrap = len(pages) > 1 or option.factor > 1
        groups.extend(
            make_group(grown, names, wrap=wrap) for names in grown.split(option.groups)
        )
    return groups


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
            g = spec.grown(factor)
            if g is None:  # pragma: no cover - the search only offers valid factors
                msg = f"{spec.kind} cannot grow by {factor}"
                raise AssertionError(msg)
            cache[spec] = g
        grown[name] = cache[spec]
    return Bucket(grown)


def _factors(
    bucket: Bucket, context: int, allow: bool
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
    if not allow:
        return out
    for factor in range(2, first.max_block_growth + 1):
        if first.block_size * factor > max(context, first.block_size):
            break
        grown: list[tuple[KVCacheSpec, int]] = []
        for spec, count in distinct.items():
            g = spec.grown(factor)
            if g is None:
                break
            grown.append((g, count))
        else:
            out[factor] = (grown[0][0], _profile((g.page_size_bytes, c) for g, c in grown))
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


def _options(bucket: Bucket, context: int, dcp: int, allow: bool) -> list[Option]:
    """Every (groups, factor) option of a bucket, pruned to those that are
    best for some stride: sorted by width, each cheaper (or as cheap with
    fewer groups) than every narrower one."""
    first = bucket.first
    total = len(bucket)
    scale = dcp if first.scales_with_context_parallel else 1
    raw: list[Option] = []
    for factor, (spec, profile) in _factors(bucket, context, allow).items():
        block = spec.block_size * scale
        held = spec.num_blocks_held(context, context, block)
        for n in _candidate_splits(profile, total):
            raw.append(Option(widest_of(profile, n), n * held, n, factor))
    raw.sort(key=lambda o: (o.width, o.cost, o.groups, o.factor))
    frontier: list[Option] = []
    for option in raw:
        if frontier:
            best = frontier[-1]
            if (option.cost, option.groups) >= (best.cost, best.groups):
                continue
        frontier.append(option)
    return frontier


def search(
    buckets: Sequence[Bucket],
    *,
    context: int,
    alignment: int,
    max_groups: int,
    dcp: int = 1,
    allow_growth: bool = True,
) -> Choice:
    """The stride and per-bucket options with the fewest bytes per request
    at ``context`` tokens (see the module docstring for ties and the cap)."""
    frontiers = [_options(b, context, dcp, allow_growth) for b in buckets]
    widths = [[o.width for o in f] for f in frontiers]
    floor = max(f[0].width for f in frontiers)
    strides = sorted(
        {round_up(o.width, alignment) for f in frontiers for o in f if o.width >= floor}
        | {round_up(floor, alignment)}
    )
    cap = max(max_groups, len(buckets))
    found: list[Choice] = []
    for stride in strides:
        picks = []
        for frontier, ws in zip(frontiers, widths, strict=True):
            i = bisect.bisect_right(ws, stride) - 1
            picks.append(frontier[i])
        choice = Choice(stride, tuple(picks))
        if choice.num_groups > cap:
            fewest = _fewest_groups(frontiers, stride)
            if fewest.num_groups > cap:
                continue
            choice = fewest
        found.append(choice)
    best = min(c.bytes_per_request for c in found)
    ties = [c for c in found if c.bytes_per_request <= best * (1 + TIE_TOLERANCE)]
    return min(
        ties,
        key=lambda c: (
            c.num_groups,
            c.bytes_per_request,
            max(o.factor for o in c.options),
            c.stride,
        ),
    )


def _fewest_groups(frontiers: Sequence[list[Option]], stride: int) -> Choice:
    """At ``stride``, each bucket's option with the fewest groups (cheapest
    among those): the fallback when the cheapest options pass the cap."""
    picks = []
    for frontier in frontiers:
        fitting = [o for o in frontier if o.width <= stride]
        picks.append(min(fitting, key=lambda o: (o.groups, o.cost)))
    return Choice(stride, tuple(picks))
