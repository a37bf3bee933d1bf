"""Trace replay benchmark: each shipped model's hit rate on the shared
Mooncake trace, at an ample and a tight pool, against the trace's ceiling.

For every shipped model (``kvcore.tools.zoo``), the shared trace
(``../shared/traces/mooncake_synthetic_trace.jsonl``, 3,993 requests) is
replayed on its clock as ``kvcore simulate MODEL --trace FILE`` replays it
(kvcore's defaults: prefix caching on, the model file's modes, 8192 tokens
a step, one prefill at a time), in two pools sized by the rule of
``benchmarks/hit_rate.py``:

- **ample**: every request's every block at once with no sharing, plus the
  null block: nothing is ever evicted;
- **tight**: the most blocks the ample run held in use at once, plus the
  null block: the live requests fit at their busiest step, and cached
  blocks live only in what they leave free.

Each row gives the hit rate (hit tokens over the tokens looked up at
admissions), the trace's ceiling (an unbounded cache, from the hash ids
alone) and the same rounded down to the plan's hit granularity, and their
gap.  Every tight row of a model other than the full-attention baseline
(``llama-3-1-8b``) is set beside the baseline in the same memory (its
context the trace's longest request) and in its own tight pool.

    python benchmarks/trace_replay.py
    python benchmarks/trace_replay.py --model gemma-3-27b --json
    python benchmarks/trace_replay.py --write   # the tables in docs/simulate.md
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from capacity import benchmark_registry
from hit_rate import (
    BASELINE_MODEL,
    TIGHT_FACTOR,
    blocks_for_everything,
    plan_model,
    plan_with_blocks,
)

import kvcore.tools.zoo
from kvcore.plan.block_sizes import plan_hit_granularity
from kvcore.registry import KindRegistry
from kvcore.tools.cli.options import Planned
from kvcore.tools.simulate import Driver, SimulationResult
from kvcore.tools.simulate.public_traces import LoadedTrace, parse_any_trace
from kvcore.tools.simulate.trace import read_trace_lines

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "simulate.md"
TRACE = REPO.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
if not TRACE.exists():
    TRACE = Path("/work/shared/traces/mooncake_synthetic_trace.jsonl")
BEGIN = "<!-- trace_replay.py: begin -->"
END = "<!-- trace_replay.py: end -->"
#: The most blocks an ample pool gets (a pool of 2**24 blocks takes about
#: 1.3 GiB of host memory at 80 bytes a block); a pool capped here is marked
#: ``ample (capped)``.
MAX_AMPLE_BLOCKS = 2**24


def replay(planned: Planned, loaded: LoadedTrace) -> SimulationResult:
    driver = Driver(
        planned.plan,
        registry=planned.registry,
        max_num_batched_tokens=planned.config.max_num_batched_tokens,
        cache_sample_every=64,
    )
    return driver.run(loaded.workload)


def _row(
    model: str,
    pool: str,
    planned: Planned,
    loaded: LoadedTrace,
    result: SimulationResult,
) -> dict[str, Any]:
    granularity = plan_hit_granularity(planned.plan) or 1
    ceiling = loaded.ceiling(granularity)
    assert ceiling is not None
    return {
        "model": model,
        "pool": pool,
        "num_blocks": result.num_blocks,
        "pool_bytes": planned.plan.num_blocks * planned.plan.bytes_per_block,
        "hit_granularity": granularity,
        "hit_rate": result.hit_rate,
        "first_admission_hit_rate": result.first_admission_hit_rate,
        "ceiling_rate": ceiling.rate,
        "aligned_rate": ceiling.aligned_rate,
        "gap": ceiling.rate - result.hit_rate,
        "bound_rate": result.bound_rate,
        "preemptions": result.preemptions,
        "evictions": result.evictions,
        "peak_cached_state_blocks": result.peak_cached_state_blocks,
        "completed": result.completed,
        "unserved": len(result.unserved),
        "peak_blocks_in_use": result.peak_blocks_in_use,
    }


def model_rows(
    model: str, loaded: LoadedTrace, registry: KindRegistry, progress: Any = None
) -> list[dict[str, Any]]:
    start = time.monotonic()
    probe = plan_model(model, registry, 2**30)
    probe_driver = Driver(probe.plan, registry=registry)
    everything = blocks_for_everything(probe_driver, loaded.workload)
    ample = plan_with_blocks(
        model, registry, min(everything, MAX_AMPLE_BLOCKS), probe=probe
    )
    result = replay(ample, loaded)
    pool = "ample" if everything <= MAX_AMPLE_BLOCKS else "ample (capped)"
    rows = [_row(model, pool, ample, loaded, result)]
    tight_blocks = math.ceil(TIGHT_FACTOR * result.peak_blocks_in_use) + 1
    tight = plan_with_blocks(model, registry, tight_blocks, probe=probe)
    rows.append(_row(model, "tight", tight, loaded, replay(tight, loaded)))
    if progress is not None:
        progress(f"{model}: {time.monotonic() - start:.0f} s")
    return rows


def same_memory(
    row: dict[str, Any], loaded: LoadedTrace, registry: KindRegistry
) -> dict[str, Any]:
    """The full-attention baseline in a tight row's memory (its context the
    trace's longest request, so every request fits), compared on first
    admissions: in a pool smaller than its busiest step the baseline
    preempts, and a re-admission's hits on its own earlier blocks save only
    what the preemption cost."""
    longest = max(r.max_tokens for r in loaded.workload.requests)
    baseline = plan_model(
        BASELINE_MODEL, registry, row["pool_bytes"], ("--context", str(longest))
    )
    result = replay(baseline, loaded)
    first = row["first_admission_hit_rate"]
    base = result.first_admission_hit_rate
    return {
        "model": row["model"],
        "hit_rate": row["hit_rate"],
        "first_admission_hit_rate": first,
        "pool_gib": row["pool_bytes"] / 2**30,
        "baseline_blocks": result.num_blocks,
        "baseline_hit_rate": result.hit_rate,
        "baseline_preemptions": result.preemptions,
        "baseline_first_admission_hit_rate": base,
        "baseline_unserved": len(result.unserved),
        "same_memory": first / base if base else None,
    }


def with_same_pressure(
    rows: Sequence[dict[str, Any]], same: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """``same`` with the baseline's own tight row beside each (same
    pressure), compared on first admissions too."""
    own = next(
        (r for r in rows if r["model"] == BASELINE_MODEL and r["pool"] == "tight"),
        None,
    )
    out = []
    for entry in same:
        entry = dict(entry)
        base = None if own is None else own["first_admission_hit_rate"]
        entry["baseline_own_hit_rate"] = base
        entry["same_pressure"] = (
            entry["first_admission_hit_rate"] / base if base else None
        )
        out.append(entry)
    return out


COLUMNS = [
    ("model", "model", "{}"),
    ("pool", "pool", "{}"),
    ("blocks", "num_blocks", "{:,}"),
    ("hits in", "hit_granularity", "{} tok"),
    ("hit rate", "hit_rate", "{:.2%}"),
    ("ceiling", "ceiling_rate", "{:.2%}"),
    ("ceiling, aligned", "aligned_rate", "{:.2%}"),
    ("gap", "gap", "{:.3f}"),
    ("token bound", "bound_rate", "{:.2%}"),
    ("preemptions", "preemptions", "{:,}"),
    ("evictions", "evictions", "{:,}"),
    ("unserved", "unserved", "{:,}"),
]
SAME_COLUMNS = [
    ("model", "model", "{}"),
    ("tight pool", "pool_gib", "{:.2f} GiB"),
    ("hit rate", "hit_rate", "{:.2%}"),
    ("at first admissions", "first_admission_hit_rate", "{:.2%}"),
    (f"{BASELINE_MODEL} there: blocks", "baseline_blocks", "{:,}"),
    ("its hit rate", "baseline_hit_rate", "{:.2%}"),
    ("its preemptions", "baseline_preemptions", "{:,}"),
    ("at first admissions", "baseline_first_admission_hit_rate", "{:.2%}"),
    ("x same memory", "same_memory", "{:.2f}"),
    (
        f"{BASELINE_MODEL} in its own tight pool, at first admissions",
        "baseline_own_hit_rate",
        "{:.2%}",
    ),
    ("x same pressure", "same_pressure", "{:.2f}"),
]


def markdown(
    rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]
) -> str:
    lines = [
        "| " + " | ".join(h for h, _, _ in columns) + " |",
        "|" + "|".join(" --- " for _ in columns) + "|",
    ]
    for row in rows:
        cells = ["-" if row[k] is None else f.format(row[k]) for _, k, f in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_doc(rows: Sequence[dict[str, Any]], same: Sequence[dict[str, Any]]) -> None:
    text = DOC.read_text()
    start, end = text.index(BEGIN), text.index(END)
    body = (
        f"{BEGIN}\n\n"
        + markdown(rows, COLUMNS)
        + "\n"
        + (markdown(same, SAME_COLUMNS) + "\n" if same else "")
    )
    DOC.write_text(text[:start] + body + text[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", default=None)
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help="replay only the trace's first N requests",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--write", action="store_true")
    parser.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        default=None,
        help="JSON outputs of earlier runs (--json) to print and --write together",
    )
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    same: list[dict[str, Any]] = []
    if args.merge:
        for path in args.merge:
            doc = json.loads(path.read_text())
            if any("first_admission_hit_rate" not in r for r in doc["rows"]):
                parser.error(
                    f"{path} has no first-admission hit rates (written by an "
                    "older trace_replay.py); replay it again with --json"
                )
            rows.extend(doc["rows"])
            same.extend(doc["same_memory"])
    else:
        registry = benchmark_registry()
        lines = [line for line in read_trace_lines(args.trace) if line.strip()]
        loaded = parse_any_trace(lines[: args.requests], source=str(args.trace))

        def say(text: str) -> None:
            print(text, file=sys.stderr, flush=True)

        for model in args.model or kvcore.tools.zoo.names():
            got = model_rows(model, loaded, registry, say)
            rows.extend(got)
            for row in got:
                say(json.dumps(row))
                if row["pool"] == "tight" and model != BASELINE_MODEL:
                    same.append(same_memory(row, loaded, registry))
                    say(json.dumps(same[-1]))
    order = {name: i for i, name in enumerate(kvcore.tools.zoo.names())}
    rows.sort(key=lambda r: (r["model"] != BASELINE_MODEL, order.get(r["model"], 99)))
    same.sort(key=lambda r: order.get(r["model"], 99))
    same = with_same_pressure(rows, same)
    if args.json:
        text = json.dumps({"rows": rows, "same_memory": same}, indent=1)
        sys.stdout.write(text + "\n")
    else:
        sys.stdout.write(markdown(rows, COLUMNS) + "\n" + markdown(same, SAME_COLUMNS))
    if args.write:
        write_doc(rows, same)
    return 0


if __name__ == "__main__":
    sys.exit(main())
