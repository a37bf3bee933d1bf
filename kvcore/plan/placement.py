"""Placement: bytes per block, layout checks, strides and the plan's tensors.

Groups overlay each other from byte 0 of every block (a block id is owned by
one group at a time), so a block is the widest group's packing, rounded up to
one lcm of every alignment.  Inside a block a group's layers are laid out by
spec, in first-appearance order.  Every stride is computed here, once; the
pool reads them from the plan.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from kvcore.errors import LayoutError, PlanError
from kvcore.layout import (
    AXIS_B,
    AXIS_C,
    AXIS_H,
    AXIS_L,
    AXIS_N,
    KVCacheLayout,
    compute_layout_strides,
)
from kvcore.plan.declarations import layer_alignment
from kvcore.spec import KVCacheSpec, round_up
from kvcore.structs import KVCacheGroupSpec, KVCacheTensor

__all__ = [
    "build_kv_cache_tensors",
    "kv_cache_bytes_per_block",
    "raise_mixed_pages",
    "tensor_strides",
    "validate_kv_cache_layout",
]


def kv_cache_bytes_per_block(
    groups: Sequence[KVCacheGroupSpec], layout: KVCacheLayout | None = None
) -> int:
    """Bytes of one block of the pool.

    Block-outer layouts (and ``layout=None``): the widest group's packed
    bytes, rounded up to ONE lcm of every layer's stride alignment (a hot
    page counts as one) and element size.  Layer-outer layouts: the widest
    group's sum of pages, each rounded up to its own alignment, since each
    layer's pages are strided by that page alone.
    """
    if not groups:
        msg = "cannot size a block for a plan with no cache groups"
        raise PlanError(msg)
    if layout is not None and not layout.is_block_outermost:
        widest = max(
            sum(
                round_up(s.page_size_bytes, s.stride_alignment())
                for s in g.layer_specs()
            )
            for g in groups
        )
        alignment = 1
    else:
        widest = max(g.packed_bytes for g in groups)
        alignment = math.lcm(
            *(layer_alignment(s) for g in groups for s in g.layer_specs())
        )
    if widest <= 0:
        msg = f"cache groups have no bytes per block (widest group: {widest} bytes)"
        raise PlanError(msg)
    return round_up(widest, alignment)


def raise_mixed_pages(layout: KVCacheLayout, specs: Iterable[KVCacheSpec]) -> None:
    pages = sorted({s.page_size_bytes for s in specs})
    msg = (
        f"KV cache layout {layout.name} cannot express this model's mixed page "
        f"sizes ({pages}): several cache groups of different page sizes overlay "
        "only in a block-outermost, block-compact layout; use BLHNC or BLNHC "
        "(the attention backend should declare them supported)"
    )
    raise LayoutError(msg)


def validate_kv_cache_layout(
    layout: KVCacheLayout, groups: Sequence[KVCacheGroupSpec]
) -> None:
    """Raise a :class:`~kvcore.errors.LayoutError` if ``layout`` cannot hold
    the groups: mixed page sizes need a block-compact layout, and a
    layer-outer one only for a single group; some kinds need the block axis
    outermost."""
    specs = [s for g in groups for s in g.layer_specs()]
    if len({s.page_size_bytes for s in specs}) > 1 and (
        not layout.is_block_compact or (layout.is_layer_compact and len(groups) > 1)
    ):
        raise_mixed_pages(layout, specs)
    for group in groups:
        for name in group.layer_names:
            spec = group.layer_spec(name)
            if spec.requires_block_outer_layout and not layout.is_block_outermost:
                msg = (
                    f"layer {name!r} ({spec.kind}) needs a block-outermost KV "
                    f"layout, got {layout.name}; use BLHNC or BLNHC"
                )
                raise LayoutError(msg)


def runs_by_spec(group: KVCacheGroupSpec) -> list[tuple[KVCacheSpec, list[str]]]:
    """The group's layers bucketed by spec equality, in first-appearance order."""
    runs: dict[KVCacheSpec, list[str]] = {}
    for name in group.layer_names:
        runs.setdefault(group.layer_spec(name), []).append(name)
    return list(runs.items())


def tensor_strides(
    spec: KVCacheSpec,
    layout: KVCacheLayout,
    *,
    num_layers: int,
    num_blocks: int,
    bytes_per_block: int,
    layer_stride: int | None = None,
) -> tuple[int, int, int, int, int]:
    """Byte strides ``[L, B, H, N, C]`` of a run of layers with one spec."""
    h, n, c = spec.page_grid
    fixed: dict[int, int] = {}
    page = spec.page_size_bytes
    if layout.is_block_outermost:
        fixed[AXIS_B] = bytes_per_block
    elif layout.is_block_compact:
        page = round_up(page, spec.stride_alignment())
        fixed[AXIS_B] = page
    if layer_stride is not None:
        fixed[AXIS_L] = layer_stride
    return compute_layout_strides(
        layout, (num_layers, num_blocks, h, n, c), page_bytes=page, fixed=fixed
    )


def _check_element_alignment(
    layers: list[str], spec: KVCacheSpec, offset: int, strides: Sequence[int]
) -> None:
    """A typed view needs every byte offset and stride on an element boundary."""
    size = spec.element_size
    bad = [
        (what, value)
        for what, value in (
            ("offset", offset),
            ("layer stride", strides[AXIS_L]),
            ("block stride", strides[AXIS_B]),
            ("head stride", strides[AXIS_H]),
            ("state stride", strides[AXIS_N]),
        )
        if value % size
    ]
    if bad:
        what, value = bad[0]
        msg = (
            f"layer {layers[0]!r} ({spec.kind}) has elements of {size} bytes but "
            f"its {what} is {value} bytes, not a multiple of {size}: a worker "
            "could not bind it. Pad the pages of the layers before it "
            "(alignment=... or page_size_padded=...) to a multiple of "
            f"{size} bytes, or order narrow layers after wide ones"
        )
        raise LayoutError(msg)


def _check_stride_alignment(
    layers: list[str], spec: KVCacheSpec, layout: KVCacheLayout, block_stride: int
) -> None:
    """The distance between a layer's consecutive blocks must honour its
    stride alignment.  Block-compact and block-outer layouts round it up; a
    layout with heads outside blocks (LHBNC) puts blocks one head's slice
    apart and cannot pad that slice, so it must refuse."""
    alignment = layer_alignment(spec)
    if block_stride % alignment:
        msg = (
            f"layer {layers[0]!r} ({spec.kind}) needs a block stride that is a "
            f"multiple of {alignment} bytes, but KV cache layout {layout.name} "
            f"puts its consecutive blocks {block_stride} bytes apart (one head's "
            "slice of a page, which this layout cannot pad); use a block-compact "
            "layout (LBHNC, LBNHC, BLHNC or BLNHC)"
        )
        raise LayoutError(msg)


def build_kv_cache_tensors(
    groups: Sequence[KVCacheGroupSpec],
    *,
    num_blocks: int,
    size: int,
    layout: KVCacheLayout,
    bytes_per_block: int,
    host_resident: bool = False,
) -> list[KVCacheTensor]:
    """One tensor per (group, spec): every group restarts at byte 0."""
    tensors: list[KVCacheTensor] = []
    for group in groups:
        offset = 0
        for spec, layers in runs_by_spec(group):
            strides = tensor_strides(
                spec,
                layout,
                num_layers=len(layers),
                num_blocks=num_blocks,
                bytes_per_block=bytes_per_block,
            )
            _check_element_alignment(layers, spec, offset, list(strides))
            _check_stride_alignment(layers, spec, layout, strides[AXIS_B])
            tensors.append(
                KVCacheTensor(
                    size=size,
                    layers=list(layers),
                    layer_stride=strides[AXIS_L],
                    block_stride=strides[AXIS_B],
                    offset=offset,
                    host_resident=host_resident,
                    page_strides=(strides[AXIS_H], strides[AXIS_N], strides[AXIS_C]),
                )
            )
            # A run spans its layers' pages inside each block (block-outer) or
            # its layers' whole regions (layer-outer).
            offset += len(layers) * (
                spec.page_size_bytes if layout.is_block_outermost else strides[AXIS_L]
            )
    return tensors
