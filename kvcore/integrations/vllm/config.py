"""kvcore's plan as the ``KVCacheConfig`` vLLM's workers allocate and bind.

vLLM 0.33 places a KV cache the way kvcore does: one backing allocation,
cache groups overlaid from byte 0, and per run of same-spec layers a
``KVCacheTensor`` with a byte offset, a layer stride and a block stride.  Its
worker (``vllm.v1.worker.utils.allocate_kv_cache``) takes those two strides
as given and derives the strides inside a page (heads, states, content) from
the layer's spec and the layout, closing the page at ``page_size_padded``.
So a plan crosses when, for every tensor, the page strides vLLM derives are
the ones kvcore placed, and every layer's vLLM spec has kvcore's page grid
and page bytes.  :func:`vllm_placement` checks that and computes the
placement with kvcore objects only; :func:`to_vllm_kv_cache_config` builds
vLLM's objects from it (and needs vLLM).

A plan that cannot cross is refused with :class:`PlanNotExpressibleError`,
naming the layer, the rule and the fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvcore.errors import KvcoreTypeError, PlanError
from kvcore.layout import AXIS_B, AXIS_L, KVCacheLayout
from kvcore.spec import KVCacheSpec, UniformTypeKVCacheSpecs
from kvcore.structs import KVCacheConfig, KVCacheGroupSpec

__all__ = [
    "VLLM_SPEC_TYPES",
    "PlanNotExpressibleError",
    "VllmPlacement",
    "VllmTensor",
    "to_vllm_groups",
    "to_vllm_kv_cache_config",
    "to_vllm_spec",
    "vllm_page_strides",
    "vllm_placement",
]

#: kvcore kind -> the vLLM 0.33 spec class its layers become.
VLLM_SPEC_TYPES = {
    "full_attention": "FullAttentionSpec",
    "mla": "MLAAttentionSpec",
    "sliding_window": "SlidingWindowSpec",
    "sliding_window_mla": "SlidingWindowMLASpec",
    "chunked_local_attention": "ChunkedLocalAttentionSpec",
    "cross_attention": "CrossAttentionSpec",
    "circular_buffer": "CircularBufferSpec",
    "mamba": "MambaSpec",
}


class PlanNotExpressibleError(PlanError):
    """A kvcore plan that vLLM's ``KVCacheConfig`` cannot express (so vLLM's
    workers would bind other bytes than kvcore placed)."""


@attrs.frozen
class VllmTensor:
    """One ``KVCacheTensor`` of vLLM: layer ``layers[l]``'s page of block
    ``b`` starts at ``offset + l * layer_stride + b * block_stride``."""

    size: int
    layers: tuple[str, ...]
    layer_stride: int
    block_stride: int
    offset: int


@attrs.frozen
class VllmPlacement:
    """What vLLM's workers are told: the blocks, the layout, the tensors and
    each layer's ``page_size_padded`` (``None``: an unpadded page)."""

    num_blocks: int
    layout: str
    tensors: tuple[VllmTensor, ...]
    page_size_padded: Mapping[str, int | None]


def _refuse(
    layer: str, spec: KVCacheSpec, rule: str, fix: str
) -> PlanNotExpressibleError:
    return PlanNotExpressibleError(
        f"kvcore.integrations.vllm: layer {layer!r} ({spec.kind}) cannot be handed "
        f"to vLLM's workers: {rule}; {fix}"
    )


def vllm_page_strides(
    layout: KVCacheLayout,
    shape: tuple[int, int, int, int, int],
    *,
    page_size_padded: int | None,
    layer_stride: int,
    block_stride: int,
) -> tuple[int, int, int, int, int] | None:
    """The byte strides ``[L, B, H, N, C]`` vLLM 0.33's worker gives a
    tensor (``compute_layout_strides`` with the tensor's layer and block
    strides fixed), or ``None`` where vLLM's worker refuses the padded page
    (padding needs every axis outside the page to be L, B or of size 1).

    :param shape: ``(layers, blocks, H, N, C)`` with C in bytes.
    """
    order = layout.value
    grid_end = max(order.index(AXIS_L), order.index(AXIS_B)) + 1
    if page_size_padded is not None:
        outside = 1
        for axis in order[:grid_end]:
            outside *= shape[axis]
        if outside != shape[AXIS_L] * shape[AXIS_B]:
            return None
    fixed = {AXIS_L: layer_stride, AXIS_B: block_stride}
    strides = [0, 0, 0, 0, 0]
    running = 1
    for position in range(len(order) - 1, -1, -1):
        axis = order[position]
        if page_size_padded is not None and position == grid_end - 1:
            running = max(running, page_size_padded)
            if running % page_size_padded:
                return None
        strides[axis] = fixed.get(axis) or running
        running = strides[axis] * shape[axis]
    return (strides[0], strides[1], strides[2], strides[3], strides[4])


def _padded(spec: KVCacheSpec) -> int | None:
    """The page size vLLM's spec must carry as ``page_size_padded``."""
    page = spec.page_size_bytes
    return page if page != spec.real_page_size_bytes else None


def vllm_placement(plan: KVCacheConfig) -> VllmPlacement:
    """The placement vLLM's workers bind for ``plan``, checked to be
    kvcore's own, byte for byte.  Needs no vLLM.

    Refuses (:class:`PlanNotExpressibleError`) host-resident tensors (vLLM
    keeps those in its HiSparse host pool, which kvcore does not plan),
    layers of kinds vLLM has no spec for, and tensors whose page strides
    vLLM would derive differently.
    """
    given: object = plan
    if not isinstance(given, KVCacheConfig):
        msg = (
            "kvcore.integrations.vllm: vllm_placement takes a kvcore plan (the "
            f"KVCacheConfig kvcore.plan_kv_cache returns), got {type(given).__name__}"
        )
        raise KvcoreTypeError(msg)
    layout = plan.kv_cache_layout
    if layout is None:
        msg = (
            "kvcore.integrations.vllm: the plan carries no KV cache layout, and "
            "vLLM's workers bind every layer in the layout the engine resolved; "
            "plan with CacheConfig(kv_cache_layout=...) set to that layout"
        )
        raise PlanNotExpressibleError(msg)
    group_of = {n: g for g in plan.kv_cache_groups for n in g.layer_names}
    padding: dict[str, int | None] = {}
    tensors: list[VllmTensor] = []
    for tensor in plan.kv_cache_tensors:
        first = tensor.layers[0]
        group = group_of.get(first)
        if group is None:
            msg = (
                f"kvcore.integrations.vllm: tensor layer {first!r} is in no cache group"
            )
            raise PlanNotExpressibleError(msg)
        spec = group.layer_spec(first)
        if spec.kind not in VLLM_SPEC_TYPES:
            raise _refuse(
                first,
                spec,
                f"vLLM 0.33 has no cache spec for kind {spec.kind!r} (it has one "
                f"for {', '.join(VLLM_SPEC_TYPES)})",
                "leave this model on vLLM's own planner (KVCORE_VLLM_PACKING=vllm)",
            )
        if tensor.host_resident:
            raise _refuse(
                first,
                spec,
                "its tensor is host-resident, and vLLM keeps host pages in its "
                "HiSparse host pool, which kvcore does not plan for vLLM",
                "leave HiSparse models on vLLM's own planner (KVCORE_VLLM_PACKING=vllm)",
            )
        padded = _padded(spec)
        h, n, c = spec.page_grid
        shape = (len(tensor.layers), plan.num_blocks, h, n, c)
        got = vllm_page_strides(
            layout,
            shape,
            page_size_padded=padded,
            layer_stride=tensor.layer_stride,
            block_stride=tensor.block_stride,
        )
        placed = (
            tensor.layer_stride,
            tensor.block_stride,
            *(tensor.page_strides or ()),
        )
        if got is None:
            raise _refuse(
                first,
                spec,
                f"its page is padded to {padded} bytes and vLLM's worker pads a page "
                f"only where every axis outside it is the layer or block axis, which "
                f"layout {layout.name} does not keep",
                "plan in a block-compact layout (LBHNC, LBNHC, BLHNC or BLNHC)",
            )
        if tensor.page_strides is not None and got != placed:
            raise _refuse(
                first,
                spec,
                f"kvcore placed its [L, B, H, N, C] byte strides at {placed}, but "
                f"vLLM's worker derives {got} from the same layer and block strides "
                f"in layout {layout.name}",
                "re-plan it with kvcore.plan_kv_cache (which places pages as vLLM "
                "reads them) rather than a hand-built tensor",
            )
        for name in tensor.layers:
            padding[name] = _padded(group.layer_spec(name))
        tensors.append(
            VllmTensor(
                size=tensor.size,
                layers=tuple(tensor.layers),
                layer_stride=tensor.layer_stride,
                block_stride=tensor.block_stride,
                offset=tensor.offset,
            )
        )
    if len({t.size for t in tensors}) > 1:
        msg = (
            "kvcore.integrations.vllm: the plan's tensors have backing sizes "
            f"{sorted({t.size for t in tensors})}, and vLLM's worker binds every "
            "tensor in one allocation; plan with kvcore.plan_kv_cache"
        )
        raise PlanNotExpressibleError(msg)
    unplaced = [
        n for g in plan.kv_cache_groups for n in g.layer_names if n not in padding
    ]
    if unplaced:
        msg = (
            f"kvcore.integrations.vllm: layers {unplaced[:4]} have no tensor in the "
            "plan, and vLLM's worker binds a cache for every layer of a group; "
            "plan with kvcore.plan_kv_cache"
        )
        raise PlanNotExpressibleError(msg)
    return VllmPlacement(
        num_blocks=plan.num_blocks,
        layout=layout.name,
        tensors=tuple(tensors),
        page_size_padded=padding,
    )


# -- vLLM objects (these need vLLM) ---------------------------------------


def _vllm_mode(mode: str | None) -> str:
    """vLLM's ``mamba_cache_mode`` for a kvcore state cache mode (``auto``
    settles to ``none`` when nothing resolved it)."""
    return mode if mode in ("none", "align", "all") else "none"


def _fresh_spec(spec: Any, padded: int | None, iface: Any) -> Any:
    """A vLLM spec built from a kvcore spec's fields."""
    kind = spec.kind
    cls = getattr(iface, VLLM_SPEC_TYPES[kind])
    alignment = spec.block_stride_alignment
    if kind == "mamba":
        return cls(
            block_size=spec.block_size,
            shapes=tuple(tuple(s) for s in spec.shapes),
            dtypes=tuple(spec.dtypes),
            page_size_padded=padded,
            mamba_cache_mode=_vllm_mode(spec.state_cache_mode),
            num_speculative_blocks=spec.num_speculative_blocks,
            tp_replicated=spec.tp_replicated,
            block_stride_alignment=alignment,
        )
    fields: dict[str, Any] = {
        "block_size": spec.block_size,
        "num_kv_heads": spec.num_kv_heads,
        "head_size": spec.head_size,
        "head_size_v": spec.head_size_v,
        "dtype": spec.dtype,
        "tokens_per_state": spec.tokens_per_state,
        "page_size_padded": padded,
        "block_stride_alignment": alignment,
    }
    if kind in ("sliding_window", "sliding_window_mla"):
        fields["sliding_window"] = spec.sliding_window
        fields["extra_retained_tokens"] = spec.extra_retained_tokens
    if kind == "sliding_window_mla":
        fields["bounded_replay"] = spec.bounded_replay
    if kind == "chunked_local_attention":
        fields["attention_chunk_size"] = spec.attention_chunk_size
    return cls(**fields)


def to_vllm_spec(
    spec: KVCacheSpec, *, layer: str = "?", base: Any | None = None
) -> Any:
    """The vLLM spec of one kvcore layer spec.

    :param base: the layer's spec as vLLM's worker reported it; it keeps
        every field kvcore does not model, and takes kvcore's block size and
        padded page.  Without it the spec is built from kvcore's fields.

    Either way the result is checked to have kvcore's page grid and page
    bytes, else :class:`PlanNotExpressibleError`.
    """
    from vllm.v1 import kv_cache_interface as iface

    if spec.kind not in VLLM_SPEC_TYPES:
        raise _refuse(
            layer,
            spec,
            f"vLLM 0.33 has no cache spec for kind {spec.kind!r}",
            "leave this model on vLLM's own planner (KVCORE_VLLM_PACKING=vllm)",
        )
    padded = _padded(spec)
    if base is None:
        out = _fresh_spec(spec, padded, iface)
    else:
        out = dataclasses.replace(
            base, block_size=spec.block_size, page_size_padded=padded
        )
    grid = (out.num_heads, out.num_states, out.state_content_size_bytes)
    if grid != spec.page_grid or out.page_size_bytes != spec.page_size_bytes:
        raise _refuse(
            layer,
            spec,
            f"vLLM's {type(out).__name__} for it has page grid [H, N, C] = {grid} "
            f"and {out.page_size_bytes}-byte pages, kvcore's spec {spec.page_grid} "
            f"and {spec.page_size_bytes}-byte pages",
            "plan from the specs vLLM's worker reports "
            "(kvcore.integrations.vllm.specs.to_kvcore_spec)",
        )
    return out


def to_vllm_groups(
    groups: Sequence[KVCacheGroupSpec],
    *,
    vllm_specs: Mapping[str, Any] | None = None,
    layer_names: Mapping[str, str] | None = None,
) -> list[Any]:
    """kvcore's cache groups as vLLM ``KVCacheGroupSpec`` values, in order:
    a group of one spec keeps it, any other is vLLM's
    ``UniformTypeKVCacheSpecs`` of its layers' specs (as vLLM's own planner
    groups; see :func:`to_vllm_spec` for ``vllm_specs``)."""
    from vllm.v1 import kv_cache_interface as iface

    rename = dict(layer_names or {})
    given = dict(vllm_specs or {})
    out = []
    for group in groups:
        names = [rename.get(n, n) for n in group.layer_names]
        specs = {
            vllm: to_vllm_spec(group.layer_spec(n), layer=n, base=given.get(vllm))
            for n, vllm in zip(group.layer_names, names, strict=True)
        }
        first = specs[names[0]]
        spec: Any = first
        if isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs) or any(
            s != first for s in specs.values()
        ):
            spec = iface.UniformTypeKVCacheSpecs(
                block_size=group.kv_cache_spec.block_size, kv_cache_specs=specs
            )
        out.append(iface.KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec))
    return out


def to_vllm_kv_cache_config(
    plan: KVCacheConfig,
    *,
    vllm_specs: Mapping[str, Any] | None = None,
    layer_names: Mapping[str, str] | None = None,
) -> Any:
    """kvcore's plan as a vLLM ``KVCacheConfig``: the same blocks, block
    stride, groups (block sizes included) and, per layer, the same offset
    and strides, so vLLM's worker binds each layer to the bytes kvcore's
    pool (:class:`kvcore.KVCachePool`) gives it.

    :param vllm_specs: vLLM's spec of each layer (by vLLM layer name), as its
        worker reported them; without it, specs are built from kvcore's.
    :param layer_names: kvcore layer name -> vLLM's, where they differ.
    """
    from kvcore.integrations.vllm import check_vllm

    check_vllm()
    from vllm.v1 import kv_cache_interface as iface

    placement = vllm_placement(plan)
    rename = dict(layer_names or {})

    def name_of(layer: str) -> str:
        return rename.get(layer, layer)

    groups = to_vllm_groups(
        plan.kv_cache_groups, vllm_specs=vllm_specs, layer_names=rename
    )
    tensors = [
        iface.KVCacheTensor(
            size=t.size,
            layers=[name_of(n) for n in t.layers],
            layer_stride=t.layer_stride,
            block_stride=t.block_stride,
            offset=t.offset,
        )
        for t in placement.tensors
    ]
    return iface.KVCacheConfig(
        num_blocks=placement.num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=groups,
        kv_cache_layout=placement.layout,
        hash_block_size=plan.hash_block_size,
    )
