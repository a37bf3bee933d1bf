"""Every check a plan passes before anything binds it, wherever it came
from: the planner, a config file, a shipped pipeline plan, another rank.

The heart is a proof, by arithmetic, that a plan's pages never share bytes.

Every byte a tensor binds is ``offset + l*Sl + b*Sb + h*Sh + n*Sn + c*Sc``
for ``l < L, b < B, h < H, n < N, c < C``: a lattice.  Two pages may share
bytes only when they are the same block of two different cache groups (a
block id belongs to one group at a time, so groups overlay each other).
Everything else (two layers of one group, two blocks of any groups, a layer
listed in two tensors) must be disjoint.

The proof peels the widest stride off every lattice at once: when what lies
under that stride fits inside one stride of it, points at different indices
of the peeled axis fall in different windows and only equal windows need a
closer look.  A lattice left with no common widest axis is injective when
each stride clears everything beneath it.  These are sufficient conditions:
a plan the proof cannot settle is refused as one that may alias, never
bound.  Every plan kvcore places passes them, in every layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvcore.errors import SerializationError, UnsafePlanError, echo
from kvcore.layout import AXIS_C, AXIS_H, AXIS_N, KVCacheLayout
from kvcore.limits import MAX_BYTE_OFFSET, MAX_NAME_CHARS, MAX_NUM_BLOCKS
from kvcore.plan.placement import tensor_strides
from kvcore.spec import KVCacheSpec
from kvcore.structs import KVCacheConfig, KVCacheTensor
from kvcore.tokens import check_token_count

__all__ = ["check_config", "check_disjoint", "check_placement", "page_strides"]


@attrs.frozen
class _Axis:
    stride: int
    size: int
    is_block: bool = False


@attrs.frozen
class _Lattice:
    """The bytes of one tensor (or what is left of it after peeling)."""

    base: int
    axes: tuple[_Axis, ...]
    group: int
    tensor: int

    @property
    def last(self) -> int:
        return self.base + sum((a.size - 1) * a.stride for a in self.axes)


def page_strides(
    tensor: KVCacheTensor,
    spec: KVCacheSpec,
    layout: KVCacheLayout | None,
    *,
    num_blocks: int,
    bytes_per_block: int,
) -> tuple[int, int, int]:
    """Byte strides of a page's ``[H, N, C]`` axes: the plan's own, or for a
    hand-built tensor the ones the layout gives (as the pool binds them);
    with no layout known yet, a dense page (the pool checks again with the
    layout it binds)."""
    if tensor.page_strides is not None:
        return tensor.page_strides
    if layout is None:
        _, n, c = spec.page_grid
        return n * c, c, 1
    strides = tensor_strides(
        spec,
        layout,
        num_layers=len(tensor.layers),
        num_blocks=num_blocks,
        bytes_per_block=bytes_per_block or tensor.block_stride,
        layer_stride=tensor.layer_stride,
    )
    return strides[AXIS_H], strides[AXIS_N], strides[AXIS_C]


def _lattice(
    tid: int,
    tensor: KVCacheTensor,
    gid: int,
    spec: KVCacheSpec,
    strides: tuple[int, int, int],
    num_blocks: int,
) -> _Lattice:
    h, n, c = spec.page_grid
    axes = [
        _Axis(tensor.layer_stride, len(tensor.layers)),
        _Axis(tensor.block_stride, num_blocks, is_block=True),
        _Axis(strides[0], h),
        _Axis(strides[1], n),
        _Axis(strides[2], c),
    ]
    return _Lattice(tensor.offset, tuple(a for a in axes if a.size > 1), gid, tid)


def _injective(lattice: _Lattice) -> bool:
    """Each stride, smallest first, clears the extent of all below it."""
    reach = 0
    for axis in sorted(lattice.axes, key=lambda a: a.stride):
        if axis.stride <= reach:
            return False
        reach += (axis.size - 1) * axis.stride
    return True


def _peel(lattice: _Lattice, stride: int) -> tuple[_Axis | None, _Lattice] | None:
    """The axis of ``stride`` (None if the lattice has none) and the rest;
    None when two axes share the stride (no window separates them)."""
    found = [a for a in lattice.axes if a.stride == stride]
    if len(found) > 1:
        return None
    rest = tuple(a for a in lattice.axes if a.stride != stride)
    return (found[0] if found else None), attrs.evolve(lattice, axes=rest)


def _window(rest: _Lattice, origin: int, stride: int) -> int | None:
    """The window of ``stride`` (counted from ``origin``) holding all of
    ``rest``, or None when it straddles two."""
    first = (rest.base - origin) // stride
    return first if (rest.last - origin) // stride == first else None


def _disjoint(a: _Lattice, b: _Lattice, same_block: bool) -> bool:
    """Whether ``a`` and ``b`` share no byte (``same_block``: points of one
    block of two groups, which may alias)."""
    if a.last < b.base or b.last < a.base:
        return True
    if same_block and a.group != b.group:
        return True
    if not a.axes and not b.axes:
        return a.base != b.base
    widest = max(axis.stride for axis in (*a.axes, *b.axes))
    peeled_a, peeled_b = _peel(a, widest), _peel(b, widest)
    if peeled_a is None or peeled_b is None:
        return False
    (axis_a, rest_a), (axis_b, rest_b) = peeled_a, peeled_b
    for origin in (min(a.base, b.base), max(a.base, b.base)):
        wa, wb = _window(rest_a, origin, widest), _window(rest_b, origin, widest)
        if wa is None or wb is None:
            continue
        size_a = axis_a.size if axis_a else 1
        size_b = axis_b.size if axis_b else 1
        if wa + size_a <= wb or wb + size_b <= wa:
            return True
        blocks = bool(axis_a and axis_b and axis_a.is_block and axis_b.is_block)
        if _disjoint(
            attrs.evolve(rest_a, base=rest_a.base - wa * widest),
            attrs.evolve(rest_b, base=rest_b.base - wb * widest),
            same_block or (blocks and wa == wb),
        ):
            return True
    return False


def check_disjoint(
    config: KVCacheConfig, layout: KVCacheLayout | None, *, where: str = "$"
) -> None:
    """Refuse a plan in which two pages that may be live at once share a
    byte: two layers of one group, two blocks, a tensor over itself.

    :raises UnsafePlanError: naming the tensors and the rule.
    """
    group_of = {
        name: gid
        for gid, group in enumerate(config.kv_cache_groups)
        for name in group.layer_names
    }
    lattices: dict[bool, list[_Lattice]] = {}
    for tid, tensor in enumerate(config.kv_cache_tensors):
        gid = group_of[tensor.layers[0]]
        spec = config.kv_cache_groups[gid].layer_spec(tensor.layers[0])
        strides = page_strides(
            tensor,
            spec,
            layout,
            num_blocks=config.num_blocks,
            bytes_per_block=config.bytes_per_block,
        )
        lattice = _lattice(tid, tensor, gid, spec, strides, config.num_blocks)
        if not _injective(lattice):
            msg = (
                f"{where}.kv_cache_tensors[{tid}]: the pages of layers "
                f"{echo(tensor.layers)} overlap one another (layer stride "
                f"{tensor.layer_stride}, block stride {tensor.block_stride}, page "
                f"strides {strides} over a {spec.page_grid} page); every layer and "
                "block needs its own bytes, re-plan rather than edit the config"
            )
            raise UnsafePlanError(msg)
        lattices.setdefault(tensor.host_resident, []).append(lattice)
    for group in lattices.values():
        _check_pairs(group, config, where)


def _check_pairs(
    lattices: Sequence[_Lattice], config: KVCacheConfig, where: str
) -> None:
    """Every two tensors of one allocation, swept by their byte spans."""
    ordered = sorted(lattices, key=lambda lat: lat.base)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if b.base > a.last:
                break
            if _disjoint(a, b, same_block=False):
                continue
            first, second = sorted((a, b), key=lambda lat: lat.tensor)
            tensors = config.kv_cache_tensors
            rule = (
                "layers of one group must be disjoint"
                if first.group == second.group
                else "two groups may share a block's bytes only within one block id"
            )
            msg = (
                f"{where}.kv_cache_tensors[{second.tensor}]: layer "
                f"{echo(tensors[second.tensor].layers[0])} (cache group "
                f"{second.group}) may share bytes with layer "
                f"{echo(tensors[first.tensor].layers[0])} "
                f"({where}.kv_cache_tensors[{first.tensor}], cache group "
                f"{first.group}) within bytes {max(a.base, b.base):,} to "
                f"{min(a.last, b.last) + 1:,}; {rule}, re-plan rather than edit the config"
            )
            raise UnsafePlanError(msg)


def _page_extent(
    tensor: KVCacheTensor, spec: KVCacheSpec, config: KVCacheConfig
) -> int:
    """Bytes from the first to one past the last byte of one page."""
    h, n, c = spec.page_grid
    sh, sn, sc = page_strides(
        tensor,
        spec,
        config.kv_cache_layout,
        num_blocks=config.num_blocks,
        bytes_per_block=config.bytes_per_block,
    )
    return (h - 1) * sh + (n - 1) * sn + (c - 1) * sc + 1


def check_config(config: KVCacheConfig) -> None:
    """Refuse a config a worker could not bind safely, naming the field:
    ``bytes_per_block`` not positive, more than
    :data:`~kvcore.limits.MAX_NUM_BLOCKS` blocks, a token count out of
    range, then everything :func:`check_placement` refuses."""
    if config.num_blocks > MAX_NUM_BLOCKS:
        msg = (
            f"$.num_blocks: {config.num_blocks:,} blocks is more than kvcore's "
            f"limit of {MAX_NUM_BLOCKS:,} (MAX_NUM_BLOCKS); plan with larger blocks "
            "or fewer of them"
        )
        raise UnsafePlanError(msg)
    for field in (
        "scheduler_block_size",
        "hash_block_size",
        "max_model_len",
        "target_context",
        "max_num_batched_tokens",
    ):
        value = getattr(config, field)
        if value is not None:
            check_token_count(value, f"$.{field}", minimum=1)
    if config.kv_cache_groups and config.bytes_per_block < 1:
        msg = (
            f"$.bytes_per_block must be a positive number of bytes, got "
            f"{echo(config.bytes_per_block)}; re-plan rather than edit the config"
        )
        raise UnsafePlanError(msg)
    check_placement(config, config.kv_cache_layout)


def check_placement(config: KVCacheConfig, layout: KVCacheLayout | None) -> None:
    """Refuse a placement a worker could not bind safely: a group's layer
    with no tensor or with two, a tensor's layer in no group or in another
    group's tensor, a tensor reaching past its pool, tensors of one
    residency of different sizes, and any two pages that may be live at
    once sharing a byte (:func:`check_disjoint`, in ``layout``)."""
    group_of: dict[str, int] = {}
    for gid, group in enumerate(config.kv_cache_groups):
        for name in group.layer_names:
            _printable_name(name, "a layer name", f"$.kv_cache_groups[{gid}]")
            if name in group_of:
                msg = (
                    f"$.kv_cache_groups[{gid}].layer_names: layer {echo(name)} is "
                    f"also in group {group_of[name]}; a layer belongs to one group"
                )
                raise UnsafePlanError(msg)
            group_of[name] = gid
    placed: dict[str, int] = {}
    sizes: dict[bool, int] = {}
    for tid, tensor in enumerate(config.kv_cache_tensors):
        at = f"$.kv_cache_tensors[{tid}]"
        for field, value in (
            ("size", tensor.size),
            ("offset", tensor.offset),
            ("layer_stride", tensor.layer_stride),
            ("block_stride", tensor.block_stride),
            *(("page_strides", s) for s in tensor.page_strides or ()),
        ):
            if not 0 <= value <= MAX_BYTE_OFFSET:
                msg = (
                    f"{at}.{field} is {value:,}; byte sizes, offsets and strides lie "
                    f"in [0, {MAX_BYTE_OFFSET:,}] (MAX_BYTE_OFFSET), re-plan rather "
                    "than edit the config"
                )
                raise UnsafePlanError(msg)
        for name in tensor.layers:
            if name not in group_of:
                msg = (
                    f"{at}.layers: layer {echo(name)} is in no cache group; list it "
                    "in one group's layer_names or drop the tensor"
                )
                raise UnsafePlanError(msg)
            if name in placed:
                msg = (
                    f"{at}.layers: layer {echo(name)} already has a tensor "
                    f"($.kv_cache_tensors[{placed[name]}]); a layer lives in one tensor"
                )
                raise UnsafePlanError(msg)
            if group_of[name] != group_of[tensor.layers[0]]:
                msg = (
                    f"{at}.layers: layers {echo(tensor.layers[0])} and {echo(name)} "
                    "are in different cache groups; a tensor holds one group's layers"
                )
                raise UnsafePlanError(msg)
            placed[name] = tid
        size = sizes.setdefault(tensor.host_resident, tensor.size)
        if size != tensor.size:
            msg = (
                f"{at}.size is {tensor.size}, but the other tensors of its residency "
                f"have size {size}; they share one allocation"
            )
            raise UnsafePlanError(msg)
        group = config.kv_cache_groups[group_of[tensor.layers[0]]]
        spec = group.layer_spec(tensor.layers[0])
        end = (
            tensor.offset
            + (len(tensor.layers) - 1) * tensor.layer_stride
            + (config.num_blocks - 1) * tensor.block_stride
            + _page_extent(tensor, spec, config)
        )
        if end > tensor.size:
            msg = (
                f"{at}: the pages of layers {echo(tensor.layers)} reach byte {end:,} "
                f"of a {tensor.size:,}-byte {'host-resident' if tensor.host_resident else 'device'} pool ({config.num_blocks} blocks of "
                f"stride {tensor.block_stride}); re-plan rather than edit the config"
            )
            raise UnsafePlanError(msg)
    for group in config.kv_cache_groups:
        for name in group.layer_names:
            if name not in placed:
                msg = (
                    f"$.kv_cache_groups[{group_of[name]}].layer_names: layer "
                    f"{echo(name)} has no tensor in $.kv_cache_tensors, so a worker "
                    "could bind no view for it; re-plan rather than edit the config"
                )
                raise UnsafePlanError(msg)
    check_disjoint(config, layout)


def _printable_name(value: object, what: str, where: str) -> str:
    """A non-empty string with no control characters (names reach
    terminals, tables and file names)."""
    if type(value) is not str or not value.strip() or len(value) > MAX_NAME_CHARS:
        msg = (
            f"{where}: {what} must be a non-empty string of at most "
            f"{MAX_NAME_CHARS} characters, got {echo(value)} "
            f"({type(value).__name__}); write it as a JSON string"
        )
        raise SerializationError(msg)
    if not value.isprintable():
        msg = (
            f"{where}: {what} {echo(value)} holds control characters; names "
            "must be printable text"
        )
        raise SerializationError(msg)
    return value
