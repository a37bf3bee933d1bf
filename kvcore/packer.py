"""The packer: layers into cache groups, groups into one block, blocks into a
config.

Every cache group packs its layers' pages densely into one block; groups
overlay each other from byte 0 (a block id is owned by one group at a time),
so the block stride is the widest group's packing, rounded up to one lcm of
every alignment.  The packer reads specs only through their generic
interface (page size, grouping key, packing role, hashing behaviour) and
names no cache kind.

Ordering is deterministic: buckets (and so groups) appear in the order of
their first layer in the model; an unsplit group keeps model order; a split
group takes every n-th repeat of its bucket's layer pattern.  Inside a block a
group's layers are laid out by spec, in first-appearance order.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import attrs

from kvcore.config import EngineConfig
from kvcore.errors import (
    BlockSizeError,
    KvcoreTypeError,
    LayoutError,
    MergeError,
    PlanError,
)
from kvcore.layout import AXIS_B, AXIS_L, KVCacheLayout, compute_layout_strides
from kvcore.registry import KindRegistry, default_registry
from kvcore.spec import (
    GroupSpec,
    KVCacheSpec,
    PackingRole,
    UniformTypeKVCacheSpecs,
    cdiv,
    iter_layer_specs,
    round_up,
)
from kvcore.structs import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

__all__ = [
    "approximate_gcd",
    "effective_block_size",
    "serves_partial_hits",
    "build_kv_cache_tensors",
    "generate_scheduler_kv_cache_config",
    "get_kv_cache_config_from_groups",
    "get_kv_cache_groups",
    "get_packed_kv_cache_groups",
    "get_uniform_page_kv_cache_groups",
    "kv_cache_bytes_per_block",
    "resolve_kv_cache_block_sizes",
    "validate_kv_cache_layout",
]


# ---------------------------------------------------------------------------
# Grouping
# ---------------------------------------------------------------------------


def get_kv_cache_groups(
    config: EngineConfig,
    specs: Mapping[str, KVCacheSpec],
    *,
    registry: KindRegistry | None = None,
) -> list[KVCacheGroupSpec]:
    """Group the model's layers into cache groups.

    In order: a plugin's ``kvcore_choose_grouping``; one group if every spec
    merges into one; one group if every layer shares a grouping key; the
    packed path if pages differ in size; the uniform-page path otherwise.

    :param specs: layer name to spec, in model order.
    """
    registry = registry if registry is not None else default_registry()
    raw: object = specs
    if not isinstance(raw, Mapping):
        msg = (
            f"get_kv_cache_groups takes a mapping of layer name to spec, got "
            f"{type(raw).__name__}"
        )
        raise KvcoreTypeError(msg)
    for name, spec in specs.items():
        registry.kind_for(spec, layer=name)
    if not specs:
        return []
    chosen = registry.choose_grouping(config, specs)
    if chosen is not None:
        _check_chosen(chosen, specs)
        return chosen
    whole = _group_spec(dict(specs))
    if whole is not None:
        return [KVCacheGroupSpec(list(specs), whole)]
    packed = get_packed_kv_cache_groups(config, specs)
    if packed is not None:
        return packed
    return get_uniform_page_kv_cache_groups(specs)


def _group_spec(members: dict[str, KVCacheSpec]) -> GroupSpec | None:
    """One spec for layers that may share a group: their merge if they merge,
    else a :class:`UniformTypeKVCacheSpecs` if they share a grouping key."""
    values = list(members.values())
    first_type = type(values[0])
    if all(type(s) is first_type for s in values):
        try:
            return first_type.merge(values)
        except MergeError:
            pass
    return UniformTypeKVCacheSpecs.from_specs(members)


def _check_chosen(chosen: object, specs: Mapping[str, KVCacheSpec]) -> None:
    """Check a plugin's grouping: groups covering every layer once, each with
    a spec that matches its layers."""
    if not isinstance(chosen, list) or not all(
        isinstance(g, KVCacheGroupSpec) for g in chosen
    ):
        msg = (
            "a kvcore_choose_grouping plugin returned "
            f"{type(chosen).__name__}; it must return a list of KVCacheGroupSpec "
            "(or None to defer)"
        )
        raise PlanError(msg)
    _check_covers(chosen, specs)
    for i, group in enumerate(chosen):
        members = {name: specs[name] for name in group.layer_names}
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            ok = spec.kv_cache_specs == members
        else:
            ok = spec == _group_spec(members)
        if not ok:
            msg = (
                f"a kvcore_choose_grouping plugin gave group {i} (layers "
                f"{group.layer_names[:4]}) a spec that does not match its layers' "
                "specs; use their merged spec or a UniformTypeKVCacheSpecs of them"
            )
            raise PlanError(msg)


def _check_covers(groups: Sequence[KVCacheGroupSpec], specs: Mapping[str, Any]) -> None:
    seen: dict[str, int] = {}
    for i, group in enumerate(groups):
        for name in group.layer_names:
            if name in seen:
                msg = (
                    f"the grouping chosen by a kvcore_choose_grouping plugin puts "
                    f"layer {name!r} in groups {seen[name]} and {i}; every layer "
                    "belongs to exactly one group"
                )
                raise PlanError(msg)
            seen[name] = i
    missing = [n for n in specs if n not in seen]
    unknown = [n for n in seen if n not in specs]
    if missing or unknown:
        msg = (
            "the grouping chosen by a kvcore_choose_grouping plugin does not match "
            f"the model's layers (missing: {missing[:5]}, unknown: {unknown[:5]})"
        )
        raise PlanError(msg)


def _bucket_key(spec: KVCacheSpec) -> Hashable:
    # Cacheability and replay are part of the key, so a scratch ring never
    # shares a group (and a manager) with prefix-cacheable owners.
    return (spec.group_key(), spec.prefix_cacheable, spec.prefix_replay_tokens)


def _buckets(specs: Mapping[str, KVCacheSpec]) -> list[dict[str, KVCacheSpec]]:
    buckets: dict[Hashable, dict[str, KVCacheSpec]] = {}
    for name, spec in specs.items():
        buckets.setdefault(_bucket_key(spec), {})[name] = spec
    return list(buckets.values())


def approximate_gcd(values: Sequence[int], lower_bound: int = 1) -> int:
    """The divisor ``d >= lower_bound`` that minimises the padding
    ``sum((-v) % d)``; ties go to the larger ``d``."""
    if not values or any(type(v) is not int or v <= 0 for v in values):
        msg = f"approximate_gcd needs positive values, got {list(values)}"
        raise PlanError(msg)
    low = max(1, lower_bound)
    high = max(values)
    if low > high:
        return low
    best, best_pad = low, None
    for d in range(low, high + 1):
        pad = sum((-v) % d for v in values)
        if best_pad is None or pad <= best_pad:
            best, best_pad = d, pad
    return best


@attrs.define
class _Bucket:
    specs: dict[str, KVCacheSpec]
    #: page size -> layer names, in first-appearance order
    by_page: dict[int, list[str]]

    @classmethod
    def of(cls, specs: dict[str, KVCacheSpec]) -> _Bucket:
        by_page: dict[int, list[str]] = {}
        for name, spec in specs.items():
            by_page.setdefault(spec.page_size_bytes, []).append(name)
        return cls(specs, by_page)

    @property
    def balanced(self) -> bool:
        return len({len(v) for v in self.by_page.values()}) == 1

    @property
    def repeats(self) -> int:
        return max(len(v) for v in self.by_page.values())

    @property
    def role(self) -> PackingRole:
        return next(iter(self.specs.values())).packing_role

    def split(self, n: int) -> list[list[str]]:
        """Split into ``n`` groups.

        A balanced bucket split at most once per repeat deals whole repeats
        of its page pattern (group i takes repeats i, i+n, ...), so pipeline
        stages stay balanced.  Otherwise layers are dealt round-robin, page
        size by page size, so no layer is dropped, no group is empty and
        unequal pages spread evenly.
        """
        if n <= 1:
            return [list(self.specs)]
        if self.balanced and n <= self.repeats:
            pattern = list(zip(*self.by_page.values(), strict=True))
            return [[name for rep in pattern[i::n] for name in rep] for i in range(n)]
        order = {name: i for i, name in enumerate(self.specs)}
        out: list[list[str]] = [[] for _ in range(n)]
        cursor = 0
        for names in sorted(
            self.by_page.values(), key=lambda v: -self.specs[v[0]].page_size_bytes
        ):
            for name in names:
                out[cursor % n].append(name)
                cursor += 1
        return [sorted(g, key=order.__getitem__) for g in out if g]

    def widest(self, n: int) -> int:
        return max(sum(self.specs[x].page_size_bytes for x in g) for g in self.split(n))


def get_packed_kv_cache_groups(
    config: EngineConfig, specs: Mapping[str, KVCacheSpec]
) -> list[KVCacheGroupSpec] | None:
    """The generic packed path, for models whose pages differ in size.

    Returns ``None`` when every page has one size (the uniform-page path
    applies).  Raises a :class:`~kvcore.errors.LayoutError` when the layout
    is unresolved or cannot hold several groups of mixed pages.

    1. Bucket layers by grouping key (plus cacheability and replay tokens).
    2. The repeat count is the approximate gcd of the balanced buckets'
       repeats, no smaller than the largest balanced multi-page bucket's.
    3. State buckets (and window buckets when there is no repeat count) are
       split only as far as the widest block the other buckets already force.
    """
    if len({s.page_size_bytes for s in specs.values()}) < 2:
        return None
    layout = config.cache_config.resolved_layout()
    buckets = [_Bucket.of(b) for b in _buckets(specs)]

    balanced = [b for b in buckets if b.balanced]
    multi = [b.repeats for b in balanced if len(b.by_page) >= 2]
    min_repeats = max(multi, default=0)
    repeats = (
        approximate_gcd([b.repeats for b in balanced], lower_bound=min_repeats)
        if min_repeats
        else None
    )

    def base_groups(b: _Bucket) -> int:
        return cdiv(b.repeats, repeats) if b.balanced and repeats else 1

    def is_state(b: _Bucket) -> bool:
        return b.role is PackingRole.STATE or (
            b.role is PackingRole.WINDOW and repeats is None
        )

    anchor = max(
        b.widest(len(b.specs) if is_state(b) else base_groups(b)) for b in buckets
    )
    groups: list[KVCacheGroupSpec] = []
    for b in buckets:
        n = base_groups(b)
        if is_state(b):
            widest_page = max(b.by_page)
            n = max(n, cdiv(len(b.specs), max(anchor // widest_page, 1)))
            while n < len(b.specs) and b.widest(n) > anchor:
                n += 1
        for names in b.split(n):
            members = {name: b.specs[name] for name in names}
            wrapper = UniformTypeKVCacheSpecs.from_specs(members)
            if wrapper is None:  # pragma: no cover - buckets share one key
                msg = f"layers {names} share a bucket but not a grouping key"
                raise PlanError(msg)
            groups.append(KVCacheGroupSpec(names, wrapper))
    if len(groups) > 1 and not layout.can_pack:
        _raise_mixed_pages(layout, specs.values())
    return groups


def get_uniform_page_kv_cache_groups(
    specs: Mapping[str, KVCacheSpec],
) -> list[KVCacheGroupSpec]:
    """Group a model whose layers all have one page size.

    Layers are bucketed by grouping key, and every bucket is cut into groups
    of one common size: the approximate gcd of the bucket sizes, no smaller
    than the smallest bucket, which minimises padded layer slots.
    """
    buckets = _buckets(specs)
    size = approximate_gcd(
        [len(b) for b in buckets], lower_bound=min(len(b) for b in buckets)
    )
    groups: list[KVCacheGroupSpec] = []
    for bucket in buckets:
        bucket_obj = _Bucket.of(bucket)
        for names in bucket_obj.split(cdiv(len(bucket), size)):
            spec = _group_spec({name: bucket[name] for name in names})
            if spec is None:  # pragma: no cover - buckets share one key
                msg = f"layers {names} share a bucket but not a grouping key"
                raise PlanError(msg)
            groups.append(KVCacheGroupSpec(names, spec))
    return groups


# ---------------------------------------------------------------------------
# Bytes per block and layout validation
# ---------------------------------------------------------------------------


def kv_cache_bytes_per_block(
    groups: Sequence[KVCacheGroupSpec], layout: KVCacheLayout | None = None
) -> int:
    """Bytes of one block of the pool.

    Block-outer layouts (and ``layout=None``): the widest group's packed
    bytes, rounded up to ONE lcm of every layer's stride alignment (a hot
    page counts as one).  Layer-outer layouts: the widest group's sum of
    pages, each rounded up to its own alignment, since each layer's pages
    are strided by that page alone.
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
            *(s.stride_alignment() for g in groups for s in g.layer_specs())
        )
    if widest <= 0:
        msg = f"cache groups have no bytes per block (widest group: {widest} bytes)"
        raise PlanError(msg)
    return round_up(widest, alignment)


def _raise_mixed_pages(layout: KVCacheLayout, specs: Any) -> None:
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
        _raise_mixed_pages(layout, specs)
    for group in groups:
        for name in group.layer_names:
            spec = group.layer_spec(name)
            if spec.requires_block_outer_layout and not layout.is_block_outermost:
                msg = (
                    f"layer {name!r} ({spec.kind}) needs a block-outermost KV "
                    f"layout, got {layout.name}; use BLHNC or BLNHC"
                )
                raise LayoutError(msg)


# ---------------------------------------------------------------------------
# The config
# ---------------------------------------------------------------------------


def _runs_by_spec(group: KVCacheGroupSpec) -> list[tuple[KVCacheSpec, list[str]]]:
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
    if layout.is_block_outermost:
        fixed[AXIS_B] = bytes_per_block
    else:
        page_stride = round_up(spec.page_size_bytes, spec.stride_alignment())
        if layout.is_block_compact:
            fixed[AXIS_B] = page_stride
    if layer_stride is not None:
        fixed[AXIS_L] = layer_stride
    page = spec.page_size_bytes
    if not layout.is_block_outermost and layout.is_block_compact:
        page = round_up(page, spec.stride_alignment())
    return compute_layout_strides(
        layout, (num_layers, num_blocks, h, n, c), page_bytes=page, fixed=fixed
    )


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
        for spec, layers in _runs_by_spec(group):
            strides = tensor_strides(
                spec,
                layout,
                num_layers=len(layers),
                num_blocks=num_blocks,
                bytes_per_block=bytes_per_block,
            )
            layer_stride, block_stride = strides[AXIS_L], strides[AXIS_B]
            tensors.append(
                KVCacheTensor(
                    size=size,
                    layers=list(layers),
                    layer_stride=layer_stride,
                    block_stride=block_stride,
                    offset=offset,
                    host_resident=host_resident,
                )
            )
            # A run spans its layers' pages inside each block (block-outer) or
            # its layers' whole regions (layer-outer).
            offset += len(layers) * (
                spec.page_size_bytes if layout.is_block_outermost else layer_stride
            )
    return tensors


def get_kv_cache_config_from_groups(
    config: EngineConfig,
    groups: Sequence[KVCacheGroupSpec],
    available_memory: int,
) -> KVCacheConfig:
    """Size the pool for ``available_memory`` bytes and place every layer.

    ``num_blocks = available_memory // bytes_per_block`` (or the override);
    block 0 later becomes the coordinator's null block.
    """
    groups = list(groups)
    if not groups:
        return KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=[])
    if isinstance(available_memory, bool) or not isinstance(available_memory, int):
        msg = (
            f"available_memory must be an int number of bytes, got {available_memory!r}"
        )
        raise PlanError(msg)
    cache = config.cache_config
    layout = cache.resolved_layout()
    validate_kv_cache_layout(layout, groups)
    bytes_per_block = kv_cache_bytes_per_block(groups, layout)
    num_blocks = available_memory // bytes_per_block
    if cache.num_gpu_blocks_override is not None:
        num_blocks = cache.num_gpu_blocks_override
    if num_blocks < 2:
        msg = (
            f"{available_memory} bytes hold {num_blocks} block(s) of "
            f"{bytes_per_block} bytes; the pool needs at least 2 (one is the null "
            "block). Give the cache more memory or set num_gpu_blocks_override"
        )
        raise PlanError(msg)
    size = bytes_per_block * num_blocks
    tensors = build_kv_cache_tensors(
        groups,
        num_blocks=num_blocks,
        size=size,
        layout=layout,
        bytes_per_block=bytes_per_block,
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=groups,
        kv_cache_layout=layout,
        bytes_per_block=bytes_per_block,
    )


# ---------------------------------------------------------------------------
# Block sizes and the scheduler view
# ---------------------------------------------------------------------------


def effective_block_size(group: KVCacheGroupSpec, dcp: int) -> int:
    """A group's block in tokens: its block size, times decode context
    parallelism when every layer scales with it."""
    specs = group.layer_specs()
    scale = dcp if all(s.scales_with_context_parallel for s in specs) else 1
    return group.kv_cache_spec.block_size * scale


def serves_partial_hits(
    group: KVCacheGroupSpec, block_size: int, hash_block_size: int, dcp: int
) -> bool:
    """Whether a group can serve a prefix hit that ends inside its block, so
    hits align to the hash block rather than the scheduler block."""
    wider = block_size > hash_block_size if dcp == 1 else block_size >= hash_block_size
    return wider and any(s.caches_partial_block_hits for s in group.layer_specs())


def resolve_kv_cache_block_sizes(
    kv_cache_config: KVCacheConfig, config: EngineConfig
) -> tuple[int, int]:
    """``(scheduler_block_size, hash_block_size)`` for a plan.

    The scheduler block is the lcm of the groups' block sizes.  Hashes are
    as fine as the gcd of the prefix-cacheable groups' block sizes (or
    ``prefix_match_unit``), unless a layer forbids sub-block hashing.  Every
    prefix-cache boundary must align with each cacheable layer's per-state
    compression.
    """
    cache = config.cache_config
    dcp = config.parallel_config.decode_context_parallel_size
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        size = cache.block_size * dcp
        return size, size
    if len(groups) == 1:
        # The group's own block, not the engine default: a single MLA group of
        # 64-token blocks schedules in 64s whatever ``cache.block_size`` says.
        size = effective_block_size(groups[0], dcp)
        return size, size
    effective = [effective_block_size(g, dcp) for g in groups]
    scheduler = math.lcm(*effective)
    if not (cache.enable_prefix_caching or config.kv_transfer_enabled):
        return scheduler, scheduler
    specs = [s for g in groups for s in g.layer_specs()]
    if not all(s.allows_sub_block_hashing for s in specs):
        return scheduler, scheduler
    cacheable = [
        e
        for e, g in zip(effective, groups, strict=True)
        if g.kv_cache_spec.prefix_cacheable
    ]
    hashing = cacheable or effective
    unit = cache.prefix_match_unit or math.gcd(*hashing)
    bad = sorted({h for h in hashing if h % unit})
    if bad:
        msg = (
            f"Invalid prefix_match_unit={unit}; prefix-cacheable KV cache group "
            f"block sizes must be divisible by prefix_match_unit (block sizes "
            f"{bad} are not); choose a divisor of {math.gcd(*hashing)}"
        )
        raise BlockSizeError(msg)
    alignments = sorted(
        {
            s.tokens_per_state
            for s in specs
            if s.prefix_cacheable and s.tokens_per_state > 1
        }
    )
    partial = any(
        serves_partial_hits(g, e, unit, dcp)
        for g, e in zip(groups, effective, strict=True)
    )
    hit_alignment = unit if partial else scheduler
    broken = [a for a in alignments if hit_alignment % a]
    if broken:
        msg = (
            f"Invalid prefix_match_unit={unit}; prefix-cache boundaries must align "
            f"with each spec's per-state compression. Got alignments={alignments}, "
            f"and hits land on multiples of {hit_alignment} tokens; use a "
            f"multiple of {math.lcm(*alignments)}"
        )
        raise BlockSizeError(msg)
    return scheduler, unit


def generate_scheduler_kv_cache_config(
    configs: Sequence[KVCacheConfig],
) -> KVCacheConfig:
    """The scheduler's view of the workers' configs.

    Every worker must have the same ``num_blocks``.  Each group's spec
    becomes its first layer's spec (the scheduler needs one representative
    per group, not the per-layer pages).
    """
    if not configs:
        msg = "generate_scheduler_kv_cache_config needs at least one worker config"
        raise PlanError(msg)
    counts = [c.num_blocks for c in configs]
    if len(set(counts)) != 1:
        msg = (
            f"workers planned different block counts {counts}; every worker must "
            "have the same num_blocks (give them equal memory, or set "
            "num_gpu_blocks_override to the smallest)"
        )
        raise PlanError(msg)
    scheduler = copy.deepcopy(configs[0])
    for group in scheduler.kv_cache_groups:
        if isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs):
            wrapper = group.kv_cache_spec
            first = wrapper.first_spec
            if first.prefix_cacheable != wrapper.prefix_cacheable:  # pragma: no cover
                msg = "a group's members disagree on prefix cacheability"
                raise PlanError(msg)
            group.kv_cache_spec = first
    return scheduler


__all__ += ["iter_layer_specs", "tensor_strides"]
