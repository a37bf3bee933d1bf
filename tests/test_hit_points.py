"""A hit point's blocks in every group leave the cache together.

A hit at ``n`` tokens on a hybrid needs the attention prefix and, from
every other group, the blocks a hit there reads (a sliding window's last
blocks before ``n``).  A running request holds its attention prefix; the
window blocks it releases as its window moves on are held back (evicted
only after every other free block) until it is freed, and then join the
eviction order beside the attention blocks at their positions.
"""

from __future__ import annotations

from coordinator_setup import fa, small_manager, small_request, sw

from kvcore.coordinator import KVCacheBlock, KVCacheManager, Request

PROMPT = list(range(100, 116))  # 16 tokens: 4 blocks of 4


def _window_hybrid(num_blocks: int) -> KVCacheManager:
    """Full attention (group 0) beside an 8-token sliding window (group 1),
    4-token blocks."""
    return small_manager([fa(4), sw(4, 8)], num_blocks)


def _run_prompt_and_decode(mgr: KVCacheManager, req: Request, decodes: int) -> None:
    assert mgr.allocate_slots(req, req.num_tokens) is not None
    req.num_computed_tokens = req.num_tokens
    for i in range(decodes):
        req.append_output_token_ids(900 + i)
        assert mgr.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1


def _fill(mgr: KVCacheManager, leave: int) -> list[Request]:
    """Admit one-block requests of fresh tokens until ``leave`` blocks are free."""
    fillers = []
    while mgr.get_num_free_blocks() > leave:
        req = small_request(
            f"fill{len(fillers)}", [5000 + 4 * len(fillers) + i for i in range(3)]
        )
        assert mgr.allocate_slots(req, 3) is not None
        fillers.append(req)
    return fillers


def _free_order(mgr: KVCacheManager) -> list[KVCacheBlock]:
    return mgr.block_pool.free_queue.get_all_free_blocks()


def test_a_running_requests_released_window_blocks_outlive_other_free_blocks() -> None:
    """A decodes 8 tokens past its 16-token prompt: its window blocks at
    positions 0-3 are released (the window now starts at token 17).  They
    are the last free blocks to go, so once the pool has handed out every
    other free block, a repeat of A's prompt still hits at 16 tokens (A
    holds the attention prefix, the held-back blocks 2 and 3 complete it);
    one block more and the first held-back block goes."""
    mgr = _window_hybrid(41)
    a = small_request("a", PROMPT)
    _run_prompt_and_decode(mgr, a, 8)
    window = mgr.get_blocks("a").blocks[1]
    assert [b.is_null for b in window] == [True] * 4 + [False] * 2
    fillers = _fill(mgr, leave=4)
    held = _free_order(mgr)
    assert len(held) == 4
    assert all(b.key_hash is not None for b in held)
    b = small_request("b", [*PROMPT, 7])
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 16
    assert [blk.block_id for blk in blocks.blocks[1][2:]] == [
        blk.block_id for blk in held[-2:]
    ]
    # Once nothing else is free the pool hands out held-back blocks, the
    # lowest position first: the hit at 16 survives two more blocks.
    c = small_request("c", [7000, 7001, 7002])
    got = mgr.allocate_slots(c, 3)
    assert got is not None
    assert [blk.block_id for g in got.blocks for blk in g] == [
        blk.block_id for blk in held[:2]
    ]
    assert mgr.get_computed_blocks(b)[1] == 16
    del fillers


def test_a_freed_requests_blocks_leave_together_by_position() -> None:
    """Freed, A's blocks of both groups and the window blocks it held back
    join the back of the eviction order by position, the last first, full
    attention before the window at one position: a hit point's blocks in
    every group are evicted together."""
    mgr = _window_hybrid(64)
    a = small_request("a", PROMPT)
    _run_prompt_and_decode(mgr, a, 8)
    full, window = mgr.get_blocks("a").blocks
    held = mgr.block_pool.free_queue.held_blocks()
    assert len(held) == 4
    mgr.free(a)
    assert mgr.block_pool.free_queue.held_blocks() == []
    order = _free_order(mgr)
    # Full attention holds 6 blocks, the window positions 4 and 5, and
    # held back 0-3 (lowest position first).
    assert len(full) == 6
    expected = [full[5], window[5], full[4], window[4]]
    for pos in (3, 2, 1, 0):
        expected += [full[pos], held[pos]]
    assert order[-len(expected) :] == expected
