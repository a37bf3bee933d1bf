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
fewer bytes and the narrower stride, but never to a plan that holds fewer
requests than ``seed`` would.  No plan has more than
``CacheConfig.max_kv_cache_groups`` groups (each costs the scheduler a block
table and a manager) unless the model has more buckets than that.

With ``CacheConfig.target_lengths`` (a :class:`~kvcore.length_mix.LengthMix`)
the target is the mix instead of one context: a bucket option's cost is the
blocks a request holds summed over the mix's lengths with their weights
(:class:`MixTarget`), so bytes per request become bytes per request of the
mix times its total weight, and the plan found holds the most requests of
the mix (:func:`kvcore.plan.mix_capacity`).  The search is the same; only
the blocks a request holds are counted over the mix (:func:`_held`).
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

import attrs

from kvcore.config import EngineConfig
from kvcore.errors import KvcoreError, PlanError
from kvcore.length_mix import LengthMix
from kvcore.plan.block_sizes import effective_block_size, resolve_block_sizes
from kvcore.plan.buckets import Bucket, bucket_layers, widest_of
from kvcore.plan.capacity import serving_blocks
from kvcore.plan.declarations import checked_grown, checked_positive, layer_alignment
from kvcore.plan.groups import make_group
from kvcore.spec import KVCacheSpec, cdiv, round_up
from kvcore.structs import KVCacheGroupSpec

__all__ = ["TIE_TOLERANCE", "MixTarget", "Option", "min_waste_groups", "search"]

#: Plans whose bytes per request are within this fraction of the best are
#: ties (and go to fewer groups).
TIE_TOLERANCE = 1e-3
#: Strides whose cheapest plan passes the group cap get an exact capped plan
#: (a knapsack) on at most this many of the cheapest; later ones take each
#: bucket's fewest groups.
CAPPED_STRIDES = 32


class MixTarget:
    """The search's target when it is a mix of lengths: the blocks a request
    holds are summed over the mix's lengths, each times its weight."""

    __slots__ = ("_held", "mix")

    def __init__(self, mix: LengthMix) -> None:
        self.mix = mix
        self._held: dict[tuple[KVCacheSpec, int], int] = {}

    @property
    def longest(self) -> int:
        return self.mix.longest

    def held(self, spec: KVCacheSpec, block_size: int) -> int:
        key = (spec, block_size)
        found = self._held.get(key)
        if found is None:
            found = self._held[key] = sum(
                w * serving_blocks(spec, length, block_size)
                for length, w in zip(self.mix.lengths, self.mix.weights, strict=True)
            )
        return found


#: What the search plans for: one context length, or a mix.
Target = int | MixTarget


def _held(spec: KVCacheSpec, target: Target, block_size: int) -> int:
    """Blocks a request of the target holds in a layer of ``spec`` (summed
    over a mix with its weights)."""
    if isinstance(target, MixTarget):
        return target.held(spec, block_size)
    return serving_blocks(spec, target, block_size)


def _longest(target: Target) -> int:
    return target.longest if isinstance(target, MixTarget) else target


class Option(NamedTuple):
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
    context: Target = config.resolved_target_context()
    if cache.target_lengths is not None:
        context = MixTarget(cache.target_lengths)
    dcp = config.parallel_config.decode_context_parallel_size
    growth = cache.max_block_growth if packing else 1
    seed = _seed_plan_cost(config, specs, context, dcp)

    def plan(caps: list[int]) -> list[KVCacheGroupSpec]:
        choice = search(
            buckets,
            context=context,
            alignment=_alignment(specs.values()),
            max_groups=cache.max_kv_cache_groups,
            dcp=dcp,
            growth_caps=caps,
            ceiling=seed[0] if seed else None,
            ceiling_groups=seed[1] if seed else None,
        )
        groups: list[KVCacheGroupSpec] = []
        for bucket, option in zip(buckets, choice.options, strict=True):
            grown = _grown_bucket(bucket, option.factor)
            wrap = len(pages) > 1 or option.factor > 1
            groups.extend(
                make_group(grown, names, wrap=wrap)
                for names in grown.split(option.groups)
            )
        return groups

    groups = plan([growth] * len(buckets))
    if not _hash_compatible(groups, config):
        # Some layer forbids hashing finer than the scheduler block, so every
        # hashed group must hold whole scheduler blocks: keep the hashed
        # kinds at their own block sizes and grow only the others.
        groups = plan([1 if b.first.hashes_blocks else growth for b in buckets])
    return groups


def _hash_compatible(groups: Sequence[KVCacheGroupSpec], config: EngineConfig) -> bool:
    """Whether every group whose blocks are hashed holds whole hash blocks
    (the coordinator refuses a plan where one does not)."""
    if not (config.cache_config.enable_prefix_caching or config.kv_transfer_enabled):
        return True
    dcp = config.parallel_config.decode_context_parallel_size
    try:
        _, hash_block = resolve_block_sizes(groups, config)
    except KvcoreError:
        return False
    return all(
        effective_block_size(g, dcp) % hash_block == 0
        for g in groups
        if g.manager_spec.hashes_blocks
    )


def _seed_plan_cost(
    config: EngineConfig, specs: Mapping[str, KVCacheSpec], context: Target, dcp: int
) -> tuple[int, int] | None:
    """Bytes per request and groups of the ``seed`` plan, which a tie must
    not exceed (``None`` where ``seed`` cannot plan the model), costed as
    the search costs a plan: the widest group rounded to the alignment."""
    from kvcore.plan.policies.seed import seed_groups

    try:
        groups = seed_groups(config, specs)
    except KvcoreError:
        return None
    widest = max(g.packed_bytes for g in groups)
    stride = round_up(widest, _alignment(specs.values()))
    held = sum(
        _held(g.manager_spec, context, effective_block_size(g, dcp)) for g in groups
    )
    return stride * held, len(groups)


def _alignment(specs: Iterable[KVCacheSpec]) -> int:
    return math.lcm(*(layer_alignment(s) for s in specs))


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
    bucket: Bucket, context: Target, dcp: int, max_growth: int, max_width: int | None
) -> dict[int, tuple[KVCacheSpec, list[tuple[int, int]]]]:
    """Growth factor -> (the bucket's first spec, its page profile
    ``[(page, count)]``) at that factor.

    A factor is offered when every distinct spec of the bucket grows by it,
    the grown block stays within the target context, and a request holds
    fewer blocks at it than at every smaller factor (the blocks held are
    counted at the grown block size, from the kind's ``num_blocks_held``).  Growth stops once
    a single grown page is wider than ``max_width`` (pages do not shrink as
    blocks grow, so no larger factor fits either).
    """
    distinct: dict[KVCacheSpec, int] = {}
    for spec in bucket.specs.values():
        distinct[spec] = distinct.get(spec, 0) + 1
    first = bucket.first
    out = {1: (first, _profile((s.page_size_bytes, c) for s, c in distinct.items()))}
    allowed = checked_positive(first, "max_block_growth", first.max_block_growth)
    scale = dcp if first.scales_with_context_parallel else 1
    fewest = _held(first, context, first.block_size * scale)
    for factor in range(2, min(allowed, max_growth) + 1):
        if first.block_size * (factor - 1) >= _longest(context):
            break  # the previous factor's block already holds the context
        # A factor whose request holds no fewer blocks than a smaller one's
        # is dominated: its pages are no narrower, its cost no lower.
        held = _held(first, context, first.block_size * factor * scale)
        if held >= fewest:
            continue
        fewest = held
        grown: list[tuple[KVCacheSpec, int]] = []
        for spec, count in distinct.items():
            g = checked_grown(spec, factor)
            if g is None:
                break
            grown.append((g, count))
        else:
            profile = _profile((g.page_size_bytes, c) for g, c in grown)
            if max_width is not None and max(p for p, _ in profile) > max_width:
                break
            out[factor] = (grown[0][0], profile)
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


def _options(
    bucket: Bucket, context: Target, dcp: int, max_growth: int, max_width: int | None
) -> tuple[list[Option], list[Option]]:
    """Every (groups, factor) option of a bucket, sorted by width, and the
    frontier of those best for some stride when groups are free: each
    cheaper (or as cheap with fewer groups) than every narrower one."""
    first = bucket.first
    total = len(bucket)
    scale = dcp if first.scales_with_context_parallel else 1
    raw: list[tuple[int, int, int, int]] = []
    for factor, (spec, profile) in _factors(
        bucket, context, dcp, max_growth, max_width
    ).items():
        held = _held(spec, context, spec.block_size * scale)
        key = tuple(profile)
        for n in _candidate_splits(profile, total):
            width = _widest(key, n)
            if max_width is None or width <= max_width:
                raw.append((width, n * held, n, factor))
    raw.sort()
    options = list(map(Option._make, raw))
    frontier: list[Option] = []
    best = (-1, -1)
    for option in options:
        if frontier and (option.cost, option.groups) >= best:
            continue
        best = (option.cost, option.groups)
        frontier.append(option)
    return options, frontier


@functools.lru_cache(maxsize=65536)
def _widest(profile: tuple[tuple[int, int], ...], n: int) -> int:
    return widest_of(profile, n)


def search(
    buckets: Sequence[Bucket],
    *,
    context: Target,
    alignment: int,
    max_groups: int,
    dcp: int = 1,
    max_growth: int = 64,
    growth_caps: Sequence[int] | None = None,
    tie_tolerance: float = TIE_TOLERANCE,
    ceiling: int | None = None,
    ceiling_groups: int | None = None,
) -> Choice:
    """The stride and per-bucket options with the fewest bytes per request
    at ``context`` tokens (see the module docstring for ties and the cap).

    Strides are swept upwards; each bucket's option changes only where the
    stride passes one of its frontier widths, so the totals are kept as
    running sums (linear in the options, not in options x buckets).

    :param growth_caps: per bucket, the largest growth factor (default
        ``max_growth`` for every bucket).
    :param tie_tolerance: plans within this fraction of the best are ties.
    :param ceiling: a tie never costs more than this many bytes per request
        (the plan another policy already reaches).
    :param ceiling_groups: the groups of that plan; when it is within the
        cap, the best plan costs no more than it, which bounds the stride.
    """
    if not buckets:
        msg = "min_waste needs at least one bucket of layers to plan"
        raise PlanError(msg)
    caps = list(growth_caps) if growth_caps is not None else [max_growth] * len(buckets)
    # A plan within the ceiling has a stride of at most ceiling / buckets:
    # every bucket holds at least one block a request.  Wider options are
    # never chosen, so they are not built.
    cap = max(max_groups, len(buckets))
    max_width = (
        ceiling // len(buckets)
        if ceiling is not None
        and ceiling_groups is not None
        and ceiling_groups <= cap
        and all(
            _fewest_held(b, context, dcp, c) >= 1
            for b, c in zip(buckets, caps, strict=True)
        )
        else None
    )
    built = [
        _options(b, context, dcp, cap, max_width)
        for b, cap in zip(buckets, caps, strict=True)
    ]
    frontiers = [f for _, f in built]
    floor = round_up(max(f[0].width for f in frontiers), alignment)

    def stride_of(option: Option) -> int:
        return max(round_up(option.width, alignment), floor)

    # Sweep the strides upwards: (stride, bucket, frontier index) events.
    events = sorted(
        (stride_of(o), b, i) for b, f in enumerate(frontiers) for i, o in enumerate(f)
    )
    at = [-1] * len(buckets)
    cost = groups = 0
    # unconstrained (bytes per request, groups, stride) at every stride
    sweep: list[tuple[int, int, int]] = []
    k = 0
    while k < len(events):
        stride = events[k][0]
        while k < len(events) and events[k][0] == stride:
            _, b, i = events[k]
            k += 1
            if at[b] >= 0:
                cost -= frontiers[b][at[b]].cost
                groups -= frontiers[b][at[b]].groups
            at[b] = i
            cost += frontiers[b][i].cost
            groups += frontiers[b][i].groups
        sweep.append((stride * cost, groups, stride))

    # Walk the strides from the cheapest unconstrained plan up; a stride whose
    # cheapest plan passes the group cap gets the best plan within the cap
    # (a knapsack over the buckets' group counts), which costs at least as
    # much, so the walk stops once no later stride can be a tie of the best
    # found.  The knapsack runs on at most CAPPED_STRIDES strides; later ones
    # take each bucket's fewest groups instead.
    sweep.sort()
    found: list[tuple[int, int, int, tuple[Option, ...]]] = []
    best: int | None = None
    knapsacks = 0
    options = [o for o, _ in built]
    singles = [_single_group_frontier(o, stride_of) for o in options]
    for bytes_, n_groups, stride in sweep:
        if best is not None and bytes_ > best * (1 + tie_tolerance):
            break
        capped: tuple[Option, ...] | None
        if n_groups <= cap:
            capped = tuple(_cheapest(f, stride, stride_of) for f in frontiers)
        elif cap == len(buckets):
            capped = _one_group_each(singles, stride)
        elif knapsacks < CAPPED_STRIDES:
            knapsacks += 1
            capped = _within_cap(options, stride, stride_of, cap)
        else:
            capped = _fewest_groups(options, stride, stride_of, cap)
        if capped is None:
            continue
        total = stride * sum(o.cost for o in capped)
        found.append((total, sum(o.groups for o in capped), stride, capped))
        best = total if best is None else min(best, total)
    if best is None and max_width is not None:  # pragma: no cover - a safety net
        return search(
            buckets,
            context=context,
            alignment=alignment,
            max_groups=max_groups,
            dcp=dcp,
            max_growth=max_growth,
            growth_caps=growth_caps,
            tie_tolerance=tie_tolerance,
            ceiling=ceiling,
        )
    if best is None:  # pragma: no cover - one group a bucket always fits
        msg = "min_waste found no plan within the group cap"
        raise PlanError(msg)
    limit = best * (1 + tie_tolerance)
    if ceiling is not None:
        limit = min(limit, max(ceiling, best))
    _, _, stride, picks = min(
        (f for f in found if f[0] <= limit), key=lambda f: (f[1], f[0], f[2])
    )
    return Choice(stride, picks)


def _fewest_held(bucket: Bucket, context: Target, dcp: int, max_growth: int) -> int:
    """The fewest blocks a request holds in one group of the bucket, at any
    growth factor (the stride bound needs every bucket to hold one)."""
    first = bucket.first
    scale = dcp if first.scales_with_context_parallel else 1
    top = min(
        checked_positive(first, "max_block_growth", first.max_block_growth), max_growth
    )
    return min(
        _held(first, context, first.block_size * f * scale)
        for f in range(1, max(top, 1) + 1)
    )


def _cheapest(
    frontier: list[Option], stride: int, stride_of: Callable[[Option], int]
) -> Option:
    """The frontier's cheapest option that fits ``stride``."""
    fitting = [o for o in frontier if stride_of(o) <= stride]
    return fitting[-1]


def _fitting_by_groups(
    bucket_options: list[Option], stride: int, stride_of: Callable[[Option], int]
) -> dict[int, Option]:
    """Per group count, the bucket's cheapest option that fits ``stride``."""
    by_groups: dict[int, Option] = {}
    for o in bucket_options:
        if stride_of(o) > stride:
            break
        if o.groups not in by_groups or o.cost < by_groups[o.groups].cost:
            by_groups[o.groups] = o
    return by_groups


def _single_group_frontier(
    bucket_options: list[Option], stride_of: Callable[[Option], int]
) -> tuple[list[int], list[Option]]:
    """A bucket's one-group options by stride, each cheaper than every
    narrower one: (strides, options)."""
    strides: list[int] = []
    out: list[Option] = []
    for o in bucket_options:
        if o.groups == 1 and (not out or o.cost < out[-1].cost):
            strides.append(stride_of(o))
            out.append(o)
    return strides, out


def _one_group_each(
    singles: Sequence[tuple[list[int], list[Option]]], stride: int
) -> tuple[Option, ...] | None:
    """Each bucket's cheapest one-group option (the cap equals the buckets)."""
    picks = []
    for strides, frontier in singles:
        i = bisect.bisect_right(strides, stride) - 1
        if i < 0:
            return None
        picks.append(frontier[i])
    return tuple(picks)


def _fewest_groups(
    options: Sequence[list[Option]],
    stride: int,
    stride_of: Callable[[Option], int],
    cap: int,
) -> tuple[Option, ...] | None:
    """Each bucket's cheapest option with its fewest fitting groups."""
    picks = []
    for bucket_options in options:
        by_groups = _fitting_by_groups(bucket_options, stride, stride_of)
        if not by_groups:
            return None
        picks.append(by_groups[min(by_groups)])
    return tuple(picks) if sum(o.groups for o in picks) <= cap else None


def _within_cap(
    options: Sequence[list[Option]],
    stride: int,
    stride_of: Callable[[Option], int],
    cap: int,
) -> tuple[Option, ...] | None:
    """The cheapest options that fit ``stride`` with at most ``cap`` groups
    in all, or ``None``: a knapsack over the buckets' group counts."""
    per_bucket = [_fitting_by_groups(o, stride, stride_of) for o in options]
    if not all(per_bucket):
        return None
    # cost[g]: the least cost of the buckets so far in exactly g groups;
    # choice[b][g]: the option bucket b takes in that best.
    cost: dict[int, int] = {0: 0}
    choice: list[dict[int, Option]] = []
    for by_groups in per_bucket:
        step: dict[int, int] = {}
        took: dict[int, Option] = {}
        for used, so_far in cost.items():
            for n, o in by_groups.items():
                g = used + n
                if g <= cap and (g not in step or so_far + o.cost < step[g]):
                    step[g] = so_far + o.cost
                    took[g] = o
        if not step:
            return None
        cost = step
        choice.append(took)
    g = min(cost, key=cost.__getitem__)
    picks: list[Option] = []
    for took in reversed(choice):
        o = took[g]
        picks.append(o)
        g -= o.groups
    return tuple(reversed(picks))
