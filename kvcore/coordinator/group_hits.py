"""Per-group prefix hits, for engines whose KV connectors load what the
local cache lacks.

:meth:`KVCacheCoordinator.find_longest_cache_hit` returns the one length
every group serves.  Under block pressure the groups' own hits can differ
(a full-attention tail evicted while a deeper recurrent state survives, or
the reverse), and a connector that can load one group's missing part may
resume past the common length.  :func:`find_longest_cache_hit_per_group`
searches each group on its own, with no fixed point between them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcore.coordinator.hashing import BlockHash
from kvcore.coordinator.partial import partial_prefix_hit

if TYPE_CHECKING:
    from kvcore.coordinator.coordinator import KVCacheCoordinator

__all__ = ["find_longest_cache_hit_per_group"]


def find_longest_cache_hit_per_group(
    coordinator: KVCacheCoordinator,
    block_hashes: Sequence[BlockHash],
    max_length: int,
) -> tuple[tuple[list[int], ...], tuple[int, ...]]:
    """Each group's own longest hit up to ``max_length`` tokens: its block
    ids and its length, by group id.

    Each prefix-cacheable group is searched alone at the hit alignment (a
    state group ends on a saved state, a prefix group on its last cached
    block; with EAGLE a token-indexed group drops its last block, as in a
    common lookup).  A group that caches nothing constrains no hit: it
    holds no blocks and reports the deepest length any group reached.  A
    group that blocks hits (a state that keeps nothing) makes every length
    0.  Nothing is attached and no statistic is counted.
    """
    num = coordinator.num_groups
    blocks: list[list[int]] = [[] for _ in range(num)]
    lengths = [0] * num
    alignment = coordinator.cache_hit_alignment
    limit = max_length - max_length % alignment
    if not coordinator.attention_groups or limit <= 0 or coordinator.hit_blockers:
        return tuple(blocks), tuple(lengths)
    searched: set[int] = set()
    deepest = 0
    for group in coordinator.attention_groups:
        hashes = coordinator._hashes_of(group, block_hashes)
        query = coordinator._query(group, block_hashes, hashes, limit, alignment)
        size = group.block_size
        if group.partial_unit:
            found, hit = partial_prefix_hit(query, group.partial_unit)
        else:
            found = coordinator.search(group, query)
            hit = len(found[0]) * size
            if coordinator.use_eagle and not group.states and hit:
                hit -= size
            # Whole blocks on the alignment (a state group's hit already
            # ends on one).
            if not group.states:
                hit -= hit % alignment
                keep = hit // size
                found = [f[:keep] for f in found]
        for gid, group_hit in zip(group.group_ids, found, strict=True):
            blocks[gid] = group_hit
            lengths[gid] = hit
            searched.add(gid)
        deepest = max(deepest, hit)
    for gid in range(num):
        if gid not in searched:
            lengths[gid] = deepest
    return tuple(blocks), tuple(lengths)
