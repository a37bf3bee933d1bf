"""Benchmark of the block coordinator on a prefix-sharing serving trace.

Trace: 2,000 requests; each prompt is 512 tokens whose first 256 are one of 8
shared prefixes and the rest random (fixed seed).  Per request:
``get_computed_blocks``, ``allocate_slots`` for the prompt, 128 decode steps of
``allocate_slots`` for one token, then ``free``.  Run with 1 and with 64
requests live at once, each the median of 3 repetitions on fresh managers.

Plans: one full-attention group of 100,000 blocks of 16 tokens with
prefix caching on and the sha256 hash; and the DeepSeek-V4-style hybrid of
``examples/deepseek_v4_hybrid.py`` (26 groups of five kinds).

Each run builds a fresh manager, then (as an engine does after start-up)
collects and freezes the garbage collector's heap, so a full collection over
the pool's long-lived block objects does not land inside a timed call.

Figures are mean microseconds per call, on this machine.  A speed ratio
against another engine's manager needs both timed in the same run on the same
machine (``../shared/baselines/vllm_blockpool_bench.py`` times vLLM's on this
trace); figures stored from another machine are not divided here.
``calibration_us`` times a fixed pure-Python loop in the same run.

    python benchmarks/coordinator.py --json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import kvcore
from kvcore.coordinator import KVCacheManager, Request
from kvcore_full_attention import FullAttentionSpec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

#: The per-call figures the summary reports.
HEADLINE = (
    "allocate_slots_us",
    "allocate_slots_decode_us",
    "allocate_slots_prompt_us",
    "get_computed_blocks_us",
    "free_us",
    "request_us",
)


def make_trace(
    num_requests: int, prompt_len: int, shared_len: int, num_prefixes: int, seed: int
) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(1, 32000) for _ in range(shared_len)]
        for _ in range(num_prefixes)
    ]
    prompts = []
    for i in range(num_requests):
        tail = [rng.randrange(1, 32000) for _ in range(prompt_len - shared_len)]
        prompts.append(prefixes[i % num_prefixes] + tail)
    return prompts


def full_attention_manager(
    num_blocks: int, hash_function: str
) -> tuple[Callable[[], KVCacheManager], int]:
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
    )
    config = kvcore.KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[kvcore.KVCacheGroupSpec(["layer.0"], spec)],
    )
    return (
        lambda: KVCacheManager(
            config,
            max_model_len=8192,
            scheduler_block_size=16,
            hash_block_size=16,
            enable_caching=True,
        ),
        16,
    )


def deepseek_v4_manager(num_blocks: int) -> tuple[Callable[[], KVCacheManager], int]:
    from deepseek_v4_hybrid import deepseek_v4_specs

    registry = kvcore.default_registry()
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout="BLHNC",
            enable_prefix_caching=True,
            num_gpu_blocks_override=num_blocks,
        )
    )
    groups = kvcore.get_kv_cache_groups(config, deepseek_v4_specs(), registry=registry)
    plan = kvcore.get_kv_cache_config_from_groups(config, groups, available_memory=0)
    sched, hashing = kvcore.resolve_kv_cache_block_sizes(plan, config)
    scheduler_plan = kvcore.generate_scheduler_kv_cache_config([plan])
    return (
        lambda: KVCacheManager(
            scheduler_plan,
            max_model_len=8192,
            scheduler_block_size=sched,
            hash_block_size=hashing,
            enable_caching=True,
            registry=registry,
        ),
        hashing,
    )


def run_trace(
    make_manager: Callable[[], KVCacheManager],
    prompts: list[list[int]],
    hash_block_size: int,
    hash_function: str,
    batch: int,
    decode_steps: int,
    seed: int,
) -> dict[str, float]:
    manager = make_manager()
    # Like an engine after start-up, move the pool's long-lived objects out of
    # the collector's way, so a full collection does not land in a timed call.
    gc.collect()
    gc.freeze()
    clock = time.perf_counter
    rng = random.Random(seed)
    decode_tokens = [rng.randrange(1, 32000) for _ in range(1024)]
    t_req = t_get = t_prompt = t_decode = t_free = 0.0
    n_decode = 0
    hit_tokens = query_tokens = 0
    pending = iter(enumerate(prompts))
    live: list[tuple[Request, int]] = []  # (request, decode steps done)
    start = clock()
    done = 0
    exhausted = False
    while done < len(prompts):
        while not exhausted and len(live) < batch:
            item = next(pending, None)
            if item is None:
                exhausted = True
                break
            i, prompt = item
            t0 = clock()
            request = Request(
                f"r{i}",
                prompt,
                hash_block_size=hash_block_size,
                hash_function=hash_function,
            )
            t1 = clock()
            blocks, hit = manager.get_computed_blocks(request)
            t2 = clock()
            out = manager.allocate_slots(request, len(prompt) - hit, hit, blocks)
            t3 = clock()
            if out is None:
                raise SystemExit("the pool ran out of blocks; raise num_blocks")
            request.num_computed_tokens = len(prompt)
            t_req += t1 - t0
            t_get += t2 - t1
            t_prompt += t3 - t2
            hit_tokens += hit
            query_tokens += len(prompt)
            live.append((request, 0))
        still: list[tuple[Request, int]] = []
        for request, steps in live:
            request.append_output_token_ids(decode_tokens[(steps + done) & 1023])
            t0 = clock()
            out = manager.allocate_slots(request, 1)
            t_decode += clock() - t0
            if out is None:
                raise SystemExit("the pool ran out of blocks; raise num_blocks")
            n_decode += 1
            request.num_computed_tokens += 1
            if steps + 1 == decode_steps:
                t0 = clock()
                manager.free(request)
                t_free += clock() - t0
                done += 1
            else:
                still.append((request, steps + 1))
        live = still
    elapsed = clock() - start
    gc.unfreeze()
    n = len(prompts)
    us = 1e6
    return {
        "allocate_slots_us": (t_prompt + t_decode) / (n + n_decode) * us,
        "allocate_slots_decode_us": t_decode / n_decode * us,
        "allocate_slots_prompt_us": t_prompt / n * us,
        "get_computed_blocks_us": t_get / n * us,
        "free_us": t_free / n * us,
        "request_us": t_req / n * us,
        "requests_per_s": n / elapsed,
        "hit_rate": hit_tokens / query_tokens,
    }


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def calibration_us() -> float:
    """Microseconds for a fixed pure-Python loop (machine speed yardstick)."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        total = 0
        for i in range(100_000):
            total += i & 7
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--decode-steps", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--hash", default="sha256", choices=("sha256", "xxh3_128"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    prompts = make_trace(args.requests, 512, 256, 8, args.seed)
    plans: dict[str, tuple[Callable[[], KVCacheManager], int]] = {
        "full_attention": full_attention_manager(100_000, args.hash),
        "deepseek_v4": deepseek_v4_manager(40_000),
    }
    results: dict[str, Any] = {"calibration_us": calibration_us(), "hash": args.hash}
    for plan_name, (make, hash_bs) in plans.items():
        for batch in (1, 64):
            runs = [
                run_trace(
                    make,
                    prompts,
                    hash_bs,
                    args.hash,
                    batch,
                    args.decode_steps,
                    args.seed,
                )
                for _ in range(args.repeat)
            ]
            figures = median_of(runs)
            results[f"{plan_name}/batch{batch}"] = figures
            if not args.json:
                print(f"{plan_name} batch {batch}:", file=sys.stderr)
                for key, value in figures.items():
                    print(f"  {key:>26} {value:10.2f}", file=sys.stderr)
    headline = results["full_attention/batch1"]
    summary = {
        key: round(headline[key], 3)
        for key in (*HEADLINE, "requests_per_s", "hit_rate")
    }
    output = {**summary, "runs": results}
    print(json.dumps(output, indent=1 if not args.json else None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
