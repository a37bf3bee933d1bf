"""Kinds whose search, keys, errors or undo calls misbehave: each is refused
or named where it crosses into the core, and nothing it reads is the
core's own to change.  The search of a class is checked when the class
that defines it (or ``block_hash``) is a kind's, whatever flag the kind
declares; what it returns and what it reads are copies."""

from __future__ import annotations

from typing import Any, ClassVar

import coordinator_setup as setup
import pytest
import torch

from kvcore import KindRegistry
from kvcore.coordinator import KVCacheManager, Request
from kvcore.coordinator.manager import HitQuery
from kvcore.coordinator.undo import put_entry
from kvcore.errors import PluginError, PluginResultError
from kvcore_cross_attention import (
    CrossAttention,
    CrossAttentionManager,
    CrossAttentionSpec,
)
from kvcore_full_attention import FullAttention, FullAttentionManager
from kvcore_mamba import Mamba, MambaManager, MambaSpec
from kvcore_sliding_window import SlidingWindow, SlidingWindowManager


def _manager(manager_type: type, num_groups: int = 1, **kw: Any) -> KVCacheManager:
    """A manager over ``num_groups`` groups of a full-attention kind served
    by ``manager_type``, registered by plugin ``acme`` (``kw``: more
    settings)."""
    kind = type("HostileKind", (FullAttention,), {"manager_type": manager_type})()
    spec = FullAttention().spec_type(
        block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    return setup.manager_for(
        [spec] * num_groups,
        32,
        scheduler_block_size=16,
        hash_block_size=16,
        registry=KindRegistry.from_kinds([kind], owner="acme"),
        max_model_len=1024,
        **kw,
    )


def _core_hit(cls: type, query: HitQuery) -> list[list[int]]:
    """The core's prefix search, run for a kind's class that wraps it."""
    found: list[list[int]] = FullAttentionManager.find_longest_cache_hit.__func__(  # type: ignore[attr-defined]
        cls, query
    )
    return found


def _computed(mgr: KVCacheManager, rid: str, tokens: range) -> Request:
    req = Request(rid, list(tokens), hash_block_size=16)
    assert mgr.allocate_slots(req, len(tokens)) is not None
    req.num_computed_tokens = len(tokens)
    return req


class _ShiftedSearch(FullAttentionManager):
    """Serves each position the block keyed one position on, and says its
    hits come from the cache tables (the flag is not the check's to
    switch off)."""

    hits_from_cache_tables = True

    @classmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> list[list[int]]:
        found = _core_hit(cls, query)
        return [blocks[1:] + blocks[:1] for blocks in found]


class _ShiftedKeys(FullAttentionManager):
    """Keys one position off and searches by its own keys: its
    ``block_hash`` agrees with its search, not with the prefix each block
    holds."""

    def block_hash(self, chunk_hashes: Any, index: int) -> Any:
        return chunk_hashes[index + 1] if index + 1 < len(chunk_hashes) else None

    @classmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> list[list[int]]:
        pool = query.block_pool
        out = []
        for i in range(query.max_blocks):
            if i + 1 >= len(query.chunk_hashes):
                break
            block = pool.lookup(query.chunk_hashes[i + 1], query.group_ids[0])
            if block is None:
                break
            out.append(block)
        return [out]


@pytest.mark.parametrize("manager_type", [_ShiftedSearch, _ShiftedKeys])
def test_a_hit_of_blocks_keyed_by_another_prefix_is_refused(
    manager_type: type,
) -> None:
    mgr = _manager(manager_type)
    _computed(mgr, "a", range(64))
    b = Request("b", [*range(48), *range(9000, 9020)], hash_block_size=16)
    with pytest.raises(
        PluginResultError, match="not keyed there by the prefix"
    ) as info:
        mgr.get_computed_blocks(b)
    assert info.value.plugin_name == "acme"


class _ScratchSearch(FullAttentionManager):
    """Answers every search with one list it reuses."""

    scratch: ClassVar[list[int]] = []

    @classmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> list[list[int]]:
        found = _core_hit(cls, query)
        cls.scratch[:] = found[0]
        return [cls.scratch]


def test_a_hit_is_not_the_list_a_kinds_search_reuses() -> None:
    mgr = _manager(_ScratchSearch)
    _computed(mgr, "x", range(1000, 1064))
    _computed(mgr, "y", range(2000, 2064))
    assert mgr.get_block_ids("x") == ([1, 2, 3, 4],)
    b = Request("b", list(range(1000, 1065)), hash_block_size=16)
    hit_b, num_b = mgr.get_computed_blocks(b)
    c = Request("c", list(range(2000, 2065)), hash_block_size=16)
    mgr.get_computed_blocks(c)  # the scratch list now holds y's blocks
    assert hit_b.get_block_ids() == ([1, 2, 3, 4],)
    assert mgr.allocate_slots(b, 65 - num_b, num_b, hit_b) is not None
    assert mgr.get_block_ids("b")[0][:4] == [1, 2, 3, 4]


class _ReversingSearch(FullAttentionManager):
    """Reverses the hashes it is given in place."""

    @classmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> list[list[int]]:
        query.block_hashes.reverse()  # type: ignore[attr-defined]
        return [[]]


def test_a_kinds_search_cannot_change_the_requests_hashes() -> None:
    mgr = _manager(_ReversingSearch)
    b = Request("b", list(range(65)), hash_block_size=16)
    hashes = list(b.block_hashes)
    with pytest.raises(PluginError, match=r"_ReversingSearch.*raised in find_longest"):
        mgr.get_computed_blocks(b)
    assert list(b.block_hashes) == hashes


class _RaisingSearch(FullAttentionManager):
    @classmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> list[list[int]]:
        raise KeyError("missing")


def test_a_search_that_raises_is_reported_as_the_plugins() -> None:
    mgr = _manager(_RaisingSearch)
    b = Request("b", list(range(40)), hash_block_size=16)
    with pytest.raises(
        PluginError, match="raised in find_longest_cache_hit: KeyError"
    ) as info:
        mgr.get_computed_blocks(b)
    assert info.value.plugin_name == "acme"
    assert isinstance(info.value.__cause__, KeyError)


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no message")


class _Misreports(FullAttentionManager):
    """Raises from its allocation step: an exception whose message itself
    raises, or a PluginError naming another plugin."""

    how = ""

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[int]:
        if self.how == "unprintable":
            raise _Unprintable
        raise PluginError("state corrupted", plugin_name="kvcore_mamba")


@pytest.mark.parametrize("how", ["unprintable", "another plugin's name"])
def test_a_raising_step_is_named_by_the_groups_plugin(how: str) -> None:
    manager = type("_Misreports", (_Misreports,), {"how": how})
    mgr = _manager(manager)
    free = mgr.get_num_free_blocks()
    req = Request("r", list(range(32)), hash_block_size=16)
    with pytest.raises(PluginError) as info:
        mgr.allocate_slots(req, 32)
    assert info.value.plugin_name == "acme"
    if how == "unprintable":
        assert "_Unprintable: (its message could not be formatted)" in str(info.value)
    assert mgr.get_num_free_blocks() == free


class _RaisingUndo(FullAttentionManager):
    """Keeps per-request state whose undo raises, and fails its second
    group's allocation: the failed step's rollback meets the raising undo."""

    keeps_request_state = True

    def request_state(self, request_id: str) -> Any:
        return "saved"

    def restore_request_state(self, request_id: str, state: Any) -> None:
        raise RuntimeError("cannot restore")

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[int]:
        new = super().allocate_new_blocks(request_id, num_tokens)
        if self.kv_cache_group_id == 1:
            raise ValueError("step fails")
        return new


def test_an_undo_that_raises_leaves_the_rest_of_the_step_undone() -> None:
    mgr = _manager(_RaisingUndo, num_groups=2)
    pool = mgr.block_pool
    before = (list(pool.ref_cnt), pool.free_queue.get_all_free_blocks())
    req = Request("r", list(range(64)), hash_block_size=16)
    with pytest.raises(PluginError, match="restore_request_state raised RuntimeError"):
        mgr.allocate_slots(req, 64)
    # Every other change was undone: no table, no block out, no open step.
    assert (list(pool.ref_cnt), pool.free_queue.get_all_free_blocks()) == before
    for group in mgr.coordinator.single_type_managers:
        assert "r" not in group.req_to_blocks
    assert pool.journal is None


class _RaisingServes(FullAttentionManager):
    def hit_serves(self, blocks: Any) -> bool:
        raise ValueError("cannot tell")


def test_a_hit_serves_that_raises_is_reported_as_the_plugins() -> None:
    mgr = _manager(_RaisingServes)
    _computed(mgr, "a", range(64))
    b = Request("b", [*range(48), 9999], hash_block_size=16)
    hit, num = mgr.get_computed_blocks(b)
    assert num == 48
    with pytest.raises(PluginError, match="hit_serves raised ValueError") as info:
        mgr.allocate_slots(b, 1, num, hit)
    assert info.value.plugin_name == "acme"
    assert "b" not in mgr.coordinator.single_type_managers[0].req_to_blocks


class _NoTouch(FullAttentionManager):
    """Attaches a hit without taking references on its blocks."""

    def add_computed_blocks(self, request_id: str, blocks: Any) -> None:
        self.record_request_state(request_id)
        self.req_to_blocks[request_id] = list(blocks)
        self.num_cached_block[request_id] = len(blocks)


def test_an_attach_that_takes_no_reference_is_refused() -> None:
    # The hit's blocks would sit in two tables with one reference: freeing
    # the first holder would hand them out under the second.
    mgr = _manager(_NoTouch)
    _computed(mgr, "a", range(1000, 1064))
    before = list(mgr.block_pool.ref_cnt)
    b = Request("b", [*range(1000, 1048), *[7] * 20], hash_block_size=16)
    hit, num = mgr.get_computed_blocks(b)
    with pytest.raises(
        PluginResultError,
        match=r"add_computed_blocks left block 1's reference count 1 below",
    ):
        mgr.allocate_slots(b, 68 - num, num, hit)
    assert list(mgr.block_pool.ref_cnt) == before
    assert "b" not in mgr.coordinator.single_type_managers[0].req_to_blocks


class _CountsNothing(FullAttentionManager):
    """Counts no block for a running request, and promises that a count of
    0 means its step grows nothing."""

    grows_by_count = True

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Any
    ) -> int:
        if request_id in self.req_to_blocks:
            return 0
        return super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks
        )


class _GrowsHalf(FullAttentionManager):
    """Takes half the blocks a step needs."""

    def allocate_twins(self, twins: Any, request_id: str, num_tokens: int) -> Any:
        return super().allocate_twins(twins, request_id, num_tokens // 2)


@pytest.mark.parametrize(
    ("manager_type", "refused"),
    [
        (_CountsNothing, "get_num_blocks_to_allocate counted 0 blocks for request 'r'"),
        (_GrowsHalf, "allocate_twins left cache group 0's table of request 'r'"),
    ],
)
def test_a_step_that_leaves_the_table_short_is_refused(
    manager_type: type, refused: str
) -> None:
    # The engine's slots for the step's tokens index the table: a table
    # short of them would send the step's KV past it.
    mgr = _manager(manager_type)
    r = Request("r", list(range(200)), hash_block_size=16)
    if manager_type is _CountsNothing:
        assert mgr.allocate_slots(r, 32) is not None
        r.num_computed_tokens = 32
    held = mgr.get_block_ids("r") if manager_type is _CountsNothing else None
    free = mgr.get_num_free_blocks()
    with pytest.raises(PluginResultError, match=refused):
        mgr.allocate_slots(r, 64, delay_cache_blocks=True)
    assert mgr.get_num_free_blocks() == free
    if held is not None:
        assert mgr.get_block_ids("r") == held


class _KeepsFreed(SlidingWindowManager):
    """Frees the blocks a request no longer reads but leaves them in its
    table."""

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        self.record_request_state(request_id)
        last = min(num_computed_tokens // self.block_size - 1, len(blocks))
        self.block_pool.free_blocks([b for b in blocks[:last] if b])


def test_a_release_that_leaves_freed_blocks_in_the_table_is_refused() -> None:
    kind = type("KeepsFreedKind", (SlidingWindow,), {"manager_type": _KeepsFreed})()
    mgr = setup.beside_full_attention(kind, 32, block_size=4, window=4)
    req = Request("r", list(range(16)), hash_block_size=4)
    assert mgr.allocate_slots(req, 16) is not None
    req.num_computed_tokens = 16
    req.append_output_token_ids(99)
    before = (list(mgr.block_pool.ref_cnt), mgr.get_block_ids("r"))
    with pytest.raises(
        PluginResultError, match="release_twins left block 5's reference count 1 below"
    ):
        mgr.allocate_slots(req, 1)
    assert (list(mgr.block_pool.ref_cnt), mgr.get_block_ids("r")) == before


class _PinsNegative(SlidingWindowManager):
    """Pins table position -1 (meaning its newest) at admission."""

    def plan_checkpoints(self, request: Request, num_computed_tokens: int) -> None:
        super().plan_checkpoints(request, num_computed_tokens)
        self.pinned[request.request_id] = [-1]


def test_a_negative_pin_never_releases_the_newest_block() -> None:
    # A step that does not fit sheds the pins: the release then restarts
    # at the lowest pin, never below position 0 (from -1 it would free the
    # request's newest block, inside its window).
    kind = type("PinsKind", (SlidingWindow,), {"manager_type": _PinsNegative})()
    spec = SlidingWindow().spec_type(
        block_size=16,
        num_kv_heads=1,
        head_size=8,
        dtype=torch.float16,
        sliding_window=32,
    )
    mgr = setup.manager_for(
        [spec],
        7,
        scheduler_block_size=16,
        hash_block_size=16,
        registry=KindRegistry.from_kinds([kind], owner="acme"),
        max_model_len=1024,
    )
    r = Request("r", list(range(200)), hash_block_size=16)
    assert mgr.allocate_slots(r, 64) is not None
    r.num_computed_tokens = 64
    assert mgr.allocate_slots(r, 16) is not None
    r.num_computed_tokens = 80
    table = mgr.get_block_ids("r")[0]
    free = mgr.get_num_free_blocks()
    other = Request("o", list(range(500, 500 + 16 * free)), hash_block_size=16)
    assert mgr.allocate_slots(other, 16 * free) is not None
    mgr.allocate_slots(r, 32)
    # Positions 3 and 4 (tokens 48-79) are what its window reads.
    assert mgr.get_block_ids("r")[0][3:5] == table[3:5]
    assert all(mgr.block_pool.ref_cnt[b] == 1 for b in table[3:5])


class _TwiceTargeted(MambaManager):
    """Plans its first checkpoint target twice."""

    def plan_checkpoints(self, request: Request, num_computed_tokens: int) -> None:
        super().plan_checkpoints(request, num_computed_tokens)
        targets = self.targets.get(request.request_id)
        if targets:
            self.targets[request.request_id] = sorted([*targets, targets[0]])


def test_checkpoint_targets_a_kind_plans_are_checked() -> None:
    # The core's state step takes a block per target: a target named twice
    # took two blocks for one position, one of them in no table.
    kind = type("TwiceKind", (Mamba,), {"manager_type": _TwiceTargeted})()
    attention = FullAttention().spec_type(
        block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    state = MambaSpec(
        block_size=16,
        shapes=((4, 8),),
        dtypes=(torch.float16,),
        mamba_cache_mode="align",
        checkpoint_policy="turns",
    )
    mgr = setup.manager_for(
        [attention, state],
        64,
        scheduler_block_size=16,
        hash_block_size=16,
        registry=KindRegistry.from_kinds([FullAttention(), kind], owner="acme"),
    )
    free = mgr.get_num_free_blocks()
    req = Request("r", list(range(100)), hash_block_size=16)
    with pytest.raises(PluginResultError, match=r"targets \[96, 96\]") as info:
        mgr.allocate_slots(req, 100)
    assert info.value.plugin_name == "acme"
    assert mgr.get_num_free_blocks() == free
    assert "r" not in mgr.coordinator.single_type_managers[1].targets


class _TakesInCount(FullAttentionManager):
    """Takes a block from the pool while it counts."""

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Any
    ) -> int:
        self.block_pool.get_new_blocks(1)
        return super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks
        )


class _FreesInCount(FullAttentionManager):
    """Calls back into the KVCacheManager while it counts."""

    owner: ClassVar[Any] = None

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Any
    ) -> int:
        if request_id in self.req_to_blocks and self.owner is not None:
            self.owner.free(request_id)
        return super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks
        )


class _TouchesInSearch(FullAttentionManager):
    """Takes references on its hit while it searches."""

    @classmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> list[list[int]]:
        found = _core_hit(cls, query)
        query.block_pool.touch(found[0])
        return [list(found[0])]


@pytest.mark.parametrize(
    ("manager_type", "refused"),
    [
        (_TakesInCount, "get_num_blocks_to_allocate changed the block pool"),
        (_FreesInCount, "get_num_blocks_to_allocate: ReentrantCallError"),
        (_TouchesInSearch, "find_longest_cache_hit changed the block pool"),
    ],
)
def test_a_query_that_changes_the_pool_is_refused_and_undone(
    manager_type: type, refused: str
) -> None:
    # A count or a search runs inside a transaction: what it changed is
    # undone, and a call back into the KVCacheManager is refused before it
    # changes anything.
    manager = type(manager_type.__name__, (manager_type,), {})
    mgr = _manager(manager)
    a = Request("a", list(range(64)), hash_block_size=16)
    if manager_type is not _TakesInCount:
        assert mgr.allocate_slots(a, 64) is not None
        a.num_computed_tokens = 64
        a.append_output_token_ids(1)
    manager.owner = mgr
    b = Request("b", list(range(64)), hash_block_size=16)
    if manager_type is _TouchesInSearch:
        mgr.free(a)
        query: Any = lambda: mgr.get_computed_blocks(b)  # noqa: E731
    else:
        query = lambda: mgr.allocate_slots(a, 16 if a.num_computed_tokens else 64)  # noqa: E731
    pool = mgr.block_pool
    before = (list(pool.ref_cnt), pool.get_num_free_blocks(), pool.num_cached_blocks)
    running = manager_type is _FreesInCount
    held = mgr.get_block_ids("a") if running else None
    with pytest.raises(PluginError) as info:
        query()
    assert refused in str(info.value).replace(f"{manager_type.__name__}.", "")
    assert info.value.plugin_name == "acme"
    after = (list(pool.ref_cnt), pool.get_num_free_blocks(), pool.num_cached_blocks)
    assert after == before
    if held is not None:
        assert mgr.get_block_ids("a") == held


class _NullPadded(FullAttentionManager):
    """Answers its hit with the null block at every position."""

    @classmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> list[list[int]]:
        found = _core_hit(cls, query)
        return [[0] * len(blocks) for blocks in found]


def test_a_hit_its_own_kind_says_does_not_serve_is_refused_at_lookup() -> None:
    # Refused where it enters the core, naming the kind, not later at the
    # engine's allocate_slots as if the engine had cut the hit.
    mgr = _manager(_NullPadded)
    _computed(mgr, "a", range(64))
    b = Request("b", list(range(65)), hash_block_size=16)
    with pytest.raises(PluginResultError, match="hit_serves says lacks") as info:
        mgr.get_computed_blocks(b)
    assert "_NullPadded.find_longest_cache_hit" in str(info.value)
    assert info.value.plugin_name == "acme"


class _LoggingMamba(MambaManager):
    """Overrides the attach step only to observe it."""

    attached: ClassVar[int] = 0

    def add_computed_blocks(self, request_id: str, blocks: Any) -> None:
        type(self).attached += 1
        super().add_computed_blocks(request_id, blocks)


class _LoggingCross(CrossAttentionManager):
    """Overrides the allocation only to observe it."""

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[int]:
        return super().allocate_new_blocks(request_id, num_tokens)


def _turns(kind: Any) -> tuple[int, tuple[list[int], ...]]:
    """Three turns sharing a prefix, then a fourth resuming from the third:
    the hit and the fourth's tables."""
    registry = KindRegistry.from_kinds([FullAttention(), kind], owner="acme")
    mgr = setup.manager_for(
        [setup.fa(16), setup.mamba(16, policy="turns")],
        200,
        scheduler_block_size=16,
        hash_block_size=16,
        registry=registry,
    )

    def turn(rid: str, tokens: list[int], outputs: range) -> list[int]:
        req = Request(rid, tokens, hash_block_size=16)
        blocks, hit = mgr.get_computed_blocks(req)
        assert mgr.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
        req.num_computed_tokens = req.num_tokens
        for token in outputs:
            req.append_output_token_ids(token)
            assert mgr.allocate_slots(req, 1) is not None
            req.num_computed_tokens += 1
        mgr.free(req)
        return list(req.all_token_ids)

    prefix = list(range(160))
    turn("a", [*prefix, *range(1000, 1040)], range(1, 2))
    turn("b", [*prefix, *range(2000, 2040)], range(1, 2))
    third = turn("c", [*prefix, *range(3000, 3040)], range(4000, 4020))
    d = Request("d", [*third, *range(5000, 5030)], hash_block_size=16)
    blocks, hit = mgr.get_computed_blocks(d)
    assert mgr.allocate_slots(d, d.num_tokens - hit, hit, blocks) is not None
    return hit, mgr.get_block_ids("d")


def test_a_kinds_attach_may_place_a_shared_state_in_a_null_slot() -> None:
    # The core's checkpoint attach puts the state shared on the request's
    # path into a null slot and touches it: a kind calling it is not refused,
    # and serves what the built-in kind serves.
    kind = type("LoggingMamba", (Mamba,), {"manager_type": _LoggingMamba})()
    assert _turns(kind) == _turns(Mamba())
    assert _LoggingMamba.attached > 0


def test_a_kinds_allocation_may_leave_a_table_empty() -> None:
    # A cross-attention group of a text-only request holds no block.
    kind = type("LoggingCross", (CrossAttention,), {"manager_type": _LoggingCross})()
    cross = CrossAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    mgr = setup.manager_for(
        [setup.fa(16), cross],
        64,
        scheduler_block_size=16,
        hash_block_size=16,
        registry=KindRegistry.from_kinds([FullAttention(), kind], owner="acme"),
    )
    text = Request("text", list(range(32)), hash_block_size=16)
    out = mgr.allocate_slots(text, 32, num_encoder_tokens=0)
    assert out is not None
    assert out.get_block_ids() == ([1, 2], [])


class _NullPads(FullAttentionManager):
    """Grows the table with null blocks and answers no new block."""

    def allocate_twins(self, twins: Any, request_id: str, num_tokens: int) -> Any:
        table = self.req_to_blocks.setdefault(request_id, [])
        self.record_request_state(request_id)
        table += [0] * (-(-num_tokens // self.block_size) - len(table))
        return None


class _KeepsPopped(FullAttentionManager):
    """Returns the request's tables from its pop but does not forget them."""

    def pop_twins(self, twins: Any, request_id: str) -> Any:
        return [t.req_to_blocks.get(request_id) for t in twins]


@pytest.mark.parametrize(
    ("manager_type", "refused"),
    [
        (_NullPads, "with no block at the position of its last token"),
        (_KeepsPopped, "and forget it"),
    ],
)
def test_a_table_of_null_blocks_or_a_pop_that_keeps_it_is_refused(
    manager_type: type, refused: str
) -> None:
    mgr = _manager(manager_type)
    req = Request("a", list(range(64)), hash_block_size=16)
    if manager_type is _NullPads:
        with pytest.raises(PluginResultError, match=refused):
            mgr.allocate_slots(req, 64)
        return
    assert mgr.allocate_slots(req, 64) is not None
    with pytest.raises(PluginResultError, match=refused):
        mgr.free(req)
    assert mgr.get_block_ids("a") == ([1, 2, 3, 4],)


# -- references a kind's step takes or drops beside the request's tables ----


class _FreesAnother(SlidingWindowManager):
    """Releases what the window lets go and drops one more reference: on
    the first block of the request's table it keeps (a prefix another
    request shares)."""

    def release_twins(self, twins: Any, request_id: str, num_computed: int) -> None:
        super().release_twins(twins, request_id, num_computed)
        table = self.req_to_blocks.get(request_id) or []
        kept = [b for b in table if b]
        if kept:
            self.block_pool.free_blocks(kept[:1])


class _TakesExtra(FullAttentionManager):
    """Allocates the step's blocks and one more it puts in no table."""

    def allocate_twins(self, twins: Any, request_id: str, num_tokens: int) -> Any:
        new = super().allocate_twins(twins, request_id, num_tokens)
        if new and request_id != "a":
            self.block_pool.get_new_blocks(1)
        return new


class _TouchesKeyed(FullAttentionManager):
    """Keys the request's blocks and takes a reference on the first."""

    def cache_twins(self, twins: Any, request: Any, num_tokens: int) -> None:
        super().cache_twins(twins, request, num_tokens)
        table = self.req_to_blocks.get(request.request_id) or []
        if table and request.request_id != "a":
            self.block_pool.touch(table[:1])


class _AttachFreesOther(FullAttentionManager):
    """Attaches the hit as the core does, then drops a reference on
    another request's block."""

    def add_computed_blocks(self, request_id: str, blocks: Any) -> None:
        super().add_computed_blocks(request_id, blocks)
        other = self.req_to_blocks["a"]
        self.block_pool.free_blocks([other[-1]])


def _pool_state(mgr: KVCacheManager) -> tuple[list[int], int, Any]:
    pool = mgr.block_pool
    return (list(pool.ref_cnt), mgr.get_num_free_blocks(), mgr.get_block_ids("a"))


def test_a_release_that_drops_a_shared_blocks_reference_is_refused() -> None:
    # Block 1 sits in both requests' tables with two references; the extra
    # drop would free it under "a", which still reads it.
    kind = type("FreesAnotherKind", (SlidingWindow,), {"manager_type": _FreesAnother})()
    mgr = setup.beside_full_attention(kind, 64, block_size=4, window=4)
    a = Request("a", list(range(32)), hash_block_size=4)
    assert mgr.allocate_slots(a, 32) is not None
    a.num_computed_tokens = 32
    b = Request("b", [*range(16), *range(500, 520)], hash_block_size=4)
    hit, num = mgr.get_computed_blocks(b)
    assert num == 16
    assert mgr.allocate_slots(b, 36 - num, num, hit) is not None
    b.num_computed_tokens = 36
    b.append_output_token_ids(7)
    before = _pool_state(mgr)
    with pytest.raises(
        PluginResultError,
        match=r"release_twins left block \d+'s reference count 1 below",
    ) as info:
        mgr.allocate_slots(b, 1)
    assert info.value.plugin_name == "<manual>"
    assert _pool_state(mgr) == before


@pytest.mark.parametrize(
    ("manager_type", "step"),
    [(_TakesExtra, "allocate_twins"), (_TouchesKeyed, "cache_twins")],
)
def test_a_step_that_keeps_a_reference_no_table_holds_is_refused(
    manager_type: type, step: str
) -> None:
    # A reference no table of the request gives back is never dropped: the
    # block never returns to the free queue.
    mgr = _manager(manager_type)
    _computed(mgr, "a", range(32))
    before = _pool_state(mgr)
    r = Request("r", list(range(100, 164)), hash_block_size=16)
    with pytest.raises(
        PluginResultError, match=rf"{step} left block \d+'s reference count 1 above"
    ) as info:
        mgr.allocate_slots(r, 64)
    assert info.value.plugin_name == "acme"
    assert _pool_state(mgr) == before
    assert "r" not in mgr.coordinator.single_type_managers[0].req_to_blocks


def test_an_attach_that_drops_another_requests_reference_is_refused() -> None:
    mgr = _manager(_AttachFreesOther)
    _computed(mgr, "a", range(1000, 1064))
    before = _pool_state(mgr)
    b = Request("b", [*range(1000, 1048), *[7] * 20], hash_block_size=16)
    hit, num = mgr.get_computed_blocks(b)
    with pytest.raises(
        PluginResultError,
        match=r"add_computed_blocks left block 4's reference count 1 below",
    ):
        mgr.allocate_slots(b, 68 - num, num, hit)
    assert _pool_state(mgr) == before


@pytest.mark.parametrize("ask", ["can_fit_full_sequence", "full_sequence_must_fit"])
def test_a_count_asked_for_the_whole_sequence_is_watched(ask: str) -> None:
    # The whole-sequence check asks each group's count too: a count that
    # takes a block there is refused and undone like a step's count.
    mgr = _manager(_TakesInCount)
    r = Request("r", list(range(64)), hash_block_size=16)
    pool = mgr.block_pool
    before = (list(pool.ref_cnt), pool.get_num_free_blocks())
    call: Any = (
        (lambda: mgr.can_fit_full_sequence(r))
        if ask == "can_fit_full_sequence"
        else (lambda: mgr.allocate_slots(r, 64, full_sequence_must_fit=True))
    )
    with pytest.raises(PluginResultError, match="changed the block pool") as info:
        call()
    assert info.value.plugin_name == "acme"
    assert (list(pool.ref_cnt), pool.get_num_free_blocks()) == before


# -- table positions a kind's step may change ---------------------------------


class _SwapsInAnother(FullAttentionManager):
    """Keys its blocks, then puts request "a"'s newest block in place of
    the request's own newest one, touching it and freeing its own: the
    references balance."""

    def cache_twins(self, twins: Any, request: Any, num_tokens: int) -> None:
        super().cache_twins(twins, request, num_tokens)
        mine = self.req_to_blocks.get(request.request_id)
        if request.request_id == "b" and mine:
            theirs = self.req_to_blocks["a"][-1]
            self.block_pool.touch([theirs])
            old, mine[-1] = mine[-1], theirs
            self.block_pool.free_blocks([old])


class _SwapsTwins(FullAttentionManager):
    """Grows the tables, then swaps their first blocks between two twins:
    each layer would read the other's KV."""

    def allocate_twins(self, twins: Any, request_id: str, num_tokens: int) -> Any:
        running = request_id in self.req_to_blocks
        new = super().allocate_twins(twins, request_id, num_tokens)
        if running and len(twins) == 2:
            first, second = (t.req_to_blocks[request_id] for t in twins)
            first[0], second[0] = second[0], first[0]
        return new


class _LyingTable(list):  # type: ignore[type-arg]
    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = None  # type: ignore[assignment]


class _KeepsAListThatLies(FullAttentionManager):
    """Replaces the request's table by a list subclass that says it is
    equal to anything, holding request "a"'s block."""

    def cache_twins(self, twins: Any, request: Any, num_tokens: int) -> None:
        super().cache_twins(twins, request, num_tokens)
        rid = request.request_id
        if rid == "b":
            table = _LyingTable(self.req_to_blocks[rid])
            table[-1] = self.req_to_blocks["a"][-1]
            self.req_to_blocks[rid] = table


@pytest.mark.parametrize(
    ("manager_type", "groups", "refused"),
    [
        (_SwapsInAnother, 1, r"cache_twins put block \d+ at position 2 in place"),
        (_SwapsTwins, 2, r"allocate_twins put block \d+ at position 0 in place"),
        (_KeepsAListThatLies, 1, "cache_twins replaced it by a non-list"),
    ],
)
def test_a_step_that_puts_one_block_in_place_of_another_is_refused(
    manager_type: type, groups: int, refused: str
) -> None:
    # Balanced references are not enough: a block in place of another is
    # written by two requests (or two layers), and the one it replaced is
    # lost to the engine, which was told the table holds it.
    mgr = _manager(manager_type, num_groups=groups)
    a = _computed(mgr, "a", range(40))
    del a
    b = Request("b", list(range(1000, 1040)), hash_block_size=16)
    if manager_type is _SwapsTwins:
        assert mgr.allocate_slots(b, 40) is not None
        b.num_computed_tokens = 40
        b.append_output_token_ids(1)
    before = _pool_state(mgr)
    tables = mgr.get_block_ids("b") if manager_type is _SwapsTwins else None
    with pytest.raises(PluginResultError, match=refused) as info:
        mgr.allocate_slots(b, 9 if manager_type is _SwapsTwins else 40)
    assert info.value.plugin_name == "acme"
    assert _pool_state(mgr) == before
    if tables is not None:
        assert mgr.get_block_ids("b") == tables


# -- what a kind's free hooks may do ------------------------------------------


class _PopsRewritten(FullAttentionManager):
    """Rewrites the popped table in place (same list, same length) to name
    request "a"'s newest block before handing it back."""

    def pop_twins(self, twins: Any, request_id: str) -> Any:
        if request_id == "b":
            self.req_to_blocks["b"][-1] = self.req_to_blocks["a"][-1]
        return super().pop_twins(twins, request_id)


class _PopFreesAnother(SlidingWindowManager):
    """Drops a reference on request "a"'s newest block while it pops, or
    while it answers which blocks it held back (``hook``)."""

    hook = "pop_twins"

    def pop_twins(self, twins: Any, request_id: str) -> Any:
        if self.hook == "pop_twins" and request_id == "b":
            self.block_pool.free_blocks([self.req_to_blocks["a"][-1]])
        return super().pop_twins(twins, request_id)

    def take_held_back(self, request_id: str) -> Any:
        if self.hook == "take_held_back" and request_id == "b":
            self.block_pool.free_blocks([self.req_to_blocks["a"][-1]])
        return super().take_held_back(request_id)


def test_a_pop_that_rewrites_its_table_in_place_is_refused() -> None:
    # Compared with the very lists it rewrote, the pop would pass: the free
    # would drop "a"'s block and leak the request's own.
    mgr = _manager(_PopsRewritten)
    _computed(mgr, "a", range(40))
    b = _computed(mgr, "b", range(1000, 1040))
    before = _pool_state(mgr), mgr.get_block_ids("b")
    with pytest.raises(
        PluginResultError, match=r"pop_twins returned \[\[\d+, \d+, 3\]\]"
    ):
        mgr.free(b)
    assert (_pool_state(mgr), mgr.get_block_ids("b")) == before


@pytest.mark.parametrize("hook", ["pop_twins", "take_held_back"])
def test_a_free_hook_that_changes_the_pool_is_refused(hook: str) -> None:
    manager = type("_PopFreesAnother", (_PopFreesAnother,), {"hook": hook})
    kind = type("FreesKind", (SlidingWindow,), {"manager_type": manager})()
    mgr = setup.beside_full_attention(kind, 32, block_size=4, window=8)
    a = Request("a", list(range(10)), hash_block_size=4)
    assert mgr.allocate_slots(a, 10) is not None
    b = Request("b", list(range(100, 110)), hash_block_size=4)
    assert mgr.allocate_slots(b, 10) is not None
    before = _pool_state(mgr), mgr.get_block_ids("b")
    refused = "changed the block pool" if hook == "take_held_back" else "pop_twins"
    with pytest.raises(PluginResultError, match=refused) as info:
        mgr.free(b)
    assert info.value.plugin_name == "<manual>"
    assert (_pool_state(mgr), mgr.get_block_ids("b")) == before


class _PopsTheQueueInCount(FullAttentionManager):
    """Takes a block straight off the pool's free queue while it counts:
    no journal record shows it."""

    def get_num_blocks_to_allocate(self, *args: Any) -> int:
        self.block_pool.free_queue.popleft()
        return super().get_num_blocks_to_allocate(*args)


def test_a_count_that_takes_from_the_free_queue_directly_is_refused() -> None:
    # The free count tells it (what the pool's own calls did not record
    # cannot be undone; the kind is named).
    mgr = _manager(_PopsTheQueueInCount)
    r = Request("r", list(range(64)), hash_block_size=16)
    with pytest.raises(PluginResultError, match="changed the block pool") as info:
        mgr.allocate_slots(r, 64)
    assert info.value.plugin_name == "acme"


class _StepOnTheInstance(FullAttentionManager):
    """Sets its keying step on itself when built: a step that takes a
    reference no table holds, and counts its runs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        core = self.cache_twins
        self.instance_runs = 0

        def cache_twins(twins: Any, request: Any, num_tokens: int) -> None:
            self.instance_runs += 1
            core(twins, request, num_tokens)
            table = self.req_to_blocks.get(request.request_id)
            if table:
                self.block_pool.touch(table[:1])

        self.cache_twins = cache_twins  # type: ignore[method-assign]


def _keyed_step_state(mgr: KVCacheManager) -> tuple[Any, ...]:
    """A 64-token admission's pool, tables and keys after its step."""
    r = Request("r", list(range(64)), hash_block_size=16)
    assert mgr.allocate_slots(r, 64) is not None
    pool = mgr.block_pool
    return (
        list(pool.ref_cnt),
        pool.get_num_free_blocks(),
        mgr.get_block_ids("r"),
        pool.num_cached_blocks,
    )


def test_a_step_a_manager_sets_on_itself_is_never_run() -> None:
    # The core calls a step through the manager's class: the attribute is
    # not run, the class's keying is, and no stray reference is taken.
    mgr = _manager(_StepOnTheInstance)
    state = _keyed_step_state(mgr)
    assert state == _keyed_step_state(_manager(FullAttentionManager))
    assert state[2] == ([1, 2, 3, 4],)
    assert state[3] == 4
    (manager,) = mgr.coordinator.single_type_managers
    assert manager.instance_runs == 0


class _ActsWhileAsked(SlidingWindowManager):
    """Frees request "a"'s newest block (or takes a block) from a hook
    the core asks outside a step or to weigh one: ``hook`` names it."""

    hook = ""

    def _strike(self, name: str) -> None:
        if self.hook == name and "a" in self.req_to_blocks:
            self.hook = ""  # once
            self.block_pool.free_blocks([self.req_to_blocks["a"][-1]])

    def admission_blocks(self, hit: Any, num_computed_tokens: int) -> Any:
        self._strike("admission_blocks")
        return super().admission_blocks(hit, num_computed_tokens)

    def releases_nothing(self, request_id: str, num_computed_tokens: int) -> bool:
        if self.hook == "releases_nothing":
            self.block_pool.get_new_blocks(1)
        return super().releases_nothing(request_id, num_computed_tokens)

    def plan_checkpoints(self, request: Any, num_computed_tokens: int) -> None:
        self._strike("plan_checkpoints")
        super().plan_checkpoints(request, num_computed_tokens)

    def shed_checkpoints(self, request_id: str) -> Any:
        self._strike("shed_checkpoints")
        return super().shed_checkpoints(request_id)


@pytest.mark.parametrize(
    "hook",
    ["admission_blocks", "releases_nothing", "plan_checkpoints", "shed_checkpoints"],
)
def test_a_hook_that_only_answers_may_not_change_the_pool(hook: str) -> None:
    # Asked outside any step (or in one of its own, to weigh a step), what
    # such a hook changed would stay: it is undone, and the kind named.
    manager = type("_ActsWhileAsked", (_ActsWhileAsked,), {"hook": hook})
    kind = type("ActsKind", (SlidingWindow,), {"manager_type": manager})()
    num_blocks = 14 if hook == "shed_checkpoints" else 40
    mgr = setup.beside_full_attention(kind, num_blocks, block_size=4, window=8)
    a = Request("a", list(range(10)), hash_block_size=4)
    assert mgr.allocate_slots(a, 10) is not None
    a.num_computed_tokens = 10
    before = _pool_state(mgr)
    if hook == "releases_nothing":
        a.append_output_token_ids(5)
        step: Any = lambda: mgr.allocate_slots(a, 1)  # noqa: E731
    else:
        b = Request("b", list(range(100, 148)), hash_block_size=4)
        step = lambda: mgr.allocate_slots(b, 48)  # noqa: E731
    with pytest.raises(PluginResultError, match=f"{hook} changed the block pool"):
        step()
    assert _pool_state(mgr) == before


class _Rehashes(FullAttentionManager):
    """Rewrites the request's block hashes to another prompt's before it
    keys its blocks (so its keys agree with the hashes it left)."""

    def cache_twins(self, twins: Any, request: Any, num_tokens: int) -> None:
        if request.request_id == "b":
            other = Request("x", list(range(7000, 7064)), hash_block_size=16)
            request.block_hashes[:] = other.block_hashes[: len(request.block_hashes)]
        super().cache_twins(twins, request, num_tokens)


def test_a_step_that_changes_the_requests_hashes_is_refused() -> None:
    # Keyed under another prompt's hashes, the request's blocks would be
    # served as that prompt's prefix; the engine's hashes are put back.
    mgr = _manager(_Rehashes)
    b = Request("b", list(range(1000, 1064)), hash_block_size=16)
    hashes = list(b.block_hashes)
    pool = mgr.block_pool
    before = (list(pool.ref_cnt), pool.get_num_free_blocks(), pool.num_cached_blocks)
    with pytest.raises(PluginResultError, match="changed the block hashes of request"):
        mgr.allocate_slots(b, 64)
    assert b.block_hashes == hashes
    after = (list(pool.ref_cnt), pool.get_num_free_blocks(), pool.num_cached_blocks)
    assert after == before


class _StateThatFrees(FullAttentionManager):
    """Keeps a request state whose snapshot frees request "a"'s newest
    block: asked by the core's own steps before they change the request."""

    keeps_request_state = True

    def request_state(self, request_id: str) -> Any:
        if request_id == "b":
            self.block_pool.free_blocks([self.req_to_blocks["a"][-1]])
        return None


def test_a_request_state_snapshot_that_changes_the_pool_is_refused() -> None:
    mgr = _manager(_StateThatFrees)
    _computed(mgr, "a", range(40))
    before = _pool_state(mgr)
    b = Request("b", list(range(1000, 1040)), hash_block_size=16)
    with pytest.raises(PluginResultError, match="request_state changed the block pool"):
        mgr.allocate_slots(b, 40)
    assert _pool_state(mgr) == before


class _FillsANullSlot(FullAttentionManager):
    """Admits its hit with the null block at the last position, then puts
    request "a"'s newest block there (touched: the references balance)."""

    def admission_blocks(self, hit: Any, num_computed_tokens: int) -> Any:
        out = list(super().admission_blocks(hit, num_computed_tokens))
        if out and "a" in self.req_to_blocks:
            out[-1] = 0
        return out

    def add_computed_blocks(self, request_id: str, blocks: Any) -> None:
        blocks = list(blocks)
        if blocks and not blocks[-1] and "a" in self.req_to_blocks:
            blocks[-1] = self.req_to_blocks["a"][-1]
        super().add_computed_blocks(request_id, blocks)


def test_a_block_of_another_prefix_in_a_null_admission_slot_is_refused() -> None:
    # Only a state keyed by the request's own prefix there may fill it.
    mgr = _manager(_FillsANullSlot)
    c = _computed(mgr, "c", range(100, 140))
    mgr.free(c)
    _computed(mgr, "a", range(40))
    b = Request("b", [*range(100, 140), 9], hash_block_size=16)
    hit, num = mgr.get_computed_blocks(b)
    assert num == 32
    before = _pool_state(mgr)
    with pytest.raises(PluginResultError, match="add_computed_blocks attached"):
        mgr.allocate_slots(b, 41 - num, num, hit)
    assert _pool_state(mgr) == before


# -- undo calls that act while a failed step is undone ------------------------


class _UndoActs(FullAttentionManager):
    """Keeps per-request state whose undo changes the pool (drops a
    reference on request "a"'s last block, or begins a step of its own),
    and fails the allocation of request "b"."""

    keeps_request_state = True
    how = ""

    def request_state(self, request_id: str) -> Any:
        return None

    def restore_request_state(self, request_id: str, state: Any) -> None:
        pool = self.block_pool
        if self.how == "frees":
            pool.free_blocks([self.req_to_blocks["a"][-1]])
        else:
            pool.begin()
            pool.get_new_blocks(1)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[int]:
        new = super().allocate_new_blocks(request_id, num_tokens)
        if request_id == "b":
            raise ValueError("step fails")
        return new


@pytest.mark.parametrize(
    ("how", "refused"),
    [
        ("frees", "restore_request_state changed the block pool"),
        ("begins", "restore_request_state raised ReentrantCallError"),
    ],
)
def test_an_undo_that_changes_the_pool_is_undone_and_refused(
    how: str, refused: str
) -> None:
    # The undo calls run inside the rollback: a change one makes to the
    # pool would outlive a step reported undone (a's block freed under it).
    mgr = _manager(type("_UndoActs", (_UndoActs,), {"how": how}))
    _computed(mgr, "a", range(40))
    before = _pool_state(mgr)
    b = Request("b", list(range(1000, 1040)), hash_block_size=16)
    with pytest.raises(PluginError, match=refused) as info:
        mgr.allocate_slots(b, 40)
    assert info.value.plugin_name == "acme"
    assert _pool_state(mgr) == before
    assert mgr.block_pool.journal is None


class _TakesEvents(FullAttentionManager):
    """Takes the pool's events while it counts a step of request "b"."""

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Any
    ) -> int:
        if request_id == "b":
            self.block_pool.take_events()
        return super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks
        )


def test_a_kind_that_takes_the_pools_events_is_refused() -> None:
    # The events are the engine's: taken inside a step, they would never
    # reach it (and a rollback could not put them back).
    mgr = _manager(_TakesEvents, enable_kv_cache_events=True)
    _computed(mgr, "a", range(64))
    before = _pool_state(mgr)
    b = Request("b", list(range(500, 532)), hash_block_size=16)
    with pytest.raises(
        PluginError, match="managers must not take the block pool's events"
    ) as info:
        mgr.allocate_slots(b, 32)
    assert info.value.plugin_name == "acme"
    assert _pool_state(mgr) == before
    assert [type(e).__name__ for e in mgr.take_events()] == ["BlockStored"]


class _ShiftedStateKeys(MambaManager):
    """A state kind of blocks finer than the hash block whose own
    ``block_hash`` keys each position by the chunk one further on, and
    searches by those keys: its hit is served by the state after 16
    tokens more than it covers."""

    def block_hash(self, chunk_hashes: Any, index: int) -> Any:
        end = (index + 1) * self.block_size
        if end % self.hash_block_size:
            return None
        chunk = end // self.hash_block_size
        return chunk_hashes[chunk] if chunk < len(chunk_hashes) else None

    @classmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> list[list[int]]:
        pool, gid = query.block_pool, query.group_ids[0]
        found: list[int] = []
        for i in range(query.max_length // query.block_size):
            end = (i + 1) * query.block_size
            chunk = end // query.hash_block_size
            if end % query.hash_block_size or chunk >= len(query.chunk_hashes):
                continue
            block = pool.lookup(query.chunk_hashes[chunk], gid)
            if block is not None:
                found = [0] * i + [block]
        return [found]


def test_a_finer_state_hit_is_checked_by_the_prefix_key_not_the_kinds() -> None:
    # 8-token states under 16-token hash chunks: the kind's own block_hash
    # agrees with its search, not with the prefix each state ends.
    kind = type("ShiftedKind", (Mamba,), {"manager_type": _ShiftedStateKeys})()
    mgr = setup.manager_for(
        [setup.mamba(8, policy="turns")],
        64,
        scheduler_block_size=16,
        hash_block_size=16,
        registry=KindRegistry.from_kinds([kind], owner="acme"),
        max_model_len=1024,
    )
    a = Request("a", list(range(64)), hash_block_size=16)
    assert mgr.allocate_slots(a, 64) is not None
    a.num_computed_tokens = 64
    mgr.free(a)
    pool = mgr.block_pool
    before = (list(pool.ref_cnt), pool.eviction_order())
    b = Request("b", [*range(64), 5], hash_block_size=16)
    with pytest.raises(
        PluginResultError, match="not keyed there by the prefix"
    ) as info:
        mgr.get_computed_blocks(b)
    assert info.value.plugin_name == "acme"
    assert (list(pool.ref_cnt), pool.eviction_order()) == before


# -- errors named by the plugin that registered the kind ----------------------


class _HeldElsewhere(SlidingWindowManager):
    """Answers ``take_held_back`` with a position the request never
    released and a block in use."""

    def take_held_back(self, request_id: str) -> list[tuple[int, int]]:
        super().take_held_back(request_id)
        return [(0, 1)]


def test_a_bad_held_back_answer_is_named_by_the_groups_plugin() -> None:
    kind = type("HeldKind", (SlidingWindow,), {"manager_type": _HeldElsewhere})()
    mgr = setup.beside_full_attention(kind, 32, block_size=4, window=8, owner="acme")
    a = Request("a", list(range(30)), hash_block_size=4)
    assert mgr.allocate_slots(a, 30) is not None
    a.num_computed_tokens = 30
    a.append_output_token_ids(1)
    assert mgr.allocate_slots(a, 1) is not None
    before = _pool_state(mgr)
    with pytest.raises(
        PluginResultError, match=r"take_held_back returned \(0, 1\)"
    ) as info:
        mgr.free(a)
    assert info.value.plugin_name == "acme"
    assert _pool_state(mgr) == before


class _RaisingUndoAtFree(_RaisingUndo):
    """Records its state when the request is freed, then fails the free."""

    def pop_blocks(self, request_id: str) -> list[int] | None:
        self.record_request_state(request_id)
        super().pop_blocks(request_id)
        raise ValueError("free fails")


@pytest.mark.parametrize("step", ["allocate_slots", "free"])
def test_an_undo_that_raises_is_named_by_the_groups_plugin(step: str) -> None:
    # The rollback names the undo call's owner: a group's manager is named
    # by the plugin that registered its kind, whoever rolls the step back.
    if step == "allocate_slots":
        mgr = _manager(_RaisingUndo, num_groups=2)  # its second group fails
    else:
        mgr = _manager(_RaisingUndoAtFree)
    r = Request("r", list(range(64)), hash_block_size=16)
    if step == "free":
        assert mgr.allocate_slots(r, 64) is not None
        r.num_computed_tokens = 64
    pool = mgr.block_pool
    before = (list(pool.ref_cnt), pool.free_queue.get_all_free_blocks())
    held = [m.req_to_blocks.get("r") for m in mgr.coordinator.single_type_managers]
    with pytest.raises(
        PluginError, match="restore_request_state raised RuntimeError"
    ) as info:
        mgr.allocate_slots(r, 64) if step == "allocate_slots" else mgr.free(r)
    assert info.value.plugin_name == "acme"
    assert "(plugin 'acme')" in str(info.value)
    assert (list(pool.ref_cnt), pool.free_queue.get_all_free_blocks()) == before
    assert [
        m.req_to_blocks.get("r") for m in mgr.coordinator.single_type_managers
    ] == held


class _RewritesItsQuery(FullAttentionManager):
    """Answers a hit of another prompt's keyed blocks and points its query
    at that prompt's hashes, so the hit would check out against them."""

    @classmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> list[list[int]]:
        other = Request("x", list(range(64)), hash_block_size=16)
        query.chunk_hashes = tuple(other.block_hashes)
        query.block_hashes = tuple(other.block_hashes)
        return _core_hit(cls, query)


def test_a_search_that_rewrites_its_query_is_refused() -> None:
    mgr = _manager(_RewritesItsQuery)
    _computed(mgr, "a", range(64))
    b = Request("b", list(range(500, 564)), hash_block_size=16)
    with pytest.raises(PluginResultError, match="changed the query it was given"):
        mgr.get_computed_blocks(b)


class _JournalsItsState(FullAttentionManager):
    """A correct kind whose per-request counter has one setter, which
    records the old value for a rollback (as a step's change must be),
    used by its undo too; its second group fails request "bad"."""

    keeps_request_state = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps: dict[str, Any] = {}

    def _set(self, rid: str, value: Any) -> None:
        self.block_pool.record(put_entry, self.steps, rid, self.steps.get(rid))
        put_entry(self.steps, rid, value)

    def request_state(self, request_id: str) -> Any:
        return self.steps.get(request_id)

    def restore_request_state(self, request_id: str, state: Any) -> None:
        self._set(request_id, state)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[int]:
        self.record_request_state(request_id)
        self._set(request_id, (self.steps.get(request_id) or 0) + 1)
        new = super().allocate_new_blocks(request_id, num_tokens)
        if self.kv_cache_group_id == 1 and request_id == "bad":
            raise ValueError("group 1 cannot serve this request")
        return new


def test_an_undo_that_records_its_own_state_is_not_a_pool_change() -> None:
    # The rollback reports the step's own failure, and the counter is
    # back where it was (the undo's own journal entry is not run again).
    mgr = _manager(_JournalsItsState, num_groups=2)
    with pytest.raises(PluginError, match="group 1 cannot serve") as info:
        mgr.allocate_slots(Request("bad", list(range(32)), hash_block_size=16), 32)
    assert "changed the block pool" not in str(info.value)
    assert [m.steps for m in mgr.coordinator.single_type_managers] == [{}, {}]


class _RewritesTheHitInPlace(FullAttentionManager):
    """Rewrites the admission list it is given, in place, to end on
    request "a"'s newest block (``hook``: where)."""

    hook = "add_computed_blocks"

    def _rewrite(self, blocks: Any, name: str) -> None:
        if self.hook == name and blocks and "a" in self.req_to_blocks:
            blocks[-1] = self.req_to_blocks["a"][-1]

    def admission_blocks(self, hit: Any, num_computed_tokens: int) -> Any:
        self._rewrite(hit, "admission_blocks")
        return hit if self.hook == "admission_blocks" else list(hit)

    def add_computed_blocks(self, request_id: str, blocks: Any) -> None:
        self._rewrite(blocks, "add_computed_blocks")
        super().add_computed_blocks(request_id, blocks)

    def get_num_blocks_to_allocate(self, *args: Any) -> int:
        self._rewrite(args[2], "get_num_blocks_to_allocate")
        return super().get_num_blocks_to_allocate(*args)


@pytest.mark.parametrize(
    "hook", ["add_computed_blocks", "admission_blocks", "get_num_blocks_to_allocate"]
)
def test_a_hook_that_rewrites_the_hit_it_is_given_changes_nothing(hook: str) -> None:
    # A kind's hook is given a copy of the admission blocks: rewritten in
    # place, it is compared with the core's own list (or changes nothing).
    manager = type("_RewritesTheHitInPlace", (_RewritesTheHitInPlace,), {"hook": hook})
    mgr = _manager(manager)
    mgr.free(_computed(mgr, "c", range(100, 140)))
    _computed(mgr, "a", range(40))
    b = Request("b", [*range(100, 140), 9], hash_block_size=16)
    hit, num = mgr.get_computed_blocks(b)
    if hook == "get_num_blocks_to_allocate":
        assert mgr.allocate_slots(b, 41 - num, num, hit) is not None
        assert mgr.get_block_ids("b")[0][:2] == hit.get_block_ids()[0]
        return
    before = _pool_state(mgr)
    with pytest.raises(PluginResultError, match=f"{hook} "):
        mgr.allocate_slots(b, 41 - num, num, hit)
    assert _pool_state(mgr) == before


class _BorrowsAStep(FullAttentionManager):
    """Sets as its keying step a bound method of another object, which runs
    the core's keying and then takes a reference no table holds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cache_twins = _TouchingKeys(self).cache_twins  # type: ignore[method-assign]


class _TouchingKeys:
    def __init__(self, manager: FullAttentionManager) -> None:
        self.manager = manager

    def cache_twins(self, twins: Any, request: Any, num_tokens: int) -> None:
        manager = self.manager
        FullAttentionManager.cache_twins(manager, twins, request, num_tokens)
        table = manager.req_to_blocks.get(request.request_id)
        if table:
            manager.block_pool.touch(table[:1])


def test_a_step_borrowed_from_another_object_is_never_run() -> None:
    mgr = _manager(_BorrowsAStep)
    assert _keyed_step_state(mgr) == _keyed_step_state(_manager(FullAttentionManager))


class _TouchesInRequestState(MambaManager):
    """Its ``request_state`` (a hook that only answers) takes a reference
    on the request's first state once armed."""

    armed: ClassVar[bool] = False

    def request_state(self, request_id: str) -> Any:
        table = self.req_to_blocks.get(request_id)
        if type(self).armed and table and any(table):
            self.block_pool.touch([b for b in table if b][:1])
        return super().request_state(request_id)


def test_request_state_asked_by_a_state_groups_pop_is_checked() -> None:
    # The core's pop of a state group records the kind's request_state:
    # a reference taken there would never be dropped; the free is refused
    # and undone, the request still live with its blocks.
    kind = type("Grabby", (Mamba,), {"manager_type": _TouchesInRequestState})()
    mgr = setup.manager_for(
        [setup.fa(16), setup.mamba(16)],
        64,
        scheduler_block_size=16,
        hash_block_size=16,
        registry=KindRegistry.from_kinds([FullAttention(), kind], owner="acme"),
    )
    r = Request("r", list(range(64)), hash_block_size=16)
    assert mgr.allocate_slots(r, 64) is not None
    r.num_computed_tokens = 64
    pool = mgr.block_pool
    before = (list(pool.ref_cnt), pool.get_num_free_blocks(), mgr.get_block_ids("r"))
    _TouchesInRequestState.armed = True
    try:
        with pytest.raises(PluginResultError, match="request_state") as info:
            mgr.free(r)
    finally:
        _TouchesInRequestState.armed = False
    assert info.value.plugin_name == "acme"
    assert (
        list(pool.ref_cnt),
        pool.get_num_free_blocks(),
        mgr.get_block_ids("r"),
    ) == before
    mgr.free(r)
    assert pool.get_num_free_blocks() == pool.num_blocks - 1


class _RejoinFails(SlidingWindowManager):
    """Its ``take_held_back`` (asked after every group's pop) raises once
    armed."""

    armed: ClassVar[bool] = False

    def take_held_back(self, request_id: str) -> Any:
        if type(self).armed:
            msg = "rejoin failed"
            raise RuntimeError(msg)
        return super().take_held_back(request_id)


def _turns_then_free(fail: bool, state_first: bool) -> tuple[Any, ...]:
    """A state group's request decoded past several states (with ``fail``,
    a free that failed after every pop, undone, between them), then freed:
    the pool's order, keys and what a hit then serves."""
    window = type("Failing", (SlidingWindow,), {"manager_type": _RejoinFails})()
    specs = [setup.mamba(16), setup.fa(16), setup.sw(16, 32)]
    mgr = setup.manager_for(
        specs if state_first else specs[::-1],
        96,
        scheduler_block_size=16,
        hash_block_size=16,
        registry=KindRegistry.from_kinds(
            [FullAttention(), window, Mamba()], owner="acme"
        ),
    )
    r = Request("r", list(range(100)), hash_block_size=16)
    assert mgr.allocate_slots(r, 100) is not None
    r.num_computed_tokens = 100
    for token in range(40):
        r.append_output_token_ids(token)
        assert mgr.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
    if fail:
        _RejoinFails.armed = True
        try:
            with pytest.raises(PluginError, match="rejoin failed"):
                mgr.free(r)
        finally:
            _RejoinFails.armed = False
    for token in range(40, 80):  # the request runs on as if never freed
        r.append_output_token_ids(token)
        assert mgr.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
    mgr.free(r)
    pool = mgr.block_pool
    again = Request("again", [*range(100), *range(80), 7], hash_block_size=16)
    blocks, hit = mgr.get_computed_blocks(again)
    return (
        pool.free_queue.get_all_free_blocks(),
        [pool.block(b).block_hash for b in range(pool.num_blocks)],
        hit,
        blocks.get_block_ids(),
    )


@pytest.mark.parametrize("state_first", [True, False])
def test_a_free_undone_in_another_group_keeps_the_state_groups_records(
    state_first: bool,
) -> None:
    # The state group's pop (its kept and step-end states, its targets) is
    # undone with the rest: the free that follows queues and keys the pool
    # as a free that never failed, and a later request gets the same hit.
    freed = _turns_then_free(fail=False, state_first=state_first)
    assert freed[2] > 0
    assert _turns_then_free(fail=True, state_first=state_first) == freed
