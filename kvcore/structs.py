"""The plan: cache groups, tensors and the whole KV-cache config."""

from __future__ import annotations

import attrs

from kvcore.layout import KVCacheLayout
from kvcore.spec import GroupSpec, KVCacheSpec, UniformTypeKVCacheSpecs

__all__ = ["KVCacheConfig", "KVCacheGroupSpec", "KVCacheTensor"]


@attrs.define(kw_only=False)
class KVCacheGroupSpec:
    """Layers that share one block table (one manager in the coordinator).

    :param layer_names: the group's layers, in packing order.
    :param kv_cache_spec: a merged spec, or a :class:`UniformTypeKVCacheSpecs`.
    """

    layer_names: list[str]
    kv_cache_spec: GroupSpec

    def layer_spec(self, name: str) -> KVCacheSpec:
        """The spec of one layer of this group."""
        spec = self.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            return spec.kv_cache_specs[name]
        return spec

    @property
    def packed_bytes(self) -> int:
        """Bytes of one block of this group: the sum of its layers' pages."""
        return sum(self.layer_spec(n).page_size_bytes for n in self.layer_names)


@attrs.define(kw_only=False)
class KVCacheTensor:
    """A run of layers with one spec inside the shared allocation.

    The page of ``layers[l]`` in block ``b`` starts at byte
    ``offset + l * layer_stride + b * block_stride``.  Tensors of different
    groups may overlap (alias): a block id is owned by one group at a time.
    """

    size: int
    layers: list[str]
    layer_stride: int
    block_stride: int
    offset: int = 0
    host_resident: bool = False


@attrs.define(kw_only=True)
class KVCacheConfig:
    """The full plan: how many blocks, where every layer lives, the groups."""

    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec]
    kv_cache_layout: KVCacheLayout | None = None
    bytes_per_block: int = 0

    def group_of(self, layer: str) -> int:
        """Index of the group holding ``layer``."""
        for i, group in enumerate(self.kv_cache_groups):
            if layer in group.layer_names:
                return i
        from kvcore.errors import KvcoreKeyError

        msg = f"layer {layer!r} is in no cache group of this config"
        raise KvcoreKeyError(msg)
