"""The plan: sized, placed and carrying every setting its users need.

``get_kv_cache_config_from_groups`` turns groups into a
:class:`~kvcore.structs.KVCacheConfig`: the block stride, ``num_blocks``,
every layer's tensor and strides, the resolved scheduler and hash block
sizes, ``max_model_len``, prefix caching, the policy and its target.
``plan_kv_cache`` does every step and refuses a plan that cannot run, with
the numbers and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvcore.config import CacheConfig, EngineConfig
from kvcore.errors import PlanError, require_instance
from kvcore.limits import MAX_NUM_BLOCKS
from kvcore.plan.block_sizes import resolve_block_sizes
from kvcore.plan.capacity import min_blocks_for_one_request
from kvcore.plan.declarations import check_spec_answers
from kvcore.plan.grouping import get_kv_cache_groups
from kvcore.plan.placement import (
    build_kv_cache_tensors,
    kv_cache_bytes_per_block,
    validate_kv_cache_layout,
)
from kvcore.registry import KindRegistry
from kvcore.spec import KVCacheSpec, iter_layer_specs
from kvcore.structs import KVCacheConfig, KVCacheGroupSpec

__all__ = ["get_kv_cache_config_from_groups", "plan_kv_cache"]


def get_kv_cache_config_from_groups(
    config: EngineConfig,
    groups: Sequence[KVCacheGroupSpec],
    available_memory: int,
) -> KVCacheConfig:
    """Size the pool for ``available_memory`` bytes and place every layer.

    ``num_blocks = available_memory // bytes_per_block`` (or the override);
    block 0 later becomes the coordinator's null block.
    """
    require_instance(config, EngineConfig, "get_kv_cache_config_from_groups: config")
    groups = list(groups)
    if isinstance(available_memory, bool) or not isinstance(available_memory, int):
        msg = (
            f"available_memory must be an int number of bytes, got {available_memory!r}"
        )
        raise PlanError(msg)
    cache = config.cache_config
    settings = {
        "max_model_len": config.max_model_len,
        "enable_prefix_caching": cache.enable_prefix_caching,
        "packing_policy": cache.packing_policy,
        "target_context": config.resolved_target_context(),
        "decode_context_parallel_size": config.parallel_config.decode_context_parallel_size,
        "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "pipeline_parallel_size": config.parallel_config.pipeline_parallel_size,
        "available_memory": available_memory,
    }
    scheduler_block_size, hash_block_size = resolve_block_sizes(groups, config)
    if not groups:
        return KVCacheConfig(
            num_blocks=1,
            kv_cache_tensors=[],
            kv_cache_groups=[],
            scheduler_block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
            **settings,  # type: ignore[arg-type]
        )
    check_spec_answers(s for g in groups for s in iter_layer_specs(g.kv_cache_spec))
    layout = cache.resolved_layout()
    validate_kv_cache_layout(layout, groups)
    bytes_per_block = kv_cache_bytes_per_block(groups, layout)
    num_blocks = available_memory // bytes_per_block
    if cache.num_gpu_blocks_override is not None:
        num_blocks = cache.num_gpu_blocks_override
    if num_blocks < 2:
        msg = (
            f"{available_memory} bytes hold {num_blocks} block(s) of "
            f"{bytes_per_block} bytes; the pool needs at least 2 (one is the null "
            "block). Give the cache more memory or set num_gpu_blocks_override"
        )
        raise PlanError(msg)
    _check_block_limit(num_blocks, bytes_per_block, available_memory, cache)
    size = bytes_per_block * num_blocks
    tensors = build_kv_cache_tensors(
        groups,
        num_blocks=num_blocks,
        size=size,
        layout=layout,
        bytes_per_block=bytes_per_block,
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=groups,
        kv_cache_layout=layout,
        bytes_per_block=bytes_per_block,
        scheduler_block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        **settings,  # type: ignore[arg-type]
    )


def _check_block_limit(
    num_blocks: int, bytes_per_block: int, available_memory: int, cache: CacheConfig
) -> None:
    """A pool of more than :data:`~kvcore.limits.MAX_NUM_BLOCKS` blocks is a
    page size or memory figure off by orders of magnitude; the coordinator
    would build per-block state for every one before it failed."""
    if num_blocks <= MAX_NUM_BLOCKS:
        return
    if cache.num_gpu_blocks_override is not None:
        source = f"num_gpu_blocks_override={num_blocks:,}"
        fix = f"set num_gpu_blocks_override to at most {MAX_NUM_BLOCKS:,}"
    else:
        source = (
            f"{available_memory:,} bytes of memory in blocks of {bytes_per_block:,} "
            "bytes"
        )
        fix = (
            f"use larger blocks (--block-size; blocks of at least "
            f"{-(-available_memory // MAX_NUM_BLOCKS):,} bytes), set "
            f"num_gpu_blocks_override to at most {MAX_NUM_BLOCKS:,}, or give the "
            "cache less memory"
        )
    msg = (
        f"{source} make {num_blocks:,} blocks, more than kvcore's limit of "
        f"{MAX_NUM_BLOCKS:,} (MAX_NUM_BLOCKS): {fix}"
    )
    raise PlanError(msg)


def _check_fits_one_request(
    config: EngineConfig,
    groups: Sequence[KVCacheGroupSpec],
    num_blocks: int,
    bytes_per_block: int,
) -> None:
    """A pool that cannot hold one request of ``max_model_len`` tokens would
    refuse every long request at run time: refuse the plan instead."""
    if config.max_model_len is None:
        return
    need = min_blocks_for_one_request(
        groups,
        config.max_model_len,
        config.max_num_batched_tokens,
        dcp=config.parallel_config.decode_context_parallel_size,
    )
    if num_blocks < need:
        msg = (
            f"the pool holds {num_blocks} blocks of {bytes_per_block} bytes, but one "
            f"request of max_model_len={config.max_model_len} tokens needs {need} "
            f"(with its prefill step and the null block): "
            + (
                f"set num_gpu_blocks_override to at least {need}"
                if config.cache_config.num_gpu_blocks_override is not None
                else f"give the cache at least {need * bytes_per_block} bytes "
                f"({need * bytes_per_block / 2**30:.2f} GiB)"
            )
            + ", or lower max_model_len"
        )
        raise PlanError(msg)


def plan_kv_cache(
    config: EngineConfig,
    specs: Mapping[str, KVCacheSpec],
    available_memory: int,
    *,
    registry: KindRegistry | None = None,
) -> KVCacheConfig:
    """Group, size and place in one call: specs in, a plan out.

    Unlike the step-by-step functions this is what an engine runs, so it
    also refuses a pool that cannot hold one request of ``max_model_len``.
    """
    require_instance(config, EngineConfig, "plan_kv_cache: config")
    groups = get_kv_cache_groups(config, specs, registry=registry)
    plan = get_kv_cache_config_from_groups(config, groups, available_memory)
    if groups:
        _check_fits_one_request(config, groups, plan.num_blocks, plan.bytes_per_block)
    return plan
