"""The sliding-window block manager.

Blocks that leave the window go back to the pool and become the null block
in the request's table.  A prefix hit needs only the window's tokens cached,
so the search runs from the right.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from kvcore.coordinator.block_pool import BlockPool, KVCacheBlock
from kvcore.coordinator.hashing import BlockHash
from kvcore.coordinator.manager import SingleTypeManager

__all__ = ["SlidingWindowManager"]


class SlidingWindowManager(SingleTypeManager):
    """Frees blocks below the window; hits need the last window of blocks."""

    monotone_hits: ClassVar[bool] = False
    skips_blocks: ClassVar[bool] = True

    def __init__(self, spec: Any, block_pool: BlockPool, **kwargs: Any) -> None:
        super().__init__(spec, block_pool, **kwargs)
        self.sliding_window: int = spec.sliding_window
        self.num_skipped_tokens = spec.skipped_tokens

    def hit_serves(self, blocks: Sequence[KVCacheBlock]) -> bool:
        # The next token reads the window before it: those blocks must be real.
        start = (
            self.num_skipped_tokens(len(blocks) * self.block_size) // self.block_size
        )
        return not any(block.is_null for block in blocks[start:])

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
        """The longest hit whose last ``sliding_window - 1`` tokens (plus the
        extra retained tokens) are cached.

        Scans from the right for a run of cached blocks long enough to cover
        the window; earlier positions are the null block.  A hit shorter than
        one window must be cached from the first block.  The result is cut to
        a multiple of ``alignment`` tokens, searching again below the cut
        when the cut leaves the window uncovered.
        """
        # The next token reads the window (and the extra tokens kept with it).
        needed = -(
            -(spec.sliding_window - 1 + spec.extra_retained_tokens) // block_size
        )
        null = block_pool.null_block
        limit = min(max_length // block_size, len(block_hashes))
        while True:
            hits = [[null] * limit for _ in group_ids]
            run = 0
            found = -1
            for i in range(limit - 1, -1, -1):
                cached = block_pool.get_cached_block(block_hashes[i], group_ids)
                if cached is None:
                    run = 0
                    continue
                for out, block in zip(hits, cached, strict=True):
                    out[i] = block
                run += 1
                if run >= needed:
                    found = i + run
                    break
            # Without a full window, only a run from the first block is a hit.
            length = found if found >= 0 else run
            aligned = (length * block_size // alignment) * alignment // block_size
            if aligned == length or aligned == 0:
                return [h[:aligned] for h in hits]
            limit = aligned
