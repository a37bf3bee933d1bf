"""The eight built-in spec classes: page sizes, hashing behaviour, grouping
keys, the merge rule and validation, plus a conformance suite over the
registry.

Every expected number is worked out by hand in the comment beside it, from
the page model ``page = H * N * C`` (semantics §1.1): ``H`` heads, ``N =
block_size / tokens_per_state`` states and ``C = (head_size + head_size_v) *
dtype size`` content bytes per state.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest
import torch
from coordinator_setup import builtin_registry

from kvcore import InvalidSpecError, KVCacheSpec, MergeError
from kvcore.plugins import BUILTIN_PLUGINS
from kvcore_chunked_local import ChunkedLocalAttentionSpec
from kvcore_circular_buffer import CircularBufferSpec
from kvcore_cross_attention import CrossAttentionSpec
from kvcore_full_attention import FullAttentionSpec
from kvcore_hisparse import HiSparseHotSpec
from kvcore_mamba import MambaSpec
from kvcore_mla import MLAAttentionSpec
from kvcore_sliding_window import SlidingWindowMLASpec, SlidingWindowSpec

# ---------------------------------------------------------------------------
# One small sample of every kind
# ---------------------------------------------------------------------------


def full(**kw: object) -> FullAttentionSpec:
    args: dict[str, object] = {
        "block_size": 16,
        "num_kv_heads": 2,
        "head_size": 64,
        "dtype": torch.float16,
    }
    return FullAttentionSpec(**(args | kw))


def mla(**kw: object) -> MLAAttentionSpec:
    args: dict[str, object] = {
        "block_size": 64,
        "num_kv_heads": 1,
        "head_size": 512,
        "dtype": torch.uint8,
    }
    return MLAAttentionSpec(**(args | kw))


def sw(**kw: object) -> SlidingWindowSpec:
    args: dict[str, object] = {
        "block_size": 16,
        "num_kv_heads": 2,
        "head_size": 64,
        "dtype": torch.float16,
        "sliding_window": 128,
    }
    return SlidingWindowSpec(**(args | kw))


def swmla(**kw: object) -> SlidingWindowMLASpec:
    args: dict[str, object] = {
        "block_size": 64,
        "num_kv_heads": 1,
        "head_size": 584,
        "dtype": torch.uint8,
        "sliding_window": 128,
        "alignment": 576,
    }
    return SlidingWindowMLASpec(**(args | kw))


def mamba(**kw: object) -> MambaSpec:
    args: dict[str, object] = {
        "block_size": 16,
        "shapes": ((32,),),
        "dtypes": (torch.bfloat16,),
    }
    return MambaSpec(**(args | kw))


def ring(**kw: object) -> CircularBufferSpec:
    args: dict[str, object] = {
        "block_size": 4,
        "num_kv_heads": 1,
        "head_size": 8,
        "head_size_v": 0,
        "dtype": torch.bfloat16,
    }
    return CircularBufferSpec(**(args | kw))


def hot(**kw: object) -> HiSparseHotSpec:
    args: dict[str, object] = {
        "block_size": 16,
        "page_size": 5120,
        "blocks_per_request": 2,
    }
    return HiSparseHotSpec(**(args | kw))


def chunked(**kw: object) -> ChunkedLocalAttentionSpec:
    args: dict[str, object] = {
        "block_size": 16,
        "num_kv_heads": 2,
        "head_size": 64,
        "dtype": torch.bfloat16,
        "attention_chunk_size": 64,
    }
    return ChunkedLocalAttentionSpec(**(args | kw))


def xattn(**kw: object) -> CrossAttentionSpec:
    args: dict[str, object] = {
        "block_size": 16,
        "num_kv_heads": 2,
        "head_size": 64,
        "dtype": torch.bfloat16,
        "max_encoder_tokens": 1500,
    }
    return CrossAttentionSpec(**(args | kw))


#: kind name -> factory of a valid sample spec.
SAMPLES: dict[str, Callable[..., KVCacheSpec]] = {
    "full_attention": full,
    "mla": mla,
    "sliding_window": sw,
    "sliding_window_mla": swmla,
    "mamba": mamba,
    "circular_buffer": ring,
    "hisparse_hot": hot,
    "chunked_local_attention": chunked,
    "cross_attention": xattn,
}
FACTORIES = list(SAMPLES.values())
FACTORY_IDS = list(SAMPLES)

# ---------------------------------------------------------------------------
# Page sizes
# ---------------------------------------------------------------------------

PAGE_CASES = [
    # H=2, N=16, C=(64+64)*2=256 -> 2*16*256 = 8192
    pytest.param(full(), 8192, id="full-fp16"),
    # H=4, N=16, C=(32+16)*4=192 -> 4*16*192 = 12288
    pytest.param(
        full(num_kv_heads=4, head_size=32, head_size_v=16, dtype=torch.float32),
        12288,
        id="full-fp32-head_v",
    ),
    # tps 4: N=16/4=4, C=(8+8)*2=32, H=1 -> 4*32 = 128
    pytest.param(
        full(num_kv_heads=1, head_size=8, dtype=torch.bfloat16, tokens_per_state=4),
        128,
        id="full-compressed",
    ),
    # head_size_v defaults to 0: N=64, C=512 -> 32768
    pytest.param(mla(), 32768, id="mla-512"),
    # N=16, C=64*2=128 -> 2048
    pytest.param(
        mla(block_size=16, head_size=64, dtype=torch.bfloat16), 2048, id="mla-bf16"
    ),
    # N=128/2=64, unpadded 64*584=37376 = 64*576+512 -> 65*576 = 37440
    pytest.param(
        mla(block_size=128, head_size=584, tokens_per_state=2, alignment=576),
        37440,
        id="mla-v41-attn-tps2",
    ),
    # N=64, unpadded 64*132=8448 = 14*576+384 -> 15*576 = 8640
    pytest.param(
        mla(block_size=128, head_size=132, tokens_per_state=2, alignment=576),
        8640,
        id="mla-v41-idx-tps2",
    ),
    # N=128, unpadded 128*584=74752 = 129*576+448 -> 130*576 = 74880
    pytest.param(
        mla(block_size=128, head_size=584, alignment=576), 74880, id="mla-v41-attn-tps1"
    ),
    # N=128, unpadded 128*132=16896 = 29*576+192 -> 30*576 = 17280
    pytest.param(
        mla(block_size=128, head_size=132, alignment=576), 17280, id="mla-v41-idx-tps1"
    ),
    # 32768 is already 64*512: alignment 512 adds nothing
    pytest.param(mla(alignment=512), 32768, id="mla-aligned-noop"),
    # unpadded 64*128 = 8192, explicit pad to 9000
    pytest.param(mla(head_size=128, page_size_padded=9000), 9000, id="mla-padded"),
    # same grid as full(): 2*16*256 = 8192
    pytest.param(sw(), 8192, id="sw"),
    # N=64, 64*584 = 37376 -> 65*576 = 37440
    pytest.param(swmla(), 37440, id="swmla-bs64"),
    # N=32, 32*584 = 18688 = 32*576+256 -> 33*576 = 19008
    pytest.param(swmla(block_size=32), 19008, id="swmla-bs32"),
    # N=4, C=8*2=16 (no V, no alignment) -> 64
    pytest.param(
        swmla(
            block_size=4,
            head_size=8,
            dtype=torch.bfloat16,
            alignment=None,
            sliding_window=8,
        ),
        64,
        id="swmla-compressor-state",
    ),
    # 32 bf16 elements -> 64
    pytest.param(mamba(), 64, id="mamba-gdn"),
    # 4*8 fp32 = 128 plus 16 bf16 = 32 -> 160
    pytest.param(
        mamba(shapes=((4, 8), (16,)), dtypes=(torch.float32, torch.bfloat16)),
        160,
        id="mamba-two-states",
    ),
    # 3*5*7 uint8 = 105
    pytest.param(mamba(shapes=((3, 5, 7),), dtypes=(torch.uint8,)), 105, id="mamba-3d"),
    # 64-byte state padded to 256
    pytest.param(mamba(page_size_padded=256), 256, id="mamba-padded"),
    # N=4, C=8*2=16, H=1 -> 64
    pytest.param(ring(), 64, id="ring-csa"),
    # N=8, C=1024*4=4096 -> 32768
    pytest.param(
        ring(block_size=8, head_size=1024, dtype=torch.float32), 32768, id="ring-v41"
    ),
    # head_size_v defaults to head_size: H=2, N=4, C=(8+8)*2=32 -> 256
    pytest.param(
        CircularBufferSpec(
            block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float16
        ),
        256,
        id="ring-with-v",
    ),
    # a hot page is exactly page_size, not times blocks_per_request
    pytest.param(hot(), 5120, id="hot"),
]


@pytest.mark.parametrize(("spec", "expected"), PAGE_CASES)
def test_page_size_bytes(spec: KVCacheSpec, expected: int) -> None:
    assert spec.page_size_bytes == expected


GRID_CASES = [
    pytest.param(full(), (2, 16, 256), id="full"),
    # tps 2 halves N: 128/2 = 64 states of 584 bytes
    pytest.param(
        mla(block_size=128, head_size=584, tokens_per_state=2, alignment=576),
        (1, 64, 584),
        id="mla-tps2",
    ),
    pytest.param(sw(), (2, 16, 256), id="sw"),
    pytest.param(swmla(block_size=32), (1, 32, 584), id="swmla"),
    # a Mamba page is one state of all tensors back to back: 128 + 32
    pytest.param(
        mamba(shapes=((4, 8), (16,)), dtypes=(torch.float32, torch.bfloat16)),
        (1, 1, 160),
        id="mamba",
    ),
    pytest.param(ring(), (1, 4, 16), id="ring"),
    pytest.param(hot(), (1, 1, 5120), id="hot"),
]


@pytest.mark.parametrize(("spec", "grid"), GRID_CASES)
def test_page_grid(spec: KVCacheSpec, grid: tuple[int, int, int]) -> None:
    assert spec.page_grid == grid


@pytest.mark.parametrize(
    ("spec", "real", "padded"),
    [
        # 64*584 = 37376 before alignment, 37440 after
        pytest.param(swmla(), 37376, 37440, id="swmla-alignment"),
        # 64*128 = 8192 before the explicit pad to 9000
        pytest.param(mla(head_size=128, page_size_padded=9000), 8192, 9000, id="mla"),
        # page_size_padded wins over alignment: 8192 -> 9000, not round_up(8192, 576)
        pytest.param(
            mla(head_size=128, page_size_padded=9000, alignment=576),
            8192,
            9000,
            id="padded-beats-alignment",
        ),
        # H=2, N=16, C=256 -> 8192, padded to 10000
        pytest.param(full(page_size_padded=10000), 8192, 10000, id="full"),
        pytest.param(mamba(page_size_padded=256), 64, 256, id="mamba"),
    ],
)
def test_page_size_padded(spec: KVCacheSpec, real: int, padded: int) -> None:
    """Padding raises page_size_bytes but not the page grid's own bytes."""
    assert spec.real_page_size_bytes == real
    assert spec.page_size_bytes == padded


@pytest.mark.parametrize(
    "factory",
    [
        pytest.param(lambda: full(page_size_padded=8191), id="full"),
        pytest.param(lambda: mla(head_size=128, page_size_padded=100), id="mla"),
        pytest.param(lambda: mamba(page_size_padded=63), id="mamba"),
    ],
)
def test_page_size_padded_below_page_rejected(factory: Callable[[], object]) -> None:
    with pytest.raises(InvalidSpecError, match="page_size_padded"):
        factory()


def test_hot_page_stride_alignment() -> None:
    """A hot page aligns the shared block stride to its own size, combined
    with any block_stride_alignment by lcm."""
    assert hot().stride_alignment() == 5120
    # 5120 = 2**10 * 5, 1152 = 2**7 * 9 -> lcm = 2**10 * 5 * 9 = 46080
    assert hot(block_stride_alignment=1152).stride_alignment() == 46080
    assert full().stride_alignment() == 1
    assert full(block_stride_alignment=512).stride_alignment() == 512


# ---------------------------------------------------------------------------
# Hashing behaviour and request limits
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "cacheable", "replay"),
    [
        pytest.param(full(), True, 0, id="full"),
        pytest.param(mla(), True, 0, id="mla"),
        pytest.param(sw(), True, 0, id="sw"),
        pytest.param(sw(bounded_replay=True), False, 128, id="sw-bounded"),
        pytest.param(swmla(), True, 0, id="swmla"),
        pytest.param(
            swmla(sliding_window=256, bounded_replay=True),
            False,
            256,
            id="swmla-bounded",
        ),
        pytest.param(mamba(), True, 0, id="mamba"),
        pytest.param(ring(), False, 0, id="ring"),
        pytest.param(hot(), False, 0, id="hot"),
        # rebuilt after a hit by replaying the hit's last 64-token chunk
        pytest.param(chunked(), False, 64, id="chunked"),
    ],
)
def test_prefix_cacheable_and_replay(
    spec: KVCacheSpec, cacheable: bool, replay: int
) -> None:
    assert (spec.prefix_cacheable, spec.prefix_replay_tokens) == (cacheable, replay)


@pytest.mark.parametrize(
    ("spec", "max_model_len", "expected"),
    [
        # cdiv(100, 16) = 7
        pytest.param(full(), 100, 7, id="full"),
        # cdiv(100, 64) = 2
        pytest.param(mla(), 100, 2, id="mla"),
        # live = min(128-1, 1000) = 127 -> cdiv(127, 16) + 1 = 8 + 1 = 9
        pytest.param(sw(), 1000, 9, id="sw"),
        # live = min(127 + 16, 1000) = 143 -> cdiv(143, 16) + 1 = 9 + 1 = 10
        pytest.param(sw(extra_retained_tokens=16), 1000, 10, id="sw-extra"),
        # a short model never needs more than cdiv(20, 16) = 2 blocks
        pytest.param(sw(), 20, 2, id="sw-short-model"),
        # mode none: 1 + 2 speculative = 3
        pytest.param(
            mamba(num_speculative_blocks=2, mamba_cache_mode="none"),
            100,
            3,
            id="mamba-none",
        ),
        # mode align: the state read and the one written, the seven
        # checkpoints the default policy may keep inside one step (two prompt
        # ends, a branch point, 4 interval states), the three states a
        # running request keeps holding (its hit's, its branch point, the
        # shared state on its path), and 2 speculative = 14
        pytest.param(
            mamba(num_speculative_blocks=2, mamba_cache_mode="align"),
            100,
            14,
            id="mamba-align",
        ),
        # mode all: cdiv(100, 16) + 2 = 7 + 2 = 9
        pytest.param(
            mamba(num_speculative_blocks=2, mamba_cache_mode="all"),
            100,
            9,
            id="mamba-all",
        ),
        # one ring block for the request's whole life
        pytest.param(ring(), 100_000, 1, id="ring"),
        pytest.param(hot(blocks_per_request=3), 100_000, 3, id="hot"),
        # one 64-token chunk: cdiv(64, 16) + 1 = 5 (the boundary block)
        pytest.param(chunked(), 1000, 5, id="chunked"),
        # a 40-token model: cdiv(40, 16) = 3
        pytest.param(chunked(), 40, 3, id="chunked-short-model"),
    ],
)
def test_max_num_blocks_per_request(
    spec: KVCacheSpec, max_model_len: int, expected: int
) -> None:
    assert spec.max_num_blocks_per_request(max_model_len) == expected


# ---------------------------------------------------------------------------
# Grouping keys
# ---------------------------------------------------------------------------


def test_chunked_local_releases_completed_chunks_and_keys_by_chunk() -> None:
    spec = chunked()
    # 64-token chunks: 130 computed tokens complete two chunks (128 tokens).
    assert [spec.skipped_tokens(n) for n in (0, 63, 64, 130)] == [0, 0, 64, 128]
    # Token 130 of 200 covered: cdiv(200, 16) - 128 // 16 = 13 - 8 = 5 blocks.
    assert spec.num_blocks_held(130, 200, 16) == 5
    assert spec.group_key() != chunked(attention_chunk_size=128).group_key()
    assert spec.grown(4) == chunked(block_size=64)
    assert spec.grown(8) is None  # a 128-token block does not tile the chunk
    with pytest.raises(InvalidSpecError, match="does not tile attention_chunk"):
        spec.with_block_size(48)


def test_full_and_mla_share_a_group_key_at_one_block_size() -> None:
    assert full().group_key() == mla(block_size=16).group_key()
    assert full().group_key() != mla(block_size=64).group_key()
    # page size does not matter for attention keys
    assert full().group_key() == full(num_kv_heads=8).group_key()


def test_sliding_window_keys_differ_by_window() -> None:
    assert sw().group_key() == sw().group_key()
    assert sw(sliding_window=128).group_key() != sw(sliding_window=256).group_key()
    # a sliding window never groups with full attention of the same block size
    assert sw().group_key() != full().group_key()
    # nor does the MLA flavour with the plain one
    assert (
        swmla(block_size=16, sliding_window=128).group_key()
        != sw(block_size=16, sliding_window=128).group_key()
    )


def test_mamba_keys_differ_by_tp_replicated_and_page() -> None:
    assert mamba().group_key() == mamba().group_key()
    assert mamba().group_key() != mamba(tp_replicated=True).group_key()
    # (32,) bf16 = 64 B vs (24,) bf16 = 48 B
    assert mamba().group_key() != mamba(shapes=((24,),)).group_key()
    # (32,) bf16 and (16,) fp32 are both 64 B: the page, not the shape, counts
    assert (
        mamba().group_key()
        == mamba(shapes=((16,),), dtypes=(torch.float32,)).group_key()
    )


def test_ring_and_hot_keys() -> None:
    assert ring().group_key() != full(block_size=4).group_key()
    assert ring().group_key() != ring(block_size=8).group_key()
    assert hot().group_key() != hot(blocks_per_request=3).group_key()


# ---------------------------------------------------------------------------
# The merge rule
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("factory", FACTORIES, ids=FACTORY_IDS)
def test_merge_single_is_identity(factory: Callable[[], KVCacheSpec]) -> None:
    spec = factory()
    assert type(spec).merge([spec]) is spec


@pytest.mark.parametrize("factory", FACTORIES, ids=FACTORY_IDS)
def test_merge_equal_specs(factory: Callable[[], KVCacheSpec]) -> None:
    a, b, c = factory(), factory(), factory()
    assert a is not b
    merged = type(a).merge([a, b, c])
    assert merged == a
    assert type(merged) is type(a)


@pytest.mark.parametrize(
    ("a", "b", "field"),
    [
        pytest.param(full(), full(num_kv_heads=4), "num_kv_heads", id="full-heads"),
        pytest.param(full(), full(dtype=torch.bfloat16), "dtype", id="full-dtype"),
        pytest.param(
            full(block_stride_alignment=512),
            full(),
            "block_stride_alignment",
            id="full-alignment",
        ),
        pytest.param(mla(), mla(tokens_per_state=4), "tokens_per_state", id="mla-tps"),
        pytest.param(sw(), sw(sliding_window=64), "sliding_window", id="sw-window"),
        pytest.param(sw(), sw(bounded_replay=True), "bounded_replay", id="sw-replay"),
        pytest.param(swmla(), swmla(alignment=None), "alignment", id="swmla-alignment"),
        pytest.param(
            mamba(), mamba(tp_replicated=True), "tp_replicated", id="mamba-tp"
        ),
        pytest.param(ring(), ring(head_size=16), "head_size", id="ring-head"),
        pytest.param(hot(), hot(page_size=1024), "page_size", id="hot-page"),
    ],
)
def test_merge_different_specs_names_the_field(
    a: KVCacheSpec, b: KVCacheSpec, field: str
) -> None:
    with pytest.raises(MergeError, match=rf"\b{field} differs") as info:
        type(a).merge([a, a, b])
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("cls", "specs"),
    [
        pytest.param(FullAttentionSpec, [full(), mla(block_size=16)], id="full-vs-mla"),
        pytest.param(MLAAttentionSpec, [mla(), full()], id="mla-vs-full"),
        pytest.param(SlidingWindowSpec, [sw(), swmla()], id="sw-vs-swmla"),
        pytest.param(MambaSpec, [mamba(), ring()], id="mamba-vs-ring"),
        pytest.param(
            CircularBufferSpec, [ring(), full(block_size=4)], id="ring-vs-full"
        ),
        pytest.param(HiSparseHotSpec, [full()], id="hot-gets-full"),
    ],
)
def test_merge_of_a_different_type_raises(
    cls: type[KVCacheSpec], specs: list[KVCacheSpec]
) -> None:
    other = next(s for s in specs if type(s) is not cls)
    with pytest.raises(MergeError, match=type(other).__name__):
        cls.merge(specs)


def test_merge_of_nothing_raises() -> None:
    with pytest.raises(MergeError, match="at least one"):
        FullAttentionSpec.merge([])


def test_block_stride_alignment_survives_merge() -> None:
    aligned = mla(block_stride_alignment=1152)
    assert (
        MLAAttentionSpec.merge([aligned, mla(block_stride_alignment=1152)]) == aligned
    )
    assert MLAAttentionSpec.merge([aligned, aligned]).block_stride_alignment == 1152


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        pytest.param(0, "must be positive", id="zero"),
        pytest.param(-16, "must be positive", id="negative"),
        pytest.param(True, "must be an int", id="bool"),
        pytest.param(16.0, "must be an int", id="float"),
        pytest.param("16", "must be an int", id="str"),
    ],
)
@pytest.mark.parametrize("factory", FACTORIES, ids=FACTORY_IDS)
def test_block_size_validation(
    factory: Callable[..., KVCacheSpec], value: object, message: str
) -> None:
    with pytest.raises(InvalidSpecError, match=rf"block_size {message}") as info:
        factory(block_size=value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("value", [0, -512], ids=["zero", "negative"])
@pytest.mark.parametrize("factory", FACTORIES, ids=FACTORY_IDS)
def test_block_stride_alignment_must_be_positive(
    factory: Callable[..., KVCacheSpec], value: int
) -> None:
    with pytest.raises(ValueError, match="block_stride_alignment must be positive"):
        factory(block_stride_alignment=value)


@pytest.mark.parametrize("factory", FACTORIES, ids=FACTORY_IDS)
def test_evolve_revalidates(factory: Callable[..., KVCacheSpec]) -> None:
    spec = factory()
    assert attrs.evolve(spec, block_stride_alignment=64).block_stride_alignment == 64
    with pytest.raises(InvalidSpecError, match="must be positive"):
        attrs.evolve(spec, block_stride_alignment=0)
    with pytest.raises(InvalidSpecError, match="block_size"):
        attrs.evolve(spec, block_size=0)


@pytest.mark.parametrize("factory", [mla, swmla], ids=["mla", "sliding_window_mla"])
@pytest.mark.parametrize("heads", [2, 8])
def test_an_mla_layer_stores_one_latent(
    factory: Callable[..., KVCacheSpec], heads: int
) -> None:
    # A page holds one latent per state: more KV heads would plan that many
    # copies of it (a DeepSeek-V3 model file saying 2 planned one request of
    # 32K tokens in 8 GiB where three fit).
    assert factory().page_grid[0] == 1
    with pytest.raises(
        InvalidSpecError, match=rf"num_kv_heads must be 1, got {heads}"
    ) as info:
        factory(num_kv_heads=heads)
    assert isinstance(info.value, ValueError)
    assert "full_attention" in str(info.value)
    with pytest.raises(InvalidSpecError, match="num_kv_heads must be 1"):
        attrs.evolve(factory(), num_kv_heads=heads)


def test_evolve_revalidates_post_init_rules() -> None:
    """Cross-field checks (in __attrs_post_init__) also run again on evolve."""
    with pytest.raises(InvalidSpecError, match="tokens_per_state"):
        attrs.evolve(full(), tokens_per_state=3)
    with pytest.raises(InvalidSpecError, match="dtype"):
        attrs.evolve(mamba(), dtypes=(torch.bfloat16, torch.float32))


@pytest.mark.parametrize(
    ("factory", "tps"),
    [
        pytest.param(full, 3, id="full-16-by-3"),
        pytest.param(mla, 48, id="mla-64-by-48"),
        pytest.param(sw, 32, id="sw-16-by-32"),
        pytest.param(ring, 8, id="ring-4-by-8"),
    ],
)
def test_tokens_per_state_must_divide_block_size(
    factory: Callable[..., KVCacheSpec], tps: int
) -> None:
    with pytest.raises(InvalidSpecError, match="multiple of tokens_per_state"):
        factory(tokens_per_state=tps)


def test_tokens_per_state_dividing_block_size_is_accepted() -> None:
    # 64 / 16 = 4 states
    assert mla(tokens_per_state=16).page_grid == (1, 4, 512)


@pytest.mark.parametrize(
    ("shapes", "dtypes"),
    [
        pytest.param(((4,), (8,)), (torch.float32,), id="two-shapes-one-dtype"),
        pytest.param(
            ((4,),), (torch.float32, torch.bfloat16), id="one-shape-two-dtypes"
        ),
        pytest.param((), (), id="no-state"),
    ],
)
def test_mamba_shapes_and_dtypes_must_match(shapes: tuple, dtypes: tuple) -> None:
    with pytest.raises(InvalidSpecError, match="one dtype per state shape"):
        mamba(shapes=shapes, dtypes=dtypes)


@pytest.mark.parametrize(
    ("factory", "kwargs", "field"),
    [
        pytest.param(full, {"num_kv_heads": 0}, "num_kv_heads", id="full-heads"),
        pytest.param(full, {"head_size": -1}, "head_size", id="full-head"),
        pytest.param(full, {"head_size_v": -1}, "head_size_v", id="full-head_v"),
        pytest.param(full, {"dtype": "float16"}, "dtype", id="full-dtype-str"),
        pytest.param(mla, {"alignment": 0}, "alignment", id="mla-alignment"),
        pytest.param(sw, {"sliding_window": 0}, "sliding_window", id="sw-window"),
        pytest.param(
            sw, {"extra_retained_tokens": -1}, "extra_retained_tokens", id="sw-extra"
        ),
        pytest.param(mamba, {"shapes": ((0, 4),)}, "shapes", id="mamba-zero-dim"),
        pytest.param(mamba, {"dtypes": ("bf16",)}, "dtypes", id="mamba-dtype-str"),
        pytest.param(
            mamba,
            {"mamba_cache_mode": "sometimes"},
            "mamba_cache_mode",
            id="mamba-mode",
        ),
        pytest.param(
            mamba,
            {"num_speculative_blocks": -1},
            "num_speculative_blocks",
            id="mamba-spec",
        ),
        pytest.param(hot, {"page_size": 0}, "page_size", id="hot-page"),
        pytest.param(
            hot, {"blocks_per_request": 0}, "blocks_per_request", id="hot-blocks"
        ),
    ],
)
def test_field_validation_names_the_field(
    factory: Callable[..., KVCacheSpec], kwargs: dict[str, object], field: str
) -> None:
    with pytest.raises(InvalidSpecError, match=rf"\b{field}\b"):
        factory(**kwargs)


def test_specs_are_frozen_and_hashable() -> None:
    spec = full()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        spec.block_size = 32  # type: ignore[misc]
    assert {spec: 1}[full()] == 1
    assert hash(mamba()) == hash(mamba())


# ---------------------------------------------------------------------------
# What kinds declare to the core in place of their own fields
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "window", "dtypes", "mode"),
    [
        pytest.param(full(), None, (torch.float16,), None, id="full"),
        pytest.param(mla(), None, (torch.uint8,), None, id="mla"),
        # The window routers key a hit on; extra retained tokens are the
        # engine's own business.
        pytest.param(
            sw(extra_retained_tokens=16), 128, (torch.float16,), None, id="sw"
        ),
        pytest.param(
            sw(bounded_replay=True), 128, (torch.float16,), None, id="sw-replay"
        ),
        pytest.param(swmla(), 128, (torch.uint8,), None, id="swmla"),
        pytest.param(
            mamba(
                shapes=((4, 8), (16,)),
                dtypes=(torch.float32, torch.bfloat16),
                mamba_cache_mode="all",
            ),
            None,
            (torch.float32, torch.bfloat16),
            "all",
            id="mamba",
        ),
        pytest.param(mamba(), None, (torch.bfloat16,), "auto", id="mamba-auto"),
        pytest.param(ring(), None, (torch.bfloat16,), None, id="ring"),
        pytest.param(hot(), None, None, None, id="hot"),
        # Never hashed, so never in an event; its chunk is no window.
        pytest.param(chunked(), None, (torch.bfloat16,), None, id="chunked"),
    ],
)
def test_declarations_the_core_reads(
    spec: KVCacheSpec,
    window: int | None,
    dtypes: tuple[torch.dtype, ...] | None,
    mode: str | None,
) -> None:
    assert spec.event_window == window
    assert spec.view_dtypes == dtypes
    assert spec.state_cache_mode == mode


def test_a_mamba_spec_built_for_another_mode_than_the_engine_is_refused() -> None:
    from kvcore import CacheConfig, EngineConfig, PlanError, get_kv_cache_groups

    config = EngineConfig(cache_config=CacheConfig(mamba_cache_mode="align"))
    with pytest.raises(PlanError) as info:
        get_kv_cache_groups(
            config, {"m": mamba(mamba_cache_mode="all")}, registry=REGISTRY
        )
    assert str(info.value).startswith(
        "layer 'm' (mamba) caches its states in mode 'all' but the engine runs "
        "mamba_cache_mode='align'"
    )
    # ``auto`` takes the engine's mode before the check.
    (group,) = get_kv_cache_groups(config, {"m": mamba()}, registry=REGISTRY)
    assert group.manager_spec.state_cache_mode == "align"


# ---------------------------------------------------------------------------
# Conformance over the registry
# ---------------------------------------------------------------------------

REGISTRY = builtin_registry()


def _sample(name: str) -> KVCacheSpec:
    factory = SAMPLES.get(name)
    if factory is None:
        if REGISTRY.owner(name) in BUILTIN_PLUGINS:
            pytest.fail(f"built-in kind {name!r} has no sample spec in SAMPLES")
        pytest.skip(f"third-party kind {name!r} has no sample spec here")
    return factory()


def test_registry_holds_every_sampled_kind() -> None:
    assert set(SAMPLES) <= set(REGISTRY)


@pytest.mark.parametrize("name", sorted(REGISTRY), ids=sorted(REGISTRY))
def test_conformance(name: str) -> None:
    kind = REGISTRY[name]
    spec = _sample(name)
    assert kind.name == name
    assert kind.spec_type.kind == name
    assert type(spec) is kind.spec_type
    assert REGISTRY.kind_for(spec) is kind
    h, n, c = spec.page_grid
    assert spec.page_size_bytes >= h * n * c > 0
    key = spec.group_key()
    hash(key)
    assert key == spec.group_key()
    assert key == _sample(name).group_key()
    assert hash(key) == hash(_sample(name).group_key())
    assert type(spec).merge([spec]) == spec
    with pytest.raises(InvalidSpecError):
        attrs.evolve(spec, block_size=0)


@pytest.mark.parametrize("name", sorted(REGISTRY), ids=sorted(REGISTRY))
def test_every_builtin_kind_passes_the_shipped_conformance_check(name: str) -> None:
    from kvcore.testing import check_kind

    check_kind(REGISTRY[name], _sample(name), registry=REGISTRY)


def test_conformance_check_names_the_broken_rule() -> None:
    from kvcore.testing import ConformanceError, check_kind

    spec = _sample("full_attention")
    with pytest.raises(
        ConformanceError, match="'mla': the sample spec must be its spec_type"
    ):
        check_kind(REGISTRY["mla"], spec, registry=REGISTRY)
