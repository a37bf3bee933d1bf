"""Multi-head latent attention: one latent vector per stored state.

``tokens_per_state > 1`` compresses that many tokens into one state (the
compressed sparse-MLA caches); ``alignment`` pads each page to a multiple of
the kernel's row size.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvcore.coordinator.managers import PrefixManager
from kvcore.hookspecs import kinds_impl
from kvcore.kinds import AttentionKind
from kvcore.spec import Sharded, non_negative_int, replicate
from kvcore_full_attention import FullAttentionSpec

__all__ = ["MLA", "MLAAttentionSpec"]


@attrs.frozen(kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """An MLA layer: ``[1, block_size / tokens_per_state, head_size]`` per page.

    It shares a grouping key with full attention of the same block size, so
    a model's main KV and its compressed or indexer caches can pack into one
    group.
    """

    kind: ClassVar[str] = "mla"

    head_size_v: int = attrs.field(default=0, validator=non_negative_int)

    def sharded(self, tp_size: int) -> Sharded:
        """Every rank keeps the whole latent: all query heads read the one
        latent, so engines run MLA as a single KV head on each rank whatever
        the tensor-parallel size."""
        return replicate(self, tp_size, "MLA latent")


class MLA(AttentionKind):
    spec_type = MLAAttentionSpec
    # An MLA layer keeps every state of the request, like full attention.
    manager_type = PrefixManager


kvcore_register_kinds = kinds_impl(MLA())
