"""The prefix cache's tables: block hash -> the block holding it.

Each group's table maps a block hash to the id of the one block holding
it, or to ``{block id: None}`` (the ids in key order) when several do (two requests computed the same
prefix before either was cached).  :class:`~kvcore.coordinator.BlockPool`
keeps one table per group for full keys and one for partial keys; these
functions read and change one entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

from kvcore.coordinator.blocks import BlockId
from kvcore.coordinator.hashing import BlockHash

__all__ = ["Entry", "insert_entry", "num_entries", "one_per_group", "remove_entry"]

Entry: TypeAlias = BlockId | dict[BlockId, None]


def num_entries(group: dict[BlockHash, Entry]) -> int:
    """Blocks under one group's keys: one per key, or each of several."""
    return sum(1 if not isinstance(e, dict) else len(e) for e in group.values())


def one_per_group(
    table: dict[int, dict[BlockHash, Entry]],
    block_hash: BlockHash,
    group_ids: Sequence[int],
) -> list[BlockId] | None:
    """One block per group keyed ``block_hash`` in ``table`` (any one where
    several share the key), or None if a group has none."""
    out = []
    for group_id in group_ids:
        group = table.get(group_id)
        entry = None if group is None else group.get(block_hash)
        if entry is None:
            return None
        if isinstance(entry, dict):
            entry = next(iter(entry))
        out.append(entry)
    return out


def insert_entry(group: dict[BlockHash, Entry], key: BlockHash, block: BlockId) -> None:
    entry = group.get(key)
    if entry is None:
        group[key] = block
    elif isinstance(entry, dict):
        entry[block] = None
    elif entry != block:
        group[key] = {entry: None, block: None}


def remove_entry(group: dict[BlockHash, Entry], key: BlockHash, block: BlockId) -> None:
    entry = group.get(key)
    if entry == block:
        del group[key]
    elif isinstance(entry, dict):
        entry.pop(block, None)
        if len(entry) == 1:
            group[key] = next(iter(entry))
        elif not entry:
            del group[key]
