"""The one-group fast paths agree with the general path they shadow.

A manager over one vetted group binds shortcuts as instance attributes
(``KVCacheManager.free``; the coordinator's admission steps).  Each test runs
the same steps on a manager with the shortcut and on one with it removed, and
compares what an engine can observe: the free queue in eviction order, the
counts, the hits, the request statuses and the errors.
"""

from __future__ import annotations

import random
from typing import Any

import coordinator_setup as setup
import pytest

from kvcore.coordinator import KVCacheManager, Request, RequestStatus
from kvcore.errors import InvalidRequestError, KvcoreError, UnknownRequestError


def pair(specs: list[Any], num_blocks: int = 64) -> tuple[KVCacheManager, ...]:
    fast = setup.manager_for(
        specs, num_blocks, scheduler_block_size=4, hash_block_size=4
    )
    general = setup.manager_for(
        specs, num_blocks, scheduler_block_size=4, hash_block_size=4
    )
    del general.__dict__["free"]
    return fast, general


def observed(mgr: KVCacheManager) -> tuple[Any, ...]:
    pool = mgr.block_pool
    return (
        [b.block_id for b in pool.free_queue.get_all_free_blocks()],
        [(b.block_id, b.ref_cnt) for b in pool.blocks],
        pool.num_cached_blocks,
        sorted(mgr._requests),
        [
            (
                sorted(m.req_to_blocks),
                sorted(m.num_cached_block),
                sorted(m.num_released),
            )
            for m in mgr._managers
        ],
    )


@pytest.mark.parametrize(
    "specs",
    [[setup.fa(4)], [setup.sw(4, 8)]],
    ids=["full-attention", "sliding-window"],
)
def test_one_group_free_takes_the_fast_path(specs: list[Any]) -> None:
    fast, _ = pair(specs)
    assert "free" in fast.__dict__


def test_a_state_hybrid_frees_through_the_coordinator() -> None:
    mgr = setup.manager_for(
        [setup.fa(4), setup.mamba(4)],
        64,
        scheduler_block_size=4,
        hash_block_size=4,
    )
    assert "free" not in mgr.__dict__


@pytest.mark.parametrize(
    "specs",
    [[setup.fa(4)], [setup.sw(4, 8)]],
    ids=["full-attention", "sliding-window"],
)
@pytest.mark.parametrize("seed", range(4))
def test_fast_free_matches_the_general_path(specs: list[Any], seed: int) -> None:
    """Random admissions, decodes and frees (by object and by id, with
    shared prefixes so frees drop references other requests keep)."""
    managers = pair(specs, num_blocks=48)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100) for _ in range(8)] for _ in range(3)]
    live: list[str] = []
    for step in range(120):
        action = rng.random()
        if action < 0.45 or not live:
            rid = f"r{step}"
            prompt = rng.choice(prefixes) + [
                rng.randrange(100) for _ in range(rng.randrange(1, 14))
            ]
            outs = []
            for mgr in managers:
                req = Request(rid, prompt, hash_block_size=4)
                blocks, hit = mgr.get_computed_blocks(req)
                outs.append(
                    (hit, mgr.allocate_slots(req, len(prompt) - hit, hit, blocks))
                )
            assert outs[0][0] == outs[1][0]
            assert (outs[0][1] is None) == (outs[1][1] is None)
            if outs[0][1] is not None:
                live.append(rid)
        elif action < 0.7:
            rid = rng.choice(live)
            grew = {
                mgr.allocate_slots(mgr._requests[rid], 1) is not None
                for mgr in managers
            }
            assert len(grew) == 1
        else:
            rid = live.pop(rng.randrange(len(live)))
            by_id = rng.random() < 0.5
            held = [mgr._requests[rid] for mgr in managers]
            for mgr, req in zip(managers, held, strict=True):
                mgr.free(rid if by_id else req)
                assert req.status is RequestStatus.FINISHED
        assert observed(managers[0]) == observed(managers[1])


def test_fast_free_errors_match_the_general_path() -> None:
    for mgr in pair([setup.fa(4)]):
        with pytest.raises(UnknownRequestError, match="holds no blocks"):
            mgr.free("never-seen")
        req = Request("a", list(range(10)), hash_block_size=4)
        assert mgr.allocate_slots(req, 10) is not None
        # A second object with the live id is marked finished with the first.
        twin = Request("a", list(range(10)), hash_block_size=4)
        mgr.free(twin)
        assert req.status is twin.status is RequestStatus.FINISHED
        with pytest.raises(UnknownRequestError):
            mgr.free(req)
        assert mgr.block_pool.get_num_free_blocks() == 63


def test_fast_free_reports_a_double_free_and_changes_nothing() -> None:
    """A table whose block lost its reference behind the manager's back:
    the release refuses it and leaves every count as it was."""
    results = []
    for mgr in pair([setup.fa(4)]):
        req = Request("a", list(range(10)), hash_block_size=4)
        assert mgr.allocate_slots(req, 10) is not None
        table = mgr._managers[0].req_to_blocks["a"]
        table[1].ref_cnt = 0
        before = [b.ref_cnt for b in mgr.block_pool.blocks]
        with pytest.raises(InvalidRequestError) as info:
            mgr.free(req)
        assert isinstance(info.value, KvcoreError)
        assert [b.ref_cnt for b in mgr.block_pool.blocks] == before
        results.append(
            (
                str(info.value),
                mgr.block_pool.get_num_free_blocks(),
                sorted(mgr._requests),
            )
        )
        # The request is still known: freeing it again finishes it.
        mgr.free("a")
        assert req.status is RequestStatus.FINISHED
    assert results[0] == results[1]


def test_thread_safe_manager_locks_the_fast_free() -> None:
    mgr = setup.manager_for(
        [setup.fa(4)], 16, scheduler_block_size=4, hash_block_size=4, thread_safe=True
    )
    req = Request("a", list(range(6)), hash_block_size=4)
    assert mgr.allocate_slots(req, 6) is not None
    assert mgr.lock is not None
    free = mgr.__dict__["free"]
    assert getattr(free, "__wrapped__", None) is not None
    mgr.free(req)
    assert mgr.block_pool.get_num_free_blocks() == 15


def test_a_prompt_shorter_than_the_hit_unit_searches_no_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Blocks of 16 and 64 tokens and whole-block hits: hits come in
    64-token units, so a 40-token prompt gets none without any group being
    searched; a 100-token prompt is searched and hits its first unit."""
    mgr = setup.manager_for(
        [setup.fa(16), setup.fa(64)],
        64,
        scheduler_block_size=64,
        hash_block_size=16,
        enable_partial_hits=False,
    )
    tokens = list(range(100))
    first = Request("first", tokens, hash_block_size=16)
    assert mgr.allocate_slots(first, 100) is not None
    mgr.free(first)
    searched: list[int] = []
    for manager in mgr._managers:
        original = type(manager).find_longest_cache_hit

        def spy(query: Any, original: Any = original) -> Any:
            searched.append(query.max_length)
            return original(query)

        monkeypatch.setattr(type(manager), "find_longest_cache_hit", spy)
    short = Request("short", tokens[:40], hash_block_size=16)
    assert mgr.get_computed_blocks(short)[1] == 0
    assert searched == []
    again = Request("again", tokens, hash_block_size=16)
    assert mgr.get_computed_blocks(again)[1] == 64
    assert searched


def test_a_subclass_overriding_free_keeps_its_override() -> None:
    calls: list[str] = []

    class Logging(KVCacheManager):
        def free(self, request: Request | str) -> None:
            calls.append(request if isinstance(request, str) else request.request_id)
            super().free(request)

    config = setup.KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[setup.KVCacheGroupSpec(["layer.0"], setup.fa(4))],
    )
    mgr = Logging(
        config, 4096, scheduler_block_size=4, hash_block_size=4, registry=setup.BUILT_IN
    )
    assert "free" not in mgr.__dict__
    req = Request("a", list(range(2, 12)), hash_block_size=4)
    assert mgr.allocate_slots(req, 10) is not None
    mgr.free(req)
    assert calls == ["a"]
    assert req.status is RequestStatus.FINISHED
    assert mgr.block_pool.get_num_free_blocks() == 15


def test_a_plan_marked_unvetted_later_frees_through_the_checked_path() -> None:
    """A manager whose method is replaced on the instance is not kvcore's
    own any more (the coordinator's ``vetted`` cleared, as the partial-hit
    tests do): free runs its pop_blocks, reports its failure as the
    plugin's, and leaves the request holding its blocks."""
    mgr = setup.manager_for(
        [setup.fa(4)], 16, scheduler_block_size=4, hash_block_size=4
    )
    req = Request("a", list(range(2, 12)), hash_block_size=4)
    assert mgr.allocate_slots(req, 10) is not None
    manager = mgr._managers[0]

    def broken(request_id: str) -> None:
        raise RuntimeError("pop_blocks failed")

    manager.pop_blocks = broken  # type: ignore[method-assign]
    mgr.coordinator.vetted = False
    with pytest.raises(KvcoreError, match="pop_blocks failed"):
        mgr.free(req)
    assert req.status is RequestStatus.RUNNING
    assert mgr.block_pool.get_num_free_blocks() == 12
    assert "a" in manager.req_to_blocks


@pytest.mark.parametrize("thread_safe", [False, True])
@pytest.mark.parametrize(
    "specs",
    [[setup.fa(4)], [setup.fa(4), setup.sw(4, 8)], [setup.fa(4), setup.mamba(4)]],
    ids=["one-group", "two-groups", "state-hybrid"],
)
def test_a_copied_manager_runs_on_its_own(specs: list[Any], thread_safe: bool) -> None:
    """The shortcuts a manager binds close over its own state; a deep copy
    (a what-if fork) binds its own, so each side's steps leave the other
    alone and the two agree on the same steps."""
    import copy

    mgr = setup.manager_for(
        specs, 48, scheduler_block_size=4, hash_block_size=4, thread_safe=thread_safe
    )
    req = Request("a", list(range(2, 12)), hash_block_size=4)
    assert mgr.allocate_slots(req, 10) is not None
    fork = copy.deepcopy(mgr)
    before = observed(mgr)
    assert observed(fork) == before
    fork.free("a")
    assert observed(mgr) == before
    assert req.status is RequestStatus.RUNNING
    mgr.free("a")
    assert req.status is RequestStatus.FINISHED
    assert observed(mgr) == observed(fork)
    hits = []
    for side in (mgr, fork):
        other = Request("b", list(range(2, 20)), hash_block_size=4)
        blocks, hit = side.get_computed_blocks(other)
        assert side.allocate_slots(other, 18 - hit, hit, blocks) is not None
        hits.append(hit)
    assert hits[0] == hits[1] > 0
    assert observed(mgr) == observed(fork)
    if thread_safe:
        assert fork.lock is not None
        assert fork.lock is not mgr.lock
