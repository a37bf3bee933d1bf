"""Copies, failures and plugins through the public API: a manager deep-copies
and pickles with its pool, a copy runs on its own, every manager's step is a
transaction, and a manager class defined outside kvcore runs as the built-in
one it is configured like."""

from __future__ import annotations

import copy
import importlib.metadata
import pickle
import random
from typing import Any

import coordinator_setup as setup
import pytest
import torch

from kvcore import KindRegistry
from kvcore.coordinator import KVCacheManager, Request, RequestStatus
from kvcore.errors import (
    InvalidRequestError,
    KvcoreError,
    PluginError,
    ReentrantCallError,
    UnknownRequestError,
)
from kvcore_full_attention import FullAttention, FullAttentionSpec
from kvcore_full_attention.manager import FullAttentionManager


def observed(mgr: KVCacheManager) -> tuple[Any, ...]:
    """What an engine can observe: eviction order, counts, keys, tables."""
    pool = mgr.block_pool
    ref, key_hash, key_group = pool.ref_cnt, pool.key_hash, pool.key_group
    return (
        pool.free_queue.get_all_free_blocks(),
        [
            (b, ref[b], None if key_hash[b] is None else (key_hash[b], key_group[b]))
            for b in range(pool.num_blocks)
        ],
        pool.num_cached_blocks,
        sorted(mgr.live_request_ids()),
        [
            (
                {rid: list(t) for rid, t in m.req_to_blocks.items()},
                dict(m.num_cached_block),
                dict(m.num_released),
            )
            for m in mgr.coordinator.single_type_managers
        ],
    )


class ThirdPartyManager(FullAttentionManager):
    """A manager class defined outside kvcore's packages, configured like
    the built-in full attention's."""


class ThirdPartyFullAttention(FullAttention):
    """The built-in full-attention kind with the manager above."""

    manager_type = ThirdPartyManager


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_large_pool_loaded_through_plugins_copies_and_pickles(how: str) -> None:
    """A manager whose registry came from a plugin manager (as an engine's
    does), over 20,000 blocks, cached, free and in use, deep-copies and
    pickles by default; the copy keeps the distributions its errors name,
    and both sides then answer the same steps alike."""
    mgr = setup.manager_for(
        [setup.fa(4), setup.sw(4, 8)],
        20_000,
        scheduler_block_size=4,
        hash_block_size=4,
        registry=setup.builtin_registry(),
    )
    shared = [7] * 8
    for i in range(30):
        req = Request(
            f"r{i}", shared + list(range(i * 100, i * 100 + 30)), hash_block_size=4
        )
        blocks, hit = mgr.get_computed_blocks(req)
        assert mgr.allocate_slots(req, 38 - hit, hit, blocks) is not None
        if i % 3:
            mgr.free(req)
    clone = copy.deepcopy(mgr) if how == "deepcopy" else pickle.loads(pickle.dumps(mgr))
    assert observed(clone) == observed(mgr)
    assert mgr.block_pool.num_cached_blocks > 0
    hits = []
    for side in (mgr, clone):
        req = Request("x", shared + list(range(40)), hash_block_size=4)
        blocks, hit = side.get_computed_blocks(req)
        assert side.allocate_slots(req, 48 - hit, hit, blocks) is not None
        hits.append(hit)
        for i in range(0, 30, 3):
            side.free(f"r{i}")
    assert hits[0] == hits[1] > 0
    assert observed(clone) == observed(mgr)
    # The error a group's failure raises names the same plugin and
    # distribution on the copy, whose plugin manager was dropped.
    for gid in range(mgr.num_kv_cache_groups):
        named = [
            (err.plugin_name, err.distribution, str(err))
            for side in (mgr, clone)
            for err in [side.coordinator.plugin_error(gid, "free", RuntimeError("x"))]
        ]
        assert named[0] == named[1]
        # Built-in plugins name kvcore's distribution where kvcore is
        # installed (not where it runs from a source tree on sys.path).
        assert (named[0][1] is not None) == _installed("kvcore")


@pytest.mark.parametrize("thread_safe", [False, True])
@pytest.mark.parametrize(
    "specs",
    [[setup.fa(4)], [setup.fa(4), setup.sw(4, 8)], [setup.fa(4), setup.mamba(4)]],
    ids=["one-group", "two-groups", "state-hybrid"],
)
def test_a_copied_manager_runs_on_its_own(specs: list[Any], thread_safe: bool) -> None:
    """A deep copy (a what-if fork) shares nothing with its original: each
    side's steps leave the other alone, and the two agree on the same
    steps; a thread-safe copy has its own lock."""
    mgr = setup.manager_for(
        specs, 48, scheduler_block_size=4, hash_block_size=4, thread_safe=thread_safe
    )
    req = Request("a", list(range(2, 12)), hash_block_size=4)
    assert mgr.allocate_slots(req, 10) is not None
    # Copied together, the fork's manager holds the copy of the request.
    fork, grown = copy.deepcopy((mgr, req))
    before = observed(mgr)
    assert observed(fork) == before
    grown.num_computed_tokens = 10
    assert fork.allocate_slots(grown, 3) is not None
    assert observed(mgr) == before
    req.num_computed_tokens = 10
    assert mgr.allocate_slots(req, 3) is not None
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


def test_free_refuses_an_unknown_id_and_finishes_every_object_of_a_live_id() -> None:
    mgr = setup.manager_for(
        [setup.fa(4)], 64, scheduler_block_size=4, hash_block_size=4
    )
    with pytest.raises(UnknownRequestError, match="holds no blocks"):
        mgr.free("never-seen")
    req = Request("a", list(range(10)), hash_block_size=4)
    assert mgr.allocate_slots(req, 10) is not None
    # A second object with the live id is marked finished with the first.
    same = Request("a", list(range(10)), hash_block_size=4)
    mgr.free(same)
    assert req.status is same.status is RequestStatus.FINISHED
    with pytest.raises(UnknownRequestError):
        mgr.free(req)
    assert mgr.block_pool.get_num_free_blocks() == 63


@pytest.mark.parametrize("groups", [1, 2])
def test_free_reports_a_double_free_and_changes_nothing(groups: int) -> None:
    """A table whose block lost its reference behind the manager's back:
    the release refuses it and leaves every count, the queue and the
    tables as they were; the request stays live."""
    mgr = setup.manager_for(
        [setup.fa(4)] * groups, 64, scheduler_block_size=4, hash_block_size=4
    )
    req = Request("a", list(range(10)), hash_block_size=4)
    assert mgr.allocate_slots(req, 10) is not None
    table = mgr.get_blocks("a").ids[0]
    ref = mgr.block_pool.ref_cnt
    ref[table[1]] = 0
    before = observed(mgr)
    with pytest.raises(InvalidRequestError, match="freed more often") as info:
        mgr.free(req)
    assert isinstance(info.value, KvcoreError)
    assert observed(mgr) == before
    assert req.status is RequestStatus.RUNNING
    ref[table[1]] = 1
    mgr.free("a")
    assert req.status is RequestStatus.FINISHED
    assert mgr.block_pool.get_num_free_blocks() == 63


def test_a_thread_safe_manager_frees_under_its_lock() -> None:
    mgr = setup.manager_for(
        [setup.fa(4)], 16, scheduler_block_size=4, hash_block_size=4, thread_safe=True
    )
    req = Request("a", list(range(6)), hash_block_size=4)
    assert mgr.allocate_slots(req, 6) is not None
    assert mgr.lock is not None
    assert getattr(mgr.free, "__wrapped__", None) is not None
    mgr.free(req)
    assert mgr.block_pool.get_num_free_blocks() == 15


def test_a_prompt_shorter_than_the_hit_unit_searches_no_group() -> None:
    """Blocks of 16 and 64 tokens and whole-block hits: hits come in
    64-token units, so a 40-token prompt gets none without any group being
    searched; a 100-token prompt is searched and hits its first unit.  The
    searches are seen by a third-party kind whose manager logs them."""
    searched: list[int] = []

    class LoggingManager(FullAttentionManager):
        @classmethod
        def find_longest_cache_hit(cls, query: Any) -> list[list[Any]]:
            searched.append(query.max_length)
            return super().find_longest_cache_hit(query)

    class LoggingFullAttention(FullAttention):
        manager_type = LoggingManager

    mgr = setup.manager_for(
        [setup.fa(16), setup.fa(64)],
        64,
        scheduler_block_size=64,
        hash_block_size=16,
        enable_partial_hits=False,
        registry=KindRegistry.from_kinds([LoggingFullAttention()]),
    )
    tokens = list(range(100))
    first = Request("first", tokens, hash_block_size=16)
    assert mgr.allocate_slots(first, 100) is not None
    mgr.free(first)
    searched.clear()
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
    req = Request("a", list(range(2, 12)), hash_block_size=4)
    assert mgr.allocate_slots(req, 10) is not None
    mgr.free(req)
    assert calls == ["a"]
    assert req.status is RequestStatus.FINISHED
    assert mgr.block_pool.get_num_free_blocks() == 15


class FailingManager(FullAttentionManager):
    """The built-in full-attention manager, made to raise in one step on
    demand (``fail``: the method's name), as a faulty plugin's would."""

    fail: str | None = None

    def pop_blocks(self, *args: Any, **kwargs: Any) -> Any:
        if self.fail == "pop_blocks":
            raise RuntimeError("free failed")
        return super().pop_blocks(*args, **kwargs)

    def allocate_twins(self, *args: Any, **kwargs: Any) -> Any:
        if self.fail == "allocate_twins":
            raise RuntimeError("grow failed")
        return super().allocate_twins(*args, **kwargs)


class FailingFullAttention(FullAttention):
    """The built-in full-attention kind with the manager above."""

    manager_type = FailingManager


def _running_in_two_groups(
    kind: FullAttention,
) -> tuple[KVCacheManager, Request, Any]:
    """A manager of two full-attention groups of ``kind`` (two specs, so the
    groups are not twins and each is stepped on its own), a request running
    in it with 10 tokens computed, and the second group's manager."""
    other = FullAttentionSpec(
        block_size=4, num_kv_heads=1, head_size=2, dtype=torch.float16
    )
    mgr = setup.manager_for(
        [setup.fa(4), other],
        32,
        scheduler_block_size=4,
        hash_block_size=4,
        registry=KindRegistry.from_kinds([kind]),
    )
    req = Request("a", list(range(2, 12)), hash_block_size=4)
    assert mgr.allocate_slots(req, 10) is not None
    req.num_computed_tokens = 10
    return mgr, req, mgr.coordinator.single_type_managers[1]


@pytest.mark.parametrize("step", ["free", "grow"])
def test_a_manager_that_raises_leaves_everything_as_it_was(step: str) -> None:
    """Transactions hold for a manager that runs kvcore's own full-attention
    steps: a group manager that raises mid-step (here the second group's,
    after the first has changed the pool) is reported as its plugin's
    failure, and the pool, tables, keys and the request are as before."""
    mgr, req, manager = _running_in_two_groups(FailingFullAttention())
    assert isinstance(manager, FailingManager)
    manager.fail = "pop_blocks" if step == "free" else "allocate_twins"
    before = observed(mgr)
    run = (
        (lambda: mgr.free(req))
        if step == "free"
        else (lambda: mgr.allocate_slots(req, 4))
    )
    with pytest.raises(KvcoreError, match=f"{step} failed"):
        run()
    assert observed(mgr) == before
    assert req.status is RequestStatus.RUNNING
    manager.fail = None
    assert mgr.allocate_slots(req, 4) is not None
    mgr.free(req)
    assert mgr.block_pool.get_num_free_blocks() == 31


def test_a_duplicated_key_serves_one_of_its_blocks() -> None:
    """Two requests with one prompt admitted without hits hold two blocks
    under each key; a lookup gets the first block of each key."""
    mgr = setup.manager_for(
        [setup.fa(4)], 24, scheduler_block_size=4, hash_block_size=4
    )
    tokens = list(range(2, 14))
    for rid in ("a", "b"):
        assert mgr.allocate_slots(Request(rid, tokens, hash_block_size=4), 12)
    cached = mgr.block_pool.cached_blocks_of(0)
    assert any(type(e) is dict for e in cached.values())
    blocks, hit = mgr.get_computed_blocks(Request("c", tokens, hash_block_size=4))
    # The last block is cached too, but the last token is recomputed.
    assert hit == 8
    assert blocks.get_block_ids() == (mgr.get_block_ids("a")[0][:2],)


def test_a_hit_is_tied_to_the_manager_that_looked_it_up() -> None:
    tokens = list(range(2, 20))
    first, other = (
        setup.manager_for([setup.fa(4)], 24, scheduler_block_size=4, hash_block_size=4)
        for _ in range(2)
    )
    for mgr in (first, other):
        assert mgr.allocate_slots(Request("a", tokens, hash_block_size=4), 18)
        mgr.free("a")
    req = Request("b", tokens, hash_block_size=4)
    blocks, hit = first.get_computed_blocks(req)
    assert hit == 16
    before = observed(other)
    with pytest.raises(InvalidRequestError, match="this manager's get_computed_blocks"):
        other.allocate_slots(req, len(tokens) - hit, hit, blocks)
    assert observed(other) == before
    assert first.allocate_slots(req, len(tokens) - hit, hit, blocks) is not None


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("events", [False, True])
def test_a_manager_defined_outside_kvcore_runs_as_the_built_in_one(
    seed: int, events: bool
) -> None:
    """The same random workload (shared prefixes, hits, decode steps,
    frees, refusals) through the built-in full-attention kind and through a
    third-party kind configured like it: the same hits, blocks, eviction
    order, keys and events."""
    third = KindRegistry.from_kinds([ThirdPartyFullAttention()])
    sides = [
        setup.manager_for(
            [setup.fa(4), setup.fa(4)],
            40,
            scheduler_block_size=4,
            hash_block_size=4,
            enable_kv_cache_events=events,
            **({"registry": third} if third_party else {}),
        )
        for third_party in (False, True)
    ]
    assert type(sides[1].coordinator.single_type_managers[0]) is ThirdPartyManager
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    traces: list[list[Any]] = [[], []]
    for side, trace in zip(sides, traces, strict=True):
        rng = random.Random(seed)
        live: list[Request] = []
        for step in range(120):
            if live and rng.random() < 0.35:
                req = live.pop(rng.randrange(len(live)))
                side.free(req)
                trace.append(("free", req.request_id))
            elif live and rng.random() < 0.5:
                req = rng.choice(live)
                req.append_output_token_ids(rng.randrange(50))
                out = side.allocate_slots(req, 1)
                trace.append(("grow", out and out.get_block_ids()))
                if out is not None:
                    req.num_computed_tokens += 1
            else:
                prompt = rng.choice(prefixes) + [
                    rng.randrange(50) for _ in range(rng.randrange(1, 10))
                ]
                req = Request(f"r{step}", prompt, hash_block_size=4)
                blocks, hit = side.get_computed_blocks(req)
                out = side.allocate_slots(req, len(prompt) - hit, hit, blocks)
                trace.append(("admit", hit, out and out.get_block_ids()))
                if out is not None:
                    req.num_computed_tokens = len(prompt)
                    live.append(req)
            trace.append(observed(side))
            trace.append(side.take_events())
    assert traces[0] == traces[1]


class CopyingManager(FullAttentionManager):
    """A faulty third-party manager: it deep-copies (or pickles) the
    object in ``target`` from inside its step."""

    target: Any = None
    how: str = "deepcopy"

    def allocate_twins(self, *args: Any, **kwargs: Any) -> Any:
        out = super().allocate_twins(*args, **kwargs)
        if self.target is not None:
            if self.how == "deepcopy":
                copy.deepcopy(self.target)
            else:
                pickle.dumps(self.target)
        return out


class CopyingFullAttention(FullAttention):
    manager_type = CopyingManager


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("what", ["manager", "pool", "itself"])
def test_a_manager_copying_inside_its_step_has_the_step_undone(
    how: str, what: str
) -> None:
    """A cache manager that copies the KVCacheManager calling it (or the
    pool, or itself, which holds the pool) from inside a step is refused;
    the refusal propagates as its plugin's failure, the whole step is
    undone, and between steps the same copy works."""
    mgr, req, manager = _running_in_two_groups(CopyingFullAttention())
    assert isinstance(manager, CopyingManager)
    target = {"manager": mgr, "pool": mgr.block_pool, "itself": manager}[what]
    manager.target, manager.how = target, how
    before = observed(mgr)
    with pytest.raises(PluginError) as info:
        mgr.allocate_slots(req, 4)
    assert isinstance(info.value.__cause__, ReentrantCallError)
    assert "between steps" in str(info.value.__cause__)
    assert observed(mgr) == before
    manager.target = None
    fork = (
        pickle.loads(pickle.dumps(target)) if how == "pickle" else copy.deepcopy(target)
    )
    assert type(fork) is type(target)
    assert mgr.allocate_slots(req, 4) is not None
    mgr.free(req)
    assert mgr.block_pool.get_num_free_blocks() == 31


def _installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
