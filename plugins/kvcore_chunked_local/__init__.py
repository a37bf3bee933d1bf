"""Chunked local attention: a token attends to the tokens of its own chunk.

Llama 4's RoPE layers attend within fixed chunks of ``attention_chunk_size``
tokens.  Blocks of chunks that are already complete are never read again, so
a request holds at most the blocks of one chunk (plus one for the boundary).
The cache is not prefix-cached: after another group's prefix hit, the
scheduler replays the hit's last chunk to rebuild it.  An engine's block
size (or a grown block) must tile the chunk, so completed chunks free whole
blocks.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import ClassVar

import attrs

from kvcore.errors import InvalidSpecError
from kvcore.hookspecs import kinds_impl
from kvcore.kinds import AttentionKind
from kvcore.spec import AttentionSpec, HitPolicy, PackingRole, cdiv, positive_int
from kvcore_chunked_local.manager import ChunkedLocalManager

__all__ = ["ChunkedLocalAttention", "ChunkedLocalAttentionSpec", "ChunkedLocalManager"]


@attrs.frozen(kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """A chunked-local attention layer.

    :param attention_chunk_size: tokens per attention chunk.
    """

    kind: ClassVar[str] = "chunked_local_attention"
    packing_role: ClassVar[PackingRole] = PackingRole.WINDOW

    attention_chunk_size: int = attrs.field(validator=positive_int)

    @property
    def hit_policy(self) -> HitPolicy:
        # Rebuilt after a hit by replaying the hit's last chunk.
        return HitPolicy.NOT_HASHED

    @property
    def prefix_replay_tokens(self) -> int:
        return self.attention_chunk_size

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        """The tokens of completed chunks."""
        chunk = self.attention_chunk_size
        return (num_computed_tokens // chunk) * chunk

    def grown(self, factor: int) -> ChunkedLocalAttentionSpec | None:
        # A grown block must still tile the chunk, so chunks free whole blocks.
        if type(factor) is not int or self.attention_chunk_size % (
            self.block_size * factor
        ):
            return None
        return super().grown(factor)

    def with_block_size(self, block_size: int) -> ChunkedLocalAttentionSpec | None:
        # Completed chunks free whole blocks only if the block tiles the chunk.
        chunk = self.attention_chunk_size
        if type(block_size) is int and block_size > 0 and chunk % block_size:
            msg = (
                f"block size {block_size} does not tile attention_chunk_size="
                f"{chunk}; a chunk must be a whole number of blocks so completed "
                f"chunks free whole blocks; use a block size that divides {chunk}"
            )
            raise InvalidSpecError(msg)
        return super().with_block_size(block_size)

    def max_num_blocks_per_request(self, max_model_len: int) -> int:
        span = min(self.attention_chunk_size, max_model_len)
        return min(
            cdiv(span, self.block_size) + 1, cdiv(max_model_len, self.block_size)
        )

    def group_key(self) -> Hashable:
        return (self.kind, self.block_size, self.attention_chunk_size)


class ChunkedLocalAttention(AttentionKind):
    spec_type = ChunkedLocalAttentionSpec
    manager_type = ChunkedLocalManager


kvcore_register_kinds = kinds_impl(ChunkedLocalAttention())
