"""Engine settings the planner and the coordinator read."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from kvcore.errors import KvcoreValueError, LayoutError
from kvcore.layout import KVCacheLayout
from kvcore.spec import is_bool, optional_positive_int, positive_int

__all__ = ["CacheConfig", "EngineConfig", "MambaCacheMode", "ParallelConfig"]

MambaCacheMode = Literal["none", "align", "all"]
_MAMBA_MODES = ("none", "align", "all")


def _layout(value: Any) -> KVCacheLayout | None:
    if value is None:
        return None
    return KVCacheLayout.from_name(value)


def _mamba_mode(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in _MAMBA_MODES:
        msg = (
            f"{type(instance).__name__}.{attribute.name} must be one of "
            f"{', '.join(_MAMBA_MODES)}, got {value!r}"
        )
        raise KvcoreValueError(msg)


@attrs.define(kw_only=True)
class CacheConfig:
    """Cache settings.

    :param block_size: the engine's default block size in tokens.
    :param kv_cache_layout: the resolved physical layout, or ``None`` while
        unresolved (a name such as ``"BLHNC"`` or ``"NHD"`` is converted).
    :param num_gpu_blocks_override: use this many blocks, whatever the memory.
    :param enable_prefix_caching: share blocks between requests by hash.
    :param prefix_match_unit: hash granularity in tokens (default: the gcd of
        the cacheable groups' block sizes).
    :param mamba_cache_mode: ``none``, ``align`` or ``all``.
    """

    block_size: int = attrs.field(default=16, validator=positive_int)
    kv_cache_layout: KVCacheLayout | None = attrs.field(
        default=None, converter=_layout, on_setattr=attrs.setters.convert
    )
    num_gpu_blocks_override: int | None = attrs.field(
        default=None, validator=optional_positive_int
    )
    enable_prefix_caching: bool = attrs.field(default=False, validator=is_bool)
    prefix_match_unit: int | None = attrs.field(
        default=None, validator=optional_positive_int
    )
    mamba_cache_mode: MambaCacheMode = attrs.field(
        default="none", validator=_mamba_mode
    )

    def resolved_layout(self) -> KVCacheLayout:
        """The layout, or a :class:`~kvcore.errors.LayoutError` if unresolved."""
        if self.kv_cache_layout is None:
            msg = (
                "KV cache layout has not been resolved yet; the engine resolves it "
                "once from the attention backend's supported layouts, or set "
                "CacheConfig(kv_cache_layout='BLHNC') explicitly"
            )
            raise LayoutError(msg)
        return self.kv_cache_layout


@attrs.define(kw_only=True)
class ParallelConfig:
    """Parallelism that changes block sizes.

    :param decode_context_parallel_size: attention block sizes are multiplied
        by this (each rank holds a slice of every block's tokens).
    """

    tensor_parallel_size: int = attrs.field(default=1, validator=positive_int)
    pipeline_parallel_size: int = attrs.field(default=1, validator=positive_int)
    decode_context_parallel_size: int = attrs.field(default=1, validator=positive_int)


@attrs.define(kw_only=True)
class EngineConfig:
    """Everything the planner reads.

    :param kv_transfer_enabled: a KV connector is active (hashes are then
        computed even without prefix caching).
    """

    cache_config: CacheConfig = attrs.Factory(CacheConfig)
    parallel_config: ParallelConfig = attrs.Factory(ParallelConfig)
    max_model_len: int | None = attrs.field(
        default=None, validator=optional_positive_int
    )
    kv_transfer_enabled: bool = attrs.field(default=False, validator=is_bool)
