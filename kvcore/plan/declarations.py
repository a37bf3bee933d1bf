"""What a kind's spec declares to the planner, checked where it crosses in.

A spec's planning methods are plugin code: a grown spec of another type or
block size, or a block count that is not a non-negative int, would plan
memory the manager never holds.  These wrappers refuse such answers with an
error naming the kind.
"""

from __future__ import annotations

import math

from kvcore.errors import PluginError
from kvcore.spec import KVCacheSpec

__all__ = [
    "checked_blocks_held",
    "checked_grown",
    "checked_positive",
    "layer_alignment",
]


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


def checked_positive(spec: KVCacheSpec, what: str, value: object) -> int:
    """A declared size (``element_size``, ``stride_alignment()``,
    ``max_block_growth``), which must be a positive int."""
    if type(value) is not int or value < 1:
        msg = (
            f"{type(spec).__name__}.{what} (kind {spec.kind!r}) is {value!r}; it "
            "must be a positive int"
        )
        raise PluginError(msg, plugin_name=spec.kind)
    return value


def layer_alignment(spec: KVCacheSpec) -> int:
    """The byte alignment a layer imposes on the block stride: its stride
    alignment and its element size."""
    return math.lcm(
        checked_positive(spec, "stride_alignment()", spec.stride_alignment()),
        checked_positive(spec, "element_size", spec.element_size),
    )
