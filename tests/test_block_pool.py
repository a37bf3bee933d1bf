"""Block pool: free queue order, reference counts, prefix cache, events."""

from __future__ import annotations

from itertools import pairwise

import pytest
from coordinator_setup import assert_free_links_agree
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.coordinator.block_pool import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    FreeBlockQueue,
)
from kvcore.coordinator.blocks import UNLINKED
from kvcore.errors import (
    BlockSizeError,
    InvalidRequestError,
    KvcoreTypeError,
    KvcoreValueError,
    NoFreeBlocksError,
    ReentrantCallError,
)


def free_ids(pool: BlockPool) -> list[int]:
    return pool.free_queue.get_all_free_blocks()


def unlinked(queue: FreeBlockQueue, block: int) -> bool:
    """Whether ``block`` has no free-queue links (it is not queued)."""
    return queue.prev[block] == UNLINKED and queue.next[block] == UNLINKED


def h(i: int) -> bytes:
    return bytes([i]) * 32


def pool(
    num_blocks: int = 10, *, caching: bool = True, events: bool = False
) -> BlockPool:
    return BlockPool(
        num_blocks,
        enable_caching=caching,
        hash_block_size=16,
        enable_kv_cache_events=events,
        # Groups 0-5: block size 4 (events carry it), the last a window.
        event_groups=[(4, "full_attention", None)] * 5 + [(4, "sliding_window", 8)],
    )


# -- FreeBlockQueue ---------------------------------------------------------------


def make_queue(n: int) -> tuple[FreeBlockQueue, list[int]]:
    return FreeBlockQueue(n), list(range(n))


def test_queue_starts_in_block_id_order() -> None:
    queue, _ = make_queue(5)
    assert queue.num_free == len(queue) == 5
    assert queue.get_all_free_blocks() == [0, 1, 2, 3, 4]


def test_queue_popleft_and_popleft_n() -> None:
    queue, _ = make_queue(5)
    assert queue.popleft() == 0
    assert queue.popleft_n(3) == [1, 2, 3]
    assert queue.popleft_n(0) == []
    assert queue.num_free == 1
    with pytest.raises(NoFreeBlocksError, match="asked the free block queue for 2"):
        queue.popleft_n(2)
    assert queue.num_free == 1  # unchanged by the failed call
    assert queue.popleft() == 4
    with pytest.raises(NoFreeBlocksError, match="empty"):
        queue.popleft()
    assert queue.get_all_free_blocks() == []


def test_queue_popped_blocks_are_unlinked() -> None:
    queue, blocks = make_queue(3)
    block = queue.popleft()
    assert queue.prev[block] == UNLINKED
    assert queue.next[block] == UNLINKED
    for b in queue.popleft_n(2):
        assert queue.prev[b] == UNLINKED
        assert queue.next[b] == UNLINKED
    assert queue.next[blocks[2]] == UNLINKED


def test_queue_remove_from_the_middle_and_ends() -> None:
    queue, blocks = make_queue(5)
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert queue.get_all_free_blocks() == [1, 3]
    assert queue.num_free == 2
    with pytest.raises(
        KvcoreValueError, match="block 2 is not in the free block queue"
    ):
        queue.remove(blocks[2])


def test_queue_append_and_prepend_keep_given_order() -> None:
    queue, _ = make_queue(6)
    taken = queue.popleft_n(4)  # 0 1 2 3 ; queue: 4 5
    queue.append(taken[0])  # 4 5 0
    queue.append_n([taken[1], taken[2]])  # 4 5 0 1 2
    queue.prepend_n([taken[3]])  # 3 4 5 0 1 2
    assert queue.get_all_free_blocks() == [3, 4, 5, 0, 1, 2]
    got = queue.popleft_n(6)
    queue.prepend_n([got[5], got[4]])  # the first given comes out first
    queue.prepend_n([got[0]])
    assert queue.get_all_free_blocks() == [3, 2, 1]
    queue.append_n([])
    queue.prepend_n([])
    assert queue.num_free == 3


def test_queue_rejects_a_block_queued_twice() -> None:
    queue, blocks = make_queue(3)
    with pytest.raises(KvcoreValueError, match="block 1 is already in the free"):
        queue.append(blocks[1])
    outside = queue.popleft()
    with pytest.raises(KvcoreValueError, match="block 2 is already"):
        queue.prepend_n([outside, blocks[2]])
    # Validated before linking: nothing changed.
    assert queue.get_all_free_blocks() == [1, 2]
    assert queue.num_free == 2


_OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["popleft", "popleft_n", "remove", "append", "append_n", "prepend_n"]
        ),
        st.integers(min_value=0, max_value=10_000),
        st.integers(min_value=0, max_value=6),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(min_value=0, max_value=12), ops=_OPS)
def test_queue_matches_a_list_model(n: int, ops: list[tuple[str, int, int]]) -> None:
    queue, blocks = make_queue(n)
    model = list(range(n))  # block ids, front first
    for op, pick, count in ops:
        outside = [i for i in range(n) if i not in model]
        if op == "popleft":
            if model:
                assert queue.popleft() == model.pop(0)
            else:
                with pytest.raises(NoFreeBlocksError):
                    queue.popleft()
        elif op == "popleft_n":
            if count <= len(model):
                assert queue.popleft_n(count) == model[:count]
                del model[:count]
            else:
                with pytest.raises(NoFreeBlocksError):
                    queue.popleft_n(count)
        elif op == "remove" and model:
            victim = model.pop(pick % len(model))
            queue.remove(blocks[victim])
        elif op == "append" and outside:
            chosen = outside[pick % len(outside)]
            queue.append(blocks[chosen])
            model.append(chosen)
        elif op in ("append_n", "prepend_n"):
            # A pick-dependent rotation of the outside blocks, up to `count`.
            k = min(count, len(outside))
            start = pick % len(outside) if outside else 0
            chosen_ids = (outside[start:] + outside[:start])[:k]
            chosen_blocks = [blocks[i] for i in chosen_ids]
            if op == "append_n":
                queue.append_n(chosen_blocks)
                model.extend(chosen_ids)
            else:
                queue.prepend_n(chosen_blocks)
                model[:0] = chosen_ids
        assert queue.num_free == len(model)
        assert queue.get_all_free_blocks() == model
    # Links are consistent in both directions.
    forward = queue.get_all_free_blocks()
    for a, b in pairwise(forward):
        assert queue.next[a] == b
        assert queue.prev[b] == a


# -- BlockPool construction and allocation ----------------------------------------


def test_pool_reserves_block_0_as_the_null_block() -> None:
    p = pool(10)
    assert p.num_blocks == 10
    assert p.null_block == 0
    assert p.blocks[0] is p.block(p.null_block)
    assert p.block(p.null_block).is_null
    assert p.get_num_free_blocks() == 9
    assert free_ids(p) == list(range(1, 10))
    assert p.get_usage() == 0.0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_blocks": 0}, KvcoreValueError, "num_blocks must be >= 1"),
        ({"num_blocks": -3}, KvcoreValueError, "got -3"),
        ({"num_blocks": 2.0}, KvcoreTypeError, "float"),
        ({"hash_block_size": 0}, BlockSizeError, "hash_block_size"),
    ],
    ids=["zero", "negative", "float", "zero-hash-block"],
)
def test_pool_validates_its_arguments(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    args: dict[str, object] = {
        "num_blocks": 4,
        "enable_caching": True,
        "hash_block_size": 16,
    }
    args.update(kwargs)
    with pytest.raises(error, match=match):
        BlockPool(**args)  # type: ignore[arg-type]


def test_pool_with_only_the_null_block() -> None:
    p = pool(1)
    assert p.get_num_free_blocks() == 0
    assert p.get_usage() == 0.0
    assert p.get_new_blocks(0) == []
    with pytest.raises(
        NoFreeBlocksError, match="asked for 1 KV-cache blocks but only 0 of 0"
    ):
        p.get_new_blocks(1)


def test_get_new_blocks_takes_from_the_front_with_ref_1() -> None:
    p = pool(10)
    got = p.get_new_blocks(3)
    assert got == [1, 2, 3]
    assert [p.ref_cnt[b] for b in got] == [1, 1, 1]
    assert p.get_num_free_blocks() == 6
    assert p.get_usage() == pytest.approx(3 / 9)
    assert p.get_new_blocks(1) == [4]


def test_get_new_blocks_fails_before_touching_anything() -> None:
    p = pool(5)
    p.get_new_blocks(2)
    before = free_ids(p)
    with pytest.raises(NoFreeBlocksError) as info:
        p.get_new_blocks(3)
    msg = str(info.value)
    assert "asked for 3" in msg
    assert "only 2 of 4 are free" in msg
    assert "free or preempt" in msg
    assert free_ids(p) == before
    assert all(p.ref_cnt[i] == 0 for i in before)
    with pytest.raises(KvcoreValueError, match="-1"):
        p.get_new_blocks(-1)


# -- freeing ------------------------------------------------------------------------


def test_free_unhashed_blocks_go_to_the_front_in_given_order() -> None:
    p = pool(10)
    a = p.get_new_blocks(3)  # 1 2 3
    p.free_blocks(reversed(a))  # tail first: 3 2 1
    assert free_ids(p) == [3, 2, 1, 4, 5, 6, 7, 8, 9]
    assert [p.ref_cnt[b] for b in a] == [0, 0, 0]
    # Reused first, for locality.
    assert p.get_new_blocks(2) == [3, 2]


def test_free_hashed_blocks_go_to_the_back_in_given_order() -> None:
    p = pool(6)
    a = p.get_new_blocks(3)  # 1 2 3
    p.cache_full_blocks(
        block_hashes=[h(1), h(2), h(3)],
        blocks=a,
        num_cached_blocks=0,
        num_full_blocks=3,
        group_id=0,
    )
    p.free_blocks(a[::-1])
    # The request's tail (block 3) is evicted before its head (block 1).
    assert free_ids(p) == [4, 5, 3, 2, 1]


def test_held_back_first_blocks_go_before_the_other_held_back_ones() -> None:
    """Blocks held back with ``hold_back_first`` leave after every queued
    block and before every block held back with ``hold_back``, in the
    given order; a rollback puts them back where they were."""
    p = pool(8)
    a = p.get_new_blocks(5)  # 1 2 3 4 5; queue 6 7
    p.cache_full_blocks(
        block_hashes=[h(i) for i in range(1, 6)],
        blocks=a,
        num_cached_blocks=0,
        num_full_blocks=5,
        group_id=0,
    )
    p.free_blocks(a)  # queue 6 7 1 2 3 4 5
    p.hold_back([a[0]])
    p.begin()
    p.hold_back_first([a[2], a[1]])
    assert free_ids(p) == [6, 7, 4, 5, 3, 2, 1]
    assert p.free_queue.held_blocks() == [3, 2, 1]
    p.rollback()
    assert free_ids(p) == [6, 7, 2, 3, 4, 5, 1]
    p.hold_back_first([a[2], a[1]])
    assert p.get_new_blocks(6) == [6, 7, 4, 5, 3, 2]


def _cached_free_pool(num_blocks: int, num_cached: int) -> tuple[BlockPool, list[int]]:
    """A pool whose first ``num_cached`` blocks are cached and freed, in
    order, behind the never-used ones."""
    p = pool(num_blocks)
    a = p.get_new_blocks(num_cached)
    p.cache_full_blocks(
        block_hashes=[h(i) for i in range(1, num_cached + 1)],
        blocks=a,
        num_cached_blocks=0,
        num_full_blocks=num_cached,
        group_id=0,
    )
    p.free_blocks(a)
    return p, a


def test_held_back_blocks_are_at_most_half_the_free_blocks() -> None:
    """Past as many held-back blocks as other free blocks, those evicted
    first among them go to the back of the queue; a rollback puts every
    block back where it was, held back again."""
    p, a = _cached_free_pool(9, 6)  # queue 7 8 1 2 3 4 5 6
    p.hold_back(a[:2])
    assert p.free_queue.held_blocks() == [1, 2]
    p.begin()
    p.hold_back(a[2:5])  # 5 held of 8 free: 1 spills
    assert p.free_queue.held_blocks() == [2, 3, 4, 5]
    assert free_ids(p) == [7, 8, 6, 1, 2, 3, 4, 5]
    p.hold_back_first([a[5]])  # 6 in front of the held: it spills first
    assert p.free_queue.held_blocks() == [2, 3, 4, 5]
    assert free_ids(p) == [7, 8, 1, 6, 2, 3, 4, 5]
    p.rollback()
    assert p.free_queue.held_blocks() == [1, 2]
    assert free_ids(p) == [7, 8, 3, 4, 5, 6, 1, 2]
    p.hold_back(a[2:4])  # 4 held of 8 free: none spills
    assert p.free_queue.held_blocks() == [1, 2, 3, 4]


def test_blocks_leaving_the_held_back_ones_count_no_more() -> None:
    """A held-back block revived by a hit or handed out stops counting as
    held back (so the cap makes room for others); a rolled-back hit holds
    it back again."""
    p, a = _cached_free_pool(9, 6)  # queue 7 8 1 2 3 4 5 6
    p.hold_back(a[:4])  # 1 2 3 4 held of 8
    p.begin()
    p.touch([a[0]])  # a hit revives 1
    assert p.free_queue.held_blocks() == [2, 3, 4]
    p.rollback()
    assert p.free_queue.held_blocks() == [1, 2, 3, 4]
    p.touch([a[0], a[1]])  # queue 7 8 5 6, held 3 4
    p.hold_back(a[4:5])  # 3 held, 3 others: none spills
    assert free_ids(p) == [7, 8, 6, 3, 4, 5]
    taken = p.get_new_blocks(5)  # on into the held-back blocks
    assert taken == [7, 8, 6, 3, 4]
    assert p.free_queue.held_blocks() == [5]
    assert p.free_queue.held == {a[4]}
    p.free_blocks(a[:2])  # 1 2 cached: to the back of the queue
    p.hold_back(a[:1])  # 2 held, 1 other: 5 spills
    assert p.free_queue.held_blocks() == [1]
    assert free_ids(p) == [2, 5, 1]


def test_free_mixed_blocks_split_front_and_back() -> None:
    p = pool(8)
    a = p.get_new_blocks(4)  # 1 2 3 4; queue 5 6 7
    p.cache_full_blocks(
        block_hashes=[h(1), h(2)],
        blocks=a,
        num_cached_blocks=0,
        num_full_blocks=2,
        group_id=0,
    )
    p.free_blocks(a[::-1])  # 4(unhashed) 3(unhashed) 2(hashed) 1(hashed)
    assert free_ids(p) == [4, 3, 5, 6, 7, 2, 1]


def test_free_without_caching_appends_everything() -> None:
    p = pool(6, caching=False)
    a = p.get_new_blocks(3)
    p.free_blocks(a[::-1])
    assert free_ids(p) == [4, 5, 3, 2, 1]
    b = p.get_new_blocks(1)
    p.free_blocks(b)
    assert free_ids(p) == [5, 3, 2, 1, 4]


def test_shared_block_is_freed_only_at_ref_0() -> None:
    p = pool(5)
    (b,) = p.get_new_blocks(1)
    p.touch([b])
    assert p.ref_cnt[b] == 2
    p.free_blocks([b])
    assert p.ref_cnt[b] == 1
    assert 1 not in free_ids(p)
    p.free_blocks([b])
    assert p.ref_cnt[b] == 0
    assert free_ids(p)[0] == 1


def test_double_free_raises_and_changes_nothing() -> None:
    p = pool(6)
    a = p.get_new_blocks(3)
    p.free_blocks([a[0]])
    before = free_ids(p)
    with pytest.raises(InvalidRequestError, match="block 1 freed more often"):
        p.free_blocks([a[0]])
    # In a longer list, the blocks before the bad one are restored.
    with pytest.raises(InvalidRequestError, match="block 1"):
        p.free_blocks([a[2], a[1], a[0]])
    assert [p.ref_cnt[b] for b in a] == [0, 1, 1]
    assert free_ids(p) == before
    # The same block twice in one call with a single reference.
    with pytest.raises(InvalidRequestError, match="block 2"):
        p.free_blocks([a[1], a[1]])
    assert p.ref_cnt[a[1]] == 1
    assert free_ids(p) == before


def test_block_listed_twice_with_two_references() -> None:
    p = pool(4)
    (b,) = p.get_new_blocks(1)
    p.touch([b])
    p.free_blocks([b, b])
    assert p.ref_cnt[b] == 0
    assert free_ids(p) == [1, 2, 3]  # queued once


def test_null_block_is_never_freed_or_counted() -> None:
    p = pool(4)
    a = p.get_new_blocks(1)
    p.free_blocks([p.null_block, *a, p.null_block])
    p.free_blocks([p.null_block])
    assert 0 not in free_ids(p)
    assert p.get_num_free_blocks() == 3
    p.touch([p.null_block, p.null_block])
    assert p.ref_cnt[p.null_block] == 0


def test_free_table_frees_tail_first_and_leaves_the_list_alone() -> None:
    p = pool(8)
    a = p.get_new_blocks(4)  # 1 2 3 4; queue 5 6 7
    p.cache_full_blocks(
        block_hashes=[h(1), h(2)],
        blocks=a,
        num_cached_blocks=0,
        num_full_blocks=2,
        group_id=0,
    )
    p.touch([a[1]])  # block 2 is shared: it stays in use
    table = [a[0], p.null_block, *a[1:]]
    snapshot = list(table)
    p.free_table(table)
    assert table == snapshot
    assert free_ids(p) == [4, 3, 5, 6, 7, 1]
    assert [p.ref_cnt[b] for b in a] == [0, 1, 0, 0]
    assert p.get_num_free_blocks() == 6


def test_free_table_double_free_restores_what_it_dropped() -> None:
    p = pool(8)
    bad, shared, fresh = p.get_new_blocks(3)  # 1 2 3
    p.touch([shared])
    p.free_blocks([bad])
    before = free_ids(p)
    # Tail first: 3 is freed and 2 dropped to 1 before 1 fails.
    with pytest.raises(InvalidRequestError, match="block 1 freed more often"):
        p.free_table([bad, shared, fresh])
    assert [p.ref_cnt[b] for b in (bad, shared, fresh)] == [0, 2, 1]
    assert free_ids(p) == before
    assert p.get_num_free_blocks() == len(before)
    queue = p.free_queue
    forward = queue.get_all_free_blocks()
    assert queue.prev[fresh] == UNLINKED
    assert queue.next[fresh] == UNLINKED
    for x, y in pairwise(forward):
        assert queue.prev[y] == x


def _free_model(
    refs: dict[int, int],
    keyed: set[int],
    queue: list[int],
    order: list[int],
    *,
    caching: bool,
    table: bool = False,
) -> tuple[dict[int, int], list[int]] | None:
    """What freeing ``order`` (block ids, 0 the null block) should do: the
    new counts and queue, or None for a double free (nothing changes).
    ``table``: ``free_table``, which queues the blocks reaching 0 in the
    reverse of the order they reach it."""
    refs = dict(refs)
    front: list[int] = []
    back: list[int] = []
    for i in order:
        if i == 0:
            continue
        if refs[i] == 0:
            return None
        refs[i] -= 1
        if refs[i] == 0:
            (front if caching and i not in keyed else back).append(i)
    if table:
        front.reverse()
        back.reverse()
    return refs, front + queue + back


@settings(max_examples=300, deadline=None)
@given(
    refs=st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=8),
    keyed=st.sets(st.integers(min_value=1, max_value=8)),
    table=st.lists(st.integers(min_value=0, max_value=8), max_size=12),
    caching=st.booleans(),
    call=st.sampled_from(["free_table", "free_blocks"]),
    transaction=st.sampled_from(["none", "commit", "rollback"]),
)
def test_free_matches_a_model(
    refs: list[int],
    keyed: set[int],
    table: list[int],
    caching: bool,
    call: str,
    transaction: str,
) -> None:
    n = len(refs)
    p = pool(n + 4, caching=caching)
    blocks = p.get_new_blocks(n)
    assert blocks == list(range(1, n + 1))  # table entries name them by id
    for b in blocks:
        if b in keyed:
            p.cache_full_blocks(
                block_hashes=[h(b)],
                blocks=[b],
                num_cached_blocks=0,
                num_full_blocks=1,
                group_id=0,
            )
    for b, r in zip(blocks, refs, strict=True):
        p.touch([b] * r)
        p.free_blocks([b])
    table = [i for i in table if i <= n]
    given_list = list(table)
    snapshot = list(given_list)
    before_refs = {b: p.ref_cnt[b] for b in blocks}
    before_queue = free_ids(p)
    expect = _free_model(
        before_refs,
        {b for b in blocks if p.key_hash[b] is not None},
        before_queue,
        table,
        caching=caching,
        table=call == "free_table",
    )
    if call == "free_table" and len(set(table) - {0}) == len(table) - table.count(0):
        # A table listing each block once: free_blocks of it reversed.
        assert expect == _free_model(
            before_refs,
            {b for b in blocks if p.key_hash[b] is not None},
            before_queue,
            table[::-1],
            caching=caching,
        )
    if transaction != "none":
        p.begin()
    if expect is None:
        with pytest.raises(InvalidRequestError, match="freed more often"):
            getattr(p, call)(given_list)
        expect = before_refs, before_queue
    else:
        getattr(p, call)(given_list)
    if transaction == "rollback":
        p.rollback()
        expect = before_refs, before_queue
    elif transaction == "commit":
        p.commit()
    assert given_list == snapshot
    assert {b: p.ref_cnt[b] for b in blocks} == expect[0]
    assert free_ids(p) == expect[1]
    assert p.get_num_free_blocks() == len(expect[1])
    assert p.ref_cnt[p.null_block] == 0
    assert_free_links_agree(p.free_queue, p.num_blocks)
    for b in blocks:
        if p.ref_cnt[b]:
            assert unlinked(p.free_queue, b)


# -- touch and the prefix cache -----------------------------------------------------


def test_touch_revives_free_cached_blocks() -> None:
    p = pool(6)
    a = p.get_new_blocks(2)  # 1 2
    p.cache_full_blocks(
        block_hashes=[h(1), h(2)],
        blocks=a,
        num_cached_blocks=0,
        num_full_blocks=2,
        group_id=0,
    )
    p.free_blocks(a[::-1])
    assert free_ids(p) == [3, 4, 5, 2, 1]
    hit = p.get_cached_block(h(1), [0])
    assert hit == [a[0]]
    p.touch(hit)
    assert p.ref_cnt[a[0]] == 1
    assert free_ids(p) == [3, 4, 5, 2]
    assert p.block(a[0]).block_hash == (h(1), 0)  # still cached while in use
    p.touch(hit)
    assert p.ref_cnt[a[0]] == 2


def test_cached_lookup_needs_every_group() -> None:
    p = pool(8)
    a = p.get_new_blocks(2)
    b = p.get_new_blocks(2)
    p.cache_full_blocks(
        block_hashes=[h(1), h(2)],
        blocks=a,
        num_cached_blocks=0,
        num_full_blocks=2,
        group_id=0,
    )
    p.cache_full_blocks(
        block_hashes=[h(1), h(2)],
        blocks=b,
        num_cached_blocks=0,
        num_full_blocks=1,
        group_id=1,
    )
    assert p.get_cached_block(h(1), [0, 1]) == [a[0], b[0]]
    assert p.get_cached_block(h(2), [0]) == [a[1]]
    assert p.get_cached_block(h(2), [0, 1]) is None  # group 1 only cached block 0
    assert p.get_cached_block(h(9), [0]) is None
    assert p.get_cached_block(h(1), []) == []
    assert p.block(b[1]).block_hash is None
    assert p.lookup(h(1), 1) == b[0]
    assert p.lookup(h(2), 0) == a[1]
    assert p.lookup(h(2), 1) is None


def test_cache_full_blocks_range_and_skips() -> None:
    p = pool(8)
    a = p.get_new_blocks(4)
    blocks = [p.null_block, *a]  # a table that starts with a skipped position
    hashes = [h(0), h(1), h(2), h(3), h(4)]
    p.cache_full_blocks(
        block_hashes=hashes,
        blocks=blocks,
        num_cached_blocks=0,
        num_full_blocks=2,
        group_id=3,
    )
    assert p.block(p.null_block).block_hash is None
    assert p.block(a[0]).block_hash == (h(1), 3)
    assert p.block(a[1]).block_hash is None  # outside [0, 2)
    # Already-cached blocks are left alone; the range continues.
    p.cache_full_blocks(
        block_hashes=hashes,
        blocks=blocks,
        num_cached_blocks=1,
        num_full_blocks=4,
        group_id=3,
    )
    assert [p.block(b).block_hash for b in a] == [
        (h(1), 3),
        (h(2), 3),
        (h(3), 3),
        None,
    ]
    assert p.num_cached_blocks == 3


@pytest.mark.parametrize(
    ("cached", "full", "n_hashes", "match"),
    [
        (2, 1, 4, "num_cached_blocks"),
        (0, 5, 5, "number of blocks"),
        (-1, 1, 4, "num_cached_blocks"),
        (0, 3, 2, "only 2 block hashes"),
    ],
    ids=["cached-after-full", "past-blocks", "negative", "missing-hashes"],
)
def test_cache_full_blocks_rejects_bad_ranges(
    cached: int, full: int, n_hashes: int, match: str
) -> None:
    p = pool(8)
    a = p.get_new_blocks(4)
    with pytest.raises(InvalidRequestError, match=match):
        p.cache_full_blocks(
            block_hashes=[h(i) for i in range(n_hashes)],
            blocks=a,
            num_cached_blocks=cached,
            num_full_blocks=full,
            group_id=0,
        )
    assert all(p.key_hash[b] is None for b in a)


def test_cache_full_blocks_does_nothing_without_caching() -> None:
    p = pool(4, caching=False)
    a = p.get_new_blocks(2)
    p.cache_full_blocks(
        block_hashes=[h(1), h(2)],
        blocks=a,
        num_cached_blocks=0,
        num_full_blocks=2,
        group_id=0,
    )
    assert p.block(a[0]).block_hash is None
    assert p.get_cached_block(h(1), [0]) is None


def test_reusing_a_cached_block_evicts_its_hash() -> None:
    p = pool(3)  # usable: 1 2
    a = p.get_new_blocks(2)
    p.cache_full_blocks(
        block_hashes=[h(1), h(2)],
        blocks=a,
        num_cached_blocks=0,
        num_full_blocks=2,
        group_id=0,
    )
    p.free_blocks(a[::-1])  # queue: 2 1
    (reused,) = p.get_new_blocks(1)
    assert reused == a[1]
    assert p.block(reused).block_hash is None
    assert p.ref_cnt[reused] == 1
    assert p.get_cached_block(h(2), [0]) is None
    assert p.get_cached_block(h(1), [0]) == [a[0]]


def test_duplicate_keys_are_all_kept() -> None:
    p = pool(6)
    a = p.get_new_blocks(1)
    b = p.get_new_blocks(1)
    c = p.get_new_blocks(1)
    for blocks in (a, b, c):
        p.cache_full_blocks(
            block_hashes=[h(7)],
            blocks=blocks,
            num_cached_blocks=0,
            num_full_blocks=1,
            group_id=0,
        )
    assert p.num_cached_blocks == 3
    assert p.get_cached_block(h(7), [0]) in ([a[0]], [b[0]], [c[0]])
    assert p.lookup(h(7), 0) in (a[0], b[0], c[0])
    # Evict two of them: the third still hits.
    p.free_blocks(a + b)
    p.get_new_blocks(4)  # 4 5, then a (block 1), then b (block 2)
    assert p.block(a[0]).block_hash is None
    assert p.block(b[0]).block_hash is None
    assert p.get_cached_block(h(7), [0]) == [c[0]]
    assert p.lookup(h(7), 0) == c[0]
    p.free_blocks(c)
    p.get_new_blocks(1)
    assert p.get_cached_block(h(7), [0]) is None
    assert p.num_cached_blocks == 0


def test_cached_counts_follow_stores_evictions_rollbacks_and_resets() -> None:
    p = pool(8)  # usable: 1-7
    a = p.get_new_blocks(3)
    for group, blocks in ((0, a[:2]), (1, a[2:])):
        p.cache_full_blocks(
            block_hashes=[h(1), h(1)],  # group 0: one key held twice
            blocks=blocks,
            num_cached_blocks=0,
            num_full_blocks=len(blocks),
            group_id=group,
        )
    assert (p.num_cached_blocks_of(0), p.num_cached_blocks_of(1)) == (2, 1)
    assert p.num_cached_blocks_of(5) == 0
    p.free_blocks(a)  # queue: 4 5 6 7 1 2 3
    order = free_ids(p)
    p.begin()
    p.get_new_blocks(6)  # evicts block 1 and 2 (group 0)
    b = p.get_new_blocks(1)  # block 3 (group 1)
    p.cache_full_blocks(
        block_hashes=[h(9)],
        blocks=b,
        num_cached_blocks=0,
        num_full_blocks=1,
        group_id=2,
    )
    assert [p.num_cached_blocks_of(g) for g in range(3)] == [0, 0, 1]
    p.rollback()
    assert [p.num_cached_blocks_of(g) for g in range(3)] == [2, 1, 0]
    assert p.num_cached_blocks == 3
    assert free_ids(p) == order
    assert p.get_cached_block(h(1), [0, 1]) is not None
    assert p.reset_prefix_cache()
    assert [p.num_cached_blocks_of(g) for g in range(3)] == [0, 0, 0]


def test_reset_prefix_cache_only_when_idle() -> None:
    p = pool(5, events=True)
    a = p.get_new_blocks(2)
    p.cache_full_blocks(
        block_hashes=[h(1), h(2)],
        blocks=a,
        num_cached_blocks=0,
        num_full_blocks=2,
        group_id=0,
        token_ids=range(8),
    )
    p.take_events()
    assert p.reset_prefix_cache() is False
    assert p.block(a[0]).block_hash == (h(1), 0)
    assert p.take_events() == []
    p.free_blocks(a[::-1])
    assert p.reset_prefix_cache() is True
    assert all(b.block_hash is None for b in p.blocks)
    assert p.get_cached_block(h(1), [0]) is None
    assert p.take_events() == [AllBlocksCleared()]
    assert p.get_num_free_blocks() == 4


# -- events -----------------------------------------------------------------------


def test_events_record_store_and_remove() -> None:
    p = pool(4, events=True)
    a = p.get_new_blocks(3)  # 1 2 3
    tokens = list(range(100, 112))
    p.cache_full_blocks(
        block_hashes=[h(1), h(2)],
        blocks=a,
        num_cached_blocks=0,
        num_full_blocks=2,
        group_id=5,
        token_ids=tokens[:8],
    )
    p.cache_full_blocks(
        block_hashes=[h(1), h(2), h(3)],
        blocks=a,
        num_cached_blocks=2,
        num_full_blocks=3,
        group_id=5,
        token_ids=tokens,
    )
    window = {"block_size": 4, "kind": "sliding_window", "sliding_window": 8}
    assert p.take_events() == [
        BlockStored(
            block_hashes=(h(1), h(2)),
            parent_block_hash=None,
            token_ids=tuple(range(100, 108)),
            group_id=5,
            block_ids=(1, 2),
            **window,
        ),
        BlockStored(
            block_hashes=(h(3),),
            parent_block_hash=h(2),
            token_ids=(108, 109, 110, 111),
            group_id=5,
            block_ids=(3,),
            **window,
        ),
    ]
    assert p.take_events() == []
    p.free_blocks(a[::-1])  # queue: 3 2 1
    p.get_new_blocks(2)
    assert p.take_events() == [
        BlockRemoved(block_hashes=(h(3),), group_id=5),
        BlockRemoved(block_hashes=(h(2),), group_id=5),
    ]


def test_events_are_off_by_default() -> None:
    p = pool(4)
    a = p.get_new_blocks(2)
    p.cache_full_blocks(
        block_hashes=[h(1), h(2)],
        blocks=a,
        num_cached_blocks=0,
        num_full_blocks=2,
        group_id=0,
    )
    p.free_blocks(a)
    p.get_new_blocks(3)
    p.reset_prefix_cache()
    assert p.take_events() == []


def test_events_are_frozen() -> None:
    event = BlockRemoved(block_hashes=(h(1),), group_id=0)
    with pytest.raises(AttributeError):
        event.group_id = 1  # type: ignore[misc]


def test_a_pool_whose_block_state_would_not_fit_in_host_memory_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Checked before the per-block state is built: 2**20 blocks at
    BLOCK_STATE_BYTES each against 64 MiB available."""
    import kvcore.coordinator.block_pool as block_pool
    import kvcore.coordinator.pool_checks as pool_checks
    from kvcore.errors import KvcoreValueError
    from kvcore.limits import BLOCK_STATE_BYTES

    monkeypatch.setattr(pool_checks, "available_memory_bytes", lambda: 64 * 2**20)
    with pytest.raises(KvcoreValueError) as info:
        block_pool.BlockPool(2**20, enable_caching=True, hash_block_size=16)
    assert str(info.value).startswith(
        f"num_blocks is 1,048,576: their coordinator state takes about "
        f"{2**20 * BLOCK_STATE_BYTES / 2**30:.1f} GiB of host memory"
    )
    assert "0.1 GiB is available" in str(info.value)
    # The same count fits when the memory is there.
    monkeypatch.setattr(pool_checks, "available_memory_bytes", lambda: 2**40)
    assert (
        block_pool.BlockPool(1000, enable_caching=True, hash_block_size=16).num_blocks
        == 1000
    )


@pytest.mark.parametrize("transaction", [False, True])
def test_free_table_takes_any_iterable(transaction: bool) -> None:
    """A table given as an iterator is walked once, as a list would be."""
    results = []
    for as_iterator in (False, True):
        p = pool(8)
        table = p.get_new_blocks(4)
        if transaction:
            p.begin()
        p.free_table(iter(table) if as_iterator else table)
        if transaction:
            p.commit()
        results.append((free_ids(p), [p.ref_cnt[b] for b in table]))
        assert p.get_num_free_blocks() == 7
    assert results[0] == results[1]


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_long_free_queue_copies_as_its_order(how: str) -> None:
    """A queue of 50,000 blocks copies as its order: the copy holds the same
    blocks in the same order, linked among themselves in link lists of its
    own, and the original is untouched."""
    import copy
    import pickle

    queue, blocks = make_queue(50_000)
    taken = queue.popleft_n(3)
    queue.remove(blocks[100])
    queue.append(taken[1])
    clone = (
        copy.deepcopy(queue) if how == "deepcopy" else pickle.loads(pickle.dumps(queue))
    )
    order = queue.get_all_free_blocks()
    copied = clone.get_all_free_blocks()
    assert copied == order
    assert len(clone) == len(queue) == 49_997
    assert clone.prev is not queue.prev
    assert clone.next is not queue.next
    assert clone.held is not queue.held
    assert all(clone.next[a] == b and clone.prev[b] == a for a, b in pairwise(copied))
    assert_free_links_agree(clone, 50_000)
    # Each side runs on its own.
    assert clone.popleft() == queue.popleft() == 3
    assert len(clone) == len(queue) == 49_996
    assert queue.get_all_free_blocks() == clone.get_all_free_blocks() == order[1:]


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_pool_keeps_every_block_state(how: str) -> None:
    """A pool's copy keeps each block's state (reference count, full key and
    its group, partial keys); a block in use stays outside the copy's queue,
    and the copy's block views read the copy."""
    import copy
    import pickle

    p = pool(8)
    a = p.get_new_blocks(5)  # 1 2 3 4 5
    p.touch([a[4]])  # block 5: two references
    p.cache_full_blocks(
        block_hashes=[h(i) for i in range(1, 6)],
        blocks=a,
        num_cached_blocks=0,
        num_full_blocks=5,
        group_id=3,
    )
    p.add_partial_key(a[4], h(9), 3)
    p.free_blocks(a[:4])
    view = p.block(5)
    assert not unlinked(p.free_queue, 1)
    clone = copy.deepcopy(p) if how == "deepcopy" else pickle.loads(pickle.dumps(p))
    copied = clone.block(5)
    assert copied is not view
    assert (copied.block_id, copied.ref_cnt, copied.block_hash) == (5, 2, (h(5), 3))
    assert clone.partial_keys[5] == [h(9)]
    assert clone.partial_group == {5: 3}
    assert clone.lookup(h(5), 3) == 5
    assert clone.lookup_partial(h(9), [3]) == [5]
    assert unlinked(clone.free_queue, 5)
    assert free_ids(clone) == free_ids(p) == [6, 7, 1, 2, 3, 4]
    assert_free_links_agree(clone.free_queue, clone.num_blocks)
    # The copy changes alone.
    clone.free_blocks([5])
    assert (copied.ref_cnt, view.ref_cnt, p.ref_cnt[5]) == (1, 2, 2)


def test_reset_prefix_cache_releases_the_held_back_blocks() -> None:
    """After a reset no request runs and no block has a key: the held-back
    blocks join the queue's back in the order they had, so the eviction
    order is unchanged and nothing is held back."""
    p, a = _cached_free_pool(10, 4)
    p.hold_back(a[:2])
    order = free_ids(p)
    assert p.free_queue.held_blocks() == [1, 2]
    assert p.reset_prefix_cache()
    assert free_ids(p) == order
    assert p.free_queue.held == set()
    assert p.free_queue.held_blocks() == []
    assert p.get_num_free_blocks() == 9
    assert p.get_new_blocks(9) == order


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_pool_inside_a_transaction_refuses_to_be_copied(how: str) -> None:
    """A copy taken inside a step could not roll back (its undo records
    point at the original's queue links): copying is refused, naming the
    fix, and the step goes on untouched; between steps the copy works."""
    import copy
    import pickle

    p, _ = _cached_free_pool(10, 4)
    p.begin()
    taken = p.get_new_blocks(3)
    with pytest.raises(ReentrantCallError, match="between steps"):
        copy.copy(p)
    take = {
        "deepcopy": copy.deepcopy,
        "pickle": lambda x: pickle.loads(pickle.dumps(x)),
    }[how]
    with pytest.raises(ReentrantCallError, match="between steps"):
        take(p)
    p.rollback()
    assert all(p.ref_cnt[b] == 0 for b in taken)
    assert free_ids(p) == [5, 6, 7, 8, 9, 1, 2, 3, 4]
    clone = take(p)
    assert free_ids(clone) == free_ids(p)
    assert clone.get_new_blocks(2) == [5, 6]
    assert free_ids(p) == [5, 6, 7, 8, 9, 1, 2, 3, 4]


def test_a_rolled_back_partial_drop_restores_the_keys_group() -> None:
    """Handing out a block drops its partial keys; rolling the hand-out back
    gives them back under the group they had, so the block still answers
    for them and takes more keys of that group."""
    p = BlockPool(2, enable_caching=True, hash_block_size=16)
    (b,) = p.get_new_blocks(1)
    p.add_partial_key(b, h(1), 0)
    p.free_blocks([b])
    p.begin()
    assert p.get_new_blocks(1) == [b]
    p.add_partial_key(b, h(2), 1)
    p.rollback()
    assert p.has_partial_key(b, h(1), 0)
    assert not p.has_partial_key(b, h(2), 1)
    assert p.lookup_partial(h(1), [0]) == [b]
    assert p.lookup_partial(h(2), [1]) is None
    p.add_partial_key(b, h(3), 0)
    assert p.partial_keys[b] == [h(1), h(3)]
    assert p.partial_group == {b: 0}


def test_a_rolled_back_partial_drop_keeps_the_order_of_a_shared_key() -> None:
    """Three blocks hold one partial key; a hand-out that drops the first
    two is rolled back: the key's blocks are in their order again, so a
    lookup answers the block it answered before."""
    p = BlockPool(5, enable_caching=True, hash_block_size=16)
    blocks = p.get_new_blocks(3)
    for block in blocks:
        p.add_partial_key(block, h(1), 0)
    p.free_blocks(blocks)  # queue: 4, then 1 2 3 (keyed, at the back)
    before = p.lookup_partial(h(1), [0])
    assert before == [blocks[0]]
    p.begin()
    p.get_new_blocks(3)  # 4, 1, 2: drops the key of 1 and 2
    assert p.lookup_partial(h(1), [0]) == [blocks[2]]
    p.rollback()
    assert p.lookup_partial(h(1), [0]) == before
    p.get_new_blocks(2)  # 4, 1: block 2 now answers first, as before
    assert p.lookup_partial(h(1), [0]) == [blocks[1]]


def test_drop_from_cache_n_takes_any_iterable() -> None:
    p = _cached_pool([(1, 0), (2, 0)], [False, False])
    p.drop_from_cache_n(iter([1, 2]))
    assert p.key_hash[1] is None
    assert p.key_hash[2] is None
    assert p.eviction_order()[:2] == [2, 1]


def test_block_state_fits_its_budget() -> None:
    """A pool's per-block state (ids, counts, keys, links) stays within
    BLOCK_STATE_BYTES a block, the figure host-memory checks use; block
    views cost nothing until an engine asks for one."""
    import tracemalloc

    from kvcore.limits import BLOCK_STATE_BYTES

    n = 200_000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        p = BlockPool(n, enable_caching=True, hash_block_size=16)
        built = tracemalloc.get_traced_memory()[0] - before
        blocks = p.get_new_blocks(n - 1)
        p.free_table(blocks)
        del blocks
        cycled = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert built / n <= BLOCK_STATE_BYTES
    assert cycled / n <= BLOCK_STATE_BYTES
    assert p.block(5) is p.block(5)
    assert p.block(5).ref_cnt == 0


@pytest.mark.parametrize(
    ("bad", "error"),
    [(True, KvcoreTypeError), (2.0, KvcoreTypeError), (-1, KvcoreValueError),
     (8, KvcoreValueError), ("3", KvcoreTypeError)],
)  # fmt: skip
def test_touch_refuses_what_is_not_a_block_id(bad: object, error: type) -> None:
    """A hit's ids cross from a manager into the pool at touch: a bool, a
    float, a negative or out-of-range id is refused there, naming it, and
    nothing changes (a negative int would otherwise index from the end)."""
    p = BlockPool(8, enable_caching=True, hash_block_size=16)
    a = p.get_new_blocks(2)
    p.free_blocks(a)
    before = (list(p.ref_cnt), p.free_queue.get_all_free_blocks())
    with pytest.raises(error, match=r"touch: .* is not a block id of this pool"):
        p.touch([a[0], bad])  # type: ignore[list-item]
    assert (list(p.ref_cnt), p.free_queue.get_all_free_blocks()) == before
    with pytest.raises(error, match="moving free blocks"):
        p.hold_back([bad])  # type: ignore[list-item]


def _pool_state(p: BlockPool) -> tuple[object, ...]:
    """What a drop may change and a rollback puts back: counts, keys and
    order (the eviction counter only grows: a rollback keeps it)."""
    return (
        list(p.ref_cnt),
        list(p.key_hash),
        list(p.key_group),
        p.eviction_order(),
        [p.num_cached_blocks_of(g) for g in range(3)],
        [p.get_cached_block(h(k), [g]) for k in range(4) for g in range(3)],
    )


def _cached_pool(keys: list[tuple[int, int]], held: list[bool]) -> BlockPool:
    """A pool of 12 whose blocks 1..len(keys) hold ``keys`` ((key, group)
    each; keys repeat, so a cache entry may list several blocks), the
    blocks not ``held`` freed, in id order."""
    p = pool(12, events=True)
    blocks = p.get_new_blocks(len(keys))
    for block, (key, group) in zip(blocks, keys, strict=True):
        p.cache_full_blocks(
            block_hashes=[h(key)],
            blocks=[block],
            num_cached_blocks=0,
            num_full_blocks=1,
            group_id=group,
            token_ids=range(4),
        )
    p.free_blocks([b for b, keep in zip(blocks, held, strict=True) if not keep])
    p.take_events()
    return p


@settings(max_examples=300, deadline=None)
@given(
    keys=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 2)), min_size=1, max_size=11
    ),
    held=st.lists(st.booleans(), min_size=11, max_size=11),
    dropped=st.lists(st.integers(0, 11), max_size=14),
    taken=st.integers(0, 11),
)
def test_dropping_and_evicting_in_batches_match_one_block_at_a_time(
    keys: list[tuple[int, int]], held: list[bool], dropped: list[int], taken: int
) -> None:
    """``drop_from_cache_n`` leaves the pool, the keys, the eviction order
    and the events exactly as ``drop_from_cache`` of each block in turn
    (null, unkeyed and repeated ids included); a hand-out evicting several
    keys in one walk emits one ``BlockRemoved`` per key, in order; and a
    rollback of either puts everything back, entries shared by several
    blocks included."""
    held = held[: len(keys)]
    one, batch, kept = (_cached_pool(keys, held) for _ in range(3))
    before = _pool_state(batch)
    for block in dropped:
        one.drop_from_cache(block)
    batch.begin()
    batch.drop_from_cache_n(dropped)
    assert _pool_state(batch) == _pool_state(one)
    assert batch.evictions == one.evictions
    batch.rollback()
    assert _pool_state(batch) == before
    # Events are taken between steps: those of a batch kept.
    kept.drop_from_cache_n(dropped)
    assert kept.take_events() == one.take_events()
    # A hand-out walks the queue front first and evicts as it goes.
    taken = min(taken, batch.get_num_free_blocks())
    order = batch.eviction_order()[:taken]
    expected = [
        BlockRemoved(block_hashes=(key,), group_id=gid)
        for block in order
        if (key := batch.key_hash[block]) is not None
        for gid in (batch.key_group[block],)
    ]
    evictions = batch.evictions
    batch.begin()
    assert batch.get_new_blocks(taken) == order
    assert batch.evictions == evictions + len(expected)
    batch.rollback()
    assert _pool_state(batch) == before
    # The rolled-back hand-out's events are gone; a kept one's are taken.
    assert batch.get_new_blocks(taken) == order
    assert batch.take_events() == expected


@pytest.mark.parametrize(
    ("bad", "error"),
    [(True, KvcoreTypeError), (-1, KvcoreValueError), (12, KvcoreValueError),
     ("3", KvcoreTypeError)],
)  # fmt: skip
def test_drop_from_cache_refuses_what_is_not_a_block_id(
    bad: object, error: type
) -> None:
    """An id the engine names for eviction is checked before any key is
    dropped: a negative id would otherwise drop the last block's key."""
    p = _cached_pool([(1, 0), (2, 0), (3, 1)], [False, True, False])
    before = _pool_state(p)
    with pytest.raises(error, match=r"drop_from_cache: .* is not a block id"):
        p.drop_from_cache_n([1, bad])  # type: ignore[list-item]
    assert _pool_state(p) == before
    assert p.take_events() == []


def test_hashes_in_a_sequence_without_slices_still_key_blocks() -> None:
    """A store slices its span's hashes once; a Sequence that takes no
    slice (a deque) is read position by position instead, directly or
    through a view of coarser blocks."""
    from collections import deque

    from kvcore.coordinator.hashing import BlockHashView

    p = pool(10)
    blocks = p.get_new_blocks(3)
    p.cache_full_blocks(
        block_hashes=deque([h(1), h(2), h(3)]),
        blocks=blocks,
        num_cached_blocks=1,
        num_full_blocks=3,
        group_id=0,
    )
    assert [p.key_hash[b] for b in blocks] == [None, h(2), h(3)]
    assert BlockHashView(deque([h(i) for i in range(6)]), 2)[0:2] == [h(1), h(3)]
