"""Packer rules beyond the spec file."""

from __future__ import annotations

import torch

import kvcore
from kvcore_circular_buffer import CircularBufferSpec
from kvcore_full_attention import FullAttentionSpec


def test_state_bucket_of_unequal_pages_splits_to_one_state_per_group() -> None:
    # full: 4 tokens * 1 head * (8 + 8) * 2 bytes = 128 B.  Rings (block 4,
    # head 8, no V, fp16): 1 head -> 4 * 16 = 64 B, 2 heads -> 128 B.  The
    # rings share a grouping key but not a page; the block is 128 B wide,
    # so each ring gets its own group, and no group is empty.
    def ring(heads: int) -> CircularBufferSpec:
        return CircularBufferSpec(
            block_size=4,
            num_kv_heads=heads,
            head_size=8,
            head_size_v=0,
            dtype=torch.float16,
        )

    specs = {
        "full": FullAttentionSpec(
            block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16
        ),
        "ring0": ring(1),
        "ring1": ring(2),
    }
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(kv_cache_layout="BLHNC", packing_policy="seed")
    )
    groups = kvcore.get_kv_cache_groups(config, specs)
    assert sorted(g.layer_names for g in groups) == [["full"], ["ring0"], ["ring1"]]
    assert kvcore.kv_cache_bytes_per_block(groups) == 128
