"""A manager's prefix hit, checked where it enters the core.

``find_longest_cache_hit`` is a kind's own search; what it returns becomes
blocks the request reads.  A hit that names a block holding another
prefix's KV (a wrong position, a repeated block, an id computed by hand)
would be read as this request's prefix, so every hit is checked before the
coordinator uses it: one list per group searched, all of one length, and
each block that is not the null block an id of the pool keyed, in its
group, by the prefix ending with it: the request's chunk hash of the tokens
up to the position's end (:func:`~kvcore.coordinator.hashing.prefix_key`;
a kind's own ``block_hash`` cannot move that key), so a block finer than
the hash block is hit only where its prefix ends on a hash-block boundary.

The searches of kvcore's manager bases (prefix, window, checkpoint) read
only the pool's cache tables at each position's key, so their hits hold
this by construction; a class that keeps one of them, built in or not, is
not checked, and every class whose search or ``block_hash`` is its own is
(:func:`~kvcore.coordinator.twins.own_code`, decided once per plan).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcore.coordinator.hashing import prefix_key
from kvcore.coordinator.plugin_results import result_error, shown
from kvcore.errors import PluginResultError

__all__ = ["check_found_hit"]


def check_found_hit(
    found: object, query: Any, managers: Sequence[Any]
) -> list[list[int]]:
    """``found``, what the manager class of ``query``'s groups returned, if
    it is a hit of their blocks (see the module); else a
    :class:`~kvcore.errors.PluginResultError` naming the class and why.
    ``managers``: every group's manager, by group id."""
    gids = query.group_ids
    if type(found) is not list or len(found) != len(gids):
        raise _hit_error(
            managers[gids[0]],
            f"returned {shown(found)}; it must return a list of {len(gids)} "
            "block lists, one per group searched",
        )
    pool = query.block_pool
    key_hash = pool.key_hash
    key_group = pool.key_group
    num_blocks = pool.num_blocks
    chunks = query.chunk_hashes
    chunk_size = pool.hash_block_size
    length = -1
    for gid, blocks in zip(gids, found, strict=True):
        manager = managers[gid]
        if type(blocks) is not list or (length >= 0 and len(blocks) != length):
            raise _hit_error(
                manager,
                f"returned block lists {shown(found)}; each must be a list, "
                "all of one length (the hit's blocks in every group searched)",
            )
        length = len(blocks)
        block_size = manager.block_size
        for i, block in enumerate(blocks):
            if type(block) is not int or not 0 <= block < num_blocks:
                raise _hit_error(
                    manager,
                    f"returned {block!r} ({type(block).__name__}) at position "
                    f"{i} of group {gid}, not a block id of the pool (an int "
                    f"from 0 to {num_blocks - 1})",
                )
            if not block:
                continue
            # The kind's own block_hash cannot move the key a position
            # must hold (None: a position keyed by no prefix).
            key = prefix_key(chunks, (i + 1) * block_size, chunk_size)
            if key is None or key_hash[block] != key or key_group[block] != gid:
                raise _hit_error(
                    manager,
                    f"returned block {block} at position {i} of group {gid}, "
                    "which is not keyed there by the prefix ending with that "
                    "position (a hit's blocks are the cached blocks of its own "
                    "prefix, the null block where the kind reads nothing)",
                )
        if blocks and not manager.hit_serves(blocks):
            raise _hit_error(
                manager,
                f"returned {shown(blocks)} for group {gid}, a hit its own "
                "hit_serves says lacks what the next token reads (a hit of "
                "null blocks only, or a window or state cut off); return the "
                "longest hit that serves, or none",
            )
    # Copies: the lists the kind returned stay its own to reuse.
    return [list(blocks) for blocks in found]


def _hit_error(manager: Any, problem: str) -> PluginResultError:
    return result_error(manager, "find_longest_cache_hit", problem)
