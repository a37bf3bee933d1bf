"""The block pool's undo journal: one record per change a step makes.

A step runs inside a transaction (:meth:`BlockPool.begin`); every change to
reference counts, the free queue and the prefix cache appends a record, a
plain tuple whose first item is one of the op codes below, and a rollback
undoes the records newest first (:func:`undo`).  State kept beside the pool
records an :data:`UNDO_CALL`: a function and its arguments.
"""

from __future__ import annotations

from typing import Any, TypeAlias

from kvcore.coordinator.cache_tables import insert_entry, remove_entry

__all__ = ["NOTHING", "UNDO_CALL", "Record", "undo"]

Record: TypeAlias = tuple[Any, ...]
"""A journal record: an op code, then what its undo needs."""

TOUCH = 0  # references taken (and free blocks unlinked) by a hit
KEY = 1  # a full key evicted
UNGET = 2  # blocks handed out
RELEASE = 3  # references dropped (and blocks queued)
MOVE = 4  # free blocks moved within the queue
UNKEY = 5  # full keys given by a store
PARTIAL = 6  # a partial key added
UNPARTIAL = 7  # a block's partial keys dropped
UNDO_CALL = 8  # state kept beside the pool: (op, function, args)

NOTHING: Record = (UNDO_CALL, tuple, ())  # a place held; undoes nothing


def undo(pool: Any, record: Record) -> None:
    """Undo one journal record of ``pool`` (a :class:`BlockPool`)."""
    op = record[0]
    queue = pool.free_queue
    ref = pool.ref_cnt
    if op == TOUCH:
        # (op, blocks, unlinked): counts first, then the relinks newest first.
        for block in record[1]:
            if block:
                ref[block] -= 1
        queue.relink(record[2])
    elif op == KEY:
        # (op, block, key, group id, entry as it was or None): an eviction.
        _, block, key, gid, saved = record
        pool.key_hash[block] = key
        pool.key_group[block] = gid
        cached = pool._cached[gid]
        if saved is None:
            cached.pop(key, None)
        elif isinstance(saved, dict):
            cached[key] = dict(saved)
        else:
            cached[key] = saved
        pool._num_cached[gid] += 1
    elif op == UNGET:
        # (op, blocks, how many came from the queue, how many of those
        # before the spare ones, how many spare ones): in ``blocks`` the
        # queue's unkeyed ones, the spare ones, the queue's others, the
        # held-back ones.
        _, blocks, from_queue, unkeyed, num_spare = record
        for block in blocks:
            ref[block] = 0
        after = from_queue + num_spare
        queue.prepend_held_n(blocks[after:])
        if num_spare:
            queue.prepend_spare_n(blocks[unkeyed : unkeyed + num_spare])
            queue.prepend_n(blocks[:unkeyed] + blocks[unkeyed + num_spare : after])
        else:
            queue.prepend_n(blocks[:from_queue])
    elif op == RELEASE:
        for block in record[1]:
            if block:
                if ref[block] == 0:
                    queue.remove(block)
                ref[block] += 1
    elif op == MOVE:
        # (op, block, prev, next, ...): the moved blocks, in the order
        # they were unlinked, each with the neighbours it had then.
        for block in record[1::3]:
            queue.remove(block)
        queue.relink(record[1:])
    elif op == UNKEY:
        # (op, group id, [(block, key), ...]): keys a store gave.
        gid = record[1]
        cached = pool._cached[gid]
        key_hash = pool.key_hash
        for block, key in reversed(record[2]):
            key_hash[block] = None
            remove_entry(cached, key, block)
        pool._num_cached[gid] -= len(record[2])
    elif op == PARTIAL:
        _, group, key, block = record
        remove_entry(group, key, block)
        keys = pool.partial_keys[block]
        assert keys is not None  # the record's key is among them
        keys.remove(key)
        if not keys:
            pool.partial_keys[block] = None
            del pool.partial_group[block]
    elif op == UNPARTIAL:
        _, group, keys, block, gid = record
        pool.partial_keys[block] = keys
        pool.partial_group[block] = gid
        for key in keys:
            insert_entry(group, key, block)
    else:
        # (op, function, args): state kept beside the pool.
        record[1](*record[2])
