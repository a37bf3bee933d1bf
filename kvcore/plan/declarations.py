"""What a kind's spec declares to the planner, checked where it crosses in.

A spec's planning methods are plugin code: a grown spec of another type or
block size, or a block count that is not a non-negative int, would plan
memory the manager never holds.  These wrappers refuse such answers with an
error naming the kind.
"""

from __future__ import annotations

from kvcore.errors import PluginError
from kvcore.spec import KVCacheSpec

__all__ = ["checked_blocks_held", "checked_grown"]


def checked_grown(spec: KVCacheSpec, factor: int) -> KVCacheSpec | None:
    """``spec.grown(factor)``, which must be ``None`` or a spec of the same
    type with ``factor`` times the block size."""
    grown: object = spec.grown(factor)
    if grown is None:
        return None
    if type(grown) is type(spec):
        if grown.block_size == spec.block_size * factor:
            return grown
        got = f"a {type(grown).__name__} of block_size {grown.block_size}"
    else:
        got = repr(grown)
    msg = (
        f"{type(spec).__name__}.grown({factor}) (kind {spec.kind!r}) returned "
        f"{got}; it must return None or a {type(spec).__name__} with block_size "
        f"{spec.block_size * factor}"
    )
    raise PluginError(msg, plugin_name=spec.kind)


def checked_blocks_held(
    spec: KVCacheSpec, num_computed_tokens: int, num_tokens: int, block_size: int
) -> int:
    """``spec.num_blocks_held(...)``, which must be a non-negative int."""
    held = spec.num_blocks_held(num_computed_tokens, num_tokens, block_size)
    if type(held) is not int or held < 0:
        msg = (
            f"{type(spec).__name__}.num_blocks_held({num_computed_tokens}, "
            f"{num_tokens}, {block_size}) (kind {spec.kind!r}) returned {held!r}; it "
            "must return the non-negative int number of blocks the kind's manager holds"
        )
        raise PluginError(msg, plugin_name=spec.kind)
    return held
