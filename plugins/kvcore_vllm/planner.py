"""vLLM 0.33's KV-cache planner, as arithmetic on :class:`Layer` values.

The steps an engine runs, in order: the hybrid attention block-size
alignment of Mamba models (the attention block grows until its page holds a
Mamba state, and states are padded to the attention page); the grouping
(one group when every layer merges or shares a type; the packed path for a
block-outermost layout with mixed pages; otherwise page sizes unified and
layers cut into groups of one size); the block stride; the pool's blocks;
the check that one request of ``max_model_len`` fits (less the null block);
and the two figures the engine logs, from the scheduler's view of each group
(its first layer's spec).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from kvcore.errors import PlanError
from kvcore.spec import cdiv, round_up
from kvcore_vllm.layers import ATTENTION, Layer, Settings

__all__ = ["Group", "VllmPlan", "align_hybrid_block_size", "plan"]

#: The smallest kernel block of vLLM's default CUDA attention backends; the
#: hybrid alignment rounds the attention block to a multiple of it.
KERNEL_BLOCK = 16
#: Hybrid MLA/Mamba models keep the attention block a multiple of this.
MLA_KERNEL_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class Group:
    """A cache group: its layers and whether vLLM wraps them (a
    ``UniformTypeKVCacheSpecs``, each layer keeping its own spec) or merges
    them into one spec (the first layer's)."""

    names: tuple[str, ...]
    layers: tuple[Layer, ...]
    uniform_type: bool

    def layer_pages(self) -> list[Layer]:
        """The spec each layer is placed with."""
        if self.uniform_type:
            return list(self.layers)
        return [self.layers[0]] * len(self.layers)


@dataclasses.dataclass(frozen=True)
class VllmPlan:
    groups: tuple[Group, ...]
    bytes_per_block: int
    num_blocks: int


def align_hybrid_block_size(layers: dict[str, Layer]) -> dict[str, Layer]:
    """``Platform._align_hybrid_block_size``: for a model with Mamba and
    attention layers, grow the attention block until one attention page holds
    the largest Mamba state, then pad every state to that page."""
    states = [x for x in layers.values() if x.type == "mamba"]
    attention = [x for x in layers.values() if x.type in ATTENTION]
    if not states or not attention:
        return layers
    first = attention[0]
    per_token = first.heads * first.content // first.tokens_per_state
    state = max(x.state_bytes for x in states)
    block = max(x.block_size for x in attention)
    kernel = max(KERNEL_BLOCK, block)
    if any(x.type == "mla" for x in attention):
        kernel = max(kernel, MLA_KERNEL_BLOCK)
    aligned = kernel * cdiv(state, kernel * per_token)
    aligned = round_up(aligned, KERNEL_BLOCK)
    block = max(block, aligned)
    page = block * per_token
    out = {}
    for name, x in layers.items():
        if x.type in ATTENTION and x.block_size != block:
            x = x.with_block_size(block)
        elif x.type == "mamba" and page != x.state_bytes:
            x = dataclasses.replace(x, page_size_padded=page, block_size=block)
        elif x.type == "mamba":
            x = dataclasses.replace(x, block_size=block)
        out[name] = x
    return out


def _merges(a: Layer, b: Layer) -> bool:
    """vLLM's ``merge``: layers of one spec; two full-attention layers also
    merge when only their window or chunk differ (never here)."""
    return a == b


def _uniform_type(layers: Sequence[Layer]) -> bool:
    """``UniformTypeKVCacheSpecs.is_uniform_type``."""
    first = layers[0]
    if len({x.block_size for x in layers}) > 1:
        return False
    if any(x.family != first.family for x in layers):
        return False
    if first.type in ("sliding", "sliding_mla"):
        return all(x.window == first.window for x in layers)
    if first.type == "chunked":
        return all(x.chunk == first.chunk for x in layers)
    if first.type == "mamba":
        return all(
            x.page == first.page and x.speculative_blocks == first.speculative_blocks
            for x in layers
        )
    return True


def _approximate_gcd(values: Sequence[int], lower_bound: int) -> int:
    """The chunk size with the least padding in ``[lower_bound, max]``;
    ties go to the larger."""
    low = max(1, lower_bound)
    if low > max(values):
        return low
    best, best_pad = low, None
    for d in range(low, max(values) + 1):
        pad = sum((d - x % d) % d for x in values)
        if best_pad is None or pad <= best_pad:
            best, best_pad = d, pad
    return best


def _packed_groups(layers: dict[str, Layer]) -> list[Group]:
    """The block-outermost path for mixed page sizes."""
    buckets: list[dict[str, Layer]] = []
    for name, x in layers.items():
        for bucket in buckets:
            if _uniform_type([*bucket.values(), x]):
                bucket[name] = x
                break
        else:
            buckets.append({name: x})
    info = []
    for bucket in buckets:
        by_page: dict[int, list[str]] = {}
        for name, x in bucket.items():
            by_page.setdefault(x.page, []).append(name)
        balanced = len({len(v) for v in by_page.values()}) == 1
        most = Counter(x.page for x in bucket.values()).most_common(1)[0][1]
        info.append((bucket, by_page, balanced, most))
    floor = max((m for _, p, b, m in info if b and len(p) > 1), default=0)
    repeats = (
        _approximate_gcd([m for _, _, b, m in info if b], floor) if floor else None
    )

    def base_groups(balanced: bool, most: int) -> int:
        return cdiv(most, repeats) if balanced and repeats is not None else 1

    def widest(by_page: dict[int, list[str]], n: int) -> int:
        return sum(cdiv(len(v), n) * page for page, v in by_page.items())

    def is_state(bucket: dict[str, Layer]) -> bool:
        first = next(iter(bucket.values()))
        if first.type in ("mamba", "circular"):
            return True
        return repeats is None and first.type in ("sliding", "sliding_mla")

    anchor = max(
        widest(p, len(bk) if is_state(bk) else base_groups(b, m))
        for bk, p, b, m in info
    )
    groups: list[Group] = []
    for bucket, by_page, balanced, most in info:
        n = base_groups(balanced, most)
        if anchor and is_state(bucket):
            per_block = max(anchor // next(iter(bucket.values())).page, 1)
            n = max(n, cdiv(len(bucket), per_block))
        if n == 1:
            names = list(bucket)
        else:
            pattern = list(zip(*by_page.values(), strict=False))
            for i in range(n):
                names = [name for rep in pattern[i::n] for name in rep]
                groups.append(_group(layers, names, uniform_type=True))
            continue
        groups.append(_group(layers, names, uniform_type=True))
    return groups


def _group(
    layers: Mapping[str, Layer], names: Sequence[str], *, uniform_type: bool
) -> Group:
    return Group(tuple(names), tuple(layers[n] for n in names), uniform_type)


def _unify_pages(layers: dict[str, Layer]) -> dict[str, Layer] | None:
    """``unify_kv_cache_spec_page_size``; ``None`` when an MLA page can
    neither grow to the largest nor be padded to it."""
    top = max(x.page for x in layers.values())
    out = {}
    for name, x in layers.items():
        if x.page == top:
            out[name] = x
            continue
        if x.type == "mamba":
            new = dataclasses.replace(x, page_size_padded=top)
        elif top % x.page == 0:
            new = x.with_block_size(x.block_size * (top // x.page))
        elif x.type != "mla":
            new = x.with_padding(top)
        else:
            return None
        if new.page != top:
            msg = (
                f"vLLM 0.33 refuses this model in its default layout (LBNHC): layer "
                f"{name!r} ({x.type}, a {x.page}-byte page) cannot be brought to "
                f"the largest page ({top} bytes) because its own alignment pads it "
                "again; only a block-outermost layout packs it "
                "(VLLM_KV_CACHE_LAYOUT=BLNHC)"
            )
            raise PlanError(msg)
        out[name] = new
    return out


def _full_allocation_fallback(layers: dict[str, Layer]) -> list[Group] | None:
    """MLA beside plain sliding-window layers whose pages cannot be unified:
    vLLM allocates the window layers as full attention (one group)."""
    types = {x.type for x in layers.values()}
    if types & {"sliding_mla", "chunked"} or not {"mla", "sliding"} <= types:
        return None
    full_blocks = {x.block_size for x in layers.values() if x.type in ("full", "mla")}
    block = next(iter(full_blocks)) if len(full_blocks) == 1 else None
    promoted = {}
    for name, x in layers.items():
        if x.type in ("sliding", "chunked"):
            bs = block or x.block_size
            padded = x.page_size_padded
            if padded is not None:
                padded = max(padded, x.unpadded_page * bs // x.block_size)
            x = dataclasses.replace(
                x,
                type="full",
                window=0,
                extra_retained_tokens=0,
                block_size=bs,
                page_size_padded=padded,
            )
        promoted[name] = x
    if not _uniform_type(list(promoted.values())):
        return None
    return [_group(promoted, list(promoted), uniform_type=True)]


def _uniform_page_groups(layers: dict[str, Layer]) -> list[Group]:
    """Layers of one page size: buckets of one spec cut into groups of one
    size (the smallest bucket's, or the largest's when the sizes are close)."""
    buckets: dict[Layer, list[str]] = {}
    for name, x in layers.items():
        buckets.setdefault(x, []).append(name)
    sizes = [len(v) for v in buckets.values()]
    size = min(sizes)
    if max(sizes) < size * 1.5:
        size = max(sizes)
    groups: list[Group] = []
    for names in buckets.values():
        n = cdiv(len(names), size)
        groups.extend(_group(layers, names[i::n], uniform_type=False) for i in range(n))
    return groups


def _groups(layers: dict[str, Layer], block_outermost: bool) -> list[Group]:
    values = list(layers.values())
    if all(_merges(values[0], x) for x in values):
        return [_group(layers, list(layers), uniform_type=False)]
    if _uniform_type(values):
        return [_group(layers, list(layers), uniform_type=True)]
    if block_outermost and len({x.page for x in values}) > 1:
        return _packed_groups(layers)
    unified = _unify_pages(layers)
    if unified is None:
        fallback = _full_allocation_fallback(layers)
        if fallback is None:
            pages = sorted({x.page for x in values})
            msg = (
                f"vLLM 0.33 refuses this model in its default layout: its MLA pages "
                f"neither divide the largest page nor can be padded (page sizes "
                f"{pages}); it runs only in a block-outermost layout "
                "(VLLM_KV_CACHE_LAYOUT=BLNHC)"
            )
            raise PlanError(msg)
        return fallback
    return _uniform_page_groups(unified)


def _bytes_per_block(groups: Sequence[Group], block_outermost: bool) -> int:
    if not block_outermost:
        return max(sum(x.stride for x in g.layer_pages()) for g in groups)
    widest = max(sum(x.page for x in g.layer_pages()) for g in groups)
    alignments = [x.block_stride_alignment or 1 for g in groups for x in g.layers]
    return round_up(widest, math.lcm(*alignments))


def check_layout(groups: Sequence[Group], block_outermost: bool) -> None:
    """``validate_kv_cache_layout``: mixed page sizes in several groups need
    a block-outermost layout."""
    pages = {x.page for g in groups for x in g.layer_pages()}
    if len(pages) > 1 and len(groups) > 1 and not block_outermost:
        msg = (
            f"vLLM 0.33 refuses this model in its default layout (LBNHC): its "
            f"{len(groups)} groups mix page sizes {sorted(pages)}, which only a "
            "block-outermost layout can pack (VLLM_KV_CACHE_LAYOUT=BLNHC)"
        )
        raise PlanError(msg)


def plan(
    layers: dict[str, Layer],
    available_memory: int,
    *,
    block_outermost: bool,
    num_gpu_blocks_override: int | None = None,
) -> VllmPlan:
    """Group the layers and size the pool as vLLM does."""
    groups = _groups(layers, block_outermost)
    check_layout(groups, block_outermost)
    bytes_per_block = _bytes_per_block(groups, block_outermost)
    num_blocks = available_memory // bytes_per_block
    if num_gpu_blocks_override is not None:
        num_blocks = num_gpu_blocks_override
    return VllmPlan(tuple(groups), bytes_per_block, num_blocks)


def scheduler_blocks(p: VllmPlan, s: Settings) -> int:
    """Blocks one request of ``max_model_len`` holds, as the engine's log
    counts them: each group through its first layer's spec."""
    return sum(g.layers[0].pages_per_request(s) for g in p.groups)


def worker_blocks(p: VllmPlan, s: Settings) -> int:
    """Blocks the engine's memory check counts: each wrapped group through
    its most demanding layer."""
    return sum(
        max(x.pages_per_request(s) for x in g.layers)
        if g.uniform_type
        else g.layers[0].pages_per_request(s)
        for g in p.groups
    )


def check_fits(
    p: VllmPlan, s: Settings, memory: int, estimate: Callable[[int], int]
) -> None:
    """vLLM refuses memory (less its null block) that cannot hold one request
    of ``max_model_len`` tokens."""
    usable = memory - p.bytes_per_block
    need = p.bytes_per_block * worker_blocks(p, s)
    if need <= usable:
        return
    longest = estimate(usable)
    msg = (
        f"vLLM 0.33 refuses max_model_len={s.max_model_len:,}: one request needs "
        f"{need / 2**30:.2f} GiB of KV cache and {usable / 2**30:.2f} GiB is "
        "available"
        + (f"; the longest that fits is {longest:,} tokens" if longest else "")
    )
    raise PlanError(msg)
