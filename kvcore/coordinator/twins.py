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

__all__ = ["Runs", "defining", "twin_key", "twin_runs"]


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


def defining(runs: Runs, *steps: str) -> frozenset[int]:
    """The classes of ``runs`` (by first group id) whose manager class
    defines one of ``steps`` itself, below :class:`SingleTypeManager` (an
    override, or a twin step made from a one-group override): their
    answers are plugin code, checked where they cross into the core; the
    core's own steps need no check."""
    out: set[int] = set()
    for first, members in runs:
        for klass in type(members[0]).__mro__:
            if klass is SingleTypeManager:
                break
            if any(step in vars(klass) for step in steps):
                out.add(first)
                break
    return frozenset(out)
