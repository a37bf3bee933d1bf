"""Engine settings the planner and the coordinator read."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, get_args

import attrs

from kvcore.choices import PACKING_POLICIES
from kvcore.errors import KvcoreValueError, LayoutError, require_instance
from kvcore.layout import KVCacheLayout
from kvcore.length_mix import LengthMix
from kvcore.spec import is_bool, optional_positive_int, positive_int
from kvcore.tokens import check_token_count

__all__ = [
    "DEFAULT_TARGET_CONTEXT",
    "PACKING_POLICIES",
    "CacheConfig",
    "EngineConfig",
    "MambaCacheMode",
    "ParallelConfig",
]

MambaCacheMode = Literal["none", "align", "all"]
_MAMBA_MODES: tuple[str, ...] = get_args(MambaCacheMode)
#: The context ``min_waste`` plans for when neither ``target_context`` nor
#: ``max_model_len`` is set.
DEFAULT_TARGET_CONTEXT = 32768


def _tokens(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """attrs validator: a token count follows the token rule (below 2**32)."""
    if value is not None:
        check_token_count(
            value, f"{type(instance).__name__}.{attribute.name}", minimum=1
        )


#: A positive token count, or None.
_OPTIONAL_TOKENS = [optional_positive_int, _tokens]
#: A positive token count.
_TOKENS = [positive_int, _tokens]


def _settings(attribute: attrs.Attribute[Any], value: object, cls: type) -> None:
    """A settings object of the right class (EngineConfig's parts)."""
    require_instance(value, cls, f"EngineConfig.{attribute.name}")


def _layout(value: Any) -> KVCacheLayout | None:
    if value is None:
        return None
    return KVCacheLayout.from_name(value)


def _one_of(
    names: tuple[str, ...], *, optional: bool = False
) -> Callable[[object, attrs.Attribute[Any], Any], None]:
    """attrs validator: the value is one of ``names`` (or None if
    ``optional``)."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value in names or (optional and value is None):
            return
        msg = (
            f"{type(instance).__name__}.{attribute.name} must be one of "
            f"{', '.join(names)}, got {value!r}"
        )
        raise KvcoreValueError(msg)

    return check


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
    :param mamba_cache_mode: the engine's recurrent-state caching mode
        (``none``, ``align`` or ``all``); when set, every layer spec that has a
        ``mamba_cache_mode`` must agree with it (``None``: each spec's own).
    :param packing_policy: how layers are grouped: ``min_waste`` (the most
        requests of ``target_context`` tokens; the default) or ``seed`` (the
        reference rules).
    :param target_context: the request length ``min_waste`` plans for
        (default: the engine's ``max_model_len``, else 32768).
    :param target_lengths: a mix of request lengths
        (:class:`~kvcore.length_mix.LengthMix`) ``min_waste`` plans for
        instead of ``target_context``: the plan holding the most requests of
        the mix (:func:`kvcore.plan.mix_capacity`); no length may pass
        ``max_model_len``.
    :param max_kv_cache_groups: the most groups ``min_waste`` may plan (each
        costs the scheduler a block table and a manager per step); a model
        with more buckets gets one group a bucket, and where ``seed`` plans
        more groups, ``min_waste`` may plan as many (it never needs more
        bytes per request than ``seed``).
    :param max_block_growth: the largest factor ``min_waste`` may grow a
        kind's block size by (1: keep the model's block sizes).  Larger blocks
        fill strides that large states force, but prefix hits become
        multiples of the larger block.
    """

    block_size: int = attrs.field(default=16, validator=_TOKENS)
    kv_cache_layout: KVCacheLayout | None = attrs.field(
        default=None, converter=_layout, on_setattr=attrs.setters.convert
    )
    num_gpu_blocks_override: int | None = attrs.field(
        default=None, validator=optional_positive_int
    )
    enable_prefix_caching: bool = attrs.field(default=False, validator=is_bool)
    prefix_match_unit: int | None = attrs.field(
        default=None, validator=_OPTIONAL_TOKENS
    )
    mamba_cache_mode: MambaCacheMode | None = attrs.field(
        default=None, validator=_one_of(_MAMBA_MODES, optional=True)
    )
    packing_policy: str = attrs.field(
        default="min_waste", validator=_one_of(PACKING_POLICIES)
    )
    target_context: int | None = attrs.field(default=None, validator=_OPTIONAL_TOKENS)
    target_lengths: LengthMix | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(
            lambda _i, a, v: require_instance(v, LengthMix, f"CacheConfig.{a.name}")
        ),
    )
    max_kv_cache_groups: int = attrs.field(default=64, validator=positive_int)
    max_block_growth: int = attrs.field(default=64, validator=positive_int)

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
    """Parallelism.

    :param tensor_parallel_size: ranks each layer's heads are split over.
        The specs a planner gets are one rank's; the plan records the size so
        workers and the scheduler can check they agree.
    :param pipeline_parallel_size: stages the layers are split over; each
        stage plans its own layers, and the plan records the size.
    :param decode_context_parallel_size: attention block sizes are multiplied
        by this (each rank holds a slice of every block's tokens).
    """

    tensor_parallel_size: int = attrs.field(default=1, validator=positive_int)
    pipeline_parallel_size: int = attrs.field(default=1, validator=positive_int)
    decode_context_parallel_size: int = attrs.field(default=1, validator=positive_int)


@attrs.define(kw_only=True)
class EngineConfig:
    """Everything the planner reads.

    :param max_model_len: the longest request, in tokens; a plan whose pool
        cannot hold one such request is refused.
    :param max_num_batched_tokens: tokens one scheduler step may prefill;
        the capacity model reserves one step's worth of blocks.
    :param kv_transfer_enabled: a KV connector is active (hashes are then
        computed even without prefix caching).
    """

    cache_config: CacheConfig = attrs.field(
        factory=CacheConfig, validator=lambda _i, a, v: _settings(a, v, CacheConfig)
    )
    parallel_config: ParallelConfig = attrs.field(
        factory=ParallelConfig,
        validator=lambda _i, a, v: _settings(a, v, ParallelConfig),
    )
    max_model_len: int | None = attrs.field(default=None, validator=_OPTIONAL_TOKENS)
    max_num_batched_tokens: int = attrs.field(default=8192, validator=_TOKENS)
    kv_transfer_enabled: bool = attrs.field(default=False, validator=is_bool)

    def resolved_target_context(self) -> int:
        """The context ``min_waste`` plans for."""
        return (
            self.cache_config.target_context
            or self.max_model_len
            or DEFAULT_TARGET_CONTEXT
        )
