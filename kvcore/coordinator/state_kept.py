"""Which released states a running request keeps for later requests:
:class:`~kvcore.coordinator.state_manager.CheckpointManager`'s answers to
``kept_twins`` (its prompt end, branch point and step ends, held back
until it is freed) and ``kept_if_room_twins`` (its interval states, held
back in front of them).  Each is asked once for a class of twin groups.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcore.coordinator.step_ends import StateManager as Manager

__all__ = ["checkpoints_kept", "interval_states_kept"]


def checkpoints_kept(
    self: Manager,
    twins: Sequence[Manager],
    request_id: str,
    positions: Sequence[int],
    removed: Sequence[Sequence[int]],
) -> list[list[int]]:
    """The released states each twin keeps for later requests (its
    prompt end, branch point, step ends; not the interval states): held
    back until it is freed, then moved to the back of the eviction
    order (``CheckpointManager.take_released_checkpoints``)."""
    out: list[list[int]] = []
    pool = self.block_pool  # every group's: one pool per coordinator
    key_hash = pool.key_hash
    key_group = pool.key_group
    for twin, released in zip(twins, removed, strict=True):
        kept = twin.kept.get(request_id)
        # A step end is an output end in the making: held only while the
        # traffic's prompts carry output ends back.
        end = twin.step_end.get(request_id) if twin.keeps_output_ends() else None
        before = twin.step_before.get(request_id)
        mine: list[int] = []
        out.append(mine)
        if not kept and end is None and before is None:
            continue
        gid = twin.kv_cache_group_id
        for block in released:
            key = key_hash[block]
            if key is None or key_group[block] != gid:
                continue  # held under no key of this group: not kept
            if (
                (end is not None and end[1] == block and end[2] == key)
                or (before is not None and before[1] == block and before[2] == key)
                or (kept and (block, key) in kept)
            ):
                mine.append(block)
    return out


def interval_states_kept(
    self: Manager,
    twins: Sequence[Manager],
    request_id: str,
    positions: Sequence[int],
    removed: Sequence[Sequence[int]],
) -> list[list[int]]:
    """The released interval states each twin kept (where the group
    holds back): held back in front of the states :func:`checkpoints_kept`
    names until the request is freed, then moved to the back of the
    eviction order with them (a request branching from the running
    prompt resumes at the interval state below its branch)."""
    out: list[list[int]] = []
    for twin, released in zip(twins, removed, strict=True):
        spaced = twin.spaced.get(request_id)
        if not spaced:
            out.append([])
            continue
        keep = {block for block, key in spaced if twin._holds(block, key)}
        out.append([block for block in released if block in keep])
    return out
