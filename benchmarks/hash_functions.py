"""Per-block cost of kvcore's block hash functions.

Hashes the prompt of a request (default 512 tokens in 16-token blocks) with
each hash function through :class:`kvcore.coordinator.hashing.BlockHasher`,
the path a new request takes, and reports the median time per block and the
ratio against sha256 measured in the same run.

    python benchmarks/hash_functions.py [--json] [--num-tokens 512] [--block-size 16]

(with kvcore installed, or ``PYTHONPATH=.`` from the repository root).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

from kvcore.coordinator.hashing import BlockHasher, hash_function_names


def measure(
    name: str, tokens: list[int], block_size: int, number: int, repeat: int
) -> float:
    """Median seconds per block over ``repeat`` runs of ``number`` requests."""
    hasher = BlockHasher(block_size, name)
    num_blocks = len(tokens) // block_size
    hasher.hash_new_blocks(tokens, [])  # warm up (loads xxhash, caches structs)
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            hasher.hash_new_blocks(tokens, [])
        samples.append((time.perf_counter() - start) / (number * num_blocks))
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--num-tokens", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--number", type=int, default=200, help="requests per run")
    parser.add_argument("--repeat", type=int, default=15, help="runs (median taken)")
    args = parser.parse_args(argv)
    if args.num_tokens < args.block_size or args.block_size < 1:
        parser.error("need --block-size >= 1 and --num-tokens >= --block-size")

    tokens = [(i * 7919 + 13) % 32000 for i in range(args.num_tokens)]
    per_block = {
        name: measure(name, tokens, args.block_size, args.number, args.repeat)
        for name in hash_function_names()
    }
    base = per_block["sha256"]
    nblocks = args.num_tokens // args.block_size
    rows: dict[str, dict[str, float]] = {
        name: {
            "us_per_block": round(t * 1e6, 4),
            "us_per_request": round(t * 1e6 * nblocks, 3),
            "ratio_vs_sha256": round(t / base, 4),
        }
        for name, t in per_block.items()
    }
    result = {
        "num_tokens": args.num_tokens,
        "block_size": args.block_size,
        "blocks_per_request": args.num_tokens // args.block_size,
        "number": args.number,
        "repeat": args.repeat,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "functions": rows,
    }
    if args.json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(
            f"{args.num_tokens} tokens, blocks of {args.block_size} "
            f"({result['blocks_per_request']} blocks), median of {args.repeat} runs"
        )
        for name, row in rows.items():
            print(
                f"  {name:10s} {row['us_per_block']:8.3f} us/block "
                f"{row['us_per_request']:9.2f} us/request "
                f"x{row['ratio_vs_sha256']:.3f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
