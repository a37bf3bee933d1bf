"""Per-step cost of the coordinator against the number of cache groups.

Three plans, each at 1, 8, 32 and 73 groups (``--groups``):

- ``mamba``: one full-attention group (16-token blocks) beside ``n - 1``
  Mamba groups in ``align`` mode (a checkpoint state per 16-token block,
  the newest kept, the one before released every block);
- ``falcon``: a Falcon-H1-like plan, one full-attention group (16-token
  blocks) beside ``n - 1`` Mamba groups of 432-token blocks (the planner's
  block for Falcon-H1-34B's states), scheduler block 432, hash block 16;
- ``attention``: ``n`` prefix-cached full-attention groups of one spec.

Each plan runs one trace: ``--requests`` requests of 864 prompt tokens (the
first 432 one of 4 shared prefixes, so lookups hit), ``--batch`` live at once,
``--decode`` decode steps each.  Figures are microseconds per call (the median
of ``--repeat`` runs, each on a fresh manager): ``decode`` (``allocate_slots``
of one token), ``prefill`` (``allocate_slots`` of the prompt with its hit
attached) and ``lookup`` (``get_computed_blocks``), with the ratio to the plan
at its first group count.

    python benchmarks/groups.py
    python benchmarks/groups.py --json
    python benchmarks/groups.py --gc off   # the cyclic collector off while timing
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from typing import Any

import torch

import kvcore
from kvcore.coordinator import KVCacheManager, Request
from kvcore_full_attention import FullAttentionSpec
from kvcore_mamba import MambaSpec

PROMPT = 864
SHARED = 432
PREFIXES = 4
VOCAB = 32000


def _attention() -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=16, num_kv_heads=4, head_size=128, dtype=torch.bfloat16
    )


def _mamba(block_size: int, layer: int) -> MambaSpec:
    # One spec per layer, as a plan that gives each state layer its own group
    # (equal specs: the groups are interchangeable).
    del layer
    return MambaSpec(
        block_size=block_size,
        shapes=((3, 5120), (32, 128, 256)),
        dtypes=(torch.bfloat16, torch.bfloat16),
        mamba_cache_mode="align",
    )


def make_manager(plan: str, num_groups: int, num_blocks: int) -> KVCacheManager:
    groups: list[kvcore.KVCacheGroupSpec] = []
    if plan == "attention":
        spec = _attention()
        groups = [
            kvcore.KVCacheGroupSpec([f"layer.{g}.attn"], spec)
            for g in range(num_groups)
        ]
        scheduler = 16
    else:
        state_block = 16 if plan == "mamba" else 432
        scheduler = state_block
        groups.append(
            kvcore.KVCacheGroupSpec(
                [f"layer.{i}.attn" for i in range(max(num_groups - 1, 1))],
                _attention(),
            )
        )
        groups += [
            kvcore.KVCacheGroupSpec([f"layer.{g}.mamba"], _mamba(state_block, g))
            for g in range(num_groups - 1)
        ]
    config = kvcore.KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
    )
    return KVCacheManager(
        config,
        8192,
        scheduler_block_size=scheduler,
        hash_block_size=16,
        enable_caching=True,
    )


def make_trace(requests: int, decode: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(SHARED)] for _ in range(PREFIXES)]
    return [
        rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(PROMPT - SHARED)]
        + [rng.randrange(VOCAB) for _ in range(decode)]
        for _ in range(requests)
    ]  # fmt: skip


def run_once(
    plan: str, num_groups: int, trace: list[list[int]], args: argparse.Namespace
) -> dict[str, float]:
    manager = make_manager(plan, num_groups, args.num_blocks)
    gc.collect()
    gc.freeze()
    collecting = gc.isenabled()
    if args.gc == "off":
        gc.disable()
    pc = time.perf_counter_ns
    t_lookup = t_prefill = t_decode = 0
    n_lookup = n_prefill = n_decode = hit_tokens = 0
    for start in range(0, len(trace), args.batch):
        live: list[tuple[Request, list[int]]] = []
        for i in range(start, min(start + args.batch, len(trace))):
            tokens = trace[i]
            req = Request(f"r{i}", tokens[:PROMPT], hash_block_size=16)
            # Each prefill is its own engine step: the states the one before
            # took are written before this one resumes from them.
            manager.new_step_starts()
            t0 = pc()
            blocks, hit = manager.get_computed_blocks(req)
            t1 = pc()
            out = manager.allocate_slots(req, PROMPT - hit, hit, blocks)
            t2 = pc()
            if out is None:
                msg = "the pool is too small for the trace"
                raise RuntimeError(msg)
            t_lookup += t1 - t0
            t_prefill += t2 - t1
            n_lookup += 1
            n_prefill += 1
            hit_tokens += hit
            req.num_computed_tokens = PROMPT
            req.append_output_token_ids(tokens[PROMPT])
            live.append((req, tokens))
        for step in range(1, args.decode):
            for req, tokens in live:
                t0 = pc()
                out = manager.allocate_slots(req, 1)
                t_decode += pc() - t0
                n_decode += 1
                if out is None:
                    msg = "the pool is too small for the trace"
                    raise RuntimeError(msg)
                req.num_computed_tokens += 1
                req.append_output_token_ids(tokens[PROMPT + step])
        for req, _ in live:
            manager.free(req)
    if collecting:
        gc.enable()
    gc.unfreeze()
    return {
        "decode_us": t_decode / n_decode / 1e3,
        "prefill_us": t_prefill / n_prefill / 1e3,
        "lookup_us": t_lookup / n_lookup / 1e3,
        "hit_tokens": hit_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plans", default="mamba,falcon,attention")
    parser.add_argument("--groups", default="1,8,32,73")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--decode", type=int, default=128)
    parser.add_argument(
        "--gc",
        default="freeze",
        choices=("freeze", "off"),
        help="freeze the heap after building each manager (the default), or "
        "also keep the cyclic collector off while the trace runs: its passes "
        "grow with the objects a many-group plan holds, and are not the "
        "coordinator's own per-step work",
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--num-blocks", type=int, default=200_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    trace = make_trace(args.requests, args.decode)
    counts = [int(n) for n in args.groups.split(",")]
    results: dict[str, Any] = {}
    for plan in args.plans.split(","):
        rows: dict[int, dict[str, float]] = {}
        for n in counts:
            runs = [run_once(plan, n, trace, args) for _ in range(args.repeat)]
            rows[n] = {
                key: statistics.median(run[key] for run in runs) for key in runs[0]
            }
        results[plan] = rows
        if args.json:
            continue
        base = rows[counts[0]]
        print(f"{plan}: us per call (x the {counts[0]}-group plan)", file=sys.stderr)
        print("  groups      decode             prefill            lookup",
              file=sys.stderr)  # fmt: skip
        for n, row in rows.items():
            cells = "".join(
                f" {row[k]:9.2f} ({row[k] / base[k]:5.1f}x)"
                for k in ("decode_us", "prefill_us", "lookup_us")
            )
            print(f"  {n:6d} {cells}", file=sys.stderr)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
