"""The recurrent-state hybrids mapped from their ``config.json``: Jamba,
Nemotron-H, Falcon-H1 and Qwen3-Next.

Every expected number below is worked by hand from the config fields and
the engines' rules (vLLM's ``MambaStateShapeCalculator``), so a mapper or
sharding change that moves a byte fails here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import kvcore.tools.zoo
import kvcore_hf
from kvcore.errors import InvalidSpecError
from kvcore.serialize import make_converter
from kvcore.serving import ServingChoices, ServingError, apply_serving_choices
from kvcore.spec import KVCacheSpec
from kvcore_full_attention import FullAttentionSpec
from kvcore_hf.mapping import (
    MapperRegistry,
    ModelConfigError,
    load_hf_config,
    map_model_config,
)
from kvcore_mamba import MambaSpec
from kvcore_sliding_window import SlidingWindowSpec

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
MAPPERS = MapperRegistry.from_mappers(kvcore_hf.MAPPERS)
BF16, FP32 = torch.bfloat16, torch.float32


def _layers(config: Any) -> dict[str, KVCacheSpec]:
    return map_model_config(config, mappers=MAPPERS).layers


def _served(config: Any, tp: int) -> dict[str, KVCacheSpec]:
    return apply_serving_choices(
        _layers(config), ServingChoices(tensor_parallel_size=tp)
    ).layers


def test_the_state_fixtures_are_named_like_shipped_files() -> None:
    """test_hf_mapping checks a fixture against the shipped file of its name;
    a misnamed fixture would be skipped there silently."""
    for name in ("jamba-1-5-mini", "qwen3-next-80b-a3b"):
        assert name in kvcore.tools.zoo.names()
        assert (FIXTURES / name / "config.json").is_file()


# -- Jamba ----------------------------------------------------------------


def test_jamba_attention_sits_at_offset_4_of_every_8_layers() -> None:
    layers = _layers(load_hf_config(FIXTURES / "jamba-1-5-mini"))
    attention = [n for n, s in layers.items() if isinstance(s, FullAttentionSpec)]
    assert attention == [f"model.layers.{i}.self_attn" for i in (4, 12, 20, 28)]
    assert len(layers) == 32
    assert list(layers)[:5] == [
        "model.layers.0.mamba",
        "model.layers.1.mamba",
        "model.layers.2.mamba",
        "model.layers.3.mamba",
        "model.layers.4.self_attn",
    ]
    # d_inner = 2 x 4096: conv (4 - 1, 8192) + SSM (8192, 16), bf16.
    assert layers["model.layers.0.mamba"] == MambaSpec(
        block_size=16, shapes=((3, 8192), (8192, 16)), dtypes=(BF16, BF16)
    )
    assert (
        layers["model.layers.0.mamba"].page_size_bytes == 3 * 8192 * 2 + 8192 * 16 * 2
    )
    # 8 KV heads of 4096 / 32 = 128, K and V, 16 tokens, 2 bytes.
    assert layers["model.layers.4.self_attn"].page_size_bytes == 16 * 8 * 256 * 2


def test_jamba_offset_must_be_below_the_period() -> None:
    data = json.loads((FIXTURES / "jamba-1-5-mini" / "config.json").read_text())
    with pytest.raises(ModelConfigError, match=r"attn_layer_offset \(8\) must be"):
        _layers({**data, "attn_layer_offset": 8})


# -- Nemotron-H -----------------------------------------------------------

#: nvidia/Nemotron-H-8B-Base-8K's cache fields (its pattern is 52 layers).
NEMOTRON_H_8B = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "hidden_size": 4096,
    "num_hidden_layers": 52,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "attention_head_dim": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "torch_dtype": "bfloat16",
}
NEMOTRON_ATTENTION = [7, 18, 29, 40]
NEMOTRON_MAMBA = [0, 2, 4, 6, 9, 11, 13, 15, 17, 20, 22, 24, 26, 28]
NEMOTRON_MAMBA += [31, 33, 35, 37, 39, 42, 44, 46, 48, 50]


def test_nemotron_h_pattern_m_star_dash() -> None:
    layers = _layers(NEMOTRON_H_8B)
    # MLP-only layers (-) keep no cache: 24 Mamba + 4 attention of 52.
    assert list(layers) == [
        f"model.layers.{i}.mixer" for i in sorted(NEMOTRON_MAMBA + NEMOTRON_ATTENTION)
    ]
    assert len(NEMOTRON_MAMBA) == 24
    for i in NEMOTRON_ATTENTION:
        assert layers[f"model.layers.{i}.mixer"] == FullAttentionSpec(
            block_size=16, num_kv_heads=8, head_size=128, dtype=BF16
        )
    # d_inner = 128 x 64 = 8192; conv adds 2 x 8 groups x 128 = 2048 channels;
    # the SSM state is float32, vLLM's NemotronH default.
    state = layers["model.layers.0.mixer"]
    assert state == MambaSpec(
        block_size=16,
        shapes=((3, 10240), (128, 64, 128)),
        dtypes=(BF16, FP32),
        conv_groups=(8, 256),
    )
    assert state.page_size_bytes == 3 * 10240 * 2 + 128 * 64 * 128 * 4 == 4255744


def test_nemotron_h_tp2_and_tp8_split_heads_and_groups() -> None:
    tp2 = _served(NEMOTRON_H_8B, 2)
    state = tp2["model.layers.0.mixer"]
    assert isinstance(state, MambaSpec)
    assert state.shapes == ((3, 5120), (64, 64, 128))
    assert state.conv_groups == (4, 256)
    assert state.page_size_bytes == 3 * 5120 * 2 + 64 * 64 * 128 * 4 == 2127872
    assert tp2["model.layers.7.mixer"].page_size_bytes == 16 * 4 * 256 * 2

    served = apply_serving_choices(
        _layers(NEMOTRON_H_8B), ServingChoices(tensor_parallel_size=8)
    )
    state = served.layers["model.layers.0.mixer"]
    assert isinstance(state, MambaSpec)
    # 8 groups over 8 ranks: one group a rank; 16 heads a rank.
    assert state.shapes == ((3, 1280), (16, 64, 128))
    assert state.conv_groups == (1, 256)
    assert state.page_size_bytes == 3 * 1280 * 2 + 16 * 64 * 128 * 4 == 531968
    attn = served.layers["model.layers.40.mixer"]
    assert attn == FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=128, dtype=BF16
    )
    assert served.replicated_layers == ()


def test_nemotron_h_groups_the_ranks_cannot_divide_are_refused() -> None:
    # MambaMixer2 accepts 8 groups on 16 ranks only if there were 1 group.
    with pytest.raises(ServingError) as info:
        _served(NEMOTRON_H_8B, 16)
    text = str(info.value)
    assert text.startswith("layer 'model.layers.0.mixer' (mamba): ")
    assert "8 B/C groups cannot follow 16 tensor-parallel ranks" in text


def test_nemotron_h_reads_the_files_ssm_dtype_and_window() -> None:
    layers = _layers(
        {**NEMOTRON_H_8B, "mamba_ssm_cache_dtype": "bfloat16", "sliding_window": 4096}
    )
    state = layers["model.layers.0.mixer"]
    assert isinstance(state, MambaSpec)
    assert state.dtypes == (BF16, BF16)
    assert layers["model.layers.7.mixer"] == SlidingWindowSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype=BF16, sliding_window=4096
    )


def test_nemotron_h_layers_block_type_is_the_pattern_as_a_list() -> None:
    data = {k: v for k, v in NEMOTRON_H_8B.items() if k != "hybrid_override_pattern"}
    names = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
    pattern = "M*-E"
    types = [names[c] for c in pattern]
    layers = _layers({**data, "layers_block_type": types})
    assert list(layers) == ["model.layers.0.mixer", "model.layers.1.mixer"]
    assert isinstance(layers["model.layers.1.mixer"], FullAttentionSpec)


def test_nemotron_h_a_missing_state_field_names_it_and_the_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "config.json"
    data = {k: v for k, v in NEMOTRON_H_8B.items() if k != "ssm_state_size"}
    path.write_text(json.dumps(data))
    with pytest.raises(ModelConfigError) as info:
        map_model_config(load_hf_config(path), mappers=MAPPERS)
    assert str(info.value) == (
        f"{path}: field ssm_state_size is missing; the mapper for "
        "NemotronHForCausalLM needs it"
    )


def test_nemotron_h_an_unknown_pattern_character_is_refused() -> None:
    with pytest.raises(ModelConfigError, match=r"found 'X'"):
        _layers({**NEMOTRON_H_8B, "hybrid_override_pattern": "M*X"})


# -- Falcon-H1 ------------------------------------------------------------

#: Falcon-H1-34B's cache fields (the transformers docs table and a
#: third-party copy of its config; mamba_n_groups from the copy only).
FALCON_H1_34B = {
    "architectures": ["FalconH1ForCausalLM"],
    "model_type": "falcon_h1",
    "hidden_size": 5120,
    "num_hidden_layers": 72,
    "num_attention_heads": 20,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "mamba_d_ssm": 4096,
    "mamba_n_heads": 32,
    "mamba_d_head": 128,
    "mamba_n_groups": 2,
    "mamba_d_state": 256,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "torch_dtype": "bfloat16",
}


def test_falcon_h1_every_layer_keeps_attention_and_a_mamba_state() -> None:
    layers = _layers(FALCON_H1_34B)
    assert len(layers) == 144
    assert list(layers)[:4] == [
        "model.layers.0.self_attn",
        "model.layers.0.mamba",
        "model.layers.1.self_attn",
        "model.layers.1.mamba",
    ]
    assert layers["model.layers.71.self_attn"] == FullAttentionSpec(
        block_size=16, num_kv_heads=4, head_size=128, dtype=BF16
    )
    # conv (3, 4096 + 2 x 2 x 256 = 5120), SSM (32, 128, 256), both bf16.
    state = layers["model.layers.71.mamba"]
    assert state == MambaSpec(
        block_size=16,
        shapes=((3, 5120), (32, 128, 256)),
        dtypes=(BF16, BF16),
        conv_groups=(2, 512),
    )
    assert state.page_size_bytes == 30720 + 2097152
    assert layers["model.layers.0.self_attn"].page_size_bytes == 16 * 4 * 256 * 2


def test_falcon_h1_a_single_group_stays_whole_on_every_rank() -> None:
    one = {**FALCON_H1_34B, "mamba_n_groups": 1}
    state = _served(one, 4)["model.layers.0.mamba"]
    assert isinstance(state, MambaSpec)
    # vLLM pads 1 group to 4: (4096 + 2 x 4 x 256) / 4 = 1024 + 512.
    assert state.shapes == ((3, 1536), (8, 128, 256))
    assert state.conv_groups == (1, 512)
    # Two groups split over 2 ranks; over 8 ranks the engines refuse.
    tp2 = _served(FALCON_H1_34B, 2)["model.layers.0.mamba"]
    assert tp2.shapes == ((3, 2560), (16, 128, 256))  # type: ignore[attr-defined]
    with pytest.raises(ServingError, match="2 B/C groups cannot follow 8"):
        _served(FALCON_H1_34B, 8)


def test_falcon_h1_null_d_ssm_and_auto_head_size_derive_the_width() -> None:
    derived = {**FALCON_H1_34B, "mamba_d_ssm": None, "mamba_d_head": "auto"}
    state = _layers(derived)["model.layers.0.mamba"]
    # 2 x 5120 = 10240 channels, 10240 / 32 = 320 a head.
    assert state.shapes == ((3, 10240 + 1024), (32, 320, 256))  # type: ignore[attr-defined]


def test_falcon_h1_needs_mamba_d_ssm_present(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps({k: v for k, v in FALCON_H1_34B.items() if k != "mamba_d_ssm"})
    )
    with pytest.raises(ModelConfigError, match=r"field mamba_d_ssm is missing"):
        map_model_config(load_hf_config(path), mappers=MAPPERS)
    bad = {**FALCON_H1_34B, "mamba_d_head": 64}
    with pytest.raises(ModelConfigError, match=r"\(32\) x mamba_d_head \(64\)"):
        _layers(bad)


# -- Qwen3-Next -----------------------------------------------------------


def test_qwen3_next_three_delta_net_layers_then_full_attention() -> None:
    layers = _layers(load_hf_config(FIXTURES / "qwen3-next-80b-a3b"))
    full = [n for n, s in layers.items() if isinstance(s, FullAttentionSpec)]
    assert full == [f"model.layers.{i}.self_attn" for i in range(3, 48, 4)]
    state = layers["model.layers.0.linear_attn"]
    # conv over q, k (16 x 128 each) and v (32 x 128); recurrent (32, 128, 128).
    assert state == MambaSpec(
        block_size=16, shapes=((3, 8192), (32, 128, 128)), dtypes=(BF16, BF16)
    )
    assert state.page_size_bytes == 3 * 8192 * 2 + 32 * 128 * 128 * 2 == 1097728
    assert layers["model.layers.3.self_attn"].page_size_bytes == 16 * 2 * 512 * 2


def test_qwen3_next_tp2_and_tp8() -> None:
    config = load_hf_config(FIXTURES / "qwen3-next-80b-a3b")
    tp2 = _served(config, 2)
    assert tp2["model.layers.0.linear_attn"].shapes == (  # type: ignore[attr-defined]
        (3, 4096),
        (16, 128, 128),
    )
    assert tp2["model.layers.3.self_attn"].page_size_bytes == 16 * 1 * 512 * 2
    served = apply_serving_choices(
        _layers(config), ServingChoices(tensor_parallel_size=8)
    )
    state = served.layers["model.layers.0.linear_attn"]
    assert isinstance(state, MambaSpec)
    assert state.shapes == ((3, 1024), (4, 128, 128))
    assert state.page_size_bytes == 3 * 1024 * 2 + 4 * 128 * 128 * 2 == 137216
    # 2 KV heads on 8 ranks: each rank keeps one, all 12 layers replicated.
    assert served.layers["model.layers.47.self_attn"].page_size_bytes == 16384
    assert served.replicated_layers == tuple(
        f"model.layers.{i}.self_attn" for i in range(3, 48, 4)
    )


def test_qwen3_next_layer_types_win_over_the_interval() -> None:
    data = json.loads((FIXTURES / "qwen3-next-80b-a3b" / "config.json").read_text())
    types = ["full_attention", "linear_attention"] * 24
    layers = _layers({**data, "layer_types": types})
    assert list(layers)[:2] == [
        "model.layers.0.self_attn",
        "model.layers.1.linear_attn",
    ]
    with pytest.raises(ModelConfigError, match=r"layer_types\[1\] is 'sliding"):
        _layers({**data, "layer_types": ["full_attention", "sliding_attention"] * 24})


# -- conv_groups in model files -------------------------------------------


def test_conv_groups_round_trip_through_json() -> None:
    converter = make_converter()
    state = _layers(NEMOTRON_H_8B)["model.layers.0.mixer"]
    data = json.loads(json.dumps(converter.unstructure(state)))
    assert data["conv_groups"] == [8, 256]
    assert converter.structure_spec(data) == state


def test_conv_groups_must_fit_the_conv_state() -> None:
    with pytest.raises(InvalidSpecError, match=r"conv_groups 4 x 64 channels must lie"):
        MambaSpec(
            block_size=16,
            shapes=((3, 256), (4, 8, 32)),
            dtypes=(BF16, BF16),
            conv_groups=(4, 64),
        )
