"""The physical limit is a bound: no plan holds more requests than it, in
any mode (prefix caching on or off, every state-cache mode, every kind,
both policies), and ``ratio`` means one thing everywhere."""

from __future__ import annotations

import math
from typing import Any

import pytest
from budgets import budget
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fuzz_planning import REGISTRY, cases, plan_case

import kvcore
from kvcore.serialize import load_model_file
from kvcore.tools import zoo


def _contexts(draw: st.DrawFn, limit: int | None) -> list[int]:
    top = limit or 70000
    # Contexts one past a block boundary are where a state kind that keeps
    # a checkpoint holds one block more than one that does not.
    near = [min(top, b * k + 1) for b in (16, 64, 256) for k in (1, 3, 64)]
    picks = draw(st.lists(st.integers(1, top), min_size=1, max_size=3))
    return sorted({*picks, *draw(st.lists(st.sampled_from(near), max_size=2))})


@st.composite
def bound_cases(draw: st.DrawFn) -> tuple[dict[str, Any], list[int]]:
    case = draw(cases(draw(st.sampled_from(kvcore.config.PACKING_POLICIES))))
    return case, _contexts(draw, case["max_model_len"])


def _check_bound(capacity: kvcore.Capacity, what: object) -> None:
    limit = capacity.ideal_concurrency
    assert capacity.concurrency <= math.floor(limit * (1 + 1e-12)), (what, capacity)
    assert capacity.unreserved_concurrency <= limit * (1 + 1e-12), (what, capacity)
    assert capacity.ratio == pytest.approx(
        capacity.unreserved_concurrency / limit if limit else 0.0
    )


@budget(quick=40, full=300)
def test_no_plan_holds_more_than_the_limit(examples: int) -> None:
    checked = 0

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=examples < 300 or settings.default.derandomize,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(bound_cases())
    def check(drawn: tuple[dict[str, Any], list[int]]) -> None:
        nonlocal checked
        case, contexts = drawn
        try:
            model, _, plan = plan_case(case)
        except kvcore.KvcoreError:
            return  # refusals are the fuzz test's business
        for context in contexts:
            try:
                capacity = kvcore.plan_capacity(plan, context, specs=model.layers)
            except kvcore.KvcoreError:
                continue
            _check_bound(capacity, (case, context))
            checked += 1

    check()
    assert checked >= examples // 2


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("policy", ["seed", "min_waste"])
@pytest.mark.parametrize("context", [4096, 4097, 4112, 4113, 32769])
def test_a_mamba_hybrid_one_past_a_block_stays_under_its_limit(
    prefix_caching: bool, policy: str, context: int
) -> None:
    # Caching off keeps one state a request; the limit once counted the
    # checkpoint a step across a block boundary writes in align mode, so at
    # T = 1 mod 16 it fell to 47.7 where the plan held 59.
    specs = load_model_file(zoo.path("qwen3-next-80b-a3b"), REGISTRY).layers
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout="BLHNC",
            packing_policy=policy,
            target_context=context,
            enable_prefix_caching=prefix_caching,
        )
    )
    memory = 8 * 2**30
    plan = kvcore.plan_kv_cache(config, specs, memory, registry=REGISTRY)
    capacity = kvcore.plan_capacity(plan, context, specs=specs, memory=memory)
    _check_bound(capacity, context)
    if policy == "min_waste" and not prefix_caching and context == 4097:
        assert capacity.concurrency == 59
        assert capacity.ideal_concurrency == pytest.approx(61.1058, abs=1e-4)


def test_the_limit_of_an_overridden_pool_counts_its_blocks() -> None:
    # A pool given more blocks than its memory holds is measured on the
    # bytes it has, or the limit would sit below what it holds.
    import torch

    from kvcore_full_attention import FullAttentionSpec

    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16
    )
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout="BLHNC", num_gpu_blocks_override=1000
        )
    )
    plan = kvcore.plan_kv_cache(config, {"a": spec}, 4096 * 10, registry=REGISTRY)
    capacity = kvcore.plan_capacity(plan, 16 * 10)
    assert capacity.concurrency == 99
    _check_bound(capacity, "override")
