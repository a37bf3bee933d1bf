"""min_waste never holds fewer requests than seed, past the group cap too,
and its search works on counts (one-page buckets offer O(sqrt N) cuts)."""

from __future__ import annotations

import pytest
import torch
from budgets import budget
from coordinator_setup import builtin_registry
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import kvcore
from kvcore.spec import cdiv
from kvcore_full_attention import FullAttentionSpec
from kvcore_mamba import MambaSpec
from kvcore_mla import MLAAttentionSpec
from kvcore_sliding_window import SlidingWindowSpec

REGISTRY = builtin_registry()


def _full(heads: int = 8) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=16, num_kv_heads=heads, head_size=128, dtype=torch.bfloat16
    )


def _window(window: int, heads: int = 8) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=16,
        num_kv_heads=heads,
        head_size=128,
        dtype=torch.bfloat16,
        sliding_window=window,
    )


def _capacities(
    specs: dict[str, kvcore.KVCacheSpec],
    context: int,
    memory: int,
    *,
    cap: int = 64,
    prefix_caching: bool = False,
) -> dict[str, tuple[kvcore.Capacity, int]]:
    out = {}
    for policy in ("seed", "min_waste"):
        config = kvcore.EngineConfig(
            cache_config=kvcore.CacheConfig(
                kv_cache_layout="BLHNC",
                packing_policy=policy,
                target_context=context,
                max_kv_cache_groups=cap,
                enable_prefix_caching=prefix_caching,
            )
        )
        plan = kvcore.plan_kv_cache(config, specs, memory, registry=REGISTRY)
        capacity = kvcore.plan_capacity(plan, context, specs=specs, memory=memory)
        out[policy] = (capacity, len(plan.kv_cache_groups))
    return out


@pytest.mark.parametrize(
    ("windows", "full", "requests", "groups"),
    [
        # min_waste planned 89 requests in 101 groups here (seed: 96 in 110):
        # one group a bucket forced the 10 full layers into one group.
        (100, 10, 96, 110),
        # 45 against seed's 51 (65 groups against 127).
        (64, 63, 51, 127),
    ],
)
def test_past_the_cap_min_waste_holds_what_seed_holds(
    windows: int, full: int, requests: int, groups: int
) -> None:
    specs: dict[str, kvcore.KVCacheSpec] = {
        f"w{i}": _window(512 + 16 * i) for i in range(windows)
    }
    specs |= {f"f{i}": _full() for i in range(full)}
    got = _capacities(specs, 4096, 64 * 2**30)
    seed, best = got["seed"], got["min_waste"]
    assert seed[1] == groups
    assert seed[0].concurrency == requests
    # The cap rises to seed's group count: seed's plan is within reach.
    assert best[0].concurrency >= requests
    assert best[1] <= groups


@st.composite
def layer_mixes(draw: st.DrawFn) -> dict[str, kvcore.KVCacheSpec]:
    """Window buckets (distinct windows, each repeated), full layers, and
    sometimes a latent or state bucket: often more buckets than the cap."""
    heads = draw(st.sampled_from([1, 2, 8]))
    specs: dict[str, kvcore.KVCacheSpec] = {}
    windows = draw(st.lists(st.integers(1, 300), min_size=0, max_size=40, unique=True))
    for w in windows:
        for r in range(draw(st.integers(1, 4))):
            specs[f"w{w}.{r}"] = _window(16 * w, heads)
    for i in range(draw(st.integers(0 if windows else 1, 40))):
        specs[f"f{i}"] = _full(heads)
    kind = draw(st.sampled_from(["none", "mla", "state"]))
    for i in range(draw(st.integers(1, 6)) if kind != "none" else 0):
        if kind == "mla":
            specs[f"m{i}"] = MLAAttentionSpec(
                block_size=16, num_kv_heads=1, head_size=576, dtype=torch.uint8
            )
        else:
            specs[f"s{i}"] = MambaSpec(
                block_size=16, shapes=((heads * 4096,),), dtypes=(torch.bfloat16,)
            )
    return specs


def _narrow_window_and_full_layers() -> dict[str, kvcore.KVCacheSpec]:
    """One window layer and nine full layers of one narrow head: ``seed``'s
    ten groups and ``min_waste``'s two hold equal bytes per request."""
    specs: dict[str, kvcore.KVCacheSpec] = {"w62.0": _window(992, heads=1)}
    return specs | {f"f{i}": _full(heads=1) for i in range(9)}


def _rounding_allowance(seed: kvcore.Capacity, best: kvcore.Capacity) -> int:
    """The requests whole strides can cost ``best`` against ``seed`` at one
    memory, when ``best`` needs no more bytes per request.

    With ``U = floor(M / S) - 1`` usable blocks, a plan holds
    ``c = 1 + floor((U - P) / n)`` requests (0 if ``P > U``), so
    ``(M - S(1 + P)) / R < c <= 1 + (M - S(1 + P)) / R`` for stride ``S``,
    prefill peak ``P`` and ``R = S * n`` bytes a request.  With
    ``R_best <= R_seed``, ``c_seed - c_best < 1 + X`` where
    ``X = (S_best(1 + P_best) - S_seed(1 + P_seed)) / R_seed``: the null block
    and the prefill peak, paid in the wider stride.
    """
    wide = best.bytes_per_block * (1 + best.prefill_peak_blocks)
    narrow = seed.bytes_per_block * (1 + seed.prefill_peak_blocks)
    return max(0, -((narrow - wide) // seed.bytes_per_request))


def test_a_tie_per_byte_can_cost_what_a_wider_stride_rounds_away() -> None:
    # At 2**28 bytes: seed's 32,768 blocks of 8,192 B, 630 a request, hold
    # 1 + (32,767 - 630) // 630 = 52; min_waste's two groups (3,640 blocks of
    # 73,728 B, 70 a request: the same bytes) hold 1 + (3,639 - 70) // 70 =
    # 51, as the null block and the remainder cost a stride nine times wider.
    # The grouping does not depend on the memory (ranks of one engine with
    # different free memory must plan the same groups), so it stays.
    specs = _narrow_window_and_full_layers()
    got = _capacities(specs, 1000, 2**28, cap=2)
    (seed, seed_groups), (best, best_groups) = got["seed"], got["min_waste"]
    assert (seed.concurrency, seed_groups) == (52, 10)
    assert (best.concurrency, best_groups) == (51, 2)
    assert best.bytes_per_request == seed.bytes_per_request == 5_160_960
    assert _rounding_allowance(seed, best) == 1
    ample = _capacities(specs, 1000, 2**34, cap=2)
    assert ample["min_waste"][1] == 2
    assert ample["min_waste"][0].concurrency == ample["seed"][0].concurrency


@budget(quick=25, full=150)
def test_min_waste_is_never_below_seed_per_byte(examples: int) -> None:
    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=examples < 150 or settings.default.derandomize,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @example(_narrow_window_and_full_layers(), 1000, 2, False, 28)
    @given(
        layer_mixes(),
        st.sampled_from([1000, 4096, 4097, 32768]),
        st.sampled_from([2, 8, 64]),
        st.booleans(),
        st.integers(28, 36),
    )
    def check(
        specs: dict[str, kvcore.KVCacheSpec],
        context: int,
        cap: int,
        prefix_caching: bool,
        exponent: int,
    ) -> None:
        memory = 2**exponent
        try:
            got = _capacities(
                specs, context, memory, cap=cap, prefix_caching=prefix_caching
            )
        except kvcore.PlanError:
            return  # too little memory for one request: both refuse
        (seed, seed_groups), (best, best_groups) = got["seed"], got["min_waste"]
        assert best.bytes_per_request <= seed.bytes_per_request
        assert best.unreserved_concurrency >= seed.unreserved_concurrency
        # Per byte never below seed; at one memory, only what the wider
        # stride's null block and prefill peak round away.
        allowance = _rounding_allowance(seed, best)
        assert best.concurrency >= seed.concurrency - allowance
        assert best_groups <= max(cap, seed_groups)

    check()


@pytest.mark.parametrize("total", [1, 2, 3, 4, 7, 64, 100, 1000, 2000, 4097])
def test_one_page_buckets_offer_every_cut_that_changes_the_widest(total: int) -> None:
    from kvcore.plan.policies.stride_search import _divisor_counts

    counts = _divisor_counts(total)
    # Every fewest group count for a largest group of q layers is offered,
    # and O(sqrt N) counts in all.
    assert {cdiv(total, q) for q in range(1, total + 1)} <= set(counts)
    assert len(counts) <= 2 * (total**0.5 + 2)
    assert max(counts) <= total
