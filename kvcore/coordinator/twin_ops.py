"""The block pool's operations over a class of twin groups.

Twin groups (one manager class, spec and block size; see
:meth:`~kvcore.coordinator.manager.SingleTypeManager.allocate_twins`) step
together, so a step changes one block or a few in each of them.  These
operations do what one :class:`~kvcore.coordinator.block_pool.BlockPool`
call per group would (same reference counts, free-queue order, keys,
events and journal effect) in one call: a class of twins costs a few
Python calls and a tight loop over its groups, not a round of calls per
group.  :class:`TwinPoolOps` is a base of ``BlockPool``; this module also
holds the pool's journal op codes, which both share.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from kvcore.coordinator.hashing import BlockHash
from kvcore.errors import InvalidRequestError

if TYPE_CHECKING:
    from kvcore.coordinator.blocks import KVCacheBlock

__all__ = ["UNDO_CALL", "TwinPoolOps", "check_store", "double_free", "key_span"]

_Record: TypeAlias = tuple[Any, ...]
"""A journal record: an op code, then what its undo needs (see
:meth:`BlockPool._undo`)."""

# Journal op codes, one per kind of change a step records.
_TOUCH = 0  # references taken (and free blocks unlinked) by a hit
_KEY = 1  # a full key evicted
_UNGET = 2  # blocks handed out
_RELEASE = 3  # references dropped (and blocks queued)
_MOVE = 4  # a free block moved within the queue
_UNKEY = 5  # full keys given by a store
_PARTIAL = 6  # a partial key added
_UNPARTIAL = 7  # a block's partial keys dropped
UNDO_CALL = 8  # state kept beside the pool: (op, function, args)

_NOTHING: _Record = (UNDO_CALL, tuple, ())  # a place held; undoes nothing


def check_store(
    num_cached_blocks: int,
    num_full_blocks: int,
    num_blocks: int,
    num_hashes: int,
    group_id: int,
) -> None:
    """Refuse a store (``cache_full_blocks``) whose range is not inside the
    table and its hashes, before anything changes."""
    if not 0 <= num_cached_blocks <= num_full_blocks <= num_blocks:
        msg = (
            f"cache_full_blocks: need 0 <= num_cached_blocks "
            f"({num_cached_blocks}) <= num_full_blocks ({num_full_blocks}) <= "
            f"number of blocks ({num_blocks}) for group {group_id}"
        )
        raise InvalidRequestError(msg)
    if num_full_blocks > num_hashes:
        msg = (
            f"cache_full_blocks: {num_full_blocks} full blocks but only "
            f"{num_hashes} block hashes for group {group_id}; hash the "
            "request's tokens before caching its blocks"
        )
        raise InvalidRequestError(msg)


def key_span(
    cached: dict[BlockHash, Any],
    table: Sequence[KVCacheBlock],
    block_hashes: Sequence[BlockHash],
    span: range,
    group_id: int,
) -> list[tuple[KVCacheBlock, BlockHash]]:
    """Key the blocks of ``table`` at positions ``span`` that hold no key
    (the null block skipped) with their hashes under ``group_id``, entering
    each in the group's table ``cached``: the (block, key) pairs keyed, in
    order (what a rolled-back store unkeys)."""
    keyed = []
    for i in span:
        block = table[i]
        if block.key_hash is None and not block.is_null:
            key = block_hashes[i]
            block.key_hash = key
            block.key_group = group_id
            entry = cached.setdefault(key, block)
            if entry is not block:
                if isinstance(entry, dict):
                    entry[block.block_id] = block
                else:
                    cached[key] = {entry.block_id: entry, block.block_id: block}
            keyed.append((block, key))
    return keyed


class TwinPoolOps:
    """``BlockPool``'s calls over several groups at once (see the module)."""

    __slots__ = ()

    def cache_twin_blocks(
        self,
        *,
        block_hashes: Sequence[BlockHash],
        tables: Sequence[Sequence[KVCacheBlock]],
        group_ids: Sequence[int],
        num_cached_blocks: int,
        num_full_blocks: int,
        token_ids: Sequence[int] | None = None,
        replaced: Sequence[KVCacheBlock | None] | None = None,
    ) -> None:
        """:meth:`~BlockPool.cache_full_blocks` of each of ``tables`` under
        its group id, in order, and with ``replaced`` (one per table, or
        None) :meth:`~BlockPool.drop_from_cache` of that group's replaced
        block right after its store.  Every table is checked before any
        changes."""
        pool: Any = self
        num_hashes = len(block_hashes)
        if (
            not 0
            <= num_cached_blocks
            <= num_full_blocks
            <= min(map(len, tables), default=num_full_blocks)
            or num_full_blocks > num_hashes
        ):
            for table, gid in zip(tables, group_ids, strict=True):
                check_store(
                    num_cached_blocks, num_full_blocks, len(table), num_hashes, gid
                )
        if replaced is None:
            replaced = [None] * len(tables)
        if pool.enable_kv_cache_events or not pool.enable_caching:
            # Events carry each store's tokens: the one-group calls build them.
            for table, gid, old in zip(tables, group_ids, replaced, strict=True):
                pool.cache_full_blocks(
                    block_hashes=block_hashes,
                    blocks=table,
                    num_cached_blocks=num_cached_blocks,
                    num_full_blocks=num_full_blocks,
                    group_id=gid,
                    token_ids=token_ids,
                )
                if old is not None:
                    pool.drop_from_cache(old)
            return
        span = range(num_cached_blocks, num_full_blocks)
        journal = pool.journal
        counts = pool._num_cached
        groups = pool._cached
        drop = pool.drop_from_cache
        for table, gid, old in zip(tables, group_ids, replaced, strict=True):
            cached = groups.get(gid)
            if cached is None:
                cached = pool.cached_blocks_of(gid)
            keyed = key_span(cached, table, block_hashes, span, gid)
            if keyed:
                counts[gid] += len(keyed)
                if journal is not None:
                    journal.append((_UNKEY, gid, keyed))
            if old is not None:
                drop(old)

    def free_each(self, lists: Sequence[Sequence[KVCacheBlock]]) -> None:
        """:meth:`~BlockPool.free_blocks` of each of ``lists``, in order: one
        reference dropped per listing; the blocks that reach 0 are queued,
        keyed ones at the back in the order they reached it, the others
        (with caching on) at the front, each list's before the earlier
        lists'.  A double free restores every count dropped and raises,
        changing nothing."""
        pool: Any = self
        queue = pool.free_queue
        front_ok = pool.enable_caching
        fronts: list[list[KVCacheBlock]] = []
        backs: list[KVCacheBlock] = []
        for index, blocks in enumerate(lists):
            front: list[KVCacheBlock] = []
            it = iter(blocks)
            for block in it:
                cnt = block.ref_cnt
                if cnt == 1:
                    block.ref_cnt = 0
                    if (
                        front_ok
                        and block.key_hash is None
                        and block.partial_keys is None
                    ):
                        front.append(block)
                    else:
                        backs.append(block)
                elif cnt > 1:
                    block.ref_cnt = cnt - 1
                elif not block.is_null:
                    done = len(blocks) - len(list(it)) - 1
                    _restore_counts([*lists[:index], blocks[:done]])
                    raise double_free(block)
            if front:
                fronts.append(front)
        if fronts:
            chain = [block for front in reversed(fronts) for block in front]
            head = queue._head
            queue._link_after(head, head.next_free, chain)
        if backs:
            tail = queue._tail
            queue._link_after(tail.prev_free, tail, backs)
        journal = pool.journal
        if journal is not None:
            journal.append((_RELEASE, tuple(b for blocks in lists for b in blocks)))


def _restore_counts(lists: Sequence[Sequence[KVCacheBlock]]) -> None:
    """Undo :meth:`TwinPoolOps.free_each`'s count drops over ``lists`` (the
    listings before a double free; nothing is queued yet)."""
    for blocks in lists:
        for block in blocks:
            if not block.is_null:
                block.ref_cnt += 1


def double_free(block: KVCacheBlock) -> InvalidRequestError:
    msg = (
        f"block {block.block_id} freed more often than it was taken (reference "
        "count would drop below 0); free each block once per allocate/touch"
    )
    return InvalidRequestError(msg)
