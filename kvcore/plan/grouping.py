"""Grouping: the model's layers into cache groups, through a policy."""

from __future__ import annotations

from collections.abc import Mapping

from kvcore.config import EngineConfig
from kvcore.errors import KvcoreTypeError, PlanError, require_instance
from kvcore.plan.declarations import (
    check_spec_answers,
    checked_state_cache_mode,
    resolved_defaults,
)
from kvcore.plan.groups import check_chosen, group_spec
from kvcore.plan.policies import POLICIES
from kvcore.registry import KindRegistry, default_registry
from kvcore.spec import KVCacheSpec
from kvcore.structs import KVCacheGroupSpec

__all__ = ["get_kv_cache_groups"]


def get_kv_cache_groups(
    config: EngineConfig,
    specs: Mapping[str, KVCacheSpec],
    *,
    registry: KindRegistry | None = None,
) -> list[KVCacheGroupSpec]:
    """Group the model's layers into cache groups.

    In order: a plugin's ``kvcore_choose_grouping``; one group if every spec
    merges into one, or if every layer shares a grouping key; otherwise the
    configured packing policy (``CacheConfig.packing_policy``).

    :param specs: layer name to spec, in model order.
    """
    require_instance(config, EngineConfig, "get_kv_cache_groups: config")
    registry = registry if registry is not None else default_registry()
    raw: object = specs
    if not isinstance(raw, Mapping):
        msg = (
            f"get_kv_cache_groups takes a mapping of layer name to spec, got "
            f"{type(raw).__name__}"
        )
        raise KvcoreTypeError(msg)
    for name, spec in specs.items():
        registry.kind_for(spec, layer=name)
    cache = config.cache_config
    specs = resolved_defaults(
        specs,
        prefix_caching=cache.enable_prefix_caching,
        state_cache_mode=cache.mamba_cache_mode,
    )
    check_spec_answers(specs.values())
    _check_engine_modes(config, specs)
    _check_target_lengths(config)
    if not specs:
        return []
    chosen = registry.choose_grouping(config, specs)
    if chosen is not None:
        check_chosen(chosen, specs)
        return chosen
    whole = group_spec(dict(specs))
    if whole is not None:
        return [KVCacheGroupSpec(list(specs), whole)]
    return POLICIES[config.cache_config.packing_policy](config, specs)


def _check_target_lengths(config: EngineConfig) -> None:
    """A mix of lengths to plan for holds no request the engine refuses."""
    mix = config.cache_config.target_lengths
    limit = config.max_model_len
    if mix is not None and limit is not None and mix.longest > limit:
        msg = (
            f"CacheConfig.target_lengths holds requests of {mix.longest:,} tokens, "
            f"past max_model_len={limit:,}; the engine refuses them: drop those "
            "lengths or raise max_model_len"
        )
        raise PlanError(msg)


def _check_engine_modes(config: EngineConfig, specs: Mapping[str, KVCacheSpec]) -> None:
    """Specs built for another recurrent-state caching mode than the engine
    runs would cache (or not) behind the scheduler's back."""
    mode = config.cache_config.mamba_cache_mode
    if mode is None:
        return
    for name, spec in specs.items():
        own = checked_state_cache_mode(spec)
        if own is not None and own != mode:
            msg = (
                f"layer {name!r} ({spec.kind}) caches its states in mode {own!r} but "
                f"the engine runs mamba_cache_mode={mode!r}; build its spec with "
                f"mode {mode!r} or leave CacheConfig.mamba_cache_mode unset"
            )
            raise PlanError(msg)
