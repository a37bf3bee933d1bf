"""The MLA families' mappers (DeepSeek V2/V3/V3.2/V4, Kimi-Linear, MiniMax)
against hand-worked specs: layer counts, kinds, head sizes, state shapes,
and what tensor parallelism does to them (an MLA latent stays whole and is
replicated on every rank; state heads and channels are divided)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import kvcore.tools.zoo
import kvcore_hf
from kvcore.registry import default_registry
from kvcore.serialize import dump_model_file, load_model_file
from kvcore.serving import ServingChoices, apply_serving_choices
from kvcore.spec import KVCacheSpec
from kvcore_circular_buffer import CircularBufferSpec
from kvcore_full_attention import FullAttentionSpec
from kvcore_hf.mapping import (
    MapperRegistry,
    ModelConfigError,
    load_hf_config,
    map_model_config,
)
from kvcore_mamba import MambaSpec
from kvcore_mla import MLAAttentionSpec
from kvcore_sliding_window import SlidingWindowMLASpec

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
MAPPERS = MapperRegistry.from_mappers(kvcore_hf.MAPPERS)
BF16 = torch.bfloat16
LATENT = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=BF16)


def layers(data: dict[str, Any]) -> dict[str, KVCacheSpec]:
    return map_model_config(data, mappers=MAPPERS).layers


def test_the_shipped_deepseek_files_have_fixtures() -> None:
    """The generic test in test_hf_mapping.py checks each of them layer for
    layer; this fails if a fixture or a file is renamed away."""
    for name in ("deepseek-v3", "deepseek-v3-2-exp", "deepseek-v4-flash"):
        assert name in kvcore.tools.zoo.names()
        assert (FIXTURES / name / "config.json").is_file()


# -- DeepSeek V2 / V3 ----------------------------------------------------------

V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "torch_dtype": "bfloat16",
}


def test_deepseek_v2_lite_caches_one_576_latent_per_layer() -> None:
    mapped = layers(V2_LITE)
    assert list(mapped) == [f"model.layers.{i}.self_attn" for i in range(27)]
    assert set(mapped.values()) == {LATENT}
    # 576 bf16 values a token: 1152 bytes, 64 tokens a page.
    assert LATENT.page_size_bytes == 64 * 1152


def test_the_latent_follows_kv_lora_rank_and_the_rope_dim() -> None:
    mapped = layers(
        {
            **V2_LITE,
            "kv_lora_rank": 256,
            "qk_rope_head_dim": 32,
            "torch_dtype": "float16",
        }
    )
    assert set(mapped.values()) == {
        MLAAttentionSpec(
            block_size=64, num_kv_heads=1, head_size=288, dtype=torch.float16
        )
    }


def test_a_nope_latent_is_the_rank_alone() -> None:
    mapped = layers({**V2_LITE, "qk_rope_head_dim": 0})
    assert set(mapped.values()) == {
        MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=512, dtype=BF16)
    }
    with pytest.raises(ModelConfigError, match=r"qk_rope_head_dim must be 0 or more"):
        layers({**V2_LITE, "qk_rope_head_dim": -64})


def test_a_missing_latent_rank_names_the_field_and_the_file(tmp_path: Path) -> None:
    data = json.loads((FIXTURES / "deepseek-v3" / "config.json").read_text())
    del data["kv_lora_rank"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ModelConfigError) as info:
        map_model_config(load_hf_config(path), mappers=MAPPERS)
    assert str(info.value) == (
        f"{path}: field kv_lora_rank is missing; the mapper for "
        "DeepseekV3ForCausalLM needs it"
    )


@pytest.mark.parametrize("tp", [2, 8])
def test_tensor_parallelism_keeps_the_latent_whole_on_every_rank(tp: int) -> None:
    model = map_model_config(load_hf_config(FIXTURES / "deepseek-v3"), mappers=MAPPERS)
    served = apply_serving_choices(
        model.layers, ServingChoices(tensor_parallel_size=tp)
    )
    assert served.layers == model.layers
    assert set(served.layers.values()) == {LATENT}
    assert served.replicated_layers == tuple(model.layers)
    assert served.notes == (f"MLA latent replicated on all {tp} ranks (61 layers)",)


# -- DeepSeek V3.2 -------------------------------------------------------------

V32 = {
    **V2_LITE,
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "num_hidden_layers": 2,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 2048,
}
INDEX_KEYS = MLAAttentionSpec(
    block_size=64, num_kv_heads=1, head_size=132, dtype=torch.uint8
)


#: V3.2's latent: bf16, carrying its 656-byte fp8_ds_mla record.
V32_LATENT = attrs.evolve(LATENT, fp8_record_size=656)


def test_deepseek_v32_adds_the_indexer_keys_after_each_latent() -> None:
    assert layers(V32) == {
        "model.layers.0.self_attn": V32_LATENT,
        "model.layers.0.self_attn.indexer.k_cache": INDEX_KEYS,
        "model.layers.1.self_attn": V32_LATENT,
        "model.layers.1.self_attn.indexer.k_cache": INDEX_KEYS,
    }
    assert list(layers(V32))[1] == "model.layers.0.self_attn.indexer.k_cache"
    # 128 fp8 keys and one fp32 scale: 132 bytes a token.
    assert INDEX_KEYS.page_size_bytes == 64 * 132


def test_the_indexer_keys_scale_with_index_head_dim() -> None:
    mapped = layers({**V32, "index_head_dim": 256})
    spec = mapped["model.layers.0.self_attn.indexer.k_cache"]
    assert spec == MLAAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=264, dtype=torch.uint8
    )
    with pytest.raises(ModelConfigError, match=r"index_head_dim must be a multiple"):
        layers({**V32, "index_head_dim": 64})


FP8_DS_MLA = MLAAttentionSpec(
    block_size=64, num_kv_heads=1, head_size=656, dtype=torch.uint8
)


@pytest.mark.parametrize(
    ("choices", "settings", "latent"),
    [
        (ServingChoices(kv_cache_dtype="fp8"), {}, FP8_DS_MLA),
        (ServingChoices(), {"kv_cache_dtype": "fp8_e4m3"}, FP8_DS_MLA),
        (ServingChoices(kv_cache_dtype="bf16"), {"kv_cache_dtype": "fp8"}, LATENT),
        (ServingChoices(), {}, V32_LATENT),
    ],
    ids=["engine-fp8", "file-fp8", "engine-overrides-file", "default"],
)
def test_an_fp8_cache_stores_the_v32_latent_as_the_656_byte_record(
    choices: ServingChoices, settings: dict[str, Any], latent: KVCacheSpec
) -> None:
    """512 fp8 values, 4 fp32 scales and 64 bf16 RoPE values: 656 B."""
    model = map_model_config({**V32, **settings}, choices, mappers=MAPPERS)
    served = apply_serving_choices(model.layers, choices)
    assert served.layers["model.layers.1.self_attn"] == latent
    assert served.layers["model.layers.1.self_attn.indexer.k_cache"] == INDEX_KEYS


def test_the_v32_caches_are_replicated_whole_under_tp() -> None:
    model = map_model_config(V32, ServingChoices(kv_cache_dtype="fp8"), mappers=MAPPERS)
    served = apply_serving_choices(
        model.layers, ServingChoices(kv_cache_dtype="fp8", tensor_parallel_size=8)
    )
    assert served.layers == {
        "model.layers.0.self_attn": FP8_DS_MLA,
        "model.layers.0.self_attn.indexer.k_cache": INDEX_KEYS,
        "model.layers.1.self_attn": FP8_DS_MLA,
        "model.layers.1.self_attn.indexer.k_cache": INDEX_KEYS,
    }
    assert served.replicated_layers == tuple(served.layers)
    assert served.dtype_kept_layers == (
        "model.layers.0.self_attn.indexer.k_cache",
        "model.layers.1.self_attn.indexer.k_cache",
    )


@pytest.mark.parametrize("dtype", ["fp8", "fp8_e5m2"])
def test_a_v32_model_file_stores_the_656_byte_record_under_fp8(
    tmp_path: Path, dtype: str
) -> None:
    """The model file written from the mapping (kvcore convert), and the
    shipped one, plan an fp8 cache as the mapping itself does."""
    registry = default_registry()
    choices = ServingChoices(kv_cache_dtype=dtype)
    mapped = map_model_config(V32, choices, mappers=MAPPERS)
    direct = apply_serving_choices(mapped.layers, choices).layers
    path = tmp_path / "v32.json"
    path.write_text(dump_model_file(map_model_config(V32, mappers=MAPPERS), registry))
    from_file = apply_serving_choices(load_model_file(path, registry).layers, choices)
    assert from_file.layers == direct
    assert direct["model.layers.0.self_attn"] == FP8_DS_MLA
    shipped = load_model_file(kvcore.tools.zoo.path("deepseek-v3-2-exp"), registry)
    served = apply_serving_choices(shipped.layers, choices).layers
    assert served["model.layers.60.self_attn"] == FP8_DS_MLA
    # 656 B, not 576: the latent is never plain fp8 values.
    assert served["model.layers.60.self_attn"].page_size_bytes == 64 * 656


# -- DeepSeek V4 ---------------------------------------------------------------

V4 = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "num_hidden_layers": 3,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "sliding_window": 128,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "num_nextn_predict_layers": 1,
    "compress_ratios": [0, 4, 128, 0],
    "torch_dtype": "bfloat16",
}
U8 = torch.uint8
# 448 fp8 NoPE + 64 bf16 RoPE (128 B) + 7 scales + 1 pad.
SWA = SlidingWindowMLASpec(
    block_size=64,
    num_kv_heads=1,
    head_size=584,
    dtype=U8,
    sliding_window=128,
    alignment=576,
)


def compressed(head: int, ratio: int) -> MLAAttentionSpec:
    return MLAAttentionSpec(
        block_size=256,
        num_kv_heads=1,
        head_size=head,
        dtype=U8,
        tokens_per_state=ratio,
        alignment=576,
    )


def ring(slots: int, width: int) -> CircularBufferSpec:
    return CircularBufferSpec(
        block_size=slots,
        num_kv_heads=1,
        head_size=width,
        head_size_v=0,
        dtype=torch.float32,
    )


def test_deepseek_v4_layers_follow_their_compression_ratio() -> None:
    mapped = layers(V4)
    assert mapped == {
        "model.layers.0.attn.swa_cache": SWA,
        "model.layers.1.attn.swa_cache": SWA,
        "model.layers.1.attn": compressed(584, 4),
        # coff 2 at ratio 4: 8 slots of 2 * 2 * 512 kv and score values.
        "model.layers.1.attn.compressor.state_cache": ring(8, 2048),
        "model.layers.1.attn.indexer.k_cache": compressed(132, 4),
        "model.layers.1.attn.indexer.compressor.state_cache": ring(8, 512),
        "model.layers.2.attn.swa_cache": SWA,
        "model.layers.2.attn": compressed(584, 128),
        # coff 1 at ratio 128: 128 slots of 2 * 512.
        "model.layers.2.attn.compressor.state_cache": ring(128, 1024),
    }
    assert list(mapped)[2:4] == [
        "model.layers.1.attn",
        "model.layers.1.attn.compressor.state_cache",
    ]
    # The trailing 0 is the MTP layer: no model.layers.3.
    assert not any(name.startswith("model.layers.3.") for name in mapped)


def test_deepseek_v4_pages_are_padded_to_576_bytes() -> None:
    mapped = layers(V4)
    # 64 records of 584 B = 37376 B, padded to 65 * 576.
    assert mapped["model.layers.0.attn.swa_cache"].page_size_bytes == 37440
    # 256 tokens at ratio 4: 64 records again.
    assert mapped["model.layers.1.attn"].page_size_bytes == 37440
    # Ratio 128: 2 records, 1168 B, padded to 3 * 576.
    assert mapped["model.layers.2.attn"].page_size_bytes == 1728
    # 64 indexer keys of 132 B = 8448 B, padded to 15 * 576.
    assert mapped["model.layers.1.attn.indexer.k_cache"].page_size_bytes == 8640


def test_deepseek_v4_without_ratio_4_layers_needs_no_index_fields() -> None:
    data = {k: v for k, v in V4.items() if not k.startswith("index_")}
    mapped = layers({**data, "compress_ratios": [1, 128, 0, 0]})
    assert list(mapped) == [
        "model.layers.0.attn.swa_cache",
        "model.layers.1.attn.swa_cache",
        "model.layers.1.attn",
        "model.layers.1.attn.compressor.state_cache",
        "model.layers.2.attn.swa_cache",
    ]
    with pytest.raises(ModelConfigError, match=r"field index_head_dim is missing"):
        layers(data)


@pytest.mark.parametrize(
    ("ratios", "message"),
    [
        ([0, 4], r"compress_ratios lists 2 ratios for 3 layers"),
        ([0, 8, 128], r"compress_ratios\[1\] is 8; DeepSeek-V4 layers run at ratio"),
        ([0, "4", 128], r"compress_ratios\[1\] is '4'"),
    ],
)
def test_bad_compression_ratios_are_refused(ratios: list[Any], message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        layers({**V4, "compress_ratios": ratios})


def test_deepseek_v4_is_replicated_whole_under_tp() -> None:
    model = layers(V4)
    served = apply_serving_choices(model, ServingChoices(tensor_parallel_size=8))
    assert served.layers == model
    assert served.replicated_layers == tuple(model)


# -- Kimi-Linear ---------------------------------------------------------------

FULL = [4, 8, 12, 16, 20, 24, 27]
LINEAR_ATTN: dict[str, Any] = {
    "full_attn_layers": FULL,
    "kda_layers": [i for i in range(1, 28) if i not in FULL],
    "num_heads": 32,
    "head_dim": 128,
    "short_conv_kernel_size": 4,
}
KIMI = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "hidden_size": 2304,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "num_nextn_predict_layers": 0,
    "linear_attn_config": LINEAR_ATTN,
    "torch_dtype": "bfloat16",
}
KDA = MambaSpec(
    block_size=16,
    shapes=((3, 3 * 32 * 128), (32, 128, 128)),
    dtypes=(BF16, torch.float32),
)


def test_kimi_linear_has_kda_state_layers_and_mla_layers() -> None:
    mapped = layers(KIMI)
    assert list(mapped) == [f"model.layers.{i}.self_attn" for i in range(27)]
    mla = [i for i in range(27) if mapped[f"model.layers.{i}.self_attn"] == LATENT]
    assert mla == [3, 7, 11, 15, 19, 23, 26]
    assert [
        mapped[f"model.layers.{i}.self_attn"] for i in range(27) if i not in mla
    ] == [KDA] * 20
    # conv 3 x 12288 bf16 + recurrent 32 x 128 x 128 fp32.
    assert KDA.state_bytes == 3 * 12288 * 2 + 32 * 128 * 128 * 4


@pytest.mark.parametrize("tp", [2, 8])
def test_kimi_linear_splits_the_state_and_replicates_the_latent(tp: int) -> None:
    served = apply_serving_choices(
        layers(KIMI), ServingChoices(tensor_parallel_size=tp)
    )
    assert served.layers["model.layers.0.self_attn"] == MambaSpec(
        block_size=16,
        shapes=((3, 12288 // tp), (32 // tp, 128, 128)),
        dtypes=(BF16, torch.float32),
    )
    assert served.layers["model.layers.3.self_attn"] == LATENT
    assert len(served.replicated_layers) == 7


def test_kimi_linear_errors_name_the_nested_field() -> None:
    config = dict(LINEAR_ATTN)
    del config["num_heads"]
    with pytest.raises(ModelConfigError) as info:
        layers({**KIMI, "linear_attn_config": config})
    assert str(info.value) == (
        "config.json: field linear_attn_config.num_heads is missing; the mapper "
        "for KimiLinearForCausalLM needs it"
    )
    with pytest.raises(ModelConfigError, match=r"kda_layers must list 1-based"):
        layers({**KIMI, "linear_attn_config": {**LINEAR_ATTN, "kda_layers": [0]}})


def test_kimi_linear_layers_outside_kda_layers_are_mla() -> None:
    """vLLM reads kda_layers alone; full_attn_layers does not decide."""
    config = {**LINEAR_ATTN, "kda_layers": [1, 2, 3], "full_attn_layers": []}
    mapped = layers({**KIMI, "num_hidden_layers": 4, "linear_attn_config": config})
    assert list(mapped.values()) == [KDA, KDA, KDA, LATENT]


# -- MiniMax -------------------------------------------------------------------

TYPES = ([0] * 7 + [1]) * 10
M1 = {
    "architectures": ["MiniMaxM1ForCausalLM"],
    "model_type": "minimax_m1",
    "hidden_size": 6144,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "attn_type_list": TYPES,
    "torch_dtype": "bfloat16",
}
LIGHTNING = MambaSpec(block_size=16, shapes=((64, 128, 128),), dtypes=(BF16,))
SOFTMAX = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=BF16)


def test_minimax_m1_has_a_softmax_layer_after_every_seven_lightning_ones() -> None:
    mapped = layers(M1)
    assert len(mapped) == 80
    for i in range(80):
        want = SOFTMAX if i % 8 == 7 else LIGHTNING
        assert mapped[f"model.layers.{i}.self_attn"] == want, i
    # 64 heads x 128 x 128 bf16: 2 MiB a request.
    assert LIGHTNING.state_bytes == 2 * 2**20


def test_transformers_layer_types_mean_the_same() -> None:
    data = {k: v for k, v in M1.items() if k != "attn_type_list"}
    names = ["linear_attention", "full_attention"]
    data["layer_types"] = [names[v] for v in TYPES]
    assert layers({**data, "architectures": ["MiniMaxForCausalLM"]}) == layers(M1)
    with pytest.raises(ModelConfigError, match=r"field attn_type_list is missing"):
        layers({k: v for k, v in data.items() if k != "layer_types"})
    with pytest.raises(ModelConfigError, match=r"must list 80 entries"):
        layers({**M1, "attn_type_list": [0, 1]})


@pytest.mark.parametrize(("tp", "heads", "kv"), [(2, 32, 4), (8, 8, 1)])
def test_minimax_m1_splits_state_heads_and_kv_heads(
    tp: int, heads: int, kv: int
) -> None:
    served = apply_serving_choices(layers(M1), ServingChoices(tensor_parallel_size=tp))
    assert served.layers["model.layers.0.self_attn"] == MambaSpec(
        block_size=16, shapes=((heads, 128, 128),), dtypes=(BF16,)
    )
    assert served.layers["model.layers.7.self_attn"] == FullAttentionSpec(
        block_size=16, num_kv_heads=kv, head_size=128, dtype=BF16
    )
    assert served.replicated_layers == ()


def test_minimax_m2_is_full_attention_throughout() -> None:
    mapped = layers(
        {
            "architectures": ["MiniMaxM2ForCausalLM"],
            "model_type": "minimax_m2",
            "hidden_size": 3072,
            "num_hidden_layers": 62,
            "num_attention_heads": 48,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "attn_type_list": [1] * 62,
            "torch_dtype": "bfloat16",
        }
    )
    assert list(mapped) == [f"model.layers.{i}.self_attn" for i in range(62)]
    assert set(mapped.values()) == {SOFTMAX}
