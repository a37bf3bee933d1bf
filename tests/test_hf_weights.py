"""Weights estimated from ``config.json``, checked against the published
sizes of the shipped public models, and the hub's own figure when the hub
answers (a fake stands in for it: no network here)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import kvcore_hf
from kvcore.tools import zoo
from kvcore.tools.accelerators import find_accelerator
from kvcore_hf.mapping import load_hf_config, map_model_config
from kvcore_hf.weights import estimate_weights, hub_checkpoint_bytes

FIXTURES = Path(__file__).parent / "fixtures" / "hf"

#: Published figures of the public checkpoints: ``(value, unit, source)``.
#: ``bytes`` is the repository's safetensors total; ``params`` a parameter
#: count the model's publisher or the hub states (for bfloat16 checkpoints
#: the bytes are twice that).  The table in docs/capacity.md repeats them.
PUBLISHED: dict[str, tuple[int, str, str]] = {
    "llama-3-1-8b": (
        16_060_522_496,
        "bytes",
        "meta-llama/Llama-3.1-8B model.safetensors.index.json total_size "
        "(quoted in the transformers docs)",
    ),
    "gemma-3-27b": (
        27_400_000_000,
        "params",
        "google/gemma-3-27b-it: 27.4B on the hub; keras_hub gemma3_instruct_27b_text "
        "preset 27,009,002,240 for the language model alone",
    ),
    "gpt-oss-120b": (
        116_800_000_000,
        "params",
        "gpt-oss-120b & gpt-oss-20b model card: 116.8B total parameters",
    ),
    "jamba-1-5-mini": (
        51_600_000_000,
        "params",
        "ai21labs/AI21-Jamba-1.5-Mini on the hub: 51.6B (paper: 52B total)",
    ),
    "llama-4-scout-17b-16e": (
        109_000_000_000,
        "params",
        "meta-llama/Llama-4-Scout-17B-16E model card: 109B total",
    ),
    "qwen3-next-80b-a3b": (
        81_300_000_000,
        "params",
        "Qwen/Qwen3-Next-80B-A3B-Instruct on the hub: 81.3B (MTP layer included)",
    ),
    "deepseek-v3": (
        685_000_000_000,
        "params",
        "deepseek-ai/DeepSeek-V3 README: 685B on the hub (671B main + 14B MTP)",
    ),
    "deepseek-v3-2-exp": (
        685_000_000_000,
        "params",
        "deepseek-ai/DeepSeek-V3.2-Exp on the hub: 685B",
    ),
    "deepseek-v4-flash": (
        284_000_000_000,
        "params",
        "deepseek-ai/DeepSeek-V4-Flash: 284B total (the main model; MTP apart)",
    ),
}

#: The estimates, pinned: ``(bytes, parameters)``.
ESTIMATES: dict[str, tuple[int, int]] = {
    "deepseek-v3-2-exp": (688_439_768_128, 685_355_329_792),
    "deepseek-v3": (687_545_620_992, 684_489_845_504),
    "deepseek-v4-flash": (160_808_738_960, 292_003_547_848),
    "gemma-3-27b": (54_864_815_584, 27_432_407_792),
    "gpt-oss-120b": (65_275_357_824, 116_842_427_712),
    "jamba-1-5-mini": (103_140_646_656, 51_570_323_328),
    "llama-3-1-8b": (16_060_522_496, 8_030_261_248),
    "llama-4-scout-17b-16e": (217_421_993_472, 108_710_996_736),
    "qwen3-next-80b-a3b": (162_649_725_440, 81_324_862_720),
}


def estimate(stem: str) -> Any:
    found = estimate_weights(load_hf_config(FIXTURES / stem / "config.json"))
    assert found is not None
    return found


def test_every_shipped_model_is_in_the_table() -> None:
    assert sorted(PUBLISHED) == sorted(ESTIMATES) == zoo.names()


@pytest.mark.parametrize("stem", sorted(ESTIMATES))
def test_the_estimate_is_pinned(stem: str) -> None:
    found = estimate(stem)
    assert (found.bytes, found.params) == ESTIMATES[stem]
    assert sum(found.parts.values()) == found.bytes


def _main_model_params(stem: str) -> int:
    """Parameters without DeepSeek-V4's MTP layer, which its publisher
    counts apart (as DeepSeek-V3's 671B + 14B)."""
    found = estimate(stem)
    if stem != "deepseek-v4-flash":
        return int(found.params)
    config = load_hf_config(FIXTURES / stem / "config.json")
    data = dict(config.root)
    data["num_nextn_predict_layers"] = 0
    without = estimate_weights(load_hf_config_from(data))
    assert without is not None
    return int(without.params)


def load_hf_config_from(data: dict[str, Any]) -> Any:
    from kvcore_hf.mapping import ModelConfig

    return ModelConfig(data)


@pytest.mark.parametrize("stem", sorted(PUBLISHED))
def test_the_estimate_is_within_3_percent_of_the_published_size(stem: str) -> None:
    value, unit, _ = PUBLISHED[stem]
    found = estimate(stem)
    ours = found.bytes if unit == "bytes" else _main_model_params(stem)
    assert abs(ours - value) / value < 0.03, (stem, ours, value)


def test_llama_3_1_8b_is_exact_to_the_byte() -> None:
    assert estimate("llama-3-1-8b").bytes == PUBLISHED["llama-3-1-8b"][0]


def test_gemma_3_language_model_matches_keras_hubs_count() -> None:
    found = estimate("gemma-3-27b")
    vision = found.parts["vision"] // 2
    assert abs(found.params - vision - 27_009_002_240) < 27_009_002_240 * 0.001


@pytest.mark.parametrize("stem", sorted(ESTIMATES))
def test_every_shipped_model_file_carries_its_weights(stem: str) -> None:
    data = json.loads(zoo.path(stem).read_text())
    assert data["weights_bytes"] == ESTIMATES[stem][0]


#: Gemma-3-4B-it's text_config as published: no heads, head size or
#: vocabulary, which Gemma3TextConfig's defaults (8, 4, 256, 262,208) give.
GEMMA3_4B_TEXT = {
    "hidden_size": 2560,
    "intermediate_size": 10240,
    "model_type": "gemma3_text",
    "num_hidden_layers": 34,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 1024,
}


def test_shape_fields_a_gemma_file_leaves_out_take_the_class_defaults() -> None:
    root = json.loads((FIXTURES / "gemma-3-27b" / "config.json").read_text())
    short = estimate_weights(
        load_hf_config_from({**root, "text_config": GEMMA3_4B_TEXT})
    )
    spelled = {
        **GEMMA3_4B_TEXT,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "vocab_size": 262_208,
    }
    full = estimate_weights(load_hf_config_from({**root, "text_config": spelled}))
    assert short is not None
    assert full is not None
    assert short == full
    assert short.params == 4_300_080_624  # google/gemma-3-4b-it: 4.3B on the hub


def test_a_mapped_model_carries_the_estimate_and_says_so() -> None:
    model = map_model_config(load_hf_config(FIXTURES / "llama-3-1-8b" / "config.json"))
    assert model.weights_bytes == 16_060_522_496
    assert "weights estimated from the configuration: 8,030,261,248 parameters" in (
        model.notes
    )


# -- hybrids with no shipped model file ----------------------------------------

#: Falcon-H1 and Nemotron-H checkpoints kvcore maps but ships no model file
#: for.  Their fixtures hold the shape fields of the hub configs (Falcon-H1-7B
#: as copies of its config quote it; Nemotron-H's from the transformers
#: ``NemotronHConfig`` defaults, which are the 8B model, and Megatron-Bridge's
#: table of the 4B, 8B and Nano-9B-v2 shapes).  ``(value, unit, rounding,
#: source)``: the published figure is rounded, so the true one lies within
#: ``rounding`` of ``value``.
HYBRIDS: dict[str, tuple[int, str, int, str]] = {
    "falcon-h1-7b-instruct": (
        7_590_000_000,
        "params",
        5_000_000,
        "tiiuae/Falcon-H1-7B-Instruct on the hub: 7.59B",
    ),
    "nemotron-h-4b-base-8k": (
        8_970_000_000,
        "bytes",
        10_000_000,
        "nvidia/Nemotron-H-4B-Base-8K's two safetensors files: 4.99 GB + 3.98 GB",
    ),
    "nemotron-h-8b-base-8k": (
        8_000_000_000,
        "params",
        500_000_000,
        "nvidia/Nemotron-H-8B-Base-8K model card: 8B",
    ),
    "nvidia-nemotron-nano-9b-v2": (
        8_890_000_000,
        "params",
        5_000_000,
        "nvidia/NVIDIA-Nemotron-Nano-9B-v2 on the hub: 8.89B",
    ),
}

#: Their estimates, pinned: ``(bytes, parameters)``.
HYBRID_ESTIMATES: dict[str, tuple[int, int]] = {
    "falcon-h1-7b-instruct": (15_171_027_136, 7_585_513_568),
    "nemotron-h-4b-base-8k": (8_978_446_080, 4_489_223_040),
    "nemotron-h-8b-base-8k": (16_201_705_472, 8_100_852_736),
    "nvidia-nemotron-nano-9b-v2": (17_776_454_656, 8_888_227_328),
}


def test_the_hybrid_fixtures_are_not_shipped_files() -> None:
    assert sorted(HYBRIDS) == sorted(HYBRID_ESTIMATES)
    assert not set(HYBRIDS) & set(zoo.names())


@pytest.mark.parametrize("stem", sorted(HYBRID_ESTIMATES))
def test_the_hybrid_estimate_is_pinned(stem: str) -> None:
    found = estimate(stem)
    assert (found.bytes, found.params) == HYBRID_ESTIMATES[stem]
    assert sum(found.parts.values()) == found.bytes
    assert found.parts["mixer"] > 0  # the Mamba-2 mixers are counted


@pytest.mark.parametrize("stem", sorted(HYBRIDS))
def test_the_hybrid_estimate_is_within_the_published_rounding(stem: str) -> None:
    value, unit, rounding, _ = HYBRIDS[stem]
    found = estimate(stem)
    ours = found.bytes if unit == "bytes" else found.params
    assert abs(ours - value) <= rounding, (stem, ours, value)
    assert abs(ours - value) / value < 0.03


#: A one-layer Falcon-H1 small enough to size by hand.
TINY_FALCON_H1: dict[str, Any] = {
    "model_type": "falcon_h1",
    "hidden_size": 16,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "intermediate_size": 24,
    "num_hidden_layers": 1,
    "vocab_size": 100,
    "mamba_d_ssm": 32,
    "mamba_n_heads": 4,
    "mamba_d_head": 8,
    "mamba_n_groups": 1,
    "mamba_d_state": 4,
    "mamba_d_conv": 4,
    "torch_dtype": "bfloat16",
}


def params(data: dict[str, Any]) -> int:
    found = estimate_weights(load_hf_config_from(data))
    assert found is not None
    return int(found.params)


def test_falcon_h1_layers_hold_attention_a_mamba2_mixer_and_an_mlp() -> None:
    # Embeddings and the untied head 2 x 1,600, the final norm 16.  The
    # layer: q and o 16 x 16, k and v 8 x 16 (768); the Mamba-2 mixer's
    # in_proj (32 gate + 40 x, B, C + 4 dt) x 16 = 1,216, conv1d 40 x (4 + 1
    # bias), dt_bias, A_log and D 3 x 4, out_proj 16 x 32 (1,940); the gated
    # MLP 3 x 24 x 16 (1,152); two norms (32).
    assert params(TINY_FALCON_H1) == 3_216 + 768 + 1_940 + 1_152 + 32
    # mamba_rms_norm adds the gated norm's 32; a null mamba_d_ssm is
    # mamba_expand x hidden_size (2 x 16, the same width).
    assert params({**TINY_FALCON_H1, "mamba_rms_norm": True}) == 7_140
    assert params({**TINY_FALCON_H1, "mamba_d_ssm": None, "mamba_expand": 2}) == 7_108


#: A four-layer Nemotron-H, one layer of each letter: Mamba-2, attention,
#: MLP and experts.
TINY_NEMOTRON_H: dict[str, Any] = {
    "model_type": "nemotron_h",
    "hybrid_override_pattern": "M*-E",
    "hidden_size": 16,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "intermediate_size": 24,
    "num_hidden_layers": 4,
    "vocab_size": 100,
    "mamba_num_heads": 4,
    "mamba_head_dim": 8,
    "n_groups": 2,
    "ssm_state_size": 4,
    "conv_kernel": 4,
    "n_routed_experts": 4,
    "moe_intermediate_size": 6,
    "moe_shared_expert_intermediate_size": 12,
    "torch_dtype": "bfloat16",
}


def test_nemotron_h_blocks_hold_a_norm_and_the_mixer_their_letter_names() -> None:
    # Embeddings and head 2 x 1,600, the final norm 16; each block's norm 16.
    # M: in_proj (32 + 48 + 4) x 16 = 1,344, conv1d 48 x 5, 3 x 4, the
    # gated norm 32, out_proj 512 (2,140).  *: 768.  -: up and down
    # 24 x 16 (768, no gate).  E: 4 experts' up and down 2 x 6 x 16 (768),
    # the router 4 x 16 and its bias 4, the shared expert 2 x 12 x 16 (1,220).
    assert params(TINY_NEMOTRON_H) == 3_216 + 4 * 16 + 2_140 + 768 + 768 + 1_220
    # A latent projection narrows the experts to 8: fc1 and fc2 8 x 16, the
    # experts 2 x 4 x 6 x 8 (384 in all instead of 768).
    latent = {**TINY_NEMOTRON_H, "moe_latent_size": 8}
    assert params(latent) == params(TINY_NEMOTRON_H) - 768 + 256 + 384
    # layers_block_type spells the same pattern; the pattern sets the count.
    listed = {
        k: v for k, v in TINY_NEMOTRON_H.items() if k != "hybrid_override_pattern"
    }
    listed["layers_block_type"] = ["mamba", "attention", "mlp", "moe"]
    assert params({**listed, "num_hidden_layers": 9}) == params(TINY_NEMOTRON_H)


def test_nemotron_h_reads_the_older_attention_head_dim() -> None:
    older = {k: v for k, v in TINY_NEMOTRON_H.items() if k != "head_dim"}
    assert params({**older, "attention_head_dim": 8}) == params(TINY_NEMOTRON_H)


def test_a_nemotron_h_pattern_with_an_unknown_letter_has_no_estimate() -> None:
    bad = {**TINY_NEMOTRON_H, "hybrid_override_pattern": "M*X"}
    assert estimate_weights(load_hf_config_from(bad)) is None


# -- kvcore plan --gpu with the estimate ---------------------------------------


@pytest.mark.parametrize("stem", sorted(HYBRID_ESTIMATES))
def test_plan_on_a_gpu_sets_a_hybrids_estimate_aside(stem: str) -> None:
    from tests.test_cli import plan_json

    config = str(FIXTURES / stem / "config.json")
    doc = plan_json("--hf-config", config, "--gpu", "H100", "--context", "8K")
    memory = doc["settings"]["memory"]
    device = find_accelerator("H100").memory_bytes
    weights = HYBRID_ESTIMATES[stem][0]
    assert memory["weights_bytes"] == weights
    assert memory["weights_source"] == "estimated from config.json"
    assert memory["kv_cache_bytes"] == int(device * 0.9) - weights
    assert not any("no weights set aside" in note for note in doc["notes"])
    bare = plan_json(
        "--hf-config", config, "--gpu", "H100", "--weights", "0", "--context", "8K"
    )
    with_weights = doc["capacity"][0]["concurrency"]
    assert with_weights < bare["capacity"][0]["concurrency"]


#: A MiniMax-M1 config cut to eight layers: a family whose tensors the
#: estimate does not list.
MINIMAX_M1: dict[str, Any] = {
    "architectures": ["MiniMaxM1ForCausalLM"],
    "model_type": "minimax_m1",
    "hidden_size": 6144,
    "num_hidden_layers": 8,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "attn_type_list": [0] * 7 + [1],
    "torch_dtype": "bfloat16",
}


def test_plan_warns_when_a_family_has_no_estimate(tmp_path: Path) -> None:
    from tests.test_cli import plan_json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(MINIMAX_M1))
    doc = plan_json("--hf-config", str(path), "--gpu", "H100", "--context", "8K")
    assert doc["settings"]["memory"]["weights_bytes"] == 0
    assert doc["notes"][1].startswith("warning: no weights set aside: ")
    assert (
        "weights not estimated: no weight layout for model_type minimax_m1"
        in (doc["notes"])
    )


def test_the_reason_for_no_estimate_gives_way_to_the_hubs_figure() -> None:
    config = load_hf_config_from(MINIMAX_M1)
    model = map_model_config(config)
    assert model.weights_bytes is None
    assert "weights not estimated: no weight layout for model_type minimax_m1" in (
        model.notes
    )
    found = kvcore_hf.with_hub_weights(
        model,
        "org/model",
        config,
        fetch=lambda *a, **k: fake_metadata({"m.safetensors": [("BF16", 4_096)]}),
    )
    assert found.weights_bytes == 4_096
    assert "weights not estimated" not in found.notes
    # a known family missing a shape field the estimate needs says which
    short = {k: v for k, v in TINY_FALCON_H1.items() if k != "intermediate_size"}
    short.update(mamba_expand=2, architectures=["FalconH1ForCausalLM"])
    notes = map_model_config(load_hf_config_from(short)).notes
    assert "weights not estimated: field intermediate_size is missing" in notes


# -- quantization formats ------------------------------------------------------

#: A two-layer Llama small enough to size by hand: per layer q 256x256,
#: k and v 128x256, o 256x256, gate and up 512x256, down 256x512; an
#: untied 1000 x 256 head; 1,692,928 parameters (3,385,856 bytes in bf16).
TINY: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def tiny(quant: dict[str, Any] | None = None) -> int:
    data = dict(TINY) if quant is None else {**TINY, "quantization_config": quant}
    found = estimate_weights(load_hf_config_from(data))
    assert found is not None
    return int(found.bytes)


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128}


def test_unquantized_is_two_bytes_a_parameter() -> None:
    assert tiny() == 3_385_856


def test_awq_int4_counts_packed_values_group_scales_and_zeros() -> None:
    # q_proj 256x256: 32,768 bytes of values, 2 groups x 256 fp16 scales
    # (1,024) and 4-bit zeros (256) = 34,048; a layer 306,432; the head
    # 133,000; embeddings (512,000) and norms (2,560) stay bf16.
    assert tiny(AWQ) == 2 * 306_432 + 133_000 + 512_000 + 2_560


def test_gptq_adds_the_input_order_index() -> None:
    # g_idx: one int32 per input column: 2,048 a layer and 256 for the head.
    gptq = tiny({**AWQ, "quant_method": "gptq"})
    assert gptq - tiny(AWQ) == (2 * 2_048 + 256) * 4


def test_modules_to_not_convert_stay_unquantized() -> None:
    kept = tiny({**AWQ, "modules_to_not_convert": ["lm_head"]})
    assert kept - tiny(AWQ) == 512_000 - 133_000


def test_fp8_per_tensor_and_block_scales() -> None:
    # One fp32 scale a tensor, or one a 128 x 128 block (16 for q_proj,
    # 8 for the head's ceil(1000 / 128) x 2 blocks ... 64 bytes).
    assert tiny({"quant_method": "fp8"}) == 1_950_268
    assert tiny({"quant_method": "fp8", "weight_block_size": [128, 128]}) == 1_950_560


def test_compressed_tensors_w4a16_groups_match_awq() -> None:
    ct = tiny(
        {
            "quant_method": "compressed-tensors",
            "config_groups": {
                "group_0": {
                    "weights": {"num_bits": 4, "strategy": "group", "group_size": 128}
                }
            },
            "ignore": ["lm_head"],
        }
    )
    assert ct == tiny({**AWQ, "modules_to_not_convert": ["lm_head"]})


def test_a_float32_config_counts_as_served_in_bfloat16() -> None:
    assert (
        tiny()
        == estimate_weights(
            load_hf_config_from({**TINY, "torch_dtype": "float32"})
        ).bytes
    )  # type: ignore[union-attr]


def test_an_unknown_family_has_no_estimate() -> None:
    assert estimate_weights(load_hf_config_from({"model_type": "mamba"})) is None


# -- the hub's figure ----------------------------------------------------------


def fake_metadata(sizes: dict[str, list[tuple[str, int]]]) -> Any:
    files = {
        name: SimpleNamespace(
            tensors={
                f"t{i}": SimpleNamespace(dtype=dtype, data_offsets=(0, size))
                for i, (dtype, size) in enumerate(tensors)
            }
        )
        for name, tensors in sizes.items()
    }
    return SimpleNamespace(files_metadata=files)


def test_the_hubs_safetensors_headers_give_the_bytes() -> None:
    calls: list[tuple[str, Any]] = []

    def fetch(repo_id: str, *, revision: Any, timeout: float) -> Any:
        calls.append((repo_id, timeout))
        return fake_metadata(
            {
                "a.safetensors": [("BF16", 1000), ("F32", 400)],
                "b.safetensors": [("U8", 24)],
            }
        )

    assert hub_checkpoint_bytes("org/model", fetch=fetch) == 1424
    assert (
        hub_checkpoint_bytes("org/model", fetch=fetch, served_float32_halved=True)
        == 1224
    )
    assert calls[0] == ("org/model", 3.0)


def test_a_hub_that_fails_leaves_the_estimate() -> None:
    def fetch(repo_id: str, **_: Any) -> Any:
        raise OSError("no network")

    assert hub_checkpoint_bytes("org/model", fetch=fetch) is None
    assert hub_checkpoint_bytes("org/model", fetch=lambda *a, **k: object()) is None

    model = map_model_config(load_hf_config(FIXTURES / "llama-3-1-8b" / "config.json"))
    config = load_hf_config(FIXTURES / "llama-3-1-8b" / "config.json")
    same = kvcore_hf.with_hub_weights(model, "org/model", config, fetch=fetch)
    assert same.weights_bytes == 16_060_522_496


def test_a_hub_figure_replaces_the_estimate_in_the_model_file() -> None:
    config = load_hf_config(FIXTURES / "llama-3-1-8b" / "config.json")
    model = map_model_config(config)
    found = kvcore_hf.with_hub_weights(
        model,
        "meta-llama/Llama-3.1-8B",
        config,
        fetch=lambda *a, **k: fake_metadata({"m.safetensors": [("BF16", 123_456)]}),
    )
    assert found.weights_bytes == 123_456
    assert "weights 123,456 bytes from the hub's safetensors metadata" in found.notes
    assert "weights estimated" not in found.notes


def test_an_unreachable_hub_is_not_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    # A cached config.json with the hub down: one refused connection, and
    # the metadata call is never made.
    import huggingface_hub
    from huggingface_hub import constants

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", never)
    config = load_hf_config(FIXTURES / "llama-3-1-8b" / "config.json")
    model = map_model_config(config)
    assert kvcore_hf.with_hub_weights(model, "org/model", config) is model
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert kvcore_hf.with_hub_weights(model, "org/model", config) is model
