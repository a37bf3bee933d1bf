"""Fuzzed hostile plans: every mutation of a shipped plan, a worker config
or a rank's record is either refused with a kvcore error or accepted as a
plan that binds with no two live pages on one byte.

The mutations are what a corrupted file, an old or new kvcore, or a lying
rank produce: a field replaced by a value of another type or an absurd
size, a key dropped, a key added, a list entry duplicated.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcore
from kvcore.errors import KvcoreError
from kvcore.integrations.distributed import checked_records, load_pipeline_plan
from kvcore.integrations.stages import plan_pipeline_stages
from kvcore.plan.validate import check_disjoint
from kvcore.registry import KindRegistry
from kvcore.serialize import dump_config, load_config
from kvcore_full_attention import FullAttentionSpec
from kvcore_sliding_window import SlidingWindowSpec

REGISTRY = KindRegistry.from_plugin_manager(
    kvcore.get_plugin_manager(load_entrypoints=False)
)


def _plan(layout: str) -> kvcore.KVCacheConfig:
    full = FullAttentionSpec(
        block_size=4, num_kv_heads=2, head_size=4, dtype=torch.float16
    )
    window = SlidingWindowSpec(
        block_size=4,
        num_kv_heads=2,
        head_size=4,
        dtype=torch.float16,
        sliding_window=8,
    )
    specs = {"f.0": full, "f.1": full, "w.0": window, "w.1": window, "w.2": window}
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(kv_cache_layout=layout, max_block_growth=1)
    )
    return kvcore.plan_kv_cache(config, specs, 16 * 1024, registry=REGISTRY)


LAYOUTS = [layout.name for layout in kvcore.KVCacheLayout]
PLANS = {name: json.loads(dump_config(_plan(name), REGISTRY)) for name in LAYOUTS}

HOSTILE_VALUES = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 2, 3, 7, 8, 16, 2**31, 2**63, 2**64]),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.lists(st.integers(-4, 64), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON tree a mutation can hit."""
    found = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            found.extend(_paths(value, (*prefix, key)))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found.extend(_paths(value, (*prefix, i)))
    return found


@st.composite
def _mutated(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any]:
    data = json.loads(json.dumps(base))
    paths = [p for p in _paths(data) if p]
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths))
        parent: Any = data
        try:
            for step in path[:-1]:
                parent = parent[step]
            last = path[-1]
            action = draw(st.sampled_from(["replace", "drop", "add", "duplicate"]))
            if action == "replace":
                parent[last] = draw(HOSTILE_VALUES)
            elif action == "drop" and isinstance(parent, dict):
                del parent[last]
            elif action == "add" and isinstance(parent, dict):
                parent[draw(st.text(min_size=1, max_size=6))] = draw(HOSTILE_VALUES)
            elif action == "duplicate" and isinstance(parent, list):
                parent.append(json.loads(json.dumps(parent[last])))
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed the path
    return data


def _accepted_is_safe(config: kvcore.KVCacheConfig, layout: str = "BLHNC") -> None:
    """What load_config accepts must prove disjoint and bind (in its own
    layout, or the one it was made for when the mutation dropped it)."""
    bound = config.kv_cache_layout or kvcore.KVCacheLayout[layout]
    check_disjoint(config, bound)
    try:
        kvcore.KVCachePool(config, "cpu", bound, registry=REGISTRY)
    except KvcoreError:
        return  # refused at binding: still a clean refusal


def _try(load: Any, text: str) -> Any:
    try:
        return load(text)
    except KvcoreError:
        return None


def _run(check: Any, examples: int) -> None:
    """Run ``check(data)`` as a hypothesis property of ``examples`` draws."""
    settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )(given(data=st.data())(check))()


def _worker_config(layout: str) -> Any:
    def check(data: st.DataObject) -> None:
        mutated = data.draw(_mutated(PLANS[layout]))
        config = _try(lambda t: load_config(t, REGISTRY), json.dumps(mutated))
        if config is not None:
            _accepted_is_safe(config, layout)

    return check


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_mutated_worker_config_is_refused_or_safe(layout: str) -> None:
    _run(_worker_config(layout), 40)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_mutated_worker_config_is_refused_or_safe_long_run(layout: str) -> None:
    _run(_worker_config(layout), 500)


def _pipeline() -> dict[str, Any]:
    from kvcore.integrations.distributed import dump_pipeline_plan

    full = FullAttentionSpec(
        block_size=4, num_kv_heads=2, head_size=4, dtype=torch.float16
    )
    specs = {f"model.layers.{i}.attn": full for i in range(4)}
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(kv_cache_layout="BLHNC"),
        parallel_config=kvcore.ParallelConfig(pipeline_parallel_size=2),
    )
    plans = plan_pipeline_stages(config, specs, 16 * 1024, registry=REGISTRY)
    return dict(json.loads(dump_pipeline_plan(plans, REGISTRY)))


PIPELINE = _pipeline()


def _shipped_plan(data: st.DataObject) -> None:
    mutated = data.draw(_mutated(PIPELINE))
    shipped = _try(lambda t: load_pipeline_plan(t, REGISTRY), json.dumps(mutated))
    if shipped is not None:
        for stage in shipped.stages:
            _accepted_is_safe(stage)


def _rank_record(data: st.DataObject) -> None:
    from kvcore.integrations.distributed import plan_fingerprint
    from kvcore.serialize import make_converter

    plan = _plan("BLHNC")
    record = {
        "stage": 0,
        "num_blocks": plan.num_blocks,
        "fingerprint": plan_fingerprint(plan, REGISTRY),
        "config": make_converter(REGISTRY).unstructure(plan),
    }
    mutated = data.draw(_mutated(record))
    try:
        (checked,) = checked_records([json.dumps(mutated).encode()], REGISTRY)
    except KvcoreError:
        return
    # Accepted only when the fingerprint is the plan's own, recomputed here.
    assert checked["fingerprint"] == plan_fingerprint(checked["plan"], REGISTRY)
    _accepted_is_safe(checked["plan"])


def test_a_mutated_shipped_plan_is_refused_or_safe() -> None:
    _run(_shipped_plan, 100)


def test_a_mutated_rank_record_is_refused_or_recomputed() -> None:
    _run(_rank_record, 60)


@pytest.mark.slow
def test_mutated_shipped_plans_and_records_long_run() -> None:
    _run(_shipped_plan, 1000)
    _run(_rank_record, 500)
