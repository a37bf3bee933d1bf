"""The block pool's operations over a class of twin groups.

Twin groups (one manager class, spec and block size; see
:meth:`~kvcore.coordinator.manager.SingleTypeManager.allocate_twins`) step
together, so a step changes one block or a few in each of them.  These
operations do what one :class:`~kvcore.coordinator.block_pool.BlockPool`
call per group would (same reference counts, free-queue order, keys,
events and journal effect) in one call: a class of twins costs a few
Python calls and a tight loop over its groups, not a round of calls per
group.  :class:`TwinPoolOps` is a base of ``BlockPool``.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Any

from kvcore.coordinator.hashing import BlockHash
from kvcore.coordinator.pool_journal import RELEASE, UNKEY
from kvcore.errors import InvalidRequestError

__all__ = ["TwinPoolOps", "check_store", "double_free", "key_spans"]


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


def key_spans(
    pool: Any,
    tables: Sequence[Sequence[int]],
    group_ids: Sequence[int],
    block_hashes: Sequence[BlockHash],
    span: range,
) -> None:
    """Key the blocks of each of ``tables`` at positions ``span`` that hold
    no key (the null block skipped) with their hashes under that table's
    group, entering each in the group's prefix cache and counting it; with
    a transaction open, one record per group of the (block, key) pairs
    keyed, in order (what a rolled-back store unkeys)."""
    key_hash = pool.key_hash
    key_group = pool.key_group
    groups = pool._cached
    counts = pool._num_cached
    journal = pool.journal
    # The span's hashes once, for every table (one slice of a hash view).
    start = span.start
    try:
        hashes = block_hashes[start : span.stop]
    except TypeError:  # a Sequence that takes no slice (a deque)
        hashes = [block_hashes[i] for i in span]
    for table, group_id in zip(tables, group_ids, strict=True):
        cached = groups.get(group_id)
        if cached is None:
            cached = pool.cached_blocks_of(group_id)
        keyed = []
        for i in span:
            block = table[i]
            if block and key_hash[block] is None:
                key = hashes[i - start]
                key_hash[block] = key
                key_group[block] = group_id
                entry = cached.setdefault(key, block)
                if entry != block:
                    if isinstance(entry, dict):
                        entry[block] = None
                    else:
                        cached[key] = {entry: None, block: None}
                keyed.append((block, key))
        if keyed:
            counts[group_id] += len(keyed)
            if journal is not None:
                journal.append((UNKEY, group_id, keyed))


class TwinPoolOps:
    """``BlockPool``'s calls over several groups at once (see the module)."""

    __slots__ = ()

    def cache_twin_blocks(
        self,
        *,
        block_hashes: Sequence[BlockHash],
        tables: Sequence[Sequence[int]],
        group_ids: Sequence[int],
        num_cached_blocks: int,
        num_full_blocks: int,
        token_ids: Sequence[int] | None = None,
        replaced: Sequence[int | None] | None = None,
    ) -> None:
        """:meth:`~BlockPool.cache_full_blocks` of each of ``tables`` under
        its group id, in order, and with ``replaced`` (one per table, or
        None) :meth:`~BlockPool.drop_from_cache` of that group's replaced
        block after the stores.  Every table is checked before any
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
        if pool.enable_kv_cache_events or not pool.enable_caching:
            if replaced is None:
                replaced = [None] * len(tables)
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
        key_spans(
            pool,
            tables,
            group_ids,
            block_hashes,
            range(num_cached_blocks, num_full_blocks),
        )
        if replaced is None:
            return
        # Each replaced block held another group's key than the blocks just
        # keyed, so dropping it after every store leaves what one store and
        # drop per group would.
        dropped = [old for old in replaced if old is not None]
        if dropped:
            pool.drop_from_cache_n(dropped)

    def free_each(self, lists: Sequence[Sequence[int]], *, spare: bool = True) -> None:
        """Release the blocks running requests stopped reading (each of
        ``lists``, in order): one reference dropped per listing; the blocks
        that reach 0 are queued, keyed ones in the order they reached it
        at the back of the spare blocks (``spare``: evicted before the
        other keyed blocks, for a group whose manager holds back those it
        keeps for later hits, so each of the rest serves only a hit ending
        beside it) or else at the queue's back (as a freed request's: a
        group that selects nothing keeps them by age), the others (with
        caching on) at the front, each list's before the earlier lists'.
        A double free restores every count dropped and raises, changing
        nothing."""
        pool: Any = self
        queue = pool.free_queue
        ref = pool.ref_cnt
        key_hash = pool.key_hash
        partial = pool.partial_keys
        front_ok = pool.enable_caching
        fronts: list[list[int]] = []
        backs: list[int] = []
        for index, blocks in enumerate(lists):
            front: list[int] = []
            it = iter(blocks)
            for block in it:
                cnt = ref[block]
                if cnt == 1:
                    ref[block] = 0
                    if front_ok and key_hash[block] is None and partial[block] is None:
                        front.append(block)
                    else:
                        backs.append(block)
                elif cnt > 1:
                    ref[block] = cnt - 1
                elif block:
                    done_here = blocks[: len(blocks) - len(list(it)) - 1]
                    for done in (*lists[:index], done_here):
                        for b in done:
                            if b:
                                ref[b] += 1
                    raise double_free(block)
            if front:
                fronts.append(front)
        if fronts:
            firsts = [block for front in reversed(fronts) for block in front]
            queue._link_after(queue.head, queue.next[queue.head], firsts)
        if backs and front_ok and spare:
            queue.spare_n(backs)
        elif backs:  # by age (with caching off: no key to keep)
            queue._link_after(queue.prev[queue.tail], queue.tail, backs)
        journal = pool.journal
        if journal is not None:
            journal.append((RELEASE, tuple(chain.from_iterable(lists))))


def double_free(block: int) -> InvalidRequestError:
    msg = (
        f"block {block} freed more often than it was taken (reference "
        "count would drop below 0); free each block once per allocate/touch"
    )
    return InvalidRequestError(msg)
