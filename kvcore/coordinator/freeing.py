"""Freeing a request: the coordinator's free step (a base class of
:class:`~kvcore.coordinator.coordinator.KVCacheCoordinator`).

Every group's table is popped, one ``pop_twins`` call per run of
consecutive twins in free order (groups that evict last at the end); the
blocks a running request held back rejoin their group's table; the blocks
are queued for eviction by hit point across caching groups
(:class:`~kvcore.coordinator.free_order.HitPointOrder`), else group by
group, each tail first; the states a state group kept go to the back of
the eviction order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvcore.coordinator.blocks import UNLINKED
from kvcore.coordinator.free_order import HitPointOrder
from kvcore.coordinator.manager import SingleTypeManager
from kvcore.coordinator.pool_checks import check_ids
from kvcore.coordinator.twins import twin_runs
from kvcore.errors import InvalidRequestError, KvcoreTypeError

if TYPE_CHECKING:
    from kvcore.coordinator.block_pool import BlockPool
    from kvcore.errors import PluginError

__all__ = ["FreeSteps"]


class FreeSteps:
    """The free step of the coordinator, which supplies the pool, the
    managers' error reports and cache spans."""

    block_pool: BlockPool
    single_type_managers: tuple[SingleTypeManager, ...]

    if TYPE_CHECKING:  # the coordinator's

        def plugin_error(
            self, gid: int, method: str, exc: BaseException
        ) -> PluginError: ...

        def forget_span(self, request_id: str) -> None: ...

        def _each(
            self, managers: Sequence[SingleTypeManager], method: str, *args: Any
        ) -> list[Any]: ...

    def _init_free_order(self, managers: Sequence[SingleTypeManager]) -> None:
        """The free order of ``managers`` (each one's ``holds_back`` set):
        groups that evict last at the end, cut into runs of twins."""
        #: Managers in the order their tables are popped and laid out.
        self._free_order = tuple(m for m in managers if not m.evicts_last) + tuple(
            m for m in managers if m.evicts_last
        )
        self._pop_runs = twin_runs(self._free_order)
        #: Managers whose freed blocks go to the back of the eviction order.
        self._evicting_last = tuple(m for m in managers if m.evicts_last)
        #: Those that hold back released blocks, freed before the state
        #: groups: a freed request's held-back blocks rejoin their group's
        #: table (state groups move theirs to the back, see
        #: :meth:`_refresh_checkpoints`).
        self._holding = tuple(m for m in managers if m.holds_back and not m.evicts_last)
        #: Their indices in the free order.
        self._holding_at = tuple(self._free_order.index(m) for m in self._holding)
        #: Two or more caching groups: freed blocks queue by hit point.
        self._by_hit_points: HitPointOrder | None = None
        if sum(m.caching for m in managers) > 1:
            self._by_hit_points = HitPointOrder(self._free_order, self.plugin_error)

    def forget_unwritten(self, request_id: str, num_computed_tokens: int) -> None:
        """Drop the full prefix-cache keys of the request's blocks that hold
        a token past ``num_computed_tokens``: a step keys its blocks when it
        is scheduled, so when the engine drops that step before its forward
        pass runs (a preemption in the scheduling step), those blocks were
        never filled and no later hit may read them.  Partial keys stay:
        they are given only for computed tokens.  Only position-indexed
        tables map blocks to tokens; the others never key blocks by token."""
        unwritten = [
            (manager.kv_cache_group_id, block)
            for manager in self.single_type_managers
            if manager.position_indexed
            for block in manager.req_to_blocks.get(request_id, ())[
                num_computed_tokens // manager.block_size :
            ]
            if block
        ]
        ref = self.block_pool.ref_cnt
        for gid, block in unwritten:
            if ref[block] > 1:
                msg = (
                    f"free(forward_ran=False) for request {request_id!r}: block "
                    f"{block} of group {gid}, which the dropped step was "
                    "to fill, is also in another request's table (a hit taken "
                    "after the step was scheduled), whose forward would read KV "
                    "no step writes; drop a step before admitting other requests "
                    "in the same step, or drop theirs too"
                )
                raise InvalidRequestError(msg)
        for _, block in unwritten:
            self.block_pool.forget_key(block)

    def free(self, request_id: str) -> None:
        """Free every group's blocks at once, the tail first."""
        freed = self._pop_tables(request_id)
        if freed:
            self.block_pool.free_table(freed)
        if self._evicting_last:
            self._refresh_checkpoints(request_id)

    def pop_for_free(self, request_id: str) -> list[int]:
        """Forget the request and hand back every group's blocks, still
        held, as :meth:`BlockPool.free_table` takes them: freeing the list
        later queues the blocks as :meth:`free` would have then.  The
        states it kept and released earlier that are free now (see
        :meth:`_refresh_checkpoints`) are held too and listed first, so they
        go behind its other blocks when the list is freed, not before them
        and before every block freed meanwhile.  A group names a kept state
        only while it is free, so one still held (in the request's table,
        or by a request that hit it) is not moved: it keeps its place among
        the request's blocks, or where its last holder frees it."""
        freed = self._pop_tables(request_id)
        if self._evicting_last:
            freed = self._kept_states_first(request_id, freed)
        return freed

    def _kept_states_first(self, request_id: str, freed: list[int]) -> list[int]:
        """``freed`` with the kept states :meth:`_refresh_checkpoints` would
        move once it is freed listed first, in the reverse of their order
        (``free_table`` queues the first listed last): each state that
        freeing ``freed`` leaves free, queued and keyed, its listings in
        ``freed`` moved there, a state that is free now taken (touched)."""
        pool = self.block_pool
        states = self._released_states(request_id)
        check_ids("take_released_checkpoints", states, pool.num_blocks)
        listed = Counter(freed)
        ref = pool.ref_cnt
        key_hash = pool.key_hash
        prev_links = pool.free_queue.prev
        chosen = [
            block
            for block in states
            if block
            and key_hash[block] is not None
            and ref[block] == listed[block]
            and (listed[block] or prev_links[block] != UNLINKED)
        ]
        if not chosen:
            return freed
        chosen = list(dict.fromkeys(reversed(chosen)))  # by its last naming
        pool.touch([block for block in chosen if not listed[block]])
        moved = set(chosen)
        return [block for block in chosen for _ in range(listed[block] or 1)] + [
            block for block in freed if block not in moved
        ]

    def _pop_tables(self, request_id: str) -> list[int]:
        """The request's blocks as :meth:`BlockPool.free_table` takes them:
        by hit point across caching groups (:class:`HitPointOrder`), else
        group by group in free order, each tail first; the blocks it held
        back rejoin their group's table first (:meth:`_rejoin_held_back`)."""
        self.forget_span(request_id)
        tables: list[list[int] | None] = []
        gid = 0
        try:
            for _, members in self._pop_runs:
                gid = members[0].kv_cache_group_id
                tables += members[0].pop_twins(members, request_id)
        except Exception as exc:
            raise self.plugin_error(gid, "pop_blocks", exc) from exc
        if self._holding:
            self._rejoin_held_back(request_id, tables)
        if self._by_hit_points is not None:
            return self._by_hit_points(tables)
        if len(tables) == 1:
            return tables[0] or []  # never changed: the journal keeps it
        freed: list[int] = []
        for blocks in reversed(tables):
            if blocks:
                freed += blocks
        return freed

    def _rejoin_held_back(
        self, request_id: str, tables: list[list[int] | None]
    ) -> None:
        """Take again the blocks the request held back that are still
        cached and put each in a copy of its group's table at its position
        (released there, so the null block): its group frees it with the
        rest of the table, tail first, and the hit points it completes
        leave the cache with the request's other blocks."""
        held = self._each(self._holding, "take_held_back", request_id)
        revived: list[int] = []
        for index, pairs in zip(self._holding_at, held, strict=True):
            table = tables[index]
            if not pairs or not table:
                continue
            merged = list(table)
            for pos, block in pairs:
                merged[pos] = block
            tables[index] = merged
            revived += [block for _, block in pairs]
        if revived:
            self.block_pool.touch(revived)

    def _refresh_checkpoints(self, request_id: str) -> None:
        """Move the states a freed request kept, released earlier, to the
        back of the eviction order with its other blocks."""
        self.block_pool.requeue_at_back(self._released_states(request_id))

    def _released_states(self, request_id: str) -> list[int]:
        """The states the request kept and released earlier, group by group
        (``take_released_checkpoints`` of each group freed last)."""
        method = "take_released_checkpoints"
        states: list[int] = []
        answers = self._each(self._evicting_last, method, request_id)
        for manager, blocks in zip(self._evicting_last, answers, strict=True):
            if type(blocks) is not list and type(blocks) is not tuple:
                msg = (
                    f"{method} returned {type(blocks).__name__} for request "
                    f"{request_id!r}; it must return a list of block ids (or [])"
                )
                gid = manager.kv_cache_group_id
                raise self.plugin_error(gid, method, KvcoreTypeError(msg))
            states += blocks
        return states
