"""Twin groups: cache groups whose managers hold tables of one shape.

Groups of one manager class with equal merged specs, block sizes, caching
and hit alignment keep equal per-request state, so the coordinator steps a
running request once per run of consecutive twins (see
:meth:`SingleTypeManager.allocate_twins`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcore.coordinator.manager import SingleTypeManager
from kvcore.coordinator.managers import FixedBlocksManager, PrefixManager, WindowManager
from kvcore.coordinator.state_manager import CheckpointManager
from kvcore.coordinator.twin_steps import TWIN_STEPS
from kvcore.coordinator.undo import put_back

__all__ = [
    "CLASS_STEPS",
    "CORE_MANAGERS",
    "KIND_STEPS",
    "Runs",
    "defining",
    "kind_steps",
    "own_code",
    "record_whole",
    "twin_key",
    "twin_runs",
]

#: The core's manager classes, one per hit policy, that kinds' managers
#: subclass: the steps they define are the core's own.
CORE_MANAGERS = frozenset(
    (
        SingleTypeManager,
        PrefixManager,
        WindowManager,
        FixedBlocksManager,
        CheckpointManager,
    )
)


def twin_key(manager: SingleTypeManager) -> Any:
    """What twin groups share: one manager class, equal merged specs, block
    sizes, caching and hit alignment (a spec that cannot be hashed makes
    its group a class of its own)."""
    key = (
        type(manager),
        manager.kv_cache_spec,
        manager.block_size,
        manager.caching,
        manager.hit_alignment,
    )
    try:
        hash(key)
    except TypeError:
        return manager.kv_cache_group_id
    return key


#: Runs of consecutive twin groups, each with its class's first group id.
Runs = tuple[tuple[int, tuple[SingleTypeManager, ...]], ...]


def twin_runs(managers: Sequence[SingleTypeManager], flag: str | None = None) -> Runs:
    """The managers whose ``flag`` is set (all of them for None), in their
    order, cut into runs of consecutive twins (see twin_key), each with its
    class's first group."""
    firsts: dict[Any, int] = {}
    runs: list[tuple[int, list[SingleTypeManager]]] = []
    for manager in managers:
        if flag is not None and not getattr(manager, flag):
            continue
        first = firsts.setdefault(twin_key(manager), manager.kv_cache_group_id)
        if runs and runs[-1][0] == first:
            runs[-1][1].append(manager)
        else:
            runs.append((first, [manager]))
    return tuple((first, tuple(members)) for first, members in runs)


def own_code(cls: type, *steps: str) -> bool:
    """Whether manager class ``cls`` runs a kind's own code for one of
    ``steps``: the class in its method resolution order that defines the
    step (an override, or a twin step made from a one-group override) is
    not one of the core's manager classes (:data:`CORE_MANAGERS`)."""
    mro = cls.__mro__
    for step in steps:
        owner = next((k for k in mro if step in vars(k)), None)
        if owner is not None and owner not in CORE_MANAGERS:
            return True
    return False


def defining(runs: Runs, *steps: str) -> frozenset[int]:
    """The group ids of the classes of ``runs`` that run their own code for
    one of ``steps`` (see :func:`own_code`).  Those steps are a kind's own
    code: what they return is checked where it crosses into the core, and
    the tables they may change are recorded whole before they run; the
    core's own steps need neither.  Found once per plan, the same for a
    built-in kind's class as for a third party's.  The core calls these
    steps through the manager's class, as Python calls special methods:
    one set on a manager instance is never run."""
    return frozenset(
        m.kv_cache_group_id
        for _, members in runs
        if own_code(type(members[0]), *steps)
        for m in members
    )


#: The steps that change a request's tables, by their class (twin) name,
#: each with the hooks it runs, and the count a running step is weighed
#: by: where a kind's manager class defines one itself, the step's answers
#: are checked and the tables it may change are recorded whole before it
#: runs.
KIND_STEPS = {
    "allocate_twins": ("allocate_twins",),
    "release_twins": ("release_twins", "kept_twins", "kept_if_room_twins"),
    "cache_twins": ("cache_twins",),
    "pop_twins": ("pop_twins",),
    "add_computed_blocks": ("add_computed_blocks",),
    "get_num_blocks_to_allocate": ("get_num_blocks_to_allocate",),
    "plan_checkpoints": ("plan_checkpoints",),
    "admission_blocks": ("admission_blocks",),
    "releases_nothing": ("releases_nothing",),
    "count_freeable_skipped": ("count_freeable_skipped",),
    "forget_checkpoints": ("forget_checkpoints",),
    "take_held_back": ("take_held_back",),
}


#: Every step the core calls through a manager's class (never an attribute
#: set on the instance): the hooks of :data:`KIND_STEPS` and the one-group
#: steps the twin steps derive from.
CLASS_STEPS = tuple(
    dict.fromkeys(
        [hook for hooks in KIND_STEPS.values() for hook in hooks]
        + [single for single, _, _ in TWIN_STEPS]
    )
)


def kind_steps(runs: Runs) -> dict[str, frozenset[int]]:
    """Each step of :data:`KIND_STEPS` -> the group ids of the classes of
    ``runs`` that run their own code in it (see :func:`defining`)."""
    return {step: defining(runs, *hooks) for step, hooks in KIND_STEPS.items()}


def record_whole(
    members: Sequence[SingleTypeManager], request_id: str
) -> list[list[int]]:
    """Before a kind's own step over ``members`` (a transaction open):
    record each one's table for the request whole, with its counts, so a
    rollback puts back every position the step changed, in place or not
    (the core's steps record exactly what they change; a kind's may change
    a table without recording it).  The copy of each table (empty where
    there is none) is returned: what the step's effects are checked
    against."""
    before: list[list[int]] = []
    for manager in members:
        if manager.keeps_request_state:  # its own state, once per transaction
            SingleTypeManager.record_request_state(manager, request_id)
        table = manager.req_to_blocks.get(request_id)
        copy = [] if table is None else list(table)
        manager.block_pool.record(
            put_back,
            manager,
            request_id,
            None if table is None else (table, copy),  # None: dropped on undo
            manager.num_cached_block.get(request_id),
            manager.num_released.get(request_id),
        )
        before.append(copy)
    return before
