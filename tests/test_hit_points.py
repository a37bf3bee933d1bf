"""Released blocks that complete a running request's hit points are held back.

A hit at ``n`` tokens on a hybrid needs the attention prefix and, from
every other group, the blocks a hit there reads (a sliding window's last
blocks before ``n``).  A running request holds its attention prefix, and
the windows where its hit ended and at its branch point (pinned in its
table); the window blocks of its other hit points it releases as its
window moves on are held back (evicted only after every other free block)
until it is freed, and then rejoin its table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import pytest
from coordinator_setup import fa, manager_for, small_manager, small_request, sw

from kvcore import KindRegistry
from kvcore.coordinator import KVCacheManager, Request
from kvcore.errors import KvcoreError, PluginError, PluginResultError
from kvcore_full_attention import FullAttention
from kvcore_full_attention.manager import FullAttentionManager
from kvcore_sliding_window import SlidingWindow
from kvcore_sliding_window.manager import SlidingWindowManager

PROMPT = list(range(100, 116))  # 16 tokens: 4 blocks of 4


def _window_hybrid(num_blocks: int, **kw: Any) -> KVCacheManager:
    """Full attention (group 0) beside an 8-token sliding window (group 1),
    4-token blocks (``kw``: :func:`small_manager`'s)."""
    return small_manager([fa(4), sw(4, 8)], num_blocks, **kw)


def _kinds_with(
    *, full: type[Any] | None = None, window: type[Any] | None = None
) -> KindRegistry:
    """The window hybrid's two kinds, a third party's manager class in place
    of either's."""
    kinds = [
        type("Full", (FullAttention,), {"manager_type": full})()
        if full
        else FullAttention(),
        type("Window", (SlidingWindow,), {"manager_type": window})()
        if window
        else SlidingWindow(),
    ]
    return KindRegistry.from_kinds(kinds)


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


def _free_order(mgr: KVCacheManager) -> list[int]:
    return mgr.block_pool.eviction_order()


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
    window = mgr.get_blocks("a").ids[1]
    assert [b == 0 for b in window] == [True] * 4 + [False] * 2
    fillers = _fill(mgr, leave=3)
    held = _free_order(mgr)
    assert held == mgr.block_pool.free_queue.held_blocks()
    assert len(held) == 3
    assert all(mgr.block_pool.key_hash[b] is not None for b in held)
    b = small_request("b", [*PROMPT, 7])
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 16
    assert blocks.ids[1][2:] == held[1:]
    # Once nothing else is free the pool hands out held-back blocks, the
    # lowest position first.
    c = small_request("c", [7000, 7001, 7002])
    got = mgr.allocate_slots(c, 3)
    assert got is not None
    assert [blk for g in got.ids for blk in g] == held[:2]
    assert mgr.get_computed_blocks(b)[1] == 0
    assert len(fillers) == 14


def test_a_freed_requests_held_back_blocks_rejoin_its_table() -> None:
    """Freed, A's window blocks it held back rejoin its window table at
    their positions, as if the window had never released them, and A's
    blocks go to the back of the eviction order by hit point: the tail
    first, each position's full-attention block just before its window
    block (the groups in order)."""
    mgr = _window_hybrid(64)
    a = small_request("a", PROMPT)
    _run_prompt_and_decode(mgr, a, 8)
    full, window = mgr.get_blocks("a").ids
    held = mgr.block_pool.free_queue.held_blocks()
    assert len(held) == 3
    mgr.free(a)
    assert mgr.block_pool.free_queue.held_blocks() == []
    # Full attention holds 6 blocks, the window positions 4 and 5, and
    # held back 1-3 (lowest position first); position 0 went to the
    # queue's back when the window left it.
    assert len(full) == 6
    assert window[1:4] == [mgr.block_pool.null_block] * 3
    rejoined = [window[0], *held, window[4], window[5]]
    expected = [b for pos in range(5, 0, -1) for b in (full[pos], rejoined[pos])]
    expected.append(full[0])
    assert _free_order(mgr)[-len(expected) :] == expected


def test_eviction_takes_a_freed_hybrids_hit_points_whole_from_the_tail() -> None:
    """Freed, A leaves 11 blocks in the cache (full attention 0-5, window
    1-5).  The pool then hands out all but 7 free blocks, taking A's 4
    newest in the eviction order: full attention 5 and 4 and the window
    blocks beside them.  What is left still serves a hit at A's prompt end
    (16 tokens: full attention 0-3, the window's 2 and 3); group by group,
    the same 4 evictions would have left window blocks beside no
    attention prefix."""
    mgr = _window_hybrid(64)
    a = small_request("a", PROMPT)
    _run_prompt_and_decode(mgr, a, 8)
    full, _ = mgr.get_blocks("a").ids
    mgr.free(a)
    _fill(mgr, leave=7)
    assert mgr.get_num_free_blocks() == 7
    assert all(mgr.block_pool.key_hash[block] is None for block in full[4:])
    b = small_request("b", [*PROMPT, 7])
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 16
    assert blocks.ids[0] == full[:4]


def _grid_run(mgr: KVCacheManager) -> int:
    """A (an 80-token prompt) computes its prompt and one more token while
    every other free block is taken; B shares A's first 70 tokens only
    (before the last window of A's prompt, whose hit points A keeps): its
    hit."""
    prompt = list(range(100, 180))
    a = small_request("a", prompt)
    _run_prompt_and_decode(mgr, a, 1)
    held = mgr.block_pool.free_queue.held_blocks()
    _fill(mgr, leave=len(held))
    b = small_request("b", [*prompt[:70], *range(500, 520)])
    return mgr.get_computed_blocks(b)[1]


def test_a_running_request_keeps_the_window_at_every_grid_point() -> None:
    """The window reads 7 tokens, so a running request also keeps the
    window before grid points of its prompt: every 56 tokens (eight times
    that, on the 4-token hit alignment) at least, and here every 64, since
    a point's 2 window blocks may cost at most an eighth of the full
    attention blocks between two points (16 blocks of 4 tokens).  B
    branches from A's prompt at 70 tokens, a point A did not foresee,
    while A runs and nothing else is free: it still resumes at 64 tokens,
    A's attention prefix and the window blocks A held back there (in a
    pool whose share for one request's grid, 1/256, holds the point's 2
    window blocks)."""
    mgr = _window_hybrid(2 * 256, max_model_len=128)
    window = mgr.coordinator.single_type_managers[1]
    assert isinstance(window, SlidingWindowManager)
    assert window.hold_interval == 56
    assert _grid_run(mgr) == 64


def test_a_prompt_that_parts_in_a_running_prompts_last_window_resumes_there() -> None:
    """A keeps the window of every hit point in the last window of its
    80-token prompt (73 to 80 tokens: the blocks from position 17 on).  B
    shares A's first 76 tokens: while A runs and nothing else is free, it
    resumes at 76, not at the grid point below (64)."""
    mgr = _window_hybrid(2 * 256, max_model_len=128)
    prompt = list(range(100, 180))
    a = small_request("a", prompt)
    _run_prompt_and_decode(mgr, a, 1)
    _fill(mgr, leave=len(mgr.block_pool.free_queue.held_blocks()))
    b = small_request("b", [*prompt[:76], *range(500, 520)])
    assert mgr.get_computed_blocks(b)[1] == 76


def test_a_request_keeps_the_window_where_it_parts_from_an_earlier_prompt() -> None:
    """B shares A's first 70 tokens, once A's released window blocks that
    it does not keep were handed out: B resumes at A's grid point (64) and
    computes on, and since full attention found 68 tokens of the prefix
    (whole blocks), B keeps the window there, its branch point.  C, which
    shares the same 70 tokens while A and B run and nothing else is free,
    resumes at 68."""
    mgr = _window_hybrid(2 * 256, max_model_len=128)
    prompt = list(range(100, 180))
    a = small_request("a", prompt)
    _run_prompt_and_decode(mgr, a, 1)
    for filler in _fill(mgr, leave=len(mgr.block_pool.free_queue.held_blocks())):
        mgr.free(filler)
    b = small_request("b", [*prompt[:70], *range(500, 520)])
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 64
    assert b.shared_prefix_tokens == 68
    assert mgr.allocate_slots(b, b.num_tokens - hit, hit, blocks) is not None
    b.num_computed_tokens = b.num_tokens
    b.append_output_token_ids(900)
    assert mgr.allocate_slots(b, 1) is not None
    b.num_computed_tokens += 1
    _fill(mgr, leave=len(mgr.block_pool.free_queue.held_blocks()))
    c = small_request("c", [*prompt[:70], *range(600, 620)])
    assert mgr.get_computed_blocks(c)[1] == 68


def _b_on_a_shared_prefix() -> tuple[KVCacheManager, Request]:
    """A runs its prompt and is freed; B shares A's first 12 tokens, hits
    there (its hit's end and branch point: the window at positions 1 and
    2), computes its 32 tokens and decodes 4."""
    mgr = _window_hybrid(40)
    a = small_request("a", PROMPT)
    _run_prompt_and_decode(mgr, a, 1)
    mgr.free(a)
    b = small_request("b", [*PROMPT[:12], *range(300, 320)])
    blocks, hit = mgr.get_computed_blocks(b)
    assert (hit, b.shared_prefix_tokens) == (12, 12)
    assert mgr.allocate_slots(b, b.num_tokens - hit, hit, blocks) is not None
    b.num_computed_tokens = b.num_tokens
    for i in range(4):
        b.append_output_token_ids(900 + i)
        assert mgr.allocate_slots(b, 1) is not None
        b.num_computed_tokens += 1
    return mgr, b


def _fill_up(mgr: KVCacheManager) -> None:
    """Admit three-token requests of fresh tokens until one is refused."""
    filled = 0
    while mgr.allocate_slots(
        small_request(f"f{filled}", [8000 + 4 * filled + i for i in range(3)]), 3
    ):
        filled += 1


def test_a_running_request_keeps_its_branch_points_window_in_its_table() -> None:
    """B shares A's first 12 tokens and hits there (A freed, its blocks
    cached): its hit's end and branch point are 12, whose window is
    positions 1 and 2.  B computes 32 tokens and decodes, so its window
    moves past them, but B keeps them in its table (pinned, referenced)
    as it keeps the attention prefix before them.  With every other block
    of the pool handed out, held back or not, C sharing the same 12 tokens
    still hits 12, on B's own window blocks."""
    mgr, _ = _b_on_a_shared_prefix()
    window = mgr.get_blocks("b").ids[1]
    null = mgr.block_pool.null_block
    # The window (8 tokens) reads from token 28 on: positions 7 and up;
    # 0 was never taken, 3-6 were released, 1 and 2 stay.
    assert [blk != null for blk in window[:7]] == [False, True, True] + [False] * 4
    assert [mgr.block_pool.ref_cnt[blk] for blk in window[1:3]] == [1, 1]
    _fill_up(mgr)
    assert mgr.get_num_free_blocks() <= 1
    c = small_request("c", [*PROMPT[:12], 5, 6, 7])
    blocks, hit = mgr.get_computed_blocks(c)
    assert hit == 12
    assert blocks.ids[1][1:3] == window[1:3]


def test_a_step_that_does_not_fit_with_its_pinned_windows_runs_without_them() -> None:
    """B pins its branch point's window (positions 1 and 2) as above and
    decodes to 36 tokens (its window at positions 7 and 8).  With the pool
    full, B's next block (a full-attention block and a window block, the
    window releasing nothing) does not fit; without the pins, whose two
    blocks it releases, it does."""
    mgr, b = _b_on_a_shared_prefix()
    window = mgr.get_blocks("b").ids[1]
    pinned = window[1:3]
    assert mgr.block_pool.null_block not in pinned
    _fill_up(mgr)
    assert mgr.get_num_free_blocks() == 0
    b.append_output_token_ids(910)
    assert mgr.allocate_slots(b, 1) is not None
    window = mgr.get_blocks("b").ids[1]
    assert window[1:3] == [mgr.block_pool.null_block] * 2
    # The pinned blocks went back to the pool, and the step took them.
    assert mgr.get_num_free_blocks() == 0
    assert sorted(blk for g in mgr.get_blocks("b").ids for blk in g[-1:]) == sorted(
        pinned
    )


class _CountsBadly(FullAttentionManager):
    """A third party's full-attention manager whose admission count raises
    while ``fail`` is set."""

    fail: ClassVar[bool] = False

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[int]
    ) -> int:
        if self.fail:
            msg = "plugin manager bug"
            raise RuntimeError(msg)
        return super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks
        )


def test_an_admission_that_raises_before_its_step_pins_nothing() -> None:
    """X would pin its hit's window (12 tokens, positions 1 and 2), but the
    full-attention manager raises while the admission is counted.  The
    same id admitted again with a prompt of its own then pins nothing and
    holds only its live window."""

    registry = _kinds_with(full=_CountsBadly)
    mgr = small_manager([fa(4), sw(4, 8)], 60, registry=registry)
    a = small_request("a", PROMPT)
    assert mgr.allocate_slots(a, 16) is not None
    mgr.free(a)
    x = small_request("x", [*PROMPT[:12], *range(300, 320)])
    blocks, hit = mgr.get_computed_blocks(x)
    assert hit == 12
    _CountsBadly.fail = True
    try:
        with pytest.raises(PluginError, match="plugin manager bug"):
            mgr.allocate_slots(x, x.num_tokens - hit, hit, blocks)
    finally:
        _CountsBadly.fail = False
    x = small_request("x", list(range(700, 732)))
    assert mgr.allocate_slots(x, 32) is not None
    x.num_computed_tokens = 32
    x.append_output_token_ids(1)
    assert mgr.allocate_slots(x, 1) is not None
    window = mgr.get_blocks("x").ids[1]
    assert [blk != mgr.block_pool.null_block for blk in window] == [False] * 6 + [
        True
    ] * 3


class _NoGrid(SlidingWindowManager):
    """A third party's window manager that keeps no grid."""

    def hold_every(self, spec: object) -> int:
        return 0


def test_a_window_manager_without_a_grid_keeps_only_its_hit_points() -> None:
    """The same run with a window manager whose ``hold_every`` is 0: A
    keeps only its prompt end's window, and B gets no hit."""

    registry = _kinds_with(window=_NoGrid)
    mgr = _window_hybrid(2 * 256, max_model_len=128, registry=registry)
    assert mgr.coordinator.single_type_managers[1].hold_interval == 0
    assert _grid_run(mgr) == 0


def test_a_one_group_plan_frees_tail_first_as_before() -> None:
    """Full attention alone: a freed request's blocks go to the back of the
    queue tail first and nothing is ever held back."""
    mgr = small_manager([fa(4)], 16)
    a = small_request("a", PROMPT)
    _run_prompt_and_decode(mgr, a, 4)
    (table,) = mgr.get_blocks("a").ids
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
        released: Sequence[int],
    ) -> list[int]:
        if self.answer == "foreign":
            return [*released, self.block_pool.num_blocks - 1]
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

    registry = _kinds_with(window=manager)
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


class _ReadsWrongly(SlidingWindowManager):
    """A third party's window manager whose ``shortest_hit_reading`` raises."""

    def shortest_hit_reading(self, position: int) -> int:
        msg = f"no reading for position {position}"
        raise RuntimeError(msg)


class _KeepsIfRoomTwice(SlidingWindowManager):
    """A third party's window manager whose ``kept_if_room`` names the
    blocks ``kept_for_later`` names as well."""

    def kept_if_room(
        self,
        request_id: str,
        positions: Sequence[int],
        released: Sequence[int],
    ) -> list[int]:
        return self.kept_for_later(request_id, positions, released)


def test_kept_if_room_may_not_name_a_block_kept_for_later_names() -> None:
    """A block named by both hooks is refused with an error naming the
    manager and ``kept_if_room``, and the step changes nothing."""

    registry = _kinds_with(window=_KeepsIfRoomTwice)
    mgr = _window_hybrid(40, registry=registry)
    a = small_request("a", PROMPT)
    assert mgr.allocate_slots(a, 16) is not None
    a.num_computed_tokens = 16
    # The first decode step moves the window past blocks 0 and 1; a hit at
    # 12 tokens (before the prompt's last token) reads block 1: named twice.
    a.append_output_token_ids(900)
    before = (mgr.get_num_free_blocks(), mgr.get_block_ids("a"))
    with pytest.raises(PluginResultError, match="kept_if_room") as info:
        mgr.allocate_slots(a, 1)
    assert "_KeepsIfRoomTwice" in str(info.value)
    assert (mgr.get_num_free_blocks(), mgr.get_block_ids("a")) == before


class _KeepsNoListPerTwin(SlidingWindowManager):
    """A window manager whose ``kept_twins`` answers with one flat list
    instead of a list per twin."""

    def kept_twins(
        self,
        twins: Sequence[Any],
        request_id: str,
        positions: Sequence[int],
        removed: Sequence[Sequence[int]],
    ) -> list[list[int]]:
        return [block for released in removed for block in released]  # type: ignore[misc]


def test_kept_twins_answers_one_list_per_twin() -> None:
    """A class step that does not answer one list per twin is refused with
    an error naming its class, and the step changes nothing."""

    registry = _kinds_with(window=_KeepsNoListPerTwin)
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


class _KeepsNoListPerTwinIfRoom(SlidingWindowManager):
    """A window manager whose ``kept_if_room_twins`` answers with one flat
    list instead of a list per twin."""

    def kept_if_room_twins(
        self,
        twins: Sequence[Any],
        request_id: str,
        positions: Sequence[int],
        removed: Sequence[Sequence[int]],
    ) -> list[list[int]]:
        return [block for released in removed for block in released]  # type: ignore[misc]


def test_kept_if_room_twins_answers_one_list_per_twin() -> None:
    """The class form of ``kept_if_room`` is checked as ``kept_twins`` is:
    an answer that is not one list per twin is refused with an error
    naming the class and the method, and the step changes nothing."""

    registry = _kinds_with(window=_KeepsNoListPerTwinIfRoom)
    mgr = small_manager([fa(4), sw(4, 8)], 40, registry=registry)
    a = small_request("a", PROMPT)
    assert mgr.allocate_slots(a, 16) is not None
    a.num_computed_tokens = 16
    a.append_output_token_ids(900)
    before = (mgr.get_num_free_blocks(), mgr.get_block_ids("a"))
    with pytest.raises(PluginResultError, match="kept_if_room_twins returned") as info:
        mgr.allocate_slots(a, 1)
    assert "_KeepsNoListPerTwinIfRoom" in str(info.value)
    assert (mgr.get_num_free_blocks(), mgr.get_block_ids("a")) == before


class _KeepsTheRestIfRoom(SlidingWindowManager):
    """A window manager that overrides only the one-group ``kept_if_room``:
    it keeps, if room, every released block ``kept_for_later`` leaves."""

    asked: ClassVar[list[int]] = []

    def kept_if_room(
        self,
        request_id: str,
        positions: Sequence[int],
        released: Sequence[int],
    ) -> list[int]:
        self.asked.append(self.kv_cache_group_id)
        kept = self.kept_for_later(request_id, positions, released)
        return [block for block in released if block not in kept]


def test_twins_overriding_only_kept_if_room_are_asked_group_by_group() -> None:
    """Two twin window groups whose class overrides only ``kept_if_room``
    are asked group by group, in group order, and the blocks they name are
    held back in front of the ``kept_for_later`` ones as one pool call per
    group leaves them: the last group's in front, each lowest position
    first; the ``kept_for_later`` blocks behind, in group order."""

    registry = _kinds_with(window=_KeepsTheRestIfRoom)
    mgr = small_manager([fa(4), sw(4, 8), sw(4, 8)], 40, registry=registry)
    _KeepsTheRestIfRoom.asked.clear()
    a = small_request("a", PROMPT)
    _run_prompt_and_decode(mgr, a, 1)
    assert _KeepsTheRestIfRoom.asked == [1, 2]
    # The first decode step moved each window past blocks 0 and 1: block 1
    # completes the hit at 12 tokens (kept_for_later), block 0 none.
    tables = [mgr.coordinator.single_type_managers[g].held_back["a"] for g in (1, 2)]
    assert [[pos for pos, _, _ in held] for held in tables] == [[1, 0], [1, 0]]
    (k1, s1), (k2, s2) = ([block for _, block, _ in held] for held in tables)
    assert mgr.block_pool.free_queue.held_blocks() == [s2, s1, k1, k2]


class _ReadsAFraction(SlidingWindowManager):
    """A third party's window manager whose ``shortest_hit_reading``
    returns a float."""

    def shortest_hit_reading(self, position: int) -> int:
        return position + 0.5  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("manager", "error"),
    [(_ReadsWrongly, PluginError), (_ReadsAFraction, PluginResultError)],
)
def test_shortest_hit_reading_is_checked_where_it_enters_the_core(
    manager: type[SlidingWindowManager], error: type[PluginError]
) -> None:
    """Freeing a hybrid request whose window manager raises in
    ``shortest_hit_reading``, or returns what is not an int of at least 0,
    is refused with an error naming the manager and the method, and the
    request keeps its blocks."""

    registry = _kinds_with(window=manager)
    mgr = _window_hybrid(40, registry=registry)
    a = small_request("a", PROMPT)
    _run_prompt_and_decode(mgr, a, 2)
    before = (mgr.get_num_free_blocks(), mgr.get_block_ids("a"))
    with pytest.raises(error, match="shortest_hit_reading") as info:
        mgr.free(a)
    assert manager.__name__ in str(info.value)
    assert (mgr.get_num_free_blocks(), mgr.get_block_ids("a")) == before


class _CountsReadings(SlidingWindowManager):
    """A window manager that counts the positions it is asked about."""

    asked: ClassVar[list[int]] = []

    def shortest_hit_reading(self, position: int) -> int:
        self.asked.append(position)
        return super().shortest_hit_reading(position)


def test_each_position_is_read_once() -> None:
    """A reading depends on the position alone: freeing two requests of
    the same length asks each position once, and the second is queued by
    the same readings."""

    _CountsReadings.asked.clear()
    registry = _kinds_with(window=_CountsReadings)
    mgr = _window_hybrid(60, registry=registry)
    for rid in ("a", "b"):
        request = small_request(rid, PROMPT)
        _run_prompt_and_decode(mgr, request, 2)
        mgr.free(request)
    asked = _CountsReadings.asked
    assert asked
    assert sorted(asked) == list(range(len(asked)))


def test_a_window_block_released_for_no_hit_goes_before_cached_prefixes() -> None:
    """X's prompt is cached and freed; then A decodes past its prompt and
    releases its window block at position 0, which no hit point of A's
    needs (positions 1-3 are held back).  That block is spare: hand-outs
    take it after the blocks without a key and before X's cached prefix,
    so a pool short by one block loses A's position-0 window block, not
    X's prefix, and a repeat of X's prompt still hits whole."""
    mgr = _window_hybrid(40)
    pool = mgr.block_pool
    x_prompt = list(range(300, 316))
    x = small_request("x", x_prompt)
    assert mgr.allocate_slots(x, 16) is not None
    x.num_computed_tokens = 16
    mgr.free(x)
    a = small_request("a", PROMPT)
    _run_prompt_and_decode(mgr, a, 8)
    spare = pool.free_queue.spare_blocks()
    assert len(spare) == 1
    assert pool.key_hash[spare[0]] is not None
    order = pool.eviction_order()
    unkeyed = [b for b in order if pool.key_hash[b] is None]
    assert order[: len(unkeyed) + 1] == unkeyed + spare
    got = pool.get_new_blocks(len(unkeyed) + 1)
    assert got == unkeyed + spare
    assert pool.key_hash[spare[0]] is None  # evicted with its hand-out
    y = small_request("y", [*x_prompt, 7])
    assert mgr.get_computed_blocks(y)[1] == 16


def test_a_rolled_back_hand_out_puts_spare_blocks_back_in_their_place() -> None:
    """A step that draws blocks without a key, a spare block and a keyed
    one, then fails, leaves the eviction order exactly as it was."""
    mgr = _window_hybrid(40)
    pool = mgr.block_pool
    x = small_request("x", list(range(300, 316)))
    assert mgr.allocate_slots(x, 16) is not None
    x.num_computed_tokens = 16
    mgr.free(x)
    a = small_request("a", PROMPT)
    _run_prompt_and_decode(mgr, a, 8)
    before = pool.eviction_order()
    spare = pool.free_queue.spare_blocks()
    unkeyed = sum(1 for b in before if pool.key_hash[b] is None)
    keys = list(pool.key_hash)
    pool.begin()
    got = pool.get_new_blocks(unkeyed + len(spare) + 1)
    assert got == before[: len(got)]
    pool.rollback()
    assert pool.eviction_order() == before
    assert pool.free_queue.spare_blocks() == spare
    assert pool.key_hash == keys


def test_a_small_pool_doubles_the_window_grid_until_it_fits_its_share() -> None:
    """A's prompt is 400 tokens: 6 points of the 64-token grid (see
    test_a_running_request_keeps_the_window_at_every_grid_point), 2 window
    blocks each.  In 300 blocks one request's grid may take 4 points (its
    share, 300/256 of a block, is less), so the interval doubles to 128:
    B, which branches from A's running prompt at 70 tokens, finds no grid
    point below (it would resume at 64 on the whole grid); C, which
    branches at 130, resumes at 128 (every other free block taken)."""
    mgr = _window_hybrid(300, max_model_len=512)
    window = mgr.coordinator.single_type_managers[1]
    assert window.hold_interval == 56
    assert window.grid_point_cost == 2
    prompt = list(range(1000, 1400))
    a = small_request("a", prompt)
    _run_prompt_and_decode(mgr, a, 1)
    _fill(mgr, leave=len(mgr.block_pool.free_queue.held_blocks()))
    b = small_request("b", [*prompt[:70], *range(500, 520)])
    assert mgr.get_computed_blocks(b)[1] == 0
    c = small_request("c", [*prompt[:130], *range(500, 520)])
    assert mgr.get_computed_blocks(c)[1] == 128


class _GridCostIs(SlidingWindowManager):
    """A third party's window manager whose grid answers are ``answer``."""

    answer: ClassVar[Any] = 0
    method: ClassVar[str] = "grid_point_blocks"

    def grid_point_blocks(self) -> int:
        if self.method == "grid_point_blocks":
            return self.answer  # type: ignore[no-any-return]
        return super().grid_point_blocks()

    def grid_pool_share(self) -> float:
        if self.method == "grid_pool_share":
            return self.answer  # type: ignore[no-any-return]
        return super().grid_pool_share()


@pytest.mark.parametrize(
    ("method", "answer"),
    [
        ("grid_point_blocks", -1),
        ("grid_point_blocks", 2.0),
        ("grid_point_blocks", None),
        ("grid_pool_share", 2),
        ("grid_pool_share", "1/256"),
    ],
)
def test_a_bad_grid_answer_is_refused_naming_the_manager(
    method: str, answer: object
) -> None:
    class Manager(_GridCostIs):
        pass

    Manager.method = method
    Manager.answer = answer

    registry = _kinds_with(window=Manager)
    with pytest.raises(PluginResultError, match=f"Manager.{method}") as info:
        _window_hybrid(64, registry=registry)
    assert isinstance(info.value, KvcoreError)


@pytest.mark.parametrize("method", ["grid_point_blocks", "grid_pool_share"])
def test_a_raising_grid_hook_is_reported_naming_the_manager_and_plugin(
    method: str,
) -> None:
    class Manager(_GridCostIs):
        def grid_point_blocks(self) -> int:
            if method == "grid_point_blocks":
                raise RuntimeError("boom")
            return super().grid_point_blocks()

        def grid_pool_share(self) -> float:
            if method == "grid_pool_share":
                raise RuntimeError("boom")
            return super().grid_pool_share()

    Manager.method = ""

    registry = _kinds_with(window=Manager)
    with pytest.raises(PluginError, match=f"Manager.{method}.*boom") as info:
        _window_hybrid(64, registry=registry)
    assert "while the KV cache manager was built" in str(info.value)
    assert info.value.plugin_name


def test_a_window_shorter_than_the_hit_alignment_keeps_the_same_prompts_hit() -> None:
    """16-token blocks and hits, a window reading 5 tokens: the prompt's
    last window of hit points (39 to 44 tokens) holds none, yet A keeps the
    window before 32 tokens, the last hit point before its final token, so
    the same prompt again still resumes there once nothing else is free."""
    mgr = manager_for(
        [fa(16), sw(16, 6)],
        400,
        scheduler_block_size=16,
        hash_block_size=4,
        max_model_len=512,
    )
    prompt = list(range(1000, 1044))
    a = small_request("a", prompt)
    _run_prompt_and_decode(mgr, a, 40)
    _fill(mgr, leave=len(mgr.block_pool.free_queue.held_blocks()))
    assert mgr.get_computed_blocks(small_request("b", prompt))[1] == 32


def test_a_window_only_plan_keeps_released_blocks_by_age() -> None:
    """A sliding window alone: no group keeps a request's prefix, so no
    manager picks the released blocks worth keeping, and they queue by age
    behind the blocks freed before them.  X's prompt is cached and freed;
    A's prefill then releases the window blocks before its last window.  A
    pool short by X's blocks loses X's prefix, not A's released block
    beside its held window, and B (A's prompt up to that block's hit point)
    hits there."""
    mgr = small_manager([sw(4, 8)], 16)
    pool = mgr.block_pool
    x = small_request("x", list(range(300, 316)))
    assert mgr.allocate_slots(x, 16) is not None
    x.num_computed_tokens = 16
    mgr.free(x)
    x_keyed = [b for b in pool.eviction_order() if pool.key_hash[b] is not None]
    a = small_request("a", PROMPT)
    _run_prompt_and_decode(mgr, a, 1)
    (table,) = mgr.get_blocks("a").ids
    released = [b for b in pool.eviction_order() if pool.key_hash[b] is not None]
    released = released[len(x_keyed) :]
    assert pool.free_queue.spare_blocks() == []
    assert released  # A's window moved on, its blocks keyed and free
    unkeyed = pool.get_num_free_blocks() - len(x_keyed) - len(released)
    assert pool.eviction_order()[unkeyed:] == [*x_keyed, *released]
    pool.get_new_blocks(unkeyed + len(x_keyed))  # the pool runs short
    b = small_request("b", PROMPT[:12])
    hit, num_tokens = mgr.get_computed_blocks(b)
    assert num_tokens == 8
    # Positions 0 and 1, released newest first.
    assert list(hit.ids[0]) == released[::-1]
    assert table[: len(released)] == [0] * len(released)
