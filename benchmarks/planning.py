"""Planning cost against model size, and min_waste against seed past the
group cap, for this kvcore and (``--against``) another checkout, in one run.

Cases (each run in a fresh interpreter, CPU seconds of
``kvcore.get_kv_cache_groups`` with ``min_waste`` at 4,096 tokens, BLHNC):

- ``windows50``: N sliding-window layers over 50 distinct windows of 1,024
  to 51,200 tokens (one spec object per layer, as a model file reads), N =
  1,000 ... 100,000; the previous search grew as about N^1.8 here;
- ``distinct``: N layers, every one a distinct window (N buckets);
- ``cap``: 100 distinct windows + 10 full layers and 64 windows + 63 full
  layers (more buckets than ``max_kv_cache_groups`` = 64), planned with both
  policies on 64 GiB: requests of 4,096 tokens and groups.

The growth column is the exponent ``log(t2 / t1) / log(N2 / N1)`` between
successive sizes (1.0 is linear).  ``--against PATH`` runs every case on the
kvcore at PATH too (a checkout or ``git archive`` of another commit, with
its ``plugins/``) and prints both side by side; a case past ``--timeout``
seconds is shown as ``>T``.

    python benchmarks/planning.py
    python benchmarks/planning.py --against /tmp/kvcore-main --timeout 120
    python benchmarks/planning.py --json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SIZES = {
    "windows50": [1000, 10000, 30000, 100000],
    "distinct": [1000, 3000, 10000],
}
CAP_CASES = [(100, 10), (64, 63)]


def _specs(case: str, size: int) -> dict[str, Any]:
    import torch

    from kvcore_full_attention import FullAttentionSpec
    from kvcore_sliding_window import SlidingWindowSpec

    def window(w: int) -> SlidingWindowSpec:
        return SlidingWindowSpec(
            block_size=16,
            num_kv_heads=8,
            head_size=128,
            dtype=torch.bfloat16,
            sliding_window=w,
        )

    if case == "windows50":
        return {f"l{i}": window(1024 * (1 + i % 50)) for i in range(size)}
    if case == "distinct":
        return {f"l{i}": window(128 + 16 * i) for i in range(size)}
    windows, full = divmod(size, 1000)
    specs = {f"w{i}": window(512 + 16 * i) for i in range(windows)}
    for i in range(full):
        specs[f"f{i}"] = FullAttentionSpec(
            block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
        )
    return specs


def _config(policy: str) -> Any:
    import kvcore

    return kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout="BLHNC", packing_policy=policy, target_context=4096
        )
    )


def run_case(case: str, size: int) -> dict[str, Any]:
    """One case in this interpreter (the child's side)."""
    import kvcore

    specs = _specs(case, size)
    if case != "cap":
        start = time.process_time()
        groups = kvcore.get_kv_cache_groups(_config("min_waste"), specs)
        return {"cpu_s": time.process_time() - start, "groups": len(groups)}
    out: dict[str, Any] = {}
    memory = 64 * 2**30
    for policy in ("seed", "min_waste"):
        plan = kvcore.plan_kv_cache(_config(policy), specs, memory)
        capacity = kvcore.plan_capacity(plan, 4096, specs=specs, memory=memory)
        out[policy] = {
            "requests": capacity.concurrency,
            "groups": len(plan.kv_cache_groups),
        }
    return out


def _child(tree: Path, case: str, size: int, timeout: float) -> dict[str, Any] | None:
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{tree / 'plugins'}")
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", case, str(size)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0:
        msg = f"{case} {size} on {tree} failed:\n{proc.stderr[-2000:]}"
        raise RuntimeError(msg)
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def _growth(rows: list[dict[str, Any]], key: str) -> None:
    for prev, row in itertools.pairwise(rows):
        a, b = prev.get(key), row.get(key)
        if a and b and row["case"] == prev["case"]:
            row[f"{key}_growth"] = math.log(b / a) / math.log(
                row["size"] / prev["size"]
            )


def collect(trees: dict[str, Path], timeout: float) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for case, sizes in SIZES.items():
        for size in sizes:
            row: dict[str, Any] = {"case": case, "size": size}
            for label, tree in trees.items():
                got = _child(tree, case, size, timeout)
                row[f"{label}_cpu_s"] = got["cpu_s"] if got else None
                row[f"{label}_groups"] = got["groups"] if got else None
            rows.append(row)
    for label in trees:
        _growth(rows, f"{label}_cpu_s")
    for windows, full in CAP_CASES:
        row = {"case": "cap", "size": windows + full, "windows": windows, "full": full}
        for label, tree in trees.items():
            got = _child(tree, "cap", windows * 1000 + full, timeout)
            row[label] = got
        rows.append(row)
    return rows


def _seconds(value: float | None, timeout: float) -> str:
    return f">{timeout:.0f}" if value is None else f"{value:.2f}"


def render(rows: list[dict[str, Any]], labels: list[str], timeout: float) -> str:
    lines = []
    head = ["case", "layers"]
    for label in labels:
        head += [f"{label} CPU s", "growth", "groups"]
    lines.append("  ".join(f"{h:>12}" for h in head))
    for row in rows:
        if row["case"] == "cap":
            continue
        cells = [row["case"], f"{row['size']:,}"]
        for label in labels:
            growth = row.get(f"{label}_cpu_s_growth")
            cells += [
                _seconds(row[f"{label}_cpu_s"], timeout),
                "" if growth is None else f"{growth:.2f}",
                str(row[f"{label}_groups"] or "-"),
            ]
        lines.append("  ".join(f"{c:>12}" for c in cells))
    lines.append("")
    lines.append("past the group cap (64): requests of 4,096 tokens (groups) on 64 GiB")
    for row in rows:
        if row["case"] != "cap":
            continue
        text = f"  {row['windows']} windows + {row['full']} full:"
        for label in labels:
            got = row[label]
            if got is None:
                text += f"  {label}: >{timeout:.0f} s"
                continue
            seed, best = got["seed"], got["min_waste"]
            text += (
                f"  {label}: seed {seed['requests']} ({seed['groups']}), "
                f"min_waste {best['requests']} ({best['groups']})"
            )
        lines.append(text)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--against", type=Path, help="another kvcore checkout to run too"
    )
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_case(args.child[0], int(args.child[1]))))
        return 0
    trees = {"this": ROOT}
    if args.against is not None:
        trees = {"against": args.against.resolve(), "this": ROOT}
    rows = collect(trees, args.timeout)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(render(rows, list(trees), args.timeout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
