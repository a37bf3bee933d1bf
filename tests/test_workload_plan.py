"""Planning for a workload: length mixes, capacity under a mix, and
min_waste planning for one (CacheConfig.target_lengths, --context MIX)."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from functools import cache
from pathlib import Path
from statistics import NormalDist

import jsonschema
import pytest
import torch
from coordinator_setup import builtin_registry

import kvcore
from kvcore.errors import KvcoreTypeError, KvcoreValueError, PlanError
from kvcore.length_mix import LengthMix, LengthMixError
from kvcore.serialize import load_model_file
from kvcore.tools import zoo
from kvcore.tools.cli import main
from kvcore.tools.cli.document import load_schema
from kvcore.tools.length_mixes import (
    QUANTILE_POINTS,
    LengthMixSyntaxError,
    fixed_lengths,
    parse_length_mix,
)
from kvcore_full_attention import FullAttentionSpec
from kvcore_sliding_window import SlidingWindowSpec

REGISTRY = builtin_registry()
GiB = 2**30


def _full(block_size: int = 16) -> FullAttentionSpec:
    # 16 tokens x (64 + 64) x 2 bytes = 4096 bytes a page
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.bfloat16
    )


def _plan(specs, memory, *, context=None, mix=None, max_model_len=None):
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout="BLHNC", target_context=context, target_lengths=mix
        ),
        max_model_len=max_model_len,
    )
    return kvcore.plan_kv_cache(config, specs, memory, registry=REGISTRY)


# -- LengthMix ---------------------------------------------------------------------


def test_a_mix_merges_equal_lengths_and_sorts_them():
    mix = LengthMix.of([(1000, 1), (100, 2), (1000, 3)])
    assert mix.lengths == (100, 1000)
    assert mix.weights == (2, 4)
    assert mix.total_weight == 6
    assert mix.longest == 1000
    assert mix.mean == Fraction(100 * 2 + 1000 * 4, 6)
    assert mix.expected([3, 9]) == Fraction(3 * 2 + 9 * 4, 6)


@pytest.mark.parametrize(
    ("lengths", "weights", "error"),
    [
        ((), (), LengthMixError),
        ((100, 100), (1, 1), LengthMixError),
        ((200, 100), (1, 1), LengthMixError),
        ((100,), (0,), LengthMixError),
        ((100,), (1, 2), LengthMixError),
        ((0,), (1,), KvcoreValueError),
        ((True,), (1,), KvcoreTypeError),
        ([100], [1], KvcoreTypeError),
    ],
)
def test_a_bad_mix_is_refused_by_name(lengths, weights, error):
    with pytest.raises(error, match="LengthMix"):
        LengthMix(lengths, weights)


def test_many_distinct_lengths_are_summarized_by_quantiles():
    mix = LengthMix.of_lengths(range(1, 10001), points=100)
    assert len(mix) == 100
    assert set(mix.weights) == {1}
    # the (i + 1/2) / 100 quantiles of 1..10000
    assert mix.lengths[0] == 51
    assert mix.lengths[-1] == 9951
    few = LengthMix.of_lengths([5, 5, 7])
    assert (few.lengths, few.weights) == ((5, 7), (2, 1))


# -- capacity under a mix ------------------------------------------------------------


def test_capacity_under_a_mix_by_hand():
    # Full attention, 16-token blocks of 4096 bytes.  Requests of 100 tokens
    # hold 7 blocks, of 1000 tokens 63: three short to one long is
    # (21 + 63) / 4 = 21 blocks a request on average.  The long request's
    # prefill (999 tokens in one step, then its last) peaks at 63 blocks.
    # 274 blocks: 273 usable, 1 + (273 - 63) // 21 = 11 requests.
    specs = {"attn": _full()}
    plan = _plan(specs, 274 * 4096, context=1000)
    assert plan.num_blocks == 274
    mix = LengthMix.of([(100, 3), (1000, 1)])
    got = kvcore.mix_capacity(plan, mix)
    assert got.blocks_per_request == 21
    assert got.prefill_peak_blocks == 63
    assert got.concurrency == 11
    assert got.hit_granularity == 16
    assert got.to_dict()["mean_length"] == 325.0


@pytest.mark.parametrize("model", zoo.names())
def test_a_one_length_mix_is_plan_capacity(model):
    plan = _zoo_plan(model, 8192, None, 8192)
    for length in (1000, 4096, 8192):
        one = kvcore.mix_capacity(plan, LengthMix.of([(length, 5)]))
        assert one.concurrency == kvcore.plan_capacity(plan, length).concurrency


def test_a_mix_past_max_model_len_is_refused():
    plan = _plan({"attn": _full()}, 2**24, max_model_len=4096)
    with pytest.raises(PlanError, match="max_model_len=4096"):
        kvcore.mix_capacity(plan, LengthMix.of([(8192, 1)]))
    with pytest.raises(PlanError, match="target_lengths"):
        _plan(
            {"attn": _full()}, 2**24, max_model_len=4096, mix=LengthMix.of([(8192, 1)])
        )


# -- min_waste for a mix ------------------------------------------------------------


@cache
def _zoo_model(model: str):
    return load_model_file(zoo.path(model), REGISTRY)


@cache
def _zoo_plan(
    model: str, context: int | None, mix: LengthMix | None, max_model_len: int
):
    return _plan(
        _zoo_model(model).layers,
        80 * GiB,
        context=context,
        mix=mix,
        max_model_len=max_model_len,
    )


def test_a_one_length_mix_plans_as_its_target_context():
    # The mix objective is the single-context one when the mix has one
    # length: the same groups, stride and blocks.
    for model in ("qwen3-next-80b-a3b", "gemma-3-27b"):
        for length in (2048, 32768):
            by_context = _zoo_plan(model, length, None, length)
            by_mix = _zoo_plan(model, None, LengthMix.of([(length, 1)]), length)
            assert by_mix.kv_cache_groups == by_context.kv_cache_groups
            assert by_mix.bytes_per_block == by_context.bytes_per_block


def _past_the_cap(policy: str, *, context=None, mix=None, cap: int = 64):
    # 100 distinct windows and 10 full layers: seed runs 110 groups of one
    # layer, past the cap, which rises to seed's count for min_waste.
    specs: dict[str, kvcore.KVCacheSpec] = {
        f"w{i}": SlidingWindowSpec(
            block_size=16,
            num_kv_heads=8,
            head_size=128,
            dtype=torch.bfloat16,
            sliding_window=512 + 16 * i,
        )
        for i in range(100)
    }
    specs |= {
        f"f{i}": FullAttentionSpec(
            block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
        )
        for i in range(10)
    }
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout="BLHNC",
            packing_policy=policy,
            target_context=context,
            target_lengths=mix,
            max_kv_cache_groups=cap,
        ),
        max_model_len=8192,
    )
    return kvcore.plan_kv_cache(config, specs, 64 * GiB, registry=REGISTRY)


def test_past_the_group_cap_a_one_length_mix_plans_as_its_context():
    by_context = _past_the_cap("min_waste", context=4096)
    by_mix = _past_the_cap("min_waste", mix=LengthMix.of([(4096, 3)]))
    assert by_mix.kv_cache_groups == by_context.kv_cache_groups
    assert by_mix.bytes_per_block == by_context.bytes_per_block
    assert by_mix.num_blocks == by_context.num_blocks


@pytest.mark.parametrize("cap", [8, 64, 101])
def test_past_the_group_cap_the_mix_plan_holds_what_seed_holds(cap):
    mix = LengthMix.of([(1000, 3), (4096, 2), (8192, 1)])
    seed = _past_the_cap("seed", mix=mix, cap=cap)
    best = _past_the_cap("min_waste", mix=mix, cap=cap)
    assert len(seed.kv_cache_groups) == 110
    assert len(best.kv_cache_groups) <= max(cap, 110)
    ours, theirs = kvcore.mix_capacity(best, mix), kvcore.mix_capacity(seed, mix)
    assert ours.blocks_per_request * best.bytes_per_block <= (
        theirs.blocks_per_request * seed.bytes_per_block
    )
    assert ours.concurrency >= theirs.concurrency


MIX = LengthMix.of([(2000, 3), (32000, 1)])


@pytest.mark.parametrize("model", zoo.names())
def test_the_mix_plan_holds_at_least_any_single_length_plan(model):
    limit = MIX.longest
    ours = kvcore.mix_capacity(_zoo_plan(model, None, MIX, limit), MIX).concurrency
    for length in (2000, 8192, 9500, 32000):
        plan = _zoo_plan(model, length, None, limit)
        tuned = kvcore.mix_capacity(plan, MIX).concurrency
        assert ours >= tuned, (model, length)


def test_the_mix_plan_beats_every_single_length_plan_on_deepseek_v4():
    # Tuned to one length, min_waste grows blocks for it; three short
    # requests to one long are served better by a plan between them.
    model, limit = "deepseek-v4-flash", MIX.longest
    ours = kvcore.mix_capacity(_zoo_plan(model, None, MIX, limit), MIX).concurrency
    for length in (2000, 8192, 9500, 32000):
        plan = _zoo_plan(model, length, None, limit)
        assert ours > kvcore.mix_capacity(plan, MIX).concurrency, length


# -- the command line's mixes ------------------------------------------------------


def test_lognormal_is_median_and_log_sigma():
    mix, dropped = parse_length_mix("lognormal:8k,1.0")
    assert dropped == 0
    assert mix.total_weight == QUANTILE_POINTS
    ordered = [
        k for k, w in zip(mix.lengths, mix.weights, strict=True) for _ in range(w)
    ]
    # the middle quantiles straddle the median
    assert ordered[127] < 8000 < ordered[128]
    # 8000 exp(1.0 z) at the outermost quantiles, z = Phi^-1(0.5 / 256)
    z = NormalDist().inv_cdf(0.5 / QUANTILE_POINTS)
    assert mix.lengths[0] == round(8000 * math.exp(z)) == 447
    assert mix.longest == round(8000 * math.exp(-z)) == 143_320


def test_uniform_mix_and_trace_forms():
    mix, _ = parse_length_mix("uniform:1k-32k")
    assert mix.total_weight == QUANTILE_POINTS
    assert 1000 < mix.lengths[0] < 1100
    assert 31_900 < mix.longest <= 32_000
    small, _ = parse_length_mix("uniform:10-12")
    assert small.lengths == (10, 11, 12)
    listed, _ = parse_length_mix("mix:2k*3, 32K")
    assert (listed.lengths, listed.weights) == ((2000, 32768), (3, 1))
    assert fixed_lengths(listed) == (2000, 9692, 32768)


def test_lengths_past_max_model_len_are_dropped():
    mix, dropped = parse_length_mix("mix:1k*2,4k,64k*5", max_model_len=4000)
    assert (mix.lengths, mix.weights, dropped) == ((1000, 4000), (2, 1), 5)
    with pytest.raises(LengthMixSyntaxError, match="every length"):
        parse_length_mix("mix:64k", max_model_len=4000)


@pytest.mark.parametrize(
    "text",
    [
        "lognormal:8k",
        "lognormal:8k,9",
        "uniform:5k",
        "uniform:5k-1k",
        "mix:",
        "mix:4k*0",
        "trace:",
    ],
)
def test_bad_mixes_are_refused(text):
    with pytest.raises(KvcoreValueError):
        parse_length_mix(text)


def test_a_trace_mix_counts_each_request_at_its_length(tmp_path: Path):
    trace = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 1000, "output_length": 11, "hash_ids": [0, 1]},
        {"timestamp": 5, "input_length": 1000, "output_length": 11, "hash_ids": [0, 1]},
        {"timestamp": 9, "input_length": 90, "output_length": 1, "hash_ids": [7]},
    ]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    mix, _ = parse_length_mix(f"trace:{trace}")
    # prompt and output, less the last sampled token
    assert (mix.lengths, mix.weights) == ((90, 1010), (1, 2))


def test_plan_and_compare_report_the_workload(capsys):
    assert (
        main(
            [
                "plan",
                "llama-3-1-8b",
                "--memory",
                "16GiB",
                "--context",
                "mix:2k*3,32k",
                "--json",
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    jsonschema.validate(doc, load_schema())
    workload = doc["summary"]["workload"]
    assert workload["lengths"] == 2
    plan = doc["summary"]
    assert workload["num_blocks"] == plan["num_blocks"]
    # one full-attention group of 16-token blocks: (3 * 125 + 2000) / 4
    assert workload["blocks_per_request"] == (3 * 125 + 2000) / 4
    assert [c["context"] for c in doc["capacity"]] == [2000, 9500, 32000]
    assert (
        main(
            [
                "compare",
                "llama-3-1-8b",
                "--memory",
                "16GiB",
                "--context",
                "mix:2k*3,32k",
            ]
        )
        == 0
    )
    assert "workload" in capsys.readouterr().out
    assert (
        main(["plan", "llama-3-1-8b", "--memory", "16GiB", "--context", "mix:4k*0"])
        == 2
    )
    assert "weight" in capsys.readouterr().err


def test_compare_keeps_the_vllm_row_and_adds_the_workload(capsys):
    args = ["compare", "llama-3-1-8b", "--memory", "16GiB", "--context", "mix:2k*3,32k"]
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    policies = doc["policies"]
    assert [p["policy"] for p in policies] == ["vllm", "min_waste", "seed"]
    assert "memory" in doc
    for row in policies[1:]:
        # one full-attention group of 16-token blocks: (3 * 125 + 2000) / 4
        assert row["workload"]["blocks_per_request"] == (3 * 125 + 2000) / 4
        assert row["workload"]["num_blocks"] == row["num_blocks"]
        assert [c["context"] for c in row["capacity"]] == [2000, 9500, 32000]
        assert all(c["gain_over_vllm"] is not None for c in row["capacity"])
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "workload:" in out
    assert "(ratio)" in out
    assert "vs vllm" in out
    lines = out.splitlines()
    vllm = next(line for line in lines if line.startswith("vllm "))
    seed = next(line for line in lines if line.startswith("seed "))
    fit = policies[2]["workload"]["concurrency"]
    # vllm has no workload figure; seed's is its own, 1.00x of itself
    # (the stride is two words: "2.0 MiB")
    assert vllm.split()[5:7] == ["-", "-"]
    assert seed.split()[5:7] == [str(fit), "1.00x"]


def test_fixed_lengths_of_a_mix_with_huge_weights_are_its_order_statistics() -> None:
    """Weights are counts, not a list to lay out: 10**20 requests of 4K and
    one of 8K give a median and 90th percentile of 4K at once."""
    from kvcore.length_mix import LengthMix
    from kvcore.tools.length_mixes import fixed_lengths

    assert fixed_lengths(LengthMix.of([(4096, 10**20), (8192, 1)])) == (4096, 8192)
    # Three of 2K and one of 32K: median 2K, mean 9.5K, 90th percentile and
    # longest 32K.
    assert fixed_lengths(LengthMix.of([(2000, 3), (32000, 1)])) == (2000, 9500, 32000)
