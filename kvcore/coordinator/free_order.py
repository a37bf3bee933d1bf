"""The order a freed request's blocks of several cache groups are queued
for eviction in.

A hit needs every group's blocks at its end: the attention prefix, a
window's last blocks, the state kept there.  Queued group by group, one
group's blocks would all be evicted before another's, leaving the other
group's blocks in the cache with nothing to serve.  Queued by the shortest
hit that reads each block (:meth:`SingleTypeManager.shortest_hit_reading`,
which each manager declares), the highest first across all groups, eviction
drops the request's hit points whole from the tail: once a block is gone,
every block that served only longer hits is gone before it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import itemgetter

from kvcore.coordinator.block_pool import KVCacheBlock
from kvcore.coordinator.manager import SingleTypeManager

__all__ = ["by_hit_points"]

_SORT_KEY = itemgetter(0, 1, 2)


def by_hit_points(
    managers: Sequence[SingleTypeManager],
    tables: Sequence[Sequence[KVCacheBlock] | None],
    error: Callable[[int, str, BaseException], Exception] | None = None,
) -> list[KVCacheBlock]:
    """The blocks of ``tables`` (one per manager, in free order; None or
    empty for a group without blocks) as one list that
    :meth:`BlockPool.free_table` takes: the null block left out, the block
    that the shortest hit reads first, so the block that only the longest
    hits read is queued first (evicted first).  Blocks that the same
    shortest hit reads are queued in the managers' order, each table's
    in position order from the tail.  ``error(group id, method, exception)``
    builds the error raised for a manager whose ``shortest_hit_reading``
    raises (the exception itself when None)."""
    entries: list[tuple[int, int, int, KVCacheBlock]] = []
    for rank, (manager, blocks) in enumerate(zip(managers, tables, strict=True)):
        if not blocks:
            continue
        reading = manager.shortest_hit_reading
        try:
            entries += [
                (reading(pos), -rank, pos, block)
                for pos, block in enumerate(blocks)
                if not block.is_null
            ]
        except Exception as exc:
            if error is None:
                raise
            gid = manager.kv_cache_group_id
            raise error(gid, "shortest_hit_reading", exc) from exc
    entries.sort(key=_SORT_KEY)
    return [entry[3] for entry in entries]
