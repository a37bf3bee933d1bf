"""Hand-worked engine-parity steps: a KV connector's external tokens, the
encoder-token keyword, the full-sequence admission check, per-group usage
and prefix-hit statistics.

Block ids come from the free queue, which starts in id order with block 0
taken out as the null block; within a step groups allocate in group order.
"""

from __future__ import annotations

from pathlib import Path

import coordinator_setup as setup
import pytest

from kvcore.coordinator import (
    GroupPrefixCacheStats,
    RequestStatus,
)
from kvcore.errors import (
    InvalidRequestError,
    KvcoreError,
    KvcoreTypeError,
    UnknownRequestError,
)
from kvcore_full_attention import FullAttentionSpec
from kvcore_sliding_window import SlidingWindowSpec


def fa(block_size: int = 4) -> FullAttentionSpec:
    return setup.fa(block_size)


def sw(block_size: int = 4, window: int = 8) -> SlidingWindowSpec:
    return setup.sw(block_size, window)


manager = setup.small_manager
req = setup.small_request


# -- external computed tokens --------------------------------------------------


def test_external_tokens_get_new_slots_and_are_cached() -> None:
    mgr = manager([fa()], 10)
    a = req("A", range(1, 11))
    # 8 tokens a connector loads + 2 computed: 10 tokens, 3 blocks.
    out = mgr.allocate_slots(a, 2, num_external_computed_tokens=8)
    assert out is not None
    assert out.get_block_ids() == ([1, 2, 3],)
    assert a.status is RequestStatus.RUNNING
    assert mgr.get_num_free_blocks() == 6
    # Not delayed: the two full blocks are hashed, so a copy hits them.
    blocks, hit = mgr.get_computed_blocks(req("B", range(1, 11)))
    assert (blocks.get_block_ids(), hit) == (([1, 2],), 8)


def test_asynchronous_load_takes_slots_then_caches_when_it_lands() -> None:
    mgr = manager([fa()], 10)
    a = req("A", range(1, 11))
    out = mgr.allocate_slots(
        a, 0, num_external_computed_tokens=8, delay_cache_blocks=True
    )
    assert out is not None
    assert out.get_block_ids() == ([1, 2],)
    assert mgr.get_computed_blocks(req("B", range(1, 11)))[1] == 0
    # The load lands: the engine records the tokens and hashes the blocks.
    a.num_computed_tokens = 8
    mgr.cache_blocks(a, 8)
    assert mgr.get_computed_blocks(req("C", range(1, 11)))[1] == 8
    # The request then computes its last two tokens as a running request.
    out = mgr.allocate_slots(a, 2)
    assert out is not None
    assert out.get_block_ids() == ([3],)
    assert mgr.get_block_ids("A") == ([1, 2, 3],)


def test_external_tokens_after_a_local_hit() -> None:
    mgr = manager([fa()], 12)
    a = req("A", range(1, 18))
    assert mgr.allocate_slots(a, 17) is not None  # blocks 1-5, 4 hashed
    b = req("B", [*range(1, 9), *range(100, 120)])  # shares 8 tokens with A
    hit, n = mgr.get_computed_blocks(b)
    assert (hit.get_block_ids(), n) == (([1, 2],), 8)
    # hit 8 + external 12 + new 4 = 24 tokens, 6 blocks: 2 hit, 4 new.
    out = mgr.allocate_slots(b, 4, n, hit, num_external_computed_tokens=12)
    assert out is not None
    assert out.get_block_ids() == ([6, 7, 8, 9],)
    assert mgr.get_block_ids("B") == ([1, 2, 6, 7, 8, 9],)


def test_external_tokens_take_no_block_where_a_window_skips() -> None:
    # Window 8, blocks of 4: with 16 tokens computed, tokens 0-8 are never
    # read again (16 - 8 + 1 = 9 skipped), so the first 2 positions are null.
    mgr = manager([fa(), sw()], 20)
    a = req("A", range(1, 21))
    out = mgr.allocate_slots(a, 4, num_external_computed_tokens=16)
    assert out is not None
    assert out.get_block_ids() == ([1, 2, 3, 4, 5], [6, 7, 8])
    assert mgr.get_block_ids("A") == ([1, 2, 3, 4, 5], [0, 0, 6, 7, 8])


def test_external_tokens_refused_when_the_pool_is_short() -> None:
    mgr = manager([fa()], 3)  # 2 free blocks
    a = req("A", range(1, 11))
    assert mgr.allocate_slots(a, 2, num_external_computed_tokens=8) is None
    assert mgr.get_num_free_blocks() == 2
    assert a.status is RequestStatus.WAITING


def test_external_tokens_only_at_admission() -> None:
    mgr = manager([fa()], 10)
    a = req("A", range(1, 11))
    assert mgr.allocate_slots(a, 4) is not None
    a.num_computed_tokens = 4
    with pytest.raises(InvalidRequestError, match="attach only when the request"):
        mgr.allocate_slots(a, 2, num_external_computed_tokens=4)
    assert mgr.get_block_ids("A") == ([1],)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_external_computed_tokens": -1}, "num_external_computed_tokens must"),
        ({"num_external_computed_tokens": 2.0}, "num_external_computed_tokens must"),
        ({"num_external_computed_tokens": None}, "num_external_computed_tokens must"),
        ({"num_encoder_tokens": -3}, "num_encoder_tokens must be"),
        ({"num_encoder_tokens": "4"}, "num_encoder_tokens must be"),
        ({"num_encoder_tokens": 4}, "no cache group of this plan takes encoder"),
        ({"full_sequence_must_fit": 1}, "full_sequence_must_fit must be a bool"),
        ({"full_sequence_must_fit": None}, "full_sequence_must_fit must be a bool"),
    ],
)
def test_engine_keywords_checked(kw: dict[str, object], match: str) -> None:
    mgr = manager([fa()], 10)
    a = req("A", range(1, 11))
    with pytest.raises(InvalidRequestError, match=match) as info:
        mgr.allocate_slots(a, 4, **kw)  # type: ignore[arg-type]
    assert isinstance(info.value, KvcoreError)
    assert mgr.live_request_ids() == ()
    with pytest.raises(UnknownRequestError):
        mgr.get_blocks("A")
    assert mgr.get_num_free_blocks() == 9


def test_live_request_ids_lists_the_requests_holding_blocks() -> None:
    """Allocated requests are live, in the order first allocated, until
    freed (by either call); a refused step adds none."""
    mgr = manager([fa()], 10)
    b, a = req("B", range(1, 5)), req("A", range(1, 9))
    assert mgr.live_request_ids() == ()
    assert mgr.allocate_slots(b, 4) is not None
    assert mgr.allocate_slots(a, 8) is not None
    assert mgr.live_request_ids() == ("B", "A")
    assert mgr.allocate_slots(req("C", range(1, 41)), 40) is None
    assert mgr.live_request_ids() == ("B", "A")
    mgr.free(b)
    assert mgr.live_request_ids() == ("A",)
    blocks = mgr.pop_blocks_for_free("A")
    assert mgr.live_request_ids() == ()
    mgr.release_blocks(blocks)
    assert mgr.reset_prefix_cache()


def test_zero_new_tokens_needs_external_tokens() -> None:
    mgr = manager([fa()], 10)
    with pytest.raises(InvalidRequestError, match="asks for 0 new tokens"):
        mgr.allocate_slots(req("A", range(1, 11)), 0)


def test_encoder_tokens_zero_and_positional_parameters_still_work() -> None:
    mgr = manager([fa()], 10)
    a = req("A", range(1, 11))
    # request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
    # num_lookahead_tokens, delay_cache_blocks: the positional order kept.
    out = mgr.allocate_slots(a, 8, 0, None, 0, True, num_encoder_tokens=0)
    assert out is not None
    assert out.get_block_ids() == ([1, 2],)
    assert mgr.get_computed_blocks(req("B", range(1, 11)))[1] == 0  # delayed
    with pytest.raises(TypeError):
        mgr.allocate_slots(a, 2, 0, None, 0, False, 4)  # type: ignore[call-arg, arg-type]


# -- the full-sequence admission check -----------------------------------------


def test_full_sequence_must_fit_refuses_a_first_chunk_that_alone_fits() -> None:
    mgr = manager([fa()], 10)  # 9 free blocks
    r = req("R", range(1, 41))  # 40 tokens: 10 blocks
    assert mgr.can_fit_full_sequence(r) is False
    assert mgr.allocate_slots(r, 8, full_sequence_must_fit=True) is None
    assert mgr.get_num_free_blocks() == 9
    assert r.status is RequestStatus.WAITING
    assert mgr.can_fit_full_sequence(r, 36) is True  # 9 blocks
    assert mgr.can_fit_full_sequence(r, 37) is False  # 10 blocks
    # Without the keyword the first chunk is admitted.
    out = mgr.allocate_slots(r, 8)
    assert out is not None
    assert out.get_block_ids() == ([1, 2],)


def test_full_sequence_must_fit_admits_what_fits() -> None:
    mgr = manager([fa()], 10)
    r = req("R", range(1, 37))  # 36 tokens: 9 blocks
    out = mgr.allocate_slots(r, 8, full_sequence_must_fit=True)
    assert out is not None
    assert out.get_block_ids() == ([1, 2],)
    # Running now: 2 held, 7 more for the whole sequence, 7 free.
    r.num_computed_tokens = 8
    assert mgr.can_fit_full_sequence(r) is True
    assert mgr.can_fit_full_sequence(r, 40) is False
    out = mgr.allocate_slots(r, 8, full_sequence_must_fit=True)
    assert out is not None
    assert out.get_block_ids() == ([3, 4],)


def test_full_sequence_capped_at_max_model_len() -> None:
    mgr = manager([fa()], 10, max_model_len=32)  # 8 blocks at most
    r = req("R", range(1, 5))
    assert mgr.can_fit_full_sequence(r, 1000) is True
    small = manager([fa()], 8, max_model_len=32)  # 7 free
    assert small.can_fit_full_sequence(r, 1000) is False


def test_full_sequence_counts_a_shared_hit_once() -> None:
    mgr = manager([fa()], 12)  # 11 free
    a = req("A", range(1, 18))
    assert mgr.allocate_slots(a, 17) is not None  # 5 blocks, 6 free
    b = req("B", [*range(1, 17), *range(100, 124)])  # 40 tokens, 16 shared
    hit, n = mgr.get_computed_blocks(b)
    assert n == 16
    # 10 blocks, 4 of them A's hit blocks: 6 from the pool.
    assert mgr.can_fit_full_sequence(b) is False
    assert (
        mgr.can_fit_full_sequence(b, new_computed_blocks=hit, num_new_computed_tokens=n)
        is True
    )
    assert (
        mgr.can_fit_full_sequence(
            b, 44, new_computed_blocks=hit, num_new_computed_tokens=n
        )
        is False
    )
    out = mgr.allocate_slots(b, 8, n, hit, full_sequence_must_fit=True)
    assert out is not None
    assert out.get_block_ids() == ([6, 7],)


def test_full_sequence_of_a_window_is_its_per_request_bound() -> None:
    # Window 8 in blocks of 4 holds at most 3 blocks at once.
    r = req("R", range(1, 41))
    roomy = manager([sw()], 4)  # 3 free
    assert roomy.can_fit_full_sequence(r) is True
    out = roomy.allocate_slots(r, 4, full_sequence_must_fit=True)
    assert out is not None
    assert out.get_block_ids() == ([1],)
    tight = manager([sw()], 3)  # 2 free
    assert tight.can_fit_full_sequence(r) is False
    assert tight.allocate_slots(r, 4, full_sequence_must_fit=True) is None


def test_can_fit_full_sequence_checks_its_arguments() -> None:
    mgr = manager([fa()], 10)
    r = req("R", range(1, 9))
    for bad in (0, -1, 2.0):
        with pytest.raises(InvalidRequestError, match="num_tokens must be"):
            mgr.can_fit_full_sequence(r, bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="num_external_computed_tokens"):
        mgr.can_fit_full_sequence(r, num_external_computed_tokens=-1)
    with pytest.raises(InvalidRequestError, match="num_new_computed_tokens"):
        mgr.can_fit_full_sequence(r, num_new_computed_tokens=-1)
    with pytest.raises(KvcoreError):
        mgr.can_fit_full_sequence("R")  # type: ignore[arg-type]


# -- per-group metrics ---------------------------------------------------------


def test_group_usage_counts_each_groups_blocks_once() -> None:
    mgr = manager([fa(), sw()], 30)
    assert mgr.group_usage() == (0, 0)
    a = req("A", range(1, 18))
    assert mgr.allocate_slots(a, 17) is not None
    # Admitted with nothing computed, the window skips nothing yet.
    assert mgr.get_block_ids("A") == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    assert mgr.group_usage() == (5, 5)
    b = req("B", [*range(1, 17), 99])
    hit, n = mgr.get_computed_blocks(b)
    assert n == 16
    assert mgr.allocate_slots(b, 1, n, hit) is not None
    # 16 computed: the window skips 16 - 8 + 1 = 9 tokens, 2 positions; B
    # shares A's 4 FA blocks and A's window blocks at positions 2-3.
    assert mgr.get_block_ids("B") == ([1, 2, 3, 4, 11], [0, 0, 8, 9, 12])
    assert mgr.group_usage() == (6, 6)
    mgr.free(a)
    assert mgr.group_usage() == (5, 3)
    mgr.free(b)
    assert mgr.group_usage() == (0, 0)


def test_group_prefix_cache_stats() -> None:
    mgr = manager([fa(), sw()], 30)
    a = req("A", range(1, 18))
    assert mgr.get_computed_blocks(a)[1] == 0
    assert mgr.allocate_slots(a, 17) is not None
    b = req("B", [*range(1, 17), 99, 98, 97])
    assert mgr.get_computed_blocks(b)[1] == 16
    fa_stats, sw_stats = mgr.group_prefix_cache_stats()
    assert fa_stats == GroupPrefixCacheStats(
        group_id=0,
        kind=str(fa().kind),
        block_size=4,
        prefix_cacheable=True,
        requests=2,
        queries=36,  # 17 + 19 tokens looked up
        hits=16,
        hit_blocks=4,
    )
    assert (sw_stats.group_id, sw_stats.hits, sw_stats.hit_blocks) == (1, 16, 4)
    assert sw_stats.hit_rate == pytest.approx(16 / 36)
    mgr.free(a)
    assert mgr.reset_prefix_cache() is True
    assert mgr.group_prefix_cache_stats()[0].queries == 0


def test_the_documented_scheduler_loop_runs() -> None:
    page = (
        Path(__file__).resolve().parent.parent / "docs" / "coordinator.md"
    ).read_text()
    section = page.split("## An engine's scheduler loop", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "docs/coordinator.md", "exec"), {})


def test_unknown_engine_keyword_refused() -> None:
    mgr = manager([fa()], 10)
    with pytest.raises(KvcoreTypeError, match="unexpected keyword argument") as info:
        mgr.allocate_slots(req("A", range(1, 11)), 4, num_external_tokens=8)  # type: ignore[call-arg]
    assert isinstance(info.value, TypeError)
    assert "num_external_computed_tokens" in str(info.value)
    assert mgr.get_num_free_blocks() == 9


# -- a step dropped before its forward ------------------------------------------


def _preempted_in_its_step(**kw: object) -> tuple[object, object]:
    """A computes its first 8 of 16 tokens, then is scheduled for the last 8
    and dropped before that step's forward runs."""
    mgr = manager([fa()], 12, **kw)
    a = req("A", range(1, 17))
    assert mgr.allocate_slots(a, 8) is not None
    a.num_computed_tokens = 8
    assert mgr.allocate_slots(a, 8) is not None  # keys all four blocks
    assert mgr.get_computed_blocks(req("X", range(1, 18)))[1] == 16
    return mgr, a


def test_a_step_dropped_before_its_forward_leaves_no_key_on_its_blocks() -> None:
    mgr, a = _preempted_in_its_step()
    mgr.free(a, forward_ran=False)
    assert a.status is RequestStatus.FINISHED
    assert mgr.get_num_free_blocks() == 11
    # Only the blocks the first step wrote are hit; the last two are
    # reused first, as blocks without a key are.
    blocks, hit = mgr.get_computed_blocks(req("B", range(1, 18)))
    assert (blocks.get_block_ids(), hit) == (([1, 2],), 8)
    out = mgr.allocate_slots(req("C", range(100, 104)), 4)
    assert out is not None
    assert out.get_block_ids() in (([3],), ([4],))


def test_a_step_whose_forward_ran_keeps_its_keys() -> None:
    mgr, a = _preempted_in_its_step()
    mgr.free(a)
    assert mgr.get_computed_blocks(req("B", range(1, 18)))[1] == 16


def test_a_dropped_step_tells_the_router_its_blocks_are_gone() -> None:
    mgr, a = _preempted_in_its_step(enable_kv_cache_events=True)
    stored = mgr.take_events()
    assert sum(len(e.block_hashes) for e in stored) == 4
    mgr.free(a, forward_ran=False)
    removed = mgr.take_events()
    assert [type(e).__name__ for e in removed] == ["BlockRemoved", "BlockRemoved"]
    assert [e.block_hashes for e in removed] == [
        stored[-1].block_hashes[-2:-1],
        stored[-1].block_hashes[-1:],
    ]


def test_a_dropped_step_keeps_keys_a_shared_block_had_before_it() -> None:
    """Keys older than the step stay, even on a block another request shares."""
    mgr = manager([fa()], 12)
    b = req("B", range(1, 9))
    assert mgr.allocate_slots(b, 8) is not None  # keys blocks 1 and 2
    a = req("A", range(1, 13))
    hit, n = mgr.get_computed_blocks(a)
    assert n == 8
    assert mgr.allocate_slots(a, 4, n, hit) is not None
    mgr.free(a, forward_ran=False)  # A's own step wrote nothing
    blocks, n = mgr.get_computed_blocks(req("C", range(1, 14)))
    assert (blocks.get_block_ids(), n) == (([1, 2],), 8)


def test_a_dropped_step_of_a_state_hybrid_leaves_no_state_to_resume_from() -> None:
    mgr = setup.state_hybrid(40, 4)
    a = req("A", range(1, 17))
    assert mgr.allocate_slots(a, 8) is not None
    a.num_computed_tokens = 8
    mgr.new_step_starts()
    assert mgr.allocate_slots(a, 8) is not None
    assert mgr.get_block_ids("A") == ([1, 2, 4, 5], [0, 3, 6, 7])
    mgr.free(a, forward_ran=False)
    mgr.new_step_starts()
    # The state at token 16 (block 7) was never written: B resumes from
    # the state the first step wrote at token 8.
    blocks, n = mgr.get_computed_blocks(req("B", range(1, 18)))
    assert (blocks.get_block_ids(), n) == (([1, 2], [0, 3]), 8)


def test_pop_blocks_for_free_drops_the_keys_of_a_dropped_step() -> None:
    mgr, a = _preempted_in_its_step()
    blocks = mgr.pop_blocks_for_free(a, forward_ran=False)
    mgr.release_blocks(blocks)
    assert mgr.get_computed_blocks(req("B", range(1, 18)))[1] == 8


def test_forward_ran_must_be_a_bool_and_a_refusal_changes_nothing() -> None:
    mgr, a = _preempted_in_its_step()
    with pytest.raises(KvcoreTypeError, match="forward_ran must be a bool"):
        mgr.free(a, forward_ran="no")  # type: ignore[arg-type]
    assert mgr.live_request_ids() == ("A",)
    assert mgr.get_computed_blocks(req("B", range(1, 18)))[1] == 16
    mgr.free(a, forward_ran=False)
    assert mgr.live_request_ids() == ()


def test_a_step_hit_by_a_later_admission_cannot_be_dropped() -> None:
    """B hits the blocks A's step keyed, in the same step: dropping A's step
    would leave B reading KV no step writes, so it is refused, changing
    nothing; an engine drops a step before admitting others."""
    mgr, a = _preempted_in_its_step()
    b = req("B", range(1, 21))
    hit, n = mgr.get_computed_blocks(b)
    assert n == 16
    assert mgr.allocate_slots(b, 4, n, hit) is not None
    with pytest.raises(InvalidRequestError, match="also in another request"):
        mgr.free(a, forward_ran=False)
    assert mgr.live_request_ids() == ("A", "B")
    assert mgr.get_computed_blocks(req("C", range(1, 18)))[1] == 16


def test_external_tokens_give_a_state_group_its_starting_state() -> None:
    """A connector loads 12 tokens of a state hybrid: the state after them
    (table position 2), which the connector writes and the first step
    reads, takes a block of its own beside the step's end (position 4); the
    next step releases it like any old state."""
    mgr = setup.state_hybrid(40, 4)
    a = req("A", range(1, 30))
    assert mgr.allocate_slots(a, 8, num_external_computed_tokens=12) is not None
    assert mgr.get_block_ids("A") == ([1, 2, 3, 4, 5], [0, 0, 6, 0, 7])
    assert mgr.get_num_free_blocks() == 32
    assert mgr.state_write_positions("A", 12, 20) == {1: (20,)}
    a.num_computed_tokens = 20
    assert mgr.allocate_slots(a, 4) is not None
    assert mgr.get_block_ids("A") == ([1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 7, 8])
    mgr.free(a)
    assert mgr.get_num_free_blocks() == 39


def test_a_hit_holding_the_starting_state_takes_no_extra_block() -> None:
    mgr = setup.state_hybrid(40, 4)
    a = req("A", range(1, 30))
    assert mgr.allocate_slots(a, 16) is not None
    a.num_computed_tokens = 16
    mgr.free(a)
    mgr.new_step_starts()
    b = req("B", range(1, 30))
    hit, n = mgr.get_computed_blocks(b)
    assert n == 16
    free = mgr.get_num_free_blocks()
    assert mgr.allocate_slots(b, 4, n, hit) is not None
    state = mgr.get_block_ids("B")[1]
    assert 0 not in state[3:5]
    # The hit's four attention blocks and its state block leave the free
    # queue, and the step takes one attention block and one state block for
    # its end: nothing for a loaded state.
    assert free - mgr.get_num_free_blocks() == 4 + 1 + 1 + 1
