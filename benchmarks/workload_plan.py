"""Planning for a workload: the mix-planned pool against every single-length plan.

For every shipped model and every mix of request lengths, the model is
planned as ``kvcore plan MODEL --memory M --context MIX --max-model-len L``
plans it (``min_waste`` with ``CacheConfig.target_lengths``: the plan that
holds the most requests of the mix) and, on the same memory and
``max_model_len``, once per single target length ``T`` (``--context T``:
``min_waste`` tuned to ``T``).  Every plan is measured under the mix with
``kvcore.mix_capacity``: requests of the mix that fit together (see
``docs/capacity.md``, "Capacity under a workload").  The single lengths are
the powers of two from 1K to the mix's longest request, and the mix's
median, mean, 90th percentile and longest.

    python benchmarks/workload_plan.py
    python benchmarks/workload_plan.py --model qwen3-next-80b-a3b --json
    python benchmarks/workload_plan.py --write   # the table in docs/capacity.md

The target: for every model and mix, ``mix plan >= best single`` (the
``ok`` column).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from capacity import benchmark_registry

import kvcore.tools.zoo
from kvcore.plan.capacity import mix_capacity
from kvcore.registry import KindRegistry
from kvcore.tools.cli.options import Planned, add_model_options, plan_from_args
from kvcore.tools.length_mixes import fixed_lengths, parse_length_mix

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "capacity.md"
TRACE = Path("/work/shared/traces/mooncake_synthetic_trace.jsonl")
if (REPO.parent / "shared" / "traces" / TRACE.name).exists():
    TRACE = REPO.parent / "shared" / "traces" / TRACE.name
MIXES = (
    "lognormal:8k,1.0",
    "uniform:1k-32k",
    "mix:2k*3,32k",
    f"trace:{TRACE}",
)
MEMORY = "80GiB"
BEGIN = "<!-- workload_plan.py: begin -->"
END = "<!-- workload_plan.py: end -->"


def plan(model: str, registry: KindRegistry, memory: str, *args: str) -> Planned:
    parser = argparse.ArgumentParser()
    add_model_options(parser)
    return plan_from_args(
        parser.parse_args([model, "--memory", memory, *args]), registry=registry
    )


def mix_label(text: str) -> str:
    return f"trace:{Path(text[6:]).name}" if text.startswith("trace:") else text


def rows_of(
    model: str, mix_text: str, registry: KindRegistry, memory: str
) -> dict[str, Any]:
    mix, _ = parse_length_mix(mix_text)
    longest = str(mix.longest)
    planned = plan(
        model, registry, memory, "--context", mix_text, "--max-model-len", longest
    )
    ours = mix_capacity(planned.plan, mix)
    singles = sorted(
        {2**k for k in range(10, 40) if 2**k <= mix.longest} | set(fixed_lengths(mix))
    )
    best_length, best = 0, -1
    per_length = {}
    for length in singles:
        other = plan(
            model,
            registry,
            memory,
            "--context",
            str(length),
            "--max-model-len",
            longest,
        )
        fit = mix_capacity(other.plan, mix).concurrency
        per_length[length] = fit
        if fit > best:
            best_length, best = length, fit
    return {
        "model": model,
        "mix": mix_label(mix_text),
        "mean_length": float(mix.mean),
        "longest": mix.longest,
        "mix_plan": ours.concurrency,
        "mix_plan_groups": len(planned.plan.kv_cache_groups),
        "mix_plan_hit_granularity": ours.hit_granularity,
        "best_single": best,
        "best_single_length": best_length,
        "single_lengths": per_length,
        "ok": ours.concurrency >= best,
    }


COLUMNS = [
    ("model", "model", "{}"),
    ("workload", "mix", "`{}`"),
    ("mean / longest", None, None),
    ("mix-planned: requests", "mix_plan", "{:,}"),
    ("groups", "mix_plan_groups", "{}"),
    ("hits in", "mix_plan_hit_granularity", "{} tok"),
    ("best single-length plan", "best_single", "{:,}"),
    ("tuned to", "best_single_length", "{:,} tok"),
    ("ok", "ok", "{}"),
]


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| " + " | ".join(h for h, _, _ in COLUMNS) + " |",
        "|" + "|".join(" --- " for _ in COLUMNS) + "|",
    ]
    for row in rows:
        cells = []
        for _, key, fmt in COLUMNS:
            if key is None:
                cells.append(f"{round(row['mean_length']):,} / {row['longest']:,}")
            else:
                cells.append(fmt.format(row[key]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_doc(rows: Sequence[dict[str, Any]], memory: str) -> None:
    text = DOC.read_text()
    start, end = text.index(BEGIN), text.index(END)
    body = (
        f"{BEGIN}\n\n`python benchmarks/workload_plan.py --write`, {memory} of KV "
        "cache per model:\n\n" + markdown(rows) + "\n"
    )
    DOC.write_text(text[:start] + body + text[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", default=None)
    parser.add_argument("--mix", action="append", default=None)
    parser.add_argument("--memory", default=MEMORY)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    registry = benchmark_registry()
    rows = []
    for model in args.model or kvcore.tools.zoo.names():
        for mix_text in args.mix or MIXES:
            row = rows_of(model, mix_text, registry, args.memory)
            rows.append(row)
            if not args.json:
                print(
                    f"{model:28} {row['mix']:40} mix-planned {row['mix_plan']:>6,}  "
                    f"best single {row['best_single']:>6,} (tuned to "
                    f"{row['best_single_length']:,})  {'ok' if row['ok'] else 'MISS'}",
                    flush=True,
                )
    if args.json:
        sys.stdout.write(json.dumps(rows, indent=1) + "\n")
    if args.write:
        write_doc(rows, args.memory)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
