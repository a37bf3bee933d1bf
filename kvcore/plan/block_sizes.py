"""Block sizes: each group's block in tokens, and the plan's scheduler and
hash block sizes."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence

from kvcore.config import EngineConfig
from kvcore.errors import BlockSizeError, PlanError
from kvcore.spec import UniformTypeKVCacheSpecs
from kvcore.structs import KVCacheConfig, KVCacheGroupSpec

__all__ = [
    "effective_block_size",
    "generate_scheduler_kv_cache_config",
    "resolve_block_sizes",
    "resolve_kv_cache_block_sizes",
    "serves_partial_hits",
]


def effective_block_size(group: KVCacheGroupSpec, dcp: int) -> int:
    """A group's block in tokens: its block size, times decode context
    parallelism when every layer scales with it."""
    specs = group.layer_specs()
    scale = dcp if all(s.scales_with_context_parallel for s in specs) else 1
    return group.kv_cache_spec.block_size * scale


def serves_partial_hits(
    group: KVCacheGroupSpec, block_size: int, hash_block_size: int, dcp: int
) -> bool:
    """Whether a group can serve a prefix hit that ends inside its block, so
    hits align to the hash block rather than the scheduler block."""
    wider = block_size > hash_block_size if dcp == 1 else block_size >= hash_block_size
    return wider and any(s.caches_partial_block_hits for s in group.layer_specs())


def resolve_kv_cache_block_sizes(
    kv_cache_config: KVCacheConfig, config: EngineConfig
) -> tuple[int, int]:
    """``(scheduler_block_size, hash_block_size)`` for a plan (see
    :func:`resolve_block_sizes`)."""
    return resolve_block_sizes(kv_cache_config.kv_cache_groups, config)


def resolve_block_sizes(
    groups: Sequence[KVCacheGroupSpec], config: EngineConfig
) -> tuple[int, int]:
    """``(scheduler_block_size, hash_block_size)`` for a grouping.

    The scheduler block is the lcm of the groups' block sizes.  Hashes are
    as fine as the gcd of the prefix-cacheable groups' block sizes (or
    ``prefix_match_unit``), unless a layer forbids sub-block hashing.  Every
    prefix-cache boundary must align with each cacheable layer's per-state
    compression.
    """
    cache = config.cache_config
    dcp = config.parallel_config.decode_context_parallel_size
    if not groups:
        size = cache.block_size * dcp
        return size, size
    if len(groups) == 1:
        # The group's own block, not the engine default: a single MLA group of
        # 64-token blocks schedules in 64s whatever ``cache.block_size`` says.
        size = effective_block_size(groups[0], dcp)
        return size, size
    effective = [effective_block_size(g, dcp) for g in groups]
    scheduler = math.lcm(*effective)
    if not (cache.enable_prefix_caching or config.kv_transfer_enabled):
        return scheduler, scheduler
    specs = [s for g in groups for s in g.layer_specs()]
    if not all(s.allows_sub_block_hashing for s in specs):
        return scheduler, scheduler
    cacheable = [
        e
        for e, g in zip(effective, groups, strict=True)
        if g.kv_cache_spec.prefix_cacheable
    ]
    hashing = cacheable or effective
    unit = cache.prefix_match_unit or math.gcd(*hashing)
    bad = sorted({h for h in hashing if h % unit})
    if bad:
        msg = (
            f"Invalid prefix_match_unit={unit}; prefix-cacheable KV cache group "
            f"block sizes must be divisible by prefix_match_unit (block sizes "
            f"{bad} are not); choose a divisor of {math.gcd(*hashing)}"
        )
        raise BlockSizeError(msg)
    alignments = sorted(
        {
            s.tokens_per_state
            for s in specs
            if s.prefix_cacheable and s.tokens_per_state > 1
        }
    )
    # Checked at the whole-block alignment: the hash boundaries a recurrent
    # state is restored at must not cut a compressed state (copy-on-write
    # hits land on multiples of tokens_per_state by construction).
    hits = _whole_block_alignment(groups, scheduler, unit, dcp)
    broken = [a for a in alignments if hits % a]
    if broken:
        msg = (
            f"Invalid prefix_match_unit={unit}; prefix-cache boundaries must align "
            f"with each spec's per-state compression. Got alignments={alignments}, "
            f"and hits land on multiples of {hits} tokens; use a "
            f"multiple of {math.lcm(*alignments)}"
        )
        raise BlockSizeError(msg)
    return scheduler, unit


def hit_alignment(
    groups: Sequence[KVCacheGroupSpec],
    scheduler_block_size: int,
    hash_block_size: int,
    dcp: int,
    *,
    partial_hits: bool = True,
    units: Mapping[int, int] | None = None,
) -> int:
    """Prefix hits are multiples of this many tokens.

    Without copy-on-write partial hits (``partial_hits=False``, or no group
    whose layers all :attr:`~kvcore.KVCacheSpec.copies_partial_block_hits`):
    the hash block when a cacheable group serves hits inside its block (see
    :func:`serves_partial_hits`), else the scheduler block.  With them, each
    cacheable group has a hit unit (:func:`group_hit_unit`, or ``units``:
    group index -> unit, for the groups that take copy-on-write hits) and
    hits are multiples of the lcm of the units (never coarser than without).
    """
    legacy = _whole_block_alignment(groups, scheduler_block_size, hash_block_size, dcp)
    if not partial_hits:
        return legacy
    found = []
    copying = False
    for gid, g in enumerate(groups):
        if not g.kv_cache_spec.prefix_cacheable:
            continue
        block = effective_block_size(g, dcp)
        unit = (
            group_hit_unit(g, block, hash_block_size)
            if units is None
            else units.get(gid)
        )
        copying = copying or unit is not None
        found.append(unit if unit is not None else math.lcm(block, hash_block_size))
    if not copying:
        return legacy
    return math.gcd(legacy, math.lcm(*found))


def group_hit_unit(
    group: KVCacheGroupSpec, block_size: int, hash_block_size: int
) -> int | None:
    """A group's copy-on-write hit unit: ``lcm(hash block, each layer's
    tokens_per_state)`` when every layer of the group
    :attr:`~kvcore.KVCacheSpec.copies_partial_block_hits` and that unit is
    finer than its ``block_size``; else None (its hits are whole blocks)."""
    specs = group.layer_specs()
    if not specs or not all(s.copies_partial_block_hits for s in specs):
        return None
    unit = math.lcm(hash_block_size, *(s.tokens_per_state for s in specs))
    if unit >= block_size or block_size % unit:
        return None
    return unit


def _whole_block_alignment(
    groups: Sequence[KVCacheGroupSpec],
    scheduler_block_size: int,
    hash_block_size: int,
    dcp: int,
) -> int:
    """The hit alignment without copy-on-write partial hits."""
    partial = any(
        g.kv_cache_spec.prefix_cacheable
        and serves_partial_hits(g, effective_block_size(g, dcp), hash_block_size, dcp)
        for g in groups
    )
    return hash_block_size if partial else scheduler_block_size


#: Plan settings every worker must share.
_AGREED = (
    "kv_cache_layout",
    "scheduler_block_size",
    "hash_block_size",
    "max_model_len",
    "enable_prefix_caching",
    "packing_policy",
    "target_context",
    "decode_context_parallel_size",
    "tensor_parallel_size",
    "pipeline_parallel_size",
)


def _check_agreed(
    plan: KVCacheConfig, first: KVCacheConfig, what: str, index: int
) -> None:
    """Raise :class:`PlanError` unless ``plan`` (``what`` ``index``, a worker
    or a stage) has the :data:`_AGREED` settings of ``first`` (``what`` 0)."""
    for name in _AGREED:
        if getattr(plan, name) != getattr(first, name):
            msg = (
                f"{what} {index} planned {name}={getattr(plan, name)!r} but {what} "
                f"0 planned {getattr(first, name)!r}; every {what} must plan with "
                "the same settings"
            )
            raise PlanError(msg)


def plan_hit_granularity(
    plan: KVCacheConfig, *, partial_hits: bool = True
) -> int | None:
    """Tokens a plan's prefix hits are multiples of (``None`` for a plan
    without resolved block sizes), with copy-on-write partial-block hits
    (``KVCacheManager``'s default, ``enable_partial_hits=True``) or without."""
    scheduler, hashing = plan.scheduler_block_size, plan.hash_block_size
    if scheduler is None or hashing is None:
        return None
    if not plan.enable_prefix_caching:
        return scheduler
    return hit_alignment(
        plan.kv_cache_groups,
        scheduler,
        hashing,
        plan.decode_context_parallel_size,
        partial_hits=partial_hits,
    )


def generate_scheduler_kv_cache_config(
    configs: Sequence[KVCacheConfig],
) -> KVCacheConfig:
    """The scheduler's view of the workers' configs.

    Every worker must have the same ``num_blocks``, settings and groups
    (pipeline stages plan their own layers and are combined elsewhere).  Each group's spec
    becomes the spec its manager runs on (the kind's merge of the group's
    members): the scheduler needs one per group, not the per-layer pages.
    """
    if not configs:
        msg = "generate_scheduler_kv_cache_config needs at least one worker config"
        raise PlanError(msg)
    counts = [c.num_blocks for c in configs]
    if len(set(counts)) != 1:
        msg = (
            f"workers planned different block counts {counts}; every worker must "
            "have the same num_blocks (give them equal memory, or set "
            "num_gpu_blocks_override to the smallest)"
        )
        raise PlanError(msg)
    first = configs[0]
    for i, other in enumerate(configs[1:], start=1):
        _check_agreed(other, first, "worker", i)
        if [g.layer_names for g in other.kv_cache_groups] != [
            g.layer_names for g in first.kv_cache_groups
        ]:
            msg = (
                f"worker {i} grouped its layers differently from worker 0; every "
                "worker must plan the same groups"
            )
            raise PlanError(msg)
    scheduler = copy.deepcopy(first)
    for group in scheduler.kv_cache_groups:
        if isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs):
            group.kv_cache_spec = group.manager_spec
    return scheduler


__all__ += ["group_hit_unit", "hit_alignment", "plan_hit_granularity"]
