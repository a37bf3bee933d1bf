"""The pool: one backing allocation per residency (device, and host for
host-resident tensors) and a zero-copy typed view per layer."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvcore.errors import (
    KvcoreKeyError,
    KvcoreTypeError,
    KvcoreValueError,
    LayoutError,
    PlanError,
    PluginBindError,
    echo,
    require_instance,
)
from kvcore.kinds import LayerView
from kvcore.layout import AXIS_B, AXIS_H, AXIS_L, AXIS_N, KVCacheLayout
from kvcore.owners import call_plugin, declared, spec_plugin_error
from kvcore.plan import tensor_strides
from kvcore.plan.validate import check_placement
from kvcore.registry import KindRegistry, default_registry
from kvcore.spec import KVCacheSpec
from kvcore.structs import KVCacheConfig, KVCacheTensor

if TYPE_CHECKING:
    from kvcore.coordinator.partial import BlockCopy

__all__ = ["ByteRegion", "KVCachePool", "allocate_kv_cache", "checked_view"]


class KVCachePool:
    """One byte buffer holding every layer's pages, with a typed view per layer.

    Every view shares its buffer's storage: layers of different groups at the
    same offset alias (a block id is owned by one group at a time), layers of
    one group are disjoint.

    Tensors marked :attr:`~kvcore.structs.KVCacheTensor.host_resident` are
    the host side of a sparse cache (HiSparse keeps its full source KV in host
    memory and only the hot pages on the device), so they are bound in a
    separate host buffer, :attr:`host_buffer`, and never in device memory:
    a host-resident tensor must not require the device.  The host buffer is
    pinned when CUDA is available, so the device can copy pages from it
    asynchronously.  Every other tensor lives in :attr:`buffer`, on
    ``device``.  Tensors of one residency share one size (one allocation).

    :param config: the plan.
    :param device: where to allocate the device buffer (host-resident tensors
        are always allocated in host memory).
    :param layout: the layout the plan was made for (default: the plan's).
    :param kernel_block_sizes: per group, split each block into kernel blocks
        of this many tokens (needs dense, unpadded pages).
    """

    def __init__(
        self,
        config: KVCacheConfig,
        device: torch.device | str = "cpu",
        layout: KVCacheLayout | None = None,
        kernel_block_sizes: Sequence[int] | None = None,
        *,
        registry: KindRegistry | None = None,
    ) -> None:
        _check_plan(config)
        given: dict[str, tuple[object, type]] = {
            "layout": (layout, KVCacheLayout),
            "registry": (registry, KindRegistry),
        }
        for what, (value, want) in given.items():
            if value is not None and not isinstance(value, want):
                msg = (
                    f"KVCachePool: {what} must be a {want.__name__} or None, got "
                    f"{echo(value)} ({type(value).__name__})"
                )
                raise KvcoreTypeError(msg)
        device = checked_device(device)
        registry = registry if registry is not None else default_registry()
        layout = layout if layout is not None else config.kv_cache_layout
        if layout is None:
            msg = "the plan carries no layout; pass the layout it was made for"
            raise LayoutError(msg)
        if config.kv_cache_layout is not None and layout is not config.kv_cache_layout:
            msg = (
                f"the plan was made for layout {config.kv_cache_layout.name}, not "
                f"{layout.name}; re-plan for {layout.name}"
            )
            raise LayoutError(msg)
        if kernel_block_sizes is not None:
            require_instance(
                kernel_block_sizes, (list, tuple), "KVCachePool: kernel_block_sizes"
            )
        if kernel_block_sizes is not None and any(
            type(k) is not int or k <= 0 for k in kernel_block_sizes
        ):
            msg = f"kernel_block_sizes must be positive ints, got {list(kernel_block_sizes)}"
            raise PlanError(msg)
        if kernel_block_sizes is not None and len(kernel_block_sizes) != len(
            config.kv_cache_groups
        ):
            msg = (
                f"kernel_block_sizes has {len(kernel_block_sizes)} entries for "
                f"{len(config.kv_cache_groups)} cache groups; give one per group"
            )
            raise PlanError(msg)
        self.config = config
        self.layout = layout
        device_tensors = [t for t in config.kv_cache_tensors if not t.host_resident]
        host_tensors = [t for t in config.kv_cache_tensors if t.host_resident]
        device_size = _shared_size(device_tensors, "device")
        host_size = _shared_size(host_tensors, "host-resident") if host_tensors else 0
        # Whatever made the plan, nothing is bound that the checks refuse:
        # every layer placed once, inside its pool, no two live pages on
        # one byte in the layout bound here.
        check_placement(config, layout)
        #: The device buffer: every tensor that is not host resident.
        self.buffer = _allocate(device_size, device, pin_memory=False)
        #: The host buffer of the host-resident tensors (``None`` when there
        #: are none): host memory, pinned when CUDA is available, because it
        #: holds the host side of a sparse cache that the device copies from.
        self.host_buffer: torch.Tensor | None = None
        if host_tensors:
            self.host_buffer = _allocate(
                host_size, "cpu", pin_memory=torch.cuda.is_available()
            )
        group_of = {
            name: i
            for i, g in enumerate(config.kv_cache_groups)
            for name in g.layer_names
        }
        self.views: dict[str, LayerView] = {}
        #: layer -> (its raw uint8 region ``[blocks, H, N, C]``, kernel
        #: blocks per block), for :meth:`copy_blocks`.
        self._raws: dict[str, tuple[torch.Tensor, int]] = {}
        for tensor in config.kv_cache_tensors:
            gid = group_of.get(tensor.layers[0])
            if gid is None:
                msg = f"tensor layer {tensor.layers[0]!r} is in no cache group of the plan"
                raise PlanError(msg)
            group = config.kv_cache_groups[gid]
            spec = group.layer_spec(tensor.layers[0])
            kind = registry.kind_for(spec, layer=tensor.layers[0])
            kernel = kernel_block_sizes[gid] if kernel_block_sizes is not None else None
            host = self.host_buffer if tensor.host_resident else None
            buffer = host if host is not None else self.buffer
            raws = self._raw_views(buffer, tensor, spec, config.num_blocks, kernel)
            ratio = raws[0].shape[0] // config.num_blocks if raws else 1
            for name, raw in zip(tensor.layers, raws, strict=True):
                self._raws[name] = (raw, ratio)
                view = call_plugin(
                    spec,
                    f"bind_view (layer {name!r})",
                    functools.partial(kind.bind_view, spec, raw),
                )
                self.views[name] = checked_view(spec, name, raw, view, buffer)

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """Run copy-on-write block copies (``KVCacheBlocks.copies``) as if in
        order: for every layer of the copy's group, the whole page of block
        ``src_block_id`` into block ``dst_block_id`` (the slots past
        ``num_tokens`` are overwritten by the request later).  Works on the
        raw page of each layer, so every layout, packing, kernel-block split
        and host-resident tensor is copied alike.  Run them before the
        step's forward pass.

        Every copy is checked before any runs, so a refused call copies
        nothing.  Copies run in batches of one gather and one scatter per
        layer (a step admitting many partial hits would otherwise launch one
        copy per layer per block); a batch ends before a copy that reads a
        block an earlier copy of the batch wrote or writes one it read or
        wrote, so the result is the in-order one."""
        checked = [self._checked_copy(i, copy) for i, copy in enumerate(copies)]
        batch: dict[int, tuple[list[int], list[int]]] = {}
        read: set[int] = set()
        written: set[int] = set()
        for gid, src, dst in checked:
            if src == dst:
                continue
            if src in written or dst in written or dst in read:
                # Groups overlay one another's bytes and a batch runs group
                # by group: a block read or written earlier in the batch is
                # written only in the next one.
                self._copy_batch(batch)
                batch, read, written = {}, set(), set()
            srcs, dsts = batch.setdefault(gid, ([], []))
            srcs.append(src)
            dsts.append(dst)
            read.add(src)
            written.add(dst)
        self._copy_batch(batch)

    def _checked_copy(self, i: int, copy: object) -> tuple[int, int, int]:
        """``copies[i]`` as ``(group_id, src, dst)``, or a clear error."""
        groups = self.config.kv_cache_groups
        num_blocks = self.config.num_blocks
        gid = getattr(copy, "group_id", None)
        if type(gid) is not int or not 0 <= gid < len(groups):
            msg = (
                f"copies[{i}].group_id is {gid!r}; it must name one of the "
                f"plan's {len(groups)} cache groups (pass the copies "
                "allocate_slots returned)"
            )
            raise KvcoreValueError(msg)
        ids = []
        for field in ("src_block_id", "dst_block_id"):
            block = getattr(copy, field, None)
            if type(block) is not int or not 0 < block < num_blocks:
                msg = (
                    f"copies[{i}].{field} is {block!r}; it must be a block id "
                    f"in 1..{num_blocks - 1} (block 0 is the null block)"
                )
                raise KvcoreValueError(msg)
            ids.append(block)
        return gid, ids[0], ids[1]

    def _copy_batch(self, batch: dict[int, tuple[list[int], list[int]]]) -> None:
        """Copies no two of which touch a block another writes: per layer,
        gather every source page, then scatter them to their destinations."""
        groups = self.config.kv_cache_groups
        for gid, (srcs, dsts) in batch.items():
            index: dict[tuple[torch.device, int], tuple[torch.Tensor, ...]] = {}
            for name in groups[gid].layer_names:
                found = self._raws.get(name)
                if found is None:
                    continue  # a layer with no tensor in this plan
                raw, ratio = found
                key = (raw.device, ratio)
                if key not in index:
                    index[key] = tuple(
                        _kernel_rows(ids, ratio, raw.device) for ids in (srcs, dsts)
                    )
                src_rows, dst_rows = index[key]
                raw.index_copy_(0, dst_rows, raw.index_select(0, src_rows))

    def raw_view(self, layer: str) -> torch.Tensor:
        """Layer ``layer``'s pages as raw bytes: the ``uint8`` view of the
        pool's storage, shaped ``[blocks, H, N, C]`` (the spec's page grid),
        that the kind's ``bind_view`` was given.  Row ``b`` is block ``b``'s
        page (with ``kernel_block_sizes``, each block is split into
        consecutive rows of kernel blocks).  An engine that binds its own
        kernels, or checks another engine's binding (vLLM's, say) against
        this pool, reads each block's address and the page strides here.

        :raises KvcoreKeyError: ``layer`` has no tensor in this plan.
        :raises KvcoreTypeError: ``layer`` is not a str."""
        if type(layer) is not str:
            msg = (
                f"KVCachePool.raw_view: layer must be a layer name, a str; got "
                f"{type(layer).__name__} {echo(layer)}"
            )
            raise KvcoreTypeError(msg)
        found = self._raws.get(layer)
        if found is None:
            known = ", ".join(sorted(self._raws)[:8]) or "none"
            msg = (
                f"KVCachePool.raw_view: layer {echo(layer)} has no tensor in this "
                f"plan (its layers include {known})"
            )
            raise KvcoreKeyError(msg)
        return found[0]

    def _raw_views(
        self,
        buffer: torch.Tensor,
        tensor: KVCacheTensor,
        spec: KVCacheSpec,
        num_blocks: int,
        kernel_block_size: int | None,
    ) -> list[torch.Tensor]:
        h, n, c = spec.page_grid
        if tensor.page_strides is not None:
            strides = [tensor.layer_stride, tensor.block_stride, *tensor.page_strides]
        else:  # a hand-built tensor: derive its page strides from the layout
            strides = list(
                tensor_strides(
                    spec,
                    self.layout,
                    num_layers=len(tensor.layers),
                    num_blocks=num_blocks,
                    bytes_per_block=self.config.bytes_per_block or tensor.block_stride,
                    layer_stride=tensor.layer_stride,
                )
            )
            strides[AXIS_B] = tensor.block_stride
        blocks = num_blocks
        if kernel_block_size is not None and kernel_block_size != spec.block_size:
            ratio, rest = divmod(spec.block_size, kernel_block_size)
            if rest or ratio < 1 or n % ratio:
                msg = (
                    f"kernel block size {kernel_block_size} must divide the block "
                    f"size {spec.block_size} of layer {tensor.layers[0]!r} into "
                    "whole states"
                )
                raise LayoutError(msg)
            dense = h * n * c
            order = self.layout.value
            n_outside_h = h == 1 or order.index(AXIS_N) < order.index(AXIS_H)
            if (
                tensor.block_stride != dense
                or not self.layout.is_block_compact
                or not n_outside_h
            ):
                msg = (
                    f"layer {tensor.layers[0]!r} cannot be split into kernel blocks: "
                    f"its block stride ({tensor.block_stride} bytes) is not one dense "
                    f"page ({dense} bytes) whose token axis is outside its head axis; "
                    "use LBNHC with unpadded pages, or no kernel block split"
                )
                raise LayoutError(msg)
            blocks, n = num_blocks * ratio, n // ratio
            strides[AXIS_B] = tensor.block_stride // ratio
        shape = (len(tensor.layers), blocks, h, n, c)
        # Checked before the view is made: torch refuses an out-of-bounds
        # view with an error that names no layer.
        end = (
            tensor.offset
            + sum((d - 1) * s for d, s in zip(shape, strides, strict=True))
            + 1
        )
        if end > buffer.numel():
            where = "host-resident" if tensor.host_resident else "device"
            msg = (
                f"tensor of layers {tensor.layers[:3]} reaches byte {end} of a "
                f"{buffer.numel()}-byte {where} pool; the plan is inconsistent"
            )
            raise PlanError(msg)
        full = torch.as_strided(
            buffer, shape, tuple(strides), buffer.storage_offset() + tensor.offset
        )
        del strides[AXIS_L]
        return [full[i] for i in range(len(tensor.layers))]


class ByteRegion:
    """The bytes of a storage a strided tensor touches, in closed form: from
    byte ``start``, every ``sum(i_k * stride_k)`` for ``0 <= i_k < size_k``
    over :attr:`dims`, plus a contiguous run of :attr:`run` bytes.

    Built from storage offset, shape and strides (never by enumerating
    elements), with contiguous and nested dims coalesced, so a dense region
    is one long run.
    """

    __slots__ = ("dims", "run", "start")

    def __init__(self, tensor: torch.Tensor) -> None:
        item = tensor.element_size()
        self.start = int(tensor.storage_offset()) * item
        dims = sorted(
            (
                (d, st * item)
                for d, st in zip(tensor.shape, tensor.stride(), strict=True)
            )
            if tensor.numel()
            else (),
            key=lambda dim: dim[1],
        )
        run = item
        outer: list[tuple[int, int]] = []
        for size, stride in dims:
            if size == 1:
                continue
            if not outer and stride == run:
                run *= size  # extends the contiguous run
            elif outer and stride == outer[-1][0] * outer[-1][1]:
                outer[-1] = (outer[-1][0] * size, outer[-1][1])
            else:
                outer.append((size, stride))
        #: ``(size, byte stride)`` from the widest stride down.
        self.dims = outer[::-1]
        #: bytes of the innermost contiguous run
        self.run = run

    def contains(self, other: torch.Tensor) -> bool:
        """Whether every byte ``other`` touches lies in this region (same
        storage assumed).  Each of ``other``'s strides is written in this
        region's digits; it lies inside if no digit can leave its range.
        Exact for the nested regions a plan makes; never too lenient."""
        if other.numel() == 0:
            return True
        item = other.element_size()
        rel = int(other.storage_offset()) * item - self.start
        if rel < 0:
            return False
        start = self._digits(rel)
        reach = [0] * (len(self.dims) + 1)
        for size, stride in zip(other.shape, other.stride(), strict=True):
            if size > 1:
                for k, digit in enumerate(self._digits(stride * item)):
                    reach[k] += (size - 1) * digit
        last = len(self.dims)
        for k, (size, _) in enumerate(self.dims):
            if start[k] + reach[k] > size - 1:
                return False
        return start[last] + reach[last] + item <= self.run

    def _digits(self, offset: int) -> list[int]:
        digits = []
        for _, stride in self.dims:
            q, offset = divmod(offset, stride)
            digits.append(q)
        digits.append(offset)
        return digits

    def describe(self) -> str:
        dims = ", ".join(f"{d} x {s} B" for d, s in self.dims)
        return f"from byte {self.start}: [{dims}] runs of {self.run} B"


def _kernel_rows(blocks: list[int], ratio: int, device: torch.device) -> torch.Tensor:
    """The rows of a raw page grid (``ratio`` kernel blocks a block) that
    hold ``blocks``, in order, on ``device``.

    A CUDA device gets them from pinned memory without blocking: a copy from
    pageable memory would wait for the work already queued on the device,
    stalling the engine's host thread before its forward pass."""
    rows = torch.tensor(blocks, dtype=torch.int64)
    if ratio != 1:
        rows = (rows[:, None] * ratio + torch.arange(ratio)).reshape(-1)
    if device.type == "cpu":
        return rows
    if device.type == "cuda":
        return rows.pin_memory().to(device, non_blocking=True)
    return rows.to(device)


def _declared_dtypes(spec: KVCacheSpec, count: int) -> list[torch.dtype] | None:
    """The dtype of each of a view's ``count`` tensors, as the spec declares
    them (:attr:`~kvcore.spec.KVCacheSpec.view_dtypes`), or None when it
    declares none."""
    dtypes = declared(spec, "view_dtypes")
    if dtypes is None:
        return None
    if (
        not isinstance(dtypes, tuple)
        or not dtypes
        or not all(isinstance(d, torch.dtype) for d in dtypes)
    ):
        text = repr(dtypes)
        raise spec_plugin_error(
            spec,
            f"view_dtypes is {text if len(text) <= 120 else text[:117] + '...'}; "
            "it must be None or a non-empty tuple of torch dtypes, one per "
            "tensor its binder returns (or one for all of them)",
        )
    if len(dtypes) == 1:
        return [dtypes[0]] * count
    if len(dtypes) != count:
        raise spec_plugin_error(
            spec,
            f"bind_view returned {count} tensor(s) but view_dtypes declares "
            f"{len(dtypes)} dtypes; declare one dtype per tensor (or one for "
            "all of them)",
            error=PluginBindError,
        )
    return list(dtypes)


def checked_view(
    spec: KVCacheSpec,
    layer: str,
    raw: torch.Tensor,
    view: object,
    buffer: torch.Tensor,
) -> LayerView:
    """A binder's answer for ``layer``, checked once as the pool is built:
    a tensor or non-empty tuple of tensors, each a view of the pool's
    storage, in the spec's dtype, touching only bytes of ``raw`` (the layer's
    pages in every block)."""
    what = f"bind_view for layer {layer!r}"
    tensors = view if isinstance(view, tuple) and view else (view,)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        if not isinstance(view, tuple):
            got = type(view).__name__
        elif not view:
            got = "an empty tuple"
        else:
            got = "a tuple of " + ", ".join(type(t).__name__ for t in view)
        raise spec_plugin_error(
            spec,
            f"{what} returned {got}; it must return a tensor (or a tuple of "
            "tensors) viewing the raw region it was given",
            error=PluginBindError,
        )
    storage = buffer.untyped_storage().data_ptr()
    region = ByteRegion(raw)
    dtypes = _declared_dtypes(spec, len(tensors))
    for i, tensor in enumerate(tensors):
        name = f"tensor {i} of " if len(tensors) > 1 else ""
        if (
            tensor.device != buffer.device
            or tensor.untyped_storage().data_ptr() != storage
        ):
            raise spec_plugin_error(
                spec,
                f"{name}{what} does not share the pool's storage (a new tensor or "
                "a copy); views must be made from `raw` without copying (view, "
                "reshape, slice, .view(dtype)), or the cache is written nowhere",
                error=PluginBindError,
            )
        if dtypes is not None and tensor.dtype != dtypes[i]:
            raise spec_plugin_error(
                spec,
                f"{name}{what} is {tensor.dtype}, but the spec's dtype is "
                f"{dtypes[i]}; view the raw bytes as {dtypes[i]}",
                error=PluginBindError,
            )
        if not region.contains(tensor):
            raise spec_plugin_error(
                spec,
                f"{name}{what} (shape {tuple(tensor.shape)}, strides "
                f"{tuple(tensor.stride())}, {tensor.dtype}, storage offset "
                f"{tensor.storage_offset()}) reaches bytes outside the layer's "
                f"region of the pool ({region.describe()}), so writes through it "
                "would overwrite other layers or blocks; derive the view from "
                "`raw` without widening it",
                error=PluginBindError,
            )
        if not _indexes_blocks(tensor, raw):
            raise spec_plugin_error(
                spec,
                f"{name}{what} (shape {tuple(tensor.shape)}, strides "
                f"{tuple(tensor.stride())}, {tensor.dtype}) does not index blocks "
                f"on its first axis: view[i] must be block i's page of the layer "
                f"({raw.shape[0]} blocks, {raw.stride(0) * raw.element_size()} "
                "bytes apart), or an engine writing one block writes others; "
                "keep `raw`'s first axis first",
                error=PluginBindError,
            )
    return view  # type: ignore[return-value]


def _indexes_blocks(tensor: torch.Tensor, raw: torch.Tensor) -> bool:
    """Whether ``tensor[i]`` lies in ``raw[i]`` (the layer's page of block
    ``i``) for every block: one entry per block on the first axis, a block
    stride apart, the first inside the first page."""
    blocks = raw.shape[0]
    if tensor.dim() == 0 or tensor.shape[0] != blocks:
        return False
    if blocks > 1 and (
        tensor.stride(0) * tensor.element_size() != raw.stride(0) * raw.element_size()
    ):
        return False
    return ByteRegion(raw[0]).contains(tensor[0])


def _shared_size(tensors: Sequence[KVCacheTensor], residency: str) -> int:
    """The one size the tensors of one residency share (0 when none)."""
    sizes = {t.size for t in tensors}
    if len(sizes) > 1:
        msg = (
            f"{residency} KV cache tensors must share one backing allocation, but "
            f"their sizes differ ({sorted(sizes)}); build the config with "
            "get_kv_cache_config_from_groups"
        )
        raise PlanError(msg)
    return sizes.pop() if sizes else 0


def _check_plan(config: object) -> None:
    if not isinstance(config, KVCacheConfig):
        msg = (
            f"a KV cache pool is bound from a KVCacheConfig (a plan from "
            f"kvcore.plan_kv_cache or kvcore.serialize.load_config), got "
            f"{type(config).__name__}"
        )
        raise KvcoreTypeError(msg)


def checked_device(device: object) -> torch.device:
    """``device`` as a torch device this torch can allocate on, or a kvcore
    error naming it (torch itself answers a CUDA device on a CPU build with
    a bare AssertionError).  A device torch cannot use is a
    :class:`~kvcore.errors.PlanError`, as a failed allocation is."""
    if not isinstance(device, (str, torch.device)):
        msg = (
            f"device must be a torch.device or a device string such as 'cpu' or "
            f"'cuda:0', got {echo(device)} ({type(device).__name__})"
        )
        raise KvcoreTypeError(msg)
    try:
        resolved = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        msg = f"{echo(device)} is not a torch device ({exc}); use 'cpu' or 'cuda:0'"
        raise PlanError(msg) from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        msg = (
            f"device {echo(device)}: this torch has no CUDA device "
            "(torch.cuda.is_available() is False); bind on 'cpu' or install a "
            "CUDA build of torch"
        )
        raise PlanError(msg)
    return resolved


def _allocate(
    size: int, device: torch.device | str, *, pin_memory: bool
) -> torch.Tensor:
    where = "in pinned host memory" if pin_memory else f"on device {device!r}"
    try:
        return torch.zeros(
            size, dtype=torch.uint8, device=device, pin_memory=pin_memory
        )
    except (RuntimeError, TypeError, AssertionError) as exc:
        msg = f"cannot allocate the {size}-byte KV cache pool {where}: {exc}"
        raise PlanError(msg) from exc


def allocate_kv_cache(
    config: KVCacheConfig,
    device: torch.device | str = "cpu",
    layout: KVCacheLayout | None = None,
    kernel_block_sizes: Sequence[int] | None = None,
    *,
    registry: KindRegistry | None = None,
) -> dict[str, LayerView]:
    """Allocate the plan's buffers and return ``layer -> view``.

    Host-resident tensors get views of a host buffer (see :class:`KVCachePool`).
    """
    _check_plan(config)
    if not config.kv_cache_tensors:
        return {}
    return KVCachePool(
        config, device, layout, kernel_block_sizes, registry=registry
    ).views
