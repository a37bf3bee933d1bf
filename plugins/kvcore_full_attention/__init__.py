"""Full attention: every token's keys and values stay for the request's life."""

from __future__ import annotations

from collections.abc import Hashable
from typing import ClassVar

import attrs

from kvcore.hookspecs import kinds_impl
from kvcore.kinds import AttentionKind
from kvcore.spec import AttentionSpec
from kvcore_full_attention.manager import FullAttentionManager

__all__ = [
    "ATTENTION_FAMILY",
    "FullAttention",
    "FullAttentionManager",
    "FullAttentionSpec",
]

#: Grouping tag shared by every kind whose layers need one slot per token for
#: the whole request (full attention and MLA), so they may share a group.
ATTENTION_FAMILY = "attention"


@attrs.frozen(kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """A full-attention layer: ``[num_kv_heads, block_size, head_size +
    head_size_v]`` elements per page."""

    kind: ClassVar[str] = "full_attention"

    def group_key(self) -> Hashable:
        return (ATTENTION_FAMILY, self.block_size)

    @property
    def copies_partial_block_hits(self) -> bool:
        # Append-only, one slot per token (or per tokens_per_state tokens):
        # the slots of positions below P hold the prefix whatever follows.
        return True


class FullAttention(AttentionKind):
    spec_type = FullAttentionSpec
    manager_type = FullAttentionManager


kvcore_register_kinds = kinds_impl(FullAttention())
