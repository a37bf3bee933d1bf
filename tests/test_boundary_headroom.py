"""An admission leaves free the blocks the running requests' states take
at their busiest coming block boundary (kvcore.coordinator.headroom),
worked by hand on a pool of Mamba states in 4-token blocks: each request
holds one state block, and a step that crosses a boundary takes a second
one that it gives back after the step."""

from __future__ import annotations

from typing import Any

import pytest
from coordinator_setup import mamba, manager_for, small_request

from kvcore import KindRegistry, KVCacheConfig
from kvcore.coordinator import KVCacheManager, Request
from kvcore.coordinator.headroom import BoundaryHeadroom
from kvcore.errors import KvcoreError, PluginError
from kvcore_mamba import Mamba
from kvcore_mamba.manager import MambaManager

PROMPT = [1, 2, 3, 4]


def _kind(manager: type[Any] | None = None) -> KindRegistry:
    """The Mamba kind, a third party's manager class in place of its own."""
    kind = type("State", (Mamba,), {"manager_type": manager})() if manager else Mamba()
    return KindRegistry.from_kinds([kind])


def _states(num_blocks: int, registry: KindRegistry | None = None) -> KVCacheManager:
    """One Mamba group in 4-token blocks, caching off: a request holds one
    state block, two while a step crosses a block boundary."""
    return manager_for(
        [mamba(4)],
        num_blocks,
        scheduler_block_size=4,
        hash_block_size=4,
        registry=registry or _kind(),
        max_model_len=64,
        enable_caching=False,
    )


def _admit(mgr: KVCacheManager, rid: str, tokens: list[int]) -> Request | None:
    req = small_request(rid, tokens)
    if mgr.allocate_slots(req, req.num_tokens, 0, None) is None:
        return None
    req.num_computed_tokens = req.num_tokens
    req.append_output_token_ids(100)
    return req


def _running(mgr: KVCacheManager, **prompts: list[int]) -> list[Request]:
    """Admit one request per keyword (its id) with that prompt, each
    admitted, computed and given its first output token."""
    out = []
    for rid, tokens in prompts.items():
        req = _admit(mgr, rid, tokens)
        assert req is not None, f"{rid} was refused"
        out.append(req)
    return out


def _decode(mgr: KVCacheManager, req: Request, steps: int) -> None:
    for i in range(steps):
        assert mgr.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        req.append_output_token_ids(101 + i)


def test_admission_leaves_the_crossing_of_aligned_requests_free() -> None:
    # 5 usable blocks.  a and b decode in step: both cross a boundary on
    # their next step and take a block each; c's own prefill crosses too.
    mgr = _states(6)
    a, b = _running(mgr, a=PROMPT, b=PROMPT)
    assert mgr.get_num_free_blocks() == 3
    # c needs 1 of the 3 free, but a, b and c crossing together take 3.
    assert _admit(mgr, "c", PROMPT) is None
    assert mgr.get_num_free_blocks() == 3
    # The crossing step: each takes its second block ...
    _decode(mgr, a, 1)
    _decode(mgr, b, 1)
    assert mgr.get_num_free_blocks() == 1
    # ... and gives back the first on its next step.
    _decode(mgr, a, 1)
    _decode(mgr, b, 1)
    assert mgr.get_num_free_blocks() == 3
    # Still in step (6 computed tokens each): c waits.
    assert _admit(mgr, "c", PROMPT) is None
    mgr.free(b)
    # a alone: its crossing and c's leave 5 - 1 - 1 - 2 = 1 spare.
    assert _admit(mgr, "c", PROMPT) is not None


def test_requests_out_of_step_cross_apart() -> None:
    mgr = _states(6)
    (a,) = _running(mgr, a=PROMPT)
    _decode(mgr, a, 2)  # 6 computed: crosses 2 steps after b
    (b,) = _running(mgr, b=PROMPT)
    assert mgr.get_num_free_blocks() == 3
    # The busiest boundary takes one of a's or b's block, plus c's: c fits.
    (c,) = _running(mgr, c=PROMPT)
    assert mgr.get_num_free_blocks() == 2
    # Every request then steps to the end of its next boundary without a
    # refusal, though the pool had room for one more admission.
    for _ in range(4):
        for req in (a, b, c):
            _decode(mgr, req, 1)
    assert mgr.get_num_free_blocks() == 2


def test_a_prefilling_request_crosses_at_every_step() -> None:
    mgr = _states(6)
    _running(mgr, a=PROMPT)
    long = small_request("long", list(range(10, 26)))
    assert mgr.allocate_slots(long, 4, 0, None) is not None
    long.num_computed_tokens = 4  # 12 tokens of prompt to go
    assert mgr.get_num_free_blocks() == 3
    # a's crossing, the long prompt's next chunk and c's prefill: 3 blocks,
    # so c (1 block) does not fit in 3 free.
    assert _admit(mgr, "c", PROMPT) is None
    mgr.free(long)
    assert _admit(mgr, "c", PROMPT) is not None


def test_a_running_request_grows_into_the_headroom() -> None:
    # The headroom is for running requests: their steps may use it all.
    mgr = _states(5)
    a, _ = _running(mgr, a=PROMPT, b=[5, 6, 7])  # 3 computed: out of step with a
    assert mgr.get_num_free_blocks() == 2
    assert _admit(mgr, "c", [8, 9, 10]) is None  # one crossing and c's
    _decode(mgr, a, 1)  # a's crossing takes one of the two
    assert mgr.get_num_free_blocks() == 1


class _TwoStates(MambaManager):
    """A third party's state manager that holds two blocks over a boundary."""

    boundary_overlap = 2


def test_a_third_party_manager_declares_its_overlap() -> None:
    mgr = _states(8, _kind(_TwoStates))
    _running(mgr, a=PROMPT)
    # a and c cross together: 2 x (1 + 1) blocks, beside c's own 1: 5 of 6.
    assert mgr.get_num_free_blocks() == 6
    _running(mgr, c=PROMPT)
    # d: 2 x (2 + 1) = 6 blocks left free, beside its own 1 of 5: refused.
    assert _admit(mgr, "d", PROMPT) is None


@pytest.mark.parametrize("bad", [-1, True, 1.0, "1", None])
def test_a_bad_overlap_is_refused_naming_the_kind(bad: object) -> None:
    manager = type("BadOverlap", (MambaManager,), {"boundary_overlap": bad})
    with pytest.raises(
        PluginError, match=r"'mamba'.*BadOverlap.*boundary_overlap"
    ) as info:
        _states(8, _kind(manager))
    assert isinstance(info.value, KvcoreError)


@pytest.mark.parametrize(("in_flight", "admitted"), [(0, True), (1, False)])
def test_a_step_in_flight_keeps_a_crossing_block_a_step_longer(
    in_flight: int, admitted: bool
) -> None:
    # a crossed on its latest step, b crosses on its next.  Synchronously
    # a gives its old block back on that step; with a step in flight it
    # holds it one step longer, so both crossings' blocks are out at once.
    mgr = _states(7)
    a, _ = _running(mgr, a=PROMPT, b=PROMPT)
    assert mgr.allocate_slots(a, 1, num_in_flight_tokens=in_flight) is not None
    assert mgr.get_num_free_blocks() == 3  # a: two state blocks, b: one
    # c (1 block): 3 free less a's and b's crossings (1 or 2 at once) and
    # its own.
    assert (_admit(mgr, "c", PROMPT) is not None) is admitted


def test_can_fit_full_sequence_counts_the_headroom_as_admission_does() -> None:
    mgr = _states(6)
    a, b = _running(mgr, a=PROMPT, b=PROMPT)
    c = small_request("c", PROMPT)
    # 3 free, 1 needed, 3 left free for a's, b's and c's crossings.
    assert not mgr.can_fit_full_sequence(c)
    assert mgr.allocate_slots(c, 4, 0, None, full_sequence_must_fit=True) is None
    mgr.free(b)
    assert mgr.can_fit_full_sequence(c)
    assert mgr.allocate_slots(c, 4, 0, None, full_sequence_must_fit=True) is not None
    # A running request's own sequence is weighed without the headroom.
    assert mgr.can_fit_full_sequence(a, 8)


class _RaisingOverlap(MambaManager):
    @property  # type: ignore[override]
    def boundary_overlap(self) -> int:
        raise RuntimeError("overlap unknown")


def test_a_raising_overlap_is_reported_naming_the_kind() -> None:
    with pytest.raises(PluginError, match=r"'mamba'.*boundary_overlap raised") as info:
        _states(8, _kind(_RaisingOverlap))
    assert isinstance(info.value.__cause__, RuntimeError)


def test_a_mamba_subclass_without_a_manager_is_refused_by_name() -> None:
    with pytest.raises(PluginError, match="has no block manager"):
        _states(
            8,
            KindRegistry.from_kinds(
                [type("State", (Mamba,), {"manager_type": None})()]
            ),
        )


def test_from_plan_passes_the_setting_on() -> None:
    config = _states(6).kv_cache_config
    plan = KVCacheConfig(
        num_blocks=config.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=config.kv_cache_groups,
        scheduler_block_size=4,
        hash_block_size=4,
        max_model_len=64,
        enable_prefix_caching=False,
    )
    for headroom, admitted in ((True, False), (False, True)):
        mgr = KVCacheManager.from_plan(
            plan, registry=_kind(), boundary_headroom=headroom
        )
        _running(mgr, a=PROMPT, b=PROMPT)
        assert (_admit(mgr, "c", PROMPT) is not None) is admitted


def test_the_lag_is_a_decode_steps_and_idle_requests_count_for_nothing() -> None:
    headroom = BoundaryHeadroom.of([(16, 1), (416, 0)])
    assert headroom is not None
    assert (headroom.sizes, headroom.per_request) == (((16, 1),), 1)
    # A prefill chunk in flight, then a decode step's one token: the lag is
    # the decode step's (the fewest seen), never past a block less one.
    headroom.saw_in_flight(40)
    assert headroom.lag == 15
    headroom.saw_in_flight(13)
    headroom.saw_in_flight(1)
    headroom.saw_in_flight(13)
    assert headroom.lag == 1
    held = {
        "a": small_request("a", list(range(17))),
        "b": small_request("b", list(range(18))),
    }
    ends = {"a": 16, "b": 17}  # decoding, one token apart: one window of 2
    assert headroom.blocks(held, ends, 0) == 2 + 1
    # Requests that hold blocks but no longer step leave nothing to keep.
    assert headroom.blocks(held, ends, 0, steps=lambda request: False) == 0
