"""Specs, groups and whole configs round-trip through JSON with a ``kind`` tag."""

from __future__ import annotations

import json

import pytest
import torch

import kvcore
from kvcore.serialize import dump_config, load_config, load_model_file, make_converter
from kvcore_chunked_local import ChunkedLocalAttentionSpec
from kvcore_circular_buffer import CircularBufferSpec
from kvcore_cross_attention import CrossAttentionSpec
from kvcore_full_attention import FullAttentionSpec
from kvcore_hisparse import HiSparseHotSpec
from kvcore_mamba import MambaSpec
from kvcore_mla import MLAAttentionSpec
from kvcore_sliding_window import SlidingWindowMLASpec, SlidingWindowSpec

SPECS = {
    "full_attention": FullAttentionSpec(
        block_size=16,
        num_kv_heads=8,
        head_size=128,
        dtype=torch.bfloat16,
        block_stride_alignment=512,
    ),
    "mla": MLAAttentionSpec(
        block_size=256,
        num_kv_heads=1,
        head_size=584,
        dtype=torch.uint8,
        tokens_per_state=4,
        alignment=576,
    ),
    "sliding_window": SlidingWindowSpec(
        block_size=16,
        num_kv_heads=4,
        head_size=64,
        dtype=torch.float16,
        sliding_window=1024,
        bounded_replay=True,
    ),
    "sliding_window_mla": SlidingWindowMLASpec(
        block_size=64,
        num_kv_heads=1,
        head_size=584,
        dtype=torch.uint8,
        sliding_window=128,
        alignment=576,
    ),
    "mamba": MambaSpec(
        block_size=16,
        shapes=((3, 64), (8, 16, 16)),
        dtypes=(torch.bfloat16, torch.float32),
        tp_replicated=True,
        mamba_cache_mode="align",
    ),
    "circular_buffer": CircularBufferSpec(
        block_size=8,
        num_kv_heads=1,
        head_size=2048,
        head_size_v=0,
        dtype=torch.float32,
    ),
    "hisparse_hot": HiSparseHotSpec(
        block_size=16, page_size=5120, blocks_per_request=2
    ),
    "chunked_local_attention": ChunkedLocalAttentionSpec(
        block_size=16,
        num_kv_heads=8,
        head_size=128,
        dtype=torch.bfloat16,
        attention_chunk_size=8192,
    ),
    "cross_attention": CrossAttentionSpec(
        block_size=16,
        num_kv_heads=8,
        head_size=128,
        dtype=torch.bfloat16,
        max_encoder_tokens=1500,
    ),
}


def test_every_registered_kind_has_a_sample() -> None:
    assert set(SPECS) == set(kvcore.default_registry())


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_spec_round_trips_through_json(kind: str) -> None:
    converter = make_converter()
    spec = SPECS[kind]
    data = json.loads(json.dumps(converter.unstructure(spec)))
    assert data["kind"] == kind
    back = converter.structure_spec(data)
    assert back == spec
    assert type(back) is type(spec)
    assert back.page_size_bytes == spec.page_size_bytes


def test_defaults_are_left_out_and_dtypes_are_names() -> None:
    data = make_converter().unstructure(SPECS["mla"])
    # head_size_v defaults to 0 for MLA; block_stride_alignment to None.
    assert data == {
        "kind": "mla",
        "block_size": 256,
        "num_kv_heads": 1,
        "head_size": 584,
        "dtype": "uint8",
        "tokens_per_state": 4,
        "alignment": 576,
    }


def test_unknown_kind_lists_the_known_ones() -> None:
    with pytest.raises(kvcore.UnknownKindError) as info:
        make_converter().structure_spec({"kind": "paged_ssm", "block_size": 16})
    assert isinstance(info.value, KeyError)
    assert info.value.kind == "paged_ssm"
    for known in SPECS:
        assert known in str(info.value)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (
            {
                "kind": "mla",
                "block_size": 16,
                "num_kv_heads": 1,
                "head_size": 8,
                "dtype": "uint8",
                "window": 3,
            },
            r"unknown field\(s\) \['window'\]",
        ),
        (
            {
                "kind": "mla",
                "block_size": 16,
                "num_kv_heads": 1,
                "head_size": 8,
                "dtype": "bf17",
            },
            r"'bf17' is not a torch dtype name .* @ \$\.dtype",
        ),
        (
            {
                "kind": "mla",
                "block_size": 0,
                "num_kv_heads": 1,
                "head_size": 8,
                "dtype": "uint8",
            },
            "block_size must be positive",
        ),
        ({"kind": "mla", "block_size": 16}, "required field missing"),
        ({"block_size": 16}, "must be a JSON object with a 'kind' key"),
    ],
    ids=["unknown-field", "bad-dtype", "invalid-value", "missing-field", "no-kind"],
)
def test_bad_spec_json_is_a_clear_error(data: dict[str, object], match: str) -> None:
    with pytest.raises(kvcore.SerializationError, match=match) as info:
        make_converter().structure_spec(data)
    assert isinstance(info.value, ValueError)


def test_group_specs_round_trip() -> None:
    converter = make_converter()
    uniform = kvcore.UniformTypeKVCacheSpecs(
        block_size=256,
        kv_cache_specs={
            "a": SPECS["mla"],
            "b": MLAAttentionSpec(
                block_size=256,
                num_kv_heads=1,
                head_size=132,
                dtype=torch.uint8,
                tokens_per_state=4,
                alignment=576,
            ),
        },
    )
    for group in (
        kvcore.KVCacheGroupSpec(["a", "b"], uniform),
        kvcore.KVCacheGroupSpec(["m"], SPECS["mamba"]),
    ):
        data = json.loads(json.dumps(converter.unstructure(group)))
        assert converter.structure(data, kvcore.KVCacheGroupSpec) == group


def test_whole_config_round_trips_as_the_scheduler_ships_it() -> None:
    from deepseek_v4_hybrid import deepseek_v4_specs

    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(kv_cache_layout="BLNHC")
    )
    groups = kvcore.get_kv_cache_groups(config, deepseek_v4_specs(num_layers=6))
    plan = kvcore.get_kv_cache_config_from_groups(config, groups, 64 * 2**20)
    text = dump_config(plan)
    back = load_config(text)
    assert back == plan
    assert back.kv_cache_layout is kvcore.KVCacheLayout.BLNHC
    assert json.loads(text)["num_blocks"] == plan.num_blocks


def test_bad_config_json_is_a_clear_error() -> None:
    with pytest.raises(kvcore.SerializationError, match="KVCacheConfig"):
        load_config(json.dumps({"num_blocks": 3}))


def test_model_file_rejects_unknown_top_level_keys() -> None:
    with pytest.raises(
        kvcore.SerializationError, match=r"unknown top-level key\(s\) \['layer'\]"
    ):
        load_model_file({"name": "x", "layers": {}, "layer": {}})
    with pytest.raises(kvcore.SerializationError, match="lists no layers"):
        load_model_file({"name": "x", "layers": {}})


def test_model_mapping_ints_obey_the_json_digit_limit(
    builtin_registry: kvcore.KindRegistry,
) -> None:
    # Found by tests/test_fuzz_planning.py: a model given as a mapping took
    # sliding_window=2**70 (the JSON reader refuses integer literals over 20
    # digits), planned it, and dumped a config load_config then refused.
    def model(window: int) -> dict[str, object]:
        spec = {
            "kind": "sliding_window",
            "block_size": 16,
            "num_kv_heads": 1,
            "head_size": 64,
            "dtype": "bfloat16",
            "sliding_window": window,
        }
        return {"layers": {"swa": spec}}

    with pytest.raises(kvcore.SerializationError, match="more than 20 digits"):
        load_model_file(model(2**70), builtin_registry)
    # The largest value the JSON reader takes still plans and round-trips.
    specs = load_model_file(model(10**20 - 1), builtin_registry).layers
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(kv_cache_layout="BLHNC")
    )
    plan = kvcore.plan_kv_cache(config, specs, 2**20, registry=builtin_registry)
    text = dump_config(plan, builtin_registry)
    assert load_config(text, builtin_registry) == plan
