"""kvcore: plans and manages the KV cache of hybrid LLMs.

The core holds the planner, the pool and the block coordinator; every cache
kind is a plugin.  Start with :func:`default_registry` (or build a registry
from :func:`get_plugin_manager`), plan with :func:`get_kv_cache_groups` and
:func:`get_kv_cache_config_from_groups` (or :func:`plan_kv_cache` in one
call), ask :func:`plan_capacity` how many requests fit, and bind views with
:class:`KVCachePool`.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from kvcore import moved

moved.install()

if TYPE_CHECKING:
    from kvcore.checkpoints import CHECKPOINT_POLICIES, CheckpointPolicy
    from kvcore.config import CacheConfig, EngineConfig, ParallelConfig
    from kvcore.errors import (
        BlockSizeError,
        DuplicateKindError,
        InvalidRequestError,
        InvalidRequestTypeError,
        InvalidSpecError,
        KvcoreError,
        KvcoreKeyError,
        KvcoreTypeError,
        KvcoreValueError,
        LayoutError,
        MergeError,
        NoFreeBlocksError,
        PlanError,
        PluginError,
        ReentrantCallError,
        SerializationError,
        UnknownKindError,
        UnknownRequestError,
        UnsafePlanError,
    )
    from kvcore.hookspecs import hookimpl, hookspec
    from kvcore.kinds import AttentionKind, CacheKind, LayerView
    from kvcore.layout import KVCacheLayout, compute_layout_strides
    from kvcore.length_mix import LengthMix
    from kvcore.plan import (
        approximate_gcd,
        build_kv_cache_tensors,
        generate_scheduler_kv_cache_config,
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
        get_packed_kv_cache_groups,
        kv_cache_bytes_per_block,
        plan_kv_cache,
        resolve_kv_cache_block_sizes,
        validate_kv_cache_layout,
    )
    from kvcore.plan.capacity import (
        Capacity,
        MixCapacity,
        ideal_concurrency,
        mix_capacity,
        plan_capacity,
    )
    from kvcore.plugins import get_plugin_manager
    from kvcore.pool import KVCachePool, allocate_kv_cache
    from kvcore.registry import KindRegistry, default_registry
    from kvcore.serving import ServingChoices, apply_serving_choices, parse_cache_dtype
    from kvcore.spec import (
        AttentionSpec,
        HitPolicy,
        KVCacheSpec,
        PackingRole,
        UniformTypeKVCacheSpecs,
        iter_layer_specs,
    )
    from kvcore.structs import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

__all__ = [
    # plugins
    "CacheKind",
    "AttentionKind",
    "KindRegistry",
    "LayerView",
    "default_registry",
    "get_plugin_manager",
    "hookimpl",
    "hookspec",
    # specs and plan
    "AttentionSpec",
    "CHECKPOINT_POLICIES",
    "CheckpointPolicy",
    "HitPolicy",
    "KVCacheSpec",
    "PackingRole",
    "UniformTypeKVCacheSpecs",
    "iter_layer_specs",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheTensor",
    "KVCacheLayout",
    "compute_layout_strides",
    # settings
    "CacheConfig",
    "EngineConfig",
    "ParallelConfig",
    "ServingChoices",
    "apply_serving_choices",
    "parse_cache_dtype",
    # packer and pool
    "approximate_gcd",
    "build_kv_cache_tensors",
    "generate_scheduler_kv_cache_config",
    "get_kv_cache_config_from_groups",
    "get_kv_cache_groups",
    "get_packed_kv_cache_groups",
    "kv_cache_bytes_per_block",
    "plan_kv_cache",
    "resolve_kv_cache_block_sizes",
    "Capacity",
    "plan_capacity",
    "ideal_concurrency",
    "LengthMix",
    "MixCapacity",
    "mix_capacity",
    "validate_kv_cache_layout",
    "KVCachePool",
    "allocate_kv_cache",
    # errors
    "BlockSizeError",
    "DuplicateKindError",
    "InvalidRequestError",
    "InvalidRequestTypeError",
    "InvalidSpecError",
    "KvcoreError",
    "KvcoreKeyError",
    "KvcoreTypeError",
    "KvcoreValueError",
    "LayoutError",
    "MergeError",
    "NoFreeBlocksError",
    "PlanError",
    "PluginError",
    "ReentrantCallError",
    "SerializationError",
    "UnknownKindError",
    "UnknownRequestError",
    "UnsafePlanError",
]


#: Where each public name lives: ``import kvcore`` imports none of them (nor
#: torch), so ``kvcore --help`` starts fast; the first use of a name imports
#: its module (PEP 562).
_LAZY: dict[str, str] = {
    name: f"kvcore.{module}"
    for module, names in {
        "checkpoints": "CHECKPOINT_POLICIES CheckpointPolicy",
        "config": "CacheConfig EngineConfig ParallelConfig",
        "errors": (
            "BlockSizeError DuplicateKindError InvalidRequestError "
            "InvalidRequestTypeError InvalidSpecError KvcoreError KvcoreKeyError "
            "KvcoreTypeError KvcoreValueError LayoutError MergeError "
            "NoFreeBlocksError PlanError PluginError ReentrantCallError "
            "SerializationError UnknownKindError UnknownRequestError UnsafePlanError"
        ),
        "hookspecs": "hookimpl hookspec",
        "kinds": "AttentionKind CacheKind LayerView",
        "layout": "KVCacheLayout compute_layout_strides",
        "plan": (
            "approximate_gcd build_kv_cache_tensors "
            "generate_scheduler_kv_cache_config get_kv_cache_config_from_groups "
            "get_kv_cache_groups get_packed_kv_cache_groups kv_cache_bytes_per_block "
            "plan_kv_cache resolve_kv_cache_block_sizes validate_kv_cache_layout"
        ),
        "length_mix": "LengthMix",
        "plan.capacity": (
            "Capacity MixCapacity ideal_concurrency mix_capacity plan_capacity"
        ),
        "plugins": "get_plugin_manager",
        "pool": "KVCachePool allocate_kv_cache",
        "registry": "KindRegistry default_registry",
        "serving": "ServingChoices apply_serving_choices parse_cache_dtype",
        "spec": (
            "AttentionSpec HitPolicy KVCacheSpec PackingRole UniformTypeKVCacheSpecs "
            "iter_layer_specs"
        ),
        "structs": "KVCacheConfig KVCacheGroupSpec KVCacheTensor",
    }.items()
    for name in names.split()
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        # ``kvcore.plugins``, ``kvcore.coordinator``: a submodule, imported on
        # first use as an eager package would have imported it already.
        if not name.startswith("_") and importlib.util.find_spec(f"kvcore.{name}"):
            return importlib.import_module(f"kvcore.{name}")
        msg = f"module 'kvcore' has no attribute {name!r}"
        raise AttributeError(msg)
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
