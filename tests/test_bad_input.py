"""Bad input gets a kvcore error that names the problem, never a crash deep
inside, and is never silently misread."""

from __future__ import annotations

import pytest
import torch

import kvcore
from kvcore.serialize import load_config, make_converter
from kvcore_full_attention import FullAttentionSpec
from kvcore_mamba import MambaSpec


def fa(block_size: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16
    )


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (
            {
                "kind": "mamba",
                "block_size": 16,
                "shapes": [[8]],
                "dtypes": ["float32"],
                "tp_replicated": "false",
            },
            "expected bool",
        ),
        (
            {
                "kind": "sliding_window",
                "block_size": 16,
                "num_kv_heads": 1,
                "head_size": 8,
                "dtype": "float16",
                "sliding_window": 64,
                "bounded_replay": "false",
            },
            "expected bool",
        ),
        (
            {
                "kind": "mamba",
                "block_size": 16,
                "shapes": [[2.5]],
                "dtypes": ["float32"],
            },
            "expected int",
        ),
        (
            {
                "kind": "mla",
                "block_size": 4.0,
                "num_kv_heads": 1,
                "head_size": 8,
                "dtype": "uint8",
            },
            "expected int",
        ),
        ({"kind": ["mla"], "block_size": 4}, "'kind' of the spec .* must be a string"),
    ],
    ids=[
        "string-bool",
        "string-bool-window",
        "float-shape",
        "float-block",
        "list-kind",
    ],
)
def test_json_values_are_taken_strictly(data: dict[str, object], match: str) -> None:
    with pytest.raises(kvcore.SerializationError, match=match):
        make_converter().structure_spec(data)


def test_spec_booleans_must_be_bools() -> None:
    with pytest.raises(
        kvcore.InvalidSpecError, match="tp_replicated must be True or False"
    ):
        MambaSpec(
            block_size=4, shapes=((8,),), dtypes=(torch.float16,), tp_replicated="no"
        )  # type: ignore[arg-type]
    with pytest.raises(kvcore.InvalidSpecError, match="enable_prefix_caching"):
        kvcore.CacheConfig(enable_prefix_caching="no")  # type: ignore[arg-type]


def test_cache_config_names_are_checked() -> None:
    with pytest.raises(kvcore.KvcoreValueError) as info:
        kvcore.CacheConfig(packing_policy="tight")
    assert str(info.value) == (
        "CacheConfig.packing_policy must be one of min_waste, seed, got 'tight'"
    )
    with pytest.raises(kvcore.KvcoreValueError, match="got None"):
        kvcore.CacheConfig(packing_policy=None)  # type: ignore[arg-type]
    config = kvcore.CacheConfig(mamba_cache_mode=None)
    with pytest.raises(kvcore.KvcoreValueError) as info:
        config.mamba_cache_mode = "some"  # type: ignore[assignment]
    assert str(info.value) == (
        "CacheConfig.mamba_cache_mode must be one of none, align, all, got 'some'"
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"shapes": "ab", "dtypes": (torch.float16,)},
            "shapes must be a sequence of int shapes",
        ),
        (
            {"shapes": ((8,),), "dtypes": "float32"},
            "dtypes must be a sequence of torch dtypes",
        ),
    ],
    ids=["shapes-string", "dtypes-string"],
)
def test_mamba_shapes_and_dtypes_are_checked(
    kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(kvcore.InvalidSpecError, match=match):
        MambaSpec(block_size=4, **kwargs)  # type: ignore[arg-type]


def test_config_json_must_be_a_json_object() -> None:
    with pytest.raises(
        kvcore.SerializationError, match="the KV cache config is not valid JSON"
    ):
        load_config("[")
    with pytest.raises(
        kvcore.SerializationError, match="must be a JSON object, got list"
    ):
        load_config("[]")


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: kvcore.KVCacheGroupSpec([], fa()), kvcore.PlanError, "non-empty list"),
        (
            lambda: kvcore.KVCacheGroupSpec("ab", fa()),
            kvcore.PlanError,
            "non-empty list",
        ),  # type: ignore[arg-type]
        (
            lambda: kvcore.KVCacheGroupSpec(["a", "a"], fa()),
            kvcore.PlanError,
            r"\['a'\] more than once",
        ),
        (
            lambda: kvcore.KVCacheGroupSpec(["a"], "fa"),
            kvcore.KvcoreTypeError,
            "must be a KVCacheSpec",
        ),  # type: ignore[arg-type]
        (
            lambda: kvcore.KVCacheGroupSpec(
                ["a", "b"],
                kvcore.UniformTypeKVCacheSpecs(
                    block_size=4, kv_cache_specs={"a": fa(), "c": fa()}
                ),
            ),
            kvcore.PlanError,
            "name different layers",
        ),
        (
            lambda: kvcore.UniformTypeKVCacheSpecs(
                block_size=4, kv_cache_specs={"a": "fa"}
            ),  # type: ignore[dict-item]
            kvcore.InvalidSpecError,
            "not a KVCacheSpec",
        ),
        (
            lambda: kvcore.KVCacheConfig(
                num_blocks=0, kv_cache_tensors=[], kv_cache_groups=[]
            ),
            kvcore.PlanError,
            "num_blocks must be a positive int",
        ),
        (
            lambda: kvcore.KVCacheTensor(
                size=8, layers=[], layer_stride=1, block_stride=1
            ),
            kvcore.PlanError,
            "layers must be a non-empty list",
        ),
        (
            lambda: kvcore.KVCacheTensor(
                size=8, layers=["a"], layer_stride=1, block_stride=1, offset=-4
            ),
            kvcore.PlanError,
            "offset .* must be a non-negative int",
        ),
    ],
    ids=[
        "no-layers",
        "string-layers",
        "duplicate-layer",
        "not-a-spec",
        "members-mismatch",
        "member-not-spec",
        "zero-blocks",
        "tensor-no-layers",
        "negative-offset",
    ],
)
def test_plan_objects_validate_themselves(
    make: object, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        make()  # type: ignore[operator]


def test_specs_must_be_a_mapping() -> None:
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(kv_cache_layout="BLHNC")
    )
    with pytest.raises(
        kvcore.KvcoreTypeError, match="mapping of layer name to spec, got list"
    ):
        kvcore.get_kv_cache_groups(config, [fa()])  # type: ignore[arg-type]


def test_approximate_gcd_takes_positive_ints() -> None:
    with pytest.raises(kvcore.PlanError, match="positive values"):
        kvcore.approximate_gcd([3, "a"])  # type: ignore[list-item]


def test_pool_on_an_unknown_device_is_a_plan_error() -> None:
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(kv_cache_layout="BLHNC")
    )
    groups = kvcore.get_kv_cache_groups(config, {"a": fa()})
    plan = kvcore.get_kv_cache_config_from_groups(
        config, groups, 4 * fa().page_size_bytes
    )
    with pytest.raises(
        kvcore.PlanError, match=r"'no-such-device' is not a torch device"
    ):
        kvcore.KVCachePool(plan, "no-such-device")
    with pytest.raises(
        kvcore.PlanError, match="kernel_block_sizes must be positive ints"
    ):
        kvcore.KVCachePool(plan, "cpu", kernel_block_sizes=[0])


class _BadGrouping:
    def __init__(self, result: object = None, error: Exception | None = None) -> None:
        self.result, self.error = result, error

    @kvcore.hookimpl
    def kvcore_choose_grouping(self, config: object, specs: object) -> object:
        if self.error is not None:
            raise self.error
        return self.result


@pytest.mark.parametrize(
    ("plugin", "error", "match"),
    [
        (
            _BadGrouping(result=kvcore.KVCacheGroupSpec(["a"], fa())),
            kvcore.PlanError,
            "must return a list",
        ),
        (_BadGrouping(result=["a"]), kvcore.PlanError, "must return a list"),
        (
            _BadGrouping(result=[kvcore.KVCacheGroupSpec(["a"], fa(8))]),
            kvcore.PlanError,
            "does not match its layers",
        ),
        (
            _BadGrouping(error=ZeroDivisionError("boom")),
            kvcore.PluginError,
            "raised ZeroDivisionError: boom",
        ),
    ],
    ids=["single-group", "strings", "wrong-spec", "raises"],
)
def test_grouping_plugin_results_are_checked(
    plugin: object, error: type, match: str
) -> None:
    pm = kvcore.get_plugin_manager(load_entrypoints=False)
    pm.register(plugin, name="test-bad-grouping")
    registry = kvcore.KindRegistry.from_plugin_manager(pm)
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(kv_cache_layout="BLHNC")
    )
    with pytest.raises(error, match=match):
        kvcore.get_kv_cache_groups(config, {"a": fa()}, registry=registry)
