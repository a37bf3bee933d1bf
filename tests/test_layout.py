"""The six physical layouts of ``[L, B, H, N, C]``: their properties, their
strides, and what a plan and its bound views look like in each.

Strides are worked out by hand (semantics §2): walk the physical order from
the innermost axis out, each axis taking the running stride, which then grows
by that axis's extent.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvcore import (
    CacheConfig,
    EngineConfig,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCachePool,
    LayoutError,
    UniformTypeKVCacheSpecs,
    allocate_kv_cache,
    compute_layout_strides,
    get_kv_cache_config_from_groups,
)
from kvcore_full_attention import FullAttentionSpec
from kvcore_mla import MLAAttentionSpec

ALL = [layout.name for layout in KVCacheLayout]

# ---------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------

#: name -> (is_layer_compact, is_block_outermost, is_block_compact, can_pack)
PROPERTIES = {
    "LBHNC": (True, False, True, False),
    "LBNHC": (True, False, True, False),
    "LHBNC": (True, False, False, False),
    "BLHNC": (False, True, True, True),
    "BLNHC": (False, True, True, True),
    "BHLNC": (False, True, False, False),
}


def test_there_are_exactly_six_layouts() -> None:
    assert sorted(ALL) == sorted(PROPERTIES)


@pytest.mark.parametrize("name", list(PROPERTIES), ids=list(PROPERTIES))
def test_layout_properties(name: str) -> None:
    layout = KVCacheLayout[name]
    assert (
        layout.is_layer_compact,
        layout.is_block_outermost,
        layout.is_block_compact,
        layout.can_pack,
    ) == PROPERTIES[name]


@pytest.mark.parametrize(
    ("name", "order"),
    [
        # L, B, H, N, C = 0..4; the member value is the physical order
        ("LBHNC", (0, 1, 2, 3, 4)),
        ("LBNHC", (0, 1, 3, 2, 4)),
        ("LHBNC", (0, 2, 1, 3, 4)),
        ("BLHNC", (1, 0, 2, 3, 4)),
        ("BLNHC", (1, 0, 3, 2, 4)),
        ("BHLNC", (1, 2, 0, 3, 4)),
    ],
    ids=list(PROPERTIES),
)
def test_layout_values_are_physical_orders(name: str, order: tuple[int, ...]) -> None:
    assert KVCacheLayout[name].value == order


@pytest.mark.parametrize(
    ("alias", "name"), [("NHD", "LBNHC"), ("HND", "LBHNC")], ids=["NHD", "HND"]
)
def test_aliases(alias: str, name: str) -> None:
    assert KVCacheLayout.from_name(alias) is KVCacheLayout[name]
    assert CacheConfig(kv_cache_layout=alias).kv_cache_layout is KVCacheLayout[name]


@pytest.mark.parametrize("name", ALL, ids=ALL)
def test_from_name_round_trips(name: str) -> None:
    layout = KVCacheLayout[name]
    assert KVCacheLayout.from_name(name) is layout
    assert KVCacheLayout.from_name(name.lower()) is layout
    assert KVCacheLayout.from_name(layout) is layout


@pytest.mark.parametrize("bad", ["XYZ", "BLHN", ""], ids=["XYZ", "BLHN", "empty"])
def test_unknown_layout_lists_known_ones(bad: str) -> None:
    with pytest.raises(LayoutError, match="unknown KV cache layout") as info:
        KVCacheLayout.from_name(bad)
    assert isinstance(info.value, ValueError)
    for known in [*ALL, "NHD", "HND"]:
        assert known in str(info.value)


def test_unknown_layout_in_cache_config() -> None:
    with pytest.raises(LayoutError, match="known layouts"):
        CacheConfig(kv_cache_layout="bogus")


# ---------------------------------------------------------------------------
# compute_layout_strides on (L=2, B=3, H=2, N=4, C=8): a page is 2*4*8 = 64 B
# ---------------------------------------------------------------------------

SHAPE = (2, 3, 2, 4, 8)

STRIDES = {
    # C=1 -> N=8 -> H=8*4=32 -> B=32*2=64 -> L=64*3=192
    "LBHNC": (192, 64, 32, 8, 1),
    # C=1 -> H=8 -> N=8*2=16 -> B=16*4=64 -> L=64*3=192
    "LBNHC": (192, 64, 8, 16, 1),
    # C=1 -> N=8 -> B=8*4=32 -> H=32*3=96 -> L=96*2=192
    "LHBNC": (192, 32, 96, 8, 1),
    # C=1 -> N=8 -> H=32 -> L=32*2=64 -> B=64*2=128
    "BLHNC": (64, 128, 32, 8, 1),
    # C=1 -> H=8 -> N=16 -> L=16*4=64 -> B=64*2=128
    "BLNHC": (64, 128, 8, 16, 1),
    # C=1 -> N=8 -> L=8*4=32 -> H=32*2=64 -> B=64*2=128
    "BHLNC": (32, 128, 64, 8, 1),
}


@pytest.mark.parametrize("name", list(STRIDES), ids=list(STRIDES))
def test_compute_layout_strides(name: str) -> None:
    layout = KVCacheLayout[name]
    assert compute_layout_strides(layout, SHAPE, page_bytes=64) == STRIDES[name]


@pytest.mark.parametrize("name", list(STRIDES), ids=list(STRIDES))
def test_strides_cover_the_tensor_exactly_once(name: str) -> None:
    """With no padding, the 2*3*64 = 384 bytes are addressed exactly once."""
    strides = compute_layout_strides(KVCacheLayout[name], SHAPE, page_bytes=64)
    raw = torch.arange(384)
    view = torch.as_strided(raw, SHAPE, strides)
    assert sorted(view.flatten().tolist()) == list(range(384))


PADDED = {
    # page closes at B: max(64, 80) = 80 -> B=80, L=80*3=240
    "LBHNC": (240, 80, 32, 8, 1),
    "LBNHC": (240, 80, 8, 16, 1),
    # page closes at L: max(64, 80) = 80 -> L=80, B=80*2=160
    "BLHNC": (80, 160, 32, 8, 1),
    "BLNHC": (80, 160, 8, 16, 1),
}


@pytest.mark.parametrize("name", list(PADDED), ids=list(PADDED))
def test_padded_page_strides(name: str) -> None:
    """An 80-byte padded page keeps its 16 bytes of padding per page."""
    layout = KVCacheLayout[name]
    assert compute_layout_strides(layout, SHAPE, page_bytes=80) == PADDED[name]


@pytest.mark.parametrize("name", ["LHBNC", "BHLNC"])
def test_padded_page_rejected_by_non_block_compact_layouts(name: str) -> None:
    with pytest.raises(LayoutError, match="cannot hold a padded page"):
        compute_layout_strides(KVCacheLayout[name], SHAPE, page_bytes=80)


def test_fixed_strides_are_kept() -> None:
    # B fixed at 1000; the inner axes are unchanged, L still closes at 64
    assert compute_layout_strides(
        KVCacheLayout.BLHNC, SHAPE, page_bytes=64, fixed={1: 1000}
    ) == (64, 1000, 32, 8, 1)
    # L fixed at 500 in a layer-outer layout
    assert compute_layout_strides(
        KVCacheLayout.LBHNC, SHAPE, page_bytes=64, fixed={0: 500}
    ) == (500, 64, 32, 8, 1)


# ---------------------------------------------------------------------------
# Planning and binding uniform pages in every layout
# ---------------------------------------------------------------------------

#: Full(bs 4, 2 heads, head 4, fp16): C = (4+4)*2 = 16 B, N = 4, H = 2,
#: page = 2*4*16 = 128 B; 3 layers -> 384 B per block.
SPEC = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=4, dtype=torch.float16)
LAYERS = ["l.0", "l.1", "l.2"]
PAGE = 128
#: 2020 // 384 = 5 blocks (5*384 = 1920 <= 2020 < 2304 = 6*384)
MEMORY = 2020
NUM_BLOCKS = 5
SIZE = 1920

#: name -> (layer_stride, block_stride, byte coefficients of (l, b, h, n)),
#: so the 16-byte state (l, b, h, n) starts at l*cl + b*cb + h*ch + n*cn.
UNIFORM = {
    # L outer: each layer owns 128*5 = 640 B; a page [H, N, C] is 128 B
    "LBHNC": (640, 128, (640, 128, 64, 16)),
    # page [N, H, C]: n*32 + h*16
    "LBNHC": (640, 128, (640, 128, 16, 32)),
    # L, H, B, N, C: N=16, B=4*16=64, H=64*5=320, L=320*2=640
    "LHBNC": (640, 64, (640, 64, 320, 16)),
    # B outer: a block is 3 pages = 384 B, layer l at l*128 inside it
    "BLHNC": (128, 384, (128, 384, 64, 16)),
    "BLNHC": (128, 384, (128, 384, 16, 32)),
    # B, H, L, N, C: N=16, L=4*16=64, H=64*3=192, B=192*2=384
    "BHLNC": (64, 384, (64, 384, 192, 16)),
}


def _engine(layout: str | None) -> EngineConfig:
    return EngineConfig(cache_config=CacheConfig(kv_cache_layout=layout))


def _uniform_plan(name: str) -> KVCacheConfig:
    groups = [KVCacheGroupSpec(list(LAYERS), SPEC)]
    return get_kv_cache_config_from_groups(_engine(name), groups, MEMORY)


@pytest.mark.parametrize("name", list(UNIFORM), ids=list(UNIFORM))
def test_uniform_plan_strides(name: str) -> None:
    config = _uniform_plan(name)
    layer_stride, block_stride, _ = UNIFORM[name]
    assert config.num_blocks == NUM_BLOCKS
    assert config.bytes_per_block == 3 * PAGE
    assert config.kv_cache_layout is KVCacheLayout[name]
    (tensor,) = config.kv_cache_tensors
    assert tensor.layers == LAYERS
    assert (tensor.layer_stride, tensor.block_stride, tensor.offset) == (
        layer_stride,
        block_stride,
        0,
    )
    assert tensor.size == SIZE


@pytest.mark.parametrize("name", list(UNIFORM), ids=list(UNIFORM))
def test_uniform_views_share_the_pool_storage(name: str) -> None:
    pool = KVCachePool(_uniform_plan(name))
    base = pool.buffer.untyped_storage().data_ptr()
    assert pool.buffer.numel() == SIZE
    assert set(pool.views) == set(LAYERS)
    for layer in LAYERS:
        view = pool.views[layer]
        assert isinstance(view, torch.Tensor)
        assert view.untyped_storage().data_ptr() == base
        # [num_blocks, H, N, head + head_v] in the spec's dtype
        assert view.shape == (NUM_BLOCKS, 2, 4, 8)
        assert view.dtype == torch.float16


@pytest.mark.parametrize("name", list(UNIFORM), ids=list(UNIFORM))
def test_uniform_view_strides(name: str) -> None:
    """Element strides of a layer's view are the byte coefficients / 2."""
    _, _, (cl, cb, ch, cn) = UNIFORM[name]
    pool = KVCachePool(_uniform_plan(name))
    base = pool.buffer.data_ptr()
    for li, layer in enumerate(LAYERS):
        view = pool.views[layer]
        assert isinstance(view, torch.Tensor)
        assert view.stride() == (cb // 2, ch // 2, cn // 2, 1)
        assert view.data_ptr() - base == li * cl


#: distinct fp16 values 1..64 (all exact), one per element of a page
PATTERN = (torch.arange(2 * 4 * 8) + 1).to(torch.float16).reshape(2, 4, 8)


@pytest.mark.parametrize("name", list(UNIFORM), ids=list(UNIFORM))
def test_writing_a_page_touches_exactly_its_bytes(name: str) -> None:
    _, _, (cl, cb, ch, cn) = UNIFORM[name]
    pool = KVCachePool(_uniform_plan(name))
    for li, layer in enumerate(LAYERS):
        view = pool.views[layer]
        assert isinstance(view, torch.Tensor)
        for b in range(NUM_BLOCKS):
            pool.buffer.zero_()
            view[b].copy_(PATTERN)
            expected = torch.zeros(SIZE, dtype=torch.uint8)
            for h in range(2):
                for n in range(4):
                    start = li * cl + b * cb + h * ch + n * cn
                    expected[start : start + 16] = PATTERN[h, n].view(torch.uint8)
            assert torch.equal(pool.buffer, expected), (layer, b)
            assert torch.equal(view[b], PATTERN)


@pytest.mark.parametrize("name", list(UNIFORM), ids=list(UNIFORM))
def test_layers_are_disjoint_and_cover_the_pool(name: str) -> None:
    pool = KVCachePool(_uniform_plan(name))
    for li, layer in enumerate(LAYERS):
        view = pool.views[layer]
        assert isinstance(view, torch.Tensor)
        view.fill_(li + 1)
    as_fp16 = pool.buffer.view(torch.float16)
    for li, layer in enumerate(LAYERS):
        assert (pool.views[layer] == li + 1).all()  # type: ignore[union-attr]
        # 5 blocks * 64 elements per page, nothing overwritten by a neighbour
        assert int((as_fp16 == li + 1).sum()) == NUM_BLOCKS * 64
    # 3 layers * 5 blocks * 128 B = 1920 B: every byte belongs to some layer
    assert int((as_fp16 == 0).sum()) == 0


@pytest.mark.parametrize("name", list(UNIFORM), ids=list(UNIFORM))
def test_allocate_kv_cache_binds_one_allocation(name: str) -> None:
    views = allocate_kv_cache(_uniform_plan(name), "cpu")
    assert set(views) == set(LAYERS)
    ptrs = {v.untyped_storage().data_ptr() for v in views.values()}  # type: ignore[union-attr]
    assert len(ptrs) == 1
    for view in views.values():
        assert isinstance(view, torch.Tensor)
        assert view.untyped_storage().nbytes() == SIZE


def test_pool_rejects_a_layout_other_than_the_plans() -> None:
    with pytest.raises(LayoutError, match="re-plan for LBNHC"):
        KVCachePool(_uniform_plan("BLHNC"), layout=KVCacheLayout.LBNHC)


def test_unresolved_layout_rejected() -> None:
    groups = [KVCacheGroupSpec(list(LAYERS), SPEC)]
    with pytest.raises(LayoutError, match="has not been resolved"):
        get_kv_cache_config_from_groups(_engine(None), groups, MEMORY)


def test_padded_page_plan_rejected_in_non_block_compact_layout() -> None:
    # 64 states of 96 B = 6144 B = 10*576 + 384 -> padded to 11*576 = 6336 B
    spec = MLAAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=96, dtype=torch.uint8, alignment=576
    )
    assert spec.page_size_bytes == 6336
    groups = [KVCacheGroupSpec(["a", "b"], spec)]
    for name in ("LHBNC", "BHLNC"):
        with pytest.raises(LayoutError, match="padded page"):
            get_kv_cache_config_from_groups(_engine(name), groups, 10 * 6336 * 2)


@pytest.mark.parametrize(
    ("name", "layer_stride", "block_stride"),
    [
        # layer-outer: each page strided by the 6336-B padded page, 4 blocks
        ("LBHNC", 6336 * 4, 6336),
        ("LBNHC", 6336 * 4, 6336),
        # block-outer: 2 padded pages per block
        ("BLHNC", 6336, 2 * 6336),
        ("BLNHC", 6336, 2 * 6336),
    ],
)
def test_padded_page_plan_in_block_compact_layouts(
    name: str, layer_stride: int, block_stride: int
) -> None:
    spec = MLAAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=96, dtype=torch.uint8, alignment=576
    )
    groups = [KVCacheGroupSpec(["a", "b"], spec)]
    # 2 * 6336 = 12672 B per block, 4 blocks
    config = get_kv_cache_config_from_groups(_engine(name), groups, 4 * 12672)
    assert config.num_blocks == 4
    (tensor,) = config.kv_cache_tensors
    assert (tensor.layer_stride, tensor.block_stride) == (layer_stride, block_stride)
    pool = KVCachePool(config)
    base = pool.buffer.data_ptr()
    for li, layer in enumerate(["a", "b"]):
        view = pool.views[layer]
        assert isinstance(view, torch.Tensor)
        assert view.shape == (4, 1, 64, 96)
        assert view.stride(0) == block_stride
        assert view.data_ptr() - base == li * layer_stride


# ---------------------------------------------------------------------------
# Mixed page sizes
# ---------------------------------------------------------------------------


def _mla(head_size: int) -> MLAAttentionSpec:
    # bs 64, 1 head, uint8: page = 64 * head_size
    return MLAAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=head_size, dtype=torch.uint8
    )


def _group(specs: dict[str, MLAAttentionSpec]) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(
        list(specs), UniformTypeKVCacheSpecs(block_size=64, kv_cache_specs=dict(specs))
    )


def _two_groups() -> list[KVCacheGroupSpec]:
    # group 0: 32768 + 8192 = 40960 B; group 1: 32768 B
    return [
        _group({"mla.0": _mla(512), "idx.0": _mla(128)}),
        _group({"swa.0": _mla(512)}),
    ]


def _one_group() -> list[KVCacheGroupSpec]:
    return [_group({"mla.0": _mla(512), "mla.1": _mla(512), "idx.0": _mla(128)})]


MIXED = "cannot express this model's mixed page sizes \\(\\[8192, 32768\\]\\)"


@pytest.mark.parametrize("name", ["BLHNC", "BLNHC"])
def test_mixed_pages_in_several_groups_pack_block_outer(name: str) -> None:
    # widest group 40960 B; 3 * 40960 B of memory -> 3 blocks
    config = get_kv_cache_config_from_groups(_engine(name), _two_groups(), 3 * 40960)
    assert config.num_blocks == 3
    assert config.bytes_per_block == 40960
    placed = {
        (tuple(t.layers), t.offset, t.layer_stride, t.block_stride)
        for t in config.kv_cache_tensors
    }
    assert placed == {
        (("mla.0",), 0, 32768, 40960),
        (("idx.0",), 32768, 8192, 40960),
        (("swa.0",), 0, 32768, 40960),
    }
    views = allocate_kv_cache(config, "cpu")
    assert views["mla.0"].data_ptr() == views["swa.0"].data_ptr()  # type: ignore[union-attr]


@pytest.mark.parametrize("name", ["LBHNC", "LBNHC", "LHBNC", "BHLNC"])
def test_mixed_pages_in_several_groups_rejected(name: str) -> None:
    with pytest.raises(LayoutError, match=MIXED):
        get_kv_cache_config_from_groups(_engine(name), _two_groups(), 3 * 40960)


@pytest.mark.parametrize(
    ("name", "idx_offset", "mla_strides"),
    [
        # layer-outer: 2 layers * 32768 B * 3 blocks before idx; page-strided
        ("LBHNC", 2 * 32768 * 3, (32768 * 3, 32768)),
        ("LBNHC", 2 * 32768 * 3, (32768 * 3, 32768)),
        # block-outer: 2 pages of 32768 B, then idx; block = 73728 B
        ("BLHNC", 2 * 32768, (32768, 73728)),
        ("BLNHC", 2 * 32768, (32768, 73728)),
    ],
)
def test_mixed_pages_in_one_group(
    name: str, idx_offset: int, mla_strides: tuple[int, int]
) -> None:
    # 2*32768 + 8192 = 73728 B per block; 3 blocks
    config = get_kv_cache_config_from_groups(_engine(name), _one_group(), 3 * 73728)
    assert config.num_blocks == 3
    mla_tensor, idx_tensor = config.kv_cache_tensors
    assert mla_tensor.layers == ["mla.0", "mla.1"]
    assert (mla_tensor.layer_stride, mla_tensor.block_stride) == mla_strides
    assert idx_tensor.layers == ["idx.0"]
    assert idx_tensor.offset == idx_offset
    assert {t.size for t in config.kv_cache_tensors} == {3 * 73728}


@pytest.mark.parametrize("name", ALL, ids=ALL)
def test_equal_pages_of_different_grids_stay_disjoint(name: str) -> None:
    """One group, one page size (8192 B), two specs with different grids:
    Full [2, 16, 256] and MLA [1, 16, 512].  Every layout accepts them, and
    the two layers must not overlap."""
    full = FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16
    )
    mla = MLAAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=512, dtype=torch.uint8
    )
    assert full.page_size_bytes == mla.page_size_bytes == 8192
    groups = [
        KVCacheGroupSpec(
            ["f", "m"],
            UniformTypeKVCacheSpecs(
                block_size=16, kv_cache_specs={"f": full, "m": mla}
            ),
        )
    ]
    # 2 * 8192 = 16384 B per block, 3 blocks
    config = get_kv_cache_config_from_groups(_engine(name), groups, 3 * 16384)
    pool = KVCachePool(config)
    f, m = pool.views["f"], pool.views["m"]
    assert isinstance(f, torch.Tensor)
    assert isinstance(m, torch.Tensor)
    f.fill_(1.0)
    m.fill_(7)
    assert (f == 1.0).all()
    assert (m == 7).all()


@pytest.mark.parametrize("name", ["LHBNC", "BHLNC"])
def test_mixed_pages_in_one_group_rejected_by_non_block_compact(name: str) -> None:
    with pytest.raises(LayoutError, match=MIXED):
        get_kv_cache_config_from_groups(_engine(name), _one_group(), 3 * 73728)


@pytest.mark.parametrize(
    ("build", "allowed"),
    [
        pytest.param(_two_groups, {"BLHNC", "BLNHC"}, id="several-groups"),
        pytest.param(
            _one_group, {"BLHNC", "BLNHC", "LBHNC", "LBNHC"}, id="single-group"
        ),
    ],
)
def test_mixed_pages_layout_table(
    build: Callable[[], list[KVCacheGroupSpec]], allowed: set[str]
) -> None:
    """Semantics §2: which layouts can express mixed page sizes."""
    accepted = set()
    for name in ALL:
        try:
            get_kv_cache_config_from_groups(_engine(name), build(), 3 * 73728)
        except LayoutError:
            continue
        accepted.add(name)
    assert accepted == allowed


def test_lhbnc_refuses_a_block_stride_alignment_it_cannot_keep() -> None:
    # Found by tests/test_fuzz_planning.py: LHBNC puts a layer's consecutive
    # blocks one head's slice apart (here 4 bytes) and cannot pad that
    # slice, so a block_stride_alignment of 16 was silently dropped.
    spec = FullAttentionSpec(
        block_size=1,
        num_kv_heads=1,
        head_size=1,
        dtype=torch.bfloat16,
        block_stride_alignment=16,
    )

    def plan(name: str) -> KVCacheConfig:
        config = EngineConfig(cache_config=CacheConfig(kv_cache_layout=name))
        return get_kv_cache_config_from_groups(
            config, [KVCacheGroupSpec(["attn"], spec)], 2**20
        )

    with pytest.raises(LayoutError, match=r"multiple of 16 bytes.*LHBNC"):
        plan("LHBNC")
    # The block-compact layouts round the page up to the alignment instead.
    for name in ("LBHNC", "LBNHC", "BLHNC", "BLNHC"):
        assert plan(name).kv_cache_tensors[0].block_stride % 16 == 0
