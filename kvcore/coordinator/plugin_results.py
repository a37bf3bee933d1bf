"""Checks and errors for a manager's answer that the core refuses where it
crosses in: each names the manager class (its module is its plugin), the
method, what it returned (shortened) and the rule."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Any

from kvcore.coordinator.pool_journal import UNDO_CALL, Record, taken_since
from kvcore.errors import KvcoreTypeError, PluginError, PluginResultError

__all__ = [
    "admission_error",
    "CHANGED_POOL",
    "answered_only",
    "BadCount",
    "block_count",
    "check_new_blocks",
    "count_error",
    "grid_answer",
    "group_plugin",
    "result_error",
    "shown",
    "skip_error",
    "within_hit",
]


#: Why a hook that only answers (a count, a search, a request's state, a
#: free's hooks) is refused when it changed the pool.
CHANGED_POOL = (
    "changed the block pool (took, touched, freed or keyed blocks) while it was "
    "asked; it only answers: it reads the pool and the tables and changes nothing"
)


def answered_only(manager: Any, method: str, journal: list[Record], mark: int) -> None:
    """After ``manager``'s hook ``method`` ran inside the open transaction
    whose ``journal`` stood at ``mark``: it recorded nothing but undo calls
    (its own state); a pool change is refused (the step is undone)."""
    if any(record[0] != UNDO_CALL for record in journal[mark:]):
        raise result_error(manager, method, CHANGED_POOL)


def shown(value: object) -> str:
    """``repr(value)``, cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def result_error(manager: Any, method: str, problem: str) -> PluginResultError:
    """``{module}.{class}.{method} {problem}``, raised as the plugin's."""
    owner = f"{type(manager).__module__}.{type(manager).__qualname__}"
    return PluginResultError(
        f"{owner}.{method} {problem}", plugin_name=type(manager).__module__
    )


def group_plugin(coordinator: Any, owner: object) -> tuple[str, str | None] | None:
    """The plugin that registered the kind of the cache group ``owner``
    manages, and its distribution; None where ``owner`` is no group's
    manager.  The block pool names an undo call's owner by it (see
    ``BlockPool.plugin_of``), whoever rolls the failed step back."""
    for gid, manager in enumerate(coordinator.single_type_managers):
        if manager is owner:
            plugin: str = coordinator._owners[gid]
            return plugin, coordinator._distribution(plugin)
    return None


#: The one type a class step's answer lists each group's new blocks in.
_LIST = frozenset((list,))
#: The reference count of every block a step takes and keeps.
_ONE = frozenset((1,))


def check_new_blocks(
    members: Sequence[Any],
    request_id: str,
    new: object,
    journal: list[Record] | None,
    marks: tuple[int, Sequence[int]],
) -> list[list[int]] | None:
    """``allocate_twins``' answer, checked: None, or one list per twin
    group of ``members`` listing only blocks the pool handed out during the
    call (the hand-outs ``journal`` recorded from ``marks[0]`` on), still
    held once, none twice; and either way each group's list must be what
    the call appended to that group's table of the request (from its
    length before the call, ``marks[1]``), in order, null positions left
    out.  The engine appends each group's new blocks to its block table
    and writes the step's KV there, so a block of another request, the
    null block, a block listed twice, under another group or out of order,
    or a table grown by a block no list names, would be overwritten or
    written where no hit reads it."""
    if new is not None:
        new = _handed_out(members, new, journal, marks[0])
    _extends_tables(members, request_id, new, marks[1])
    return new


def _handed_out(
    members: Sequence[Any], new: object, journal: list[Record] | None, mark: int
) -> list[list[int]]:
    """``new`` if it lists, per twin, blocks handed out since ``mark`` and
    held once, each once; else an error naming the manager class."""
    if type(new) is not list or len(new) != len(members):
        raise result_error(
            members[0],
            "allocate_twins",
            f"returned {shown(new)}; it must return None or a list of each "
            f"twin group's new blocks ({len(members)} lists, one per group)",
        )
    taken = taken_since(journal or [], mark)
    ref = members[0].block_pool.ref_cnt
    if len(taken) == 1 and set(map(type, new)) == _LIST:
        given = list(chain.from_iterable(new))
        if given == taken[0] and set(map(ref.__getitem__, given)) <= _ONE:
            return new  # the one hand-out, split in group order, all held
    left = {block for blocks in taken for block in blocks}
    for blocks in new:
        if type(blocks) is not list:
            raise result_error(
                members[0], "allocate_twins", f"returned {shown(blocks)} as a group's new "
                "blocks; each must be a list of block ids"
            )  # fmt: skip
        for block in blocks:
            if block not in left or ref[block] != 1:
                raise result_error(
                    members[0],
                    "allocate_twins",
                    f"returned block {block!r} among the new blocks of "
                    f"{shown(new)}, which the block pool did not hand out in "
                    "this call or which is no longer held (another request's "
                    "block, the null block, one listed twice or one freed "
                    "again); return only the blocks it took from "
                    "block_pool.get_new_blocks and keeps, each once",
                )
            left.discard(block)
    return new


def _extends_tables(
    members: Sequence[Any],
    request_id: str,
    new: list[list[int]] | None,
    lengths: Sequence[int],
) -> None:
    """Each group's table of the request, past its length before the call
    and without null positions, must be that group's new blocks (none for
    a None answer); else an error naming the first group that differs."""
    null = members[0].null_block
    for i, manager in enumerate(members):
        blocks = new[i] if new is not None else []
        table = manager.req_to_blocks.get(request_id) or ()
        grown = list(table[lengths[i] :])
        if null in grown:
            grown = [block for block in grown if block != null]
        if grown == blocks:
            continue
        raise result_error(
            members[0],
            "allocate_twins",
            f"returned {shown(blocks)} as the new blocks of cache group "
            f"{manager.kv_cache_group_id} for request {request_id!r}, but "
            f"that group's table grew by {shown(list(grown))} (null positions "
            "left out); return each group's new blocks in that group's list, "
            "in group order, exactly as appended to its table",
        )


class BadCount(KvcoreTypeError):
    """A manager's block count that is not an int of at least 0, raised
    inside a guarded call; the coordinator's ``plugin_error`` turns it into
    a :class:`PluginResultError` naming the group's plugin (see
    :func:`count_error`)."""

    def __init__(self, value: object) -> None:
        super().__init__(f"returned {shown(value)} blocks")
        self.value = value


def block_count(value: object) -> int:
    """A manager's block count, checked (a plugin may return anything)."""
    if type(value) is not int or value < 0:
        raise BadCount(value)
    return value


def count_error(
    manager: Any, method: str, value: object, plugin: str, distribution: str | None
) -> PluginResultError:
    """The error for ``manager``'s ``method`` answering ``value`` where the
    core takes a block count: the step takes that many blocks from the pool,
    so only an ``int`` of at least 0 is one (a float, bool or numpy integer
    is refused by type, as an index or a sum would mishandle it)."""
    gid = manager.kv_cache_group_id
    kind = manager.kv_cache_spec.kind
    where = f" (distribution {distribution!r})" if distribution else ""
    owner = f"{type(manager).__module__}.{type(manager).__qualname__}"
    msg = (
        f"{owner}.{method} of cache group {gid} (kind {kind!r}, plugin "
        f"{plugin!r}{where}) returned {shown(value)} ({type(value).__name__}); "
        "a block count must be an int of at least 0 (not a bool, float or "
        "numpy integer): return int(...) of a non-negative count. The step was "
        "refused and the block pool is as it was before it; fix the plugin or "
        f"block it with KVCORE_DISABLE_PLUGINS={plugin}"
    )
    return PluginResultError(msg, plugin_name=plugin, distribution=distribution)


def skip_error(
    manager: Any, num_computed_tokens: int, value: object
) -> PluginResultError:
    """The error for ``num_skipped_blocks(num_computed_tokens)`` answering
    ``value``: the leading table positions a request never reads again are
    an int from 0 to the blocks its computed tokens fill (a larger answer
    would pad its table with null blocks past anything it holds)."""
    bound = num_computed_tokens // manager.block_size
    return result_error(
        manager,
        "num_skipped_blocks",
        f"returned {shown(value)} ({type(value).__name__}) for "
        f"{num_computed_tokens} computed tokens in cache group "
        f"{manager.kv_cache_group_id}; it must return an int from 0 to "
        f"{bound} (the whole {manager.block_size}-token blocks those tokens "
        "fill: a request never skips a position it has not computed), as "
        "the table is padded with the null block up to it; fix the plugin's "
        "release rule",
    )


def grid_answer(manager: Any, method: str, owners: Sequence[str]) -> Any:
    """``manager.grid_point_blocks()`` (an int of at least 0) or
    ``manager.grid_pool_share()`` (a number from 0 to 1), checked where
    it enters the core, at construction."""
    gid = manager.kv_cache_group_id
    owner = f"{type(manager).__module__}.{type(manager).__qualname__}"
    plugin = owners[gid]
    try:
        answer = getattr(manager, method)()
    except Exception as exc:
        msg = (
            f"{owner}.{method}() of cache group {gid} (plugin {plugin!r}) "
            f"raised while the KV cache manager was built: "
            f"{type(exc).__name__}: {exc}; fix the plugin or block it with "
            f"KVCORE_DISABLE_PLUGINS={plugin}"
        )
        raise PluginError(msg, plugin_name=plugin) from exc
    if method == "grid_point_blocks":
        ok = type(answer) is int and answer >= 0
        rule = (
            "an int of at least 0: the blocks a running request keeps in "
            "the group at each point of its grid"
        )
    else:
        ok = type(answer) in (int, float) and 0 <= answer <= 1
        rule = (
            "a number from 0 to 1: the share of the pool one request's "
            "grid may take (0: no limit)"
        )
    if not ok:
        msg = (
            f"{owner}.{method}() returned {answer!r} for cache group {gid}; "
            f"it must return {rule}"
        )
        raise PluginResultError(msg, plugin_name=plugin)
    return answer


def within_hit(attach: list[int], hit: Sequence[int], null: int) -> bool:
    """Whether admission blocks are the hit's blocks at their own
    positions, the null block anywhere (skipped, or a state a connector
    loads)."""
    if len(attach) > len(hit) and any(b != null for b in attach[len(hit) :]):
        return False
    return all(a in (h, null) for a, h in zip(attach, hit, strict=False))


def admission_error(
    manager: Any, hit: Sequence[int], attach: object
) -> PluginResultError:
    return result_error(
        manager,
        "admission_blocks",
        f"returned {shown(attach)} for cache group {manager.kv_cache_group_id}'s "
        f"hit {list(hit)[:8]!r}; it must return a list of the hit's blocks at "
        "their positions, the null block where the kind skips one (a block of "
        "its own choosing would be attached to the request as computed)",
    )
