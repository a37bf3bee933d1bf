"""Multi-head latent attention: one latent vector per stored state.

``tokens_per_state > 1`` compresses that many tokens into one state (the
compressed sparse-MLA caches); ``alignment`` pads each page to a multiple of
the kernel's row size; ``fp8_record_size`` is the packed record a latent
becomes under an 8-bit float cache dtype (DeepSeek-V3.2's ``fp8_ds_mla``).
"""

from __future__ import annotations

from typing import ClassVar, Self

import attrs
import torch

from kvcore.coordinator.managers import PrefixManager
from kvcore.hookspecs import kinds_impl
from kvcore.kinds import AttentionKind
from kvcore.spec import (
    Sharded,
    non_negative_int,
    one_latent,
    optional_positive_int,
    replicate,
)
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

    num_kv_heads: int = attrs.field(validator=one_latent)
    head_size_v: int = attrs.field(default=0, validator=non_negative_int)
    #: Bytes a token takes when the engine's cache dtype is an 8-bit float
    #: and the kernel stores the latent as a packed uint8 record instead
    #: (DeepSeek-V3.2's ``fp8_ds_mla``: 512 fp8 values, 4 fp32 scales and 64
    #: bf16 RoPE values, 656 B; vLLM ``models/config.py``
    #: ``DeepseekV32ForCausalLM``); None: the latent takes the dtype as is.
    fp8_record_size: int | None = attrs.field(
        default=None, validator=optional_positive_int
    )

    def with_cache_dtype(self, dtype: torch.dtype) -> Self | None:
        """An 8-bit float cache stores the latent as its ``fp8_record_size``
        record, when it has one; otherwise as full attention takes a dtype."""
        record = self.fp8_record_size
        if record is not None and dtype.is_floating_point and dtype.itemsize == 1:
            if not self.dtype.is_floating_point or self.page_size_padded is not None:
                return None
            return attrs.evolve(
                self, head_size=record, dtype=torch.uint8, fp8_record_size=None
            )
        return super().with_cache_dtype(dtype)

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
