"""Building a coordinator's parts from a plan: one checked manager per cache
group, the groups a prefix lookup searches together, what each group's
events say about it.

Each step reads the plan's groups and the registry and returns plain
values; :class:`~kvcore.coordinator.coordinator.KVCacheCoordinator` wires
them together.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs

from kvcore.coordinator.block_pool import BlockPool
from kvcore.coordinator.declared import check_built, check_manager, declared_policy
from kvcore.coordinator.manager import SingleTypeManager
from kvcore.coordinator.managers import CheckpointManager
from kvcore.coordinator.partial import copy_hit_units
from kvcore.coordinator.twins import own_code, twin_key
from kvcore.errors import BlockSizeError
from kvcore.plan import effective_block_size, hit_alignment
from kvcore.plan.declarations import checked_event_window
from kvcore.registry import KindRegistry
from kvcore.spec import HitPolicy
from kvcore.structs import KVCacheGroupSpec

__all__ = [
    "BuiltManagers",
    "ManagerSettings",
    "SpecGroup",
    "build_managers",
    "check_hash_block",
    "checkpoint_twins",
    "event_groups",
    "hit_units",
    "search_groups",
    "share_evidence",
]


@attrs.define
class SpecGroup:
    """Prefix-cacheable groups with one spec, searched together."""

    spec: Any
    group_ids: list[int]
    manager_type: type[SingleTypeManager]
    block_size: int
    #: A hit under a bound stays a hit under any smaller aligned bound (a
    #: left-to-right search), so the fixed point trims instead of searching.
    monotone: bool = False
    #: Recurrent-state groups (``HitPolicy.CHECKPOINT``), searched last.
    states: bool = False
    #: The copy-on-write hit unit in tokens when these groups serve hits
    #: that end inside a block (see :mod:`kvcore.coordinator.partial`), else 0.
    partial_unit: int = 0
    #: Whether their manager class's hits are checked as they enter the
    #: core: its search or its keys are a kind's own code, not the core
    #: classes' (which read only the cache tables at each position's key).
    checks_hits: bool = True


@attrs.frozen
class ManagerSettings:
    """The coordinator's settings every group's manager is built with."""

    hash_block_size: int
    scheduler_block_size: int
    enable_caching: bool
    max_model_len: int
    dcp: int
    use_eagle: bool
    #: Hits are multiples of this many tokens.
    hit_alignment: int


@attrs.frozen
class BuiltManagers:
    """One manager per group, with the plugin that owns each group's kind
    and the hit policy its spec declares."""

    managers: tuple[SingleTypeManager, ...]
    owners: tuple[str, ...]
    policies: tuple[HitPolicy, ...]
    #: Each manager's checked ``boundary_overlap``.
    overlaps: tuple[int, ...]


def check_hash_block(hash_block_size: int, scheduler_block_size: int) -> None:
    """The hash block divides the scheduler block."""
    if scheduler_block_size % hash_block_size:
        msg = (
            f"hash_block_size={hash_block_size} must divide "
            f"scheduler_block_size={scheduler_block_size}; resolve both with "
            "kvcore.resolve_kv_cache_block_sizes"
        )
        raise BlockSizeError(msg)


def event_groups(
    groups: Sequence[KVCacheGroupSpec], hash_block_size: int, dcp: int
) -> list[tuple[int, str, int | None]]:
    """What each group's BlockStored events say about the group: its block
    size, kind and window.  A group finer than the hash block keys one
    block per hash chunk, so its events describe chunks (see
    CheckpointManager)."""
    return [
        (
            max(effective_block_size(g, dcp), hash_block_size),
            g.manager_spec.kind,
            checked_event_window(g.manager_spec),
        )
        for g in groups
    ]


def hit_units(
    groups: Sequence[KVCacheGroupSpec],
    registry: KindRegistry,
    block_sizes: tuple[int, int, int],
    *,
    enable_caching: bool,
    enable_partial_hits: bool,
) -> tuple[int, dict[int, int]]:
    """The hit alignment (hits are multiples of it, see hit_alignment) and
    the groups whose managers take copy-on-write hits inside their blocks,
    with their units; ``block_sizes``: the scheduler block, the hash block
    and the decode context parallelism."""
    scheduler_block_size, hash_block_size, dcp = block_sizes
    if not enable_caching:
        return scheduler_block_size, {}
    units = (
        copy_hit_units(groups, registry, hash_block_size, dcp)
        if enable_partial_hits
        else {}
    )
    alignment = hit_alignment(
        groups,
        scheduler_block_size,
        hash_block_size,
        dcp,
        partial_hits=bool(units),
        units=units,
    )
    # Hits end only on the alignment: a group keys (and copies) only there,
    # and one whose blocks the alignment never falls inside takes no partial
    # hit at all.
    return alignment, {
        gid: math.lcm(unit, alignment)
        for gid, unit in units.items()
        if math.lcm(unit, alignment) % effective_block_size(groups[gid], dcp)
    }


def build_managers(
    groups: Sequence[KVCacheGroupSpec],
    block_pool: BlockPool,
    registry: KindRegistry,
    settings: ManagerSettings,
) -> BuiltManagers:
    """Each group's manager, made by its kind's plugin and checked where it
    crosses into the core (its policy, its block size against the
    scheduler and hash blocks)."""
    managers: list[SingleTypeManager] = []
    owners: list[str] = []
    policies: list[HitPolicy] = []
    overlaps: list[int] = []
    for gid, group in enumerate(groups):
        layer_spec = group.manager_spec
        block_size = effective_block_size(group, settings.dcp)
        if settings.scheduler_block_size % block_size:
            msg = (
                f"cache group {gid} ({layer_spec.kind}, block {block_size}) does not "
                f"divide scheduler_block_size={settings.scheduler_block_size}; the "
                "scheduler block must be a multiple of every group's block size"
            )
            raise BlockSizeError(msg)
        kind = registry.kind_for(layer_spec, layer=group.layer_names[0])
        owner = registry.owner(kind.name)
        policy = declared_policy(layer_spec, kind.name, owner)
        given: dict[str, Any] = {
            "group_id": gid,
            "block_size": block_size,
            "hash_block_size": settings.hash_block_size,
        }
        manager = kind.make_manager(
            layer_spec,
            block_pool,
            **given,
            enable_caching=settings.enable_caching,
            max_model_len=settings.max_model_len,
            # With EAGLE a hit may end on any block of the group; a state
            # serves only a hit that ends on it, and hits end on the hit
            # alignment.
            hit_alignment=(
                block_size
                if settings.use_eagle and policy is not HitPolicy.CHECKPOINT
                else settings.hit_alignment
            ),
        )
        check_built(manager, {**given, "block_pool": block_pool}, kind.name, owner)
        overlaps.append(check_manager(manager, policy, kind.name, owner))
        manager.use_eagle = settings.use_eagle
        _check_hash_alignment(gid, manager, settings.hash_block_size)
        managers.append(manager)
        owners.append(owner)
        policies.append(policy)
    return BuiltManagers(
        tuple(managers), tuple(owners), tuple(policies), tuple(overlaps)
    )


def _check_hash_alignment(
    gid: int, manager: SingleTypeManager, hash_block_size: int
) -> None:
    """Only groups whose manager hashes its blocks must align with the hash
    block (a recurrent state that is never kept hashes nothing); a manager
    that keys only hash-boundary blocks accepts finer ones."""
    block_size = manager.block_size
    if (
        manager.caching
        and block_size % hash_block_size
        and not (manager.accepts_coarse_hashes and hash_block_size % block_size == 0)
    ):
        msg = (
            f"prefix-cacheable cache group {gid} ({manager.kv_cache_spec.kind}) has "
            f"block size {block_size}, not a multiple of "
            f"hash_block_size={hash_block_size}"
        )
        raise BlockSizeError(msg)


def search_groups(
    managers: Sequence[SingleTypeManager],
    policies: Sequence[HitPolicy],
    partial_units: dict[int, int],
) -> list[SpecGroup]:
    """Prefix-cacheable groups with equal specs, searched together, in
    search order: left-to-right searches first (they bound the others,
    and the length they reach is the prefix the request shares with
    earlier ones, see ``last_shared_prefix``), states last."""
    spec_groups: dict[Any, SpecGroup] = {}
    for gid, manager in enumerate(managers):
        if not manager.caching:
            continue
        key = (manager.kv_cache_spec, type(manager), manager.block_size)
        if key in spec_groups:
            spec_groups[key].group_ids.append(gid)
        else:
            spec_groups[key] = SpecGroup(
                manager.kv_cache_spec,
                [gid],
                type(manager),
                manager.block_size,
                monotone=policies[gid] is HitPolicy.PREFIX,
                states=policies[gid] is HitPolicy.CHECKPOINT,
                partial_unit=partial_units.get(gid, 0)
                if type(manager).partial_copy_hits is True
                else 0,
                checks_hits=own_code(
                    type(manager), "find_longest_cache_hit", "block_hash"
                ),
            )
    return sorted(spec_groups.values(), key=lambda g: (not g.monotone, g.states))


def checkpoint_twins(
    planning: Sequence[SingleTypeManager],
) -> tuple[list[CheckpointManager], ...]:
    """Classes of two or more twin state groups (see twin_key): they agree
    on one checkpoint path."""
    twins: dict[Any, list[CheckpointManager]] = {}
    for m in planning:
        if isinstance(m, CheckpointManager):
            twins.setdefault(twin_key(m), []).append(m)
    return tuple(c for c in twins.values() if len(c) > 1)


def share_evidence(twins: Sequence[CheckpointManager]) -> None:
    """Give a class of twin state groups one output-end evidence: twins see
    the same prompts and free the same output ends, so one tracker answers
    for all (one memory of keys, not one per group).  The first twin counts
    the prompts; each free is counted once, on the first twin's ask (see
    :meth:`OutputEnds.keep_output_end`)."""
    shared = twins[0].output_ends
    for twin in twins:
        twin.output_ends = shared
        twin._notes_prompts = twin is twins[0]
        twin._shares_evidence = True
