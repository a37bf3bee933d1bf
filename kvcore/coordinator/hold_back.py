"""Holding back the blocks a running request releases but keeps for hits.

A group that skips blocks beside a group keeping every block (its
``holds_back`` set) asks its manager which of the blocks a running request
just released stay for later requests' hits: ``kept_for_later`` names
those held back behind the other free blocks (``BlockPool.hold_back``),
``kept_if_room`` those for less likely hits, held back in front of them
(``BlockPool.hold_back_first``).  A class of twin groups is asked once,
through the class forms ``kept_twins`` and ``kept_if_room_twins`` (see
:meth:`~kvcore.coordinator.manager.SingleTypeManager.allocate_twins`).
This module runs that step for the manager base class: it checks each
answer where it enters the core, moves the blocks in one pool call per
kind, and notes what a group freed before the others holds back for
``take_held_back``; a group whose every release stays a hit point
(``rejoins_releases``) holds back none and notes its keyed releases there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

from kvcore.coordinator.plugin_results import result_error
from kvcore.coordinator.undo import truncate
from kvcore.errors import PluginResultError

#: A ``SingleTypeManager`` (kvcore.coordinator.manager, which imports this
#: module: named here without importing it back).
Manager: TypeAlias = Any

__all__ = ["hold_back_twins"]


def hold_back_twins(
    lead: Manager,
    twins: Sequence[Manager],
    request_id: str,
    positions: Sequence[int],
    removed: Sequence[Sequence[int]],
) -> None:
    """Hold back the released blocks each of ``twins`` (``lead`` first)
    keeps: those ``kept_for_later`` names behind the held-back blocks, in
    group order, and those ``kept_if_room`` names in front of them, the
    last group's first (as one pool call per group would leave them); each
    twin's lowest position first (evicted first).  A group freed before
    the others (not ``evicts_last``) remembers them for ``take_held_back``.
    Every answer is checked before the pool changes.  A group whose every
    release stays a hit point (``rejoins_releases``) holds back none."""
    if not lead.holds_back:
        _remember_keyed(twins, request_id, positions, removed)
        return
    num = len(twins)
    steps = type(lead)
    answers = steps.kept_twins(lead, twins, request_id, positions, removed)
    if type(answers) is not list or len(answers) != num:
        raise _answers_error(lead, "kept_twins", request_id, answers, num)
    spares = steps.kept_if_room_twins(lead, twins, request_id, positions, removed)
    if type(spares) is not list or len(spares) != num:
        raise _answers_error(lead, "kept_if_room_twins", request_id, spares, num)
    held: list[int] = []
    first: list[list[int]] = []
    for i, kept in enumerate(answers):
        # Lowest position first: the running request holds its whole
        # attention prefix, so its longest hit points go last.
        spare = spares[i]
        if not kept and not spare:
            continue
        twin = twins[i]
        released = removed[i]
        if spare:
            where = _where(positions, released)
            seen: set[int] = set()
            if kept:
                kept = answers[i] = _checked(twin, request_id, kept, where, seen)
            spare = spares[i] = _checked(
                twin, request_id, spare, where, seen, "kept_if_room"
            )
            first.append(spare)
        elif (
            type(kept) is not list
            or len(kept) > 1
            or type(kept[0]) is not int
            or kept[0] not in released
        ):
            where = _where(positions, released)
            kept = answers[i] = _checked(twin, request_id, kept, where, set())
        if kept:
            held += kept
    if not held and not first:
        return
    pool = lead.block_pool
    if held:
        pool.hold_back(held)
    if first:
        pool.hold_back_first([block for spare in reversed(first) for block in spare])
    if lead.evicts_last:
        return
    for twin, released, kept, spare in zip(
        twins, removed, answers, spares, strict=True
    ):
        if kept or spare:
            both = [*(kept or ()), *(spare or ())]
            _remember_held(twin, request_id, both, _where(positions, released))


def _where(positions: Sequence[int], released: Sequence[int]) -> dict[int, int]:
    """Each released block's table position, by block id."""
    return dict(zip(released, positions, strict=True))


def _remember_keyed(
    twins: Sequence[Manager],
    request_id: str,
    positions: Sequence[int],
    removed: Sequence[Sequence[int]],
) -> None:
    """Note each twin's released blocks that its group keyed, for
    ``take_held_back``: they rejoin the table when the request is freed,
    so each leaves the cache by hit point with the blocks its hit reads
    (moved behind all of them, a state outlived the attention blocks it
    needs and served nothing)."""
    for twin, released in zip(twins, removed, strict=True):
        pool = twin.block_pool
        gid = twin.kv_cache_group_id
        keyed = [
            block
            for block in released
            if pool.key_hash[block] is not None and pool.key_group[block] == gid
        ]
        if keyed:
            _remember_held(twin, request_id, keyed, _where(positions, released))


def _remember_held(
    manager: Manager,
    request_id: str,
    kept: list[int],
    where: dict[int, int],
) -> None:
    """Note the blocks the running request held back in ``manager``'s
    group (see ``take_held_back``)."""
    pool = manager.block_pool
    held = manager.held_back.get(request_id)
    if held is None:
        held = manager.held_back[request_id] = []
        pool.record(manager.held_back.pop, request_id, None)
    else:
        pool.record(truncate, held, len(held))
    key_hash = pool.key_hash
    held += [(where[block], block, key_hash[block]) for block in kept]


def _answers_error(
    manager: Manager,
    method: str,
    request_id: str,
    answers: Any,
    num_twins: int,
) -> PluginResultError:
    """A class answer (``kept_twins``, ``kept_if_room_twins``) that is not
    one list per twin, as an error naming the manager class."""
    return result_error(
        manager,
        method,
        f"returned {answers!r} for request {request_id!r}; it must return a "
        f"list of {num_twins} lists, one per twin, of the released blocks to "
        "hold back",
    )


def _checked(
    manager: Manager,
    request_id: str,
    kept: Any,
    where: dict[int, int],
    seen: set[int],
    method: str = "kept_for_later",
) -> list[int]:
    """``method``'s answer for one group as the core takes it: a list of
    distinct blocks among those just released (``where``) and not in
    ``seen`` (the ids named so far, which it extends), lowest position
    first, else an error naming the manager class (nothing is held back
    yet)."""
    if not isinstance(kept, list):
        raise result_error(
            manager,
            method,
            f"returned {type(kept).__name__} for request {request_id!r}; it "
            "must return a list of the released blocks to hold back (or [])",
        )
    for block in kept:
        if type(block) is not int or block not in where or block in seen:
            raise result_error(
                manager,
                method,
                f"returned {block!r} for request {request_id!r}, which is not "
                "one of the blocks it just released or is named twice "
                "(kept_for_later and kept_if_room together); return each "
                "released block to hold back once",
            )
        seen.add(block)
    return sorted(kept, key=where.__getitem__)
