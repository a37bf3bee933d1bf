"""The undo calls a rolled-back step runs for state kept beside the pool:
the managers' tables, counts and per-request entries (journaled with
:meth:`BlockPool.record`, see
:meth:`~kvcore.coordinator.manager.SingleTypeManager.record_request_state`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "put_at",
    "put_at_each",
    "put_back",
    "put_back_each",
    "put_entries",
    "put_entry",
    "truncate",
]


def put_at(
    blocks: list[int],
    positions: Sequence[int],
    removed: Sequence[int],
) -> None:
    """Put released blocks back at their table positions."""
    for i, block in zip(positions, removed, strict=True):
        blocks[i] = block


def put_back_each(request_id: str, entries: Sequence[tuple[Any, ...]]) -> None:
    """Undo :meth:`SingleTypeManager.record_twins`: :func:`put_back` for
    each twin (``(manager, table, its length or -1 for none, hashed count,
    released count)``), the last first."""
    for manager, blocks, length, cached, released in reversed(entries):
        table = None if blocks is None else (blocks, length)
        put_back(manager, request_id, table, cached, released)


def put_at_each(
    tables: Sequence[list[int]],
    positions: Sequence[int],
    removed: Sequence[Sequence[int]],
) -> None:
    """:func:`put_at` for each twin's table."""
    for blocks, blocks_removed in zip(tables, removed, strict=True):
        put_at(blocks, positions, blocks_removed)


def truncate(items: list[Any], length: int) -> None:
    del items[length:]


def put_back(
    manager: Any,
    request_id: str,
    table: tuple[list[int], list[int] | int] | None,
    cached: int | None,
    released: int | None,
) -> None:
    """Put a manager's table for a request (the same list object: ``items``
    its blocks, or the length it is cut back to), hashed count and released
    count back."""
    if table is None:
        manager.req_to_blocks.pop(request_id, None)
    else:
        blocks, items = table
        if isinstance(items, int):
            del blocks[items:]
        else:
            blocks[:] = items
        manager.req_to_blocks[request_id] = blocks
    put_entry(manager.num_cached_block, request_id, cached)
    put_entry(manager.num_released, request_id, released)


def put_entries(entries: Sequence[tuple[dict[str, Any], str, Any]]) -> None:
    """Put back several stores' entries (see :meth:`~kvcore.coordinator.CheckpointManager._save`)."""
    for store, request_id, value in entries:
        put_entry(store, request_id, value)


def put_entry(store: dict[str, Any], request_id: str, value: Any) -> None:
    """Put back one store's entry for the request (None: no entry)."""
    if value is None:
        store.pop(request_id, None)
    else:
        store[request_id] = value
