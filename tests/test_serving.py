"""Serving choices: cache dtype, tensor parallelism and block size applied to
model files' layers, with hand-worked page sizes."""

from __future__ import annotations

import json
from typing import Any, ClassVar

import attrs
import pytest
import torch

import kvcore
from kvcore.config import CacheConfig, EngineConfig
from kvcore.errors import PluginResultError
from kvcore.serialize import load_model_file, make_converter
from kvcore.serving import (
    CACHE_DTYPE_ALIASES,
    ServedLayers,
    ServingChoices,
    ServingError,
    apply_serving_choices,
    parse_cache_dtype,
)
from kvcore.spec import KVCacheSpec, Sharded
from kvcore.tools import zoo
from kvcore_circular_buffer import CircularBufferSpec
from kvcore_full_attention import FullAttentionSpec
from kvcore_hisparse import HiSparseHotSpec
from kvcore_mamba import MambaSpec
from kvcore_mla import MLAAttentionSpec
from kvcore_sliding_window import SlidingWindowMLASpec, SlidingWindowSpec

E4M3 = torch.float8_e4m3fn


def _model(registry: kvcore.KindRegistry, name: str) -> dict[str, KVCacheSpec]:
    return load_model_file(zoo.path(name), registry).layers


def _full(**kw: Any) -> FullAttentionSpec:
    fields: dict[str, Any] = {
        "block_size": 16,
        "num_kv_heads": 8,
        "head_size": 128,
        "dtype": torch.bfloat16,
    }
    return FullAttentionSpec(**(fields | kw))


# -- cache dtype names ---------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("auto", None),
        ("fp8", E4M3),
        ("fp8_e4m3", E4M3),
        ("fp8_inc", E4M3),
        ("fp8_e5m2", torch.float8_e5m2),
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("float16", torch.float16),
        ("fp16", torch.float16),
        ("half", torch.float16),
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("float", torch.float32),
    ],
)
def test_every_alias_parses(name: str, dtype: torch.dtype | None) -> None:
    assert parse_cache_dtype(name) == dtype
    assert parse_cache_dtype(name.upper()) == dtype
    assert CACHE_DTYPE_ALIASES[name] == dtype


def test_the_alias_table_is_exactly_the_documented_names() -> None:
    assert list(CACHE_DTYPE_ALIASES) == [
        "auto",
        "fp8",
        "fp8_e4m3",
        "fp8_inc",
        "fp8_e5m2",
        "bfloat16",
        "bf16",
        "float16",
        "fp16",
        "half",
        "float32",
        "fp32",
        "float",
    ]


def test_an_unknown_dtype_name_lists_the_accepted_ones() -> None:
    with pytest.raises(ServingError, match="unknown KV cache dtype 'fp9'") as info:
        parse_cache_dtype("fp9")
    assert isinstance(info.value, kvcore.KvcoreValueError)
    assert isinstance(info.value, ValueError)
    for name in CACHE_DTYPE_ALIASES:
        assert name in str(info.value)


def test_a_packed_format_name_says_it_is_not_a_dtype() -> None:
    with pytest.raises(ServingError, match="fp8_ds_mla is a packed record"):
        parse_cache_dtype("fp8_ds_mla")


def test_a_dtype_name_must_be_a_string() -> None:
    with pytest.raises(ServingError, match="must be a string, got 8"):
        parse_cache_dtype(8)  # type: ignore[arg-type]


# -- the choices ---------------------------------------------------------------


def test_choices_take_a_dtype_name_or_a_dtype() -> None:
    assert ServingChoices(kv_cache_dtype="FP8").kv_cache_dtype == E4M3
    assert ServingChoices(kv_cache_dtype="auto").kv_cache_dtype is None
    assert ServingChoices(kv_cache_dtype=torch.float16).kv_cache_dtype == (
        torch.float16
    )
    assert ServingChoices() == ServingChoices(
        kv_cache_dtype=None, tensor_parallel_size=1, block_size=None
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive int"),
        ({"tensor_parallel_size": True}, "tensor_parallel_size must be a positive int"),
        ({"tensor_parallel_size": "2"}, "tensor_parallel_size must be a positive int"),
        ({"block_size": 0}, r"block_size must be a positive int or None, got 0"),
        ({"block_size": 16.0}, r"block_size must be a positive int or None"),
        ({"kv_cache_dtype": torch.uint8}, "kv_cache_dtype must be None, a cache"),
        ({"kv_cache_dtype": "int4"}, "unknown KV cache dtype 'int4'"),
    ],
)
def test_bad_choices_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ServingError, match=match):
        ServingChoices(**kwargs)


# -- hand-worked pages ---------------------------------------------------------


def test_gemma_pages_under_dtype_and_tensor_parallelism(
    zoo_registry: kvcore.KindRegistry,
) -> None:
    layers = _model(zoo_registry, "gemma-3-27b")
    # 16 KV heads x 16 tokens x (128 + 128) values x 2 bytes.
    assert {s.page_size_bytes for s in layers.values()} == {131072}

    fp8 = apply_serving_choices(layers, ServingChoices(kv_cache_dtype="fp8"))
    assert {s.page_size_bytes for s in fp8.layers.values()} == {65536}
    assert {s.dtype for s in fp8.layers.values()} == {E4M3}  # type: ignore[attr-defined]
    assert fp8.notes == ("cache dtype float8_e4m3fn on 62 layers",)
    assert fp8.dtype_kept_layers == ()

    tp2 = apply_serving_choices(
        layers, ServingChoices(kv_cache_dtype="fp8", tensor_parallel_size=2)
    )
    assert {s.page_size_bytes for s in tp2.layers.values()} == {32768}
    assert {s.num_kv_heads for s in tp2.layers.values()} == {8}  # type: ignore[attr-defined]
    assert tp2.replicated_layers == ()
    assert tp2.notes[1] == "tensor parallel 2: 62 layers split across ranks"

    # 32 ranks, 16 heads: each rank keeps one head, each head on 2 ranks.
    tp32 = apply_serving_choices(layers, ServingChoices(tensor_parallel_size=32))
    assert {s.page_size_bytes for s in tp32.layers.values()} == {16 * 256 * 2}
    assert tp32.replicated_layers == tuple(layers)
    assert tp32.notes == (
        "KV heads replicated across 32 ranks: 16 heads, each rank keeps 1 (62 layers)",
    )


def test_model_order_is_kept(zoo_registry: kvcore.KindRegistry) -> None:
    layers = _model(zoo_registry, "jamba-1-5-mini")
    served = apply_serving_choices(
        layers, ServingChoices(kv_cache_dtype="bf16", tensor_parallel_size=2)
    )
    assert list(served.layers) == list(layers)
    assert isinstance(served, ServedLayers)


def test_no_choices_change_nothing(zoo_registry: kvcore.KindRegistry) -> None:
    layers = _model(zoo_registry, "deepseek-v4-flash")
    served = apply_serving_choices(layers, ServingChoices())
    assert served.layers == layers
    assert served.notes == ()


def test_a_dtype_already_in_use_is_the_same_spec() -> None:
    spec = _full()
    assert spec.with_cache_dtype(torch.bfloat16) is spec


# -- what keeps its dtype ------------------------------------------------------


def test_packed_byte_formats_and_states_keep_their_dtype(
    zoo_registry: kvcore.KindRegistry,
) -> None:
    v4 = _model(zoo_registry, "deepseek-v4-flash")
    served = apply_serving_choices(v4, ServingChoices(kv_cache_dtype="fp8"))
    assert served.layers == v4
    assert served.dtype_kept_layers == tuple(v4)
    assert served.notes == (
        "cache dtype float8_e4m3fn on 0 layers; 167 layers keep their own "
        "dtype: 43 sliding_window_mla, 62 mla, 62 circular_buffer",
    )

    # V3.2: the bf16 latent becomes its fp8_ds_mla record (656 B a token, as
    # vLLM stores it under an fp8 cache), the uint8 indexer keys (132 B a
    # token) keep their format.
    v32 = _model(zoo_registry, "deepseek-v3-2-exp")
    served = apply_serving_choices(v32, ServingChoices(kv_cache_dtype="fp8"))
    pages = sorted({s.page_size_bytes for s in served.layers.values()})
    assert pages == [132 * 64, 656 * 64]
    assert len(served.dtype_kept_layers) == 61
    assert all(name.endswith("indexer.k_cache") for name in served.dtype_kept_layers)

    jamba = _model(zoo_registry, "jamba-1-5-mini")
    served = apply_serving_choices(jamba, ServingChoices(kv_cache_dtype="fp8_e5m2"))
    assert served.notes == (
        "cache dtype float8_e5m2 on 4 layers; 28 layers keep their own dtype: 28 mamba",
    )
    mamba = [s for s in served.layers.values() if isinstance(s, MambaSpec)]
    assert {s.dtypes for s in mamba} == {(torch.bfloat16, torch.bfloat16)}


def test_a_padded_page_and_hot_pages_keep_their_dtype() -> None:
    padded = _full(page_size_padded=70000)
    hot = HiSparseHotSpec(block_size=64, page_size=4096, blocks_per_request=8)
    assert padded.with_cache_dtype(E4M3) is None
    assert hot.with_cache_dtype(E4M3) is None
    ring = CircularBufferSpec(
        block_size=8, num_kv_heads=1, head_size=512, head_size_v=0, dtype=torch.float32
    )
    assert ring.with_cache_dtype(torch.bfloat16) is None


def test_alignment_re_pads_a_new_dtype() -> None:
    spec = _full(num_kv_heads=1, head_size=8, dtype=E4M3, alignment=64)
    # alignment re-pads: 16 tokens x 16 values x 4 bytes = 1024, a multiple of 64.
    assert spec.with_cache_dtype(torch.float32).page_size_bytes == 1024  # type: ignore[union-attr]
    assert spec.page_size_bytes == 256


# -- tensor parallelism --------------------------------------------------------


def test_heads_that_do_not_divide_are_an_error_naming_layer_and_rule() -> None:
    layers = {"model.layers.0.self_attn": _full(num_kv_heads=12)}
    with pytest.raises(ServingError) as info:
        apply_serving_choices(layers, ServingChoices(tensor_parallel_size=8))
    text = str(info.value)
    assert "layer 'model.layers.0.self_attn' (full_attention)" in text
    assert "12 KV heads do not divide across 8 tensor-parallel ranks" in text
    assert "heads % tp == 0" in text
    assert "tp % heads == 0" in text
    assert "[1, 2, 3, 4, 6, 12] or a multiple of 12" in text
    assert isinstance(info.value.__cause__, kvcore.InvalidSpecError)


def test_fewer_heads_than_ranks_need_a_multiple() -> None:
    with pytest.raises(ServingError, match="8 KV heads do not divide across 12"):
        apply_serving_choices({"a": _full()}, ServingChoices(tensor_parallel_size=12))
    shard = _full().sharded(24)
    assert shard.replicas == 3
    assert shard.spec.num_kv_heads == 1  # type: ignore[attr-defined]


def test_a_padded_page_cannot_split_its_heads() -> None:
    with pytest.raises(ServingError, match="page_size_padded=70000 was sized for 8"):
        apply_serving_choices(
            {"a": _full(page_size_padded=70000)},
            ServingChoices(tensor_parallel_size=2),
        )


def test_mla_latents_are_replicated(zoo_registry: kvcore.KindRegistry) -> None:
    layers = _model(zoo_registry, "deepseek-v3")
    served = apply_serving_choices(layers, ServingChoices(tensor_parallel_size=8))
    assert served.layers == layers
    # One 576-value bf16 latent a token, 64 tokens a block, on every rank.
    assert {s.page_size_bytes for s in served.layers.values()} == {73728}
    assert served.replicated_layers == tuple(layers)
    assert served.notes == ("MLA latent replicated on all 8 ranks (61 layers)",)
    window = SlidingWindowMLASpec(
        block_size=64, num_kv_heads=1, head_size=584, dtype=torch.uint8,
        sliding_window=128,
    )  # fmt: skip
    assert window.sharded(4) == Sharded(
        spec=window, replicas=4, note="MLA latent replicated on all 4 ranks"
    )


def test_deepseek_v4_rings_and_hot_pages_are_replicated(
    zoo_registry: kvcore.KindRegistry,
) -> None:
    layers = _model(zoo_registry, "deepseek-v4-flash")
    hot = HiSparseHotSpec(block_size=64, page_size=37440, blocks_per_request=8)
    served = apply_serving_choices(
        {**layers, "hot": hot}, ServingChoices(tensor_parallel_size=4)
    )
    assert served.layers == {**layers, "hot": hot}
    assert len(served.replicated_layers) == 168
    assert served.notes == (
        "MLA latent replicated on all 4 ranks (105 layers)",
        "single KV head replicated on all 4 ranks (62 layers)",
        "hot pages replicated on all 4 ranks (1 layer)",
    )


def test_jamba_states_halve_at_tp2(zoo_registry: kvcore.KindRegistry) -> None:
    layers = _model(zoo_registry, "jamba-1-5-mini")
    state = layers["model.layers.0.mamba"]
    assert isinstance(state, MambaSpec)
    # conv (3, 8192) + SSM (8192, 16), bf16.
    assert state.state_bytes == (3 * 8192 + 8192 * 16) * 2 == 311296
    served = apply_serving_choices(layers, ServingChoices(tensor_parallel_size=2))
    rank = served.layers["model.layers.0.mamba"]
    assert isinstance(rank, MambaSpec)
    assert rank.shapes == ((3, 4096), (4096, 16))
    assert rank.state_bytes == 155648
    attention = served.layers["model.layers.4.self_attn"]
    assert attention.page_size_bytes == 4 * 16 * 256 * 2
    assert served.notes == ("tensor parallel 2: 32 layers split across ranks",)


def test_qwen3_next_states_halve_at_tp2(zoo_registry: kvcore.KindRegistry) -> None:
    layers = _model(zoo_registry, "qwen3-next-80b-a3b")
    state = layers["model.layers.0.linear_attn"]
    assert isinstance(state, MambaSpec)
    # conv (3, 8192) + recurrent (32 heads, 128, 128), bf16.
    assert state.state_bytes == 49152 + 1048576
    served = apply_serving_choices(layers, ServingChoices(tensor_parallel_size=2))
    rank = served.layers["model.layers.0.linear_attn"]
    assert isinstance(rank, MambaSpec)
    assert rank.shapes == ((3, 4096), (16, 128, 128))
    assert rank.state_bytes == (49152 + 1048576) // 2
    # 2 KV heads of 256: TP 2 splits them, TP 4 replicates each on 2 ranks.
    assert served.layers["model.layers.3.self_attn"].page_size_bytes == 16384
    tp4 = apply_serving_choices(layers, ServingChoices(tensor_parallel_size=4))
    assert tp4.layers["model.layers.3.self_attn"].page_size_bytes == 16384
    assert len(tp4.replicated_layers) == 12
    assert tp4.notes[-1] == (
        "KV heads replicated across 4 ranks: 2 heads, each rank keeps 1 (12 layers)"
    )


def test_a_state_dim_that_does_not_divide_names_layer_shape_and_fix(
    zoo_registry: kvcore.KindRegistry,
) -> None:
    layers = _model(zoo_registry, "jamba-1-5-mini")
    with pytest.raises(ServingError) as info:
        apply_serving_choices(layers, ServingChoices(tensor_parallel_size=3))
    text = str(info.value)
    assert text.startswith("layer 'model.layers.0.mamba' (mamba): state shape 0")
    assert "(3, 8192) splits dim 1 (8192) across 3" in text
    assert "set shard_dims (or tp_replicated)" in text


def test_tp_replicated_states_are_untouched() -> None:
    state = MambaSpec(
        block_size=16, shapes=((3, 64), (64, 16)), dtypes=(torch.float32,) * 2,
        tp_replicated=True,
    )  # fmt: skip
    served = apply_serving_choices({"s": state}, ServingChoices(tensor_parallel_size=4))
    assert served.layers["s"] is state
    assert served.replicated_layers == ("s",)
    assert served.notes[-1] == (
        "recurrent state (tp_replicated) replicated on all 4 ranks (1 layer)"
    )


def test_shard_dims_override_the_default() -> None:
    state = MambaSpec(
        block_size=16, shapes=((3, 64), (3, 32), (8, 4)),
        dtypes=(torch.float32,) * 3, shard_dims=(1, 1, None),
    )  # fmt: skip
    rank = state.sharded(2).spec
    assert isinstance(rank, MambaSpec)
    assert rank.shapes == ((3, 32), (3, 16), (8, 4))
    # Without the override the second conv state would split its 3 rows.
    default = attrs.evolve(state, shard_dims=None)
    with pytest.raises(kvcore.InvalidSpecError, match=r"state shape 1 \(3, 32\)"):
        default.sharded(2)
    # One shape: a linear-attention state (heads, d, d) splits its heads.
    single = MambaSpec(block_size=16, shapes=((8, 16, 16),), dtypes=(torch.float32,))
    assert single.sharded(4).spec.shapes == ((2, 16, 16),)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("shard_dims", "match"),
    [
        ((1,), "needs one entry per state shape, got 1 for 2 shapes"),
        ((2, 0), r"dim 2 is not a dim of state shape \(3, 64\)"),
        ("01", "shard_dims must be null or a sequence"),
    ],
)
def test_bad_shard_dims_are_refused(shard_dims: Any, match: str) -> None:
    with pytest.raises(kvcore.InvalidSpecError, match=match):
        MambaSpec(
            block_size=16, shapes=((3, 64), (64, 16)), dtypes=(torch.float32,) * 2,
            shard_dims=shard_dims,
        )  # fmt: skip


def test_a_shard_the_spec_refuses_is_the_spec_error() -> None:
    # bf16 conv (3, 2) then fp32: at TP 2 the fp32 state would start at byte 6.
    state = MambaSpec(
        block_size=16, shapes=((3, 2), (4,)), dtypes=(torch.bfloat16, torch.float32)
    )
    with pytest.raises(ServingError, match=r"layer 's' .*would start at byte 6"):
        apply_serving_choices({"s": state}, ServingChoices(tensor_parallel_size=2))


def test_a_padded_state_cannot_split() -> None:
    state = MambaSpec(
        block_size=16, shapes=((3, 64), (64, 16)), dtypes=(torch.float32,) * 2,
        page_size_padded=8192,
    )  # fmt: skip
    with pytest.raises(ServingError, match="page_size_padded=8192 was sized for"):
        apply_serving_choices({"s": state}, ServingChoices(tensor_parallel_size=2))


@attrs.frozen(kw_only=True)
class _PlainSpec(KVCacheSpec):
    kind: ClassVar[str] = "plain"

    @property
    def page_grid(self) -> tuple[int, int, int]:
        return (1, 1, 64)


def test_a_kind_that_does_not_say_how_it_shards_is_refused() -> None:
    spec = _PlainSpec(block_size=16)
    served = apply_serving_choices(
        {"p": spec}, ServingChoices(kv_cache_dtype="fp8", block_size=32)
    )
    assert served.layers["p"] is spec
    assert served.dtype_kept_layers == served.block_size_kept_layers == ("p",)
    assert spec.sharded(1) == Sharded(spec=spec)
    with pytest.raises(ServingError, match=r"kind 'plain' .*must override"):
        apply_serving_choices({"p": spec}, ServingChoices(tensor_parallel_size=2))


@attrs.frozen(kw_only=True)
class _BadSpec(FullAttentionSpec):
    def with_block_size(self, block_size: int) -> Any:
        return 32


def test_a_plugin_answer_of_the_wrong_type_is_a_type_error() -> None:
    spec = _BadSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16)
    with pytest.raises(
        PluginResultError, match=r"with_block_size\(32\) for layer 'b' returned 32;"
    ) as info:
        apply_serving_choices({"b": spec}, ServingChoices(block_size=32))
    assert isinstance(info.value, TypeError)


def test_bad_arguments_are_type_errors() -> None:
    with pytest.raises(kvcore.KvcoreTypeError, match="must be a ServingChoices"):
        apply_serving_choices({}, {"tp": 2})  # type: ignore[arg-type]
    with pytest.raises(kvcore.KvcoreTypeError, match="must map layer names"):
        apply_serving_choices([_full()], ServingChoices())  # type: ignore[arg-type]
    with pytest.raises(kvcore.KvcoreTypeError, match="layer 'x' has spec 3"):
        apply_serving_choices({"x": 3}, ServingChoices())  # type: ignore[dict-item]
    with pytest.raises(kvcore.InvalidSpecError, match="positive int, got 0"):
        _full().sharded(0)


# -- block size ----------------------------------------------------------------


def test_block_size_on_a_hybrid_leaves_states_alone(
    zoo_registry: kvcore.KindRegistry,
) -> None:
    layers = _model(zoo_registry, "jamba-1-5-mini")
    served = apply_serving_choices(layers, ServingChoices(block_size=32))
    attention = served.layers["model.layers.4.self_attn"]
    assert attention.block_size == 32
    assert attention.page_size_bytes == 8 * 32 * 256 * 2
    assert served.layers["model.layers.0.mamba"] is layers["model.layers.0.mamba"]
    assert len(served.block_size_kept_layers) == 28
    assert served.notes == (
        "block size 32 on 4 layers; 28 layers keep their own block: 28 mamba",
    )


def test_block_size_on_deepseek_v4(zoo_registry: kvcore.KindRegistry) -> None:
    layers = _model(zoo_registry, "deepseek-v4-flash")
    served = apply_serving_choices(layers, ServingChoices(block_size=32))
    window = served.layers["model.layers.0.attn.swa_cache"]
    # 32 tokens x 584 bytes = 18688, padded up to a multiple of 576.
    assert window.block_size == 32
    assert window.page_size_bytes == 33 * 576
    assert served.notes == (
        "block size 32 on 43 layers; 124 layers keep their own block: "
        "62 mla, 62 circular_buffer",
    )


def test_a_padded_page_keeps_its_block() -> None:
    assert _full(page_size_padded=70000).with_block_size(32) is None
    spec = _full()
    assert spec.with_block_size(16) is spec


def test_a_block_size_the_spec_refuses_is_the_spec_error() -> None:
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16,
        sliding_window=64,
    )  # fmt: skip
    assert window.with_block_size(64).block_size == 64  # type: ignore[union-attr]
    # The choices refuse a bad block size before any spec sees it; a spec
    # called directly refuses it with its own validation.
    with pytest.raises(kvcore.InvalidSpecError, match="block_size must be positive"):
        window.with_block_size(0)


def test_chunked_local_takes_a_block_that_tiles_its_chunk(
    zoo_registry: kvcore.KindRegistry,
) -> None:
    layers = _model(zoo_registry, "llama-4-scout-17b-16e")
    served = apply_serving_choices(layers, ServingChoices(block_size=32))
    assert {s.block_size for s in served.layers.values()} == {32}
    with pytest.raises(ServingError) as info:
        apply_serving_choices(layers, ServingChoices(block_size=48))
    text = str(info.value)
    assert text.startswith("layer 'model.layers.0.self_attn' (chunked_local_attention)")
    assert "block size 48 does not tile attention_chunk_size=8192" in text
    assert "use a block size that divides 8192" in text


def test_all_three_choices_plan(zoo_registry: kvcore.KindRegistry) -> None:
    layers = _model(zoo_registry, "gemma-3-27b")
    choices = ServingChoices(
        kv_cache_dtype="fp8", tensor_parallel_size=2, block_size=32
    )
    served = apply_serving_choices(layers, choices)
    # 8 heads x 32 tokens x 256 values x 1 byte.
    assert {s.page_size_bytes for s in served.layers.values()} == {65536}
    assert served.notes == (
        "cache dtype float8_e4m3fn on 62 layers",
        "block size 32 on 62 layers",
        "tensor parallel 2: 62 layers split across ranks",
    )
    config = EngineConfig(cache_config=CacheConfig(kv_cache_layout="BLHNC"))
    plan = kvcore.plan_kv_cache(config, served.layers, 2**30, registry=zoo_registry)
    assert plan.num_blocks > 0


# -- model files ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("fp8", E4M3),
        ("FP8_E5M2", torch.float8_e5m2),
        ("bf16", torch.bfloat16),
        ("half", torch.float16),
        ("fp32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("torch.uint8", torch.uint8),
        ("float8_e4m3fn", E4M3),
    ],
)
def test_model_files_take_dtype_aliases(
    zoo_registry: kvcore.KindRegistry, name: str, dtype: torch.dtype
) -> None:
    data = {
        "name": "m",
        "layers": {
            "a": {
                "kind": "full_attention", "block_size": 16, "num_kv_heads": 1,
                "head_size": 8, "dtype": name,
            },
            "s": {
                "kind": "mamba", "block_size": 16, "shapes": [[4]],
                "dtypes": [name],
            },
        },
    }  # fmt: skip
    layers = load_model_file(data, zoo_registry).layers
    assert layers["a"].dtype == dtype  # type: ignore[attr-defined]
    assert layers["s"].dtypes == (dtype,)  # type: ignore[attr-defined]
    dumped = make_converter(zoo_registry).unstructure(layers["a"])
    assert dumped["dtype"] == str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("name", ["auto", "fp9", "Tensor"])
def test_model_files_refuse_other_dtype_names(
    zoo_registry: kvcore.KindRegistry, name: str
) -> None:
    data = {
        "layers": {
            "a": {
                "kind": "mla", "block_size": 16, "num_kv_heads": 1,
                "head_size": 8, "dtype": name,
            }
        }
    }  # fmt: skip
    with pytest.raises(kvcore.SerializationError) as info:
        load_model_file(data, zoo_registry)
    assert f"{name!r} is not a torch dtype name" in str(info.value)
    assert "cache dtype alias (fp8, fp8_e4m3" in str(info.value)


def test_shard_dims_round_trip_through_json(
    zoo_registry: kvcore.KindRegistry,
) -> None:
    converter = make_converter(zoo_registry)
    state = MambaSpec(
        block_size=16, shapes=((3, 64), (64, 16)), dtypes=(torch.float32,) * 2,
        shard_dims=(1, None),
    )  # fmt: skip
    data = json.loads(json.dumps(converter.unstructure(state)))
    assert data["shard_dims"] == [1, None]
    assert converter.structure_spec(data) == state
    assert "shard_dims" not in converter.unstructure(
        attrs.evolve(state, shard_dims=None)
    )


def test_mla_keeps_the_whole_latent_at_any_size() -> None:
    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=E4M3)
    assert spec.sharded(1).replicas == 1
    assert spec.sharded(16).spec is spec


def test_mamba_cache_mode_applies_to_state_layers_only(
    zoo_registry: kvcore.KindRegistry,
) -> None:
    layers = _model(zoo_registry, "jamba-1-5-mini")
    served = apply_serving_choices(layers, ServingChoices(mamba_cache_mode="align"))
    modes = {getattr(s, "mamba_cache_mode", None) for s in served.layers.values()}
    assert modes == {"align", None}
    states = sum(1 for s in served.layers.values() if s.kind == "mamba")
    assert served.notes == (f"state cache mode align on {states} layers",)
    # attention layers are the same objects
    assert all(served.layers[n] is s for n, s in layers.items() if s.kind != "mamba")
    with pytest.raises(ServingError, match="mamba_cache_mode must be one of"):
        ServingChoices(mamba_cache_mode="sometimes")


def test_checkpoint_policy_applies_to_state_layers_only(
    zoo_registry: kvcore.KindRegistry,
) -> None:
    layers = _model(zoo_registry, "jamba-1-5-mini")
    choices = ServingChoices(mamba_cache_mode="align", checkpoint_policy="steps")
    served = apply_serving_choices(layers, choices)
    policies = {getattr(s, "checkpoint_policy", None) for s in served.layers.values()}
    assert policies == {"steps", None}
    states = sum(1 for s in served.layers.values() if s.kind == "mamba")
    assert served.notes == (
        f"state cache mode align on {states} layers",
        f"checkpoint policy steps on {states} layers",
    )
    # A model without state layers takes neither, and says nothing.
    attention = {n: s for n, s in layers.items() if s.kind != "mamba"}
    assert apply_serving_choices(attention, choices).notes == ()
