"""kvcore's planner behind vLLM 0.33's ``KVCacheConfigBuilder`` hook.

vLLM's engine core plans the KV cache in ``get_kv_cache_configs``: it asks
the platform's builder (``get_kv_cache_config_builder``) to group the
workers' layers and then to place the groups for a block count; its workers
ask the same builder for the small cache they profile with.
:class:`KvcoreKVCacheConfigBuilder` answers both with kvcore: the layers'
vLLM specs become kvcore's, kvcore's packing policy groups them and kvcore's
placement lays them out, and the result goes back as vLLM's own types
(:mod:`kvcore.integrations.vllm.config`).  vLLM keeps its own flow: memory
profiling, ``num_gpu_blocks_override``, the null block, auto-fit, the
capacity check and the cross-rank block count.

:func:`install_builder` (called by :func:`kvcore.integrations.vllm.install`,
so only with ``KVCORE_VLLM=1``) points vLLM's builder lookup at it.
``KVCORE_VLLM_PACKING`` names the policy (``min_waste``, the default, or
``seed``); ``vllm`` keeps vLLM's own planner.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.core import kv_cache_config_builder as vllm_builder
from vllm.v1.core.kv_cache_planning import DefaultKVCacheConfigBuilder

from kvcore.config import PACKING_POLICIES, CacheConfig, EngineConfig, ParallelConfig
from kvcore.errors import PlanError
from kvcore.integrations.vllm.config import (
    PlanNotExpressibleError,
    to_vllm_groups,
    to_vllm_kv_cache_config,
)
from kvcore.integrations.vllm.specs import to_kvcore_spec
from kvcore.layout import KVCacheLayout
from kvcore.plan import (
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
    kv_cache_bytes_per_block,
)
from kvcore.plan.groups import group_spec
from kvcore.spec import KVCacheSpec, UniformTypeKVCacheSpecs
from kvcore.structs import KVCacheGroupSpec

__all__ = [
    "PACKING_SWITCH",
    "KvcoreKVCacheConfigBuilder",
    "fixed_kernel_blocks",
    "install_builder",
    "packing_policy",
]

#: The environment variable naming kvcore's packing policy for vLLM.
PACKING_SWITCH = "KVCORE_VLLM_PACKING"
#: Its default.
DEFAULT_PACKING = "min_waste"


def packing_policy() -> str | None:
    """The kvcore policy vLLM's layers are grouped by, or ``None`` when
    ``KVCORE_VLLM_PACKING=vllm`` keeps vLLM's own planner."""
    value = os.environ.get(PACKING_SWITCH, "") or DEFAULT_PACKING
    if value == "vllm":
        return None
    if value not in PACKING_POLICIES:
        msg = (
            f"{PACKING_SWITCH}={value!r} names no packing policy; use one of "
            f"{', '.join(sorted(PACKING_POLICIES))}, or 'vllm' for vLLM's own planner"
        )
        raise PlanError(msg)
    return value


def engine_config(
    vllm_config: Any,
    policy: str,
    *,
    num_blocks: int | None = None,
    max_block_growth: int | None = None,
) -> EngineConfig:
    """The kvcore settings of a vLLM engine: its resolved layout, lengths,
    prefix caching and parallelism, and ``policy``."""
    growth = (
        max_block_growth
        if max_block_growth is not None
        else CacheConfig().max_block_growth
    )
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    layout = KVCacheLayout.from_name(cache.get_resolved_kv_cache_layout().name)
    return EngineConfig(
        cache_config=CacheConfig(
            kv_cache_layout=layout,
            num_gpu_blocks_override=num_blocks,
            enable_prefix_caching=bool(cache.enable_prefix_caching),
            prefix_match_unit=cache.prefix_match_unit,
            packing_policy=policy,
            max_block_growth=growth,
        ),
        parallel_config=ParallelConfig(
            tensor_parallel_size=parallel.tensor_parallel_size,
            pipeline_parallel_size=parallel.pipeline_parallel_size,
            decode_context_parallel_size=parallel.decode_context_parallel_size,
        ),
        max_model_len=vllm_config.model_config.max_model_len,
        max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
    )


def kvcore_layer_spec(spec: Any, layer: str) -> KVCacheSpec:
    """One vLLM layer spec as kvcore's, with the placement facts the
    scheduler's conversion leaves out: a padded page, a compression ratio
    and the block stride alignment vLLM's backend asked for."""
    out = to_kvcore_spec(spec)
    fields = attrs.fields_dict(type(out))
    changes: dict[str, Any] = {}
    padded = getattr(spec, "page_size_padded", None)
    if padded is not None and "page_size_padded" in fields:
        changes["page_size_padded"] = padded
    ratio = getattr(spec, "tokens_per_state", 1)
    if "tokens_per_state" in fields and isinstance(ratio, int) and ratio > 1:
        changes["tokens_per_state"] = ratio
    alignment = spec.get_block_stride_alignment()
    if alignment > 1:
        changes["block_stride_alignment"] = alignment
    return attrs.evolve(out, **changes) if changes else out


def fixed_kernel_blocks(specs: Mapping[str, Any]) -> list[str]:
    """Layers whose attention backend takes only kernel blocks of fixed
    sizes: vLLM marks their spec with a ``MultipleOf`` block stride
    alignment (``customize_attention_spec``)."""
    return [
        name
        for name, spec in specs.items()
        if isinstance(getattr(spec, "block_stride_alignment", None), MultipleOf)
    ]


def _layer_specs(groups: Sequence[Any]) -> dict[str, Any]:
    """vLLM's spec of every layer of vLLM's groups."""
    out: dict[str, Any] = {}
    for group in groups:
        members = getattr(group.kv_cache_spec, "kv_cache_specs", None)
        for name in group.layer_names:
            out[name] = members[name] if members is not None else group.kv_cache_spec
    return out


def _kvcore_groups(groups: Sequence[Any]) -> list[KVCacheGroupSpec]:
    """vLLM's groups (kvcore's, handed back, perhaps cut to one pipeline
    stage's layers) as kvcore groups, layer order kept."""
    specs = _layer_specs(groups)
    out = []
    for group in groups:
        members = {n: kvcore_layer_spec(specs[n], n) for n in group.layer_names}
        wrapped = getattr(group.kv_cache_spec, "kv_cache_specs", None) is not None
        spec = (
            UniformTypeKVCacheSpecs.from_specs(members)
            if wrapped
            else group_spec(members)
        )
        if spec is None:
            first = group.layer_names[0]
            msg = (
                f"kvcore.integrations.vllm: the cache group of layer {first!r} "
                "holds layers kvcore cannot manage in one group (no shared "
                "grouping key); group them with kvcore's planner "
                f"({PACKING_SWITCH}=min_waste or seed)"
            )
            raise PlanNotExpressibleError(msg)
        out.append(KVCacheGroupSpec(list(group.layer_names), spec))
    return out


def _refuse_hisparse(vllm_config: Any) -> None:
    if vllm_config.attention_config.hisparse_config is not None:
        msg = (
            "kvcore.integrations.vllm: HiSparse keeps host pages in a pool "
            "kvcore does not plan for vLLM; set "
            f"{PACKING_SWITCH}=vllm to plan this model with vLLM's own planner"
        )
        raise PlanNotExpressibleError(msg)


class KvcoreKVCacheConfigBuilder(DefaultKVCacheConfigBuilder):  # type: ignore[misc]
    """vLLM's builder interface, answered by kvcore's planner."""

    def get_kv_cache_groups(
        self, vllm_config: Any, kv_cache_spec: dict[str, Any]
    ) -> list[Any]:
        policy = packing_policy()
        if (
            policy is None
            or not kv_cache_spec
            or vllm_config.model_config.supports_kv_cache_grouping
        ):
            # The model owns its grouping (vLLM's SupportsKVCacheGrouping);
            # kvcore still places it.
            return super().get_kv_cache_groups(vllm_config, kv_cache_spec)  # type: ignore[no-any-return]
        _refuse_hisparse(vllm_config)
        specs = {n: kvcore_layer_spec(s, n) for n, s in kv_cache_spec.items()}
        # vLLM never splits a block of a block-outermost layout into kernel
        # blocks, so a backend of fixed kernel block sizes must get its
        # model's block size: kvcore grows no block then.
        growth = 1 if fixed_kernel_blocks(kv_cache_spec) else None
        config = engine_config(vllm_config, policy, max_block_growth=growth)
        groups = get_kv_cache_groups(config, specs)
        return to_vllm_groups(groups, vllm_specs=kv_cache_spec)

    def get_kv_cache_config_from_groups(
        self, vllm_config: Any, kv_cache_groups: list[Any], num_blocks: int
    ) -> Any:
        policy = packing_policy()
        if policy is None or not kv_cache_groups:
            return super().get_kv_cache_config_from_groups(
                vllm_config, kv_cache_groups, num_blocks
            )
        _refuse_hisparse(vllm_config)
        config = engine_config(vllm_config, policy, num_blocks=num_blocks)
        plan = get_kv_cache_config_from_groups(
            config, _kvcore_groups(kv_cache_groups), 0
        )
        out = to_vllm_kv_cache_config(plan, vllm_specs=_layer_specs(kv_cache_groups))
        for mine, theirs in zip(out.kv_cache_groups, kv_cache_groups, strict=True):
            mine.is_eagle_group = theirs.is_eagle_group
            mine.host_resident = theirs.host_resident
            mine.enable_kv_transfer = theirs.enable_kv_transfer
            mine.role = theirs.role
        out.prefix_cache_retention_interval = (
            vllm_config.cache_config.prefix_cache_retention_interval
        )
        return out

    def _get_pool_bytes_per_block(
        self, vllm_config: Any, kv_cache_groups: list[Any]
    ) -> int | None:
        # kvcore's block, without a one-block probe (kvcore plans two
        # blocks at least: one is the null block).
        policy = packing_policy()
        if policy is None or not kv_cache_groups:
            return super()._get_pool_bytes_per_block(vllm_config, kv_cache_groups)  # type: ignore[no-any-return]
        layout = engine_config(vllm_config, policy).cache_config.resolved_layout()
        return kv_cache_bytes_per_block(_kvcore_groups(kv_cache_groups), layout)


def _builder(vllm_config: Any) -> KvcoreKVCacheConfigBuilder:
    return KvcoreKVCacheConfigBuilder()


def install_builder() -> None:
    """Point vLLM's builder lookup (``get_kv_cache_config_builder``, which
    its engine core and workers call) at :class:`KvcoreKVCacheConfigBuilder`."""
    vllm_builder.get_kv_cache_config_builder = _builder
