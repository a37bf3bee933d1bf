"""Hand-worked prefix hits across groups of unequal block sizes.

Block ids come from the free queue, which starts in id order with block 0
taken out as the null block; groups allocate in group order within one step.
"""

from __future__ import annotations

import pytest
from coordinator_setup import fa, manager_for, sw

from kvcore.coordinator import KVCacheManager, Request


def make_manager(
    specs: list[object], *, sched: int, hash_bs: int, use_eagle: bool = False
) -> KVCacheManager:
    return manager_for(
        specs,
        100,
        scheduler_block_size=sched,
        hash_block_size=hash_bs,
        use_eagle=use_eagle,
    )


def chunks(n: int, size: int) -> list[int]:
    """``n`` tokens, one distinct value per ``size``-token chunk."""
    return [i // size for i in range(n)]


class TestEagleUnequalBlocks:
    """FA block 32 + SW block 8 (window 8), hash 8, scheduler 32: hits are
    multiples of 32.  A prompt of ``cached`` tokens is computed and freed;
    the same tokens plus one more are looked up (bound ``cached``)."""

    @pytest.mark.parametrize(
        ("cached", "eagle", "hit", "hit_ids"),
        [
            # 40 cached: FA [1, 2] (block 1 full), SW [3..7] all full.
            # Plain: bound 40 -> 32; FA [1], SW needs only block 3 (tokens
            # 24..31, id 6).
            (40, False, 32, ([1], [0, 0, 0, 6])),
            # EAGLE: FA's hit of 32 drops to 0, SW's hit of 40 drops its
            # block 32..39 to 32: the prefix was computed past 32, and both
            # groups serve 32.  (Dropping a whole 32-token unit gave 0.)
            (40, True, 32, ([1], [0, 0, 0, 6])),
            # 72 cached: FA [1, 2, 3], SW [4..12].  FA's 64 drops to 32, SW's
            # 72 drops to 64 -> 64: FA [1, 2], SW block 56..63 (id 11).
            # (Dropping a whole unit from 64 gave 32.)
            (72, True, 64, ([1, 2], [0, 0, 0, 0, 0, 0, 0, 11])),
            # 64 cached: no group's cache reaches past 64, so EAGLE keeps
            # 56 at most -> 32: FA [1], SW block 24..31 (id 6).
            (64, False, 64, ([1, 2], [0, 0, 0, 0, 0, 0, 0, 10])),
            (64, True, 32, ([1], [0, 0, 0, 6])),
        ],
    )
    def test_eagle_drops_one_block_per_group(
        self,
        cached: int,
        eagle: bool,
        hit: int,
        hit_ids: tuple[list[int], ...],
    ) -> None:
        mgr = make_manager([fa(32), sw(8, 8)], sched=32, hash_bs=8, use_eagle=eagle)
        tokens = chunks(cached, 8)
        a = Request("a", tokens, hash_block_size=8)
        assert mgr.allocate_slots(a, cached) is not None
        mgr.free("a")
        blocks, got = mgr.get_computed_blocks(
            Request("b", [*tokens, 999], hash_block_size=8)
        )
        assert got == hit
        assert blocks.get_block_ids() == hit_ids

    def test_eagle_on_equal_blocks_drops_one_block(self) -> None:
        # FA block 8 + SW block 8 (window 16), hash = scheduler = 8: 24
        # tokens cached, bound 24 -> each group drops one 8-token block -> 16.
        mgr = make_manager([fa(8), sw(8, 16)], sched=8, hash_bs=8, use_eagle=True)
        tokens = chunks(24, 8)
        assert mgr.allocate_slots(Request("a", tokens, hash_block_size=8), 24)
        mgr.free("a")
        blocks, got = mgr.get_computed_blocks(
            Request("b", [*tokens, 999], hash_block_size=8)
        )
        # FA [1, 2, 3], SW [4, 5, 6]: hit 16 -> FA [1, 2]; SW needs the
        # window's 15 tokens, blocks 0..1 -> [4, 5].
        assert got == 16
        assert blocks.get_block_ids() == ([1, 2], [4, 5])
