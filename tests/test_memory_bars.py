"""The memory picture's data: the device bar (weights, KV cache, headroom)
and one request's bytes by group and kind at each asked context; the
figure's drawing is covered by test_picture.py."""

from __future__ import annotations

import importlib.util
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import kvcore
from kvcore.errors import KvcoreValueError
from kvcore.serialize import load_model_file
from kvcore.tools import zoo
from kvcore.tools.memory_bars import device_bar, kind_totals, request_bars
from kvcore.tools.picture import save_plan_figure

GIB = 2**30


def plan_of(name: str, policy: str = "seed") -> kvcore.KVCacheConfig:
    registry = kvcore.default_registry()
    specs = load_model_file(zoo.path(name), registry).layers
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout="BLHNC", packing_policy=policy, target_context=131072
        ),
        max_model_len=131072,
    )
    return kvcore.plan_kv_cache(config, specs, 40 * GIB, registry=registry)


def test_the_device_bar_adds_up_to_the_device() -> None:
    bar = device_bar("H100 80GB", 80 * GIB, 15 * GIB, 57 * GIB)
    assert [(s.kind, s.bytes) for s in bar.segments] == [
        ("weights", 15 * GIB),
        ("kv_cache", 57 * GIB),
        ("headroom", 8 * GIB),
    ]
    assert bar.total == 80 * GIB


def test_a_device_bar_that_does_not_fit_is_refused() -> None:
    with pytest.raises(KvcoreValueError, match="exceed its"):
        device_bar("A10", 24 * GIB, 20 * GIB, 8 * GIB)


def test_gemma_3_at_128k_is_nearly_all_global_layers() -> None:
    # The block panel gives the 52 window layers 13 rows against the 10
    # global layers' 5; a 128k request's pages are 96% global layers'.
    plan = plan_of("gemma-3-27b")
    short, long = request_bars([kvcore.plan_capacity(plan, c) for c in (8192, 131072)])
    assert kind_totals(long) == {
        "full_attention": 10 * GIB,
        "padding": 3 * GIB,
        "sliding_window": 416 * 2**20,
    }
    pages = long.total - kind_totals(long)["padding"]
    assert kind_totals(long)["full_attention"] / pages > 0.96
    # The window layers' bytes stop growing past their window.
    assert kind_totals(short)["sliding_window"] == kind_totals(long)["sliding_window"]


@pytest.mark.parametrize("name", ["gemma-3-27b", "jamba-1-5-mini", "deepseek-v4-flash"])
def test_a_request_bar_is_its_blocks_at_the_stride(name: str) -> None:
    plan = plan_of(name, "min_waste")
    for capacity in (kvcore.plan_capacity(plan, c) for c in (4096, 65536)):
        (bar,) = request_bars([capacity])
        assert bar.total == capacity.bytes_per_request
        by_group = {s.group: s.bytes for s in bar.segments if s.group is not None}
        for group in capacity.groups:
            if group.blocks_per_request:
                assert by_group[group.group] == (
                    group.blocks_per_request * group.packed_bytes
                )
        assert bar.label == f"1 request, {capacity.context:,} tokens"


def test_jamba_groups_name_their_kind_and_layers() -> None:
    plan = plan_of("jamba-1-5-mini")
    (bar,) = request_bars([kvcore.plan_capacity(plan, 131072)])
    labels = [s.label for s in bar.segments]
    assert "group 28: full_attention (4 layers)" in labels
    assert kind_totals(bar)["full_attention"] == 2 * GIB
    assert kind_totals(bar)["mamba"] == 28 * 311_296


@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="kvcore[plot] not installed"
)
def test_the_figure_draws_a_bar_segment_per_part(tmp_path: Path) -> None:
    plan = plan_of("gemma-3-27b")
    asked = [kvcore.plan_capacity(plan, c) for c in (8192, 131072)]
    path = tmp_path / "plan.svg"
    device = device_bar("H100 80GB", 80 * GIB, 25 * GIB, 47 * GIB)
    save_plan_figure(plan, asked, path, title="t", device=device)
    ids = {e.get("id") for e in ET.parse(path).getroot().iter() if e.get("id")}
    assert {"memory:device:weights", "memory:device:kv_cache"} <= ids
    assert "memory:device:headroom" in ids
    # two request bars (rows 1 and 0), each with its five groups and padding
    for row in (0, 1):
        assert f"memory:{row}:padding" in ids
        assert {f"memory:{row}:group{g}" for g in range(5)} <= ids
