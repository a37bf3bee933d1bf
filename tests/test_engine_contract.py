"""The engine contract's newer pieces, engine-neutral (docs/coordinator.md,
"The engine contract"): prefix-hit statistics read per interval, releases on
a processed-tokens basis under asynchronous scheduling, a reserved-blocks
floor, evicting chosen cached blocks and admitting a hit with no new tokens.

Block ids come from the free queue, which starts in id order with block 0
taken out as the null block; within a step groups allocate in group order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import coordinator_setup as setup

from kvcore.coordinator import KVCacheManager, Request


def manager(
    specs: Sequence[object], num_blocks: int, *, max_model_len: int = 64, **kw: Any
) -> KVCacheManager:
    return setup.manager_for(
        specs,
        num_blocks,
        scheduler_block_size=4,
        hash_block_size=4,
        max_model_len=max_model_len,
        **kw,
    )


def req(rid: str, tokens: Sequence[int]) -> Request:
    return Request(rid, list(tokens), hash_block_size=4)


# -- prefix-hit statistics per interval ------------------------------------------


def test_take_prefix_cache_stats_reads_one_interval_and_resets() -> None:
    mgr = manager([setup.fa(4)], 20)
    a = req("A", range(1, 10))
    mgr.get_computed_blocks(a)
    assert mgr.allocate_slots(a, 9) is not None
    # B shares A's two full blocks: 8 of its 9 tokens hit.
    mgr.get_computed_blocks(req("B", range(1, 10)))
    first = mgr.take_prefix_cache_stats()
    assert (first.requests, first.queries, first.hits) == (2, 18, 8)
    assert first.hit_rate == 8 / 18
    # The next interval starts at zero and counts only its own lookups.
    empty = mgr.take_prefix_cache_stats()
    assert (empty.requests, empty.queries, empty.hits) == (0, 0, 0)
    mgr.get_computed_blocks(req("C", range(1, 6)))
    second = mgr.take_prefix_cache_stats()
    assert (second.requests, second.queries, second.hits) == (1, 5, 4)
    assert mgr.prefix_cache_stats.requests == 0
