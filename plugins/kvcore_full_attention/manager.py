"""The full-attention block manager: every block stays, hits grow from the left."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcore.coordinator.block_pool import BlockPool, KVCacheBlock
from kvcore.coordinator.hashing import BlockHash
from kvcore.coordinator.manager import SingleTypeManager

__all__ = ["FullAttentionManager"]


class FullAttentionManager(SingleTypeManager):
    """Keeps every block of a request; the prefix hit is the run of cached
    blocks from the first block up to the first miss (hashes chain, so a miss
    ends the prefix)."""

    @classmethod
    def find_longest_cache_hit(
        cls,
        spec: Any,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_ids: Sequence[int],
        block_pool: BlockPool,
        block_size: int,
        alignment: int,
    ) -> list[list[KVCacheBlock]]:
        limit = min(max_length // block_size, len(block_hashes))
        if len(group_ids) == 1:
            gid = group_ids[0]
            out: list[KVCacheBlock] = []
            append = out.append
            # The group's hash -> block map, read directly (see
            # BlockPool.lookup): an entry is a block or {block_id: block}.
            get = block_pool.cached_blocks_of(gid).get
            for i in range(limit):
                entry = get(block_hashes[i])
                if entry is None:
                    break
                if isinstance(entry, dict):
                    entry = next(iter(entry.values()))
                append(entry)
            hits = [out]
        else:
            hits = [[] for _ in group_ids]
            for i in range(limit):
                cached = block_pool.get_cached_block(block_hashes[i], group_ids)
                if cached is None:
                    break
                for blocks, block in zip(hits, cached, strict=True):
                    blocks.append(block)
        if alignment > block_size:
            keep = (len(hits[0]) * block_size // alignment) * alignment // block_size
            if keep != len(hits[0]):
                hits = [h[:keep] for h in hits]
        return hits
