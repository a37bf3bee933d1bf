"""The cross-attention block manager.

A request's table holds ``ceil(num_encoder_tokens / block_size)`` blocks,
taken when it is admitted with encoder inputs: the manager declares
``takes_encoder_tokens``, so the coordinator sizes its table by the
engine's ``num_encoder_tokens`` rather than the decoder's tokens.  The table
is not position-indexed by decoder tokens (a running request never grows
it), is never hashed and never takes a hit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from kvcore.coordinator.block_pool import BlockPool
from kvcore.coordinator.manager import HitQuery, SingleTypeManager
from kvcore.coordinator.request import Request

__all__ = ["CrossAttentionManager"]


class CrossAttentionManager(SingleTypeManager):
    """Holds one slot per encoder token from admission until the request is
    freed; nothing else."""

    takes_encoder_tokens: ClassVar[bool] = True
    position_indexed: ClassVar[bool] = False

    def __init__(self, spec: Any, block_pool: BlockPool, **kwargs: Any) -> None:
        super().__init__(spec, block_pool, **kwargs)
        self.caching = False

    def add_computed_blocks(self, request_id: str, blocks: Sequence[int]) -> None:
        # Never hit: an admission attaches nothing here.
        return

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        return

    @classmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> list[list[int]]:
        return [[] for _ in query.group_ids]
