"""benchmarks/coordinator.py runs end to end without vLLM, and describes the
DeepSeek-V4 plan to vLLM's worker group by group.  (Its timings are never
asserted; the side-by-side run needs a vLLM interpreter.)"""

from __future__ import annotations

import json
from typing import Any

import pytest
from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench() -> Any:
    return load_benchmark("coordinator")


def test_the_deepseek_v4_plan_is_described_group_by_group(bench: Any) -> None:
    make, hash_block_size, info = bench.deepseek_v4_manager(64 << 30, 32768)
    manager = make()
    plan = bench.vllm_plan(manager)
    json.dumps(plan)  # it crosses to the worker as JSON
    assert len(plan["groups"]) == info["groups"] == manager.num_kv_cache_groups
    assert plan["hash_block_size"] == hash_block_size == manager.hash_block_size
    assert plan["scheduler_block_size"] == info["scheduler_block_size"]
    assert plan["num_blocks"] == info["num_blocks"]
    assert sum(len(g["layers"]) for g in plan["groups"]) == info["layers"]
    kinds = {g["kind"] for g in plan["groups"]}
    assert kinds == {"SlidingWindowMLASpec", "MLAAttentionSpec", "CircularBufferSpec"}
    for group, spec_group in zip(
        plan["groups"], manager.kv_cache_config.kv_cache_groups, strict=True
    ):
        spec = spec_group.kv_cache_spec
        assert group["fields"]["block_size"] == spec.block_size
        assert group["fields"]["dtype"] == str(spec.dtype).removeprefix("torch.")


def _trace(bench: Any, **draws: int) -> tuple[Any, Any]:
    """The benchmark's trace of 512-token prompts on shared prefixes of 256."""
    args = bench.argparse.Namespace(shared_prefix_len=256, prompt_len=512, **draws)
    return bench.make_trace(args)


def _run(bench: Any, make: Any, trace: Any, hash_block_size: int, **loop: int) -> Any:
    """The benchmark's timed loop over ``trace`` (``loop``: batch, decode steps)."""
    prompts, decode = trace
    return bench.run_trace(
        make,
        prompts,
        decode,
        hash_block_size=hash_block_size,
        hash_function="sha256",
        gc_mode="on",
        **loop,
    )


def test_whole_block_hits_give_none_under_the_plans_large_blocks(bench: Any) -> None:
    """The side-by-side run's kvcore uses vLLM's hit rule: a 512-token prompt
    gets no hit under 2048-token blocks; kvcore's default, copy-on-write
    hits inside a block, serves some of the shared prefixes."""
    trace = _trace(bench, seed=0, num_prefixes=2, requests=12, decode_steps=4)
    hits = {}
    for partial in (True, False):
        make, hash_block_size, _ = bench.deepseek_v4_manager(
            64 << 30, 32768, partial_hits=partial
        )
        run = _run(bench, make, trace, hash_block_size, batch=4, decode_steps=4)
        assert run["allocation_failures"] == 0
        assert run["free_blocks_end"] == make().block_pool.get_num_free_blocks()
        hits[partial] = run["prefix_hit_tokens"]
    assert hits[False] == 0
    assert hits[True] > 0
    assert hits[True] % 128 == 0  # the plan's hash block


def test_kvcore_only_run_prints_its_figures(bench: Any, capsys: Any) -> None:
    argv = ["--no-vllm", "--json", "--requests", "8", "--decode-steps", "3"]
    argv += ["--repeat", "1", "--no-groups", "--no-memory", "--batch", "2"]
    assert bench.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["vllm"] is None
    figures = out["full_attention/batch2"]["kvcore"]
    assert figures["allocation_failures"] == 0
    assert figures["prefix_hit_tokens"] > 0
    v4 = out["deepseek_v4/batch2"]
    assert v4["kvcore_whole_block_hits"]["prefix_hit_tokens"] == 0
    assert "compare" not in v4


def test_the_kind_override_benchmark_runs_both_kinds_side_by_side(
    capsys: Any,
) -> None:
    overrides = load_benchmark("kind_overrides")
    argv = ["--json", "--contexts", "64,256", "--steps", "32", "--repeat", "1"]
    assert overrides.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"full_attention", "sliding_window"}
    for rows in out.values():
        assert set(rows) == {"64", "256"}
        for row in rows.values():
            assert row["built_in_us"] > 0
            assert row["pass_through_us"] > 0
            assert row["ratio"] == row["pass_through_us"] / row["built_in_us"]


@pytest.mark.parametrize(("num_blocks", "batch"), [(100_000, 4), (150, 2), (90, 3)])
def test_the_python_floor_serves_the_trace_as_kvcore_does(
    bench: Any, num_blocks: int, batch: int
) -> None:
    """The floor is a measuring stick only if it does kvcore's work: the
    same hits, refusals and free and cached blocks, also in pools small
    enough that prefix-cached blocks are evicted (the eviction order is
    the same)."""
    trace = _trace(bench, seed=3, num_prefixes=3, requests=40, decode_steps=40)
    make_kvcore, hash_block_size = bench.full_attention_manager(num_blocks, 32768)
    runs = {
        side: _run(bench, make, trace, hash_block_size, batch=batch, decode_steps=40)
        for side, make in (
            ("kvcore", make_kvcore),
            ("floor", lambda: bench.FloorManager(num_blocks)),
        )
    }
    assert bench.workload_mismatch(runs["kvcore"], runs["floor"]) == []
    assert runs["kvcore"]["prefix_hit_tokens"] > 0
    if num_blocks < 1000:  # the small pools evict cached blocks
        assert runs["kvcore"]["cached_blocks_end"] < num_blocks - 1
