"""The engine contract's newer pieces, engine-neutral (docs/coordinator.md,
"The engine contract"): prefix-hit statistics read per interval, releases on
a processed-tokens basis under asynchronous scheduling, a reserved-blocks
floor, evicting chosen cached blocks and admitting a hit with no new tokens.

Block ids come from the free queue, which starts in id order with block 0
taken out as the null block; within a step groups allocate in group order.
"""

from __future__ import annotations

import copy

import coordinator_setup as setup
import pytest

from kvcore.coordinator import KVCacheManager, Request, RequestStatus
from kvcore.errors import InvalidRequestError, UnknownRequestError

manager = setup.small_manager
req = setup.small_request


# -- prefix-hit statistics per interval ------------------------------------------


def test_take_prefix_cache_stats_reads_one_interval_and_resets() -> None:
    mgr = manager([setup.fa(4)], 20)
    a = req("A", range(1, 10))
    mgr.get_computed_blocks(a)
    assert mgr.allocate_slots(a, 9) is not None
    # B shares A's two full blocks: 8 of its 9 tokens hit.
    mgr.get_computed_blocks(req("B", range(1, 10)))
    first = mgr.take_prefix_cache_stats()
    assert (first.requests, first.queries, first.hits) == (2, 18, 8)
    assert first.hit_rate == 8 / 18
    # The next interval starts at zero and counts only its own lookups.
    empty = mgr.take_prefix_cache_stats()
    assert (empty.requests, empty.queries, empty.hits) == (0, 0, 0)
    mgr.get_computed_blocks(req("C", range(1, 6)))
    second = mgr.take_prefix_cache_stats()
    assert (second.requests, second.queries, second.hits) == (1, 5, 4)
    assert mgr.prefix_cache_stats.requests == 0


# -- releases on a processed-tokens basis -------------------------------------------


def _prefilled_window_request() -> tuple[KVCacheManager, Request]:
    """A window-8 group of 4-token blocks; A's 20-token prefill holds blocks
    1-5 and its first output token is scheduled next."""
    mgr = manager([setup.sw(4, 8)], 20)
    a = req("A", range(1, 21))
    assert mgr.allocate_slots(a, 20) is not None
    a.num_computed_tokens = 20
    a.append_output_token_ids(7)
    return mgr, a


def test_synchronous_step_releases_blocks_out_of_the_window() -> None:
    mgr, a = _prefilled_window_request()
    out = mgr.allocate_slots(a, 1)
    assert out is not None
    assert out.get_block_ids() == ([6],)
    # Token 20 reads tokens 13-20: blocks 1-3 (tokens 0-11) go back.
    assert mgr.get_block_ids("A") == ([0, 0, 0, 4, 5, 6],)
    assert mgr.get_num_free_blocks() == 16


def test_no_block_an_in_flight_step_reads_is_released() -> None:
    mgr, a = _prefilled_window_request()
    # Asynchronous scheduling: the decode step is scheduled while the
    # prefill (all 20 computed tokens) is still in flight and reads blocks 1-5.
    out = mgr.allocate_slots(a, 1, num_in_flight_tokens=20)
    assert out is not None
    assert out.get_block_ids() == ([6],)
    assert mgr.get_block_ids("A") == ([1, 2, 3, 4, 5, 6],)
    assert mgr.get_num_free_blocks() == 13
    # The prefill completes: the engine releases on what is processed now.
    mgr.remove_skipped_blocks(a, 20)
    assert mgr.get_block_ids("A") == ([0, 0, 0, 4, 5, 6],)
    assert mgr.get_num_free_blocks() == 16


def test_in_flight_tokens_release_only_below_the_processed_tokens() -> None:
    mgr, a = _prefilled_window_request()
    # 8 of the 20 tokens still in flight: 12 processed, token 12 reads
    # tokens 5-12, so only block 1 (tokens 0-3) is unread.
    out = mgr.allocate_slots(a, 1, num_in_flight_tokens=8)
    assert out is not None
    assert mgr.get_block_ids("A") == ([0, 2, 3, 4, 5, 6],)
    assert mgr.get_num_free_blocks() == 14


def test_remove_skipped_blocks_checks_its_request_and_count() -> None:
    mgr, a = _prefilled_window_request()
    with pytest.raises(UnknownRequestError, match="'B' holds no blocks"):
        mgr.remove_skipped_blocks("B", 4)
    with pytest.raises(InvalidRequestError, match="num_tokens must be a non-negative"):
        mgr.remove_skipped_blocks(a, -1)
    with pytest.raises(InvalidRequestError, match="num_in_flight_tokens must be"):
        mgr.allocate_slots(a, 1, num_in_flight_tokens=-1)
    # Past the 20 computed tokens: it would release what the next step reads.
    with pytest.raises(InvalidRequestError, match="past the 20 tokens it has computed"):
        mgr.remove_skipped_blocks(a, 400)
    assert mgr.get_block_ids("A") == ([1, 2, 3, 4, 5],)


# -- reserved blocks ------------------------------------------------------------------


def test_reserved_blocks_stay_free() -> None:
    mgr = manager([setup.fa(4)], 10)
    # 9 usable blocks; A needs 3 (12 tokens).
    a = req("A", range(1, 13))
    assert mgr.allocate_slots(a, 12, reserved_blocks=7) is None
    assert mgr.get_num_free_blocks() == 9
    with pytest.raises(UnknownRequestError):
        mgr.get_block_ids("A")
    out = mgr.allocate_slots(a, 12, reserved_blocks=6)
    assert out is not None
    assert out.get_block_ids() == ([1, 2, 3],)
    assert mgr.get_num_free_blocks() == 6


# -- evicting chosen cached blocks ------------------------------------------------


def test_evict_blocks_drops_the_chosen_keys_only() -> None:
    mgr = manager([setup.fa(4)], 10)
    a = req("A", range(1, 13))
    assert mgr.allocate_slots(a, 12) is not None
    mgr.free(a)
    # Blocks 1-3 hold A's three full blocks; B's lookup hits 8 of 12 tokens.
    assert mgr.get_computed_blocks(req("B", range(1, 13)))[1] == 8
    # Block 2 (tokens 4-7) is stale: the hit now stops before it.
    assert mgr.evict_blocks({2, 0}) == 1
    blocks, hit = mgr.get_computed_blocks(req("C", range(1, 13)))
    assert (blocks.get_block_ids(), hit) == (([1],), 4)
    # A block without a key (evicted already) is passed over.
    assert mgr.evict_blocks([2]) == 0
    assert mgr.get_num_free_blocks() == 9


def test_evict_blocks_refuses_ids_outside_the_pool() -> None:
    mgr = manager([setup.fa(4)], 10)
    a = req("A", range(1, 9))
    assert mgr.allocate_slots(a, 8) is not None
    with pytest.raises(InvalidRequestError, match=r"block ids \[10\] are not blocks"):
        mgr.evict_blocks([1, 10])
    # Nothing changed: block 1 still serves the hit.
    assert mgr.get_computed_blocks(req("B", range(1, 10)))[1] == 8


# -- admitting a hit with no new tokens ---------------------------------------------


def test_a_hit_is_admitted_with_no_new_tokens() -> None:
    mgr = manager([setup.fa(4)], 10)
    a = req("A", range(1, 13))
    assert mgr.allocate_slots(a, 12) is not None
    b = req("B", range(1, 13))
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8
    # A chunk that only adopts the hit: no slot of its own.
    out = mgr.allocate_slots(b, 0, num_hit, hit)
    assert out is not None
    assert out.get_block_ids() == ([],)
    assert mgr.get_block_ids("B") == ([1, 2],)
    assert mgr.get_num_free_blocks() == 6
    # The next chunk computes the rest.
    b.num_computed_tokens = 8
    out = mgr.allocate_slots(b, 4)
    assert out is not None
    assert out.get_block_ids() == ([4],)
    # Without a hit, zero new tokens is still refused.
    with pytest.raises(InvalidRequestError, match="asks for 0 new tokens"):
        mgr.allocate_slots(req("C", range(50, 60)), 0)


# -- deferred frees -------------------------------------------------------------------


def test_deferred_free_holds_blocks_until_released() -> None:
    mgr = manager([setup.fa(4)], 10)
    a = req("A", range(1, 13))
    assert mgr.allocate_slots(a, 12) is not None
    # A finishes while the step that computed it is still in flight.
    blocks = mgr.pop_blocks_for_free(a)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert a.status is RequestStatus.FINISHED
    assert mgr.get_num_free_blocks() == 6
    # Nobody is given A's blocks meanwhile: B takes the other six only.
    b = req("B", range(100, 125))
    assert mgr.allocate_slots(b, 25) is None
    out = mgr.allocate_slots(b, 24)
    assert out is not None
    assert set(out.get_block_ids()[0]).isdisjoint({1, 2, 3})
    mgr.free(b)
    # The step completes: the blocks come back, A's prefix still cached.
    mgr.release_blocks(blocks)
    assert mgr.get_num_free_blocks() == 9
    assert mgr.get_computed_blocks(req("C", range(1, 13)))[1] == 8
    with pytest.raises(InvalidRequestError):
        mgr.release_blocks(blocks)
    assert mgr.get_num_free_blocks() == 9


def test_a_list_released_twice_is_refused_once_its_blocks_are_reused() -> None:
    mgr = manager([setup.fa(4)], 4)
    a = req("A", range(1, 9))
    assert mgr.allocate_slots(a, 8) is not None
    blocks = mgr.pop_blocks_for_free(a)
    mgr.release_blocks(blocks)
    # B takes every block, A's two among them: a second release of A's
    # list would drop B's references.
    b = req("B", range(100, 112))
    assert mgr.allocate_slots(b, 12) is not None
    assert mgr.get_num_free_blocks() == 0
    with pytest.raises(InvalidRequestError, match="not held for release"):
        mgr.release_blocks(blocks)
    with pytest.raises(InvalidRequestError, match="not held for release"):
        mgr.release_blocks(mgr.get_blocks("B").blocks[0])
    assert mgr.get_num_free_blocks() == 0
    assert mgr.get_block_ids("B") == ([3, 2, 1],)


def test_a_list_released_twice_is_refused_while_another_list_shares_it() -> None:
    """B hit all of A's blocks; both finish with a step in flight. A's list
    released twice is refused: the second release would drop B's
    references while B's step still reads them. A list cut short or with
    a block twice is refused too; B's own list, in any order, is taken."""
    mgr = manager([setup.fa(4)], 8)
    a = req("A", range(1, 9))
    assert mgr.allocate_slots(a, 8) is not None
    a.num_computed_tokens = 8
    b = req("B", [*range(1, 9), 50, 51, 52, 53])
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8
    assert mgr.allocate_slots(b, 4, num_hit, hit) is not None
    listed_a = mgr.pop_blocks_for_free(a)
    listed_b = mgr.pop_blocks_for_free(b)
    mgr.release_blocks(listed_a)
    held = [mgr.block_pool.ref_cnt[block.block_id] for block in listed_b]
    for bad in (listed_a, listed_b[:2], [*listed_b, listed_b[0]]):
        with pytest.raises(InvalidRequestError, match="not held for release"):
            mgr.release_blocks(bad)
    assert [mgr.block_pool.ref_cnt[block.block_id] for block in listed_b] == held
    assert held == [1, 1, 1]
    mgr.release_blocks(listed_b[::-1])
    assert mgr.get_num_free_blocks() == 7


@pytest.mark.parametrize("sizes", [(4,), (4, 8)], ids=["one group", "two groups"])
def test_a_list_released_in_another_order_is_freed_as_handed_out(
    sizes: tuple[int, ...],
) -> None:
    """The order a list comes back in does not matter: it is freed as a
    free of its request would free it, tail first."""

    def order(how: str) -> list[int]:
        specs = [setup.fa(size) for size in sizes]
        mgr = setup.manager_for(specs, 40, scheduler_block_size=8, hash_block_size=4)
        a = req("A", range(1, 25))
        assert mgr.allocate_slots(a, 24) is not None
        if how == "free":
            mgr.free(a)
        else:
            blocks = mgr.pop_blocks_for_free(a)
            mgr.release_blocks(blocks[::-1] if how == "reversed" else blocks)
        return mgr.block_pool.eviction_order()

    assert order("reversed") == order("as handed out") == order("free")


def _state_request_finished(
    deferred: bool, other_first: bool
) -> tuple[list[int], set[int]]:
    """The pool's eviction order once a request R of a full-attention and
    Mamba hybrid has decoded past several state blocks (releasing states
    it keeps) and finished, with another request freed too: ``deferred``,
    R's blocks are popped first and released last (the other freed in
    between); otherwise both are freed directly (``other_first``: the
    other one first).  Also R's states still in its table at the end."""
    mgr = setup.state_hybrid(200, 16)
    r = Request("R", list(range(5000, 5040)), hash_block_size=16)
    o = Request("O", list(range(9000, 9040)), hash_block_size=16)
    for request in (r, o):
        hit, num_hit = mgr.get_computed_blocks(request)
        assert mgr.allocate_slots(request, 40 - num_hit, num_hit, hit) is not None
        request.num_computed_tokens = 40
    for i in range(40):
        r.append_output_token_ids(7000 + i)
        mgr.remove_skipped_blocks(r, r.num_computed_tokens)
        assert mgr.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
    # R released states it keeps for later hits: they wait held back.
    assert mgr.block_pool.free_queue.held_blocks()
    in_table = {b for b in mgr.get_block_ids("R")[1] if b}
    if deferred:
        blocks = mgr.pop_blocks_for_free(r)
        mgr.free(o)
        mgr.release_blocks(blocks)
    elif other_first:
        mgr.free(o)
        mgr.free(r)
    else:
        mgr.free(r)
        mgr.free(o)
    return mgr.block_pool.eviction_order(), in_table


def test_a_deferred_free_queues_blocks_as_a_free_when_released() -> None:
    """A free deferred until its step completes queues the request's
    blocks, and the released states it kept behind them, exactly as a free
    at release time does: after every block freed meanwhile."""
    order, in_table = _state_request_finished(deferred=True, other_first=True)
    direct, _ = _state_request_finished(deferred=False, other_first=True)
    early, _ = _state_request_finished(deferred=False, other_first=False)
    assert in_table
    assert order == direct
    assert order != early


def _window_request(name: str = "R") -> tuple[KVCacheManager, Request]:
    """A request of a full-attention and sliding-window plan that has run
    past its window: the window blocks it released wait held back, free,
    for later requests' hits on its prefix."""
    mgr = manager([setup.fa(4), setup.sw(4, 8)], 40)
    r = req(name, range(1, 25))
    _prefill_and_decode(mgr, r, 16)
    assert mgr.block_pool.free_queue.held_blocks()
    return mgr, r


def _prefill_and_decode(mgr: KVCacheManager, r: Request, outputs: int) -> None:
    """Compute the 24-token prompt in three steps, then decode ``outputs``."""
    for n in (8, 8, 8):
        assert mgr.allocate_slots(r, n) is not None
        r.num_computed_tokens += n
    for i in range(outputs):
        r.append_output_token_ids(99 + i)
        assert mgr.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1


def test_a_deferred_free_takes_no_free_block_while_its_step_runs() -> None:
    """Popping a request holds its own blocks only: the window blocks it
    held back stay free (and given out if needed) until the release."""
    mgr, r = _window_request()
    before = max(n for n in range(4, 64, 4) if _admits(copy.deepcopy(mgr), n))
    held = list(mgr.block_pool.free_queue.held_blocks())
    free = mgr.get_num_free_blocks()
    blocks = mgr.pop_blocks_for_free(r)
    assert mgr.get_num_free_blocks() == free
    assert [mgr.block_pool.ref_cnt[b] for b in held] == [0] * len(held)
    assert not {b.block_id for b in blocks} & set(held)
    # The longest fresh prompt that fits beside R running fits after the pop.
    assert _admits(copy.deepcopy(mgr), before)
    mgr.release_blocks(blocks)
    assert mgr.get_num_free_blocks() == 39


def _admits(mgr: KVCacheManager, num_tokens: int) -> bool:
    fresh = req("F", range(5000, 5000 + num_tokens))
    return mgr.allocate_slots(fresh, num_tokens) is not None


def _window_finished(deferred: bool, name: str = "Q") -> list[int]:
    """The eviction order once Q hit R's prefix (taking some blocks R held
    back) and both finished: R popped, Q freed, R's list released; or
    (not ``deferred``) Q freed, then R."""
    mgr, r = _window_request()
    q = req(name, [*range(1, 25), 777, 778, 779, 780])
    hit, num_hit = mgr.get_computed_blocks(q)
    assert num_hit == 24
    assert mgr.allocate_slots(q, 4, num_hit, hit) is not None
    q.num_computed_tokens = 28
    if deferred:
        blocks = mgr.pop_blocks_for_free(r)
        mgr.free(q)
        mgr.release_blocks(blocks)
    else:
        mgr.free(q)
        mgr.free(r)
    return mgr.block_pool.eviction_order()


def test_a_deferred_free_rejoins_held_back_blocks_when_released() -> None:
    """The blocks R held back rejoin its table at the release, as a free
    then does: those Q took and freed meanwhile are queued among R's
    blocks by their positions, not where Q's free left them."""
    assert _window_finished(deferred=True) == _window_finished(deferred=False)


def test_an_id_reused_before_the_release_keeps_its_records() -> None:
    """A new request under the popped request's id (its id is free at the
    pop) holds back its own blocks; the old list's release takes only the
    old request's, and each free queues its blocks as under another id."""

    def run(name: str) -> list[int]:
        mgr, r = _window_request()
        blocks = mgr.pop_blocks_for_free(r)
        again = req(name, range(300, 324))
        _prefill_and_decode(mgr, again, 12)
        mgr.release_blocks(blocks)
        mgr.free(again)
        return mgr.block_pool.eviction_order()

    assert run("R") == run("S")


# -- bounded lookups ------------------------------------------------------------------


def test_lookup_bounded_by_a_maximum_hit_length() -> None:
    mgr = manager([setup.fa(4)], 10)
    a = req("A", range(1, 14))
    assert mgr.allocate_slots(a, 13) is not None
    assert mgr.get_computed_blocks(req("B", range(1, 14)))[1] == 12
    # Bounded at 10 tokens: the hit ends on the block boundary below it.
    blocks, hit = mgr.get_computed_blocks(req("C", range(1, 14)), 10)
    assert (blocks.get_block_ids(), hit) == (([1, 2],), 8)
    assert mgr.get_computed_blocks(req("D", range(1, 14)), 0)[1] == 0
    with pytest.raises(InvalidRequestError, match="max_cache_hit_length must be"):
        mgr.get_computed_blocks(req("E", range(1, 14)), -1)
