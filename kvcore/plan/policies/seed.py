"""The ``seed`` policy: the reference grouping rules, bit for bit.

- Mixed page sizes (the packed path): the repeat count is the approximate gcd
  of the balanced buckets' repeats, no smaller than the largest balanced
  multi-page bucket's; state buckets (and window buckets when there is no
  repeat count) are split only as far as the widest block the other buckets
  already force.
- One page size: every bucket is cut into groups of one common size, the
  approximate gcd of the bucket sizes, no smaller than the smallest bucket.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvcore.config import EngineConfig
from kvcore.plan.buckets import Bucket, approximate_gcd, bucket_layers
from kvcore.plan.groups import make_group
from kvcore.plan.placement import raise_mixed_pages
from kvcore.spec import KVCacheSpec, PackingRole, cdiv
from kvcore.structs import KVCacheGroupSpec

__all__ = ["packed_groups", "seed_groups", "uniform_page_groups"]


def seed_groups(
    config: EngineConfig, specs: Mapping[str, KVCacheSpec]
) -> list[KVCacheGroupSpec]:
    """Group with the reference rules."""
    packed = packed_groups(config, specs)
    if packed is not None:
        return packed
    return uniform_page_groups(specs)


def packed_groups(
    config: EngineConfig, specs: Mapping[str, KVCacheSpec]
) -> list[KVCacheGroupSpec] | None:
    """The packed path, for models whose pages differ in size.

    Returns ``None`` when every page has one size.  Raises a
    :class:`~kvcore.errors.LayoutError` when the layout is unresolved or
    cannot hold several groups of mixed pages.
    """
    if len({s.page_size_bytes for s in specs.values()}) < 2:
        return None
    layout = config.cache_config.resolved_layout()
    buckets = bucket_layers(specs)

    balanced = [b for b in buckets if b.balanced]
    multi = [b.repeats for b in balanced if len(b.by_page) >= 2]
    min_repeats = max(multi, default=0)
    repeats = (
        approximate_gcd([b.repeats for b in balanced], lower_bound=min_repeats)
        if min_repeats
        else None
    )

    def base_groups(b: Bucket) -> int:
        return cdiv(b.repeats, repeats) if b.balanced and repeats else 1

    def is_state(b: Bucket) -> bool:
        return b.role is PackingRole.STATE or (
            b.role is PackingRole.WINDOW and repeats is None
        )

    anchor = max(b.widest(len(b) if is_state(b) else base_groups(b)) for b in buckets)
    groups: list[KVCacheGroupSpec] = []
    for b in buckets:
        n = base_groups(b)
        if is_state(b):
            widest_page = max(b.by_page)
            n = max(n, cdiv(len(b), max(anchor // widest_page, 1)))
            while n < len(b) and b.widest(n) > anchor:
                n += 1
        groups.extend(make_group(b, names, wrap=True) for names in b.split(n))
    if len(groups) > 1 and not layout.can_pack:
        raise_mixed_pages(layout, specs.values())
    return groups


def uniform_page_groups(specs: Mapping[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """Group a model whose layers all have one page size: groups of one
    common size, which minimises padded layer slots."""
    buckets = bucket_layers(specs)
    size = approximate_gcd(
        [len(b) for b in buckets], lower_bound=min(len(b) for b in buckets)
    )
    return [
        make_group(b, names, wrap=False)
        for b in buckets
        for names in b.split(cdiv(len(b), size))
    ]
