"""The search behind ``min_waste``: the stride and per-bucket cuts with the
fewest bytes per request, within a cap on the number of groups.

A bucket cut into ``n`` groups at block growth ``f`` costs ``n x held(f)``
blocks a request and needs a stride of at least its widest group.  For one
factor, fewer groups are both cheaper and fewer, so at a given stride a
bucket's only useful cut per factor is the fewest groups that fit: each
factor is a *staircase* of (groups, width) steps, and a stride picks one
step of it by bisection.

Strides are swept upwards once, keeping each bucket's cheapest option as
running sums (linear in the options).  A stride whose cheapest plan has no
more groups than the cap is exact as swept.  One past the cap is solved
exactly: every bucket takes its fewest-group option, and the buckets that
can buy blocks with groups (several factors fit) share the groups left by a
knapsack over the extra groups, never more than the cap leaves.  The walk
stops once no later stride can reach the best plan found.

Every step works on counts: a bucket is its distinct specs with their
multiplicities, a one-page bucket of ``N`` layers offers ``O(sqrt N)``
group counts (where its widest group changes), so planning grows close to
linearly in layers and buckets.

The target is one context length or a :class:`MixTarget` (a mix of lengths):
for a mix, the blocks a request holds are summed over its lengths with their
weights (:func:`held_blocks`), and every step above is unchanged.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import NamedTuple

import attrs
import numpy as np

from kvcore.errors import PlanError
from kvcore.length_mix import LengthMix
from kvcore.plan.buckets import Bucket, widest_of
from kvcore.plan.capacity import serving_blocks
from kvcore.plan.declarations import checked_grown, checked_positive
from kvcore.spec import KVCacheSpec, cdiv, round_up

__all__ = [
    "TIE_TOLERANCE",
    "Choice",
    "MixTarget",
    "Option",
    "Target",
    "held_blocks",
    "longest_of",
    "search",
]

#: Plans whose bytes per request are within this fraction of the best are
#: ties (and go to fewer groups).
TIE_TOLERANCE = 1e-3
#: Buckets of at most this many layers with several page sizes try every
#: group count; larger ones the counts where a one-page bucket's widest
#: group would change (of the layers and of the repeats).
EVERY_SPLIT = 4096
_INF = np.int64(2**62)


class MixTarget:
    """The search's target when it is a mix of lengths: the blocks a request
    holds are summed over the mix's lengths, each times its weight (so a
    plan's cost is its bytes per request of the mix times the mix's total
    weight, and one length of weight ``w`` plans as that length)."""

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


def held_blocks(spec: KVCacheSpec, target: Target, block_size: int) -> int:
    """Blocks a request of the target holds in a layer of ``spec`` (summed
    over a mix with its weights)."""
    if isinstance(target, MixTarget):
        return target.held(spec, block_size)
    return serving_blocks(spec, target, block_size)


def longest_of(target: Target) -> int:
    """The target's longest request."""
    return target.longest if isinstance(target, MixTarget) else target


class Option(NamedTuple):
    """One way to cut a bucket: ``groups`` groups at block growth ``factor``,
    the widest ``width`` bytes (rounded to the alignment), holding ``cost``
    blocks per request."""

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


@attrs.frozen
class _Stairs:
    """A bucket at one growth factor: cut into ``groups[k]`` groups its
    widest is ``widths[k]`` (strictly narrower as ``k`` grows)."""

    factor: int
    held: int
    groups: list[int]
    widths: list[int]
    negated: list[int]  # -widths, ascending, for bisection

    def fewest(self, stride: int) -> int | None:
        """Index of the fewest groups whose widest fits ``stride``."""
        k = bisect.bisect_left(self.negated, -stride)
        return k if k < len(self.groups) else None

    def option(self, k: int) -> Option:
        n = self.groups[k]
        return Option(self.widths[k], n * self.held, n, self.factor)


def _held_by_factor(
    bucket: Bucket, context: Target, dcp: int, max_growth: int
) -> list[tuple[int, int]]:
    """``[(factor, blocks a request holds)]`` of the factors worth growing
    by: each holds fewer blocks than every smaller one, and the previous
    factor's block does not already hold the context."""
    first = bucket.first
    allowed = checked_positive(first, "max_block_growth", first.max_block_growth)
    scale = dcp if first.scales_with_context_parallel else 1
    out = [(1, held_blocks(first, context, first.block_size * scale))]
    longest = longest_of(context)
    for factor in range(2, min(allowed, max_growth) + 1):
        if first.block_size * (factor - 1) >= longest:
            break
        held = held_blocks(first, context, first.block_size * factor * scale)
        if held < out[-1][1]:
            out.append((factor, held))
    return out


def _grown_profile(
    bucket: Bucket, factor: int
) -> tuple[KVCacheSpec, list[tuple[int, int]]] | None:
    """The bucket's first spec and page profile ``[(page, layers)]`` grown
    by ``factor`` (``None`` if one of its specs cannot grow by it)."""
    first: KVCacheSpec | None = None
    pages: dict[int, int] = {}
    for spec, count in bucket.counts.items():
        grown = spec if factor == 1 else checked_grown(spec, factor)
        if grown is None:
            return None
        if first is None:
            first = grown
        page = grown.page_size_bytes
        pages[page] = pages.get(page, 0) + count
    assert first is not None  # a bucket has a layer
    return first, list(pages.items())


def _divisor_counts(total: int) -> list[int]:
    """Group counts where a one-page bucket of ``total`` layers changes its
    widest group: ``cdiv(total, q)`` for every group size ``q`` (plus a few
    counts that are not, which the staircase drops)."""
    if total <= 3:
        return list(range(1, total + 1))
    root = math.isqrt(total) + 1
    counts = {n for n in range(1, root + 1) if n <= total}
    counts.update(cdiv(total, q) for q in range(1, root + 1))
    return sorted(counts)


def _candidate_splits(profile: list[tuple[int, int]], total: int) -> list[int]:
    if len(profile) == 1:
        return _divisor_counts(total)
    if total <= EVERY_SPLIT:
        return list(range(1, total + 1))
    repeats = max(c for _, c in profile)
    return sorted({*_divisor_counts(total), *_divisor_counts(repeats)})


def _stairs(
    bucket: Bucket,
    factors: list[tuple[int, int]],
    *,
    context: Target,
    dcp: int,
    alignment: int,
    max_width: int | None,
) -> list[_Stairs]:
    """The bucket's staircase at each factor (growth stops once one grown
    page is wider than ``max_width``: pages do not shrink as blocks grow)."""
    total = len(bucket)
    out: list[_Stairs] = []
    for factor, _ in factors:
        grown = _grown_profile(bucket, factor)
        if grown is None:
            continue
        spec, profile = grown
        if max_width is not None and max(p for p, _ in profile) > max_width:
            break
        scale = dcp if spec.scales_with_context_parallel else 1
        held = held_blocks(spec, context, spec.block_size * scale)
        key = tuple(profile)
        groups: list[int] = []
        widths: list[int] = []
        for n in _candidate_splits(profile, total):
            width = widest_of(key, n)
            if max_width is not None and width > max_width:
                continue
            rounded = round_up(width, alignment)
            if not widths or rounded < widths[-1]:
                groups.append(n)
                widths.append(rounded)
        if groups:
            out.append(_Stairs(factor, held, groups, widths, [-w for w in widths]))
    return out


def _frontier(stairs: list[_Stairs]) -> list[Option]:
    """A bucket's options best for some stride when groups are free: each
    cheaper (or as cheap with fewer groups) than every narrower one."""
    options = sorted(s.option(k) for s in stairs for k in range(len(s.groups)))
    frontier: list[Option] = []
    best = (-1, -1)
    for option in options:
        if frontier and (option.cost, option.groups) >= best:
            continue
        best = (option.cost, option.groups)
        frontier.append(option)
    return frontier


def _pareto(stairs: list[_Stairs], stride: int) -> list[Option]:
    """At ``stride``: per factor the fewest groups that fit, reduced to the
    options that buy fewer blocks with more groups (fewest groups first)."""
    fits = []
    for s in stairs:
        k = s.fewest(stride)
        if k is not None:
            fits.append(s.option(k))
    fits.sort(key=lambda o: (o.groups, o.cost))
    out: list[Option] = []
    for o in fits:
        if not out or o.cost < out[-1].cost:
            out.append(o)
    return out


def _within_cap(
    stairs: Sequence[list[_Stairs]], stride: int, cap: int
) -> tuple[Option, ...] | None:
    """The cheapest options that fit ``stride`` with at most ``cap`` groups
    in all (fewest groups among the cheapest), or ``None``."""
    per_bucket = [_pareto(s, stride) for s in stairs]
    if not all(per_bucket):
        return None
    picks = [p[0] for p in per_bucket]
    budget = cap - sum(o.groups for o in picks)
    if budget < 0:
        return None
    flexible = [b for b, p in enumerate(per_bucket) if len(p) > 1]
    most = sum(per_bucket[b][-1].groups - picks[b].groups for b in flexible)
    if most <= budget:
        return tuple(p[-1] for p in per_bucket)
    # best[e]: the fewest blocks the flexible buckets so far save with
    # exactly e extra groups; took[i][e]: the option bucket i takes there.
    best = np.full(budget + 1, _INF, dtype=np.int64)
    best[0] = 0
    took = []
    for b in flexible:
        base = per_bucket[b][0]
        step = best.copy()
        choice = np.zeros(budget + 1, dtype=np.int32)
        for k, o in enumerate(per_bucket[b][1:], start=1):
            extra = o.groups - base.groups
            if extra > budget:
                break
            candidate = best[: budget + 1 - extra] + (o.cost - base.cost)
            better = candidate < step[extra:]
            step[extra:][better] = candidate[better]
            choice[extra:][better] = k
        best = step
        took.append(choice)
    extra = int(np.argmin(best))  # the first minimum: fewest groups
    for i in range(len(flexible) - 1, -1, -1):
        b = flexible[i]
        k = int(took[i][extra])
        picks[b] = per_bucket[b][k]
        extra -= picks[b].groups - per_bucket[b][0].groups
    return tuple(picks)


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
    at ``context`` tokens (or over a :class:`MixTarget`), with at most
    ``max(max_groups, len(buckets))`` groups.  Plans within
    ``tie_tolerance`` of the best are ties and go to fewer groups, then
    fewer bytes, then the narrower stride.

    :param growth_caps: per bucket, the largest growth factor (default
        ``max_growth`` for every bucket).
    :param ceiling: a tie never costs more than this many bytes per request
        (the plan another policy already reaches).
    :param ceiling_groups: the groups of that plan; when it is within the
        cap, the best plan costs no more than it, which bounds the stride.
    """
    if not buckets:
        msg = "min_waste needs at least one bucket of layers to plan"
        raise PlanError(msg)
    caps = list(growth_caps) if growth_caps is not None else [max_growth] * len(buckets)
    cap = max(max_groups, len(buckets))
    factors = [
        _held_by_factor(b, context, dcp, c) for b, c in zip(buckets, caps, strict=True)
    ]
    # Every bucket holds at least its fewest blocks at any factor, so a plan
    # whose stride is S costs at least S x (their sum): a plan within the
    # ceiling has a stride of at most ceiling / that sum, and wider options
    # are never chosen, so they are not built.
    fewest = sum(min(h for _, h in f) for f in factors)
    max_width = (
        ceiling // fewest
        if ceiling is not None
        and ceiling_groups is not None
        and ceiling_groups <= cap
        and fewest >= 1
        else None
    )
    stairs = [
        _stairs(
            b, f, context=context, dcp=dcp, alignment=alignment, max_width=max_width
        )
        for b, f in zip(buckets, factors, strict=True)
    ]
    if not all(stairs):
        if max_width is not None:  # pragma: no cover - a safety net
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
        msg = "min_waste found no way to cut a bucket into groups"  # pragma: no cover
        raise PlanError(msg)  # pragma: no cover
    return _walk(stairs, cap, tie_tolerance, ceiling)


def _walk(
    stairs: list[list[_Stairs]], cap: int, tie_tolerance: float, ceiling: int | None
) -> Choice:
    frontiers = [_frontier(s) for s in stairs]
    floor = max(f[0].width for f in frontiers)
    # Each bucket's frontier by stride: (strides, options), cheaper as wider.
    strides = [[max(o.width, floor) for o in f] for f in frontiers]
    # Where some unconstrained plan may pass the cap, every option's stride
    # is a candidate (a wider option off the frontier may be the one with
    # few enough groups); only frontier options change the sums.
    events = [(st, b, i) for b, ss in enumerate(strides) for i, st in enumerate(ss)]
    if sum(max(o.groups for o in f) for f in frontiers) > cap:
        events += [
            (max(w, floor), -1, -1)
            for bucket in stairs
            for s in bucket
            for w in s.widths
        ]
    events.sort()
    at = [-1] * len(stairs)
    cost = groups = 0
    sweep: list[tuple[int, int, int]] = []  # unconstrained (bytes, groups, stride)
    k = 0
    while k < len(events):
        stride = events[k][0]
        while k < len(events) and events[k][0] == stride:
            _, b, i = events[k]
            k += 1
            if b < 0:
                continue
            if at[b] >= 0:
                cost -= frontiers[b][at[b]].cost
                groups -= frontiers[b][at[b]].groups
            at[b] = i
            cost += frontiers[b][i].cost
            groups += frontiers[b][i].groups
        sweep.append((stride * cost, groups, stride))
    sweep.sort()
    top = max(s for _, _, s in sweep)
    # The cheapest plan within the cap at the widest stride costs no more
    # blocks than one at any narrower stride: a lower bound on the blocks
    # of every capped plan, so strides it prices out are skipped.
    fewest_blocks: int | None = None
    found: list[tuple[int, int, int, tuple[Option, ...] | None]] = []
    best: int | None = None
    for bytes_, n_groups, stride in sweep:
        if best is not None and bytes_ > best * (1 + tie_tolerance):
            break
        picks: tuple[Option, ...] | None = None
        if n_groups > cap:
            if fewest_blocks is None:
                widest = _within_cap(stairs, top, cap)
                if widest is None:  # pragma: no cover - one group a bucket fits
                    msg = "min_waste found no plan within the group cap"
                    raise PlanError(msg)
                fewest_blocks = sum(o.cost for o in widest)
            if best is not None and stride * fewest_blocks > best * (1 + tie_tolerance):
                continue
            picks = _within_cap(stairs, stride, cap)
            if picks is None:
                continue
            bytes_ = stride * sum(o.cost for o in picks)
            n_groups = sum(o.groups for o in picks)
        found.append((bytes_, n_groups, stride, picks))
        best = bytes_ if best is None else min(best, bytes_)
    if best is None:  # pragma: no cover - one group a bucket always fits
        msg = "min_waste found no plan within the group cap"
        raise PlanError(msg)
    limit = best * (1 + tie_tolerance)
    if ceiling is not None:
        limit = min(limit, max(ceiling, best))
    _, _, stride, chosen = min(
        (f for f in found if f[0] <= limit), key=lambda f: (f[1], f[0], f[2])
    )
    if chosen is None:
        chosen = tuple(
            f[bisect.bisect_right(ss, stride) - 1]
            for f, ss in zip(frontiers, strides, strict=True)
        )
    return Choice(stride, chosen)
