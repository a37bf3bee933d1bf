"""The example third-party kind (``examples/third_party_plugin``, attention
sinks with a sliding window) in a real KVCacheManager: it releases the
blocks between the sinks and the window, and a prefix hit needs exactly the
sink blocks and the window's blocks.  Loaded through its entry point, as an
installed distribution is.

Every layer below: 4-token blocks, 4 sink tokens (block 0) and an 8-token
window, so the token at position ``p`` reads block 0 and the blocks from
``(p - 7) // 4`` on.
"""

from __future__ import annotations

from typing import Any

import torch
from example_plugin import example_registry

from kvcore import KVCacheConfig, KVCacheGroupSpec
from kvcore.coordinator import KVCacheManager, Request

REGISTRY = example_registry()
SINKS = REGISTRY["attention_sinks"].spec_type


def sinks(**kw: Any) -> Any:
    args = {
        "block_size": 4,
        "num_kv_heads": 1,
        "head_size": 8,
        "dtype": torch.float16,
        "sink_tokens": 4,
        "window": 8,
    }
    return SINKS(**(args | kw))


def manager(*specs: Any, num_blocks: int = 40) -> KVCacheManager:
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)
        ],
    )
    return KVCacheManager(
        config,
        max_model_len=64,
        scheduler_block_size=4,
        hash_block_size=4,
        enable_caching=True,
        registry=REGISTRY,
    )


PROMPT = list(range(100, 124))  # 24 tokens: 6 blocks


def run_first(mgr: KVCacheManager) -> None:
    """Prefill ``PROMPT``, decode one token, free: blocks 1..6, then 7."""
    a = Request("a", PROMPT, hash_block_size=4)
    assert mgr.allocate_slots(a, 24) is not None
    a.num_computed_tokens = 24
    assert mgr.get_block_ids("a")[0] == [1, 2, 3, 4, 5, 6]
    # Token 24 reads block 0 (the sinks) and tokens 17..24, blocks 4..6:
    # blocks 1..3 (ids 2 3 4) go back to the pool.
    a.append_output_token_ids([7])
    assert mgr.allocate_slots(a, 1) is not None
    a.num_computed_tokens = 25
    assert mgr.get_block_ids("a")[0] == [1, 0, 0, 0, 5, 6, 7]
    assert mgr.get_num_free_blocks() == 39 - 4
    mgr.free(a)
    assert mgr.get_num_free_blocks() == 39


def test_the_middle_is_released_and_a_hit_needs_sinks_and_window() -> None:
    mgr = manager(sinks())
    run_first(mgr)
    b = Request("b", [*PROMPT, 5, 6, 7, 8], hash_block_size=4)
    hit, num_hit = mgr.get_computed_blocks(b)
    # The longest hit, 24 tokens (6 blocks): the sink block and the window
    # of token 24 (blocks 4 and 5), the null block between them.
    assert num_hit == 24
    assert [[blk.block_id for blk in g] for g in hit.blocks] == [[1, 0, 0, 0, 5, 6]]
    assert mgr.allocate_slots(b, 4, num_hit, hit) is not None
    assert mgr.get_block_ids("b")[0][:6] == [1, 0, 0, 0, 5, 6]
    # b holds the sink block, its window and one new block.
    assert mgr.get_num_free_blocks() == 39 - 4


def test_a_missing_window_block_shortens_the_hit() -> None:
    mgr = manager(sinks())
    run_first(mgr)
    pool = mgr.block_pool
    pool.drop_from_cache(pool.blocks[6])  # block 5 of the prompt
    b = Request("b", PROMPT, hash_block_size=4)
    hit, num_hit = mgr.get_computed_blocks(b)
    # A 24-token hit reads block 5; 20 tokens read the sinks and blocks 3
    # and 4 (tokens 13..20), released by the first request but still cached.
    assert num_hit == 20
    assert [[blk.block_id for blk in g] for g in hit.blocks] == [[1, 0, 0, 4, 5]]


def test_a_missing_sink_block_leaves_no_hit() -> None:
    mgr = manager(sinks())
    run_first(mgr)
    pool = mgr.block_pool
    pool.drop_from_cache(pool.blocks[1])  # the sink block
    b = Request("b", PROMPT, hash_block_size=4)
    assert mgr.get_computed_blocks(b)[1] == 0


def test_beside_full_attention_both_groups_take_one_hit() -> None:
    full = REGISTRY["full_attention"].spec_type(
        block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    mgr = manager(sinks(sink_tokens=6), full)
    a = Request("a", PROMPT, hash_block_size=4)
    assert mgr.allocate_slots(a, 24) is not None
    a.num_computed_tokens = 24
    mgr.free(a)
    b = Request("b", [*PROMPT, 1], hash_block_size=4)
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 24
    sink_group, full_group = hit.blocks
    # 6 sink tokens take blocks 0 and 1; token 24 reads blocks 4 and 5.
    assert [blk.is_null for blk in sink_group] == [
        False,
        False,
        True,
        True,
        False,
        False,
    ]
    assert not any(blk.is_null for blk in full_group)
    assert mgr.allocate_slots(b, 1, num_hit, hit) is not None
