"""kvcore's conformance suite (``kvcore.testing.pytest_plugin``) over every
built-in kind and the example third-party kind (loaded through its entry
point, as an installed plugin is), and the broken-kind zoo caught by it."""

from __future__ import annotations

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
from coordinator_setup import BUILT_IN
from example_plugin import example_registry

from kvcore.errors import PluginBindError
from kvcore.testing import check_kind
from kvcore.testing.conformance import ConformanceCase, KindConformance
from kvcore_chunked_local import ChunkedLocalAttentionSpec
from kvcore_circular_buffer import CircularBufferSpec
from kvcore_cross_attention import CrossAttentionSpec
from kvcore_full_attention import FullAttentionSpec
from kvcore_hisparse import HiSparseHotSpec
from kvcore_mamba import MambaSpec
from kvcore_mla import MLAAttentionSpec
from kvcore_sliding_window import SlidingWindowMLASpec, SlidingWindowSpec

pytest_plugins = ["kvcore.testing.pytest_plugin"]

#: Built-in kinds and the example third-party kind, loaded through its
#: entry point as an installed distribution's would be.
REGISTRY = example_registry()
SINKS = REGISTRY["attention_sinks"].spec_type


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
        "chunked_local_attention": ChunkedLocalAttentionSpec(
            block_size=16,
            num_kv_heads=2,
            head_size=64,
            dtype=torch.bfloat16,
            attention_chunk_size=64,
        ),
        "cross_attention": CrossAttentionSpec(
            block_size=16,
            num_kv_heads=2,
            head_size=64,
            dtype=torch.bfloat16,
            max_encoder_tokens=1500,
        ),
        "attention_sinks": [
            SINKS(
                block_size=16,
                num_kv_heads=2,
                head_size=64,
                dtype=torch.bfloat16,
                sink_tokens=4,
                window=64,
            ),
            SINKS(
                block_size=4,
                num_kv_heads=1,
                head_size=8,
                dtype=torch.float16,
                sink_tokens=6,
                window=10,
            ),
        ],
    }


def test_every_registered_kind_is_under_test() -> None:
    cases = TestBuiltinAndExampleKinds.conformance_cases()
    assert {c.name for c in cases} == set(REGISTRY)
    assert all(c.spec is not None for c in cases)
    assert len(cases) == 13


def test_the_example_comes_from_its_distribution_beside_every_builtin() -> None:
    # Installing the example beside kvcore collides with no built-in kind:
    # every built-in kind keeps its plugin, and the example's kind is its
    # entry point's.
    assert REGISTRY.owner("attention_sinks") == "attention_sinks"
    assert REGISTRY.owner("chunked_local_attention") == "chunked_local"
    assert set(REGISTRY) == set(BUILT_IN) | {"attention_sinks"}
    assert REGISTRY.overridden == {}
    assert SINKS.__module__ == "kvcore_attention_sinks"


@pytest.mark.parametrize(
    ("block", "sinks", "window"),
    [(16, 4, 64), (4, 6, 10), (16, 40, 100), (1, 1, 1), (16, 4, 8192)],
)
def test_the_example_kind_passes_check_kind(
    block: int, sinks: int, window: int
) -> None:
    # The whole cycle: prefill in uneven steps, decode, a prefix hit where
    # the kind declares one, preemption, re-admission and free, the blocks
    # held compared with num_blocks_held after every step.
    spec = SINKS(
        block_size=block,
        num_kv_heads=2,
        head_size=8,
        dtype=torch.bfloat16,
        sink_tokens=sinks,
        window=window,
    )
    check_kind(REGISTRY["attention_sinks"], spec, registry=REGISTRY)


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
