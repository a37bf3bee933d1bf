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

A block's reading depends on its table position alone, so each manager is
asked once per position and the answers are kept: ordering a freed
request is then one stable sort of integers over its tables laid end to
end, each table already in position order (runs the sort merges).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import compress

from kvcore.coordinator.manager import SingleTypeManager
from kvcore.coordinator.plugin_results import result_error
from kvcore.errors import PluginResultError

__all__ = ["HitPointOrder"]


class HitPointOrder:
    """Orders a freed request's tables by hit point for ``managers`` (in
    free order), keeping each manager's readings by position.
    ``error(group id, method, exception)`` builds the error raised for a
    manager whose ``shortest_hit_reading`` raises (the exception itself
    when None)."""

    def __init__(
        self,
        managers: Sequence[SingleTypeManager],
        error: Callable[[int, str, BaseException], Exception] | None = None,
    ) -> None:
        self.managers = tuple(managers)
        self.error = error
        #: Per manager, its readings of positions 0, 1, ... asked so far.
        self.readings: list[list[int]] = [[] for _ in self.managers]

    def __call__(self, tables: Sequence[Sequence[int] | None]) -> list[int]:
        """The blocks of ``tables`` (one per manager, in free order; None or
        empty for a group without blocks) as one list that
        :meth:`BlockPool.free_table` takes: the null block left out, the
        block that the shortest hit reads first, so the block that only the
        longest hits read is queued first (evicted first).  Blocks that the
        same shortest hit reads are queued in the managers' order, each
        table's in position order from the tail."""
        keys: list[int] = []
        blocks: list[int] = []
        # Laid end to end last manager first, each in position order: the
        # stable sort breaks a tie by the later manager, then the position.
        all_readings = self.readings
        for index in range(len(tables) - 1, -1, -1):
            table = tables[index]
            if not table:
                continue
            num = len(table)
            readings = all_readings[index]
            if len(readings) < num:
                self._read(index, num)
            if 0 in table:
                # The null block's positions (released, never taken) left
                # out at C speed: a long request's window tables are
                # mostly null, and the sort need not see them.
                keys += compress(readings, table)
                blocks += filter(None, table)
            else:
                keys += readings[:num]
                blocks += table
        order = sorted(range(len(keys)), key=keys.__getitem__)
        return [blocks[i] for i in order]

    def _read(self, index: int, num_positions: int) -> None:
        """Ask manager ``index`` for its readings up to ``num_positions``,
        checking each where it enters the core."""
        manager = self.managers[index]
        readings = self.readings[index]
        try:
            new = [
                manager.shortest_hit_reading(position)
                for position in range(len(readings), num_positions)
            ]
            for position, reading in enumerate(new, len(readings)):
                if type(reading) is not int or reading < 0:
                    raise _bad_reading(manager, position, reading)
        except Exception as exc:
            if self.error is None or isinstance(exc, PluginResultError):
                raise
            gid = manager.kv_cache_group_id
            raise self.error(gid, "shortest_hit_reading", exc) from exc
        readings += new


def _bad_reading(
    manager: SingleTypeManager, position: int, reading: object
) -> PluginResultError:
    return result_error(
        manager,
        f"shortest_hit_reading({position})",
        f"returned {reading!r}; it must return an int of at least 0: the "
        "fewest tokens a hit must cover to read the block at that table position",
    )
