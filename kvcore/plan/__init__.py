"""The planner: specs -> groups -> a sized, placed plan.

- :mod:`~kvcore.plan.buckets`: which layers may share a group, and splits.
- :mod:`~kvcore.plan.policies`: how buckets become groups (``seed``,
  ``min_waste``).
- :mod:`~kvcore.plan.grouping`: the entry point that picks a policy.
- :mod:`~kvcore.plan.placement`: bytes per block, layout checks, strides.
- :mod:`~kvcore.plan.block_sizes`: scheduler and hash block sizes.
- :mod:`~kvcore.plan.plan`: the sized plan that carries its settings.
- :mod:`~kvcore.plan.capacity`: how many requests a plan holds.
"""

from __future__ import annotations

from kvcore.plan.block_sizes import (
    effective_block_size,
    generate_scheduler_kv_cache_config,
    hit_alignment,
    resolve_kv_cache_block_sizes,
    serves_partial_hits,
)
from kvcore.plan.buckets import approximate_gcd
from kvcore.plan.capacity import (
    Capacity,
    MixCapacity,
    ideal_concurrency,
    mix_capacity,
    plan_capacity,
)
from kvcore.plan.grouping import get_kv_cache_groups
from kvcore.plan.placement import (
    build_kv_cache_tensors,
    kv_cache_bytes_per_block,
    tensor_strides,
    validate_kv_cache_layout,
)
from kvcore.plan.plan import get_kv_cache_config_from_groups, plan_kv_cache
from kvcore.plan.policies.seed import packed_groups as get_packed_kv_cache_groups
from kvcore.plan.policies.seed import uniform_page_groups

__all__ = [
    "Capacity",
    "MixCapacity",
    "approximate_gcd",
    "build_kv_cache_tensors",
    "plan_capacity",
    "effective_block_size",
    "generate_scheduler_kv_cache_config",
    "get_kv_cache_config_from_groups",
    "get_kv_cache_groups",
    "get_packed_kv_cache_groups",
    "hit_alignment",
    "ideal_concurrency",
    "kv_cache_bytes_per_block",
    "mix_capacity",
    "plan_kv_cache",
    "resolve_kv_cache_block_sizes",
    "serves_partial_hits",
    "tensor_strides",
    "uniform_page_groups",
    "validate_kv_cache_layout",
]
