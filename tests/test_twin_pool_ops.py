"""The block pool's calls over a class of twin groups (``free_each``,
``cache_twin_blocks``) do exactly what one call per group does."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvcore
from kvcore.coordinator import KVCacheManager, Request
from kvcore.coordinator.block_pool import BlockPool, BlockRemoved, BlockStored
from kvcore.errors import InvalidRequestError
from kvcore_full_attention import FullAttentionSpec
from kvcore_mamba import MambaSpec


def h(i: int) -> bytes:
    return bytes([i]) * 32


def make_pool(*, caching: bool = True, events: bool = False) -> BlockPool:
    return BlockPool(
        40,
        enable_caching=caching,
        hash_block_size=16,
        enable_kv_cache_events=events,
        event_groups=[(4, "full_attention", None)] * 4,
    )


def snapshot(p: BlockPool) -> tuple[Any, ...]:
    """Everything a step may change but its events (taken only outside a
    transaction, see the tests): queue order, counts, keys."""
    return (
        p.free_queue.get_all_free_blocks(),
        p.free_queue.held_blocks(),
        p.free_queue.num_free,
        [
            (ref, key, gid if key else None)
            for ref, key, gid in zip(p.ref_cnt, p.key_hash, p.key_group, strict=True)
        ],
        {
            gid: {k: _ids(e) for k, e in p.cached_blocks_of(gid).items()}
            for gid in range(4)
        },
        p.num_cached_blocks,
    )


def _ids(entry: Any) -> Any:
    if isinstance(entry, dict):
        return sorted(entry)
    return entry


def setup(p: BlockPool) -> list[list[int]]:
    """Three groups' tables of 4 blocks, the first two keyed, the third of
    each group shared (a second reference); a few free blocks keyed too."""
    p.get_new_blocks(2)  # ids 1, 2 stay in use
    tables = [p.get_new_blocks(4) for _ in range(3)]
    for gid, table in enumerate(tables):
        p.cache_full_blocks(
            block_hashes=[h(1), h(2), h(3), h(4)],
            blocks=table,
            num_cached_blocks=0,
            num_full_blocks=2,
            group_id=gid,
            token_ids=list(range(8)),
        )
        p.touch([table[2]])
    spare = p.get_new_blocks(3)
    p.cache_full_blocks(
        block_hashes=[h(9), h(10), h(11)],
        blocks=spare,
        num_cached_blocks=0,
        num_full_blocks=3,
        group_id=3,
        token_ids=list(range(12)),
    )
    p.free_blocks(spare)
    p.take_events()
    return tables


@pytest.mark.parametrize("caching", [True, False])
def test_free_each_is_one_free_blocks_per_list(caching: bool) -> None:
    one, each = make_pool(caching=caching), make_pool(caching=caching)
    tables_one, tables_each = setup(one), setup(each)
    # Keyed and unkeyed blocks in each list, newest first, one shared.
    pick = [[t[3], t[2], t[1], t[0]] for t in tables_one]
    for blocks in pick:
        one.free_blocks(blocks)
    before = snapshot(each)
    each.begin()
    each.free_each([[t[3], t[2], t[1], t[0]] for t in tables_each])
    assert snapshot(each) == snapshot(one)
    # Unkeyed blocks: the later list's go before the earlier's, at the front.
    if caching:
        later_first = [tables_each[2][3], tables_each[1][3], tables_each[0][3]]
        assert snapshot(each)[0][:3] == later_first
    each.rollback()
    assert snapshot(each) == before


def test_free_each_double_free_changes_nothing() -> None:
    p = make_pool()
    tables = setup(p)
    p.free_blocks([tables[1][0]])
    before = snapshot(p)
    with pytest.raises(InvalidRequestError, match="freed more often"):
        p.free_each([[tables[0][1], tables[0][0]], [tables[1][1], tables[1][0]]])
    assert snapshot(p) == before


@pytest.mark.parametrize("events", [False, True])
@pytest.mark.parametrize("caching", [True, False])
def test_cache_twin_blocks_is_one_store_and_drop_per_group(
    events: bool, caching: bool
) -> None:
    one = make_pool(events=events, caching=caching)
    each = make_pool(events=events, caching=caching)
    tables_one, tables_each = setup(one), setup(each)
    # The replaced states: group 0's free and keyed (moves to the front),
    # group 1's in use (keeps its place), group 2 none.
    for p, tables in ((one, tables_one), (each, tables_each)):
        p.free_blocks([tables[0][0]])
    hashes = [h(1), h(2), h(3), h(4)]
    tokens = list(range(16))
    for gid, table in enumerate(tables_one):
        one.cache_full_blocks(
            block_hashes=hashes,
            blocks=table,
            num_cached_blocks=2,
            num_full_blocks=4,
            group_id=gid,
            token_ids=tokens,
        )
        if gid < 2:
            one.drop_from_cache(table[0])
    before = snapshot(each)
    each.begin()

    def store() -> None:
        each.cache_twin_blocks(
            block_hashes=hashes,
            tables=tables_each,
            group_ids=[0, 1, 2],
            num_cached_blocks=2,
            num_full_blocks=4,
            token_ids=tokens,
            replaced=[tables_each[0][0], tables_each[1][0], None],
        )

    store()
    assert snapshot(each) == snapshot(one)
    if caching:
        assert each.num_cached_blocks == before[5] + 2 * 3 - 2
        assert snapshot(each)[0][0] == tables_each[0][0]
    each.rollback()
    assert snapshot(each) == before
    assert each.take_events() == []
    # Kept, the twin call records the per-group calls' events.
    store()
    assert snapshot(each) == snapshot(one)
    expected = one.take_events()
    assert bool(expected) == (events and caching)
    assert each.take_events() == expected


def test_cache_twin_blocks_checks_every_table_first() -> None:
    p = make_pool()
    tables = setup(p)
    before = snapshot(p)
    with pytest.raises(InvalidRequestError, match="for group 2"):
        p.cache_twin_blocks(
            block_hashes=[h(1), h(2), h(3), h(4)],
            tables=[tables[0], tables[1], tables[2][:3]],
            group_ids=[0, 1, 2],
            num_cached_blocks=2,
            num_full_blocks=4,
        )
    assert snapshot(p) == before


def test_twin_state_groups_store_in_group_order_with_eagle() -> None:
    """With EAGLE a step may reach kept targets and keep its end state in
    one call; the twin state groups' events still come in group order, as
    with one group stepped at a time."""
    attention = FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    state = MambaSpec(
        block_size=16,
        shapes=((3, 8),),
        dtypes=(torch.float16,),
        mamba_cache_mode="align",
    )
    groups = [kvcore.KVCacheGroupSpec(["a.0"], attention)] + [
        kvcore.KVCacheGroupSpec([f"m.{i}"], state) for i in range(3)
    ]
    config = kvcore.KVCacheConfig(
        num_blocks=400, kv_cache_tensors=[], kv_cache_groups=groups
    )
    mgr = KVCacheManager(
        config,
        4096,
        scheduler_block_size=16,
        hash_block_size=16,
        enable_caching=True,
        use_eagle=True,
        enable_kv_cache_events=True,
    )
    seen = 0
    for n, prompt in enumerate((192, 224, 224)):
        # Each request is admitted in its own engine step: the states the
        # one before wrote are there to resume from.
        mgr.new_step_starts()
        # A whole prompt on a block boundary in one step: it reaches the
        # two boundaries before its end (kept with EAGLE) and keeps its end.
        req = Request(f"r{n}", list(range(1000, 1000 + prompt)), hash_block_size=16)
        blocks, hit = mgr.get_computed_blocks(req)
        assert mgr.allocate_slots(req, prompt - hit, hit, blocks) is not None
        events = mgr.take_events()
        order = [
            e.group_id
            for e in events
            if isinstance(e, BlockStored | BlockRemoved) and e.group_id > 0
        ]
        assert order == sorted(order), order
        seen += order.count(1) > 1
    assert seen  # a step that stored several states in each state group
