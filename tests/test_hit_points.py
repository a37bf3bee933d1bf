"""Released blocks that complete a running request's hit points are held back.

A hit at ``n`` tokens on a hybrid needs the attention prefix and, from
every other group, the blocks a hit there reads (a sliding window's last
blocks before ``n``).  A running request holds its attention prefix; the
window blocks of its hit points it releases as its window moves on are
held back (evicted only after every other free block) until it is freed,
and then rejoin its table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import pytest
from coordinator_setup import fa, small_manager, small_request, sw

from kvcore import KindRegistry
from kvcore.coordinator import KVCacheBlock, KVCacheManager, Request
from kvcore.errors import KvcoreError, PluginResultError
from kvcore_full_attention import FullAttention
from kvcore_sliding_window import SlidingWindow
from kvcore_sliding_window.manager import SlidingWindowManager

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
    positions 0-3 are released (the window now starts at token 17).  Those
    a hit at its prompt's end reads (12 and 16 tokens: positions 1-3) are
    held back, the last free blocks to go: once the pool has handed out
    every other free block, a repeat of A's prompt still hits at 16 tokens
    (A holds the attention prefix, blocks 2 and 3 complete it).  Then the
    held-back blocks go too, the lowest position first."""
    mgr = _window_hybrid(40)
    a = small_request("a", PROMPT)
    _run_prompt_and_decode(mgr, a, 8)
    window = mgr.get_blocks("a").blocks[1]
    assert [b.is_null for b in window] == [True] * 4 + [False] * 2
    fillers = _fill(mgr, leave=3)
    held = _free_order(mgr)
    assert held == mgr.block_pool.free_queue.held_blocks()
    assert len(held) == 3
    assert all(b.key_hash is not None for b in held)
    b = small_request("b", [*PROMPT, 7])
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 16
    assert [blk.block_id for blk in blocks.blocks[1][2:]] == [
        blk.block_id for blk in held[1:]
    ]
    # Once nothing else is free the pool hands out held-back blocks, the
    # lowest position first.
    c = small_request("c", [7000, 7001, 7002])
    got = mgr.allocate_slots(c, 3)
    assert got is not None
    assert [blk.block_id for g in got.blocks for blk in g] == [
        blk.block_id for blk in held[:2]
    ]
    assert mgr.get_computed_blocks(b)[1] == 0
    assert len(fillers) == 14


def test_a_freed_requests_held_back_blocks_rejoin_its_table() -> None:
    """Freed, A's window blocks it held back rejoin its window table at
    their positions: each group's blocks go to the back of the eviction
    order tail first, the groups in order, as if the window had never
    released them."""
    mgr = _window_hybrid(64)
    a = small_request("a", PROMPT)
    _run_prompt_and_decode(mgr, a, 8)
    full, window = mgr.get_blocks("a").blocks
    held = mgr.block_pool.free_queue.held_blocks()
    assert len(held) == 3
    mgr.free(a)
    assert mgr.block_pool.free_queue.held_blocks() == []
    # Full attention holds 6 blocks, the window positions 4 and 5, and
    # held back 1-3 (lowest position first); position 0 went to the
    # queue's back when the window left it.
    assert len(full) == 6
    expected = [*full[::-1], window[5], window[4], *held[::-1]]
    assert _free_order(mgr)[-len(expected) :] == expected


def test_a_one_group_plan_frees_tail_first_as_before() -> None:
    """Full attention alone: a freed request's blocks go to the back of the
    queue tail first and nothing is ever held back."""
    mgr = small_manager([fa(4)], 16)
    a = small_request("a", PROMPT)
    _run_prompt_and_decode(mgr, a, 4)
    (table,) = mgr.get_blocks("a").blocks
    mgr.free(a)
    assert mgr.block_pool.free_queue.held_blocks() == []
    assert _free_order(mgr)[-len(table) :] == table[::-1]


class _KeepsWrongly(SlidingWindowManager):
    """A third party's window manager whose ``kept_for_later`` answers
    wrongly, as its class attribute ``answer`` says."""

    answer: ClassVar[str] = "foreign"

    def kept_for_later(
        self,
        request_id: str,
        positions: Sequence[int],
        released: Sequence[KVCacheBlock],
    ) -> list[KVCacheBlock]:
        if self.answer == "foreign":
            return [*released, self.block_pool.blocks[-1]]
        if self.answer == "twice":
            return [*released, *released[:1]]
        return tuple(released)  # type: ignore[return-value]


class _KeepsTwice(_KeepsWrongly):
    answer = "twice"


class _KeepsATuple(_KeepsWrongly):
    answer = "tuple"


@pytest.mark.parametrize("manager", [_KeepsWrongly, _KeepsTwice, _KeepsATuple])
def test_kept_for_later_is_checked_where_it_enters_the_core(
    manager: type[SlidingWindowManager],
) -> None:
    """A manager that names a block it did not just release, names one
    twice or answers with no list is refused with an error naming it, and
    the step changes nothing."""

    class Window(SlidingWindow):
        manager_type = manager

    registry = KindRegistry.from_kinds([FullAttention(), Window()])
    mgr = small_manager([fa(4), sw(4, 8)], 40, registry=registry)
    a = small_request("a", PROMPT)
    assert mgr.allocate_slots(a, 16) is not None
    a.num_computed_tokens = 16
    # The first decode step moves the window past blocks 0 and 1: released,
    # they are offered to kept_for_later, whose answer is refused.
    a.append_output_token_ids(900)
    before = (mgr.get_num_free_blocks(), mgr.get_block_ids("a"))
    with pytest.raises(PluginResultError, match="kept_for_later") as info:
        mgr.allocate_slots(a, 1)
    assert manager.__qualname__ in str(info.value)
    assert isinstance(info.value, KvcoreError)
    assert (mgr.get_num_free_blocks(), mgr.get_block_ids("a")) == before


class _KeepsNoListPerTwin(SlidingWindowManager):
    """A window manager whose ``kept_twins`` answers with one flat list
    instead of a list per twin."""

    def kept_twins(
        self,
        twins: Sequence[Any],
        request_id: str,
        positions: Sequence[int],
        removed: Sequence[Sequence[KVCacheBlock]],
    ) -> list[list[KVCacheBlock]]:
        return [block for released in removed for block in released]  # type: ignore[misc]


def test_kept_twins_answers_one_list_per_twin() -> None:
    """A class step that does not answer one list per twin is refused with
    an error naming its class, and the step changes nothing."""

    class Window(SlidingWindow):
        manager_type = _KeepsNoListPerTwin

    registry = KindRegistry.from_kinds([FullAttention(), Window()])
    mgr = small_manager([fa(4), sw(4, 8)], 40, registry=registry)
    a = small_request("a", PROMPT)
    assert mgr.allocate_slots(a, 16) is not None
    a.num_computed_tokens = 16
    a.append_output_token_ids(900)
    before = (mgr.get_num_free_blocks(), mgr.get_block_ids("a"))
    with pytest.raises(PluginResultError, match="kept_twins returned") as info:
        mgr.allocate_slots(a, 1)
    assert "_KeepsNoListPerTwin" in str(info.value)
    assert (mgr.get_num_free_blocks(), mgr.get_block_ids("a")) == before
