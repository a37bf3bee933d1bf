"""Adversarial checks of state checkpoints: transactions, superseded
step-end states, branch points without token-indexed groups, and EAGLE.

Hybrids of full attention and Mamba at 16-token hashes, driven by hand as an
engine does (compute, cache, sample, free).
"""

from __future__ import annotations

from typing import Any

import coordinator_setup as setup
import pytest
from coordinator_setup import fa, manager_for, state_hybrid, state_manager

from kvcore.coordinator import (
    CheckpointPolicy,
    KVCacheManager,
    Request,
)
from kvcore.errors import PluginError
from kvcore.registry import KindRegistry
from kvcore.serving import ServingChoices, ServingError
from kvcore_full_attention import FullAttention
from kvcore_mamba import Mamba, MambaManager, MambaSpec
from kvcore_sliding_window import SlidingWindow

BS = 16


def mamba(block_size: int = BS, policy: str = "turns") -> MambaSpec:
    return setup.mamba(block_size, policy=policy)


state = state_manager


def decode(mgr: KVCacheManager, req: Request, until: int, token: int = 1000) -> None:
    """Sample and compute one token at a time until ``until`` are computed."""
    while req.num_computed_tokens < until:
        req.append_output_token_ids(token + req.num_computed_tokens)
        assert mgr.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1


def prefill(mgr: KVCacheManager, rid: str, prompt: list[int]) -> Request:
    """Admit ``prompt`` and compute it in one step, its blocks cached."""
    req = Request(rid, prompt, hash_block_size=BS)
    assert mgr.allocate_slots(req, len(prompt)) is not None
    req.num_computed_tokens = len(prompt)
    mgr.cache_blocks(req, len(prompt))
    return req


class Raising(MambaManager):
    """Not one of kvcore's modules: its steps run inside a transaction."""

    armed = False

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> Any:
        new = super().allocate_new_blocks(request_id, num_tokens)
        if self.armed:
            msg = "allocation failed"
            raise RuntimeError(msg)
        return new

    def take_released_checkpoints(self, request_id: str) -> list[int]:
        states = super().take_released_checkpoints(request_id)
        if self.armed:
            msg = "release failed"
            raise RuntimeError(msg)
        return states


class RaisingMamba(Mamba):
    def make_manager(self, spec: MambaSpec, block_pool: Any, **kwargs: Any) -> Any:
        return Raising(spec, block_pool, **kwargs)


def test_a_rolled_back_admission_leaves_no_planned_checkpoints() -> None:
    registry = KindRegistry.from_kinds([FullAttention(), RaisingMamba()])
    mgr = state_hybrid(100, registry=registry)
    manager = state(mgr)
    assert isinstance(manager, Raising)
    manager.armed = True
    req = Request("a", list(range(100)), hash_block_size=BS)
    free = mgr.get_num_free_blocks()
    with pytest.raises(PluginError):
        mgr.allocate_slots(req, 100)
    assert mgr.get_num_free_blocks() == free
    assert manager.req_to_blocks == {}
    # The admission was undone: nothing planned for it stays behind.
    assert manager.targets == {}


def test_a_rolled_back_admission_does_not_count_as_a_resume() -> None:
    """A state becomes shared when a second request resumes from it; an
    admission that resumed from it and was rolled back (a plugin raised)
    does not count, so the one real resume after it leaves it unshared."""
    registry = KindRegistry.from_kinds([FullAttention(), RaisingMamba()])
    mgr = state_hybrid(200, registry=registry)
    manager = state(mgr)
    assert isinstance(manager, Raising)
    prompt = list(range(100))
    mgr.free(prefill(mgr, "a", prompt))  # its prompt-end state at 96
    b = Request("b", [*prompt, *range(900, 910)], hash_block_size=BS)
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 96
    manager.armed = True
    with pytest.raises(PluginError):
        mgr.allocate_slots(b, b.num_tokens - hit, hit, blocks)
    manager.armed = False
    assert manager.hit_counts == {}
    assert mgr.allocate_slots(b, b.num_tokens - hit, hit, blocks) is not None
    assert [count for _, count in manager.hit_counts.values()] == [1]
    assert manager.shared_states == {}
    mgr.free(b)
    assert mgr.get_num_free_blocks() == 199


def test_a_release_that_raises_changes_nothing_and_runs_again() -> None:
    """A deferred free whose release raises in a state group leaves the
    pool and the popped list as they were: released again, it frees the
    request as a free does, its kept states at the back."""
    registry = KindRegistry.from_kinds([FullAttention(), RaisingMamba()])

    def finished(deferred: bool) -> KVCacheManager:
        mgr = state_hybrid(200, registry=registry)
        r = prefill(mgr, "r", list(range(5000, 5040)))
        for i in range(40):  # releasing the states it keeps as it goes
            r.append_output_token_ids(7000 + i)
            mgr.remove_skipped_blocks(r, r.num_computed_tokens)
            assert mgr.allocate_slots(r, 1) is not None
            r.num_computed_tokens += 1
        assert mgr.block_pool.free_queue.held_blocks()
        if not deferred:
            mgr.free(r)
            return mgr
        blocks = mgr.pop_blocks_for_free(r)
        manager = state(mgr)
        assert isinstance(manager, Raising)
        before = (mgr.block_pool.eviction_order(), list(mgr.block_pool.ref_cnt))
        manager.armed = True
        with pytest.raises(PluginError, match="release failed"):
            mgr.release_blocks(blocks)
        assert (mgr.block_pool.eviction_order(), list(mgr.block_pool.ref_cnt)) == before
        manager.armed = False
        mgr.release_blocks(blocks)
        return mgr

    popped, freed = finished(deferred=True), finished(deferred=False)
    assert popped.block_pool.eviction_order() == freed.block_pool.eviction_order()
    assert popped.get_num_free_blocks() == freed.get_num_free_blocks() == 199


def test_a_failed_release_keeps_the_popped_tables_as_they_were() -> None:
    """Beside a window that held back blocks, a release that raises in the
    state group after the held-back blocks rejoined the tables leaves the
    popped list as it was: a request that takes those blocks meanwhile
    keeps its references when the list is released again."""
    registry = KindRegistry.from_kinds(
        [FullAttention(), SlidingWindow(), RaisingMamba()]
    )
    mgr = manager_for(
        [fa(4), setup.sw(4, 8), mamba(4)],
        80,
        scheduler_block_size=4,
        hash_block_size=4,
        boundary_headroom=False,
        registry=registry,
    )
    r = Request("r", list(range(1, 25)), hash_block_size=4)
    for n in (8, 8, 8):
        assert mgr.allocate_slots(r, n) is not None
        r.num_computed_tokens += n
    for i in range(16):
        r.append_output_token_ids(9000 + i)
        mgr.remove_skipped_blocks(r, r.num_computed_tokens)
        assert mgr.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
    held = set(mgr.block_pool.free_queue.held_blocks())
    assert held
    blocks = mgr.pop_blocks_for_free(r)
    manager = state(mgr, 2)
    assert isinstance(manager, Raising)
    manager.armed = True
    with pytest.raises(PluginError, match="release failed"):
        mgr.release_blocks(blocks)
    manager.armed = False
    # q hits r's prefix: it takes blocks r held back.
    q = Request("q", [*range(1, 21), 555, 556, 557, 558], hash_block_size=4)
    hit, num_hit = mgr.get_computed_blocks(q)
    assert num_hit == 20
    assert mgr.allocate_slots(q, 4, num_hit, hit) is not None
    taken = held & set(mgr.get_block_ids("q")[1])
    assert taken
    mgr.release_blocks(blocks)
    assert [mgr.block_pool.ref_cnt[b] for b in taken] == [1] * len(taken)
    mgr.free(q)
    assert mgr.get_num_free_blocks() == 79


def test_a_superseded_state_does_not_drop_a_block_another_request_cached() -> None:
    # b takes every free block beside a running request: no headroom.
    mgr = state_hybrid(20, boundary_headroom=False)
    manager = state(mgr)
    a = Request("a", list(range(100)), hash_block_size=BS)
    assert mgr.allocate_slots(a, 100) is not None
    a.num_computed_tokens = 100
    # a's decode reaches 112 (its step-end state is kept), then passes it:
    # the block holding it is released into the free queue.
    decode(mgr, a, 114)
    pool = mgr.block_pool
    x = manager.step_end["a"][1]
    assert pool.ref_cnt[x] == 0
    assert pool.key_hash[x] is not None
    # b takes every free block, x included, and caches its own prefix in it.
    free = mgr.get_num_free_blocks()
    b = Request("b", list(range(5000, 5000 + BS * (free - 2))), hash_block_size=BS)
    blocks, hit = mgr.get_computed_blocks(b)
    assert mgr.allocate_slots(b, b.num_tokens, hit, blocks) is not None
    assert any(blk == x for group in mgr.get_blocks("b").ids for blk in group)
    b.num_computed_tokens = b.num_tokens
    mgr.free(b)
    key = pool.key_hash[x]
    assert key is not None
    assert pool.ref_cnt[x] == 0
    # a's next step end (128) supersedes its state at 112, which left the
    # cache long ago; the block now holds b's content and stays cached.
    decode(mgr, a, 128)
    assert pool.key_hash[x] == key


class BranchOnly(MambaManager):
    def checkpoint_policy(self, spec: Any) -> CheckpointPolicy:
        return CheckpointPolicy(prompt_end=False, output_end=False)


class BranchOnlyMamba(Mamba):
    def make_manager(self, spec: MambaSpec, block_pool: Any, **kwargs: Any) -> Any:
        return BranchOnly(spec, block_pool, **kwargs)


def test_a_model_of_states_alone_finds_no_shared_prefix_in_a_fresh_request() -> None:
    registry = KindRegistry.from_kinds([BranchOnlyMamba()])
    mgr = manager_for(
        [mamba()],
        100,
        scheduler_block_size=BS,
        hash_block_size=BS,
        registry=registry,
        enable_caching=True,
    )
    req = Request("a", list(range(100)), hash_block_size=BS)
    blocks, hit = mgr.get_computed_blocks(req)
    assert hit == 0
    # No other group holds any of its tokens: nothing is shared.
    assert req.shared_prefix_tokens == 0
    free = mgr.get_num_free_blocks()
    assert mgr.allocate_slots(req, 100, hit, blocks) is not None
    assert free - mgr.get_num_free_blocks() == 1


@pytest.mark.parametrize("use_eagle", [False, True])
def test_states_are_kept_only_where_hits_end_with_eagle(use_eagle: bool) -> None:
    # Hits are multiples of 32 (the attention block); Mamba's block is 16.
    mgr = manager_for(
        [fa(32), mamba(16)],
        200,
        scheduler_block_size=32,
        hash_block_size=BS,
        enable_caching=True,
        use_eagle=use_eagle,
        # Whole-block hits: with copy-on-write partial hits they would be
        # multiples of the 16-token hash block.
        enable_partial_hits=False,
    )
    assert mgr.coordinator.cache_hit_alignment == 32
    assert state(mgr).unit == 32
    a = Request("a", list(range(90)), hash_block_size=BS)
    assert mgr.allocate_slots(a, 90) is not None
    a.num_computed_tokens = 90
    mgr.cache_blocks(a, 90)
    decode(mgr, a, 120)
    mgr.free(a)
    pool = mgr.block_pool
    cached = [
        (i + 1) * BS
        for i, h in enumerate(a.block_hashes)
        if pool.lookup(h, 1) is not None
    ]
    # The prompt's state at 64, the last boundary a hit can end at (with
    # EAGLE the one before too, 32: a hit drops a block), and the output's
    # at 96; none at 80 or 112, where no hit ends.
    assert cached == ([32, 64, 96] if use_eagle else [64, 96])
    _, hit = mgr.get_computed_blocks(Request("b", list(range(90)), hash_block_size=BS))
    assert hit == (32 if use_eagle else 64)


def test_the_same_prompt_again_hits_with_eagle() -> None:
    """With EAGLE a hit drops its last block, so the prompt-end states are
    kept a block earlier: the same 100-token prompt again resumes at 80
    (without EAGLE, 96)."""
    mgr = state_hybrid(200, use_eagle=True)
    prompt = list(range(100))
    mgr.free(prefill(mgr, "a", prompt))
    _, hit = mgr.get_computed_blocks(Request("b", prompt, hash_block_size=BS))
    assert hit == 80


@pytest.mark.parametrize(
    ("attention_block", "state_block", "expected"),
    [
        # Hits drop a 16-token block: the state at 80, one before the
        # prompt's last boundary (96), kept for it.
        (16, 16, 80),
        # A 64-token state block: its only boundary below 100 is 64; the
        # attention's bound (96 less a block: 80) reaches it.
        (16, 64, 64),
        # A 32-token attention block with copy-on-write partial hits: the
        # state's own bound (96 less 16) ends inside an attention block.
        (32, 16, 80),
    ],
)
def test_the_same_prompt_again_with_eagle_resumes_near_its_end(
    attention_block: int, state_block: int, expected: int
) -> None:
    mgr = manager_for(
        [fa(attention_block), mamba(state_block)],
        200,
        scheduler_block_size=max(attention_block, state_block),
        hash_block_size=BS,
        enable_caching=True,
        use_eagle=True,
    )
    prompt = list(range(100))
    mgr.free(prefill(mgr, "a", prompt))
    _, hit = mgr.get_computed_blocks(Request("b", prompt, hash_block_size=BS))
    assert hit == expected


def test_a_chats_next_turn_with_eagle_resumes_a_block_before_the_output_end() -> None:
    """With EAGLE the state before the newest step end is kept too: turn 1
    computed 139 tokens (its output end at 128); turn 2's attention hit
    reaches 128 and drops a block, so it resumes at 112, where the state
    is kept."""
    mgr = state_hybrid(200, use_eagle=True)
    first = prefill(mgr, "t1", list(range(100)))
    decode(mgr, first, 139)
    mgr.free(first)
    history = list(first.all_token_ids)
    assert len(history) == 139
    second = Request("t2", history + list(range(2000, 2030)), hash_block_size=BS)
    _, hit = mgr.get_computed_blocks(second)
    assert hit == 112


@pytest.mark.parametrize("value", [["turns"], {"turns": 1}, 3, "often"])
def test_a_bad_serving_checkpoint_policy_is_a_serving_error(value: Any) -> None:
    with pytest.raises(ServingError, match="checkpoint_policy must be one of"):
        ServingChoices(checkpoint_policy=value)


def test_a_freed_request_does_not_requeue_a_block_another_request_reused() -> None:
    # b takes every free block beside a running request: no headroom.
    mgr = state_hybrid(20, boundary_headroom=False)
    a = Request("a", list(range(100)), hash_block_size=BS)
    assert mgr.allocate_slots(a, 100) is not None
    a.num_computed_tokens = 100
    # a keeps its prompt's state at 96 (an inner block of its prefill),
    # released once a's decode passes it.
    pool = mgr.block_pool
    x = mgr.get_blocks("a").ids[1][5]
    assert pool.key_hash[x] is not None
    decode(mgr, a, 102)
    assert pool.ref_cnt[x] == 0
    # b takes every free block, x included, caches its prefix and finishes.
    free = mgr.get_num_free_blocks()
    b = Request("b", list(range(5000, 5000 + BS * (free - 2))), hash_block_size=BS)
    blocks, hit = mgr.get_computed_blocks(b)
    assert mgr.allocate_slots(b, b.num_tokens, hit, blocks) is not None
    assert any(blk == x for group in mgr.get_blocks("b").ids for blk in group)
    b.num_computed_tokens = b.num_tokens
    mgr.free(b)
    queue = pool.free_queue
    before = queue.get_all_free_blocks()
    cached = [
        blk
        for group in mgr.get_blocks("a").ids
        for blk in group
        if pool.key_hash[blk] is not None
    ]
    mgr.free(a)
    after = queue.get_all_free_blocks()
    # b's blocks, x among them, keep their order; a's cached blocks go
    # behind them.
    assert [i for i in after if i in before] == before
    assert all(after.index(x) < after.index(blk) for blk in cached)


def test_a_step_that_raises_after_shedding_keeps_its_checkpoints() -> None:
    """A running request whose step fits only without its checkpoints sheds
    them; when a plugin's manager then raises, the rolled-back step gives
    them back (the prompt-end target, the hit's held state, the release
    line), as a refused step does."""
    registry = KindRegistry.from_kinds([FullAttention(), RaisingMamba()])
    mgr = state_hybrid(100, registry=registry)
    manager = state(mgr)
    assert isinstance(manager, Raising)
    first = Request("a", list(range(100)), hash_block_size=BS)
    assert mgr.allocate_slots(first, 100) is not None
    first.num_computed_tokens = 100
    mgr.cache_blocks(first, 100)
    mgr.free(first)
    # 140 tokens: a hit of 96 (a's prompt end), 20 computed, then a step to
    # 136 that passes the prompt-end target at 128.
    req = Request("b", [*range(100), *range(5000, 5040)], hash_block_size=BS)
    blocks, hit = mgr.get_computed_blocks(req)
    assert hit == 96
    assert mgr.allocate_slots(req, 20, hit, blocks) is not None
    req.num_computed_tokens = 116
    mgr.cache_blocks(req, 116)
    before = (
        list(manager.targets["b"]),
        list(manager.pinned["b"]),
        manager.num_released.get("b"),
    )
    assert before[:2] == ([128], [5])
    # One free block: the step takes two (an attention block and the state
    # at 136; the state at 128 is written into the block at position 7 it
    # holds), which fits only once the held hit state at position 5 is
    # given up and released.
    mgr.block_pool.get_new_blocks(mgr.get_num_free_blocks() - 1)
    manager.armed = True
    with pytest.raises(PluginError):
        mgr.allocate_slots(req, 20)
    assert mgr.get_num_free_blocks() == 1
    after = (
        manager.targets.get("b"),
        manager.pinned.get("b"),
        manager.num_released.get("b"),
    )
    assert after == before


class RaisingAfterCaching(MambaManager):
    """Not one of kvcore's modules: raises once it has cached a step's
    states, so the step's every change is rolled back."""

    armed = False

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        super().cache_blocks(request, num_tokens)
        if self.armed:
            msg = "caching failed"
            raise RuntimeError(msg)


class RaisingAfterCachingMamba(Mamba):
    def make_manager(self, spec: MambaSpec, block_pool: Any, **kwargs: Any) -> Any:
        return RaisingAfterCaching(spec, block_pool, **kwargs)


def test_a_rolled_back_step_does_not_mark_its_branch_point_shared() -> None:
    """A step that keeps the state at its request's branch point marks it
    shared (a later request on the prefix resumes there); when a plugin's
    manager raises after that, the rolled-back step leaves no mark, and the
    same step run again marks it once."""
    registry = KindRegistry.from_kinds([FullAttention(), RaisingAfterCachingMamba()])
    mgr = state_hybrid(200, registry=registry)
    manager = state(mgr)
    assert isinstance(manager, RaisingAfterCaching)
    mgr.free(prefill(mgr, "a", list(range(100))))
    # b shares a's first 64 tokens, where a kept no state: no hit, and a
    # branch point at 64 that b's prefill passes.
    b = Request("b", [*range(64), *range(900, 936)], hash_block_size=BS)
    _, hit = mgr.get_computed_blocks(b)
    assert (hit, b.shared_prefix_tokens) == (0, 64)
    manager.armed = True
    with pytest.raises(PluginError):
        mgr.allocate_slots(b, b.num_tokens)
    assert manager.shared_states == {}
    manager.armed = False
    assert mgr.allocate_slots(b, b.num_tokens) is not None
    assert list(manager.shared_states) == [64]
    assert len(manager.shared_states[64]) == 1
