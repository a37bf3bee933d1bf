"""The blocks a manager's step answers with are checked where they cross
into the core: the engine writes the step's KV into the new blocks
(vLLM's workers append them to the request's block table), so a block the
pool did not hand out in that call would be written over another
request's KV; and a freed request's popped tables are what the pool
frees, so a block left out would never be freed and another request's
block in them would be freed under it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import coordinator_setup as setup
import pytest
import torch

import kvcore
from kvcore import KindRegistry
from kvcore.coordinator import KVCacheManager, Request
from kvcore.coordinator.manager import SingleTypeManager
from kvcore.coordinator.managers import PrefixManager
from kvcore.errors import KvcoreError, PluginResultError
from kvcore_full_attention import FullAttention, FullAttentionManager
from kvcore_sliding_window import SlidingWindow, SlidingWindowManager


class _Answers(FullAttentionManager):
    """Full attention whose ``allocate_twins`` answer is bent by ``mode``
    (the table grows as the answer says)."""

    mode = ""

    def allocate_twins(
        self, twins: Sequence[Any], request_id: str, num_tokens: int
    ) -> list[list[int]] | None:
        if request_id == "live" or not self.mode:
            return super().allocate_twins(twins, request_id, num_tokens)
        if self.mode == "two hand-outs":
            # Legal: one block per call, returned in order.
            held = self.req_to_blocks.setdefault(request_id, [])
            need = -(-num_tokens // self.block_size) - len(held)
            if need <= 0:
                return None
            new = [self.block_pool.get_new_blocks(1)[0] for _ in range(need)]
            held += new
            return [new]
        out = super().allocate_twins(twins, request_id, num_tokens)
        if out is None:
            return None
        table = self.req_to_blocks[request_id]
        if self.mode == "another request's block":
            table[-1] = self.req_to_blocks["live"][0]
            out[0][-1] = table[-1]
        elif self.mode == "the null block":
            table[-1] = out[0][-1] = self.null_block
        elif self.mode == "a block twice":
            table[-1] = out[0][-1] = out[0][0]
        elif self.mode == "a block freed again":
            self.block_pool.free_blocks([table.pop()])
        elif self.mode == "a tuple":
            return [tuple(out[0])]  # type: ignore[list-item]
        elif self.mode == "one list too many":
            return [*out, []]
        elif self.mode == "twins' lists swapped":
            return out[::-1]
        elif self.mode == "a block placed in no table":
            table.pop()
        elif self.mode == "out of order":
            return [blocks[::-1] for blocks in out]
        elif self.mode == "a block in both tables":
            # The first group's new blocks in both tables, listed once.
            twins[1].req_to_blocks[request_id][-len(out[1]) :] = out[0]
            return [out[0], []]
        elif self.mode == "tables grown, none listed":
            return None
        return out

    def pop_twins(self, twins: Sequence[Any], request_id: str) -> Any:
        out = super().pop_twins(twins, request_id)
        if request_id == "live" or out[0] is None:
            return out
        if self.mode == "pop one block short":
            return [out[0][:-1]]
        if self.mode == "pop its table cut in place":
            out[0].pop()
            return out
        if self.mode == "pop another request's block":
            return [[*out[0], self.req_to_blocks["live"][0]]]
        if self.mode == "pop nothing":
            return [None]
        if self.mode == "pop a tuple":
            return (out[0],)  # a sequence of the tables: accepted
        return out


def _manager(mode: str, num_groups: int = 1) -> KVCacheManager:
    manager = type("_Answers", (_Answers,), {"mode": mode})
    kind = type("AnswersKind", (FullAttention,), {"manager_type": manager})()
    spec = FullAttention().spec_type(
        block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    return KVCacheManager(
        kvcore.KVCacheConfig(
            num_blocks=32,
            kv_cache_tensors=[],
            kv_cache_groups=[
                kvcore.KVCacheGroupSpec([f"l{g}"], spec) for g in range(num_groups)
            ],
        ),
        max_model_len=1024,
        scheduler_block_size=16,
        hash_block_size=16,
        registry=KindRegistry.from_kinds([kind], owner="acme"),
    )


def _state(mgr: KVCacheManager) -> tuple[list[int], list[int]]:
    pool = mgr.block_pool
    return list(pool.ref_cnt), pool.free_queue.get_all_free_blocks()


def _beside_live(mgr: KVCacheManager, num_tokens: int) -> Request:
    """Request 'live' (32 tokens: blocks 1 and 2), then request 'r' of
    ``num_tokens`` computed tokens (blocks from 3 on)."""
    live = Request("live", list(range(900, 932)), hash_block_size=16)
    assert mgr.allocate_slots(live, 32) is not None
    req = Request("r", list(range(num_tokens)), hash_block_size=16)
    assert mgr.allocate_slots(req, num_tokens) is not None
    req.num_computed_tokens = num_tokens
    return req


BAD = {
    "another request's block": r"returned block 1 among the new blocks of "
    r"\[\[\d+, 1\]\], which the block pool did not hand out in this call",
    "the null block": r"returned block 0 among the new blocks",
    "a block twice": r"returned block (\d+) among the new blocks of \[\[\1, \1\]\]",
    "a block freed again": r"returned block (\d+) among the new blocks of "
    r"\[\[\d+, \1\]\], which the block pool did not hand out in this call or "
    r"which is no longer held",
    "a tuple": r"returned \(\d+, \d+\) as a group's new blocks; each must be a list",
    "one list too many": r"it must return None or a list of each twin group's "
    r"new blocks \(1 lists, one per group\)",
}


@pytest.mark.parametrize("mode", list(BAD))
def test_an_admission_answer_of_blocks_not_handed_out_is_refused(mode: str) -> None:
    mgr = _manager(mode)
    live = Request("live", list(range(900, 932)), hash_block_size=16)
    assert mgr.allocate_slots(live, 32) is not None
    before = _state(mgr)
    req = Request("r", list(range(32)), hash_block_size=16)
    with pytest.raises(PluginResultError, match=BAD[mode]) as info:
        mgr.allocate_slots(req, 32)
    assert isinstance(info.value, KvcoreError)
    assert "_Answers.allocate_twins" in str(info.value)
    # Named by the plugin that registered the kind, not the manager's module.
    assert info.value.plugin_name == "acme"
    # Nothing changed: the live request keeps its blocks, none leaked.
    assert _state(mgr) == before
    assert mgr.get_block_ids("live") == ([1, 2],)
    assert "r" not in mgr.coordinator.single_type_managers[0].req_to_blocks


@pytest.mark.parametrize("mode", ["another request's block", "the null block"])
def test_a_running_requests_grow_answer_is_checked_too(mode: str) -> None:
    mgr = _manager("")
    req = _beside_live(mgr, 16)
    req.append_output_token_ids(7)
    for manager in mgr.coordinator.single_type_managers:
        type(manager).mode = mode  # the next step's answer goes wrong
    before = _state(mgr)
    with pytest.raises(PluginResultError, match="did not hand out in this call"):
        mgr.allocate_slots(req, 1)
    assert _state(mgr) == before
    assert mgr.get_block_ids("r") == ([3],)


TWINS = {
    # (mode, running): the answer named, and what the table grew by.
    ("twins' lists swapped", False): ("[3, 4]", "[1, 2]"),
    ("twins' lists swapped", True): ("[4]", "[3]"),
    ("a block placed in no table", False): ("[1, 2]", "[1]"),
    ("a block placed in no table", True): ("[3]", "[]"),
    ("out of order", False): ("[2, 1]", "[1, 2]"),
    ("a block in both tables", False): ("[]", "[1, 2]"),
    ("a block in both tables", True): ("[]", "[3]"),
    ("tables grown, none listed", False): ("[]", "[1, 2]"),
}


@pytest.mark.parametrize(("mode", "running"), list(TWINS))
def test_each_twins_answer_must_be_what_its_table_grew_by(
    mode: str, running: bool
) -> None:
    # Two groups of one class step as twins: one hand-out, split in group
    # order.  The engine appends group g's new blocks to its block table
    # and writes group g's KV there, so an answer listing another group's
    # blocks there, out of order, a block no table holds, or a table grown
    # by blocks no list names would put the KV where no hit reads it (or
    # leave a block in two tables with one reference).
    mgr = _manager("" if running else mode, num_groups=2)
    req = Request("r", list(range(48)), hash_block_size=16)
    if running:
        assert mgr.allocate_slots(req, 16) is not None
        assert mgr.get_block_ids("r") == ([1], [2])
        req.num_computed_tokens = 16
        for manager in mgr.coordinator.single_type_managers:
            type(manager).mode = mode
    before = _state(mgr)
    answer, grown = TWINS[mode, running]
    with pytest.raises(PluginResultError) as info:
        mgr.allocate_slots(req, 16 if running else 32)
    assert (
        f"_Answers.allocate_twins returned {answer} as the new blocks of cache "
        f"group {1 if 'both' in mode else 0} for request 'r', but that "
        f"group's table grew by {grown}"
    ) in str(info.value)
    assert info.value.plugin_name == "acme"
    assert _state(mgr) == before
    if running:
        assert mgr.get_block_ids("r") == ([1], [2])
    else:
        assert "r" not in mgr.coordinator.single_type_managers[0].req_to_blocks


class _Mixin(SingleTypeManager):
    """A kind's own allocation step, in a class after a core manager class
    in its subclass's method resolution order."""

    def allocate_twins(
        self, twins: Sequence[Any], request_id: str, num_tokens: int
    ) -> list[list[int]] | None:
        out = SingleTypeManager.allocate_twins(self, twins, request_id, num_tokens)
        if out is not None and request_id != "live":
            self.req_to_blocks[request_id][-1] = self.req_to_blocks["live"][0]
            out[0][-1] = self.req_to_blocks["live"][0]
        return out


class _MixedIn(PrefixManager, _Mixin):
    """Runs ``_Mixin.allocate_twins``: the kind's code, checked as such."""


def test_a_kinds_step_behind_a_core_class_in_the_mro_is_checked() -> None:
    assert _MixedIn.allocate_twins is _Mixin.allocate_twins
    kind = type("MixedKind", (FullAttention,), {"manager_type": _MixedIn})()
    mgr = setup.manager_for(
        [
            FullAttention().spec_type(
                block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16
            )
        ],
        32,
        scheduler_block_size=16,
        hash_block_size=16,
        registry=KindRegistry.from_kinds([kind], owner="acme"),
        max_model_len=1024,
    )
    live = Request("live", list(range(900, 932)), hash_block_size=16)
    assert mgr.allocate_slots(live, 32) is not None
    before = _state(mgr)
    req = Request("r", list(range(32)), hash_block_size=16)
    with pytest.raises(
        PluginResultError, match=r"_MixedIn\.allocate_twins returned block 1"
    ):
        mgr.allocate_slots(req, 32)
    assert _state(mgr) == before
    assert mgr.get_block_ids("live") == ([1, 2],)


def test_blocks_from_several_hand_outs_in_one_call_pass() -> None:
    mgr = _manager("two hand-outs")
    req = Request("r", list(range(48)), hash_block_size=16)
    out = mgr.allocate_slots(req, 48)
    assert out is not None
    assert out.get_block_ids() == ([1, 2, 3],)
    assert mgr.get_block_ids("r") == ([1, 2, 3],)


POPS = {
    "pop one block short": r"returned \[\[3\]\] for request 'r', whose tables "
    r"were \[\[3, 4\]\] \(of \[2\] blocks before the call\); it must return each "
    r"twin's table as the request held it",
    "pop its table cut in place": r"returned \[\[3\]\] for request 'r', whose "
    r"tables were \[\[3, 4\]\] \(of \[2\] blocks before the call\)",
    "pop another request's block": r"returned \[\[3, 4, 1\]\] for request 'r'",
    "pop nothing": r"returned \[None\] for request 'r'",
}


@pytest.mark.parametrize("forward_ran", [True, False])
@pytest.mark.parametrize("mode", list(POPS))
def test_a_pop_answer_that_is_not_the_requests_tables_is_refused(
    mode: str, forward_ran: bool
) -> None:
    mgr = _manager("")
    req = _beside_live(mgr, 32)
    for manager in mgr.coordinator.single_type_managers:
        type(manager).mode = mode
    before = _state(mgr)
    with pytest.raises(PluginResultError, match=POPS[mode]) as info:
        mgr.free(req, forward_ran=forward_ran)
    assert "_Answers.pop_twins" in str(info.value)
    assert info.value.plugin_name == "acme"
    # The free was undone: both requests keep their blocks, none is free
    # (a table the manager cut in place too: it was recorded whole before
    # the kind's own step ran).
    assert _state(mgr) == before
    assert mgr.get_block_ids("r") == ([3, 4],)
    assert mgr.get_block_ids("live") == ([1, 2],)
    for manager in mgr.coordinator.single_type_managers:
        type(manager).mode = ""
    mgr.free(req)
    assert mgr.block_pool.ref_cnt[3:5] == [0, 0]


def test_a_pop_answer_of_the_tables_in_another_sequence_passes() -> None:
    mgr = _manager("pop a tuple")
    req = Request("r", list(range(32)), hash_block_size=16)
    assert mgr.allocate_slots(req, 32) is not None
    free = mgr.block_pool.get_num_free_blocks()
    mgr.free(req)
    assert mgr.block_pool.get_num_free_blocks() == free + 2


class _ReturningWindow(SlidingWindowManager):
    """A window whose release and keying steps return what they changed:
    only an allocation's answer is used, so neither is checked or used."""

    def release_twins(self, twins: Sequence[Any], *args: Any) -> Any:
        tables = [list(t.req_to_blocks.get(args[0], ())) for t in twins]
        super().release_twins(twins, *args)
        return tables

    def cache_twins(self, twins: Sequence[Any], *args: Any) -> Any:
        super().cache_twins(twins, *args)
        return [["not", "blocks"] for _ in twins]


def test_what_a_release_or_a_keying_returns_is_not_used() -> None:
    kind = type("ReturningKind", (SlidingWindow,), {"manager_type": _ReturningWindow})()
    mgr = setup.beside_full_attention(kind, 32, block_size=4, window=4)
    req = Request("r", list(range(16)), hash_block_size=4)
    out = mgr.allocate_slots(req, 16)
    assert out is not None
    assert out.get_block_ids() == ([1, 2, 3, 4], [5, 6, 7, 8])
    req.num_computed_tokens = 16
    req.append_output_token_ids(99)
    # Token 16 reads the window's tokens 13-16: the step releases positions
    # 0-2 (keyed, so they queue behind the unkeyed blocks 9 on) and takes a
    # block in each group, in group order.
    out = mgr.allocate_slots(req, 1)
    assert out is not None
    assert out.get_block_ids() == ([9], [10])
    assert mgr.get_block_ids("r") == ([1, 2, 3, 4, 9], [0, 0, 0, 8, 10])
    assert mgr.block_pool.num_cached_blocks == 8


class _Raising(FullAttentionManager):
    """Changes the request's table and hashed count without recording them
    in the step ``mode`` names, then raises."""

    mode = ""

    def _break(self, request_id: str) -> None:
        table = self.req_to_blocks.get(request_id)
        if table:
            table[0] = 7  # in place: the list the request holds
            table.append(8)
        else:
            self.req_to_blocks[request_id] = [7]
        self.num_cached_block[request_id] = 99
        raise RuntimeError("broken mid-step")

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[int]:
        if self.mode == "allocate":
            self._break(request_id)
        return super().allocate_new_blocks(request_id, num_tokens)

    def add_computed_blocks(self, request_id: str, blocks: Sequence[int]) -> None:
        if self.mode == "attach":
            self._break(request_id)
        super().add_computed_blocks(request_id, blocks)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        if self.mode == "cache":
            self._break(request.request_id)
        super().cache_blocks(request, num_tokens)

    def pop_blocks(self, request_id: str) -> list[int] | None:
        if self.mode == "pop":
            self._break(request_id)
        return super().pop_blocks(request_id)


def _raising_manager() -> tuple[KVCacheManager, type[_Raising]]:
    manager = type("_Raising", (_Raising,), {})
    kind = type("RaisingKind", (FullAttention,), {"manager_type": manager})()
    spec = FullAttention().spec_type(
        block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    mgr = KVCacheManager(
        kvcore.KVCacheConfig(
            num_blocks=32,
            kv_cache_tensors=[],
            kv_cache_groups=[kvcore.KVCacheGroupSpec(["l0"], spec)],
        ),
        max_model_len=1024,
        scheduler_block_size=16,
        hash_block_size=16,
        registry=KindRegistry.from_kinds([kind], owner="acme"),
    )
    return mgr, manager


def _everything(mgr: KVCacheManager) -> tuple[Any, ...]:
    group = mgr.coordinator.single_type_managers[0]
    return (
        _state(mgr),
        {rid: list(table) for rid, table in group.req_to_blocks.items()},
        dict(group.num_cached_block),
        mgr.block_pool.num_cached_blocks,
    )


@pytest.mark.parametrize(
    ("mode", "call"),
    [
        ("allocate", "admit"),
        ("allocate", "grow"),
        ("attach", "admit"),
        ("cache", "grow"),
        ("pop", "free"),
        ("pop", "free, forward not run"),
    ],
)
def test_a_kinds_step_that_raises_leaves_the_tables_as_they_were(
    mode: str, call: str
) -> None:
    # A kind's own step may change a table in place, without recording it,
    # before it raises: the core recorded the tables whole before the step,
    # so the rollback puts back every position, the list objects the
    # engine holds included, and the hashed counts.
    mgr, manager = _raising_manager()
    prefix = list(range(32))
    first = Request("first", [*prefix, 50], hash_block_size=16)
    assert mgr.allocate_slots(first, 33) is not None  # blocks 1-3, 1-2 keyed
    first.num_computed_tokens = 33
    first.append_output_token_ids(51)
    group = mgr.coordinator.single_type_managers[0]
    held = group.req_to_blocks["first"]
    before = _everything(mgr)
    req = Request("r", [*prefix, 60, 61], hash_block_size=16)
    blocks, hit = mgr.get_computed_blocks(req)
    assert hit == 32
    step = {
        "admit": lambda: mgr.allocate_slots(req, 2, hit, blocks),
        "grow": lambda: mgr.allocate_slots(first, 16),
        "free": lambda: mgr.free(first),
        "free, forward not run": lambda: mgr.free(first, forward_ran=False),
    }[call]
    manager.mode = mode
    with pytest.raises(kvcore.PluginError, match="broken mid-step"):
        step()
    assert _everything(mgr) == before
    assert group.req_to_blocks["first"] is held  # the same list, put back
    assert held == [1, 2, 3]
    manager.mode = ""
    assert mgr.allocate_slots(first, 16) is not None
    assert mgr.get_block_ids("first") == ([1, 2, 3, 4],)


class _RaisingRelease(SlidingWindowManager):
    """Overwrites a table position in place in its release step, then
    raises."""

    broken = False

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        super().remove_skipped_blocks(request_id, num_computed_tokens)
        if self.broken:
            self.req_to_blocks[request_id][-1] = 5
            raise RuntimeError("broken mid-release")


class _RaisingKept(SlidingWindowManager):
    """Overwrites a table position in place in ``kept_for_later``, which the
    core's release step asks, then raises."""

    broken = False

    def kept_for_later(
        self, request_id: str, positions: Sequence[int], released: Sequence[int]
    ) -> list[int]:
        if self.broken:
            self.req_to_blocks[request_id][-1] = 5
            raise RuntimeError("broken mid-release")
        return super().kept_for_later(request_id, positions, released)


@pytest.mark.parametrize("manager", [_RaisingRelease, _RaisingKept])
def test_a_kinds_release_that_raises_leaves_the_tables_as_they_were(
    manager: type[_RaisingRelease | _RaisingKept],
) -> None:
    kind = type("RaisingWindowKind", (SlidingWindow,), {"manager_type": manager})()
    mgr = setup.beside_full_attention(kind, 32, block_size=4, window=4)
    req = Request("r", list(range(16)), hash_block_size=4)
    assert mgr.allocate_slots(req, 16) is not None
    req.num_computed_tokens = 16
    req.append_output_token_ids(99)
    window = mgr.coordinator.single_type_managers[1]
    held = window.req_to_blocks["r"]
    before = (_state(mgr), mgr.get_block_ids("r"), mgr.block_pool.num_cached_blocks)
    manager.broken = True
    try:
        with pytest.raises(kvcore.PluginError, match="broken mid-release"):
            mgr.allocate_slots(req, 1)
    finally:
        manager.broken = False
    after = (_state(mgr), mgr.get_block_ids("r"), mgr.block_pool.num_cached_blocks)
    assert after == before
    assert window.req_to_blocks["r"] is held
    assert mgr.get_block_ids("r") == ([1, 2, 3, 4], [5, 6, 7, 8])
    out = mgr.allocate_slots(req, 1)
    assert out is not None
    assert mgr.get_block_ids("r") == ([1, 2, 3, 4, 9], [0, 0, 0, 8, 10])


def test_a_kinds_attach_that_raises_in_a_later_twin_leaves_it_as_it_was() -> None:
    # Two groups of one class: the second group's attach changes its table
    # without recording it, then raises.
    manager = type("_Raising", (_Raising,), {})
    kind = type("RaisingKind", (FullAttention,), {"manager_type": manager})()
    spec = FullAttention().spec_type(
        block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    mgr = setup.manager_for(
        [spec, spec],
        32,
        scheduler_block_size=16,
        hash_block_size=16,
        registry=KindRegistry.from_kinds([kind], owner="acme"),
        max_model_len=1024,
    )
    prefix = list(range(32))
    first = Request("first", [*prefix, 50], hash_block_size=16)
    assert mgr.allocate_slots(first, 33) is not None
    first.num_computed_tokens = 33
    before = _state(mgr)
    second = mgr.coordinator.single_type_managers[1]
    second.mode = "attach"  # this group only
    req = Request("r", [*prefix, 60, 61], hash_block_size=16)
    blocks, hit = mgr.get_computed_blocks(req)
    assert hit == 32
    with pytest.raises(kvcore.PluginError, match="broken mid-step"):
        mgr.allocate_slots(req, 2, hit, blocks)
    assert _state(mgr) == before
    assert "r" not in second.req_to_blocks
    assert "r" not in second.num_cached_block
    second.mode = ""
    blocks, hit = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, 2, hit, blocks) is not None
    assert mgr.get_block_ids("r") == ([1, 2, 7], [4, 5, 8])
