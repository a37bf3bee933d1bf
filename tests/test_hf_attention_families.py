"""The attention-only architecture mappers: Qwen2 / Qwen3 (dense and MoE),
Mistral, Mixtral, Gemma 2 / 3, gpt-oss and GLM-4.5.

Configurations are inline dicts with the public checkpoints' cache fields
(or small edits of them, said where made); every expectation is worked by
hand from the rules in the mapper modules: which layers are windowed and by
how much, KV heads, head size, dtype.  Tensor parallelism goes through
:func:`kvcore.serving.apply_serving_choices`, the code ``kvcore plan --tp``
runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import kvcore.tools.zoo
import kvcore_hf
from kvcore.serving import ServingChoices, apply_serving_choices
from kvcore.spec import KVCacheSpec
from kvcore_full_attention import FullAttentionSpec
from kvcore_hf.mapping import (
    MapperRegistry,
    ModelConfigError,
    UnknownArchitectureError,
    load_hf_config,
    map_model_config,
)
from kvcore_sliding_window import SlidingWindowSpec

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
MAPPERS = MapperRegistry.from_mappers(kvcore_hf.MAPPERS)
BF16 = torch.bfloat16


def mapped(data: dict[str, Any]) -> dict[str, KVCacheSpec]:
    return dict(map_model_config(data, mappers=MAPPERS).layers)


def full(kv: int, head: int, dtype: torch.dtype = BF16) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=16, num_kv_heads=kv, head_size=head, dtype=dtype
    )


def sliding(
    kv: int, head: int, window: int, dtype: torch.dtype = BF16
) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=16,
        num_kv_heads=kv,
        head_size=head,
        dtype=dtype,
        sliding_window=window,
    )


def layers(pattern: str, f: KVCacheSpec, s: KVCacheSpec) -> dict[str, KVCacheSpec]:
    """The expected model: ``F`` for a full layer, ``S`` for a sliding one."""
    assert set(pattern) <= {"F", "S"}
    return {
        f"model.layers.{i}.self_attn": f if c == "F" else s
        for i, c in enumerate(pattern)
    }


def test_the_gemma_and_gpt_oss_fixtures_are_checked_against_the_shipped_files() -> None:
    """tests/test_hf_mapping.py maps every fixture named like a shipped
    model file and compares the two layer for layer."""
    for name in ("gemma-3-27b", "gpt-oss-120b"):
        assert name in kvcore.tools.zoo.names()
        assert (FIXTURES / name / "config.json").is_file()


def test_every_family_is_registered() -> None:
    names = {m.name for m in kvcore_hf.MAPPERS}
    assert {
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "mistral",
        "mixtral",
        "gemma2",
        "gemma3",
        "gpt_oss",
        "glm4_moe",
    } <= names
    with pytest.raises(UnknownArchitectureError) as info:
        map_model_config({"architectures": ["FooForCausalLM"]}, mappers=MAPPERS)
    for arch in (
        "Qwen3MoeForCausalLM",
        "Gemma3ForConditionalGeneration",
        "GptOssForCausalLM",
        "Glm4MoeForCausalLM",
    ):
        assert arch in str(info.value)


# -- Qwen ------------------------------------------------------------------------

#: Qwen2.5-7B-Instruct's cache fields.
QWEN25_7B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "num_hidden_layers": 28,
    "max_window_layers": 28,
    "sliding_window": 131072,
    "use_sliding_window": False,
    "torch_dtype": "bfloat16",
}
#: A four-layer Qwen2 with the window switched on (an edited configuration).
QWEN2_WINDOWED: dict[str, Any] = {
    **QWEN25_7B,
    "num_hidden_layers": 4,
    "use_sliding_window": True,
    "sliding_window": 4096,
    "max_window_layers": 2,
    "torch_dtype": "float16",
}


def test_qwen2_is_full_attention_while_the_window_is_off() -> None:
    """3584 / 28 = 128-wide heads; use_sliding_window false wins over
    sliding_window 131072."""
    assert mapped(QWEN25_7B) == layers("F" * 28, full(4, 128), full(4, 128))


def test_qwen2_slides_from_max_window_layers_on() -> None:
    f, s = full(4, 128, torch.float16), sliding(4, 128, 4096, torch.float16)
    assert mapped(QWEN2_WINDOWED) == layers("FFSS", f, s)


def test_qwen2_layer_types_override_max_window_layers() -> None:
    data = {
        **QWEN2_WINDOWED,
        "layer_types": [
            "sliding_attention",
            "full_attention",
            "full_attention",
            "sliding_attention",
        ],
    }
    f, s = full(4, 128, torch.float16), sliding(4, 128, 4096, torch.float16)
    assert mapped(data) == layers("SFFS", f, s)


@pytest.mark.parametrize(
    "edit",
    [
        {"use_sliding_window": False},
        {"sliding_window": None},
        {"use_sliding_window": False, "layer_types": ["sliding_attention"] * 4},
    ],
    ids=["window-off", "window-null", "off-despite-layer-types"],
)
def test_qwen2_without_a_window_every_layer_is_full(edit: dict[str, Any]) -> None:
    f = full(4, 128, torch.float16)
    assert mapped({**QWEN2_WINDOWED, **edit}) == layers("FFFF", f, f)


#: Qwen1.5-MoE-A2.7B's cache fields (Qwen2MoeForCausalLM).
QWEN2_MOE: dict[str, Any] = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_hidden_layers": 24,
    "max_window_layers": 21,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "torch_dtype": "bfloat16",
}


def test_qwen2_moe_is_full_attention_as_released() -> None:
    assert mapped(QWEN2_MOE) == layers("F" * 24, full(16, 128), full(16, 128))


def test_qwen2_moe_windows_even_layers_below_max_window_layers() -> None:
    """transformers' Qwen2-MoE default: sliding when i is even and
    i < max_window_layers (here 3): layers 0 and 2."""
    data = {
        **QWEN2_MOE,
        "num_hidden_layers": 6,
        "use_sliding_window": True,
        "sliding_window": 4096,
        "max_window_layers": 3,
    }
    assert mapped(data) == layers("SFSFFF", full(16, 128), sliding(16, 128, 4096))


#: Qwen3-32B's cache fields: head_dim 128, not 5120 / 64 = 80.
QWEN3_32B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 5120,
    "head_dim": 128,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "num_hidden_layers": 64,
    "max_window_layers": 64,
    "sliding_window": None,
    "use_sliding_window": False,
    "torch_dtype": "bfloat16",
}


def test_qwen3_dense_uses_its_head_dim() -> None:
    assert mapped(QWEN3_32B) == layers("F" * 64, full(8, 128), full(8, 128))


def test_qwen3_dense_slides_from_max_window_layers_on() -> None:
    data = {
        **QWEN3_32B,
        "num_hidden_layers": 3,
        "use_sliding_window": True,
        "sliding_window": 4096,
        "max_window_layers": 2,
    }
    assert mapped(data) == layers("FFS", full(8, 128), sliding(8, 128, 4096))


#: Qwen3-30B-A3B's cache fields: head_dim 128, not 2048 / 32 = 64.
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "head_dim": 128,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "num_hidden_layers": 48,
    "max_window_layers": 48,
    "sliding_window": None,
    "use_sliding_window": False,
    "torch_dtype": "bfloat16",
}


def test_qwen3_moe_is_full_attention_as_released() -> None:
    assert mapped(QWEN3_30B_A3B) == layers("F" * 48, full(4, 128), full(4, 128))


def test_qwen3_moe_windows_every_layer_when_switched_on() -> None:
    """Qwen3-MoE's attention takes the window on every layer;
    max_window_layers 48 does not spare layers 0-2."""
    data = {
        **QWEN3_30B_A3B,
        "num_hidden_layers": 3,
        "use_sliding_window": True,
        "sliding_window": 4096,
    }
    assert mapped(data) == layers("SSS", full(4, 128), sliding(4, 128, 4096))


# -- Mistral and Mixtral -----------------------------------------------------

#: Mistral-7B-v0.1's cache fields.
MISTRAL_7B_V01: dict[str, Any] = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "sliding_window": 4096,
    "torch_dtype": "bfloat16",
}


def test_mistral_7b_v01_slides_on_every_layer() -> None:
    assert mapped(MISTRAL_7B_V01) == layers(
        "S" * 32, full(8, 128), sliding(8, 128, 4096)
    )


def test_mistral_with_a_null_window_is_full_attention() -> None:
    """Mistral-7B-v0.3 sets sliding_window null."""
    data = {**MISTRAL_7B_V01, "sliding_window": None}
    assert mapped(data) == layers("F" * 32, full(8, 128), full(8, 128))


def test_mistral_without_a_window_field_takes_the_class_default() -> None:
    """MistralConfig's sliding_window defaults to 4096."""
    data = {k: v for k, v in MISTRAL_7B_V01.items() if k != "sliding_window"}
    data["torch_dtype"] = "float16"
    f, s = full(8, 128, torch.float16), sliding(8, 128, 4096, torch.float16)
    assert mapped(data) == layers("S" * 32, f, s)


def test_mistral_nemo_uses_its_head_dim() -> None:
    """Mistral-Nemo: head_dim 128, not 5120 / 32 = 160; no window."""
    data = {
        **MISTRAL_7B_V01,
        "hidden_size": 5120,
        "head_dim": 128,
        "num_hidden_layers": 40,
        "sliding_window": None,
    }
    assert mapped(data) == layers("F" * 40, full(8, 128), full(8, 128))


#: Mixtral-8x7B-v0.1's cache fields.
MIXTRAL_8X7B: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "sliding_window": None,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize("drop", [False, True], ids=["null", "absent"])
def test_mixtral_is_full_attention_without_a_window(drop: bool) -> None:
    """MixtralConfig's sliding_window defaults to None."""
    data = dict(MIXTRAL_8X7B)
    if drop:
        del data["sliding_window"]
    assert mapped(data) == layers("F" * 32, full(8, 128), full(8, 128))


def test_mixtral_with_a_window_slides() -> None:
    data = {**MIXTRAL_8X7B, "num_hidden_layers": 2, "sliding_window": 4096}
    assert mapped(data) == layers("SS", full(8, 128), sliding(8, 128, 4096))


# -- Gemma -------------------------------------------------------------------

#: Gemma-2-9B's cache fields.
GEMMA2_9B: dict[str, Any] = {
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "hidden_size": 3584,
    "head_dim": 256,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "num_hidden_layers": 42,
    "sliding_window": 4096,
    "torch_dtype": "bfloat16",
}


def test_gemma2_alternates_local_and_global_from_layer_0() -> None:
    """Even layers local (4096), odd layers global; 256-wide heads, not
    3584 / 16 = 224."""
    assert mapped(GEMMA2_9B) == layers("SF" * 21, full(8, 256), sliding(8, 256, 4096))


#: Gemma-3-1B's cache fields (a text-only Gemma3ForCausalLM).
GEMMA3_1B: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 1152,
    "head_dim": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "num_hidden_layers": 26,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
}


def test_gemma3_1b_is_five_local_then_one_global() -> None:
    """Globals at 5, 11, 17, 23; layers 24 and 25 local."""
    expected = layers("SSSSSF" * 4 + "SS", full(1, 256), sliding(1, 256, 512))
    assert mapped(GEMMA3_1B) == expected
    without = {k: v for k, v in GEMMA3_1B.items() if k != "sliding_window_pattern"}
    assert mapped(without) == expected  # the pattern defaults to 6


def test_gemma3_follows_the_pattern_it_is_given() -> None:
    data = {**GEMMA3_1B, "num_hidden_layers": 6, "sliding_window_pattern": 3}
    assert mapped(data) == layers("SSFSSF", full(1, 256), sliding(1, 256, 512))


def test_gemma3_layer_types_win_over_the_pattern() -> None:
    types = ["full_attention", "sliding_attention", "sliding_attention"]
    data = {**GEMMA3_1B, "num_hidden_layers": 3, "layer_types": types}
    assert mapped(data) == layers("FSS", full(1, 256), sliding(1, 256, 512))


def test_gemma3_27b_maps_its_text_config() -> None:
    """The multimodal file: text_config holds the language model, the
    root its dtype; globals at 5, 11, ..., 59, layers 60 and 61 local."""
    config = load_hf_config(FIXTURES / "gemma-3-27b")
    assert config.prefix == "text_config."
    model = map_model_config(config, mappers=MAPPERS)
    assert dict(model.layers) == layers(
        "SSSSSF" * 10 + "SS", full(16, 128), sliding(16, 128, 1024)
    )


# -- gpt-oss -----------------------------------------------------------------

#: gpt-oss-20b's cache fields.
GPT_OSS_20B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "head_dim": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "num_hidden_layers": 24,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "quantization_config": {"quant_method": "mxfp4"},
}


def test_gpt_oss_alternates_sliding_128_and_full() -> None:
    """No torch_dtype in the file: bfloat16; MXFP4 weights leave the cache
    alone."""
    expected = layers("SF" * 12, full(8, 64), sliding(8, 64, 128))
    assert mapped(GPT_OSS_20B) == expected
    without = {k: v for k, v in GPT_OSS_20B.items() if k != "layer_types"}
    assert mapped(without) == expected  # the default: even layers slide


def test_gpt_oss_120b_from_its_public_config() -> None:
    model = map_model_config(load_hf_config(FIXTURES / "gpt-oss-120b"), mappers=MAPPERS)
    assert dict(model.layers) == layers("SF" * 18, full(8, 64), sliding(8, 64, 128))


# -- GLM ---------------------------------------------------------------------

#: GLM-4.5's cache fields (GLM-4.6 has the same).
GLM45: dict[str, Any] = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "hidden_size": 5120,
    "head_dim": 128,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "num_hidden_layers": 92,
    "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 0.5,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize(
    ("edit", "count"),
    [({}, 92), ({"hidden_size": 4096, "num_hidden_layers": 46}, 46)],
    ids=["GLM-4.5", "GLM-4.5-Air"],
)
def test_glm45_is_full_attention_without_its_mtp_layer(
    edit: dict[str, Any], count: int
) -> None:
    """8 KV heads of 128 (5120 / 96 is no head size); the MTP layer at
    index num_hidden_layers holds no cache outside speculative decoding."""
    specs = mapped({**GLM45, **edit})
    assert specs == layers("F" * count, full(8, 128), full(8, 128))
    assert f"model.layers.{count}.self_attn" not in specs


# -- tensor parallelism ------------------------------------------------------


@pytest.mark.parametrize(
    ("tp", "heads", "replicated"),
    [(2, 2, False), (8, 1, True)],
)
def test_tensor_parallel_qwen3_moe_splits_then_replicates_its_4_kv_heads(
    tp: int, heads: int, replicated: bool
) -> None:
    """4 KV heads: 2 per rank at TP 2; at TP 8 each head sits on 2 ranks."""
    served = apply_serving_choices(
        mapped(QWEN3_30B_A3B), ServingChoices(tensor_parallel_size=tp)
    )
    assert dict(served.layers) == layers("F" * 48, full(heads, 128), full(heads, 128))
    assert served.replicated_layers == (tuple(served.layers) if replicated else ())


@pytest.mark.parametrize(("tp", "heads"), [(2, 8), (8, 2)])
def test_tensor_parallel_gemma3_27b_splits_local_and_global_layers(
    tp: int, heads: int
) -> None:
    """16 KV heads divide over 2 and 8 ranks; windows are per rank too."""
    model = map_model_config(load_hf_config(FIXTURES / "gemma-3-27b"), mappers=MAPPERS)
    served = apply_serving_choices(
        model.layers, ServingChoices(tensor_parallel_size=tp)
    )
    assert dict(served.layers) == layers(
        "SSSSSF" * 10 + "SS", full(heads, 128), sliding(heads, 128, 1024)
    )
    assert served.replicated_layers == ()


@pytest.mark.parametrize(("tp", "heads"), [(2, 4), (8, 1)])
def test_tensor_parallel_gpt_oss_splits_its_8_kv_heads(tp: int, heads: int) -> None:
    served = apply_serving_choices(
        mapped(GPT_OSS_20B), ServingChoices(tensor_parallel_size=tp)
    )
    assert dict(served.layers) == layers(
        "SF" * 12, full(heads, 64), sliding(heads, 64, 128)
    )
    assert served.replicated_layers == ()


# -- errors ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "field", "arch"),
    [
        (QWEN3_30B_A3B, "num_key_value_heads", "Qwen3MoeForCausalLM"),
        (MISTRAL_7B_V01, "num_key_value_heads", "MistralForCausalLM"),
    ],
)
def test_a_missing_field_names_the_field_and_the_file(
    tmp_path: Path, data: dict[str, Any], field: str, arch: str
) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in data.items() if k != field}))
    with pytest.raises(ModelConfigError) as info:
        map_model_config(load_hf_config(path), mappers=MAPPERS)
    assert str(info.value) == (
        f"{path}: field {field} is missing; the mapper for {arch} needs it"
    )


# -- defaults of the configuration classes -------------------------------------


@pytest.mark.parametrize(
    ("data", "field", "note", "check"),
    [
        # Qwen3Config's head_dim default is 128 (not 5120 / 64 = 80).
        (
            QWEN3_32B,
            "head_dim",
            "head_dim 128 (Qwen3Config's default)",
            lambda spec: spec.head_size == 128,
        ),
        (
            GEMMA2_9B,
            "sliding_window",
            "sliding_window 4096 (Gemma2Config's default)",
            lambda spec: getattr(spec, "sliding_window", 4096) == 4096,
        ),
        (
            GPT_OSS_20B,
            "head_dim",
            "head_dim 64 (GptOssConfig's default)",
            lambda spec: spec.head_size == 64,
        ),
    ],
)
def test_a_missing_field_takes_the_configuration_class_default(
    tmp_path: Path, data: dict[str, Any], field: str, note: str, check: Any
) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in data.items() if k != field}))
    model = map_model_config(load_hf_config(path), mappers=MAPPERS)
    assert all(check(spec) for spec in model.layers.values())
    assert f"defaults applied: {note}" in model.notes


def test_a_head_dim_the_rule_cannot_give_is_refused(tmp_path: Path) -> None:
    # Glm4MoeConfig has no head_dim default; hidden / heads = 5120 / 96 is
    # no whole number, so the file must say.
    data = {k: v for k, v in GLM45.items() if k != "head_dim"}
    with pytest.raises(ModelConfigError, match="no head_dim is given"):
        map_model_config(data, mappers=MAPPERS)


def test_a_composite_config_without_head_dim_takes_gemma3s_default(
    tmp_path: Path,
) -> None:
    # Gemma-3-4B/12B ship text_config without head_dim: Gemma3TextConfig's
    # 256 applies (the 27B's own is 128).
    source = (FIXTURES / "gemma-3-27b" / "config.json").read_text()
    path = tmp_path / "config.json"
    path.write_text(source.replace('"head_dim": 128,', ""))
    model = map_model_config(load_hf_config(path), mappers=MAPPERS)
    assert {spec.head_size for spec in model.layers.values()} == {256}
    assert (
        "defaults applied: text_config.head_dim 256 (Gemma3TextConfig's default)"
        in model.notes
    )


def test_a_gemma_file_without_max_position_embeddings_takes_the_class_default(
    tmp_path: Path,
) -> None:
    # Gemma-3-4B/12B's text_config leaves it out: Gemma3TextConfig's 131072
    # applies, so a longer --context is warned about.
    source = (FIXTURES / "gemma-3-27b" / "config.json").read_text()
    assert "max_position_embeddings" not in source
    model = map_model_config(load_hf_config(FIXTURES / "gemma-3-27b"), mappers=MAPPERS)
    assert model.max_position_embeddings == 131_072
    assert (
        "text_config.max_position_embeddings 131072 (Gemma3TextConfig's default)"
        in model.notes
    )
    gemma2 = map_model_config(
        {**GEMMA2_9B, "max_position_embeddings": 4096}, mappers=MAPPERS
    )
    assert gemma2.max_position_embeddings == 4096
    assert "max_position_embeddings" not in gemma2.notes
    data = {k: v for k, v in GEMMA2_9B.items() if k != "max_position_embeddings"}
    assert map_model_config(data, mappers=MAPPERS).max_position_embeddings == 8192


def test_a_float32_checkpoint_is_served_in_bfloat16(tmp_path: Path) -> None:
    # vLLM's --dtype auto downcasts float32 configs to bfloat16.
    # and its weights take bfloat16's two bytes a value on the device.
    sized = {**QWEN3_32B, "vocab_size": 151936, "intermediate_size": 25600}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**sized, "torch_dtype": "float32"}))
    model = map_model_config(load_hf_config(path), mappers=MAPPERS)
    assert {spec.dtype for spec in model.layers.values()} == {torch.bfloat16}
    assert "torch_dtype float32 served as bfloat16" in model.notes
    served = map_model_config(sized, mappers=MAPPERS).weights_bytes
    assert model.weights_bytes == served == 65_524_246_528


def test_a_config_without_head_dim_uses_hidden_over_heads() -> None:
    model = map_model_config(MISTRAL_7B_V01, mappers=MAPPERS)
    size = MISTRAL_7B_V01["hidden_size"] // MISTRAL_7B_V01["num_attention_heads"]
    assert {spec.head_size for spec in model.layers.values()} == {size}
    assert "transformers' rule" in model.notes


def test_qwen_windows_without_layer_types_need_max_window_layers() -> None:
    data = {k: v for k, v in QWEN2_WINDOWED.items() if k != "max_window_layers"}
    with pytest.raises(ModelConfigError, match="field max_window_layers is missing"):
        mapped(data)


def test_a_layer_type_the_mapper_does_not_know_is_refused() -> None:
    data = {**GEMMA3_1B, "num_hidden_layers": 2}
    data["layer_types"] = ["sliding_attention", "chunked_attention"]
    with pytest.raises(ModelConfigError) as info:
        mapped(data)
    assert str(info.value) == (
        "config.json: field layer_types[1] is 'chunked_attention'; this mapper "
        "knows 'full_attention' and 'sliding_attention'"
    )


def test_layer_types_of_the_wrong_length_are_refused() -> None:
    data = {**GPT_OSS_20B, "layer_types": ["sliding_attention", "full_attention"]}
    with pytest.raises(
        ModelConfigError,
        match=r"field layer_types must list 24 strings \(one per layer\), got 2",
    ):
        mapped(data)


def test_a_window_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ModelConfigError, match="field sliding_window must be positive"):
        mapped({**MISTRAL_7B_V01, "sliding_window": 0})
