"""A state group's step-end states, stored over a class of twins at once.

With the ``turns`` policy a :class:`~kvcore.coordinator.state_manager.CheckpointManager`
keys the state at each step's end and (where the policy replaces step
ends) drops the one before from the cache.  Twin groups step together, so
:func:`replace_step_ends` does it for a whole class in one pool call
(``BlockPool.cache_twin_blocks``).  This module also holds the table view
a state group finer than the hash block is keyed through
(:class:`ChunkEnds`) and the undo of the manager's saved entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from kvcore.coordinator.hashing import hashes_at_block_size
from kvcore.coordinator.undo import put_entries

if TYPE_CHECKING:
    from kvcore.coordinator.request import Request

#: A ``CheckpointManager`` (kvcore.coordinator.state_manager, which imports
#: this module: named here without importing it back).
StateManager: TypeAlias = Any

__all__ = ["ChunkEnds", "replace_step_ends"]


def replace_step_ends(
    self: StateManager,
    twins: Sequence[StateManager],
    request: Request,
    pos: int,
) -> None:
    """Keep each of ``twins``' state at table position ``pos`` (``self``
    decides for the class); with the policy replacing step ends, a
    replaced one leaves the cache (one pool call: each twin's store, then
    its drop).  The caller recorded the tables and counts."""
    rid = request.request_id
    blocks = self.req_to_blocks[rid]
    if pos < 0 or pos >= len(blocks) or not blocks[pos]:
        return  # twins' tables have one shape: no state there in any
    chunks = request.block_hashes
    key = self.block_hash(chunks, pos)
    if key is None:
        return
    rows = [t.req_to_blocks[rid] for t in twins]
    news = [row[pos] for row in rows]
    gids = [t.kv_cache_group_id for t in twins]
    tables: Sequence[Sequence[int]] = rows
    index = pos
    hashes: Sequence[Any] = chunks
    if self.block_size % self.hash_block_size:  # finer: see _keep
        ratio = self.hash_block_size // self.block_size
        tables = [ChunkEnds(table, ratio) for table in tables]
        index = (pos + 1) // ratio - 1
    else:
        hashes = hashes_at_block_size(chunks, self.hash_block_size, self.block_size)
    replaces = self._replaces
    eagle = self.use_eagle
    kept_too = not replaces and not self.keep_all
    drops: list[int | None] = []
    saved: list[tuple[dict[str, Any], str, Any]] = []  # the step ends before
    pool = self.block_pool
    key_hash = pool.key_hash
    if replaces:
        pool.record(put_entries, saved)
    for twin, row, block, gid in zip(twins, rows, news, gids, strict=True):
        newly = key_hash[block] is None
        if twin.num_cached_block.get(rid, 0) <= pos:
            twin.num_cached_block[rid] = pos + 1
        if not replaces:
            if newly and kept_too:
                twin._save(twin.kept, rid)
                twin.kept.setdefault(rid, []).append((block, key))
            drops.append(None)
            continue
        previous = twin.step_end.get(rid)
        saved.append((twin.step_end, rid, previous))
        twin.step_end[rid] = (pos, block, key if newly else key_hash[block])
        if eagle and previous is not None and previous[1] != block:
            # A hit that drops a block may end at the state before the
            # newest: that one is kept, and the one before it replaced.
            replaced = twin.step_before.get(rid)
            twin._save(twin.step_before, rid)
            twin.step_before[rid] = previous
            previous = replaced
        if previous is None or previous[1] == block:
            drops.append(None)
            continue
        old_pos, old, old_key = previous
        in_table = old_pos < len(row) and row[old_pos] == old
        held = pool.ref_cnt[old] == (1 if in_table else 0) and (  # see _holds
            old_key is not None
            and key_hash[old] == old_key
            and pool.key_group[old] == gid
        )
        drops.append(old if held else None)
    pool.cache_twin_blocks(
        block_hashes=hashes,
        tables=tables,
        group_ids=gids,
        num_cached_blocks=index,
        num_full_blocks=index + 1,
        token_ids=request.all_token_ids,
        replaced=drops,
    )


class ChunkEnds(Sequence[int]):
    """A checkpoint table finer than the hash block, one entry per hash
    chunk: the block id holding the state at the chunk's end."""

    def __init__(self, blocks: Sequence[int], ratio: int) -> None:
        self._blocks = blocks
        self._ratio = ratio
        self._len = len(blocks) // ratio

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._len))]
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            msg = f"chunk {index} out of range for {self._len} chunks"
            raise IndexError(msg)
        return self._blocks[(index + 1) * self._ratio - 1]
