"""Hand-worked steps: exact admission, transactional steps, hits tied to their
manager, ``free`` leaving handed-out lists alone, and constructor checks.

Block ids come from the free queue, which starts in id order with block 0
taken out as the null block; within a step groups allocate in group order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import attrs
import coordinator_setup as setup
import pytest
import torch

import kvcore
import kvcore.tools.zoo
from kvcore import AttentionKind, KindRegistry, KVCacheConfig, KVCacheGroupSpec
from kvcore.coordinator import KVCacheManager, Request, RequestStatus
from kvcore.errors import PluginResultError
from kvcore.spec import AttentionSpec
from kvcore_full_attention import FullAttentionSpec
from kvcore_full_attention.manager import FullAttentionManager
from kvcore_sliding_window import SlidingWindowSpec


def fa(block_size: int = 4) -> FullAttentionSpec:
    return setup.fa(block_size)


def replay_window(block_size: int = 16, window: int = 32) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=8,
        dtype=torch.float16,
        sliding_window=window,
        bounded_replay=True,
    )


def manager(
    specs: Sequence[object],
    num_blocks: int,
    *,
    block_size: int = 4,
    max_model_len: int = 64,
    **kw: Any,
) -> KVCacheManager:
    return setup.manager_for(
        specs,
        num_blocks,
        scheduler_block_size=block_size,
        hash_block_size=block_size,
        max_model_len=max_model_len,
        **kw,
    )


def pool_state(mgr: KVCacheManager) -> tuple[object, ...]:
    """Everything a step may change in the pool: ref counts, free-queue
    order, every block's prefix-cache key and the cache's entries."""
    pool = mgr.block_pool
    key_hash, key_group = pool.key_hash, pool.key_group
    return (
        list(pool.ref_cnt),
        pool.free_queue.get_all_free_blocks(),
        pool.free_queue.num_free,
        [
            None if key_hash[b] is None else (key_hash[b], key_group[b])
            for b in range(pool.num_blocks)
        ],
        pool.num_cached_blocks,
    )


def real(ids: list[int]) -> int:
    return sum(1 for i in ids if i)


# ---------------------------------------------------------------------------
# 1. exact admission
# ---------------------------------------------------------------------------


def prefill(mgr: KVCacheManager, r: Request, chunk: int) -> None:
    while r.num_computed_tokens < r.num_tokens:
        n = min(chunk, r.num_tokens - r.num_computed_tokens)
        assert mgr.allocate_slots(r, n) is not None
        r.num_computed_tokens += n


def test_replay_window_beside_a_hit_takes_only_the_window() -> None:
    # Full attention (block 16) + a 32-token bounded-replay window (block 16,
    # never hashed).  100 blocks -> 99 usable.  A (1,025 tokens) prefills in
    # 256-token chunks: 65 full-attention blocks; the window holds positions
    # from skipped(1024) = (1024 - 31) // 16 = 62 up to 64: 3 blocks.
    # Free: 99 - 68 = 31.
    mgr = manager([fa(16), replay_window()], 100, block_size=16, max_model_len=4096)
    a = Request("A", [*range(1, 1025), 7], hash_block_size=16)
    prefill(mgr, a, 256)
    assert [real(t) for t in mgr.get_block_ids("A")] == [65, 3]
    assert mgr.get_num_free_blocks() == 31
    # B shares A's first 1,024 tokens: a hit of 64 full-attention blocks (all
    # held by A).  Its step covers 1,025 tokens with 1,024 computed:
    # full attention 65 - 64 = 1 new block; the window 65 positions, the
    # first 62 skipped (null), so 3 blocks.  4 in all, not 66.
    b = Request("B", [*range(1, 1025), 9], hash_block_size=16)
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 1024
    out = mgr.allocate_slots(b, 1, hit, blocks)
    assert out is not None
    assert [len(g) for g in out.ids] == [1, 3]
    assert mgr.get_num_free_blocks() == 27
    window = mgr.get_block_ids("B")[1]
    assert len(window) == 65
    assert window[:62] == [0] * 62
    assert real(window) == 3
    # The next step (1,025 computed) skips (1025 - 31) // 16 = 62 positions:
    # nothing more to release, and 1,026 tokens still fit in 65 blocks.
    b.num_computed_tokens = 1025
    b.append_output_token_ids(5)
    assert mgr.allocate_slots(b, 1) is not None
    assert mgr.get_num_free_blocks() == 27


@pytest.mark.parametrize(("free", "fits"), [(3, False), (4, True)])
def test_replay_window_admission_is_refused_only_below_its_need(
    free: int, fits: bool
) -> None:
    # The plan above; after A, 31 blocks are free and B's step needs 4.  The
    # test takes blocks straight from the pool until ``free`` are left.
    mgr = manager([fa(16), replay_window()], 100, block_size=16, max_model_len=4096)
    a = Request("A", [*range(1, 1025), 7], hash_block_size=16)
    prefill(mgr, a, 256)
    mgr.block_pool.get_new_blocks(31 - free)
    b = Request("B", [*range(1, 1025), 9], hash_block_size=16)
    blocks, hit = mgr.get_computed_blocks(b)
    before = pool_state(mgr)
    out = mgr.allocate_slots(b, 1, hit, blocks)
    if fits:
        assert out is not None
        assert mgr.get_num_free_blocks() == 0
    else:
        assert out is None
        assert pool_state(mgr) == before
        assert b.status is RequestStatus.WAITING


def scout_manager(
    registry: KindRegistry, num_blocks: int
) -> tuple[KVCacheManager, list[str]]:
    mgr = setup.zoo_manager("llama-4-scout-17b-16e", registry, num_blocks, 32768)
    kinds = [type(m).__name__ for m in mgr.coordinator.single_type_managers]
    return mgr, kinds


def test_chunked_local_groups_beside_a_hit_take_one_block(
    zoo_registry: KindRegistry,
) -> None:
    # Llama-4-Scout: 3 chunked-local groups (chunk 8192, block 16) and one
    # full-attention group.  A (16,400 tokens) prefills in 4,096-token steps;
    # each chunked group ends holding the blocks of its current chunk from
    # token 16,384: 1 block; full attention 1,025.  4,000 blocks -> 3,999
    # usable, 3,999 - 1,028 = 2,971 free.
    mgr, kinds = scout_manager(zoo_registry, 4000)
    assert kinds == ["ChunkedLocalManager"] * 3 + ["FullAttentionManager"]
    prefix = list(range(1, 16385))
    a = Request("A", prefix + [7] * 16, hash_block_size=16)
    prefill(mgr, a, 4096)
    assert [real(t) for t in mgr.get_block_ids("A")] == [1, 1, 1, 1025]
    assert mgr.get_num_free_blocks() == 2971
    # B's hit: 16,384 tokens = 1,024 full-attention blocks held by A.  Its
    # step covers 16,400 tokens with 16,384 computed: each chunked group
    # skips the 1,024 blocks of its two completed chunks and takes 1 block
    # (not 1,025); full attention takes 1,025 - 1,024 = 1.
    b = Request("B", prefix + [9] * 16, hash_block_size=16)
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 16384
    out = mgr.allocate_slots(b, b.num_tokens - hit, hit, blocks)
    assert out is not None
    assert [len(g) for g in out.ids] == [1, 1, 1, 1]
    assert mgr.get_num_free_blocks() == 2971 - 4
    assert [real(t) for t in mgr.get_block_ids("B")] == [1, 1, 1, 1025]
    # One decode step: 16,401 tokens, 16,400 computed: positions 1,024 and
    # 1,025 of each chunked group are read or written: 2 blocks each.
    b.num_computed_tokens = b.num_tokens
    b.append_output_token_ids(5)
    assert mgr.allocate_slots(b, 1) is not None
    assert [real(t) for t in mgr.get_block_ids("B")] == [2, 2, 2, 1026]


# ---------------------------------------------------------------------------
# 2. transactional steps
# ---------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class BadSpec(AttentionSpec):
    kind: ClassVar[str] = "bad"


class BadManager(FullAttentionManager):
    """Full attention that raises in the method named by ``fail``."""

    fail: ClassVar[str] = ""

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[int]:
        new = super().allocate_new_blocks(request_id, num_tokens)
        if self.fail == "allocate_new_blocks":
            msg = "plugin manager bug"
            raise RuntimeError(msg)
        return new

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        super().cache_blocks(request, num_tokens)
        if self.fail == "cache_blocks":
            msg = "plugin manager bug"
            raise RuntimeError(msg)

    def pop_blocks(self, request_id: str) -> list[int] | None:
        if self.fail == "pop_blocks":
            msg = "plugin manager bug"
            raise RuntimeError(msg)
        return super().pop_blocks(request_id)


class Bad(AttentionKind):
    name: ClassVar[str] = "bad"
    spec_type = BadSpec
    manager_type = BadManager


class BadPlugin:
    @kvcore.hookimpl
    def kvcore_register_kinds(self) -> list[kvcore.CacheKind]:
        return [Bad()]


@pytest.fixture
def bad_manager() -> Any:
    pm = kvcore.get_plugin_manager(load_entrypoints=False)
    pm.register(BadPlugin(), name="bad")
    registry = KindRegistry.from_plugin_manager(pm)
    bad = BadSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16)
    yield manager([fa(), bad], 32, registry=registry, enable_kv_cache_events=True)
    BadManager.fail = ""


@pytest.mark.parametrize("method", ["allocate_new_blocks", "cache_blocks"])
def test_a_failing_manager_leaves_the_pool_as_it_was(
    bad_manager: KVCacheManager, method: str
) -> None:
    mgr = bad_manager
    # 32 blocks -> 31 usable.  r1 (12 tokens) takes 1, 2, 3 (full attention)
    # and 4, 5, 6 (bad), all hashed; freed, they go to the back of the queue.
    r1 = Request("r1", list(range(12)), hash_block_size=4)
    assert mgr.allocate_slots(r1, 12) is not None
    mgr.free(r1)
    mgr.take_events()
    # r2 (9 tokens) hits its first 8 tokens: 2 blocks per group.
    r2 = Request("r2", [*range(8), 99], hash_block_size=4)
    blocks, hit = mgr.get_computed_blocks(r2)
    assert (hit, blocks.get_block_ids()) == (8, ([1, 2], [4, 5]))
    before = pool_state(mgr)
    assert mgr.get_num_free_blocks() == 31
    BadManager.fail = method
    with pytest.raises(kvcore.PluginError, match=method) as info:
        mgr.allocate_slots(r2, 1, hit, blocks)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.plugin_name == "bad"
    assert "kind 'bad'" in str(err)
    assert "cache group 1" in str(err)
    assert isinstance(err.__cause__, RuntimeError)
    assert pool_state(mgr) == before
    assert mgr.get_num_free_blocks() == 31
    assert mgr.take_events() == []
    assert r2.status is RequestStatus.WAITING
    assert mgr.coordinator.get_blocks("r2") == ([], [])
    # Nothing leaked: with the bug gone the same step takes 2 hit blocks and
    # 1 new block per group.
    BadManager.fail = ""
    out = mgr.allocate_slots(r2, 1, hit, blocks)
    assert out is not None
    assert [len(g) for g in out.ids] == [1, 1]
    assert mgr.get_num_free_blocks() == 31 - 6


def test_a_failing_running_step_restores_the_tables(
    bad_manager: KVCacheManager,
) -> None:
    mgr = bad_manager
    r = Request("r", list(range(16)), hash_block_size=4)
    assert mgr.allocate_slots(r, 6) is not None
    r.num_computed_tokens = 6
    tables = mgr.get_block_ids("r")
    assert tables == ([1, 2], [3, 4])
    handed = mgr.get_blocks("r")
    before = pool_state(mgr)
    BadManager.fail = "allocate_new_blocks"
    with pytest.raises(kvcore.PluginError, match="allocate_new_blocks"):
        mgr.allocate_slots(r, 10)
    assert pool_state(mgr) == before
    assert mgr.get_block_ids("r") == tables
    assert handed.get_block_ids() == tables  # the same lists, put back
    BadManager.fail = ""
    out = mgr.allocate_slots(r, 10)
    assert out is not None
    assert out.get_block_ids() == ([5, 6], [7, 8])


@attrs.frozen(kw_only=True)
class CountingSpec(AttentionSpec):
    kind: ClassVar[str] = "counting"


class CountingManager(FullAttentionManager):
    """A plugin's manager with per-request state of its own (how many steps
    grew each request's table), recorded before it changes it."""

    keeps_request_state: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.grown: dict[str, int] = {}
        self.snapshots = 0

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[int]:
        new = super().allocate_new_blocks(request_id, num_tokens)
        if new:
            self.record_request_state(request_id)  # recorded by super already
            self.grown[request_id] = self.grown.get(request_id, 0) + 1
        return new

    def request_state(self, request_id: str) -> Any:
        self.snapshots += 1
        return self.grown.get(request_id)

    def restore_request_state(self, request_id: str, state: Any) -> None:
        if state is None:
            self.grown.pop(request_id, None)
        else:
            self.grown[request_id] = state


class Counting(AttentionKind):
    name: ClassVar[str] = "counting"
    spec_type = CountingSpec
    manager_type = CountingManager


class CountingPlugin:
    @kvcore.hookimpl
    def kvcore_register_kinds(self) -> list[kvcore.CacheKind]:
        return [Counting(), Bad()]


def test_a_plugins_own_request_state_is_recorded_once_and_put_back() -> None:
    pm = kvcore.get_plugin_manager(load_entrypoints=False)
    pm.register(CountingPlugin(), name="counting")
    registry = KindRegistry.from_plugin_manager(pm)
    specs = [
        CountingSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16),
        BadSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16),
    ]
    mgr = manager(specs, 32, registry=registry)
    counting = mgr.coordinator.single_type_managers[0]
    assert isinstance(counting, CountingManager)
    r = Request("r", list(range(16)), hash_block_size=4)
    assert mgr.allocate_slots(r, 6) is not None
    r.num_computed_tokens = 6
    # The step recorded the request's state once, before the kind's own
    # step ran, however many changes followed (its table, its hashed count,
    # its own).
    assert (counting.grown, counting.snapshots) == ({"r": 1}, 1)
    # So does a step of the kind's own that changes nothing: what it may
    # change is recorded before it runs.
    assert mgr.allocate_slots(r, 1) is mgr.empty_kv_cache_blocks
    r.num_computed_tokens = 7
    assert (counting.grown, counting.snapshots) == ({"r": 1}, 2)
    before = pool_state(mgr)
    try:
        BadManager.fail = "allocate_new_blocks"
        with pytest.raises(kvcore.PluginError, match="allocate_new_blocks"):
            mgr.allocate_slots(r, 5)
    finally:
        BadManager.fail = ""
    # The plugin's own state is put back with the pool and the tables.
    assert counting.grown == {"r": 1}
    assert pool_state(mgr) == before
    assert mgr.get_block_ids("r") == ([1, 2], [3, 4])
    assert mgr.allocate_slots(r, 5) is not None
    assert (counting.grown, counting.snapshots) == ({"r": 2}, 4)
    assert mgr.get_block_ids("r") == ([1, 2, 5], [3, 4, 6])


def test_a_failing_free_leaves_the_request_held(bad_manager: KVCacheManager) -> None:
    mgr = bad_manager
    r = Request("r", list(range(8)), hash_block_size=4)
    assert mgr.allocate_slots(r, 8) is not None
    before = pool_state(mgr)
    assert mgr.get_num_free_blocks() == 27
    BadManager.fail = "pop_blocks"
    with pytest.raises(kvcore.PluginError, match="pop_blocks") as info:
        mgr.free(r)
    assert info.value.plugin_name == "bad"
    assert pool_state(mgr) == before
    assert mgr.get_block_ids("r") == ([1, 2], [3, 4])
    assert r.status is RequestStatus.RUNNING
    BadManager.fail = ""
    mgr.free(r)
    assert mgr.get_num_free_blocks() == 31


class NegativeCount(FullAttentionManager):
    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[int],
    ) -> int:
        return -3


def test_a_manager_answering_a_bad_count_is_a_plugin_error() -> None:
    class Kind(AttentionKind):
        name: ClassVar[str] = "bad"
        spec_type = BadSpec
        manager_type = NegativeCount

    registry = KindRegistry.from_kinds([Kind()], owner="negative")
    bad = BadSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16)
    mgr = manager([bad], 8, registry=registry)
    before = pool_state(mgr)
    with pytest.raises(
        PluginResultError,
        match=r"NegativeCount.get_num_blocks_to_allocate of cache group 0 \(kind "
        r"'bad', plugin 'negative'\) returned -3 \(int\); a block count must be "
        r"an int of at least 0",
    ) as info:
        mgr.allocate_slots(Request("r", [1, 2, 3], hash_block_size=4), 3)
    assert info.value.plugin_name == "negative"
    assert pool_state(mgr) == before


# ---------------------------------------------------------------------------
# 3. a hit belongs to its manager; a live id to its request
# ---------------------------------------------------------------------------


def cached_manager() -> KVCacheManager:
    mgr = manager([fa()], 16)
    a = Request("a", list(range(12)), hash_block_size=4)
    assert mgr.allocate_slots(a, 12) is not None
    mgr.free(a)
    return mgr


def test_another_managers_hit_is_refused() -> None:
    first, second = cached_manager(), cached_manager()
    hit, n = first.get_computed_blocks(Request("r", list(range(13)), hash_block_size=4))
    assert (n, hit.get_block_ids()) == (12, ([1, 2, 3],))
    before = pool_state(first), pool_state(second)
    with pytest.raises(kvcore.InvalidRequestError, match="do not belong"):
        second.allocate_slots(
            Request("r", list(range(13)), hash_block_size=4), 1, n, hit
        )
    assert (pool_state(first), pool_state(second)) == before
    # The pools still work: 15 usable blocks each.
    x = Request("x", list(range(900, 960)), hash_block_size=4)
    assert first.allocate_slots(x, 60) is not None
    assert first.get_num_free_blocks() == 0


def test_a_live_id_with_other_tokens_is_refused() -> None:
    mgr = manager([fa()], 16)
    r = Request("r", list(range(8)), hash_block_size=4)
    assert mgr.allocate_slots(r, 8) is not None
    r.num_computed_tokens = 8
    before = pool_state(mgr)
    other = Request("r", list(range(100, 108)), hash_block_size=4)
    with pytest.raises(kvcore.InvalidRequestError, match="'r' already holds blocks"):
        mgr.allocate_slots(other, 4)
    assert pool_state(mgr) == before
    # The same tokens under a new object stand for the same request.
    same = Request("r", list(range(8)), hash_block_size=4)
    same.num_computed_tokens = 8
    assert mgr.allocate_slots(same, 4) is not None
    assert mgr.get_block_ids("r") == ([1, 2, 3],)


# ---------------------------------------------------------------------------
# 4. free leaves what get_blocks returned alone
# ---------------------------------------------------------------------------


def test_free_does_not_change_handed_out_lists() -> None:
    mgr = manager([fa()], 11, max_model_len=1024)
    a = Request("a", list(range(12)), hash_block_size=4)
    assert mgr.allocate_slots(a, 12) is not None
    held = mgr.get_blocks("a")
    assert held.get_block_ids() == ([1, 2, 3],)
    mgr.free("a")
    assert held.get_block_ids() == ([1, 2, 3],)
    assert [mgr.block_pool.ref_cnt[i] for i in (1, 2, 3)] == [0, 0, 0]
    # Freed tail first: the hashed blocks sit at the back as 3, 2, 1.
    free_ids = mgr.block_pool.free_queue.get_all_free_blocks()
    assert free_ids[-3:] == [3, 2, 1]


# ---------------------------------------------------------------------------
# 5. constructor arguments
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "error", "name"),
    [
        ({"enable_caching": 1}, kvcore.KvcoreTypeError, "enable_caching"),
        ({"use_eagle": "yes"}, kvcore.KvcoreTypeError, "use_eagle"),
        (
            {"enable_kv_cache_events": None},
            kvcore.KvcoreTypeError,
            "enable_kv_cache_events",
        ),
        ({"dcp": 0}, kvcore.KvcoreValueError, "dcp"),
        ({"dcp": 2.0}, kvcore.KvcoreTypeError, "dcp"),
        ({"dcp": True}, kvcore.KvcoreTypeError, "dcp"),
        ({"max_model_len": True}, kvcore.KvcoreTypeError, "max_model_len"),
        ({"max_model_len": -4}, kvcore.KvcoreValueError, "max_model_len"),
        ({"scheduler_block_size": 4.0}, kvcore.KvcoreTypeError, "scheduler_block_size"),
        ({"hash_block_size": 0}, kvcore.KvcoreValueError, "hash_block_size"),
        ({"registry": "default"}, kvcore.KvcoreTypeError, "registry"),
        ({"kv_cache_config": {}}, kvcore.KvcoreTypeError, "kv_cache_config"),
    ],
)
def test_constructor_arguments_are_checked(
    kw: dict[str, object], error: type[Exception], name: str
) -> None:
    config = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["l"], fa())],
    )
    args: dict[str, Any] = {
        "kv_cache_config": config,
        "max_model_len": 64,
        "scheduler_block_size": 4,
        "hash_block_size": 4,
    }
    args.update(kw)
    with pytest.raises(error, match=rf"KVCacheManager: {name} must be"):
        KVCacheManager(**args)


def test_twin_steps_built_from_a_one_group_override_return_what_they_promise() -> None:
    # A class overriding only the one-group steps gets twin steps that ask
    # each twin in turn: growth returns the blocks (None when no twin took
    # one), release and caching return nothing whatever the override
    # returns, pop and the kept answers return one answer per twin.
    class OneGroupSteps(FullAttentionManager):
        def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[int]:
            raise AssertionError

        def remove_skipped_blocks(self, request_id: str, num_computed: int) -> None:
            raise AssertionError

        def cache_blocks(self, request: Request, num_tokens: int) -> None:
            raise AssertionError

        def pop_blocks(self, request_id: str) -> list[int] | None:
            raise AssertionError

    class Twin:
        """A twin whose one-group steps answer as given (the twin steps
        call them through its class)."""

        def __init__(self, grown: list[int]) -> None:
            self.grown = grown

        def allocate_new_blocks(self, rid: str, n: int) -> list[int]:
            return self.grown

        def remove_skipped_blocks(self, rid: str, n: int) -> int:
            return 3

        def cache_blocks(self, request: object, n: int) -> int:
            return 3

        def pop_blocks(self, rid: str) -> None:
            return None

    a, b = Twin([]), Twin([7])
    cls: Any = OneGroupSteps
    assert cls.allocate_twins(a, [a, b], "r", 4) == [[], [7]]
    assert cls.allocate_twins(a, [a, a], "r", 4) is None
    assert cls.release_twins(a, [a, b], "r", 4) is None
    assert cls.cache_twins(a, [a, b], "r", 4) is None
    assert cls.pop_twins(a, [a, b], "r") == [None, None]
