"""Checks of what a :class:`~kvcore.coordinator.block_pool.BlockPool` is
built with and of the block ids handed to it: each names the value, the
rule broken and the fix."""

from __future__ import annotations

from collections.abc import Sequence

from kvcore.errors import KvcoreError, KvcoreTypeError, KvcoreValueError
from kvcore.limits import BLOCK_STATE_BYTES, MAX_NUM_BLOCKS, available_memory_bytes

__all__ = ["check_events_medium", "check_ids", "check_num_blocks"]


def check_num_blocks(num_blocks: object) -> None:
    """A pool's block count: an int from 1 (the null block) to
    MAX_NUM_BLOCKS whose per-block state fits in the host's memory."""
    if type(num_blocks) is not int:
        msg = f"num_blocks must be an int, not {type(num_blocks).__name__}"
        raise KvcoreTypeError(msg)
    if num_blocks < 1:
        msg = (
            f"num_blocks must be >= 1 (block 0 is the null block), got "
            f"{num_blocks}; give the pool more memory or smaller blocks"
        )
        raise KvcoreValueError(msg)
    if num_blocks > MAX_NUM_BLOCKS:
        msg = (
            f"num_blocks is {num_blocks:,}, more than kvcore's limit of "
            f"{MAX_NUM_BLOCKS:,} (MAX_NUM_BLOCKS), checked before the per-block "
            "state is built; plan with larger blocks or fewer of them"
        )
        raise KvcoreValueError(msg)
    available = available_memory_bytes()
    if available is not None and num_blocks * BLOCK_STATE_BYTES > available:
        msg = (
            f"num_blocks is {num_blocks:,}: their coordinator state takes "
            f"about {num_blocks * BLOCK_STATE_BYTES / 2**30:.1f} GiB of host "
            f"memory ({BLOCK_STATE_BYTES} B a block) and "
            f"{available / 2**30:.1f} GiB is available; plan with larger "
            "blocks or fewer of them"
        )
        raise KvcoreValueError(msg)


def check_events_medium(kv_events_medium: object) -> None:
    """The medium KV events name: a non-empty str."""
    if type(kv_events_medium) is not str or not kv_events_medium:
        msg = (
            f"kv_events_medium must be a non-empty str such as 'GPU' or "
            f"'CPU', got {kv_events_medium!r}"
        )
        if type(kv_events_medium) is str:
            raise KvcoreValueError(msg)
        raise KvcoreTypeError(msg)


def check_ids(call: str, blocks: Sequence[object], num_blocks: int) -> None:
    """Refuse, naming it and ``call``, a value in ``blocks`` that is not a
    block id of a pool of ``num_blocks`` (a manager's hit or answer built
    by hand): an int from 0 to ``num_blocks - 1``, not a bool, a numpy int
    or a negative int (which would index the pool's lists from the end)."""
    for block in blocks:
        if type(block) is not int or not 0 <= block < num_blocks:
            raise _not_a_block(call, block, num_blocks)


def _not_a_block(call: str, block: object, num_blocks: int) -> KvcoreError:
    msg = (
        f"{call}: {block!r} ({type(block).__name__}) is not a block id of "
        f"this pool; block ids are ints from 0 to {num_blocks - 1}, handed "
        "out by the pool (a manager passes on only ids it was given)"
    )
    if type(block) is not int:
        return KvcoreTypeError(msg)
    return KvcoreValueError(msg)
