"""The pool: one allocation, zero-copy typed views per layer, aliasing
across groups, isolation within one, kernel-block splitting and sizing.

The main plan below is built by hand (not by the grouping policy) so every
offset is known: six groups covering all seven kinds, in a BLHNC layout.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvcore import (
    CacheConfig,
    EngineConfig,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCachePool,
    KVCacheTensor,
    KvcoreKeyError,
    KvcoreTypeError,
    KvcoreValueError,
    LayoutError,
    PlanError,
    UniformTypeKVCacheSpecs,
    allocate_kv_cache,
    get_kv_cache_config_from_groups,
)
from kvcore_circular_buffer import CircularBufferSpec
from kvcore_full_attention import FullAttentionSpec
from kvcore_hisparse import HiSparseHotSpec
from kvcore_mamba import MambaSpec
from kvcore_mla import MLAAttentionSpec
from kvcore_sliding_window import SlidingWindowMLASpec, SlidingWindowSpec

cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# ---------------------------------------------------------------------------
# The hand-built multi-group plan
# ---------------------------------------------------------------------------

# bs 16, 1 head, head 64, bf16: N=16, C=64*2=128 -> 2048 B
MLA = MLAAttentionSpec(
    block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16
)
# bs 16, 2 heads, head 16 (+16 V), bf16: C=(16+16)*2=64, N=16, H=2 -> 2048 B
FULL = FullAttentionSpec(
    block_size=16, num_kv_heads=2, head_size=16, dtype=torch.bfloat16
)
# tps 4: N=16/4=4, C=32*2=64 -> 256 B
IDX = MLAAttentionSpec(
    block_size=16,
    num_kv_heads=1,
    head_size=32,
    dtype=torch.bfloat16,
    tokens_per_state=4,
)
# (2, 8) fp32 = 64 B, then (4,) bf16 = 8 B -> 72 B
SSM = MambaSpec(
    block_size=16, shapes=((2, 8), (4,)), dtypes=(torch.float32, torch.bfloat16)
)
# bs 4, head 8, no V, bf16: N=4, C=16 -> 64 B
RING = CircularBufferSpec(
    block_size=4, num_kv_heads=1, head_size=8, head_size_v=0, dtype=torch.bfloat16
)
# a hot page is 1024 B, and 1024 becomes an alignment of the block stride
HOT = HiSparseHotSpec(block_size=16, page_size=1024, blocks_per_request=2)
# bs 16, 1 head, head 32 (+32 V), fp16: C=64*2=128, N=16 -> 2048 B
SW = SlidingWindowSpec(
    block_size=16, num_kv_heads=1, head_size=32, dtype=torch.float16, sliding_window=64
)
# bs 16, 1 head, head 48, no V, uint8: N=16, C=48 -> 768 B
SWMLA = SlidingWindowMLASpec(
    block_size=16, num_kv_heads=1, head_size=48, dtype=torch.uint8, sliding_window=32
)

#: widest group: G0 = 3*2048 + 256 = 6400 B; lcm of alignments = 1024 (hot
#: page) -> round_up(6400, 1024) = 7*1024 = 7168 B per block.
BPB = 7168
#: 43108 // 7168 = 6 (6*7168 = 43008 <= 43108 < 50176 = 7*7168)
MEMORY = 43108
NUM_BLOCKS = 6
SIZE = 43008

#: layer -> (group, spec, byte start of its page inside a block, page bytes).
#: Within a group, layers are laid out by spec in first-appearance order, so
#: in G0 both MLA layers come before full.0 although full.0 sits between them.
LAYOUT: dict[str, tuple[int, object, int, int]] = {
    "mla.0": (0, MLA, 0, 2048),
    "full.0": (0, FULL, 4096, 2048),
    "mla.1": (0, MLA, 2048, 2048),
    "idx.0": (0, IDX, 6144, 256),
    "ssm.0": (1, SSM, 0, 72),
    "ssm.1": (1, SSM, 72, 72),
    "ring.0": (2, RING, 0, 64),
    "hot.0": (3, HOT, 0, 1024),
    "sw.0": (4, SW, 0, 2048),
    "sw.1": (4, SW, 2048, 2048),
    "swmla.0": (5, SWMLA, 0, 768),
}

#: layer -> the shapes of its typed view(s), dim 0 = num_blocks
SHAPES: dict[str, list[tuple[int, ...]]] = {
    "mla.0": [(6, 1, 16, 64)],
    "mla.1": [(6, 1, 16, 64)],
    "full.0": [(6, 2, 16, 32)],  # K and V side by side: 16 + 16
    "idx.0": [(6, 1, 4, 32)],  # 16 tokens / 4 per state
    "ssm.0": [(6, 2, 8), (6, 4)],
    "ssm.1": [(6, 2, 8), (6, 4)],
    "ring.0": [(6, 1, 4, 8)],
    "hot.0": [(6, 1, 1, 1024)],  # raw bytes
    "sw.0": [(6, 1, 16, 64)],
    "sw.1": [(6, 1, 16, 64)],
    "swmla.0": [(6, 1, 16, 48)],
}
DTYPES: dict[str, list[torch.dtype]] = {
    "mla.0": [torch.bfloat16],
    "mla.1": [torch.bfloat16],
    "full.0": [torch.bfloat16],
    "idx.0": [torch.bfloat16],
    "ssm.0": [torch.float32, torch.bfloat16],
    "ssm.1": [torch.float32, torch.bfloat16],
    "ring.0": [torch.bfloat16],
    "hot.0": [torch.uint8],
    "sw.0": [torch.float16],
    "sw.1": [torch.float16],
    "swmla.0": [torch.uint8],
}


def _groups() -> list[KVCacheGroupSpec]:
    g0 = {"mla.0": MLA, "full.0": FULL, "mla.1": MLA, "idx.0": IDX}
    return [
        KVCacheGroupSpec(
            list(g0), UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=g0)
        ),
        KVCacheGroupSpec(["ssm.0", "ssm.1"], SSM),
        KVCacheGroupSpec(["ring.0"], RING),
        KVCacheGroupSpec(["hot.0"], HOT),
        KVCacheGroupSpec(["sw.0", "sw.1"], SW),
        KVCacheGroupSpec(["swmla.0"], SWMLA),
    ]


def _engine(layout: str | None = "BLHNC", **cache: object) -> EngineConfig:
    return EngineConfig(cache_config=CacheConfig(kv_cache_layout=layout, **cache))  # type: ignore[arg-type]


def _plan() -> KVCacheConfig:
    return get_kv_cache_config_from_groups(_engine(), _groups(), MEMORY)


def _parts(view: object) -> list[torch.Tensor]:
    """A layer's view as a list of tensors (Mamba binds a tuple)."""
    if isinstance(view, tuple):
        return list(view)
    assert isinstance(view, torch.Tensor)
    return [view]


def test_plan_places_every_layer() -> None:
    config = _plan()
    assert config.num_blocks == NUM_BLOCKS
    assert config.bytes_per_block == BPB
    placed = {
        (tuple(t.layers), t.offset, t.layer_stride, t.block_stride, t.size)
        for t in config.kv_cache_tensors
    }
    assert placed == {
        (("mla.0", "mla.1"), 0, 2048, BPB, SIZE),
        (("full.0",), 4096, 2048, BPB, SIZE),
        (("idx.0",), 6144, 256, BPB, SIZE),
        (("ssm.0", "ssm.1"), 0, 72, BPB, SIZE),
        (("ring.0",), 0, 64, BPB, SIZE),
        (("hot.0",), 0, 1024, BPB, SIZE),
        (("sw.0", "sw.1"), 0, 2048, BPB, SIZE),
        (("swmla.0",), 0, 768, BPB, SIZE),
    }


def test_views_have_the_expected_shapes_and_dtypes() -> None:
    pool = KVCachePool(_plan())
    assert set(pool.views) == set(LAYOUT)
    for name, view in pool.views.items():
        parts = _parts(view)
        assert [tuple(p.shape) for p in parts] == SHAPES[name], name
        assert [p.dtype for p in parts] == DTYPES[name], name


def test_every_view_shares_the_pool_storage() -> None:
    pool = KVCachePool(_plan())
    assert pool.buffer.numel() == SIZE
    assert pool.buffer.dtype == torch.uint8
    base = pool.buffer.untyped_storage().data_ptr()
    for name, view in pool.views.items():
        for part in _parts(view):
            assert part.untyped_storage().data_ptr() == base, name


def test_views_start_where_the_plan_says() -> None:
    """Block b of a layer starts at b * 7168 + its start inside the block."""
    pool = KVCachePool(_plan())
    base = pool.buffer.data_ptr()
    for name, (_, _, start, _) in LAYOUT.items():
        parts = _parts(pool.views[name])
        for b in range(NUM_BLOCKS):
            assert parts[0][b].data_ptr() - base == b * BPB + start, (name, b)
        if name.startswith("ssm."):
            # the bf16 state follows the 64-byte fp32 state inside the page
            assert parts[1][0].data_ptr() - base == start + 64


def test_raw_view_is_each_layers_pages_as_bytes() -> None:
    """A layer's raw view is uint8 over the pool's storage, one page a row,
    starting where the plan says; its typed view lies on exactly those
    bytes.  A layer the plan lacks is named in a KeyError."""
    pool = KVCachePool(_plan())
    base = pool.buffer.data_ptr()
    for name, (_, _, start, page) in LAYOUT.items():
        raw = pool.raw_view(name)
        assert raw.dtype == torch.uint8
        assert raw.shape[0] == NUM_BLOCKS
        assert raw[0].numel() == page, name
        for b in range(NUM_BLOCKS):
            assert raw[b].data_ptr() - base == b * BPB + start, (name, b)
        assert _parts(pool.views[name])[0].data_ptr() == raw.data_ptr()
        raw[1].fill_(0x5A)
        _mark_bytes(pool.views[name], 1)
        assert bool((raw[1] == 0xA5).all()), name
        pool.buffer.zero_()
    with pytest.raises(KvcoreKeyError, match="'nope' has no tensor") as info:
        pool.raw_view("nope")
    assert isinstance(info.value, KeyError)
    with pytest.raises(KvcoreTypeError, match="layer name, a str") as typed:
        pool.raw_view(["full.0"])  # type: ignore[arg-type]
    assert isinstance(typed.value, TypeError)


def test_groups_at_the_same_offset_alias() -> None:
    pool = KVCachePool(_plan())
    firsts = ["mla.0", "ssm.0", "ring.0", "hot.0", "sw.0", "swmla.0"]
    ptrs = {_parts(pool.views[name])[0].data_ptr() for name in firsts}
    assert ptrs == {pool.buffer.data_ptr()}
    # sw.1 and mla.1 both start 2048 B into the block
    assert pool.views["sw.1"].data_ptr() == pool.views["mla.1"].data_ptr()  # type: ignore[union-attr]


def _mark_bytes(view: object, block: int) -> None:
    """Set every byte of one block of a layer's view to 0xA5."""
    for part in _parts(view):
        part[block].view(torch.uint8).fill_(0xA5)


@pytest.mark.parametrize("block", [0, 1, NUM_BLOCKS - 1], ids=["b0", "b1", "last"])
@pytest.mark.parametrize("name", list(LAYOUT), ids=list(LAYOUT))
def test_a_block_of_a_layer_is_exactly_its_page(name: str, block: int) -> None:
    """Writing one block of one layer touches [b*7168 + start, +page) only."""
    pool = KVCachePool(_plan())
    _, _, start, page = LAYOUT[name]
    _mark_bytes(pool.views[name], block)
    touched = pool.buffer.nonzero().flatten()
    first = block * BPB + start
    assert torch.equal(touched, torch.arange(first, first + page))


@pytest.mark.parametrize("group", range(6), ids=[f"g{i}" for i in range(6)])
def test_layers_within_a_group_are_disjoint(group: int) -> None:
    pool = KVCachePool(_plan())
    members = [n for n, (g, *_) in LAYOUT.items() if g == group]
    footprints = []
    for name in members:
        pool.buffer.zero_()
        for b in range(NUM_BLOCKS):
            _mark_bytes(pool.views[name], b)
        footprints.append(set(pool.buffer.nonzero().flatten().tolist()))
    for i, mine in enumerate(footprints):
        for other in footprints[i + 1 :]:
            assert not mine & other


def _pattern(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(1, 256, shape, generator=gen).to(dtype)


@pytest.mark.parametrize("name", list(LAYOUT), ids=list(LAYOUT))
def test_typed_round_trip(name: str) -> None:
    """Write a block through the typed view; read it back through the view
    and as the raw bytes of the page."""
    pool = KVCachePool(_plan())
    _, _, start, page = LAYOUT[name]
    block = 4
    parts = _parts(pool.views[name])
    patterns = [
        _pattern(tuple(p.shape[1:]), p.dtype, seed=i) for i, p in enumerate(parts)
    ]
    for part, pattern in zip(parts, patterns, strict=True):
        part[block].copy_(pattern)
    for part, pattern in zip(parts, patterns, strict=True):
        assert torch.equal(part[block], pattern)
    raw = torch.cat([p.contiguous().view(torch.uint8).flatten() for p in patterns])
    assert raw.numel() == page
    first = block * BPB + start
    assert torch.equal(pool.buffer[first : first + page], raw)


def test_blocks_owned_by_different_groups_stay_isolated() -> None:
    """Group g owns block g: writes by one group never disturb another's."""
    pool = KVCachePool(_plan())
    written: dict[str, list[torch.Tensor]] = {}
    for seed, (name, (group, *_)) in enumerate(LAYOUT.items()):
        parts = _parts(pool.views[name])
        written[name] = []
        for i, part in enumerate(parts):
            pattern = _pattern(tuple(part.shape[1:]), part.dtype, seed=10 * seed + i)
            part[group].copy_(pattern)
            written[name].append(pattern)
    for name, (group, *_) in LAYOUT.items():
        for part, pattern in zip(_parts(pool.views[name]), written[name], strict=True):
            assert torch.equal(part[group], pattern), name


def test_allocate_kv_cache_returns_the_pool_views() -> None:
    views = allocate_kv_cache(_plan(), "cpu")
    assert set(views) == set(LAYOUT)
    ptrs = {p.untyped_storage().data_ptr() for v in views.values() for p in _parts(v)}
    assert len(ptrs) == 1
    assert isinstance(views["ssm.0"], tuple)


def test_allocate_kv_cache_of_an_empty_plan() -> None:
    config = get_kv_cache_config_from_groups(_engine(), [], MEMORY)
    assert config.num_blocks == 1
    assert config.kv_cache_tensors == []
    assert allocate_kv_cache(config, "cpu") == {}


def test_hot_pages_need_a_block_outer_layout() -> None:
    groups = [KVCacheGroupSpec(["hot.0"], HOT)]
    with pytest.raises(LayoutError, match="block-outermost"):
        get_kv_cache_config_from_groups(_engine("LBNHC"), groups, 10 * 1024)


# ---------------------------------------------------------------------------
# Kernel block splitting
# ---------------------------------------------------------------------------

# bs 16, 2 heads, head 8 (+8 V), fp16: C=(8+8)*2=32, N=16, H=2 -> 1024 B
KERNEL_SPEC = FullAttentionSpec(
    block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16
)


def _full_plan(layout: str) -> KVCacheConfig:
    groups = [KVCacheGroupSpec(["a", "b"], KERNEL_SPEC)]
    # 2 layers * 1024 B = 2048 B per block; 4 blocks
    return get_kv_cache_config_from_groups(_engine(layout), groups, 4 * 2048)


def test_kernel_blocks_split_a_layer_outer_plan() -> None:
    config = _full_plan("LBNHC")
    (tensor,) = config.kv_cache_tensors
    # layer-outer: each layer owns 4 * 1024 B; a block is one 1024-B page
    assert (tensor.layer_stride, tensor.block_stride) == (4096, 1024)
    pool = KVCachePool(config, kernel_block_sizes=[8])
    base = pool.buffer.data_ptr()
    for li, name in enumerate(["a", "b"]):
        view = pool.views[name]
        assert isinstance(view, torch.Tensor)
        # 16 / 8 = 2 kernel blocks per block: [4*2, H=2, 8 tokens, 8+8]
        assert view.shape == (8, 2, 8, 16)
        # bytes: kernel block 1024/2 = 512, H = C = 32 (LBNHC: N outside H),
        # N = H*C = 64; in fp16 elements: 256, 16, 32, 1
        assert view.stride() == (256, 16, 32, 1)
        assert view.data_ptr() - base == li * 4096
        assert (
            view.untyped_storage().data_ptr()
            == pool.buffer.untyped_storage().data_ptr()
        )


@pytest.mark.parametrize("kernel_block", range(8), ids=[f"kb{i}" for i in range(8)])
def test_kernel_block_covers_half_a_block(kernel_block: int) -> None:
    """Kernel block 2k+r is tokens 8r..8r+7 of block k: bytes
    [layer + k*1024 + r*512, +512)."""
    pool = KVCachePool(_full_plan("LBNHC"), kernel_block_sizes=[8])
    view = pool.views["b"]
    assert isinstance(view, torch.Tensor)
    view[kernel_block].view(torch.uint8).fill_(0xA5)
    k, r = divmod(kernel_block, 2)
    first = 4096 + k * 1024 + r * 512
    assert torch.equal(
        pool.buffer.nonzero().flatten(), torch.arange(first, first + 512)
    )


def test_kernel_block_equal_to_the_block_does_not_split() -> None:
    pool = KVCachePool(_full_plan("LBNHC"), kernel_block_sizes=[16])
    assert pool.views["a"].shape == (4, 2, 16, 16)  # type: ignore[union-attr]


@pytest.mark.parametrize("name", ["LBHNC", "BLHNC"])
def test_kernel_blocks_refused_when_heads_are_outside_tokens(name: str) -> None:
    """In an H-outer page [H, N, C] half the tokens of every head are not one
    contiguous run, so a kernel block would overlap its neighbour's heads."""
    # BLHNC with a single layer: the block is exactly one dense page
    layers = ["a", "b"] if name == "LBHNC" else ["a"]
    groups = [KVCacheGroupSpec(layers, KERNEL_SPEC)]
    config = get_kv_cache_config_from_groups(
        _engine(name), groups, 4 * 1024 * len(layers)
    )
    with pytest.raises(LayoutError, match="cannot be split into kernel blocks"):
        KVCachePool(config, kernel_block_sizes=[8])


def test_kernel_blocks_of_one_head_split_in_any_block_compact_layout() -> None:
    """With one head, H-outer and N-outer pages are the same bytes."""
    one_head = FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    # C = 32, N = 16 -> 512 B per page; 2 layers, 4 blocks
    groups = [KVCacheGroupSpec(["a", "b"], one_head)]
    config = get_kv_cache_config_from_groups(_engine("LBHNC"), groups, 4 * 1024)
    pool = KVCachePool(config, kernel_block_sizes=[4])
    view = pool.views["b"]
    assert isinstance(view, torch.Tensor)
    # 16 / 4 = 4 kernel blocks per block: [16, 1, 4, 16]
    assert view.shape == (16, 1, 4, 16)
    view[5].view(torch.uint8).fill_(0xA5)
    # kernel block 5 = block 1, quarter 1: layer b at 4*512 = 2048, + 512 + 128
    assert torch.equal(pool.buffer.nonzero().flatten(), torch.arange(2688, 2816))


def test_kernel_blocks_split_a_single_layer_block_outer_plan() -> None:
    """BLNHC with one layer: the block is one dense N-outer page."""
    groups = [KVCacheGroupSpec(["a"], KERNEL_SPEC)]
    config = get_kv_cache_config_from_groups(_engine("BLNHC"), groups, 4 * 1024)
    pool = KVCachePool(config, kernel_block_sizes=[8])
    view = pool.views["a"]
    assert isinstance(view, torch.Tensor)
    assert view.shape == (8, 2, 8, 16)
    view[3].view(torch.uint8).fill_(0xA5)
    # kernel block 3 = block 1, second half: 1024 + 512
    assert torch.equal(pool.buffer.nonzero().flatten(), torch.arange(1536, 2048))


def test_kernel_blocks_rejected_in_a_packed_multi_group_plan() -> None:
    """In BLHNC the block stride is the whole packed block (2048 B), not one
    dense page (1024 B), so a block cannot be cut into kernel blocks."""
    narrow = FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    # group 0: 2 * 1024 B; group 1: 1 head -> 512 B; block = 2048 B
    groups = [
        KVCacheGroupSpec(["a", "b"], KERNEL_SPEC),
        KVCacheGroupSpec(["c"], narrow),
    ]
    config = get_kv_cache_config_from_groups(_engine("BLHNC"), groups, 4 * 2048)
    assert config.bytes_per_block == 2048
    with pytest.raises(LayoutError, match="cannot be split into kernel blocks"):
        KVCachePool(config, kernel_block_sizes=[8, 8])


def test_kernel_block_must_divide_the_block() -> None:
    with pytest.raises(LayoutError, match="must divide"):
        KVCachePool(_full_plan("LBNHC"), kernel_block_sizes=[5])


def test_kernel_block_sizes_needs_one_entry_per_group() -> None:
    with pytest.raises(PlanError, match="one per group"):
        KVCachePool(_full_plan("LBNHC"), kernel_block_sizes=[8, 8])


# ---------------------------------------------------------------------------
# Sizing
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "memory",
    [0, 2047, 2 * 2048 - 1],
    ids=["zero", "under-one-block", "one-block"],
)
def test_fewer_than_two_blocks_is_a_plan_error(memory: int) -> None:
    groups = [KVCacheGroupSpec(["a", "b"], KERNEL_SPEC)]
    with pytest.raises(PlanError, match="at least 2") as info:
        get_kv_cache_config_from_groups(_engine(), groups, memory)
    assert isinstance(info.value, ValueError)


def test_exactly_two_blocks_is_enough() -> None:
    groups = [KVCacheGroupSpec(["a", "b"], KERNEL_SPEC)]
    config = get_kv_cache_config_from_groups(_engine(), groups, 2 * 2048)
    assert config.num_blocks == 2


@pytest.mark.parametrize("memory", [0, 2048 * 100], ids=["no-memory", "plenty"])
def test_num_gpu_blocks_override_is_honoured(memory: int) -> None:
    groups = [KVCacheGroupSpec(["a", "b"], KERNEL_SPEC)]
    config = get_kv_cache_config_from_groups(
        _engine(num_gpu_blocks_override=7), groups, memory
    )
    assert config.num_blocks == 7
    (tensor,) = config.kv_cache_tensors
    # 7 blocks * 2048 B
    assert tensor.size == 14336
    pool = KVCachePool(config)
    assert pool.buffer.numel() == 14336
    assert pool.views["a"].shape[0] == 7  # type: ignore[union-attr]


def test_override_below_two_blocks_is_a_plan_error() -> None:
    groups = [KVCacheGroupSpec(["a", "b"], KERNEL_SPEC)]
    with pytest.raises(PlanError, match="at least 2"):
        get_kv_cache_config_from_groups(
            _engine(num_gpu_blocks_override=1), groups, 2048 * 100
        )


def test_available_memory_must_be_an_int() -> None:
    groups = [KVCacheGroupSpec(["a", "b"], KERNEL_SPEC)]
    with pytest.raises(PlanError, match="available_memory"):
        get_kv_cache_config_from_groups(_engine(), groups, 8192.0)  # type: ignore[arg-type]


def test_tensors_of_different_sizes_are_rejected() -> None:
    config = _full_plan("BLHNC")
    (tensor,) = config.kv_cache_tensors
    config.kv_cache_tensors.append(
        KVCacheTensor(
            size=tensor.size + 1,
            layers=["a"],
            layer_stride=tensor.layer_stride,
            block_stride=tensor.block_stride,
        )
    )
    with pytest.raises(PlanError, match="share one backing allocation"):
        KVCachePool(config)


# ---------------------------------------------------------------------------
# CUDA (skipped without a GPU)
# ---------------------------------------------------------------------------


@cuda
@needs_cuda
def test_cuda_views_share_one_device_allocation() -> None:
    pool = KVCachePool(_plan(), "cuda")
    assert pool.buffer.is_cuda
    base = pool.buffer.untyped_storage().data_ptr()
    start = pool.buffer.data_ptr()
    for name, (_, _, offset, _) in LAYOUT.items():
        for part in _parts(pool.views[name]):
            assert part.is_cuda
            assert part.untyped_storage().data_ptr() == base
        assert _parts(pool.views[name])[0][2].data_ptr() - start == 2 * BPB + offset
    assert pool.views["mla.0"].data_ptr() == pool.views["hot.0"].data_ptr()  # type: ignore[union-attr]


@cuda
@needs_cuda
def test_cuda_typed_round_trip_matches_cpu_bytes() -> None:
    """The same writes give byte-identical pools on CPU and CUDA."""
    pools = [KVCachePool(_plan(), device) for device in ("cpu", "cuda")]
    for pool in pools:
        for seed, (name, (group, *_)) in enumerate(LAYOUT.items()):
            for i, part in enumerate(_parts(pool.views[name])):
                pattern = _pattern(
                    tuple(part.shape[1:]), part.dtype, seed=10 * seed + i
                )
                part[group].copy_(pattern.to(part.device))
    assert torch.equal(pools[0].buffer, pools[1].buffer.cpu())


@cuda
@needs_cuda
def test_cuda_kernel_block_split() -> None:
    pool = KVCachePool(_full_plan("LBNHC"), "cuda", kernel_block_sizes=[8])
    view = pool.views["b"]
    assert isinstance(view, torch.Tensor)
    assert view.shape == (8, 2, 8, 16)
    view[3].view(torch.uint8).fill_(0xA5)
    # kernel block 3 = block 1, second half: 4096 + 1024 + 512
    touched = pool.buffer.nonzero().flatten().cpu()
    assert torch.equal(touched, torch.arange(5632, 6144))


@cuda
@needs_cuda
def test_cuda_allocate_kv_cache() -> None:
    views = allocate_kv_cache(_plan(), torch.device("cuda"))
    ptrs = {p.untyped_storage().data_ptr() for v in views.values() for p in _parts(v)}
    assert len(ptrs) == 1
    assert all(p.is_cuda for v in views.values() for p in _parts(v))


def test_layout_of_the_plan_is_recorded() -> None:
    assert _plan().kv_cache_layout is KVCacheLayout.BLHNC


# ---------------------------------------------------------------------------
# Copy-on-write block copies
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["BLHNC", "BLNHC"])
def test_copy_blocks_copies_every_layer_of_the_group(layout: str) -> None:
    """Data written into block 2 of group 0's layers reaches block 4 of the
    same layers; other groups' layers (aliasing the same block ids) and
    other blocks are untouched."""
    from kvcore.coordinator import BlockCopy

    config = get_kv_cache_config_from_groups(_engine(layout), _groups(), MEMORY)
    pool = KVCachePool(config)
    members = [n for n, (g, *_) in LAYOUT.items() if g == 0]
    written = {}
    for seed, name in enumerate(members):
        (part,) = _parts(pool.views[name])
        pattern = _pattern(tuple(part.shape[1:]), part.dtype, seed=seed + 1)
        part[2].copy_(pattern)
        written[name] = pattern
    before = {n: [p.clone() for p in _parts(v)] for n, v in pool.views.items()}
    pool.copy_blocks([BlockCopy(0, 2, 4, 5)])
    for name in members:
        (part,) = _parts(pool.views[name])
        assert torch.equal(part[4], written[name]), name
        assert torch.equal(part[2], written[name]), name
    # Every other block is as it was (block 4 of other groups aliases group
    # 0's block 4, which was written).
    for name, parts in before.items():
        for old, new in zip(parts, _parts(pool.views[name]), strict=True):
            for b in range(config.num_blocks):
                if b != 4:
                    assert torch.equal(old[b], new[b]), (name, b)


@pytest.mark.parametrize("layout", [layout.name for layout in KVCacheLayout])
def test_copy_blocks_in_every_layout(layout: str) -> None:
    from kvcore.coordinator import BlockCopy

    pool = KVCachePool(_full_plan(layout))
    for name, seed in (("a", 1), ("b", 2)):
        view = _parts(pool.views[name])[0]
        view[1].copy_(_pattern(tuple(view.shape[1:]), view.dtype, seed))
    others = [_parts(pool.views[n])[0][b].clone() for n in "ab" for b in (0, 2)]
    pool.copy_blocks([BlockCopy(0, 1, 3, 7)])
    for name in "ab":
        view = _parts(pool.views[name])[0]
        assert torch.equal(view[3], view[1]), name
    after = [_parts(pool.views[n])[0][b] for n in "ab" for b in (0, 2)]
    assert all(torch.equal(x, y) for x, y in zip(others, after, strict=True))


def test_copy_blocks_with_kernel_blocks() -> None:
    from kvcore.coordinator import BlockCopy

    pool = KVCachePool(_full_plan("LBNHC"), kernel_block_sizes=[8])
    view = _parts(pool.views["a"])[0]
    view[2].view(torch.uint8).fill_(0x11)
    view[3].view(torch.uint8).fill_(0x22)
    pool.copy_blocks([BlockCopy(0, 1, 2, 12)])
    assert bool((view[4].view(torch.uint8) == 0x11).all())
    assert bool((view[5].view(torch.uint8) == 0x22).all())


def test_copy_blocks_refuses_a_bad_copy() -> None:
    from kvcore.coordinator import BlockCopy

    pool = KVCachePool(_plan())
    with pytest.raises(KvcoreValueError, match="group_id"):
        pool.copy_blocks([BlockCopy(9, 1, 2, 4)])
    with pytest.raises(KvcoreValueError, match="dst_block_id"):
        pool.copy_blocks([BlockCopy(0, 1, 0, 4)])


def _random_pool(config: KVCacheConfig, **kwargs: object) -> KVCachePool:
    pool = KVCachePool(config, **kwargs)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(3)
    pool.buffer.copy_(torch.randint(0, 256, pool.buffer.shape, generator=gen))
    return pool


def test_copy_blocks_runs_chained_copies_in_order() -> None:
    """A copy reading a block an earlier copy wrote reads the new page; two
    copies into one block leave the later one's page."""
    from kvcore.coordinator import BlockCopy

    pool = _random_pool(_plan())
    raw = pool.raw_view("full.0")
    one, two = raw[1].clone(), raw[2].clone()
    pool.copy_blocks([BlockCopy(0, 1, 3, 4), BlockCopy(0, 3, 4, 4)])
    assert torch.equal(raw[3], one)
    assert torch.equal(raw[4], one)
    pool.copy_blocks([BlockCopy(0, 1, 5, 4), BlockCopy(0, 2, 5, 4)])
    assert torch.equal(raw[5], two)
    # A swap written as two copies: the second reads what the first wrote.
    pool.copy_blocks([BlockCopy(0, 1, 2, 4), BlockCopy(0, 2, 1, 4)])
    assert torch.equal(raw[1], one)
    assert torch.equal(raw[2], one)


def test_a_refused_copy_blocks_call_copies_nothing() -> None:
    from kvcore.coordinator import BlockCopy

    pool = _random_pool(_plan())
    before = pool.buffer.clone()
    with pytest.raises(KvcoreValueError, match=r"copies\[2\]\.src_block_id"):
        pool.copy_blocks(
            [BlockCopy(0, 1, 2, 4), BlockCopy(1, 3, 4, 4), BlockCopy(0, 0, 5, 4)]
        )
    assert torch.equal(pool.buffer, before)


@pytest.mark.parametrize("kernel", [False, True])
@given(
    copies=st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 5), st.integers(1, 5)),
        max_size=12,
    )
)
# Group 1 writes block 1 after group 0 read it: groups overlay one
# another's bytes, so the write waits for the next batch.
@example(copies=[(1, 1, 4), (0, 1, 2), (1, 3, 1)])
@settings(max_examples=100, deadline=None)
def test_copy_blocks_in_one_call_equals_one_call_a_copy(
    kernel: bool, copies: list[tuple[int, int, int]]
) -> None:
    """Batched copies give the bytes the copies give one call at a time, in
    every group, with and without kernel blocks."""
    from kvcore.coordinator import BlockCopy

    if kernel:
        config, kwargs = _full_plan("LBNHC"), {"kernel_block_sizes": [8]}
        copies = [(0, 1 + s % 3, 1 + d % 3) for _, s, d in copies]
    else:
        config, kwargs = _plan(), {}
        groups = len(config.kv_cache_groups)
        copies = [(g % groups, s, d) for g, s, d in copies]
    batched, alone = _random_pool(config, **kwargs), _random_pool(config, **kwargs)
    batched.copy_blocks([BlockCopy(g, s, d, 1) for g, s, d in copies])
    for g, s, d in copies:
        alone.copy_blocks([BlockCopy(g, s, d, 1)])
    assert torch.equal(batched.buffer, alone.buffer)


@cuda
@needs_cuda
def test_cuda_copy_blocks_match_cpu() -> None:
    """The same writes and copies give byte-identical pools on CPU and CUDA."""
    from kvcore.coordinator import BlockCopy

    pools = [KVCachePool(_plan(), device) for device in ("cpu", "cuda")]
    for pool in pools:
        for seed, name in enumerate(LAYOUT):
            for i, part in enumerate(_parts(pool.views[name])):
                pattern = _pattern(tuple(part.shape[1:]), part.dtype, seed=seed + i)
                part[1].copy_(pattern.to(part.device))
        pool.copy_blocks([BlockCopy(0, 1, 3, 5), BlockCopy(4, 1, 2, 16)])
    assert torch.equal(pools[0].buffer, pools[1].buffer.cpu())


def test_a_cuda_pool_without_cuda_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch answers a CUDA allocation on a CPU build with a bare
    AssertionError; kvcore names the device and the fix first."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(KvcoreValueError, match="this torch has no CUDA device"):
        KVCachePool(_plan(), "cuda")
    with pytest.raises(KvcoreValueError, match="this torch has no CUDA device"):
        KVCachePool(_plan(), torch.device("cuda", 0))
