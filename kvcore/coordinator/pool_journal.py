"""The block pool's undo journal: one record per change a step makes.

A step runs inside a transaction (:meth:`BlockPool.begin`); every change to
reference counts, the free queue and the prefix cache appends a record, a
plain tuple whose first item is one of the op codes below, and a rollback
undoes the records newest first (:func:`undo_all`, one function per op
code).  State kept beside the pool records an :data:`UNDO_CALL`: a function
and its arguments.
"""

from __future__ import annotations

import contextlib
from typing import Any, TypeAlias

from kvcore.coordinator.cache_tables import remove_entry
from kvcore.errors import PluginError

__all__ = ["NOTHING", "UNDO_CALL", "Record", "taken_since", "undo_all"]

Record: TypeAlias = tuple[Any, ...]
"""A journal record: an op code, then what its undo needs."""

TOUCH = 0  # references taken (and free blocks unlinked) by a hit
KEY = 1  # full keys evicted
UNGET = 2  # blocks handed out
RELEASE = 3  # references dropped (and blocks queued)
MOVE = 4  # free blocks moved within the queue
UNKEY = 5  # full keys given by a store
PARTIAL = 6  # a partial key added
UNPARTIAL = 7  # a block's partial keys dropped
UNDO_CALL = 8  # state kept beside the pool: (op, function, args)

NOTHING: Record = (UNDO_CALL, tuple, ())  # a place held; undoes nothing


def _touch(pool: Any, record: Record) -> None:
    # (op, blocks, unlinked): counts first, then the relinks newest first.
    ref = pool.ref_cnt
    for block in record[1]:
        if block:
            ref[block] -= 1
    pool.free_queue.relink(record[2])


def _key(pool: Any, record: Record) -> None:
    # (op, [(block, key, group id, entry as it was or None), ...]):
    # evictions, undone newest first.
    key_hash = pool.key_hash
    key_group = pool.key_group
    for block, key, gid, saved in reversed(record[1]):
        key_hash[block] = key
        key_group[block] = gid
        cached = pool._cached[gid]
        if saved is None:
            cached.pop(key, None)
        elif type(saved) is dict:
            cached[key] = dict(saved)
        else:
            cached[key] = saved
        pool._num_cached[gid] += 1


def _unget(pool: Any, record: Record) -> None:
    # (op, blocks, how many came from the queue, how many of those before
    # the spare ones, how many spare ones): in ``blocks`` the queue's
    # unkeyed ones, the spare ones, the queue's others, the held-back ones.
    _, blocks, from_queue, unkeyed, num_spare = record
    queue = pool.free_queue
    ref = pool.ref_cnt
    for block in blocks:
        ref[block] = 0
    after = from_queue + num_spare
    queue.prepend_held_n(blocks[after:])
    if num_spare:
        queue.prepend_spare_n(blocks[unkeyed : unkeyed + num_spare])
        queue.prepend_n(blocks[:unkeyed] + blocks[unkeyed + num_spare : after])
    else:
        queue.prepend_n(blocks[:from_queue])


def _release(pool: Any, record: Record) -> None:
    # (op, blocks): each listing's reference taken back, queued ones unlinked.
    queue = pool.free_queue
    ref = pool.ref_cnt
    for block in record[1]:
        if block:
            if ref[block] == 0:
                queue.remove(block)
            ref[block] += 1


def _move(pool: Any, record: Record) -> None:
    # (op, block, prev, next, ...): the moved blocks, in the order they
    # were unlinked, each with the neighbours it had then.
    queue = pool.free_queue
    for block in record[1::3]:
        queue.remove(block)
    queue.relink(record[1:])


def _unkey(pool: Any, record: Record) -> None:
    # (op, group id, [(block, key), ...]): keys a store gave.
    gid = record[1]
    cached = pool._cached[gid]
    key_hash = pool.key_hash
    for block, key in reversed(record[2]):
        key_hash[block] = None
        remove_entry(cached, key, block)
    pool._num_cached[gid] -= len(record[2])


def _partial(pool: Any, record: Record) -> None:
    # (op, group's partial keys, key, block): a partial key added.
    _, group, key, block = record
    remove_entry(group, key, block)
    keys = pool.partial_keys[block]
    keys.remove(key)
    if not keys:
        pool.partial_keys[block] = None
        del pool.partial_group[block]


def _unpartial(pool: Any, record: Record) -> None:
    # (op, group's partial keys, keys, block, group id, each key's entry as
    # it was): the block's partial keys dropped.
    _, group, keys, block, gid, saved = record
    pool.partial_keys[block] = keys
    pool.partial_group[block] = gid
    for key, entry in zip(keys, saved, strict=True):
        if entry is None:
            group.pop(key, None)
        else:
            group[key] = dict(entry) if type(entry) is dict else entry


def _call(pool: Any, record: Record) -> None:
    # (op, function, args): state kept beside the pool.
    del pool
    record[1](*record[2])


#: The undo of each op code.
_UNDO = {
    TOUCH: _touch,
    KEY: _key,
    UNGET: _unget,
    RELEASE: _release,
    MOVE: _move,
    UNKEY: _unkey,
    PARTIAL: _partial,
    UNPARTIAL: _unpartial,
    UNDO_CALL: _call,
}


def undo_all(pool: Any, journal: list[Record]) -> None:
    """Undo every record of ``journal``, newest first, while
    ``pool.journal`` is a fresh list (see :meth:`BlockPool.rollback`).  An
    undo call a manager recorded that raises, or that changes the pool
    (what that list caught, undone at once: the step is reported undone),
    does not stop the others (the pool's own records undo what they did
    whatever it did); once all have run, the first such failure is raised
    as a :class:`PluginError` naming the call's owner."""
    caught = pool.journal
    failed: tuple[Record, Exception | None] | None = None
    for record in reversed(journal):
        try:
            _UNDO[record[0]](pool, record)
        except Exception as exc:
            if failed is None:
                failed = (record, exc)
        if caught and _undo_caught(pool, caught) and failed is None:
            failed = (record, None)
    if failed is not None:
        record, error = failed
        if error is None:
            raise _undo_error(pool, record[1], None)
        raise _undo_error(pool, record[1], error) from error


def _undo_caught(pool: Any, caught: list[Record]) -> bool:
    """Undo, newest first, the pool changes an undo call made (``caught``
    by the rollback's journal), emptying it; whether there were any.  The
    undo calls it recorded (its own state's journal, as a step's setter
    keeps it) are dropped: the rollback is putting that state back."""
    changed = False
    while caught:
        record = caught.pop()
        if record[0] == UNDO_CALL:
            continue
        changed = True
        with contextlib.suppress(Exception):  # the call that made it is reported
            _UNDO[record[0]](pool, record)
    return changed


def _undo_error(pool: Any, call: Any, error: Exception | None) -> PluginError:
    """The error for undo call ``call`` that raised ``error`` (None: it
    changed the pool), naming the plugin of the group whose manager
    recorded it (see ``BlockPool.plugin_of``), else the owner's module."""
    owner = getattr(call, "__self__", call)
    named = pool.plugin_of(owner) if pool.plugin_of is not None else None
    plugin, distribution = named or (
        getattr(type(owner), "__module__", None) or "unknown",
        None,
    )
    name = getattr(call, "__qualname__", repr(call))
    did = (
        "changed the block pool (took, touched, freed or keyed blocks)"
        if error is None
        else f"raised {type(error).__name__}"
    )
    msg = (
        f"{name} {did} while a failed step was undone (plugin {plugin!r}); "
        "every other change of the step, and the call's changes to the block "
        "pool, were undone. An undo a manager records (restore_request_state, "
        "or a call given to BlockPool.record) must put back what it saved, "
        "change nothing in the block pool and not raise"
    )
    return PluginError(msg, plugin_name=plugin, distribution=distribution)


def taken_since(journal: list[Record], mark: int) -> list[list[int]]:
    """The blocks each hand-out recorded in ``journal`` from ``mark`` on
    handed out, in order."""
    return [record[1] for record in journal[mark:] if record[0] == UNGET]
