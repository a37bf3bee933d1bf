"""A cache manager that calls back into the KVCacheManager from inside a
step: the nested call is refused before it changes anything, and the outer
step is undone, whatever the manager does after."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import attrs
import coordinator_setup as setup
import pytest
import torch

from kvcore import KindRegistry
from kvcore.coordinator import KVCacheManager, Request, RequestStatus
from kvcore.errors import KvcoreError
from kvcore_full_attention import FullAttention, FullAttentionSpec
from kvcore_full_attention.manager import FullAttentionManager

#: What the re-entering manager does from inside a step: set per test.
CALLBACK: list[Callable[[], object]] = []


@attrs.frozen(kw_only=True)
class CallbackSpec(FullAttentionSpec):
    kind: ClassVar[str] = "callback_attention"


class CallbackManager(FullAttentionManager):
    """Full attention, but allocating a block first runs the callback."""

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> Any:
        new = super().allocate_new_blocks(request_id, num_tokens)
        if new and CALLBACK:
            CALLBACK[0]()
        return new


class CallbackKind(FullAttention):
    name: ClassVar[str] = "callback_attention"
    spec_type = CallbackSpec
    manager_type = CallbackManager


def _manager(*more: Any) -> KVCacheManager:
    spec = CallbackSpec(block_size=4, num_kv_heads=1, head_size=1, dtype=torch.float16)
    registry = KindRegistry.from_kinds([*setup.builtin_kinds(), CallbackKind()])
    return setup.manager_for(
        [setup.fa(4), spec, *more],
        32,
        scheduler_block_size=4,
        hash_block_size=4,
        registry=registry,
        enable_kv_cache_events=True,
    )


def _observed(mgr: KVCacheManager, *requests: Request) -> tuple[Any, ...]:
    pool = mgr.block_pool
    return (
        pool.get_num_free_blocks(),
        pool.free_queue.get_all_free_blocks(),
        [
            mgr.get_block_ids(r.request_id)
            for r in requests
            if r.status is RequestStatus.RUNNING
        ],
        [r.num_computed_tokens for r in requests],
        [r.status for r in requests],
        mgr.take_events(),
    )


@pytest.mark.parametrize("nested", ["allocate_slots", "free", "reset_prefix_cache"])
@pytest.mark.parametrize("then", ["raise", "swallow"])
def test_a_manager_calling_back_is_refused_and_the_step_undone(
    nested: str, then: str
) -> None:
    mgr = _manager()
    held = Request("held", list(range(2, 14)), hash_block_size=4)
    assert mgr.allocate_slots(held, 12) is not None
    held.num_computed_tokens = 12
    other = Request("other", list(range(50, 60)), hash_block_size=4)
    grow = Request("grow", list(range(100, 110)), hash_block_size=4)
    mgr.take_events()  # the held request's, published already
    before = _observed(mgr, held, other, grow)
    assert before[5] == []
    refusals: list[BaseException] = []

    def callback() -> None:
        call = {
            "allocate_slots": lambda: mgr.allocate_slots(other, 10),
            "free": lambda: mgr.free(held),
            "reset_prefix_cache": mgr.reset_prefix_cache,
        }[nested]
        try:
            call()
        except KvcoreError as exc:
            refusals.append(exc)
            if then == "raise":
                raise

    CALLBACK[:] = [callback]
    try:
        if then == "raise":
            with pytest.raises(KvcoreError, match="back into the KVCacheManager"):
                mgr.allocate_slots(grow, 10)
        else:
            assert mgr.allocate_slots(grow, 10) is not None
    finally:
        CALLBACK.clear()
    assert [type(e).__name__ for e in refusals] == ["ReentrantCallError"]
    if then == "raise":
        # Nothing the outer or the nested step did survives.
        assert _observed(mgr, held, other, grow) == before
    else:
        # The nested call changed nothing; the outer step went through.
        assert other.status is not RequestStatus.RUNNING
        assert held.status is RequestStatus.RUNNING
        assert mgr.get_block_ids("held") == before[2][0]
        mgr.free(grow)
    # The pool still works and balances.
    mgr.free(held)
    assert mgr.block_pool.get_num_free_blocks() == 31


@pytest.mark.parametrize("nested", ["cache_blocks", "remove_skipped_blocks"])
def test_a_call_that_would_change_nothing_is_refused_inside_a_step(
    nested: str,
) -> None:
    """A call that changes nothing outside a step (keying inside the
    request's cache span, releasing where the window has not moved) is
    still refused from inside one, and the outer step undone."""
    mgr = _manager(setup.sw(4, 4))
    held = Request("held", list(range(2, 16)), hash_block_size=4)
    assert mgr.allocate_slots(held, 14) is not None
    held.num_computed_tokens = 14
    mgr.remove_skipped_blocks(held, 14)
    call = {
        "cache_blocks": lambda: mgr.cache_blocks(held, 14),
        "remove_skipped_blocks": lambda: mgr.remove_skipped_blocks(held, 14),
    }[nested]
    call()  # outside a step: nothing to change, nothing refused
    grow = Request("grow", list(range(100, 110)), hash_block_size=4)
    mgr.take_events()
    before = _observed(mgr, held, grow)
    refusals: list[BaseException] = []

    def callback() -> None:
        try:
            call()
        except KvcoreError as exc:
            refusals.append(exc)
            raise

    CALLBACK[:] = [callback]
    try:
        with pytest.raises(KvcoreError, match="back into the KVCacheManager"):
            mgr.allocate_slots(grow, 10)
    finally:
        CALLBACK.clear()
    assert [type(e).__name__ for e in refusals] == ["ReentrantCallError"]
    assert _observed(mgr, held, grow) == before
