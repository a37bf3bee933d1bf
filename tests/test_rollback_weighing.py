"""A plugin's manager that raises while a step is weighed, or while the
engine keys blocks, leaves every group as it was: the plans an admission
made, the checkpoints a step shed, the keys other groups took, and the
shared states a prune dropped.

Each test arms one method of a third party's manager subclass (not one of
kvcore's modules) to raise after its base class ran, then compares the
state the public attributes show before and after.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from coordinator_setup import fa, mamba, manager_for, sw

from kvcore.coordinator import KVCacheManager, Request
from kvcore.errors import PluginError
from kvcore.registry import KindRegistry
from kvcore_full_attention import FullAttention
from kvcore_mamba import Mamba, MambaManager
from kvcore_sliding_window import SlidingWindow
from kvcore_sliding_window.manager import SlidingWindowManager

#: method name -> (group id, calls left before it raises), armed by a test.
ARMED: dict[str, list[int]] = {}

RAISING = (
    "plan_checkpoints",
    "shed_checkpoints",
    "get_num_blocks_to_allocate",
    "cache_blocks",
)


def _raising(base: type) -> type:
    """``base`` with each of :data:`RAISING` raising once armed, after the
    base class's own call."""

    def wrap(name: str) -> Any:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = getattr(super(cls, self), name)(*args, **kwargs)
            arm = ARMED.get(name)
            if arm is not None and arm[0] == self.kv_cache_group_id:
                arm[1] -= 1
                if arm[1] <= 0:
                    del ARMED[name]
                    msg = f"{name} failed"
                    raise RuntimeError(msg)
            return out

        return method

    cls = type(f"Raising{base.__name__}", (base,), {n: wrap(n) for n in RAISING})
    return cls


class RaisingMamba(Mamba):
    manager_type = _raising(MambaManager)


class RaisingWindow(SlidingWindow):
    manager_type = _raising(SlidingWindowManager)


REGISTRY = KindRegistry.from_kinds([FullAttention(), RaisingWindow(), RaisingMamba()])


@pytest.fixture(autouse=True)
def _disarm() -> Any:
    ARMED.clear()
    yield
    ARMED.clear()


def manager(specs: list[Any], num_blocks: int, block_size: int = 4) -> KVCacheManager:
    return manager_for(
        specs,
        num_blocks,
        scheduler_block_size=block_size,
        hash_block_size=block_size,
        registry=REGISTRY,
        max_model_len=1024,
    )


def request(rid: str, tokens: Any, block_size: int = 4) -> Request:
    return Request(rid, list(tokens), hash_block_size=block_size)


def test_an_admission_whose_planning_raises_keeps_no_plan() -> None:
    """The window and state groups plan an admission's checkpoints; when
    the state group raises in ``plan_checkpoints`` (after the window's
    planned), neither keeps a plan for the request that was not admitted,
    and the output end it noted is taken back."""
    mgr = manager([fa(4), sw(4, 8), mamba(4)], 200)
    window, state = mgr.coordinator.single_type_managers[1:]
    a = request("a", range(100, 132))
    assert mgr.allocate_slots(a, 32) is not None
    a.num_computed_tokens = 32
    a.append_output_token_ids(list(range(500, 508)))
    assert mgr.allocate_slots(a, 8) is not None
    a.num_computed_tokens = 40
    mgr.free(a)
    # The next turn extends a's prompt and output.
    b = request("b", [*range(100, 132), *range(500, 508), *range(600, 640)])
    blocks, hit = mgr.get_computed_blocks(b)
    ends = (state.output_ends.returned, dict(state.output_ends.keys))
    ARMED["plan_checkpoints"] = [2, 1]
    with pytest.raises(PluginError, match="plan_checkpoints"):
        mgr.allocate_slots(b, b.num_tokens - hit, hit, blocks)
    assert mgr.live_request_ids() == ()
    assert (window.grid_end, window.pinned) == ({}, {})
    assert (state.targets, state.branch, state.pinned) == ({}, {}, {})
    assert (state.output_ends.returned, dict(state.output_ends.keys)) == ends


def _resumed_with_a_target(mgr: KVCacheManager) -> Request:
    """Request b, running: it resumed from a's prompt-end state at 96 (16-
    token blocks), computed 20 tokens, and has its prompt-end target at
    128 still ahead (its hit state pinned at position 5)."""
    a = request("a", range(100), 16)
    assert mgr.allocate_slots(a, 100) is not None
    a.num_computed_tokens = 100
    mgr.cache_blocks(a, 100)
    mgr.free(a)
    b = request("b", [*range(100), *range(5000, 5040)], 16)
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 96
    assert mgr.allocate_slots(b, 20, hit, blocks) is not None
    b.num_computed_tokens = 116
    mgr.cache_blocks(b, 116)
    return b


@pytest.mark.parametrize("raising", ["get_num_blocks_to_allocate", "shed_checkpoints"])
def test_a_step_that_raises_after_shedding_gets_its_checkpoints_back(
    raising: str,
) -> None:
    """A running request's step fits only without its checkpoints; the
    state group then raises, in its own shed (after the base class shed)
    or while the step is counted again: the request keeps its prompt-end
    target, its held hit state and its release line."""
    mgr = manager([fa(16), mamba(16)], 100, block_size=16)
    state = mgr.coordinator.single_type_managers[1]
    b = _resumed_with_a_target(mgr)
    before = (state.targets["b"], state.pinned["b"], state.num_released.get("b"))
    assert before[:2] == ([128], [5])
    # One free block: the step fits only once the target at 128 is shed.
    mgr.block_pool.get_new_blocks(mgr.get_num_free_blocks() - 1)
    # The count's second call is the one after the shed.
    ARMED[raising] = [1, 2 if raising == "get_num_blocks_to_allocate" else 1]
    with pytest.raises(PluginError, match=raising):
        mgr.allocate_slots(b, 20)
    after = (state.targets.get("b"), state.pinned.get("b"), state.num_released.get("b"))
    assert after == before


def test_keying_that_raises_in_one_group_keys_nothing() -> None:
    """The engine keys a step's blocks late (``delay_cache_blocks``); when
    the state group raises, the attention group's keys, hashed counts and
    events, and the state group's kept states, are all undone."""
    mgr = KVCacheManager(
        manager([fa(4), mamba(4)], 60).kv_cache_config,
        1024,
        scheduler_block_size=4,
        hash_block_size=4,
        registry=REGISTRY,
        enable_kv_cache_events=True,
    )
    attention, state = mgr.coordinator.single_type_managers
    r = request("a", range(100, 140))
    assert mgr.allocate_slots(r, 40, delay_cache_blocks=True) is not None
    r.num_computed_tokens = 40
    mgr.take_events()
    before = copy.deepcopy(
        (mgr.block_pool.num_cached_blocks, attention.num_cached_block, state.kept)
    )
    ARMED["cache_blocks"] = [1, 1]
    with pytest.raises(PluginError, match="cache_blocks"):
        mgr.cache_blocks(r, 40)
    after = (mgr.block_pool.num_cached_blocks, attention.num_cached_block, state.kept)
    assert after == before
    assert mgr.take_events() == []
    # Keyed again without the fault, every group keys its blocks.
    mgr.cache_blocks(r, 40)
    assert mgr.block_pool.num_cached_blocks > before[0]


def _num_shared(state: Any) -> int:
    """The shared states a checkpoint manager knows (a prune runs once a
    new mark takes them past twice the pool's blocks)."""
    return sum(map(len, state.shared_states.values()))


def test_a_rolled_back_step_keeps_the_shared_states_a_prune_dropped() -> None:
    """Marking a shared state past the bound (twice the pool's blocks)
    prunes the states evicted since; when the step then rolls back, the
    evictions are undone, and so is the prune: every shared state it
    knew stays known."""
    num_blocks = 40
    mgr = manager([fa(4), mamba(4), mamba(4)], num_blocks)
    states = mgr.coordinator.single_type_managers[1:]
    pruned = 0
    n = 0
    for base_id in range(40):
        base = [base_id * 1000 + i + 7 for i in range(64)]
        for t in (64, *range(8, 64, 4)):  # the base, then branches off it at t
            n += 1
            tokens = (
                base
                if t == 64
                else [*base[:t], *range(10**6 + 10 * n, 10**6 + 10 * n + 6)]
            )
            r = request(f"r{n}", tokens)
            blocks, hit = mgr.get_computed_blocks(r)
            if any(_num_shared(s) >= 2 * num_blocks for s in states):
                # This step's mark prunes: the last state group raises.
                before = [
                    copy.deepcopy((s.shared_states, s.hit_counts)) for s in states
                ]
                ARMED["cache_blocks"] = [2, 1]
                with pytest.raises(PluginError):
                    mgr.allocate_slots(r, r.num_tokens - hit, hit, blocks)
                assert [(s.shared_states, s.hit_counts) for s in states] == before
                pruned += 1
                if pruned == 3:
                    return
                # Run it again, unarmed: it prunes for good.
                blocks, hit = mgr.get_computed_blocks(r)
            if mgr.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None:
                r.num_computed_tokens = r.num_tokens
                mgr.free(r)
    pytest.fail("no step reached the shared-state bound")


class Interrupting(MambaManager):
    """A shed that an interrupt (not an Exception) ends after its base
    class shed."""

    armed = False

    def shed_checkpoints(self, request_id: str) -> Any:
        out = super().shed_checkpoints(request_id)
        if type(self).armed:
            type(self).armed = False
            raise KeyboardInterrupt
        return out


class InterruptingMamba(Mamba):
    manager_type = Interrupting


def test_an_interrupted_shed_leaves_no_step_open() -> None:
    """An interrupt inside a shed propagates as itself, after the shed is
    undone: the request keeps its checkpoints and later calls run."""
    registry = KindRegistry.from_kinds([FullAttention(), InterruptingMamba()])
    mgr = manager_for(
        [fa(16), mamba(16)],
        100,
        scheduler_block_size=16,
        hash_block_size=16,
        registry=registry,
        max_model_len=1024,
    )
    state = mgr.coordinator.single_type_managers[1]
    b = _resumed_with_a_target(mgr)
    before = (state.targets["b"], state.pinned["b"])
    taken = mgr.block_pool.get_new_blocks(mgr.get_num_free_blocks() - 1)
    Interrupting.armed = True
    with pytest.raises(KeyboardInterrupt):
        mgr.allocate_slots(b, 20)
    assert (state.targets["b"], state.pinned["b"]) == before
    mgr.block_pool.free_blocks(taken)
    assert mgr.allocate_slots(b, 20) is not None
    mgr.free(b)
    assert mgr.get_num_free_blocks() == 99
