"""Circular buffer: one block per request for its whole life.

A compressor ring holds the raw keys of the token group still being
compressed; ``block_size`` is the ring's capacity.  It covers no token range,
so it is never hashed and never contributes a prefix hit.  Serving choices
leave its dtype and capacity alone; under tensor parallelism its heads split
like attention heads (a one-head ring of a latent is replicated).
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from kvcore.hookspecs import kinds_impl
from kvcore.kinds import AttentionKind
from kvcore.spec import AttentionSpec, HitPolicy, PackingRole
from kvcore_circular_buffer.manager import CircularBufferManager

__all__ = ["CircularBufferManager", "CircularBuffer", "CircularBufferSpec"]


@attrs.frozen(kw_only=True)
class CircularBufferSpec(AttentionSpec):
    """A ring of ``block_size`` states: ``[num_kv_heads, block_size,
    head_size + head_size_v]`` per page."""

    kind: ClassVar[str] = "circular_buffer"
    packing_role: ClassVar[PackingRole] = PackingRole.STATE

    @property
    def hit_policy(self) -> HitPolicy:
        # The ring is rebuilt from the replayed tokens after a hit.
        return HitPolicy.NOT_HASHED

    def max_num_blocks_per_request(self, max_model_len: int) -> int:
        return 1

    def grown(self, factor: int) -> CircularBufferSpec | None:
        # The block is the ring's capacity, not a page of tokens.
        return self if factor == 1 else None

    def num_blocks_held(
        self, num_computed_tokens: int, num_tokens: int, block_size: int
    ) -> int:
        return 1

    def with_cache_dtype(self, dtype: torch.dtype) -> CircularBufferSpec | None:
        # The ring accumulates compressor inputs at the compressor's own
        # precision; the engine's cache dtype is for the compressed cache.
        return None

    def with_block_size(self, block_size: int) -> CircularBufferSpec | None:
        # The block is the ring's capacity, which the compression ratio fixes.
        return None


class CircularBuffer(AttentionKind):
    spec_type = CircularBufferSpec
    manager_type = CircularBufferManager


kvcore_register_kinds = kinds_impl(CircularBuffer())
