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

import pytest
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
    assert hit.get_block_ids() == ([1, 0, 0, 0, 5, 6],)
    assert mgr.allocate_slots(b, 4, num_hit, hit) is not None
    assert mgr.get_block_ids("b")[0][:6] == [1, 0, 0, 0, 5, 6]
    # b holds the sink block, its window and one new block.
    assert mgr.get_num_free_blocks() == 39 - 4


def test_a_missing_window_block_shortens_the_hit() -> None:
    mgr = manager(sinks())
    run_first(mgr)
    pool = mgr.block_pool
    pool.drop_from_cache(6)  # block 5 of the prompt
    b = Request("b", PROMPT, hash_block_size=4)
    hit, num_hit = mgr.get_computed_blocks(b)
    # A 24-token hit reads block 5; 20 tokens read the sinks and blocks 3
    # and 4 (tokens 13..20), released by the first request but still cached.
    assert num_hit == 20
    assert hit.get_block_ids() == ([1, 0, 0, 4, 5],)


def test_a_missing_sink_block_leaves_no_hit() -> None:
    mgr = manager(sinks())
    run_first(mgr)
    pool = mgr.block_pool
    pool.drop_from_cache(1)  # the sink block
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
    sink_group, full_group = hit.ids
    # 6 sink tokens take blocks 0 and 1; token 24 reads blocks 4 and 5.
    assert [blk == 0 for blk in sink_group] == [
        False,
        False,
        True,
        True,
        False,
        False,
    ]
    assert 0 not in full_group
    assert mgr.allocate_slots(b, 1, num_hit, hit) is not None


def test_a_rolled_back_step_puts_the_released_middle_back() -> None:
    """A decode step releases blocks 1..3 and then another group's manager
    raises: the step is undone, the request's table and the pool both as
    they were."""
    from kvcore import KindRegistry
    from kvcore.errors import PluginError
    from kvcore_full_attention import FullAttention, FullAttentionSpec
    from kvcore_full_attention.manager import FullAttentionManager

    class Raising(FullAttentionManager):
        def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[int]:
            new = super().allocate_new_blocks(request_id, num_tokens)
            if request_id == "a" and num_tokens > 24:
                msg = "allocation failed"
                raise RuntimeError(msg)
            return new

    class RaisingFullAttention(FullAttention):
        manager_type = Raising

    registry = KindRegistry.from_kinds(
        [REGISTRY["attention_sinks"], RaisingFullAttention()]
    )
    full = FullAttentionSpec(
        block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    config = KVCacheConfig(
        num_blocks=40,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["layer.0"], sinks()),
            KVCacheGroupSpec(["layer.1"], full),
        ],
    )
    mgr = KVCacheManager(
        config,
        max_model_len=64,
        scheduler_block_size=4,
        hash_block_size=4,
        enable_caching=True,
        registry=registry,
    )
    a = Request("a", PROMPT, hash_block_size=4)
    assert mgr.allocate_slots(a, 24) is not None
    a.num_computed_tokens = 24
    a.append_output_token_ids([7])
    before = (mgr.get_num_free_blocks(), mgr.get_block_ids("a"))
    assert before[1][0] == [1, 2, 3, 4, 5, 6]
    with pytest.raises(PluginError, match="allocation failed"):
        mgr.allocate_slots(a, 1)
    assert (mgr.get_num_free_blocks(), mgr.get_block_ids("a")) == before
    mgr.free(a)
    assert mgr.get_num_free_blocks() == 39
