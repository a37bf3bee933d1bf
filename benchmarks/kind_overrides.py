"""What a kind pays for overriding the core's steps.

A third party's manager that overrides a step runs its own code there, so
the core records the request's tables whole before the step and checks
what it left after (answers, tables, references, keys; see
``kvcore/coordinator/kind_effects.py``).  This script times one decode
``allocate_slots`` of a running request for each built-in kind below and
for a kind whose manager overrides its steps only to call ``super()``,
side by side in one run, at two context lengths (the checks copy and
compare each table, so they grow with it).

    python benchmarks/kind_overrides.py
    python benchmarks/kind_overrides.py --contexts 1024,16384,65536 --json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from typing import Any

import torch

import kvcore
from kvcore.coordinator import KVCacheManager, Request
from kvcore_full_attention import FullAttention, FullAttentionManager, FullAttentionSpec
from kvcore_sliding_window import (
    SlidingWindow,
    SlidingWindowManager,
    SlidingWindowSpec,
)


class PassThroughFullAttention(FullAttentionManager):
    """Overrides the count, the allocation and the keying, each only
    calling ``super()``: every one is the kind's own code."""

    def get_num_blocks_to_allocate(self, *args: Any) -> int:
        return super().get_num_blocks_to_allocate(*args)

    def allocate_twins(self, *args: Any) -> Any:
        return super().allocate_twins(*args)

    def cache_twins(self, *args: Any) -> None:
        super().cache_twins(*args)


class PassThroughSlidingWindow(SlidingWindowManager):
    """The same over a sliding window, its release too."""

    def get_num_blocks_to_allocate(self, *args: Any) -> int:
        return super().get_num_blocks_to_allocate(*args)

    def allocate_twins(self, *args: Any) -> Any:
        return super().allocate_twins(*args)

    def release_twins(self, *args: Any) -> None:
        super().release_twins(*args)

    def cache_twins(self, *args: Any) -> None:
        super().cache_twins(*args)


def _kinds() -> dict[str, tuple[Any, Any, Any]]:
    """Each kind's name -> (spec, built-in kind, pass-through kind)."""
    fa_spec = FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    sw_spec = SlidingWindowSpec(
        block_size=16,
        num_kv_heads=1,
        head_size=8,
        dtype=torch.float16,
        sliding_window=1024,
    )
    fa_pass = type(
        "PassFA", (FullAttention,), {"manager_type": PassThroughFullAttention}
    )
    sw_pass = type(
        "PassSW", (SlidingWindow,), {"manager_type": PassThroughSlidingWindow}
    )
    return {
        "full_attention": (fa_spec, FullAttention(), fa_pass()),
        "sliding_window": (sw_spec, SlidingWindow(), sw_pass()),
    }


def decode_us(kind: Any, spec: Any, context: int, steps: int) -> float:
    """Mean microseconds of one decode ``allocate_slots`` of a request
    holding ``context`` tokens, over ``steps`` steps."""
    config = kvcore.KVCacheConfig(
        num_blocks=context // 16 + steps // 16 + 64,
        kv_cache_tensors=[],
        kv_cache_groups=[kvcore.KVCacheGroupSpec(["layer.0"], spec)],
    )
    manager = KVCacheManager(
        config,
        context + steps + 16,
        scheduler_block_size=16,
        hash_block_size=16,
        enable_caching=True,
        registry=kvcore.KindRegistry.from_kinds([kind]),
    )
    request = Request("r", list(range(context)), hash_block_size=16)
    if manager.allocate_slots(request, context) is None:
        msg = "the pool is too small for the context"
        raise RuntimeError(msg)
    request.num_computed_tokens = context
    gc.collect()
    gc.freeze()
    pc = time.perf_counter_ns
    total = 0
    for i in range(steps):
        request.append_output_token_ids(i)
        t0 = pc()
        manager.allocate_slots(request, 1)
        total += pc() - t0
        request.num_computed_tokens += 1
    gc.unfreeze()
    return total / steps / 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default="1024,16384")
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results: dict[str, dict[int, dict[str, float]]] = {}
    for name, (spec, built_in, passing) in _kinds().items():
        rows = results[name] = {}
        for context in (int(c) for c in args.contexts.split(",")):
            # Alternated, so a change in the machine's load falls on both.
            both = [
                (
                    decode_us(built_in, spec, context, args.steps),
                    decode_us(passing, spec, context, args.steps),
                )
                for _ in range(args.repeat)
            ]
            own = statistics.median(b for b, _ in both)
            over = statistics.median(p for _, p in both)
            rows[context] = {
                "built_in_us": own,
                "pass_through_us": over,
                "ratio": over / own,
            }
            if not args.json:
                print(
                    f"{name:15s} {context:7d} tokens: built-in {own:6.2f} us, "
                    f"pass-through {over:6.2f} us ({over / own:4.1f}x)",
                    file=sys.stderr,
                )
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
