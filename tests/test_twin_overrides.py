"""A third party's twin step (``pop_twins``, ``cache_twins``) over a class
whose ancestor overrides the one-group step, reaching it by ``super()``."""

from __future__ import annotations

from typing import Any

from coordinator_setup import fa, mamba, manager_for, sw

from kvcore.coordinator import Request
from kvcore.registry import KindRegistry
from kvcore_full_attention import FullAttention
from kvcore_mamba import Mamba, MambaManager
from kvcore_sliding_window import SlidingWindow
from kvcore_sliding_window.manager import SlidingWindowManager


def request(rid: str, tokens: Any) -> Request:
    return Request(rid, list(tokens), hash_block_size=4)


class PoppingMamba(MambaManager):
    """A third party's twin step over an ancestor's one-group override
    (``CheckpointManager.pop_blocks``), reaching it by ``super()``."""

    popped = 0

    def pop_twins(self, twins: Any, request_id: str) -> Any:
        type(self).popped += 1
        return super().pop_twins(twins, request_id)


class CachingWindow(SlidingWindowManager):
    """The same over ``WindowManager.cache_blocks``."""

    cached = 0

    def cache_twins(self, twins: Any, request: Request, num_tokens: int) -> None:
        type(self).cached += 1
        super().cache_twins(twins, request, num_tokens)


class Popping(Mamba):
    manager_type = PoppingMamba


class Caching(SlidingWindow):
    manager_type = CachingWindow


def test_a_twin_step_over_an_ancestors_one_group_step_runs_it_once() -> None:
    """Overriding the twin step of a class whose ancestor overrides the
    one-group step, and calling ``super()``, runs the ancestor's step:
    the same blocks and hits as the built-in kinds, no endless loop."""

    def serve(registry: KindRegistry) -> tuple[int, int, int]:
        mgr = manager_for(
            [fa(4), sw(4, 8), mamba(4)],
            80,
            scheduler_block_size=4,
            hash_block_size=4,
            registry=registry,
            max_model_len=1024,
        )
        a = request("a", range(100, 140))
        assert mgr.allocate_slots(a, 40) is not None
        a.num_computed_tokens = 40
        mgr.cache_blocks(a, 40)
        mgr.free(a)
        b = request("b", [*range(100, 140), *range(700, 708)])
        blocks, hit = mgr.get_computed_blocks(b)
        assert mgr.allocate_slots(b, b.num_tokens - hit, hit, blocks) is not None
        held = mgr.get_num_free_blocks()
        mgr.free(b)
        return hit, held, mgr.get_num_free_blocks()

    built_in = serve(
        KindRegistry.from_kinds([FullAttention(), SlidingWindow(), Mamba()])
    )
    third = serve(KindRegistry.from_kinds([FullAttention(), Caching(), Popping()]))
    assert third == built_in
    assert built_in[0] > 0
    # The third party's run: its twin steps ran, a pop per free (a, b) and
    # a store at least at each admission (a's 40 tokens, b's prompt).
    assert PoppingMamba.popped == 2
    assert CachingWindow.cached >= 2
