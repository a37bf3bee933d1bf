"""The manager contract: declared hit policies, the generic managers kinds
configure, the keyword hit query, the release rule, window groups hashing
only blocks that can serve a hit, and a state group finer than the hash
block.

Block ids come from the free queue, which starts in id order with block 0
taken out as the null block; within a step groups allocate in group order.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, ClassVar

import attrs
import pytest
import torch
from coordinator_setup import BUILT_IN, fa, manager_for, sw

import kvcore
from kvcore import HitPolicy, KindRegistry
from kvcore.coordinator import (
    CheckpointManager,
    FixedBlocksManager,
    HitQuery,
    KVCacheManager,
    PrefixManager,
    Request,
    WindowManager,
)
from kvcore.errors import KvcoreError, PluginError
from kvcore.spec import PackingRole, positive_int
from kvcore_full_attention import FullAttention, FullAttentionSpec
from kvcore_mamba import MambaSpec
from kvcore_mla import MLAAttentionSpec

build = manager_for


def tokens(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i) % 50000 for i in range(n)]


# ---------------------------------------------------------------------------
# Declared policies and the generic managers
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "policy", "manager"),
    [
        (fa(16), HitPolicy.PREFIX, PrefixManager),
        (
            MLAAttentionSpec(
                block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16
            ),
            HitPolicy.PREFIX,
            PrefixManager,
        ),
        (sw(16, 32), HitPolicy.WINDOW, WindowManager),
        (
            attrs.evolve(sw(16, 32), bounded_replay=True),
            HitPolicy.NOT_HASHED,
            WindowManager,
        ),
        (
            MambaSpec(
                block_size=16,
                shapes=((4, 8),),
                dtypes=(torch.float16,),
                mamba_cache_mode="none",
            ),
            HitPolicy.BLOCKS_HITS,
            FixedBlocksManager,
        ),
        (
            MambaSpec(
                block_size=16,
                shapes=((4, 8),),
                dtypes=(torch.float16,),
                mamba_cache_mode="align",
            ),
            HitPolicy.CHECKPOINT,
            CheckpointManager,
        ),
    ],
    ids=["full", "mla", "window", "replay-window", "mamba-none", "mamba-align"],
)
def test_built_in_kinds_declare_a_policy_and_use_a_generic_manager(
    spec: Any, policy: HitPolicy, manager: type
) -> None:
    assert spec.hit_policy is policy
    assert (spec.prefix_cacheable, spec.hashes_blocks) == (
        policy.prefix_cacheable,
        policy.hashes_blocks,
    )
    mgr = build([spec], 64, scheduler_block_size=spec.block_size, hash_block_size=16)
    group_manager = mgr.coordinator.single_type_managers[0]
    assert isinstance(group_manager, manager)
    assert policy in type(group_manager).hit_policies


def test_the_hit_query_takes_keywords_only() -> None:
    pool = kvcore.coordinator.BlockPool(4, enable_caching=True, hash_block_size=4)
    with pytest.raises(TypeError):
        HitQuery(fa(4), [], [], 4, 16, [0], pool, 4, 4)  # type: ignore[misc]
    query = HitQuery(
        spec=fa(4),
        block_hashes=[],
        chunk_hashes=[],
        hash_block_size=4,
        max_length=16,
        group_ids=[0],
        block_pool=pool,
        block_size=4,
        alignment=4,
    )
    assert query.max_blocks == 0
    assert PrefixManager.find_longest_cache_hit(query) == [[]]


# -- a kind whose declarations disagree is refused, naming the kind ---------


@attrs.frozen(kw_only=True)
class StateSpec(kvcore.KVCacheSpec):
    """One per-request state block (a third-party kind), by default with the
    base's ``PREFIX`` policy: the mistake under test."""

    kind: ClassVar[str] = "toy_state"
    packing_role: ClassVar[PackingRole] = PackingRole.STATE

    state_bytes: int = attrs.field(default=64, validator=positive_int)

    @property
    def page_grid(self) -> tuple[int, int, int]:
        return (1, 1, self.state_bytes)

    def num_blocks_held(
        self, num_computed_tokens: int, num_tokens: int, block_size: int
    ) -> int:
        return 1

    def max_num_blocks_per_request(self, max_model_len: int) -> int:
        return 1

    def group_key(self) -> Hashable:
        return (self.kind, self.state_bytes)


class ToyState(kvcore.CacheKind):
    name: ClassVar[str] = "toy_state"
    spec_type = StateSpec
    manager_type = FixedBlocksManager


def test_a_fixed_blocks_kind_left_at_the_prefix_default_is_refused() -> None:
    registry = KindRegistry.from_kinds([FullAttention(), ToyState()])
    with pytest.raises(PluginError) as info:
        build(
            [fa(16), StateSpec(block_size=16)],
            32,
            scheduler_block_size=16,
            hash_block_size=16,
            registry=registry,
        )
    msg = str(info.value)
    assert "cache kind 'toy_state'" in msg
    assert "declares hit_policy=PREFIX" in msg
    assert "FixedBlocksManager serves BLOCKS_HITS, NOT_HASHED" in msg
    assert isinstance(info.value, ValueError)
    assert info.value.plugin_name == registry.owner("toy_state")


@attrs.frozen(kw_only=True)
class OverridesCacheableSpec(StateSpec):
    """The old way of saying "never hashed": overriding ``prefix_cacheable``
    while the policy still says ``PREFIX``."""

    kind: ClassVar[str] = "toy_old_style"

    @property
    def prefix_cacheable(self) -> bool:
        return False


class OldStyle(kvcore.CacheKind):
    name: ClassVar[str] = "toy_old_style"
    spec_type = OverridesCacheableSpec
    manager_type = FixedBlocksManager


def test_a_spec_overriding_a_derived_property_is_refused() -> None:
    registry = KindRegistry.from_kinds([FullAttention(), OldStyle()])
    with pytest.raises(PluginError, match="override hit_policy alone") as info:
        build(
            [fa(16), OverridesCacheableSpec(block_size=16)],
            32,
            scheduler_block_size=16,
            hash_block_size=16,
            registry=registry,
        )
    assert "prefix_cacheable=False / hashes_blocks=True" in str(info.value)


class PositionalSearch(PrefixManager):
    """A hit search with the seven positional arguments of earlier releases."""

    partial_copy_hits: ClassVar[bool] = False  # its own search

    @classmethod
    def find_longest_cache_hit(  # type: ignore[override]
        cls,
        spec: Any,
        block_hashes: Any,
        max_length: int,
        group_ids: Any,
        block_pool: Any,
        block_size: int,
        alignment: int,
    ) -> list[list[Any]]:
        return [[] for _ in group_ids]


@attrs.frozen(kw_only=True)
class PositionalSpec(FullAttentionSpec):
    kind: ClassVar[str] = "toy_positional"


class Positional(FullAttention):
    name: ClassVar[str] = "toy_positional"
    spec_type = PositionalSpec
    manager_type = PositionalSearch


def test_a_hit_search_with_the_old_positional_signature_is_refused() -> None:
    registry = KindRegistry.from_kinds([Positional()])
    spec = PositionalSpec(
        block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float16
    )
    with pytest.raises(PluginError) as info:
        build(
            [spec], 32, scheduler_block_size=16, hash_block_size=16, registry=registry
        )
    assert (
        "PositionalSearch.find_longest_cache_hit cannot be called with one query"
        in str(info.value)
    )
    assert "HitQuery" in str(info.value)


# ---------------------------------------------------------------------------
# The release rule: a state kind holds only its declared blocks
# ---------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class CheckpointedStateSpec(StateSpec):
    """A third-party recurrent state kept at block boundaries."""

    kind: ClassVar[str] = "toy_checkpointed"

    @property
    def hit_policy(self) -> HitPolicy:
        return HitPolicy.CHECKPOINT

    def num_blocks_held(
        self, num_computed_tokens: int, num_tokens: int, block_size: int
    ) -> int:
        return 2

    def max_num_blocks_per_request(self, max_model_len: int) -> int:
        return 2


class Checkpointed(kvcore.CacheKind):
    name: ClassVar[str] = "toy_checkpointed"
    spec_type = CheckpointedStateSpec
    manager_type = CheckpointManager


def test_a_state_kind_releases_every_old_state_across_multi_block_steps() -> None:
    """Steps of three blocks leave null blocks between the state a step reads
    and the one it writes; every earlier state still goes back."""
    registry = KindRegistry.from_kinds([FullAttention(), Checkpointed()])
    mgr = build(
        [fa(16), CheckpointedStateSpec(block_size=16)],
        200,
        scheduler_block_size=16,
        hash_block_size=16,
        registry=registry,
    )
    r = Request("r", tokens(20 * 16), hash_block_size=16)
    held = []
    computed = 0
    while computed < r.num_tokens:
        step = min(48, r.num_tokens - computed)
        assert mgr.allocate_slots(r, step) is not None
        computed += step
        r.num_computed_tokens = computed
        state = [b for b in mgr.get_blocks("r").ids[1] if b != 0]
        held.append(len(state))
    # The state a step reads and the one it writes; nothing older.  The last
    # step (tokens 288..320) also keeps the state at 304, where the same
    # prompt sent again resumes (its last token is always recomputed).
    assert held == [1] + [2] * 5 + [3]
    mgr.free(r)
    assert mgr.block_pool.get_num_free_blocks() == 199


# ---------------------------------------------------------------------------
# Window groups hash only blocks that can serve a hit
# ---------------------------------------------------------------------------


def test_a_window_block_no_aligned_hit_reads_is_not_hashed_and_is_reused_first() -> (
    None
):
    """Full attention in 32-token blocks beside a 32-token window in 16-token
    blocks: hits are multiples of 32, and the hit of 96 tokens reads window
    blocks 4 and 5.  Block 6 (tokens 96..111 of a 112-token prompt) could only
    serve a hit of 128, which this prompt never reaches."""
    mgr = build(
        [fa(32), sw(16, 32)],
        100,
        scheduler_block_size=32,
        hash_block_size=16,
        enable_partial_hits=False,  # whole-block hits: multiples of 32
    )
    r = Request("r", tokens(112), hash_block_size=16)
    assert mgr.allocate_slots(r, 112) is not None
    window = mgr.get_blocks("r").ids[1]
    pool = mgr.block_pool
    assert window == [5, 6, 7, 8, 9, 10, 11]
    assert [pool.key_hash[b] is not None for b in window] == [True] * 6 + [False]
    mgr.free(r)
    # Unhashed blocks go to the front of the free queue: the partial full-
    # attention block and window block 6 are reused before any cached block.
    front = pool.free_queue.get_all_free_blocks()[:2]
    assert sorted(front) == [4, 11]

    again = Request("again", tokens(112), hash_block_size=16)
    hit, length = mgr.get_computed_blocks(again)
    assert length == 96
    assert hit.ids[1][-2:] == [9, 10]


def test_a_short_window_hashes_one_block_per_alignment_unit() -> None:
    """A 16-token window in 16-token blocks beside 64-token full-attention
    blocks: a hit of ``64 k`` tokens reads only window block ``4 k - 1``, so
    those are the only window blocks hashed, and the hit still finds them."""
    mgr = build(
        [fa(64), sw(16, 16)],
        100,
        scheduler_block_size=64,
        hash_block_size=16,
        enable_partial_hits=False,  # whole-block hits: multiples of 64
    )
    r = Request("r", tokens(130), hash_block_size=16)
    assert mgr.allocate_slots(r, 130) is not None
    window = mgr.get_blocks("r").ids[1]
    key_hash = mgr.block_pool.key_hash
    hashed = [i for i, b in enumerate(window) if key_hash[b] is not None]
    assert hashed == [3, 7]
    ids = {i: window[i] for i in hashed}
    mgr.free(r)

    again = Request("again", tokens(130), hash_block_size=16)
    hit, length = mgr.get_computed_blocks(again)
    assert length == 128
    assert [b == 0 for b in hit.ids[1]] == [True] * 7 + [False]
    assert hit.ids[1][7] == ids[7]


def test_with_eagle_a_window_group_hashes_every_full_block() -> None:
    """EAGLE's hit may end on any block of the group, so nothing is left
    unhashed."""
    mgr = build(
        [fa(32), sw(16, 32)],
        100,
        scheduler_block_size=32,
        hash_block_size=16,
        use_eagle=True,
    )
    r = Request("r", tokens(112), hash_block_size=16)
    assert mgr.allocate_slots(r, 112) is not None
    window = mgr.get_blocks("r").ids[1]
    assert all(mgr.block_pool.key_hash[b] is not None for b in window)


# ---------------------------------------------------------------------------
# A state group finer than the hash block
# ---------------------------------------------------------------------------


def kimi_shape(mode: str) -> list[Any]:
    return [
        MambaSpec(
            block_size=16,
            shapes=((4, 64),),
            dtypes=(torch.bfloat16,),
            mamba_cache_mode=mode,  # type: ignore[arg-type]
        ),
        MLAAttentionSpec(
            block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16
        ),
    ]


def test_a_mamba_group_finer_than_the_hash_block_builds_and_hits() -> None:
    """Mode ``all`` with 16-token state blocks beside 64-token MLA blocks, and
    64-token hashes: every kept state that ends on a hash boundary is keyed
    (64 and 128), so a repeated prompt resumes from the state at 128 tokens."""
    mgr = build(kimi_shape("all"), 100, scheduler_block_size=64, hash_block_size=64)
    first = Request("first", tokens(130), hash_block_size=64)
    assert mgr.allocate_slots(first, 128) is not None
    first.num_computed_tokens = 128
    assert mgr.allocate_slots(first, 2) is not None
    states = mgr.get_blocks("first").ids[0]
    key_hash = mgr.block_pool.key_hash
    keyed = [i for i, b in enumerate(states) if key_hash[b] is not None]
    assert keyed == [3, 7]
    state_at_128 = states[7]
    mgr.free(first)

    second = Request("second", tokens(130), hash_block_size=64)
    hit, length = mgr.get_computed_blocks(second)
    assert length == 128
    assert hit.ids[0][-1] == state_at_128
    assert len(hit.ids[0]) == 8
    assert len(hit.ids[1]) == 2
    assert mgr.allocate_slots(second, 2, 128, new_computed_blocks=hit) is not None
    mgr.free(second)


@pytest.mark.parametrize("mode", ["none", "align", "all"])
def test_the_kimi_shape_builds_in_every_mode(mode: str) -> None:
    cfg = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout="BLHNC",
            enable_prefix_caching=True,
            num_gpu_blocks_override=100,
        )
    )
    layers = dict(zip(["l0.mamba", "l1.attn"], kimi_shape(mode), strict=True))
    plan = kvcore.get_kv_cache_config_from_groups(
        cfg, kvcore.get_kv_cache_groups(cfg, layers, registry=BUILT_IN), 0
    )
    sched, hashed = kvcore.resolve_kv_cache_block_sizes(plan, cfg)
    try:
        KVCacheManager(
            kvcore.generate_scheduler_kv_cache_config([plan]),
            4096,
            scheduler_block_size=sched,
            hash_block_size=hashed,
            registry=BUILT_IN,
        )
    except KvcoreError as exc:  # pragma: no cover - the failure under test
        pytest.fail(f"mode {mode}: {exc}")


class NoSearch(kvcore.coordinator.SingleTypeManager):
    """Declares a hashing policy but keeps the base class's search."""

    hit_policies: ClassVar[frozenset[HitPolicy]] = frozenset({HitPolicy.PREFIX})


def _search_kind(manager: type) -> KindRegistry:
    kind = type("SearchKind", (FullAttention,), {"manager_type": manager})()
    return KindRegistry.from_kinds([kind])


def test_a_hashing_manager_without_a_search_is_refused_when_built() -> None:
    with pytest.raises(PluginError, match="find_longest_cache_hit is not implemented"):
        build(
            [fa(16)],
            32,
            scheduler_block_size=16,
            hash_block_size=16,
            registry=_search_kind(NoSearch),
        )


def _undecorated(f: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return f(*args, **kwargs)

    return wrapper


class Decorated(PrefixManager):
    partial_copy_hits: ClassVar[bool] = False  # its own search

    @classmethod
    @_undecorated
    def find_longest_cache_hit(cls, query: HitQuery) -> list[list[Any]]:
        return PrefixManager.find_longest_cache_hit.__func__(cls, query)  # type: ignore[attr-defined,no-any-return]


class OptionalArgument(PrefixManager):
    partial_copy_hits: ClassVar[bool] = False  # its own search

    @classmethod
    def find_longest_cache_hit(  # type: ignore[override]
        cls, query: HitQuery, trace: bool = False
    ) -> list[list[Any]]:
        return PrefixManager.find_longest_cache_hit.__func__(cls, query)  # type: ignore[attr-defined,no-any-return]


@pytest.mark.parametrize("manager", [Decorated, OptionalArgument])
def test_searches_callable_with_one_query_are_accepted(manager: type) -> None:
    mgr = build(
        [fa(16)],
        32,
        scheduler_block_size=16,
        hash_block_size=16,
        registry=_search_kind(manager),
    )
    first = Request("a", tokens(40), hash_block_size=16)
    assert mgr.allocate_slots(first, 40) is not None
    first.num_computed_tokens = 40
    mgr.free(first)
    assert (
        mgr.get_computed_blocks(Request("b", tokens(40), hash_block_size=16))[1] == 32
    )


def test_events_of_a_state_group_finer_than_the_hash_block_describe_chunks() -> None:
    """16-token Mamba blocks beside 64-token MLA blocks, hash 64: a stored
    state is keyed by its hash chunk, so its event names that chunk's
    tokens, the chunk's size and the previous chunk as parent."""
    from kvcore.coordinator.events import BlockStored

    mgr = build(
        kimi_shape("all"),
        64,
        scheduler_block_size=64,
        hash_block_size=64,
        enable_kv_cache_events=True,
    )
    r = Request("r", tokens(200), hash_block_size=64)
    for _ in range(2):
        assert mgr.allocate_slots(r, 64) is not None
        r.num_computed_tokens += 64
    chunks = list(r.block_hashes)
    states = [
        e for e in mgr.take_events() if isinstance(e, BlockStored) and e.group_id == 0
    ]
    assert [(e.block_hashes, e.parent_block_hash) for e in states] == [
        ((chunks[0],), None),
        ((chunks[1],), chunks[0]),
    ]
    assert [e.token_ids for e in states] == [
        tuple(r.all_token_ids[:64]),
        tuple(r.all_token_ids[64:128]),
    ]
    assert {e.block_size for e in states} == {64}
