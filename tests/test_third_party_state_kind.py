"""A third-party recurrent-state kind, written from kvcore's docs alone.

``rwkv_state`` keeps one fixed state of a few KiB per request for the
request's whole life (an RWKV / Mamba-``none``-style state that is never
checkpointed).  Everything is defined here, from ``docs/plugins.md`` ("A cache
kind", "Planning declarations", "The manager contract"), ``docs/coordinator.md``
and the example plugin in ``examples/third_party_plugin/``; kvcore's and
``plugins/``' sources were not read.

Where the docs were silent or ambiguous, the guess taken is marked ``DOCS:``.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import ClassVar

import attrs
import pytest
import torch

import kvcore
from kvcore.coordinator import FixedBlocksManager, KVCacheManager, Request
from kvcore.spec import PackingRole, positive_int
from kvcore.testing import check_kind

# DOCS: no page names the full-attention plugin's module or its kind class;
# README shows ``from kvcore_mla import MLAAttentionSpec`` only, so the module
# name was taken from ``kvcore kinds`` (plugin column) and the class names from
# ``kvcore_full_attention.__all__``.
from kvcore_full_attention import FullAttention, FullAttentionSpec

BLOCK = 16
STATE_BYTES = 4096
MAX_MODEL_LEN = 256
NUM_BLOCKS = 64


@attrs.frozen(kw_only=True)
class RWKVStateSpec(kvcore.KVCacheSpec):
    """One recurrent state of ``state_bytes`` per request, never checkpointed."""

    kind: ClassVar[str] = "rwkv_state"
    packing_role: ClassVar[PackingRole] = PackingRole.STATE

    state_bytes: int = attrs.field(validator=positive_int)

    # DOCS: plugins.md says page sizing is "derived from its fields" but never
    # says which member a plain ``KVCacheSpec`` subclass must provide; the
    # ``page_grid`` ``(H, N, C)`` of architecture.md is the guess (one head,
    # one state per block, ``state_bytes`` of content).
    @property
    def page_grid(self) -> tuple[int, int, int]:
        return (1, 1, self.state_bytes)

    # plugins.md: a state that needs the whole prefix but is never
    # checkpointed declares HitPolicy.BLOCKS_HITS (the model then gets no
    # hits, and `kvcore plan` says so).
    @property
    def hit_policy(self) -> kvcore.HitPolicy:
        return kvcore.HitPolicy.BLOCKS_HITS

    # The block is the state, not a page of tokens: never grow it and keep
    # it under serving choices (the defaults of KVCacheSpec, per plugins.md).

    def num_blocks_held(
        self, num_computed_tokens: int, num_tokens: int, block_size: int
    ) -> int:
        return 1  # one state per request for its whole life

    # DOCS: plugins.md never mentions ``max_num_blocks_per_request`` (only the
    # example plugin overrides it); overridden so it agrees with the above.
    def max_num_blocks_per_request(self, max_model_len: int) -> int:
        return 1

    def group_key(self) -> Hashable:
        return (self.kind, self.state_bytes)


class RWKVStateManager(FixedBlocksManager):
    """One block per request (``blocks_per_request`` default), never hit."""


class RWKVState(kvcore.CacheKind):
    name: ClassVar[str] = "rwkv_state"
    spec_type = RWKVStateSpec
    manager_type = RWKVStateManager


# DOCS: check_kind needs *the same kind object* that the registry holds; a
# fresh ``RWKVState()`` fails with "the registry must map the spec to it",
# which no page mentions.
KIND = RWKVState()
FULL = FullAttention()
REGISTRY = kvcore.KindRegistry.from_kinds([FULL, KIND])
STATE_SPEC = RWKVStateSpec(block_size=BLOCK, state_bytes=STATE_BYTES)
ATTN_SPEC = FullAttentionSpec(
    block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
)


def _config() -> kvcore.EngineConfig:
    return kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            block_size=BLOCK,
            kv_cache_layout="BLHNC",
            enable_prefix_caching=True,
            num_gpu_blocks_override=NUM_BLOCKS,
        ),
        max_model_len=MAX_MODEL_LEN,
    )


def _hybrid_specs() -> dict[str, kvcore.KVCacheSpec]:
    specs: dict[str, kvcore.KVCacheSpec] = {}
    for i in range(4):
        specs[f"layers.{2 * i}.attn"] = ATTN_SPEC
        specs[f"layers.{2 * i + 1}.rwkv"] = STATE_SPEC
    return specs


def _plan(specs: dict[str, kvcore.KVCacheSpec]) -> kvcore.KVCacheConfig:
    return kvcore.plan_kv_cache(_config(), specs, 2**30, registry=REGISTRY)


def _tokens(n: int, offset: int = 0) -> list[int]:
    return [(7 * i + 3 + offset) % 1000 for i in range(n)]


class Driver:
    """Steps requests through a manager and checks every group after each."""

    def __init__(self, plan: kvcore.KVCacheConfig) -> None:
        self.plan = plan
        self.manager = KVCacheManager.from_plan(plan, registry=REGISTRY)
        self.specs = [g.manager_spec for g in plan.kv_cache_groups]
        self.live: dict[str, Request] = {}

    def request(self, rid: str, tokens: list[int]) -> Request:
        return Request(rid, tokens, hash_block_size=self.plan.hash_block_size)

    def admit(self, req: Request, num_new_tokens: int) -> int:
        blocks, hit = self.manager.get_computed_blocks(req)
        new = self.manager.allocate_slots(req, num_new_tokens - hit, hit, blocks)
        assert new is not None
        self.live[req.request_id] = req
        self._computed(req, num_new_tokens)
        return hit

    def step(self, req: Request, num_new_tokens: int) -> list[list[int]]:
        new = self.manager.allocate_slots(req, num_new_tokens)
        assert new is not None
        self._computed(req, req.num_computed_tokens + num_new_tokens)
        return list(new.get_block_ids())

    def _computed(self, req: Request, n: int) -> None:
        # DOCS: coordinator.md does not say who advances
        # ``Request.num_computed_tokens``; allocate_slots leaves it alone, so
        # the scheduler (this driver) sets it, as vLLM's scheduler does.
        req.num_computed_tokens = n
        self.manager.cache_blocks(req, n)
        self.check()

    def free(self, rid: str) -> None:
        self.manager.free(self.live.pop(rid))
        self.check()

    def check(self) -> None:
        held_ids: set[int] = set()
        for rid, req in self.live.items():
            for spec, ids in zip(
                self.specs, self.manager.get_block_ids(rid), strict=True
            ):
                held = [b for b in ids if b != 0]
                n = req.num_computed_tokens
                assert len(held) == spec.num_blocks_held(n, n, spec.block_size)
                if isinstance(spec, RWKVStateSpec):
                    assert len(held) <= spec.max_num_blocks_per_request(
                        self.plan.max_model_len
                    )
                held_ids.update(held)
        # Blocks shared through a hit count once; cached blocks of freed
        # requests stay in the free queue (coordinator.md, "Block pool").
        free = self.manager.get_num_free_blocks()
        assert free == self.plan.num_blocks - 1 - len(held_ids)


def test_kind_conforms() -> None:
    check_kind(KIND, STATE_SPEC, registry=REGISTRY)


def test_spec_declarations() -> None:
    assert STATE_SPEC.page_size_bytes == STATE_BYTES
    assert STATE_SPEC.grown(1) == STATE_SPEC
    assert STATE_SPEC.grown(2) is None
    assert STATE_SPEC.with_block_size(32) is None
    assert STATE_SPEC.with_cache_dtype(torch.float16) is None
    assert STATE_SPEC.element_size == 1
    assert STATE_SPEC.prefix_replay_tokens == 0
    assert STATE_SPEC.skipped_tokens(1000) == 0
    with pytest.raises(kvcore.InvalidSpecError):
        RWKVStateSpec(block_size=BLOCK, state_bytes=0)
    with pytest.raises(kvcore.InvalidSpecError):
        attrs.evolve(STATE_SPEC, state_bytes=-1)


def test_hybrid_plan_groups() -> None:
    plan = _plan(_hybrid_specs())
    assert plan.num_blocks == NUM_BLOCKS
    assert plan.enable_prefix_caching is True
    assert plan.scheduler_block_size == BLOCK
    state_groups = [
        g for g in plan.kv_cache_groups if isinstance(g.manager_spec, RWKVStateSpec)
    ]
    attn_groups = [
        g for g in plan.kv_cache_groups if isinstance(g.manager_spec, FullAttentionSpec)
    ]
    assert len(state_groups) + len(attn_groups) == len(plan.kv_cache_groups)
    assert sorted(n for g in state_groups for n in g.layer_names) == [
        f"layers.{2 * i + 1}.rwkv" for i in range(4)
    ]
    assert sorted(n for g in attn_groups for n in g.layer_names) == [
        f"layers.{2 * i}.attn" for i in range(4)
    ]
    # Groups overlay each other; the block is the widest group's packing.
    widest = max(g.packed_bytes for g in plan.kv_cache_groups)
    assert plan.bytes_per_block >= widest


def test_hybrid_lifecycle() -> None:
    d = Driver(_plan(_hybrid_specs()))
    state_gid = [isinstance(s, RWKVStateSpec) for s in d.specs].index(True)

    # Chunked prefill of a 100-token prompt: 40 + 40 + 20 tokens.
    a_tokens = _tokens(100)
    a = d.request("a", a_tokens)
    assert d.admit(a, 40) == 0
    state_block = d.manager.get_block_ids("a")[state_gid]
    assert len(state_block) == 1
    for chunk in (40, 20):
        new = d.step(a, chunk)
        assert new[state_gid] == []  # the state never gets a second block
    assert a.num_computed_tokens == 100

    # Decode 5 tokens.
    for t in range(5):
        a.append_output_token_ids([500 + t])
        new = d.step(a, 1)
        assert new[state_gid] == []
    assert d.manager.get_block_ids("a")[state_gid] == state_block

    # A second request sharing a's first 64 tokens: the state kind blocks
    # the hit for the whole model (see test_state_kind_blocks_hits).
    b = d.request("b", a_tokens[:64] + _tokens(36, offset=1))
    assert d.admit(b, 100) == 0

    # Preempt a (free while running), then re-admit it with its prompt and
    # output so far; it recomputes everything.
    a_all = list(a.all_token_ids)
    d.free("a")
    assert d.manager.get_num_free_blocks() < NUM_BLOCKS - 1  # b still holds
    a2 = d.request("a", a_all)
    assert d.admit(a2, 64) == 0
    d.step(a2, len(a_all) - 64)
    a2.append_output_token_ids([900])
    d.step(a2, 1)

    d.free("b")
    d.free("a")
    assert d.manager.get_num_free_blocks() == NUM_BLOCKS - 1
    # DOCS: coordinator.md lists `usage` among the methods; it is a property.
    assert d.manager.usage == 0.0


def test_state_kind_blocks_hits() -> None:
    """coordinator.md: a group that needs its whole prefix but keeps none of
    it "allows no hit at all" ("no hit for the whole plan")."""
    prompt = _tokens(100)
    follower = prompt[:64] + _tokens(36, offset=1)

    # Control: the full-attention layers alone give the follower a 64-token
    # hit, so the blocks are cached and hashed.
    only_attn = {f"layers.{2 * i}.attn": ATTN_SPEC for i in range(4)}
    control = Driver(_plan(only_attn))
    control.admit(control.request("x", prompt), 100)
    assert control.admit(control.request("y", follower), 100) == 64

    # The hybrid: the same full-attention blocks are cached, but the plan
    # keeps prefix caching on while the state group allows no hit.
    plan = _plan(_hybrid_specs())
    assert plan.enable_prefix_caching is True
    d = Driver(plan)
    d.admit(d.request("x", prompt), 100)
    blocks, hit = d.manager.get_computed_blocks(d.request("y", follower))
    assert hit == 0
    assert all(ids == [] for ids in blocks.get_block_ids())
    # Not even an identical prompt hits.
    _, hit = d.manager.get_computed_blocks(d.request("z", prompt))
    assert hit == 0
