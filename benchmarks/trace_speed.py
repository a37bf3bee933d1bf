"""Trace replay speed: a 12,000-request Mooncake trace through the simulator.

The trace is the shared Mooncake trace repeated with disjoint ids until it
holds ``--requests`` requests (:func:`long_trace.long_trace_lines`), read
with ``parse_any_trace`` and replayed on its clock by ``Driver.run`` on
``--model`` planned in ``--memory`` (prefix caching on, as ``kvcore simulate``
plans it).  Times are CPU seconds of the process (``time.process_time``), so
other work on a shared machine does not count, beside wall seconds.

    python benchmarks/trace_speed.py
    python benchmarks/trace_speed.py --baseline /path/to/other/checkout

``--baseline`` runs the same measurement on another kvcore checkout (its
``kvcore`` and ``plugins``) and on this one, each in a fresh interpreter,
alternating ``--repeat`` times, and prints both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from long_trace import long_trace_lines

REPO = Path(__file__).resolve().parent.parent
TRACE = REPO.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
if not TRACE.exists():
    TRACE = Path("/work/shared/traces/mooncake_synthetic_trace.jsonl")


def measure(trace: Path, requests: int, model: str, memory: str) -> dict[str, object]:
    """Read and replay the long trace once; CPU and wall seconds of each."""
    from kvcore.tools.cli.options import add_model_options, plan_from_args
    from kvcore.tools.simulate import Driver
    from kvcore.tools.simulate.public_traces import parse_any_trace

    lines = list(long_trace_lines(trace.read_text().splitlines(), requests))
    parser = argparse.ArgumentParser()
    add_model_options(parser)
    planned = plan_from_args(parser.parse_args([model, "--memory", memory]))
    cpu, wall = time.process_time(), time.perf_counter()
    loaded = parse_any_trace(lines, source="long trace")
    read_cpu, read_wall = time.process_time() - cpu, time.perf_counter() - wall
    driver = Driver(
        planned.plan,
        registry=planned.registry,
        max_num_batched_tokens=planned.config.max_num_batched_tokens,
    )
    cpu, wall = time.process_time(), time.perf_counter()
    result = driver.run(loaded.workload)
    run_cpu, run_wall = time.process_time() - cpu, time.perf_counter() - wall
    return {
        "requests": result.requests,
        "completed": result.completed,
        "hit_rate": result.hit_rate,
        "bound_rate": result.bound_rate,
        "read_cpu_s": read_cpu,
        "read_wall_s": read_wall,
        "replay_cpu_s": run_cpu,
        "replay_wall_s": run_wall,
        "total_cpu_s": read_cpu + run_cpu,
    }


def _child(checkout: Path, args: argparse.Namespace) -> dict[str, object]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{checkout}{os.pathsep}{checkout / 'plugins'}"
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            "--trace",
            str(args.trace),
            "--requests",
            str(args.requests),
            "--model",
            args.model,
            "--memory",
            args.memory,
        ],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--requests", type=int, default=12000)
    parser.add_argument("--model", default="llama-3-1-8b")
    parser.add_argument("--memory", default="3TiB")
    parser.add_argument("--baseline", type=Path, default=None)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        figures = measure(args.trace, args.requests, args.model, args.memory)
        sys.stdout.write(json.dumps(figures) + "\n")
        return 0
    sides = [("this checkout", REPO)]
    if args.baseline is not None:
        sides.insert(0, ("baseline", args.baseline.resolve()))
    for _ in range(args.repeat):
        for name, checkout in sides:
            figures = _child(checkout, args)
            print(
                f"{name:14} {figures['requests']:,} requests: read "
                f"{figures['read_cpu_s']:.1f} s, replay {figures['replay_cpu_s']:.1f} s "
                f"CPU (wall {figures['replay_wall_s']:.1f} s), total "
                f"{figures['total_cpu_s']:.1f} s CPU; hit rate "
                f"{figures['hit_rate']:.4%}, bound {figures['bound_rate']:.4%}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
