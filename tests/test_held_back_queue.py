"""Held-back and spare blocks against a list model: free order, the held
and spare sets, the cap on held-back blocks, rollback, copies; and the
hit-point free order against the per-block sort it replaced."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Sequence
from typing import Any, cast

import pytest
from coordinator_setup import assert_free_links_agree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvcore.coordinator.block_pool import BlockPool
from kvcore.coordinator.blocks import UNLINKED
from kvcore.coordinator.free_order import HitPointOrder
from kvcore.coordinator.manager import SingleTypeManager
from kvcore.errors import ReentrantCallError

NUM_BLOCKS = 10  # block 0 is the null block


def h(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


class Model:
    """The pool as plain lists of block ids: the queue front first, the
    spare and the held-back blocks front first, reference counts and keyed
    blocks."""

    def __init__(self) -> None:
        self.queue = list(range(1, NUM_BLOCKS))
        self.spare: list[int] = []
        self.held: list[int] = []
        self.ref = dict.fromkeys(range(1, NUM_BLOCKS), 0)
        self.keyed: set[int] = set()

    def copy(self) -> Model:
        other = Model()
        other.queue = list(self.queue)
        other.spare = list(self.spare)
        other.held = list(self.held)
        other.ref = dict(self.ref)
        other.keyed = set(self.keyed)
        return other

    def unlink(self, i: int) -> None:
        if i in self.queue:
            self.queue.remove(i)
        elif i in self.spare:
            self.spare.remove(i)
        else:
            self.held.remove(i)

    def order(self) -> list[int]:
        """The order hand-outs take free blocks in: the queue's blocks
        without a key (at its front), the spare ones, the queue's others,
        the held-back ones."""
        unkeyed = 0
        while unkeyed < len(self.queue) and self.queue[unkeyed] not in self.keyed:
            unkeyed += 1
        return self.queue[:unkeyed] + self.spare + self.queue[unkeyed:] + self.held

    def movable(self, i: int) -> bool:
        return self.ref[i] == 0 and i in self.keyed

    def spill(self) -> None:
        while 2 * len(self.held) > len(self.queue) + len(self.spare) + len(self.held):
            self.queue.append(self.held.pop(0))


def _entry_ids(cached: dict[bytes, Any]) -> dict[bytes, Any]:
    """A group's prefix cache with each key's block ids (sorted where
    several blocks hold it)."""
    return {
        key: sorted(entry) if isinstance(entry, dict) else entry
        for key, entry in cached.items()
    }


class HeldBackMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=16)
        self.model = Model()
        self.saved: tuple[Model, Any] | None = None
        self.next_hash = 1

    # -- helpers ------------------------------------------------------------

    def pick(
        self, data: st.DataObject, ids: Sequence[int], *, most: int = 5
    ) -> list[int]:
        """A random sub-list of ``ids`` in random order (repeats allowed)."""
        if not ids:
            return []
        return data.draw(st.lists(st.sampled_from(list(ids)), max_size=most))

    def free_keyed(self) -> list[int]:
        m = self.model
        return [i for i in m.queue + m.spare + m.held if i in m.keyed]

    def snapshot(self) -> Any:
        p = self.pool
        q = p.free_queue
        return (
            q.get_all_free_blocks(),
            q.held_blocks(),
            sorted(q.held),
            q.spare_blocks(),
            sorted(q.spare),
            q.num_free,
            list(zip(p.ref_cnt, p.key_hash, p.key_group, strict=True)),
            # Group 0 is the only group the rules key blocks in.
            _entry_ids(p.cached_blocks_of(0)),
            p.num_cached_blocks_of(0),
        )

    # -- rules --------------------------------------------------------------

    @initialize(data=st.data())
    def fill(self, data: st.DataObject) -> None:
        """Start from free blocks, most of them keyed (hits and holds need
        keyed free blocks), freed in a random order."""
        self.get_new_blocks_n(NUM_BLOCKS - 1)
        self.cache(data)
        self.free_blocks(data)

    @rule(data=st.data())
    def get_new_blocks(self, data: st.DataObject) -> None:
        m = self.model
        free = len(m.queue) + len(m.spare) + len(m.held)
        # Often past the queue and the spare blocks, on into the held-back.
        low = len(m.queue) + len(m.spare) if data.draw(st.booleans()) else 0
        self.get_new_blocks_n(data.draw(st.integers(min(low, free), free)))

    def get_new_blocks_n(self, n: int) -> None:
        free = self.model.order()
        assert self.pool.eviction_order() == free
        got = self.pool.get_new_blocks(n)
        assert got == free[:n]
        for i in got:
            self.model.unlink(i)
            self.model.ref[i] = 1
            self.model.keyed.discard(i)

    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        """Give a key to blocks in use that have none (fresh hashes)."""
        ids = [i for i, r in self.model.ref.items() if r and i not in self.model.keyed]
        chosen = list(dict.fromkeys(self.pick(data, ids, most=NUM_BLOCKS)))
        if not chosen:
            return
        hashes = [h(self.next_hash + k) for k in range(len(chosen))]
        self.next_hash += len(chosen)
        self.pool.cache_full_blocks(
            block_hashes=hashes,
            blocks=list(chosen),
            num_cached_blocks=0,
            num_full_blocks=len(chosen),
            group_id=0,
        )
        self.model.keyed.update(chosen)

    def _free(self, chosen: list[int], *, table: bool) -> None:
        reached: list[int] = []
        for i in chosen:
            self.model.ref[i] -= 1
            if self.model.ref[i] == 0:
                reached.append(i)
        if table:
            reached.reverse()
        front = [i for i in reached if i not in self.model.keyed]
        back = [i for i in reached if i in self.model.keyed]
        self.model.queue = front + self.model.queue + back

    def _free_pick(self, data: st.DataObject) -> list[int]:
        """Blocks in use, each listed at most as often as it is held."""
        budget = dict(self.model.ref)
        chosen = []
        in_use = [i for i, r in budget.items() if r]
        for i in self.pick(data, in_use, most=2 * NUM_BLOCKS):
            if budget[i]:
                budget[i] -= 1
                chosen.append(i)
        return chosen

    @rule(data=st.data())
    def free_blocks(self, data: st.DataObject) -> None:
        chosen = self._free_pick(data)
        self.pool.free_blocks(list(chosen))
        self._free(chosen, table=False)

    @rule(data=st.data())
    def free_table(self, data: st.DataObject) -> None:
        chosen = list(dict.fromkeys(self._free_pick(data)))
        self.pool.free_table(list(chosen))
        self._free(chosen, table=True)

    @rule(data=st.data())
    def release_stopped_reading(self, data: st.DataObject) -> None:
        """Blocks running requests stopped reading (free_each): keyed ones
        to the back of the spare blocks (or, ``spare=False``, of the
        queue), the others to the queue's front."""
        budget = dict(self.model.ref)
        lists = []
        for _ in range(data.draw(st.integers(1, 2))):
            chosen = []
            for i in self.pick(data, [i for i, r in budget.items() if r]):
                if budget[i]:
                    budget[i] -= 1
                    chosen.append(i)
            lists.append(chosen)
        spare = data.draw(st.booleans())
        self.pool.free_each(lists, spare=spare)
        fronts: list[list[int]] = []
        backs: list[int] = []
        for chosen in lists:
            front = []
            for i in chosen:
                self.model.ref[i] -= 1
                if self.model.ref[i] == 0:
                    if i in self.model.keyed:
                        (self.model.spare if spare else backs).append(i)
                    else:
                        front.append(i)
            fronts.append(front)
        firsts = [i for f in reversed(fronts) for i in f]
        self.model.queue = firsts + self.model.queue + backs

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        """Hits: free keyed blocks (queued or held back) and blocks in use."""
        if data.draw(st.booleans()):
            ids = self.free_keyed() or [1]
        else:
            ids = list(range(1, NUM_BLOCKS))
        ids = [i for i in ids if self.model.ref[i] or i in self.model.keyed]
        chosen = self.pick(data, ids)
        self.pool.touch(list(chosen))
        for i in chosen:
            if self.model.ref[i] == 0:
                self.model.unlink(i)
            self.model.ref[i] += 1

    def _move(self, data: st.DataObject, how: str) -> None:
        if data.draw(st.booleans()):
            chosen = self.pick(data, self.free_keyed(), most=NUM_BLOCKS)
        else:
            chosen = self.pick(data, range(1, NUM_BLOCKS))
        m = self.model
        if how == "hold_back":
            self.pool.hold_back(list(chosen))
            for i in chosen:
                if m.movable(i):
                    m.unlink(i)
                    m.held.append(i)
        elif how == "hold_back_first":
            self.pool.hold_back_first(list(chosen))
            for i in reversed(chosen):
                if m.movable(i):
                    m.unlink(i)
                    m.held.insert(0, i)
        else:
            self.pool.requeue_at_back(list(chosen))
            for i in chosen:
                if m.movable(i):
                    m.unlink(i)
                    m.queue.append(i)
        if how != "requeue_at_back":
            m.spill()
            queue = self.pool.free_queue
            assert 2 * len(queue.held) <= queue.num_free

    @rule(data=st.data())
    def hold_back(self, data: st.DataObject) -> None:
        self._move(data, "hold_back")

    @rule(data=st.data())
    def hold_back_first(self, data: st.DataObject) -> None:
        self._move(data, "hold_back_first")

    @rule(data=st.data())
    def requeue_at_back(self, data: st.DataObject) -> None:
        self._move(data, "requeue_at_back")

    @rule(i=st.integers(1, NUM_BLOCKS - 1))
    def drop_from_cache(self, i: int) -> None:
        self.pool.drop_from_cache(i)
        m = self.model
        if i in m.keyed:
            m.keyed.discard(i)
            if m.ref[i] == 0:
                m.unlink(i)
                m.queue.insert(0, i)

    @precondition(lambda self: self.saved is None)
    @rule()
    def begin(self) -> None:
        self.saved = (self.model.copy(), self.snapshot())
        self.pool.begin()

    @precondition(lambda self: self.saved is not None)
    @rule()
    def commit(self) -> None:
        self.pool.commit()
        self.saved = None

    @precondition(lambda self: self.saved is not None)
    @rule()
    def rollback(self) -> None:
        assert self.saved is not None
        model, before = self.saved
        self.pool.rollback()
        self.saved = None
        self.model = model
        assert self.snapshot() == before

    @precondition(lambda self: self.saved is None)
    @rule(how=st.sampled_from(["pickle", "deepcopy"]))
    def copy_pool(self, how: str) -> None:
        before = self.snapshot()
        if how == "pickle":
            self.pool = pickle.loads(pickle.dumps(self.pool))
        else:
            self.pool = copy.deepcopy(self.pool)
        assert self.snapshot() == before

    @precondition(lambda self: self.saved is not None)
    @rule(how=st.sampled_from(["pickle", "deepcopy"]))
    def copy_pool_inside_a_transaction(self, how: str) -> None:
        before = self.snapshot()
        take = pickle.dumps if how == "pickle" else copy.deepcopy
        with pytest.raises(ReentrantCallError):
            take(self.pool)
        assert self.snapshot() == before

    # -- invariants ---------------------------------------------------------

    @invariant()
    def matches_the_model(self) -> None:
        p = self.pool
        q = p.free_queue
        m = self.model
        held = q.held_blocks()
        assert q.held == set(held)
        assert q.spare == set(q.spare_blocks())
        order = q.get_all_free_blocks()
        assert order == m.queue + m.spare + m.held
        assert p.eviction_order() == m.order()
        assert held == m.held
        assert q.num_free == len(order)
        assert all(p.ref_cnt[b] == 0 and b != 0 for b in order)
        assert {b: p.ref_cnt[b] for b in range(1, p.num_blocks)} == m.ref
        keyed = {b for b in range(p.num_blocks) if p.key_hash[b] is not None}
        assert keyed == m.keyed
        assert p.num_cached_blocks_of(0) == len(m.keyed)
        # Links agree both ways across both lists and their sentinels.
        assert_free_links_agree(q, p.num_blocks)
        for b in range(p.num_blocks):
            if p.ref_cnt[b] or b == 0:
                assert q.prev[b] == UNLINKED
                assert q.next[b] == UNLINKED


_FAST = settings(
    max_examples=80,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
_SLOW = settings(_FAST, max_examples=1500, stateful_step_count=80)


def test_held_back_queue_matches_a_list_model() -> None:
    _run(_FAST)


@pytest.mark.slow
def test_held_back_queue_matches_a_list_model_long() -> None:
    _run(_SLOW)


def _run(config: settings) -> None:
    run_state_machine_as_test(HeldBackMachine, settings=config)


# -- hit-point free order ---------------------------------------------------------


class _Readings:
    """A manager stand-in whose readings depend on the position alone."""

    def __init__(self, gid: int, readings: list[int]) -> None:
        self.kv_cache_group_id = gid
        self.readings = readings
        self.asked: list[int] = []

    def shortest_hit_reading(self, position: int) -> int:
        self.asked.append(position)
        return self.readings[position]


def _old_by_hit_points(
    managers: Sequence[_Readings], tables: Sequence[Sequence[int] | None]
) -> list[int]:
    """The per-block sort HitPointOrder replaced: (reading, -rank, position)."""
    entries: list[tuple[int, int, int, int]] = []
    for rank, (manager, blocks) in enumerate(zip(managers, tables, strict=True)):
        if not blocks:
            continue
        reading = manager.shortest_hit_reading
        entries += [
            (reading(pos), -rank, pos, block)
            for pos, block in enumerate(blocks)
            if block != 0
        ]
    entries.sort(key=lambda entry: entry[:3])
    return [entry[3] for entry in entries]


_MAX_POS = 12


@st.composite
def _requests(draw: st.DrawFn) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Per manager its readings by position (few values, so ties are common),
    and a few freed requests' tables: per manager None, or block ids with 0
    (the null block) sprinkled in."""
    num = draw(st.integers(1, 4))
    small = st.integers(0, 6)
    readings = [draw(st.lists(small, min_size=_MAX_POS, max_size=_MAX_POS))]
    for _ in range(num - 1):
        readings.append(draw(st.lists(small, min_size=_MAX_POS, max_size=_MAX_POS)))
    table = st.lists(st.integers(0, 3), max_size=_MAX_POS)
    requests = draw(st.lists(st.lists(table, min_size=num, max_size=num), max_size=4))
    return readings, requests


def _check_hit_point_order(
    data: tuple[list[list[int]], list[list[list[int]]]],
) -> None:
    readings, requests = data
    managers = [_Readings(gid, r) for gid, r in enumerate(readings)]
    order = HitPointOrder(cast("list[SingleTypeManager]", managers))
    serial = iter(range(1, 10_000))
    for request in requests:
        # Each listing its own block, a fresh id (0: the null block), so the
        # ids name the listings; an empty table stands for a group without
        # blocks (None or []).
        tables: list[list[int] | None] = [
            [0 if z == 0 else next(serial) for z in table] or None for table in request
        ]
        expected = _old_by_hit_points(managers, tables)
        for m in managers:
            m.asked.clear()
        got = order(tables)
        assert got == expected
        # Each position is read once per order, ever.
        for m in managers:
            assert len(m.asked) == len(set(m.asked))
    for m, r in zip(managers, order.readings, strict=True):
        assert r == m.readings[: len(r)]


@settings(max_examples=150, deadline=None)
@given(data=_requests())
def test_hit_point_order_is_the_per_block_sort(
    data: tuple[list[list[int]], list[list[list[int]]]],
) -> None:
    _check_hit_point_order(data)


@pytest.mark.slow
@settings(max_examples=3000, deadline=None)
@given(data=_requests())
def test_hit_point_order_is_the_per_block_sort_long(
    data: tuple[list[list[int]], list[list[list[int]]]],
) -> None:
    _check_hit_point_order(data)


# -- the cap and rollbacks, every small case ---------------------------------------


def _state(p: BlockPool) -> tuple[list[int], list[int], list[int], list[int]]:
    q = p.free_queue
    return (
        q.get_all_free_blocks(),
        q.held_blocks(),
        sorted(q.held),
        list(p.ref_cnt),
    )


@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("num_free", range(1, 8))
def test_holding_spills_the_fewest_and_rolls_back(first: bool, num_free: int) -> None:
    """Holding ``k`` blocks beside ``held`` held-back ones leaves
    min(held + k, num_free // 2) held back, spilling those evicted first;
    a hit on any held-back block, or a requeue of one, in the same
    transaction rolls back to the state before it, held set included."""
    cases = [
        (h0, k0, j0)
        for h0 in range(num_free // 2 + 1)
        for k0 in range(num_free - h0 + 1)
        for j0 in range(min(h0 + k0, num_free // 2) + 1)
    ]
    for held, k, j in cases:
        p = BlockPool(num_free + 2, enable_caching=True, hash_block_size=16)
        blocks = p.get_new_blocks(num_free + 1)
        p.cache_full_blocks(
            block_hashes=[h(i) for i in range(1, num_free + 1)],
            blocks=blocks[:-1],
            num_cached_blocks=0,
            num_full_blocks=num_free,
            group_id=0,
        )
        p.free_blocks(blocks[:-1])  # the last stays in use
        p.hold_back(blocks[:held])
        model = Model()
        model.queue = list(range(held + 1, num_free + 1))
        model.held = list(range(1, held + 1))
        before = _state(p)
        p.begin()
        chosen = blocks[held : held + k]
        ids = list(chosen)
        if first:
            p.hold_back_first(chosen)
            model.held[:0] = ids
        else:
            p.hold_back(chosen)
            model.held += ids
        model.queue = [i for i in model.queue if i not in ids]
        model.spill()
        q = p.free_queue
        assert len(q.held) == min(held + k, num_free // 2)
        assert _state(p)[:3] == (
            model.queue + model.held,
            model.held,
            sorted(model.held),
        )
        if j < len(model.held):
            target = model.held[j]
            p.touch([target])
            assert q.held == set(q.held_blocks())
            p.free_blocks([target])
            p.hold_back([target])
            p.requeue_at_back([model.held[-1]])
            assert q.held == set(q.held_blocks())
        p.rollback()
        assert _state(p) == before
