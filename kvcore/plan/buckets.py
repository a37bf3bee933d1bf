"""Buckets: the layers that may share a cache group, and how a bucket splits.

Layers whose specs have equal grouping keys (and equal cacheability and
replay tokens, so a scratch ring never shares a manager with prefix-cacheable
owners) form one bucket; every grouping policy cuts buckets into groups.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence

import numpy as np

from kvcore.errors import PlanError
from kvcore.spec import KVCacheSpec, PackingRole, cdiv

__all__ = ["Bucket", "approximate_gcd", "bucket_key", "bucket_layers", "widest_of"]


def bucket_key(spec: KVCacheSpec) -> Hashable:
    """Layers with equal keys may share a group."""
    return (spec.group_key(), spec.prefix_cacheable, spec.prefix_replay_tokens)


def bucket_layers(specs: Mapping[str, KVCacheSpec]) -> list[Bucket]:
    """The model's buckets, in order of each bucket's first layer.

    Each distinct spec is asked for its key once: layers sharing a spec
    object (or an equal one) cost a dictionary look-up, so a model of many
    repeated layers buckets in time linear in its layers."""
    buckets: dict[Hashable, dict[str, KVCacheSpec]] = {}
    keys: dict[int, Hashable] = {}
    for name, spec in specs.items():
        key = keys.get(id(spec))
        if key is None:
            key = keys[id(spec)] = bucket_key(spec)
        buckets.setdefault(key, {})[name] = spec
    return [Bucket(b) for b in buckets.values()]


def approximate_gcd(values: Sequence[int], lower_bound: int = 1) -> int:
    """The divisor ``d >= lower_bound`` that minimises the padding
    ``sum((-v) % d)``; ties go to the larger ``d``.

    Equal values are counted once with their multiplicity, so the cost is
    (distinct values) x (candidate divisors), vectorised.
    """
    if not values or any(type(v) is not int or v <= 0 for v in values):
        msg = f"approximate_gcd needs positive values, got {list(values)[:10]}"
        raise PlanError(msg)
    low = max(1, lower_bound)
    high = max(values)
    if low > high:
        return low
    divisors = np.arange(low, high + 1, dtype=np.int64)
    pad = np.zeros_like(divisors)
    for value, count in Counter(values).items():
        pad += count * ((-value) % divisors)
    # argmin takes the first minimum; ties go to the larger divisor.
    best = len(pad) - 1 - int(np.argmin(pad[::-1]))
    return int(divisors[best])


class Bucket:
    """Layers sharing one bucket key, with each page size computed once.

    :param specs: layer name to spec, in model order.
    """

    __slots__ = ("_desc", "by_page", "counts", "pages", "role", "specs")

    def __init__(self, specs: dict[str, KVCacheSpec]) -> None:
        self.specs = specs
        #: distinct spec -> its layers (the bucket as counts, in
        #: first-appearance order); each distinct spec's page is asked once
        self.counts: dict[KVCacheSpec, int] = {}
        page_of: dict[int, int] = {}
        objects: dict[int, tuple[KVCacheSpec, int]] = {}
        self.pages: dict[str, int] = {}
        #: page size -> layer names, in first-appearance order
        self.by_page: dict[int, list[str]] = {}
        for name, spec in specs.items():
            page = page_of.get(id(spec))
            if page is None:
                page = page_of[id(spec)] = spec.page_size_bytes
            held = objects.get(id(spec))
            objects[id(spec)] = (spec, 1 if held is None else held[1] + 1)
            self.pages[name] = page
            self.by_page.setdefault(page, []).append(name)
        for spec, count in objects.values():
            self.counts[spec] = self.counts.get(spec, 0) + count
        self.role: PackingRole = next(iter(specs.values())).packing_role
        # pages from the widest down, for the round-robin deal
        self._desc = sorted(self.by_page, reverse=True)

    def __len__(self) -> int:
        return len(self.specs)

    @property
    def first(self) -> KVCacheSpec:
        return next(iter(self.specs.values()))

    @property
    def balanced(self) -> bool:
        """Every page size has the same number of layers (a repeating pattern)."""
        return len({len(v) for v in self.by_page.values()}) == 1

    @property
    def repeats(self) -> int:
        """The largest number of layers sharing one page size."""
        return max(len(v) for v in self.by_page.values())

    def split(self, n: int) -> list[list[str]]:
        """Split into ``n`` groups.

        A balanced bucket split at most once per repeat deals whole repeats
        of its page pattern (group i takes repeats i, i+n, ...), so pipeline
        stages stay balanced.  Otherwise layers are dealt round-robin, page
        size by page size from the widest down, so no layer is dropped, no
        group is empty and unequal pages spread evenly.
        """
        if n <= 1:
            return [list(self.specs)]
        if self.balanced and n <= self.repeats:
            pattern = list(zip(*self.by_page.values(), strict=True))
            return [[name for rep in pattern[i::n] for name in rep] for i in range(n)]
        order = {name: i for i, name in enumerate(self.specs)}
        out: list[list[str]] = [[] for _ in range(n)]
        cursor = 0
        for page in self._desc:
            for name in self.by_page[page]:
                out[cursor % n].append(name)
                cursor += 1
        return [sorted(g, key=order.__getitem__) for g in out if g]

    def widest(self, n: int) -> int:
        """Bytes of the widest of the ``n`` groups :meth:`split` makes."""
        return widest_of([(p, len(v)) for p, v in self.by_page.items()], n)


def widest_of(profile: Sequence[tuple[int, int]], n: int) -> int:
    """Bytes of the widest of ``n`` groups that :meth:`Bucket.split` makes of
    a bucket with ``profile`` ``[(page size, layers)]``.

    Group 0 is always the widest: it takes the first repeat (or the first,
    widest layer of every round of the deal) and at least as many layers as
    any other group.  Computed from page counts alone.
    """
    counts = {c for _, c in profile}
    if n <= 1:
        return sum(p * c for p, c in profile)
    repeats = max(counts)
    if len(counts) == 1 and n <= repeats:
        return cdiv(repeats, n) * sum(p for p, _ in profile)
    total = 0
    start = 0
    for page, count in sorted(profile, key=lambda x: -x[0]):
        # positions start .. start+count-1 of the deal; group 0 takes the
        # multiples of n among them.
        first = cdiv(start, n) * n
        end = start + count
        if first < end:
            total += page * ((end - 1 - first) // n + 1)
        start = end
    return total
