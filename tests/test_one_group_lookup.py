"""The one-group lookup: a plan of one group searched left to right in
blocks of the hash size has its prefix-cache lookup inlined in
``get_computed_blocks``.  It must answer every lookup exactly as the
coordinator's search does, and stand aside where it cannot."""

from __future__ import annotations

import copy
import pickle
import random
from typing import Any
from unittest import mock

import coordinator_setup as setup
import pytest

from kvcore.coordinator import KVCacheCoordinator, KVCacheManager, Request
from kvcore.errors import InvalidRequestError, KvcoreError


def manager(num_blocks: int = 24, **options: Any) -> KVCacheManager:
    options.setdefault("scheduler_block_size", 4)
    options.setdefault("hash_block_size", 4)
    return setup.manager_for([setup.fa(4)], num_blocks, **options)


def general(mgr: KVCacheManager) -> KVCacheManager:
    """``mgr`` with the inlined lookup removed: every lookup goes through the
    coordinator."""
    mgr._one_prefix = None
    return mgr


def answer(mgr: KVCacheManager, req: Request) -> tuple[Any, ...]:
    """A lookup's result and what it leaves behind."""
    try:
        blocks, hit = mgr.get_computed_blocks(req)
    except KvcoreError as exc:
        return ("error", type(exc), str(exc))
    stats = mgr.prefix_cache_stats
    return (
        hit,
        blocks.get_block_ids(),
        blocks is mgr.empty_kv_cache_blocks,
        (stats.requests, stats.queries, stats.hits),
        mgr.coordinator.last_shared_prefix,
    )


def state(mgr: KVCacheManager) -> tuple[Any, ...]:
    pool = mgr.block_pool
    return (
        [b.block_id for b in pool.free_queue.get_all_free_blocks()],
        [(b.block_id, b.ref_cnt, b.key_hash) for b in pool.blocks],
        sorted(mgr._requests),
    )


def test_only_a_plain_one_group_plan_inlines_its_lookup() -> None:
    assert manager()._one_prefix is not None
    # Hashed in smaller chunks than the group's blocks: the coordinator
    # groups the hashes first.
    assert (
        setup.manager_for(
            [setup.fa(8)], 24, scheduler_block_size=8, hash_block_size=4
        )._one_prefix
        is None
    )
    assert manager(use_eagle=True)._one_prefix is None
    assert (
        setup.manager_for(
            [setup.fa(4), setup.sw(4, 8)], 24, scheduler_block_size=4, hash_block_size=4
        )._one_prefix
        is None
    )
    # With caching off a lookup finds nothing and counts nothing.
    off = manager(enable_caching=False)
    blocks, hit = off.get_computed_blocks(
        Request("a", list(range(2, 20)), hash_block_size=4)
    )
    assert (blocks, hit) == (off.empty_kv_cache_blocks, 0)
    assert off.prefix_cache_stats.requests == 0


@pytest.mark.parametrize("seed", range(6))
def test_the_inlined_lookup_answers_as_the_coordinator(seed: int) -> None:
    """A random trace run twice, once with the inlined lookup and once
    through the coordinator: every lookup's hit, blocks, statistics and
    the pool after each step agree.  Prompts share prefixes (hits), some
    repeat exactly (a whole last block cached: the last token is still
    recomputed), some are admitted without their hit (two blocks holding
    one key), the pool runs dry (evictions cut hits short), and some
    requests skip reading the cache."""
    rng = random.Random(seed)
    fast, slow = manager(), general(manager())
    prefixes = [
        [rng.randrange(2, 60) for _ in range(rng.randrange(0, 14))] for _ in range(3)
    ]
    live: list[str] = []
    seen: list[list[int]] = []
    for step in range(120):
        if live and rng.random() < 0.4:
            rid = live.pop(rng.randrange(len(live)))
            fast.free(rid)
            slow.free(rid)
        else:
            if seen and rng.random() < 0.25:
                # A prompt seen before: its last block may be cached whole.
                tokens = rng.choice(seen)
            else:
                tokens = rng.choice(prefixes) + [
                    rng.randrange(2, 60) for _ in range(rng.randrange(1, 10))
                ]
                seen.append(tokens)
            skip = rng.random() < 0.1
            use_hit = rng.random() < 0.8
            outs = []
            for mgr in (fast, slow):
                req = Request(
                    f"r{step}",
                    tokens,
                    hash_block_size=4,
                    skip_reading_prefix_cache=skip,
                )
                got = answer(mgr, req)
                blocks, hit = mgr.get_computed_blocks(req) if use_hit else (None, 0)
                out = mgr.allocate_slots(req, len(tokens) - hit, hit, blocks)
                outs.append((got, out is None))
            assert outs[0] == outs[1]
            if not outs[0][1]:
                live.append(f"r{step}")
        assert state(fast) == state(slow)


def test_a_duplicated_key_serves_one_of_its_blocks() -> None:
    """Two requests with one prompt admitted without hits hold two blocks
    under each key; a lookup gets one block per key, as the coordinator's."""
    tokens = list(range(2, 14))
    answers = []
    for mgr in (manager(), general(manager())):
        for rid in ("a", "b"):
            assert mgr.allocate_slots(Request(rid, tokens, hash_block_size=4), 12)
        cached = mgr.block_pool.cached_blocks_of(0)
        assert any(type(e) is dict for e in cached.values())
        answers.append(answer(mgr, Request("c", tokens, hash_block_size=4)))
    assert answers[0] == answers[1]
    # The last block is cached too, but the last token is recomputed.
    assert answers[0][0] == 8


def test_the_inlined_lookup_refuses_what_the_coordinator_refuses() -> None:
    for mgr in (manager(), general(manager())):
        with pytest.raises(InvalidRequestError, match="hashed at 8 tokens per chunk"):
            mgr.get_computed_blocks(Request("a", list(range(20)), hash_block_size=8))
        with pytest.raises(InvalidRequestError, match="hashed at None tokens"):
            mgr.get_computed_blocks(Request("b", list(range(20)), hash_block_size=None))
        with pytest.raises(TypeError):
            mgr.get_computed_blocks("c")  # type: ignore[arg-type]
        assert mgr.prefix_cache_stats.requests == 0


def test_a_request_subclass_is_checked_through_its_own_properties() -> None:
    class Rehashed(Request):
        __slots__ = ()

        @property
        def hash_block_size(self) -> int | None:
            return 8

    mgr = manager()
    with pytest.raises(InvalidRequestError, match="hashed at 8 tokens per chunk"):
        mgr.get_computed_blocks(Rehashed("a", list(range(20)), hash_block_size=4))


def test_a_hit_from_the_inlined_lookup_is_tied_to_its_manager() -> None:
    tokens = list(range(2, 20))
    first, other = manager(), manager()
    for mgr in (first, other):
        assert mgr.allocate_slots(Request("a", tokens, hash_block_size=4), 18)
        mgr.free("a")
    req = Request("b", tokens, hash_block_size=4)
    blocks, hit = first.get_computed_blocks(req)
    assert hit == 16
    before = state(other)
    with pytest.raises(InvalidRequestError, match="this manager's get_computed_blocks"):
        other.allocate_slots(req, len(tokens) - hit, hit, blocks)
    assert state(other) == before
    assert first.allocate_slots(req, len(tokens) - hit, hit, blocks) is not None


def test_a_search_patched_onto_the_coordinator_later_sees_every_lookup() -> None:
    mgr = manager()
    assert mgr._one_prefix is not None
    assert mgr.allocate_slots(Request("a", list(range(2, 20)), hash_block_size=4), 18)
    original = KVCacheCoordinator.find_longest_cache_hit
    with mock.patch.object(
        KVCacheCoordinator,
        "find_longest_cache_hit",
        autospec=True,
        side_effect=original,
    ) as spy:
        _, hit = mgr.get_computed_blocks(
            Request("b", list(range(2, 20)), hash_block_size=4)
        )
    assert spy.call_count == 1
    assert hit == 16


def test_a_coordinator_subclass_with_its_own_search_is_searched() -> None:
    calls: list[int] = []

    class Counting(KVCacheCoordinator):
        def find_longest_cache_hit(self, *args: Any) -> Any:
            calls.append(1)
            return super().find_longest_cache_hit(*args)

    with mock.patch("kvcore.coordinator.kv_cache_manager.KVCacheCoordinator", Counting):
        mgr = manager()
    assert type(mgr.coordinator) is Counting
    assert mgr._one_prefix is None
    mgr.get_computed_blocks(Request("a", list(range(2, 20)), hash_block_size=4))
    assert calls == [1]


@pytest.mark.parametrize("clone", ["deepcopy", "pickle"])
def test_a_copied_manager_looks_up_in_its_own_pool(clone: str) -> None:
    mgr = manager()
    fork = (
        copy.deepcopy(mgr) if clone == "deepcopy" else pickle.loads(pickle.dumps(mgr))
    )
    assert fork._one_prefix is not None
    assert fork._one_prefix[0] is fork.block_pool.cached_blocks_of(0)
    assert fork._one_prefix[0] is not mgr.block_pool.cached_blocks_of(0)
    tokens = list(range(2, 20))
    assert fork.allocate_slots(Request("a", tokens, hash_block_size=4), 18)
    assert fork.get_computed_blocks(Request("b", tokens, hash_block_size=4))[1] == 16
    assert mgr.get_computed_blocks(Request("b", tokens, hash_block_size=4))[1] == 0


@pytest.mark.parametrize("where", ["class-single-hit", "instance"])
def test_parts_of_the_search_patched_later_see_every_lookup(where: str) -> None:
    """The coordinator's one-group search patched after construction, on
    its class or on the coordinator itself, runs instead of the inlined
    lookup (here it refuses every hit)."""
    mgr = manager()
    tokens = list(range(2, 20))
    assert mgr.allocate_slots(Request("a", tokens, hash_block_size=4), 18)
    coordinator = mgr.coordinator

    def refuse(*args: Any, **kwargs: Any) -> Any:
        return ([],), 0

    if where == "instance":
        with mock.patch.object(coordinator, "find_longest_cache_hit", refuse):
            hit = mgr.get_computed_blocks(Request("b", tokens, hash_block_size=4))[1]
    else:
        with mock.patch.object(KVCacheCoordinator, "_single_hit", refuse):
            hit = mgr.get_computed_blocks(Request("b", tokens, hash_block_size=4))[1]
    assert hit == 0
    assert mgr.get_computed_blocks(Request("c", tokens, hash_block_size=4))[1] == 16


def test_a_subclass_checking_requests_itself_is_asked_on_every_lookup() -> None:
    checked: list[str] = []

    class Checking(KVCacheManager):
        def _check_hashing(self, request: Request) -> None:
            checked.append(request.request_id)
            super()._check_hashing(request)

    mgr = setup.manager_for(
        [setup.fa(4)],
        24,
        scheduler_block_size=4,
        hash_block_size=4,
        registry=setup.BUILT_IN,
    )
    mgr.__class__ = Checking
    mgr._bind_methods()
    assert mgr._one_prefix is None
    mgr.get_computed_blocks(Request("a", list(range(2, 20)), hash_block_size=4))
    assert checked == ["a"]


def test_a_search_patched_onto_the_coordinator_itself_later_is_used() -> None:
    mgr = manager()
    tokens = list(range(2, 20))
    assert mgr.allocate_slots(Request("a", tokens, hash_block_size=4), 18)
    with mock.patch.object(
        mgr.coordinator, "_single_hit", return_value=(([],), 0)
    ) as spy:
        hit = mgr.get_computed_blocks(Request("b", tokens, hash_block_size=4))[1]
    assert (hit, spy.call_count) == (0, 1)
