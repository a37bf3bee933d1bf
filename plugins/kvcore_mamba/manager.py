"""The recurrent-state block manager.

``mamba_cache_mode="none"``: each request holds one state block (plus its
speculative blocks) for its life; nothing is cached.

``"align"``: the table is indexed by block position like attention, but only
the newest state is a real block; earlier positions are the null block.  The
state a step leaves in its last block is hashed when the step ends exactly on
a block boundary, so a later request with the same prefix can resume from it.

``"all"``: like ``"align"``, but every state block is kept for the request's
life.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from kvcore.coordinator.block_pool import BlockPool, KVCacheBlock
from kvcore.coordinator.hashing import BlockHash, hashes_at_block_size
from kvcore.coordinator.manager import FixedBlocksManager, SingleTypeManager
from kvcore.coordinator.request import Request
from kvcore.errors import InvalidSpecError
from kvcore.spec import cdiv

__all__ = ["MambaManager", "MambaStateManager"]


class MambaStateManager(FixedBlocksManager):
    """Mode ``none``: one state block (plus speculative ones) per request."""

    def blocks_per_request(self, spec: Any) -> int:
        return 1 + int(spec.num_speculative_blocks)


class MambaManager(SingleTypeManager):
    """Modes ``align`` and ``all``: states at block boundaries."""

    monotone_hits: ClassVar[bool] = False
    skips_blocks: ClassVar[bool] = True
    # The state is written at the last computed position; slots past it for
    # speculative tokens would move it.
    supports_lookahead: ClassVar[bool] = False

    def __init__(self, spec: Any, block_pool: BlockPool, **kwargs: Any) -> None:
        if spec.num_speculative_blocks:
            msg = (
                f"mamba_cache_mode={spec.mamba_cache_mode!r} with "
                f"num_speculative_blocks={spec.num_speculative_blocks} is not "
                "supported: state blocks are cached by position, and speculative "
                "states have none. Use mamba_cache_mode='none' with speculative "
                "decoding"
            )
            raise InvalidSpecError(msg)
        super().__init__(spec, block_pool, **kwargs)
        self.keep_all = spec.mamba_cache_mode == "all"
        #: request id -> positions below this are all null (already released).
        self._released: dict[str, int] = {}

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
    ) -> int:
        held = self.req_to_blocks.get(request_id)
        have = len(new_computed_blocks) + (len(held) if held is not None else 0)
        need = 1 if cdiv(num_tokens, self.block_size) > have else 0
        if self.keep_all:
            need = max(cdiv(num_tokens, self.block_size) - have, 0)
        for block in new_computed_blocks:
            if block.ref_cnt == 0 and not block.is_null:
                need += 1
        return need

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int
    ) -> list[KVCacheBlock]:
        held = self.req_to_blocks.get(request_id)
        if held is None:
            held = self.req_to_blocks[request_id] = []
        target = cdiv(num_tokens, self.block_size)
        missing = target - len(held)
        if missing <= 0:
            return []
        if self.keep_all:
            new = self.block_pool.get_new_blocks(missing)
            held.extend(new)
            return new
        # Only the step's last position gets a real block: the step's final
        # state is written there.
        held.extend([self.null_block] * (missing - 1))
        new = self.block_pool.get_new_blocks(1)
        held.extend(new)
        return new

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.caching or num_tokens % self.block_size:
            return
        rid = request.request_id
        pos = num_tokens // self.block_size - 1
        blocks = self.req_to_blocks.get(rid)
        if pos < 0 or blocks is None or pos >= len(blocks):
            return
        if self.num_cached_block.get(rid, 0) > pos:
            return
        hashes = hashes_at_block_size(
            request.block_hashes, self.hash_block_size, self.block_size
        )
        if pos >= len(hashes):
            return
        self.block_pool.cache_full_blocks(
            block_hashes=hashes,
            blocks=blocks,
            num_cached_blocks=pos,
            num_full_blocks=pos + 1,
            group_id=self.kv_cache_group_id,
            token_ids=request.all_token_ids,
        )
        self.num_cached_block[rid] = pos + 1

    def hit_serves(self, blocks: Sequence[KVCacheBlock]) -> bool:
        # The next token reads the state at the hit's last position.
        return not blocks or not blocks[-1].is_null

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        # Only the state after the last computed token is read again.
        if self.keep_all or num_computed_tokens <= 0:
            return 0
        return (num_computed_tokens - 1) // self.block_size

    def _skipped(self, request_id: str, num_computed_tokens: int) -> list[int]:
        # A step longer than a block pads the table with nulls between the
        # state it reads and the one it writes, and a hit pads before its
        # state, so nulls are not a prefix: scan down to where the previous
        # release stopped instead of stopping at the first null.
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return []
        last = min(self.num_skipped_blocks(num_computed_tokens), len(blocks))
        null = self.null_block
        start = self._released.get(request_id, 0)
        return [i for i in range(last - 1, start - 1, -1) if blocks[i] is not null]

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        super().remove_skipped_blocks(request_id, num_computed_tokens)
        blocks = self.req_to_blocks.get(request_id)
        if blocks:
            last = min(self.num_skipped_blocks(num_computed_tokens), len(blocks))
            if last > self._released.get(request_id, 0):
                self._released[request_id] = last

    def pop_blocks(self, request_id: str) -> list[KVCacheBlock] | None:
        self._released.pop(request_id, None)
        return super().pop_blocks(request_id)

    def request_state(self, request_id: str) -> Any:
        return super().request_state(request_id), self._released.get(request_id)

    def restore_request_state(self, request_id: str, state: Any) -> None:
        base, released = state
        super().restore_request_state(request_id, base)
        if released is None:
            self._released.pop(request_id, None)
        else:
            self._released[request_id] = released

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
        """The latest cached state at an aligned block boundary."""
        null = block_pool.null_block
        limit = min(max_length // block_size, len(block_hashes))
        for i in range(limit - 1, -1, -1):
            if ((i + 1) * block_size) % alignment:
                continue
            cached = block_pool.get_cached_block(block_hashes[i], group_ids)
            if cached is not None:
                return [[null] * i + [block] for block in cached]
        return [[] for _ in group_ids]
