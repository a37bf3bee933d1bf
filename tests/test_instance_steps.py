"""The core calls a manager's steps through its class: what a kind's class
defines runs (and is checked as the kind's own code); an attribute of the
same name set on a manager instance never runs; a step that is not a
method of the class is refused when the manager is built."""

from __future__ import annotations

import functools
from typing import Any

import coordinator_setup as setup
import pytest

from kvcore import KindRegistry
from kvcore.coordinator import KVCacheManager, Request
from kvcore.coordinator.twins import CLASS_STEPS
from kvcore.errors import PluginError
from kvcore_full_attention import FullAttention
from kvcore_mamba import Mamba, MambaManager
from kvcore_sliding_window import SlidingWindow, SlidingWindowManager

BASES = {SlidingWindowManager: SlidingWindow, MambaManager: Mamba}


def _counting(base: type, step: str) -> type:
    """A manager class whose own ``step`` counts its runs and runs the
    base's; each instance also sets ``step`` on itself, counted apart and
    taking a reference no table holds (a leak, were it ever run)."""

    def own(self: Any, *args: Any) -> Any:
        type(self).class_runs += 1
        return getattr(base, step)(self, *args)

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)

        def on_instance(*args: Any) -> Any:
            type(self).instance_runs += 1
            live = [b for t in self.req_to_blocks.values() for b in t if b]
            if live and self.block_pool.journal is not None:
                self.block_pool.touch(live[:1])
            return own(self, *args)

        setattr(self, step, on_instance)

    namespace = {step: own, "__init__": init, "class_runs": 0, "instance_runs": 0}
    return type(f"Counting_{step}", (base,), namespace)


def _manager(manager_type: type, num_blocks: int) -> KVCacheManager:
    base = next(b for b in BASES if issubclass(manager_type, b))
    kind = type("Kind", (BASES[base],), {"manager_type": manager_type})()
    spec = setup.sw(16, 32) if base is SlidingWindowManager else setup.mamba(16)
    return setup.manager_for(
        [setup.fa(16), spec],
        num_blocks,
        scheduler_block_size=16,
        hash_block_size=16,
        registry=KindRegistry.from_kinds([FullAttention(), kind], owner="acme"),
        max_model_len=1024,
    )


def _decode(
    mgr: KVCacheManager, request: Request, steps: int, *, release: bool
) -> None:
    for _ in range(steps):
        request.append_output_token_ids(3)
        if release:
            mgr.remove_skipped_blocks(request, request.num_computed_tokens)
        if mgr.allocate_slots(request, 1) is None:
            return
        request.num_computed_tokens += 1


def _run(manager_type: type) -> list[KVCacheManager]:
    """Two requests on one prefix (a hit), decoded past their windows and
    states, a refusal, and frees; then a running request in a pool so tight
    that its step fits only by what its release returns."""
    roomy = _manager(manager_type, 40)
    requests = []
    for rid in ("a", "b"):
        request = Request(rid, list(range(120)), hash_block_size=16)
        blocks, hit = roomy.get_computed_blocks(request)
        assert roomy.allocate_slots(request, 120 - hit, hit, blocks) is not None
        request.num_computed_tokens = 120
        requests.append(request)
        _decode(roomy, request, 40, release=True)
    big = Request("big", list(range(500, 1100)), hash_block_size=16)
    assert roomy.allocate_slots(big, 600) is None
    for request in requests:
        roomy.free(request)
    tight = _manager(manager_type, 14)
    request = Request("a", list(range(64)), hash_block_size=16)
    assert tight.allocate_slots(request, 64) is not None
    request.num_computed_tokens = 64
    # The longest filler that fits, but for one block: "a" then grows only
    # by what its release returns.
    for size in range(tight.block_pool.get_num_free_blocks() - 1, 0, -1):
        filler = Request("f", list(range(900, 900 + 16 * size)), hash_block_size=16)
        if tight.allocate_slots(filler, filler.num_tokens) is not None:
            break
    _decode(tight, request, 40, release=False)
    tight.free(request)
    tight.free(filler)
    return [roomy, tight]


@pytest.mark.parametrize("base", list(BASES), ids=lambda b: b.__name__)
@pytest.mark.parametrize("step", CLASS_STEPS)
def test_a_step_set_on_the_instance_never_runs(base: type, step: str) -> None:
    manager_type = _counting(base, step)
    managers = _run(manager_type)
    kind = managers[0].coordinator.single_type_managers[1]
    # A free asks take_held_back only of a group whose held-back blocks
    # rejoin the request's table: one that holds back and is not freed
    # last (a state group moves its own to the back), or rejoins releases.
    asked = step != "take_held_back" or (
        kind.rejoins_releases or (kind.holds_back and not kind.evicts_last)
    )
    assert (manager_type.class_runs > 0) == asked  # the class's step ran
    assert manager_type.instance_runs == 0
    for mgr in managers:
        pool = mgr.block_pool
        assert [b for b in range(pool.num_blocks) if pool.ref_cnt[b]] == []
        assert pool.get_num_free_blocks() == pool.num_blocks - 1


class _Static(SlidingWindowManager):
    @staticmethod
    def releases_nothing(request_id: str, num_computed_tokens: int) -> bool:
        return False


class _ClassStep(SlidingWindowManager):
    @classmethod
    def admission_blocks(cls, hit: Any, num_computed_tokens: int) -> Any:
        return hit


class _Strategy:
    def __call__(self, twins: Any, request: Any, num_tokens: int) -> None:
        return None


class _CallableObject(SlidingWindowManager):
    cache_twins = _Strategy()


class _Property(SlidingWindowManager):
    @property
    def get_num_blocks_to_allocate(self) -> Any:
        return functools.partial(SlidingWindowManager.get_num_blocks_to_allocate, self)


@pytest.mark.parametrize(
    ("manager_type", "step", "what"),
    [
        (_Static, "releases_nothing", "staticmethod"),
        (_ClassStep, "admission_blocks", "classmethod"),
        (_CallableObject, "cache_twins", "_Strategy"),
        (_Property, "get_num_blocks_to_allocate", "property"),
    ],
)
def test_a_step_that_is_not_a_method_is_refused_when_built(
    manager_type: type, step: str, what: str
) -> None:
    with pytest.raises(PluginError) as info:
        _manager(manager_type, 40)
    message = str(info.value)
    assert f"{manager_type.__name__}.{step} is a {what}, not a method" in message
    assert "plugin 'acme'" in message
    assert info.value.plugin_name == "acme"


class _PartialStep(SlidingWindowManager):
    def _pop(self, twins: Any, request_id: str, tag: str) -> Any:
        return SlidingWindowManager.pop_twins(self, twins, request_id)

    pop_twins = functools.partialmethod(_pop, tag="x")


def _wrapped(step: Any) -> Any:
    @functools.wraps(step)
    def inner(*args: Any, **kwargs: Any) -> Any:
        return step(*args, **kwargs)

    return inner


class _DecoratedStep(SlidingWindowManager):
    allocate_twins = _wrapped(SlidingWindowManager.allocate_twins)


@pytest.mark.parametrize("manager_type", [_PartialStep, _DecoratedStep])
def test_partial_and_decorated_methods_are_steps(manager_type: type) -> None:
    plain = [m.block_pool.get_num_free_blocks() for m in _run(SlidingWindowManager)]
    assert [m.block_pool.get_num_free_blocks() for m in _run(manager_type)] == plain
