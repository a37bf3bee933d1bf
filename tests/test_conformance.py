"""kvcore's conformance suite (``kvcore.testing.pytest_plugin``) over every
built-in kind and the example third-party kind, and the broken-kind zoo
caught by it."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from broken_kinds import (
    BinderKind,
    BinderSpec,
    HalfPageKind,
    LenientMergeKind,
    LenientMergeSpec,
    SeededKeyKind,
    SeededKeySpec,
    UncheckedKind,
    UncheckedSpec,
    plugin_with,
    registry_with,
    sample,
)

import kvcore
from kvcore import KindRegistry
from kvcore.errors import PluginBindError
from kvcore.testing.conformance import ConformanceCase, KindConformance
from kvcore_circular_buffer import CircularBufferSpec
from kvcore_full_attention import FullAttentionSpec
from kvcore_hisparse import HiSparseHotSpec
from kvcore_mamba import MambaSpec
from kvcore_mla import MLAAttentionSpec
from kvcore_sliding_window import SlidingWindowMLASpec, SlidingWindowSpec

pytest_plugins = ["kvcore.testing.pytest_plugin"]

THIRD_PARTY = Path(__file__).resolve().parent.parent / "examples" / "third_party_plugin"


def _example_plugin() -> object:
    sys.path.insert(0, str(THIRD_PARTY))
    try:
        return importlib.import_module("kvcore_chunked_local")
    finally:
        sys.path.remove(str(THIRD_PARTY))


def _registry() -> KindRegistry:
    """Built-in kinds and the example kind, registered explicitly."""
    plugin = _example_plugin()
    pm = kvcore.get_plugin_manager(load_entrypoints=False)
    if pm.get_plugin("chunked_local_attention") is None:
        pm.register(plugin, name="chunked_local_attention")
    return KindRegistry.from_plugin_manager(pm, override=())


REGISTRY = _registry()
CHUNKED = REGISTRY["chunked_local_attention"].spec_type


class TestBuiltinAndExampleKinds(KindConformance):
    registry = REGISTRY
    samples: ClassVar = {
        "full_attention": FullAttentionSpec(
            block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16
        ),
        "mla": MLAAttentionSpec(
            block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16
        ),
        "sliding_window": [
            SlidingWindowSpec(
                block_size=16,
                num_kv_heads=2,
                head_size=64,
                dtype=torch.float16,
                sliding_window=64,
            ),
            SlidingWindowSpec(
                block_size=16,
                num_kv_heads=4,
                head_size=32,
                dtype=torch.bfloat16,
                sliding_window=40,
                extra_retained_tokens=8,
                alignment=4096,
            ),
        ],
        "sliding_window_mla": SlidingWindowMLASpec(
            block_size=64,
            num_kv_heads=1,
            head_size=584,
            dtype=torch.uint8,
            sliding_window=128,
            alignment=576,
        ),
        "mamba": [
            MambaSpec(block_size=16, shapes=((32,),), dtypes=(torch.bfloat16,)),
            MambaSpec(
                block_size=16,
                shapes=((3, 64), (8, 16, 4)),
                dtypes=(torch.float32, torch.bfloat16),
                mamba_cache_mode="align",
            ),
        ],
        "circular_buffer": CircularBufferSpec(
            block_size=4,
            num_kv_heads=1,
            head_size=8,
            head_size_v=0,
            dtype=torch.bfloat16,
        ),
        "hisparse_hot": HiSparseHotSpec(
            block_size=16, page_size=5120, blocks_per_request=2
        ),
        "chunked_local_attention": CHUNKED(
            block_size=16,
            num_kv_heads=2,
            head_size=64,
            dtype=torch.bfloat16,
            attention_chunk_size=64,
        ),
    }


def test_every_registered_kind_is_under_test() -> None:
    cases = TestBuiltinAndExampleKinds.conformance_cases()
    assert {c.name for c in cases} == set(REGISTRY)
    assert all(c.spec is not None for c in cases)
    assert len(cases) == 10


# ---------------------------------------------------------------------------
# The suite catches broken kinds, each with its message
# ---------------------------------------------------------------------------


def _suite_for(kind: Any, spec: Any) -> tuple[KindConformance, ConformanceCase]:
    registry = registry_with(plugin_with(kind), "broken")

    class Suite(KindConformance):
        pass

    Suite.registry = registry
    Suite.samples = {kind.name: spec}
    Suite.kinds = [kind.name]
    [case] = Suite.conformance_cases()
    return Suite(), case


def test_suite_catches_a_binder_that_addresses_half_its_page() -> None:
    suite, case = _suite_for(HalfPageKind(), sample(BinderSpec))
    with pytest.raises(AssertionError) as info:
        suite.test_page_size_is_what_the_binder_addresses(case)
    assert str(info.value) == (
        "writing one block through the views changes 256 bytes, but the page is "
        "512 bytes (page_grid (1, 16, 32)); page_size_bytes must be what the "
        "binder addresses"
    )


def test_suite_catches_a_grouping_key_that_follows_the_hash_seed() -> None:
    suite, case = _suite_for(SeededKeyKind(), sample(SeededKeySpec))
    with pytest.raises(AssertionError, match=r"in a process with PYTHONHASHSEED="):
        suite.test_group_key_stable_across_processes(case)


def test_suite_catches_a_merge_of_unequal_specs() -> None:
    suite, case = _suite_for(LenientMergeKind(), sample(LenientMergeSpec))
    with pytest.raises(AssertionError) as info:
        suite.test_merging_unequal_specs_raises(case)
    assert str(info.value).startswith("merge() of two unequal specs returned ")
    assert str(info.value).endswith("; it must raise kvcore.MergeError")


def test_suite_catches_evolve_without_validation() -> None:
    suite, case = _suite_for(UncheckedKind(), sample(UncheckedSpec))
    with pytest.raises(AssertionError) as info:
        suite.test_evolve_revalidates(case)
    assert str(info.value) == (
        "attrs.evolve(spec, block_size=0) must raise InvalidSpecError"
    )


def test_suite_catches_an_escaping_binder() -> None:
    suite, case = _suite_for(BinderKind("wide"), sample(BinderSpec))
    with pytest.raises(PluginBindError, match="reaches bytes outside"):
        suite.test_views_inside_region_sharing_storage(case)


def test_suite_reports_a_kind_without_a_sample() -> None:
    class Suite(KindConformance):
        registry = REGISTRY
        samples: ClassVar = {}
        kinds: ClassVar = ["mamba"]

    [case] = Suite.conformance_cases()
    with pytest.raises(AssertionError) as info:
        Suite().test_json_round_trip(case)
    assert str(info.value) == (
        "kind 'mamba' is in the registry under test but the suite has no sample "
        "spec for it; add one to samples"
    )
