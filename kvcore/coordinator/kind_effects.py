"""What a kind's own step left behind, checked before the step commits.

A step a kind's manager class defines itself (see
:func:`~kvcore.coordinator.twins.defining`) changes the request's tables,
the pool's references and its keys with code the core did not write; an
answer can be right while the tables are not.  The checks here read only
the request's tables and what the step recorded in the pool's journal, so
the core's own steps never pay for them.  Each failure is a
:class:`~kvcore.errors.PluginResultError` naming the manager class, and
the step is undone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import zip_longest
from typing import Any

from kvcore.coordinator.plugin_results import check_new_blocks, result_error, shown
from kvcore.coordinator.pool_journal import (
    RELEASE,
    TOUCH,
    UNDO_CALL,
    UNGET,
    UNKEY,
    Record,
)

__all__ = [
    "check_attached",
    "check_balanced",
    "check_count_covers",
    "check_covers",
    "check_keyed",
    "checked_step",
    "count_of",
    "watched_query",
]


def checked_step(
    method: str,
    members: Sequence[Any],
    args: Sequence[Any],
    new: object,
    marks: tuple[list[Record] | None, int, Sequence[Sequence[int]]],
) -> Any:
    """What a kind's own class step ``method`` (``allocate_twins``,
    ``release_twins`` or ``cache_twins``, called with ``args``) returned
    (``new``), once what it left is checked; ``marks``: the journal, where
    the step's records start and the tables before it."""
    journal, mark, before = marks
    journal = journal or []  # a kind's step runs inside a transaction
    if method == "allocate_twins":
        request_id, num_tokens = args[0], args[1]
        lengths = [len(table) for table in before]
        new = check_new_blocks(members, request_id, new, journal, (mark, lengths))
        check_covers(members, request_id, num_tokens)
    elif method == "release_twins":
        request_id = args[0]  # a freed block left in a table: unbalanced
    else:
        request_id = args[0].request_id
        check_keyed(members, args[0], journal, mark)
    check_balanced(members, request_id, method, before, (journal, mark))
    return new


def check_balanced(
    members: Sequence[Any],
    request_id: str,
    method: str,
    before: Sequence[Sequence[int]],
    since: tuple[list[Record], int],
) -> None:
    """After a kind's step over ``members`` (their tables of the request
    were ``before``): the step changed each block's reference count by as
    much as it changed how often the request's tables list the block (the
    references the pool's journal recorded from the mark in ``since``).  A
    reference dropped on a block the tables do not give up frees it under
    its other holder (another request, another twin's shared hit); one
    taken on a block no table gains is never freed."""
    journal, mark = since
    change: dict[int, int] = {}
    for record in journal[mark:]:
        op = record[0]
        if op in (TOUCH, UNGET, RELEASE):
            step = -1 if op == RELEASE else 1
            for block in record[1]:
                if block:
                    change[block] = change.get(block, 0) + step
    for manager, old in zip(members, before, strict=True):
        table = manager.req_to_blocks.get(request_id) or ()
        size = len(old)
        pairs: Iterable[tuple[int, int]]
        if len(table) == size:
            if table == old:
                continue  # a list as it was (most steps)
            pairs = zip(old, table, strict=True)
        elif len(table) > size and table[:size] == old:
            pairs = zip_longest((), table[size:], fillvalue=0)  # appended to
        else:  # positions changed: compared one by one (0: the null block)
            pairs = zip_longest(old, table, fillvalue=0)
        for was, now in pairs:
            if was != now:
                if was:
                    change[was] = change.get(was, 0) + 1
                if now:
                    change[now] = change.get(now, 0) - 1
    if not change:
        return
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
    count = manager.get_num_blocks_to_allocate
    if watched:
        return watched_query(
            manager,
            "get_num_blocks_to_allocate",
            count,
            request_id,
            num_tokens,
            computed,
        )
    return count(request_id, num_tokens, computed)


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
    try:
        answer = call(*args)
    except BaseException:
        if opened:
            pool.rollback()
        raise
    changed = any(record[0] != UNDO_CALL for record in journal[mark:])
    if opened:
        if changed:
            pool.rollback()
        else:
            pool.commit()
    if not changed:
        return answer
    raise result_error(
        manager,
        method,
        "changed the block pool (took, touched, freed or keyed blocks) while it "
        "was asked; a count or a search reads the pool and the tables and "
        "changes nothing",
    )


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
            end = -1 if i is None else (i + 1) * block_size
            n = end // chunk
            if (
                end > 0
                and not end % chunk
                and n <= len(chunks)
                and chunks[n - 1] == key
            ):
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
    touched: tuple[list[Record], int],
) -> None:
    """After a kind's ``add_computed_blocks``: the group's table grew (from
    ``before``) by the admission ``blocks`` at their positions, a block in
    place of a null one allowed (a state shared on the request's path),
    and the references moved with it (:func:`check_balanced`, from the
    mark in ``touched``): a hit block attached untouched would be freed
    under the request by its other holder."""
    table = manager.req_to_blocks.get(request_id) or ()
    grown = list(table[len(before) :])
    if len(grown) != len(blocks) or not all(
        not want or got == want for got, want in zip(grown, blocks, strict=True)
    ):
        raise result_error(
            manager,
            "add_computed_blocks",
            f"attached {shown(grown)} to cache group {manager.kv_cache_group_id}'s "
            f"table of request {request_id!r} for the admission blocks "
            f"{shown(list(blocks))}; append them at their positions and take one "
            "reference on each block added (block_pool.touch)",
        )
    step = "add_computed_blocks"
    check_balanced((manager,), request_id, step, (before,), touched)
