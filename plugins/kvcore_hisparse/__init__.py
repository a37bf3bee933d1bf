"""HiSparse hot pages: a fixed GPU buffer of hot pages per request.

The sparse KV lives on the host; each request keeps ``blocks_per_request``
device blocks of its hottest pages.  Those blocks are private to the request,
so they are never hashed.  A hot page's size also becomes an alignment of the
shared block stride, so a hot page never straddles a block.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import ClassVar

import attrs

from kvcore.hookspecs import kinds_impl
from kvcore.kinds import CacheKind
from kvcore.layout import KVCacheLayout
from kvcore.spec import (
    HitPolicy,
    KVCacheSpec,
    PackingRole,
    Sharded,
    positive_int,
    replicate,
)
from kvcore.structs import KVCacheGroupSpec, KVCacheTensor
from kvcore_hisparse.manager import HiSparseHotManager

__all__ = [
    "HiSparseHotManager",
    "HiSparseHot",
    "HiSparseHotSpec",
    "build_hisparse_kv_cache_tensors",
]


@attrs.frozen(kw_only=True)
class HiSparseHotSpec(KVCacheSpec):
    """A hot-page buffer.

    :param page_size: bytes of one hot page (one layer-page of the source).
    :param blocks_per_request: device blocks each request keeps.
    """

    kind: ClassVar[str] = "hisparse_hot"
    packing_role: ClassVar[PackingRole] = PackingRole.STATE
    requires_block_outer_layout: ClassVar[bool] = True

    page_size: int = attrs.field(validator=positive_int)
    blocks_per_request: int = attrs.field(validator=positive_int)

    @property
    def page_grid(self) -> tuple[int, int, int]:
        return (1, 1, self.page_size)

    @property
    def hit_policy(self) -> HitPolicy:
        # Hot pages are private per request: never shared, never hit.
        return HitPolicy.NOT_HASHED

    def stride_alignment(self) -> int:
        return math.lcm(self.page_size, self.block_stride_alignment or 1)

    def max_num_blocks_per_request(self, max_model_len: int) -> int:
        return self.blocks_per_request

    def num_blocks_held(
        self, num_computed_tokens: int, num_tokens: int, block_size: int
    ) -> int:
        return self.blocks_per_request

    def group_key(self) -> Hashable:
        return (self.kind, self.block_size, self.blocks_per_request)

    def sharded(self, tp_size: int) -> Sharded:
        """A hot page copies one page of a sparse-MLA latent cache, which every
        rank keeps whole, so every rank keeps the same hot pages.  (Dtype and
        block size stay too: a hot page is raw bytes of its source.)"""
        return replicate(self, tp_size, "hot pages")


class HiSparseHot(CacheKind):
    """Hot pages stay raw bytes ``[num_blocks, 1, 1, page_size]``."""

    spec_type = HiSparseHotSpec
    manager_type = HiSparseHotManager


def build_hisparse_kv_cache_tensors(
    groups: Sequence[KVCacheGroupSpec],
    num_blocks: int,
    size: int,
    layout: KVCacheLayout,
    bytes_per_block: int,
    *,
    host_resident: bool = False,
) -> list[KVCacheTensor]:
    """Tensors for a plan that holds hot-page groups.

    Hot pages need a block-outermost layout; every group restarts at byte 0
    of the block and every tensor spans ``size`` bytes.
    """
    from kvcore.plan import build_kv_cache_tensors, validate_kv_cache_layout

    validate_kv_cache_layout(layout, groups)
    return build_kv_cache_tensors(
        groups,
        num_blocks=num_blocks,
        size=size,
        layout=layout,
        bytes_per_block=bytes_per_block,
        host_resident=host_resident,
    )


kvcore_register_kinds = kinds_impl(HiSparseHot())
