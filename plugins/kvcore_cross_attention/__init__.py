"""Encoder cross-attention: a decoder layer reads the keys and values of the
request's encoder output (Whisper, BART, T5).

The cache holds one slot per encoder token, written once when the encoder
runs, so a request's blocks in the group are sized by its encoder tokens
(``num_encoder_tokens`` of ``allocate_slots`` when it is admitted with
encoder inputs), never by its decoder tokens: decoding grows nothing, a
request without encoder inputs holds no block, and the blocks stay until
the request is freed.  Encoder outputs are not prefixes of one another, so
the cache is never hashed or hit.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvcore.hookspecs import kinds_impl
from kvcore.kinds import AttentionKind
from kvcore.spec import AttentionSpec, HitPolicy, cdiv, optional_positive_int
from kvcore_cross_attention.manager import CrossAttentionManager

__all__ = ["CrossAttention", "CrossAttentionManager", "CrossAttentionSpec"]


@attrs.frozen(kw_only=True)
class CrossAttentionSpec(AttentionSpec):
    """An encoder cross-attention layer: one page slot per encoder token.

    :param max_encoder_tokens: the most encoder tokens one request brings
        (Whisper: 1500), which bounds its blocks; ``None``: bounded by
        ``max_model_len``.
    """

    kind: ClassVar[str] = "cross_attention"

    max_encoder_tokens: int | None = attrs.field(
        default=None, validator=optional_positive_int
    )

    @property
    def hit_policy(self) -> HitPolicy:
        # Encoder outputs are per request: nothing to share by prefix.
        return HitPolicy.NOT_HASHED

    def num_blocks_held(
        self, num_computed_tokens: int, num_tokens: int, block_size: int
    ) -> int:
        # Decoder tokens take no block here; the encoder's blocks are taken
        # at admission from num_encoder_tokens, outside this token model.
        return 0

    def max_num_blocks_per_request(self, max_model_len: int) -> int:
        tokens = self.max_encoder_tokens
        return cdiv(max_model_len if tokens is None else tokens, self.block_size)


class CrossAttention(AttentionKind):
    spec_type = CrossAttentionSpec
    manager_type = CrossAttentionManager


kvcore_register_kinds = kinds_impl(CrossAttention())
