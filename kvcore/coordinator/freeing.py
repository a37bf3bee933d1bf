"""Freeing a request: the coordinator's free step (a base class of
:class:`~kvcore.coordinator.coordinator.KVCacheCoordinator`).

Every group's table is popped, one ``pop_twins`` call per run of
consecutive twins in free order (groups that evict last at the end); the
blocks a running request held back (or released, in a group whose every
release stays a hit point) rejoin their group's table; the blocks
are queued for eviction by hit point across caching groups
(:class:`~kvcore.coordinator.free_order.HitPointOrder`), else group by
group, each tail first; the states a state group kept go to the back of
the eviction order.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcore.coordinator.free_order import HitPointOrder
from kvcore.coordinator.manager import SingleTypeManager
from kvcore.coordinator.parts import CoordinatorParts
from kvcore.coordinator.plugin_results import result_error, shown
from kvcore.coordinator.pool_journal import UNDO_CALL
from kvcore.coordinator.twins import defining, record_whole, twin_runs
from kvcore.coordinator.undo import truncate
from kvcore.errors import InvalidRequestError, KvcoreTypeError

if TYPE_CHECKING:
    pass

__all__ = ["FreeSteps", "PoppedId", "list_key"]


class PoppedId(str):
    """The id a popped request's records are filed under until its blocks
    are released (:meth:`FreeSteps.pop_for_free`): it reads as the request
    id but equals only itself, so a new request under the same id never
    meets the old one's records."""

    __slots__ = ()
    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other


def list_key(ids: Sequence[int]) -> tuple[int, ...]:
    """A popped list's ids as a release matches them: sorted, the null
    block left out (any order of the same list is that list)."""
    ordered = sorted(ids)
    return tuple(ordered[bisect_right(ordered, 0) :])  # null blocks sort first


class FreeSteps(CoordinatorParts):
    """The free step of the coordinator, which supplies the pool, the
    managers' error reports and cache spans."""

    def _init_free_order(self, managers: Sequence[SingleTypeManager]) -> None:
        """The free order of ``managers`` (each one's ``holds_back`` set):
        groups that evict last at the end, cut into runs of twins."""
        #: Managers in the order their tables are popped and laid out.
        self._free_order = tuple(m for m in managers if not m.evicts_last) + tuple(
            m for m in managers if m.evicts_last
        )
        self._pop_runs = twin_runs(self._free_order)
        self._checked_pops = defining(self._pop_runs, "pop_twins")
        #: Managers whose freed blocks go to the back of the eviction order.
        self._evicting_last = tuple(m for m in managers if m.evicts_last)
        #: Those whose freed request's held-back blocks rejoin its table:
        #: groups that hold back, freed before the state groups (which move
        #: theirs to the back, see :meth:`_refresh_checkpoints`), and groups
        #: whose every release stays a hit point (``rejoins_releases``).
        self._holding = tuple(
            m
            for m in managers
            if m.rejoins_releases or (m.holds_back and not m.evicts_last)
        )
        #: Their indices in the free order.
        self._holding_at = tuple(self._free_order.index(m) for m in self._holding)
        #: Two or more caching groups: freed blocks queue by hit point.
        self._by_hit_points: HitPointOrder | None = None
        if sum(m.caching for m in managers) > 1:
            self._by_hit_points = HitPointOrder(self._free_order, self.plugin_error)
        #: The groups with work left for a free after its blocks are popped
        #: (held-back blocks, kept states): a popped request's records there
        #: are filed under a :class:`PoppedId` until its list is released.
        self._parking = (
            *self._holding,
            *(m for m in self._evicting_last if m not in self._holding),
        )
        #: The popped lists whose free is not finished, by :func:`list_key`:
        #: each one's id and popped tables, in the order they were popped.
        self._parked: dict[
            tuple[int, ...], list[tuple[str, list[list[int] | None]]]
        ] = {}

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
        self._free_tables(request_id, self._pop_tables(request_id))

    def pop_for_free(self, request_id: str) -> list[int]:
        """Forget the request and hand back every group's blocks, still
        held, as :meth:`BlockPool.free_table` takes them; the request's id
        is free for reuse at once.  Freeing that list later through
        :meth:`free_popped` is :meth:`free` at that time: the blocks the
        request held back rejoin its tables if they are still cached then,
        and the states it kept move to the back then.  Until then those
        stay free where they are (nothing is taken from the free pool but
        the request's own blocks), filed under a :class:`PoppedId`; the
        list is then the tables' blocks group by group, the null block left
        out (its release orders them)."""
        tables = self._pop_tables(request_id)
        if not self._parking:
            return self._in_free_order(tables)
        freed = [b for blocks in reversed(tables) if blocks for b in blocks if b]
        if not freed:  # no list comes back: nothing to wait for
            self._free_tables(request_id, tables)
            return freed
        token = PoppedId(request_id)
        self._each(self._parking, "park_freed", request_id, token)
        key = list_key(freed)
        records = self._parked.get(key)
        if records is None:
            records = self._parked[key] = []
            self.block_pool.record(self._parked.pop, key, None)
        else:
            self.block_pool.record(truncate, records, len(records))
        records.append((token, tables))
        return freed

    def free_popped(
        self, blocks: Sequence[int], key: tuple[int, ...] | None = None
    ) -> bool:
        """Finish the free of a list :meth:`pop_for_free` handed out (any
        order of it), as :meth:`free` would now; False, changing nothing,
        when no popped list still out holds exactly those blocks (the
        caller frees them as it would any blocks).  Lists of the same
        blocks are taken in the order they were popped.  ``key``: the
        list's :func:`list_key`, where the caller has it."""
        if not self._parked:
            return False
        if key is None:
            key = list_key(blocks)
        records = self._parked.get(key)
        if records is None:
            return False
        token, tables = records.pop(0)
        self.block_pool.record(records.insert, 0, (token, tables))
        if not records:
            del self._parked[key]
            self.block_pool.record(self._parked.__setitem__, key, records)
        self._free_tables(token, tables)
        return True

    def _free_tables(self, request_id: str, tables: list[list[int] | None]) -> None:
        """Queue a freed request's popped ``tables`` for eviction: the
        blocks it held back rejoin them first (:meth:`_rejoin_held_back`),
        then every block by hit point across caching groups
        (:class:`HitPointOrder`), else group by group in free order, each
        tail first; the states it kept go to the back last, but for those
        that rejoined its table."""
        rejoined: list[int] = []
        if self._holding:
            tables = list(tables)  # a parked record stays as popped
            rejoined = self._rejoin_held_back(request_id, tables)
        freed = self._in_free_order(tables)
        if freed:
            self.block_pool.free_table(freed)
        if self._evicting_last:
            self._refresh_checkpoints(request_id, rejoined)

    def _pop_tables(self, request_id: str) -> list[list[int] | None]:
        """Forget the request in every group: each group's table (None where
        it holds none), in free order."""
        self.forget_span(request_id)
        tables: list[list[int] | None] = []
        gid = 0
        try:
            for first, members in self._pop_runs:
                lead = members[0]
                gid = lead.kv_cache_group_id
                if first not in self._checked_pops:
                    tables += type(lead).pop_twins(lead, members, request_id)
                    continue
                journal = self.block_pool.journal
                # Copies: a pop that rewrote a table in place is told apart.
                copies = (
                    record_whole(members, request_id)
                    if journal is not None
                    else [list(m.req_to_blocks.get(request_id, ())) for m in members]
                )
                held = [
                    None if request_id not in m.req_to_blocks else copy
                    for m, copy in zip(members, copies, strict=True)
                ]
                mark = 0 if journal is None else len(journal)
                popped = type(lead).pop_twins(lead, members, request_id)
                if (
                    type(popped) not in (list, tuple)
                    or list(popped) != held
                    or any(t is not None and type(t) is not list for t in popped)
                    or any(request_id in m.req_to_blocks for m in members)
                    or any(r[0] != UNDO_CALL for r in (journal or ())[mark:])
                ):
                    sizes = [-1 if t is None else len(t) for t in held]
                    raise _pop_error(lead, request_id, (held, sizes), popped)
                tables += popped
        except Exception as exc:
            raise self.plugin_error(gid, "pop_blocks", exc) from exc
        return tables

    def _in_free_order(self, tables: list[list[int] | None]) -> list[int]:
        """``tables`` as :meth:`BlockPool.free_table` takes them: by hit point
        across caching groups, else group by group, each tail first."""
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
    ) -> list[int]:
        """Take again the blocks the request held back (or, where the
        group rejoins its releases, released keyed) that are still
        cached and put each in a copy of its group's table at its position
        (released there, so the null block): its group frees it with the
        rest of the table, tail first, and the hit points it completes
        leave the cache with the request's other blocks.  The blocks put
        back."""
        held = self._each(self._holding, "take_held_back", request_id, reads=True)
        revived: list[int] = []
        for manager, index, pairs in zip(
            self._holding, self._holding_at, held, strict=True
        ):
            table = tables[index]
            if not pairs or not table:
                continue
            self._check_held_back(manager, request_id, pairs, table)
            merged = list(table)
            for pos, block in pairs:
                merged[pos] = block
            tables[index] = merged
            revived += [block for _, block in pairs]
        if revived:
            self.block_pool.touch(revived)
        return revived

    def _check_held_back(
        self,
        manager: SingleTypeManager,
        request_id: str,
        pairs: object,
        table: Sequence[int],
    ) -> None:
        """A ``take_held_back`` answer as the core takes it: distinct
        ``(table position, block)`` pairs, each a position the request
        released (the null block there) and a free block of the pool."""
        pool = self.block_pool
        null = pool.null_block
        ref = pool.ref_cnt
        seen: set[int] = set()
        for pair in pairs if isinstance(pairs, list | tuple) else (pairs,):
            ok = isinstance(pair, tuple) and len(pair) == 2
            if ok:
                pos, block = pair
                ok = (
                    type(pos) is int
                    and 0 <= pos < len(table)
                    and table[pos] == null
                    and type(block) is int
                    and 0 < block < pool.num_blocks
                    and ref[block] == 0
                    and block not in seen
                )
                seen.add(block)
            if not ok:
                gid = manager.kv_cache_group_id
                error = result_error(
                    manager,
                    "take_held_back",
                    f"returned {shown(pair)} for request {request_id!r} in cache "
                    f"group {gid}; it must return (table position, block) pairs, "
                    "each a position the request released and the free block it "
                    "held back there, each block once",
                )
                raise self.plugin_error(gid, "take_held_back", error)

    def _refresh_checkpoints(self, request_id: str, rejoined: list[int]) -> None:
        """Move the states a freed request kept, released earlier, to the
        back of the eviction order with its other blocks; not those that
        ``rejoined`` its table, queued by hit point beside the blocks their
        hits read (behind all of them, a state outlived the attention
        blocks it needs and served nothing)."""
        states = self._released_states(request_id)
        if rejoined:
            skip = set(rejoined)
            states = [block for block in states if block not in skip]
        self.block_pool.requeue_at_back(states)

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


def _pop_error(
    manager: SingleTypeManager,
    request_id: str,
    held: tuple[list[list[int] | None], list[int]],
    popped: object,
) -> Exception:
    """A ``pop_twins`` answer that is not the tables the twins held (the
    tables, and their lengths before the call, -1 where none): the blocks
    it leaves out would never be freed, and another request's blocks in it
    would be freed under that request."""
    tables, sizes = held
    return result_error(
        manager,
        "pop_twins",
        f"returned {shown(popped)} for request {request_id!r}, whose tables "
        f"were {shown(tables)} (of {shown(sizes)} blocks before the call); it "
        "must return each twin's table as the request held it (None where it "
        "held none), unchanged, and forget it, without taking, freeing or "
        "keying a block itself, so the request's blocks, and only they, are "
        "freed, once",
    )
