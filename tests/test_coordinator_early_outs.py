"""The coordinator's early-outs: a ``cache_blocks`` call inside the
request's cache span asks no manager, and a running step that no class
grows, releases in or keys in returns at once.  Both rest on the managers'
promise flags (``caches_at_chunk_ends``, ``grows_by_count``,
``releases_by_count``); with them,
a manager does exactly what it does with both early-outs turned off, and a
step that raises leaves the spans as they were.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, ClassVar

import attrs
import coordinator_setup as setup
import pytest

from kvcore import KindRegistry
from kvcore.coordinator import KVCacheManager, Request, SingleTypeManager
from kvcore.errors import InvalidRequestError, KvcoreError, PluginError
from kvcore_full_attention import FullAttention, FullAttentionSpec
from kvcore_full_attention.manager import FullAttentionManager
from kvcore_mla import MLAAttentionSpec
from kvcore_sliding_window import SlidingWindow, SlidingWindowSpec
from kvcore_sliding_window.manager import SlidingWindowManager

# -- a manager that counts (and may fail) its steps ----------------------------


@attrs.frozen(kw_only=True)
class CountedSpec(FullAttentionSpec):
    kind: ClassVar[str] = "counted_attention"


class CountedManager(FullAttentionManager):
    """Full attention keeping its promises, counting its twin steps; it
    raises in the step named by ``fail``."""

    caches_at_chunk_ends: ClassVar[bool] = True
    grows_by_count: ClassVar[bool] = True
    calls: ClassVar[dict[str, int]] = {}
    fail: ClassVar[str] = ""

    def _count(self, step: str) -> None:
        CountedManager.calls[step] = CountedManager.calls.get(step, 0) + 1
        if CountedManager.fail == step:
            msg = "plugin manager bug"
            raise RuntimeError(msg)

    def allocate_twins(
        self, twins: Sequence[SingleTypeManager], request_id: str, num_tokens: int
    ) -> list[list[int]] | None:
        out = super().allocate_twins(twins, request_id, num_tokens)
        self._count("allocate_twins")
        return out

    def cache_twins(
        self, twins: Sequence[SingleTypeManager], request: Request, num_tokens: int
    ) -> None:
        super().cache_twins(twins, request, num_tokens)
        self._count("cache_twins")


class Counted(FullAttention):
    name: ClassVar[str] = "counted_attention"
    spec_type = CountedSpec
    manager_type = CountedManager


def counted(block_size: int = 4) -> CountedSpec:
    return CountedSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=setup.fa(4).dtype
    )


@attrs.frozen(kw_only=True)
class CountedWindowSpec(SlidingWindowSpec):
    kind: ClassVar[str] = "counted_window"


class CountedWindowManager(SlidingWindowManager):
    """A sliding window keeping its promises, counting its releases."""

    releases_by_count: ClassVar[bool] = True

    def release_twins(
        self,
        twins: Sequence[SingleTypeManager],
        request_id: str,
        num_computed_tokens: int,
    ) -> None:
        super().release_twins(twins, request_id, num_computed_tokens)
        CountedManager.calls["release_twins"] = (
            CountedManager.calls.get("release_twins", 0) + 1
        )


def _window(spec_type: type[SlidingWindowSpec], window: int) -> Any:
    """A one-head window layer of 4-token blocks, of ``spec_type``."""
    return spec_type(
        block_size=4,
        num_kv_heads=1,
        head_size=1,
        dtype=setup.fa(4).dtype,
        sliding_window=window,
    )


class CountedWindow(SlidingWindow):
    name: ClassVar[str] = "counted_window"
    spec_type = CountedWindowSpec
    manager_type = CountedWindowManager


@pytest.fixture
def counting() -> Any:
    CountedManager.calls.clear()
    registry = KindRegistry.from_kinds(
        [*setup.builtin_kinds(), Counted(), CountedWindow()]
    )
    yield lambda specs, num_blocks: setup.small_manager(
        specs, num_blocks, registry=registry, enable_kv_cache_events=True
    )
    CountedManager.calls.clear()
    CountedManager.fail = ""


def test_a_cache_call_inside_the_span_asks_no_manager(counting: Any) -> None:
    mgr: KVCacheManager = counting([counted()], 32)
    r = Request("r", list(range(1, 11)), hash_block_size=4)
    assert mgr.allocate_slots(r, 10, delay_cache_blocks=True) is not None
    r.num_computed_tokens = 5
    mgr.cache_blocks(r, 5)
    assert CountedManager.calls == {"allocate_twins": 1, "cache_twins": 1}
    # After a call at 5 tokens no chunk ends before 8: 5, 6 and 7 key
    # nothing, and no manager is asked.
    assert mgr.coordinator.cache_spans == {"r": (5, 8)}
    for n in (5, 6, 7):
        mgr.cache_blocks(r, n)
    assert CountedManager.calls["cache_twins"] == 1
    # A call below the span, or at a chunk end, asks the managers.
    mgr.cache_blocks(r, 4)
    assert CountedManager.calls["cache_twins"] == 2
    assert mgr.coordinator.cache_spans == {"r": (5, 8)}
    mgr.cache_blocks(r, 8)
    assert CountedManager.calls["cache_twins"] == 3
    assert mgr.block_pool.num_cached_blocks == 2
    assert mgr.coordinator.cache_spans == {"r": (9, 12)}
    # Past the 10 tokens its step was given slots for: refused, and the
    # span and the keys stay as they were.
    with pytest.raises(InvalidRequestError, match="past the 10 tokens"):
        mgr.cache_blocks(r, 13)
    assert mgr.coordinator.cache_spans == {"r": (9, 12)}
    assert mgr.block_pool.num_cached_blocks == 2
    mgr.free(r)
    assert mgr.coordinator.cache_spans == {}


def _idle_seventh_token(mgr: KVCacheManager) -> tuple[Request, dict[str, int]]:
    """Run a 6-token prompt, then the step of its 7th token, which fits the
    blocks held and ends no chunk: it must ask no manager.  The request and
    the calls counted before that step."""
    r = Request("r", list(range(1, 7)), hash_block_size=4)
    assert mgr.allocate_slots(r, 6) is not None
    r.num_computed_tokens = 6
    r.append_output_token_ids(7)
    calls = dict(CountedManager.calls)
    out = mgr.allocate_slots(r, 1)
    assert out is not None
    assert out.get_block_ids() == tuple([] for _ in range(mgr.num_kv_cache_groups))
    assert CountedManager.calls == calls
    return r, calls


def test_a_step_that_changes_nothing_returns_at_once(counting: Any) -> None:
    mgr: KVCacheManager = counting([counted()], 32)
    # 7 tokens fit the 2 blocks held and no chunk ends: nothing is asked.
    r, calls = _idle_seventh_token(mgr)
    r.num_computed_tokens = 7
    r.append_output_token_ids(8)
    # The 8th token ends a chunk: the step runs and caches inside it.
    assert mgr.allocate_slots(r, 1) is not None
    assert CountedManager.calls == {
        "allocate_twins": calls["allocate_twins"] + 1,
        "cache_twins": calls["cache_twins"] + 1,
    }
    assert mgr.block_pool.num_cached_blocks == 2
    r.num_computed_tokens = 8
    r.append_output_token_ids(9)
    # The 9th needs a third block: the class grows.
    out = mgr.allocate_slots(r, 1)
    assert out is not None
    assert out.get_block_ids() == ([3],)
    assert CountedManager.calls["allocate_twins"] == calls["allocate_twins"] + 2


def test_a_step_that_releases_nothing_returns_at_once(counting: Any) -> None:
    mgr: KVCacheManager = counting([counted(), _window(CountedWindowSpec, 4)], 32)
    # At 6 computed tokens the window (4 tokens) reads from token 2 on:
    # block 0 is still read, nothing is released, nothing grows or is
    # keyed, so no manager is asked.
    r, calls = _idle_seventh_token(mgr)
    assert all(b != 0 for b in mgr.get_block_ids("r")[1])
    for n, token in ((7, 8), (8, 9)):
        r.num_computed_tokens = n
        r.append_output_token_ids(token)
        assert mgr.allocate_slots(r, 1) is not None
    # At 8 computed tokens the window starts at token 4: block 0 of the
    # window group is released (the null block takes its place).
    assert CountedManager.calls["release_twins"] > calls.get("release_twins", 0)
    assert mgr.get_block_ids("r")[1][0] == 0
    assert mgr.get_block_ids("r")[0][0] != 0


def test_a_step_with_no_partial_key_due_returns_at_once() -> None:
    registry = KindRegistry.from_kinds([*setup.builtin_kinds(), Counted()])
    # 16-token blocks hashed every 4 tokens: a hit may end inside a block,
    # so the group keys a partial key at every chunk end inside a block.
    mgr = setup.manager_for(
        [counted(16)], 8, scheduler_block_size=16, hash_block_size=4, registry=registry
    )
    assert mgr.coordinator.partial is not None
    CountedManager.calls.clear()
    try:
        r = Request("r", list(range(1, 6)), hash_block_size=4)
        assert mgr.allocate_slots(r, 5) is not None
        assert mgr.block_pool.num_partial_keys == 0
        keyed = []
        for n in range(5, 13):
            r.num_computed_tokens = n
            r.append_output_token_ids(n + 1)
            before = dict(CountedManager.calls)
            assert mgr.allocate_slots(r, 1) is not None
            keyed.append(mgr.block_pool.num_partial_keys)
            asked = CountedManager.calls != before
            # A step registers the partial keys its computed tokens reach (4
            # at 5 computed, 8 at 8, 12 at 12), and the steps at 7 and 11
            # key the full chunks ending at 8 and 12; the others ask no
            # manager.
            assert asked == (n in (5, 7, 8, 11, 12)), n
        assert keyed == [1, 1, 1, 2, 2, 2, 2, 3]
    finally:
        CountedManager.calls.clear()


class RaisingWindowManager(SlidingWindowManager):
    """A window whose release rule raises once a request passes 6 tokens."""

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        if num_computed_tokens > 6:
            msg = "plugin bug"
            raise RuntimeError(msg)
        return super().num_skipped_blocks(num_computed_tokens)


def test_a_release_rule_that_raises_is_the_release_steps_failure() -> None:
    @attrs.frozen(kw_only=True)
    class RaisingSpec(SlidingWindowSpec):
        kind: ClassVar[str] = "raising_window"

    class Raising(SlidingWindow):
        name: ClassVar[str] = "raising_window"
        spec_type = RaisingSpec
        manager_type = RaisingWindowManager

    registry = KindRegistry.from_kinds([*setup.builtin_kinds(), Raising()])
    window = _window(RaisingSpec, 8)
    mgr = setup.small_manager([setup.fa(4), window], 32, registry=registry)
    r = Request("r", list(range(1, 7)), hash_block_size=4)
    assert mgr.allocate_slots(r, 6) is not None
    r.num_computed_tokens = 6
    r.append_output_token_ids(7)
    assert mgr.allocate_slots(r, 1) is not None
    r.num_computed_tokens = 7
    r.append_output_token_ids(8)
    tables = mgr.get_block_ids("r")
    free = mgr.get_num_free_blocks()
    with pytest.raises(PluginError, match="raised in remove_skipped_blocks") as info:
        mgr.allocate_slots(r, 1)
    assert "RaisingWindowManager of cache group 1" in str(info.value)
    assert "plugin bug" in str(info.value)
    assert mgr.get_block_ids("r") == tables
    assert mgr.get_num_free_blocks() == free


def test_overriding_a_step_drops_its_promise() -> None:
    class OwnCache(FullAttentionManager):
        def cache_blocks(self, request: Request, num_tokens: int) -> None:
            super().cache_blocks(request, num_tokens)

    class OwnGrowth(FullAttentionManager):
        def get_num_blocks_to_allocate(
            self,
            request_id: str,
            num_tokens: int,
            new_computed_blocks: Sequence[int],
        ) -> int:
            return super().get_num_blocks_to_allocate(
                request_id, num_tokens, new_computed_blocks
            )

    class OwnRelease(SlidingWindowManager):
        def remove_skipped_blocks(
            self, request_id: str, num_computed_tokens: int
        ) -> None:
            super().remove_skipped_blocks(request_id, num_computed_tokens)

    class Promised(OwnCache):
        caches_at_chunk_ends: ClassVar[bool] = True

    class Inherits(FullAttentionManager):
        """Overrides nothing: keeps its base's promises."""

    assert FullAttentionManager.caches_at_chunk_ends
    assert FullAttentionManager.grows_by_count
    assert not OwnCache.caches_at_chunk_ends
    assert OwnCache.grows_by_count
    assert OwnGrowth.caches_at_chunk_ends
    assert not OwnGrowth.grows_by_count
    assert Promised.caches_at_chunk_ends
    assert Inherits.caches_at_chunk_ends
    assert Inherits.grows_by_count
    assert SlidingWindowManager.releases_by_count
    assert Inherits.releases_by_count
    assert not OwnRelease.releases_by_count
    assert OwnRelease.grows_by_count
    assert CountedWindowManager.releases_by_count


def test_a_rolled_back_step_puts_the_spans_back(counting: Any) -> None:
    # Group 0 plain full attention, group 1 the counted manager.
    mgr: KVCacheManager = counting([setup.fa(4), counted()], 32)
    r = Request("r", list(range(1, 7)), hash_block_size=4)
    assert mgr.allocate_slots(r, 6) is not None
    r.num_computed_tokens = 6
    for token in (7, 8):
        r.append_output_token_ids(token)
    spans = dict(mgr.coordinator.cache_spans or {})
    assert spans == {"r": (6, 8)}
    tables = mgr.get_block_ids("r")
    # The step grows both groups (the span is dropped: the tables changed),
    # keys the second chunk in group 0, then group 1 raises while keying.
    CountedManager.fail = "cache_twins"
    with pytest.raises(PluginError):
        mgr.allocate_slots(r, 3)
    assert mgr.coordinator.cache_spans == spans
    assert mgr.get_block_ids("r") == tables
    assert mgr.block_pool.num_cached_blocks == 2
    CountedManager.fail = ""
    assert mgr.allocate_slots(r, 3) is not None
    assert mgr.block_pool.num_cached_blocks == 4
    assert mgr.coordinator.cache_spans == {"r": (9, 12)}


# -- the early-outs against the same manager without them ----------------------

#: name -> (specs, num_blocks, scheduler block, hash block, EAGLE)
PLANS: dict[str, tuple[list[Any], int, int, int, bool]] = {
    "full": ([setup.fa(4)], 40, 4, 4, False),
    "full_eagle": ([setup.fa(4)], 40, 4, 4, True),
    "full_sw": ([setup.fa(4), setup.sw(4, 8)], 64, 4, 4, False),
    "twins_mamba_turns": (
        [setup.fa(4), setup.fa(4), setup.mamba(4), setup.mamba(4)],
        96,
        4,
        4,
        False,
    ),
    "mamba_steps_eagle": (
        [setup.fa(4), setup.mamba(4, policy="steps")],
        64,
        4,
        4,
        True,
    ),
    "mamba_prompts": ([setup.fa(4), setup.mamba(8, policy="prompts")], 64, 8, 4, False),
    "mamba_all": ([setup.fa(4), setup.mamba(4, mode="all")], 96, 4, 4, False),
    # Partial hits: 16-token attention blocks, Mamba keyed every 8 tokens.
    "partial_fa16_sw_mamba8": (
        [setup.fa(16), setup.sw(4, 8), setup.mamba(8)],
        96,
        16,
        4,
        False,
    ),
    "mla16": (
        [
            MLAAttentionSpec(
                block_size=16,
                num_kv_heads=1,
                head_size=16,
                dtype=setup.fa(4).dtype,
                tokens_per_state=4,
            ),
            setup.sw(4, 8),
        ],
        64,
        16,
        4,
        False,
    ),
}


def _plain(mgr: KVCacheManager) -> KVCacheManager:
    """``mgr`` with both early-outs off: every call asks every manager."""
    mgr.coordinator.cache_spans = None
    mgr.coordinator.idle_steps = False
    return mgr


def _state(mgr: KVCacheManager) -> Any:
    pool = mgr.block_pool
    return (
        [
            (
                pool.ref_cnt[b],
                pool.key_hash[b],
                pool.key_group[b],
                tuple(pool.partial_keys[b] or ()),
            )
            for b in range(pool.num_blocks)
        ],
        pool.free_queue.get_all_free_blocks(),
        [
            (
                sorted((rid, list(t)) for rid, t in m.req_to_blocks.items()),
                sorted(m.num_cached_block.items()),
                sorted(m.num_released.items()),
            )
            for m in mgr.coordinator.single_type_managers
        ],
        pool.take_events(),
    )


class _Replay:
    """One seeded trace of engine calls, run on one manager; what each
    call returned is kept."""

    def __init__(self, mgr: KVCacheManager, unit: int, hash_bs: int) -> None:
        self.mgr = mgr
        self.unit = unit
        self.hash_bs = hash_bs
        self.waiting: list[Request] = []
        self.running: list[tuple[Request, int]] = []
        self.count = 0
        #: request id -> the tokens of its last cache_blocks call.
        self.last_cache: dict[str, int] = {}

    def op(self, rng: random.Random, prefixes: list[list[int]]) -> Any:
        mgr, unit = self.mgr, self.unit
        lookahead = not mgr.coordinator.lookahead_refusers
        roll = rng.random()
        if roll < 0.15 or not (self.running or self.waiting):
            self.count += 1
            tokens = rng.choice(prefixes)[: rng.randrange(0, 4 * unit)]
            tokens += [rng.randrange(1, 999) for _ in range(rng.randrange(1, 3 * unit))]
            self.waiting.append(
                Request(f"r{self.count}", tokens, hash_block_size=self.hash_bs)
            )
            return ("new", self.count)
        if roll < 0.3 and self.waiting:
            r = self.waiting.pop(rng.randrange(len(self.waiting)))
            blocks, hit = mgr.get_computed_blocks(r)
            n = min(r.num_tokens - hit, rng.choice([1, unit, 3 * unit, 999]))
            out = mgr.allocate_slots(
                r, n, hit, blocks, delay_cache_blocks=rng.random() < 0.5
            )
            if out is None:
                self.waiting.append(r)
                return ("admit", hit, None)
            r.num_computed_tokens = hit
            self.running.append((r, n))
            return ("admit", hit, out.get_block_ids(), out.copies)
        if roll < 0.75 and self.running:
            i = rng.randrange(len(self.running))
            r, pending = self.running[i]
            r.num_computed_tokens += pending
            if r.num_computed_tokens >= r.num_tokens:
                r.append_output_token_ids(rng.randrange(1, 999))
            done = r.num_computed_tokens
            if rng.random() < 0.5:
                # Some calls reach past the table (or the hashed chunks),
                # some repeat near the request's last call.
                last = self.last_cache.get(r.request_id, done)
                past = done + rng.randrange(1, 3 * unit)
                n = rng.choice([done, max(0, done - 3), past, last, last + 1])
                self.last_cache[r.request_id] = n
                mgr.cache_blocks(r, n)
            n = max(1, min(r.num_tokens - done, rng.choice([1, 1, 1, unit])))
            kw: dict[str, Any] = {}
            if rng.random() < 0.1:
                kw["num_in_flight_tokens"] = min(done, rng.randrange(3))
            if rng.random() < 0.05:
                kw["reserved_blocks"] = rng.randrange(5)
            out = mgr.allocate_slots(
                r,
                n,
                num_lookahead_tokens=rng.choice([0, 0, 2]) if lookahead else 0,
                delay_cache_blocks=rng.random() < 0.5,
                **kw,
            )
            self.running[i] = (r, 0 if out is None else n)
            if out is None and rng.random() < 0.7:
                victim = self.running.pop(rng.randrange(len(self.running)))[0]
                mgr.free(victim)
                victim.num_computed_tokens = 0
                self.waiting.append(victim)
            return ("step", None if out is None else out.get_block_ids())
        if roll < 0.85 and self.running:
            r, _ = self.running.pop(rng.randrange(len(self.running)))
            mgr.free(r)
            return ("free", r.request_id)
        if roll < 0.9 and self.running:
            r, _ = self.running[rng.randrange(len(self.running))]
            mgr.remove_skipped_blocks(r, r.num_computed_tokens)
            return ("skip", r.request_id)
        if roll < 0.97:
            ids = [rng.randrange(mgr.block_pool.num_blocks) for _ in range(3)]
            return ("evict", mgr.evict_blocks(ids))
        return ("reset", mgr.reset_prefix_cache())


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("seed", range(3))
def test_the_early_outs_change_nothing(plan: str, seed: int) -> None:
    specs, num_blocks, unit, hash_bs, eagle = PLANS[plan]

    def build() -> KVCacheManager:
        mgr: KVCacheManager = setup.manager_for(
            specs,
            num_blocks,
            scheduler_block_size=unit,
            hash_block_size=hash_bs,
            use_eagle=eagle,
            enable_kv_cache_events=True,
        )
        return mgr

    fast = build()
    assert fast.coordinator.cache_spans is not None
    assert fast.coordinator.idle_steps
    sides = [_Replay(fast, unit, hash_bs), _Replay(_plain(build()), unit, hash_bs)]
    rngs = [random.Random(seed) for _ in sides]
    prefixes = [
        [random.Random(seed * 7 + p).randrange(1, 999) for _ in range(5 * unit)]
        for p in range(3)
    ]
    skipped = 0
    for step in range(250):
        seen = []
        for side, rng in zip(sides, rngs, strict=True):
            spans = dict(side.mgr.coordinator.cache_spans or {})
            try:
                out: Any = side.op(rng, prefixes)
            except KvcoreError as exc:
                out = (type(exc).__name__, str(exc))
            seen.append((out, _state(side.mgr)))
            if side.mgr is fast and spans and spans == fast.coordinator.cache_spans:
                skipped += 1
        assert seen[0] == seen[1], f"{plan} seed {seed}: step {step} differs"
    assert skipped, "the trace never kept a span across a call"


def test_a_search_or_keys_of_its_own_are_checked() -> None:
    """The core's searches read only the cache tables at each position's
    key, so their hits go unchecked; a class whose search or keys are its
    own is checked, built in or not, whatever it declares (a flag in its
    body does not switch the check off)."""
    from kvcore.coordinator.manager import HitQuery
    from kvcore.coordinator.managers import PrefixManager, WindowManager
    from kvcore.coordinator.state_manager import CheckpointManager
    from kvcore.coordinator.twins import own_code

    class OwnSearch(PrefixManager):
        @classmethod
        def find_longest_cache_hit(cls, query: HitQuery) -> list[list[int]]:
            return super().find_longest_cache_hit(query)

    class OwnKeys(CheckpointManager):
        def block_hash(self, chunk_hashes: Any, index: int) -> Any:
            return super().block_hash(chunk_hashes, index)

    class Promises(PrefixManager):
        hits_from_cache_tables = True

        @classmethod
        def find_longest_cache_hit(cls, query: HitQuery) -> list[list[int]]:
            return super().find_longest_cache_hit(query)

    class Inherits(WindowManager):
        pass

    def checked(cls: type) -> bool:
        return own_code(cls, "find_longest_cache_hit", "block_hash")

    for core in (PrefixManager, WindowManager, CheckpointManager, Inherits):
        assert not checked(core)
    assert not checked(FullAttentionManager)
    assert not checked(SlidingWindowManager)
    assert checked(OwnSearch)
    assert checked(OwnKeys)
    assert checked(Promises)
