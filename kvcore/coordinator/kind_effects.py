"""What a kind's own step left behind, checked before the step commits.

A step a kind's manager class defines itself (see
:func:`~kvcore.coordinator.twins.defining`) changes the request's tables,
the pool's references and its keys with code the core did not write; an
answer can be right while the tables are not.  The checks here read only
the request's tables, a copy of them and of the request's hashes taken
before the step, and what the step recorded in the pool's journal, so the
core's own steps never pay for them.  A kind's own query (a count, a
search, a hook that only answers) runs inside a transaction and must
record nothing there (:func:`watched_query`).  Each failure is a
:class:`~kvcore.errors.PluginResultError` naming the manager class, and
the step is undone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

from kvcore.coordinator.hashing import prefix_key
from kvcore.coordinator.plugin_results import (
    CHANGED_POOL,
    check_new_blocks,
    result_error,
    shown,
)
from kvcore.coordinator.pool_journal import (
    RELEASE,
    TOUCH,
    UNDO_CALL,
    UNGET,
    UNKEY,
    Record,
)
from kvcore.coordinator.twins import record_whole

__all__ = [
    "check_attached",
    "check_balanced",
    "check_count_covers",
    "check_covers",
    "check_keyed",
    "check_hashes_kept",
    "checked_step",
    "count_of",
    "step_snapshot",
    "watched_query",
]


def checked_step(
    method: str,
    members: Sequence[Any],
    args: Sequence[Any],
    new: object,
    marks: tuple[list[Record] | None, int, Snapshot],
) -> Any:
    """What a kind's own class step ``method`` (``allocate_twins``,
    ``release_twins`` or ``cache_twins``, called with ``args``) returned
    (``new``), once what it left is checked; ``marks``: the journal, where
    the step's records start and the tables before it."""
    journal, mark, (before, hashes) = marks
    if journal is None:  # a kind's step runs inside a transaction
        journal = []
    if method == "allocate_twins":
        request_id, num_tokens = args[0], args[1]
        lengths = [len(table) for table in before]
        new = check_new_blocks(members, request_id, new, journal, (mark, lengths))
        check_covers(members, request_id, num_tokens)
    elif method == "release_twins":
        request_id = args[0]  # a freed block left in a table: unbalanced
    else:
        request_id = args[0].request_id
        check_hashes_kept(members[0], method, args[0], hashes)
        check_keyed(members, args[0], journal, mark)
    check_balanced(members, request_id, method, before, (journal, mark))
    return new


#: What a step of each kind may do to a table position it held before:
#: (a block may become the null block, the null block may become a block
#: the pool handed out in the step); every step may append but the two
#: that neither grow nor attach.
_MAY = {
    "allocate_twins": (False, True),
    "release_twins": (True, False),
    "cache_twins": (False, False),
    "add_computed_blocks": (False, False),
}
_APPENDS = frozenset(("allocate_twins", "add_computed_blocks"))


#: What a kind's step is checked against: each twin's table before it,
#: and (a step given the request) the request's hash list and its copy.
Snapshot: TypeAlias = tuple[list[list[int]], tuple[list[Any], list[Any]] | None]


def step_snapshot(members: Sequence[Any], args: Sequence[Any]) -> Snapshot:
    """Before a kind's step over ``members`` called with ``args`` (a
    request id first, or the request): the tables recorded whole
    (:func:`~kvcore.coordinator.twins.record_whole`) and, where the step is
    given the request, its block hashes and a copy of them."""
    request = args[0]
    rid = getattr(request, "request_id", request)
    hashes = None if rid is request else request.block_hashes
    copy = None if hashes is None else (hashes, list(hashes))
    return record_whole(members, rid), copy


def check_hashes_kept(
    manager: Any, method: str, request: Any, hashes: tuple[list[Any], list[Any]] | None
) -> None:
    """After a kind's step given ``request``: its block hashes are the list
    they were, as they were (``hashes``: the list and a copy).  They are
    the engine's, and every key and hit of the request is read from them;
    changed ones are put back before the step is refused."""
    if hashes is None:
        return
    held, copy = hashes
    if request.block_hashes is held and held == copy:
        return
    held[:] = copy
    request.block_hashes = held
    raise result_error(
        manager,
        method,
        f"changed the block hashes of request {request.request_id!r}; a step "
        "reads the request and changes only the pool and the request's tables",
    )


def check_balanced(
    members: Sequence[Any],
    request_id: str,
    method: str,
    before: Sequence[Sequence[int]],
    since: tuple[list[Record], int],
) -> None:
    """After a kind's step over ``members`` (their tables of the request
    were ``before``): each table is still a list, changed only as the step
    may (a release nulls positions, an allocation fills null ones with
    blocks it took, no step puts one block in place of another or moves a
    block between twins, a table never shrinks, and only an allocation or
    an attach appends), and each block's reference count moved by as much
    as how often the tables list it (the references the pool's journal
    recorded from the mark in ``since``).  A reference dropped on a block
    the tables do not give up frees it under its other holder (another
    request, another twin's shared hit); one taken on a block no table
    gains is never freed; a block swapped in would be written by two
    requests or two layers."""
    change, handed = _references_moved(*since)
    may_null, may_fill = _MAY[method]
    appends = method in _APPENDS
    for manager, old in zip(members, before, strict=True):
        table = manager.req_to_blocks.get(request_id, [])
        if type(table) is not list:
            raise _moved(
                members, method, manager, request_id, "replaced it by a non-list"
            )
        size = len(old)
        if len(table) == size and table == old:
            continue  # as it was (most steps)
        if len(table) < size:
            raise _moved(members, method, manager, request_id, "shortened it")
        if len(table) > size and not appends:
            raise _moved(members, method, manager, request_id, "appended to it")
        # Positions it held, walked only where they changed (an append
        # leaves them as they were).
        held = () if len(table) > size and table[:size] == old else old
        for i, (was, now) in enumerate(zip(held, table, strict=False)):
            if was == now:
                continue
            if not (now == 0 and may_null) and not (
                was == 0 and may_fill and now in handed
            ):
                done = f"put block {now} at position {i} in place of block {was}"
                raise _moved(members, method, manager, request_id, done)
            if was:
                change[was] = change.get(was, 0) + 1
            if now:
                change[now] = change.get(now, 0) - 1
        for now in table[size:]:
            if now:
                change[now] = change.get(now, 0) - 1
    if not change:
        return  # no reference moved, no table changed (most steps)
    wrong = [(block, n) for block, n in change.items() if n]
    if not wrong:
        return
    block, n = wrong[0]
    groups = ", ".join(str(m.kv_cache_group_id) for m in members)
    raise result_error(
        members[0],
        method,
        f"left block {block}'s reference count {abs(n)} "
        f"{'above' if n > 0 else 'below'} what the tables of request "
        f"{request_id!r} in cache group(s) {groups} hold of it; a step takes one "
        "reference for each block it puts in the request's tables and drops "
        "one for each it takes out (block_pool.get_new_blocks, touch, "
        "free_blocks), and changes no other block's count",
    )


def _references_moved(
    journal: list[Record], mark: int
) -> tuple[dict[int, int], set[int]]:
    """Each block's reference change the journal recorded from ``mark``
    on (touched and handed out: +1, released: -1), and the blocks handed
    out."""
    change: dict[int, int] = {}
    handed: set[int] = set()
    for record in journal[mark:]:
        op = record[0]
        if op in (TOUCH, UNGET, RELEASE):
            step = -1 if op == RELEASE else 1
            for block in record[1]:
                if block:
                    change[block] = change.get(block, 0) + step
            if op == UNGET:
                handed.update(record[1])
    return change, handed


def _moved(
    members: Sequence[Any], method: str, manager: Any, request_id: str, done: str
) -> Exception:
    """The error for a step that changed a table as no step of its kind may."""
    return result_error(
        members[0],
        method,
        f"{done} (cache group {manager.kv_cache_group_id}'s table of request "
        f"{request_id!r}); a table stays a list that a release changes only by "
        "putting the null block at released positions and an allocation only "
        "by appending or by putting a block it takes at a null position; no "
        "step puts one block in place of another, moves one to another group "
        "or shortens the table",
    )


def check_covers(members: Sequence[Any], request_id: str, num_tokens: int) -> None:
    """After a kind's allocation: each position-indexed twin's table holds a
    block at the position of the last of ``num_tokens`` tokens (the engine's
    slots for the step's tokens index the table)."""
    for manager in members:
        if not manager.position_indexed or num_tokens <= 0:
            continue
        table = manager.req_to_blocks.get(request_id) or ()
        last = (num_tokens - 1) // manager.block_size
        # The step's last token is written into the block at its position.
        if len(table) <= last or not table[last]:
            raise result_error(
                members[0],
                "allocate_twins",
                f"left cache group {manager.kv_cache_group_id}'s table of request "
                f"{request_id!r} at {len(table)} blocks of {manager.block_size} "
                f"tokens where the step covers {num_tokens} tokens, with no block "
                "at the position of its last token: the engine would write the "
                "step's KV past the table or into the null block; take a block "
                "for every position the step writes",
            )


def count_of(
    manager: Any,
    watched: bool,
    request_id: str,
    num_tokens: int,
    computed: Sequence[int],
) -> Any:
    """``manager``'s count (unchecked) of the blocks a step covering ``num_tokens``
    takes with ``computed`` attached, run :func:`watched_query` where
    it is the kind's own code (``watched``)."""
    count = type(manager).get_num_blocks_to_allocate
    if watched:  # given a copy: the admission blocks are the core's
        return watched_query(
            manager,
            "get_num_blocks_to_allocate",
            count,
            manager,
            request_id,
            num_tokens,
            list(computed),
        )
    return count(manager, request_id, num_tokens, computed)


def watched_query(manager: Any, method: str, call: Any, *args: Any) -> Any:
    """What a kind's own query ``method`` (a count or a search:
    ``call(*args)``) answers, once it is known to have changed nothing in
    the pool: it runs inside a transaction (the step's, or one opened for
    it), and a change recorded there (a block taken, touched, freed or
    keyed; a call back into the KVCacheManager, refused as re-entrant) is
    undone and reported as the kind's."""
    pool = manager.block_pool
    opened = pool.journal is None
    if opened:
        pool.begin()
    journal = pool.journal
    mark = len(journal)
    # The free count too: a change made past the pool's own calls (its
    # free queue popped directly) records nothing.
    free = pool.free_queue.num_free
    try:
        answer = call(*args)
    except BaseException:
        if opened:
            pool.rollback()
        raise
    changed = (
        any(record[0] != UNDO_CALL for record in journal[mark:])
        or free != pool.free_queue.num_free
    )
    if opened:
        if changed:
            pool.rollback()
        else:
            pool.commit()
    if not changed:
        return answer
    raise result_error(manager, method, CHANGED_POOL)


def check_count_covers(manager: Any, request_id: str, num_tokens: int) -> None:
    """A kind's count of 0 blocks for a running request at ``num_tokens``:
    its table already holds a position for every token (with the
    ``grows_by_count`` promise, a count of 0 passes the step over)."""
    table = manager.req_to_blocks.get(request_id) or ()
    if len(table) * manager.block_size >= num_tokens:
        return
    raise result_error(
        manager,
        "get_num_blocks_to_allocate",
        f"counted 0 blocks for request {request_id!r} at {num_tokens} tokens in "
        f"cache group {manager.kv_cache_group_id}, whose table holds "
        f"{len(table)} blocks of {manager.block_size} tokens; count the "
        "blocks the step's tokens need",
    )


def check_keyed(
    members: Sequence[Any], request: Any, journal: list[Record], mark: int
) -> None:
    """After a kind's keying: every block it keyed (the keys ``journal``
    recorded from ``mark`` on) is in its own group's table of the request,
    keyed by the request's hash of the tokens up to its position's end (a
    later request of another prompt would read it as its prefix)."""
    by_group = {m.kv_cache_group_id: m for m in members}
    rid = request.request_id
    chunks = request.block_hashes
    for record in journal[mark:]:
        if record[0] != UNKEY:
            continue
        gid, pairs = record[1], record[2]
        manager = by_group.get(gid)
        table = manager.req_to_blocks.get(rid) or () if manager else ()
        # Keyed blocks sit near the table's end: look there first.
        start = max(0, len(table) - len(pairs) - 8)
        where = {block: start + i for i, block in enumerate(table[start:]) if block}
        lead = manager or members[0]
        block_size, chunk = lead.block_size, lead.hash_block_size
        for block, key in pairs:
            i = where.get(block)
            if i is None and start:
                where = {b: j for j, b in enumerate(table) if b}
                start = 0
                i = where.get(block)
            if i is not None and prefix_key(chunks, (i + 1) * block_size, chunk) == key:
                continue
            raise result_error(
                members[0],
                "cache_twins",
                f"keyed block {block} under group {gid} for request {rid!r}, "
                "but it is not in that group's table of the request at a "
                "position whose prefix the key is; key each group's blocks "
                "under the request's hash at their position "
                "(block_pool.cache_full_blocks)",
            )


def check_attached(
    manager: Any,
    request_id: str,
    before: Sequence[int],
    blocks: Sequence[int],
    touched: tuple[list[Record], int, Sequence[Any] | None],
) -> None:
    """After a kind's ``add_computed_blocks``: the group's table grew (from
    ``before``) by the admission ``blocks`` at their positions, a block in
    place of a null one only where the group keyed it by the request's
    prefix there (a state shared on the request's path; with the request's
    hashes, the last of ``touched``), and the references moved with it
    (:func:`check_balanced`, from the journal mark in ``touched``): a hit
    block attached untouched would be freed under the request by its other
    holder, and a block of another prefix would be read as this one's."""
    journal, mark, hashes = touched
    table = manager.req_to_blocks.get(request_id) or ()
    grown = list(table[len(before) :])
    if len(grown) != len(blocks) or not all(
        got == want
        or (not want and (hashes is None or _keys_prefix(manager, got, pos, hashes)))
        for pos, (got, want) in enumerate(zip(grown, blocks, strict=True), len(before))
    ):
        raise result_error(
            manager,
            "add_computed_blocks",
            f"attached {shown(grown)} to cache group {manager.kv_cache_group_id}'s "
            f"table of request {request_id!r} for the admission blocks "
            f"{shown(list(blocks))}; append them at their positions (a block in "
            "place of a null one only where the group keyed it by the request's "
            "prefix there) and take one reference on each block added "
            "(block_pool.touch)",
        )
    step = "add_computed_blocks"
    check_balanced((manager,), request_id, step, (before,), (journal, mark))


def _keys_prefix(manager: Any, block: int, pos: int, hashes: Sequence[Any]) -> bool:
    """Whether ``block`` is keyed in ``manager``'s group by the prefix that
    table position ``pos`` ends: the request's hash of the chunk it ends
    (a position not ending on a chunk holds no keyed state)."""
    pool = manager.block_pool
    end = (pos + 1) * manager.block_size
    n, rest = divmod(end, manager.hash_block_size)
    return (
        not rest
        and 0 < n <= len(hashes)
        and pool.key_group[block] == manager.kv_cache_group_id
        and pool.key_hash[block] == hashes[n - 1]
    )
