"""``KVCacheManager(thread_safe=True)``: every public method under one lock."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
import torch
from coordinator_setup import BUILT_IN

from kvcore import KVCacheConfig, KVCacheGroupSpec
from kvcore.coordinator import KVCacheManager, Request
from kvcore.errors import KvcoreTypeError
from kvcore_full_attention import FullAttentionSpec
from kvcore_sliding_window import SlidingWindowSpec

NUM_BLOCKS = 64


def manager(**kw: object) -> KVCacheManager:
    fa = FullAttentionSpec(
        block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    sw = SlidingWindowSpec(
        block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16, sliding_window=8
    )
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["layer.0"], fa),
            KVCacheGroupSpec(["layer.1"], sw),
        ],
    )
    return KVCacheManager(
        config,
        max_model_len=256,
        scheduler_block_size=4,
        registry=BUILT_IN,
        **kw,  # type: ignore[arg-type]
    )


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Switch threads as often as the interpreter allows, so unserialised
    calls would interleave mid-step."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


@pytest.mark.usefixtures("fast_switching")
def test_eight_threads_on_one_manager_leave_every_block_free() -> None:
    mgr = manager(thread_safe=True, enable_kv_cache_events=True)
    lock = mgr.lock
    assert lock is not None
    errors: list[BaseException] = []
    done = [0] * 8
    start = threading.Barrier(8)

    def work(t: int) -> None:
        try:
            start.wait()
            for i in range(100):
                # Four shared prompts, so threads hit each other's blocks.
                prompt = [1000 * (i % 4) + k for k in range(10 + i % 7)]
                req = Request(f"t{t}-{i}", prompt, hash_block_size=4)
                # A lookup alone, racing the other threads' steps.
                mgr.get_computed_blocks(Request(f"p{t}-{i}", prompt, hash_block_size=4))
                # Admission: the hit must still be there when it is used, so
                # the lookup and its allocation run under one hold of the lock.
                with lock:
                    hit, num_hit = mgr.get_computed_blocks(req)
                    new = req.num_tokens - num_hit
                    out = mgr.allocate_slots(req, new, num_hit, hit)
                if out is not None:
                    req.num_computed_tokens = req.num_tokens
                    req.append_output_token_ids(7)
                    if mgr.allocate_slots(req, 1) is not None:
                        req.num_computed_tokens += 1
                    mgr.usage  # noqa: B018 - a read racing the steps
                    mgr.group_usage()
                mgr.free(req)
                mgr.take_events()
                done[t] += 1
        except BaseException as exc:  # collected, re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads)
    assert errors == []
    assert done == [100] * 8
    pool = mgr.block_pool
    assert mgr.get_num_free_blocks() == NUM_BLOCKS - 1
    queued = pool.free_queue.get_all_free_blocks()
    assert sorted(queued) == list(range(1, NUM_BLOCKS))
    assert pool.ref_cnt == [0] * NUM_BLOCKS
    assert mgr.group_usage() == (0, 0)
    assert mgr.reset_prefix_cache() is True


def test_a_call_waits_for_the_lock() -> None:
    mgr = manager(thread_safe=True)
    finished = threading.Event()

    def read() -> None:
        mgr.get_num_free_blocks()
        finished.set()

    assert mgr.lock is not None
    with mgr.lock:
        th = threading.Thread(target=read)
        th.start()
        assert not finished.wait(0.2)  # blocked on the held lock
    assert finished.wait(10)
    th.join()


def test_the_lock_is_reentrant_and_keeps_the_methods() -> None:
    mgr = manager(thread_safe=True)
    assert mgr.lock is not None
    with mgr.lock:  # held by this thread: calls still run
        req = Request("r", list(range(8)), hash_block_size=4)
        assert mgr.allocate_slots(req, 8) is not None
        assert mgr.get_block_ids("r") == ([1, 2], [3, 4])
    assert mgr.allocate_slots.__name__ == "allocate_slots"
    assert mgr.allocate_slots.__doc__ == KVCacheManager.allocate_slots.__doc__
    assert mgr.thread_safe is True


def test_off_by_default_and_then_lock_free() -> None:
    mgr = manager()
    assert mgr.thread_safe is False
    assert mgr.lock is None
    # The class's own methods, not wrappers: nothing per call.
    assert "allocate_slots" not in vars(mgr)
    assert type(mgr).allocate_slots is KVCacheManager.allocate_slots


@pytest.mark.parametrize("value", [1, None, "yes"])
def test_thread_safe_must_be_a_bool(value: object) -> None:
    with pytest.raises(KvcoreTypeError, match="thread_safe must be a bool") as info:
        manager(thread_safe=value)
    assert isinstance(info.value, TypeError)


def test_the_choice_is_a_class_made_once() -> None:
    """``thread_safe=True`` builds the locked subclass; its instances carry
    no per-instance wrappers, like the lock-free class's."""
    mgr = manager(thread_safe=True)
    assert type(mgr) is KVCacheManager.ThreadSafe
    assert isinstance(mgr, KVCacheManager)
    assert mgr.thread_safe is True
    assert "allocate_slots" not in vars(mgr)
    assert manager(thread_safe=True).__class__ is type(mgr)
    assert type(manager()) is KVCacheManager


def _held_elsewhere(mgr: KVCacheManager) -> bool:
    """Whether another thread finds ``mgr.lock`` held."""
    assert mgr.lock is not None
    lock = mgr.lock
    got: list[bool] = []

    def probe() -> None:
        ok = lock.acquire(blocking=False)
        if ok:
            lock.release()
        got.append(not ok)

    th = threading.Thread(target=probe)
    th.start()
    th.join()
    return got[0]


def _one_group_config() -> KVCacheConfig:
    """The scheduler's view of one 4-token full-attention group, 16 blocks."""
    fa = FullAttentionSpec(
        block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    return KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], fa)],
    )


def test_a_subclass_gets_its_own_locked_class_with_its_methods_locked() -> None:
    class Traced(KVCacheManager):
        def holds_lock(self) -> bool:
            return _held_elsewhere(self)

    config = _one_group_config()
    mgr = Traced(
        config, 64, scheduler_block_size=4, registry=BUILT_IN, thread_safe=True
    )
    assert type(mgr) is Traced.ThreadSafe
    assert Traced.ThreadSafe is not KVCacheManager.ThreadSafe
    assert isinstance(mgr, Traced)
    assert mgr.holds_lock() is True
    assert _held_elsewhere(mgr) is False
    plain = Traced(config, 64, scheduler_block_size=4, registry=BUILT_IN)
    assert type(plain) is Traced
    assert plain.lock is None


def test_a_thread_safe_manager_pickles_with_a_fresh_lock() -> None:
    """Default pickling: the class is found by name in a fresh process and
    the copy has its own, unheld lock, even when the original's is held."""
    mgr = manager(thread_safe=True)
    req = Request("r", list(range(8)), hash_block_size=4)
    assert mgr.allocate_slots(req, 8) is not None
    assert mgr.lock is not None
    with mgr.lock:
        data = pickle.dumps(mgr)
        copied = copy.deepcopy(mgr)
    assert copied.lock is not None
    assert copied.lock is not mgr.lock
    assert _held_elsewhere(copied) is False
    script = (
        "import pickle, sys\n"
        "mgr = pickle.loads(sys.stdin.buffer.read())\n"
        "print(type(mgr).__qualname__, mgr.lock.acquire(blocking=False),"
        " mgr.get_block_ids('r'))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", script],
        input=data,
        capture_output=True,
        check=True,
        env=env,
        timeout=120,
    )
    assert out.stdout.decode().split(None, 2) == [
        "KVCacheManager.ThreadSafe",
        "True",
        "([1, 2], [3, 4])\n",
    ]


def test_a_subclass_may_turn_a_method_into_a_property() -> None:
    """Only what a class resolves to a function is locked: a property or
    classmethod a subclass puts in an inherited method's place stays one."""

    class Reporting(KVCacheManager):
        @property
        def group_usage(self) -> tuple[float, ...]:  # type: ignore[override]
            return (0.5,)

        @classmethod
        def get_num_free_blocks(cls) -> int:  # type: ignore[override]
            return -1

    config = _one_group_config()
    mgr = Reporting(
        config, 64, scheduler_block_size=4, registry=BUILT_IN, thread_safe=True
    )
    assert type(mgr) is Reporting.ThreadSafe
    assert mgr.group_usage == (0.5,)
    assert mgr.get_num_free_blocks() == -1
