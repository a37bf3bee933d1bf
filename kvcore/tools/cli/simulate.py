"""``kvcore simulate``: replay a workload through the real coordinator.

The model is planned as ``kvcore plan`` plans it (the shared options of
:mod:`kvcore.tools.cli.options`); the workload is a trace file (``--trace``) or
drawn from the synthetic options; the run is
:class:`kvcore.tools.simulate.Driver` with the plan's ``--max-num-batched-tokens``
as the step budget.  The figures print as a table, or as JSON with
``--json``.  A progress bar is drawn on stderr only when it is a terminal
and the run takes more than a couple of seconds.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from kvcore.plan.block_sizes import plan_hit_granularity
from kvcore.tools.choices import DEFAULT_DECODE_RATE, DEFAULT_PREFILL_RATE
from kvcore.tools.cli.console import make_console
from kvcore.tools.cli.options import (
    CliUsageError,
    Planned,
    plan_from_args,
)
from kvcore.tools.cli.parsers import SIMULATE_SCHEMA_VERSION
from kvcore.tools.limits import MAX_WORKLOAD_REQUESTS
from kvcore.tools.simulate import (
    NAMED_WORKLOADS,
    Driver,
    SimulationResult,
    Workload,
    parse_distribution,
    synthetic_workload,
)
from kvcore.tools.simulate.public_traces import (
    LoadedTrace,
    TraceCeiling,
    load_any_trace,
)
from kvcore.tools.units import format_size

__all__ = ["SCHEMA_VERSION"]

#: JSON schema version of ``kvcore simulate --json``.
SCHEMA_VERSION = SIMULATE_SCHEMA_VERSION

#: The synthetic options and their defaults (``None`` in the parser, so a
#: synthetic option next to ``--trace`` can be refused).
SYNTHETIC_DEFAULTS: dict[str, str | None] = {
    "requests": "64",
    "prompt_len": "1024",
    "output_len": "128",
    "shared_prefixes": "0",
    "prefix_len": None,
    "turns": "1",
    "arrival_gap": "0",
    "seed": "0",
}

#: Seconds a run goes before its progress bar appears.
PROGRESS_DELAY_S = 2.0


def _int(text: str, option: str, low: int, high: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low:
        msg = f"{option} takes an int >= {low}, got {text!r}"
        raise CliUsageError(msg)
    if high is not None and value > high:
        msg = f"{option} takes at most {high:,}, got {value:,}"
        raise CliUsageError(msg)
    return value


def _rate(text: str | None, option: str, default: float) -> float:
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        msg = f"{option} takes a positive number, got {text!r}"
        raise CliUsageError(msg)
    return value


def _trace_only(args: argparse.Namespace) -> None:
    """Refuse the trace options without ``--trace``."""
    if args.trace is not None:
        return
    for option, value in (
        ("--trace-format", args.trace_format),
        ("--trace-block-tokens", args.trace_block_tokens),
        ("--no-timing", args.no_timing or None),
    ):
        if value is not None:
            msg = f"{option} shapes how a --trace file is read; give --trace FILE"
            raise CliUsageError(msg)


def _workload(
    args: argparse.Namespace,
) -> tuple[Workload, dict[str, Any], LoadedTrace | None]:
    given = [
        "--" + name.replace("_", "-")
        for name in SYNTHETIC_DEFAULTS
        if getattr(args, name) is not None
    ]
    preset: dict[str, str] = {}
    if args.workload is not None:
        if args.trace is not None:
            msg = (
                "--workload names a synthetic workload; a --trace file already "
                "gives every request, so give one of them"
            )
            raise CliUsageError(msg)
        found = NAMED_WORKLOADS.get(args.workload)
        if found is None:
            msg = (
                f"--workload takes one of {', '.join(NAMED_WORKLOADS)}, got "
                f"{args.workload!r}"
            )
            raise CliUsageError(msg)
        preset = found
    if args.trace is not None:
        if given:
            msg = (
                f"{', '.join(given)} shape a synthetic workload; a --trace file "
                "already gives every request, so drop them"
            )
            raise CliUsageError(msg)
        block_tokens = (
            None
            if args.trace_block_tokens is None
            else _int(args.trace_block_tokens, "--trace-block-tokens", 1)
        )
        loaded = load_any_trace(
            args.trace,
            trace_format=args.trace_format,
            timing=not args.no_timing,
            block_tokens=block_tokens,
        )
        info: dict[str, Any] = {
            "trace": args.trace,
            "format": loaded.format,
            "block_tokens": loaded.block_tokens,
            "timed": loaded.workload.timed,
            "chat_turns": loaded.chat_turns,
        }
        return loaded.workload, info, loaded
    # An explicit option wins over the named workload's, which wins over the
    # default.
    values: dict[str, str] = {}
    for name, default in SYNTHETIC_DEFAULTS.items():
        value = getattr(args, name)
        if value is None:
            value = preset.get(name, default)
        if value is not None:
            values[name] = str(value)
    shared = _int(values["shared_prefixes"], "--shared-prefixes", 0)
    if "prefix_len" not in values:
        if shared:
            msg = "--shared-prefixes needs --prefix-len, the tokens of each prefix"
            raise CliUsageError(msg)
        prefix_len = 0
    else:
        prefix_len = _int(values["prefix_len"], "--prefix-len", 1)
    if prefix_len and not shared and args.prefix_len is None:
        prefix_len = 0  # the named workload's prefixes, turned off
    if prefix_len and not shared:
        msg = (
            "--prefix-len sets the length of shared prefixes; give --shared-prefixes K"
        )
        raise CliUsageError(msg)
    requests = _int(values["requests"], "--requests", 1, MAX_WORKLOAD_REQUESTS)
    prompt_len = parse_distribution(values["prompt_len"], what="--prompt-len")
    output_len = parse_distribution(values["output_len"], what="--output-len")
    turns = _int(values["turns"], "--turns", 1)
    gap = parse_distribution(values["arrival_gap"], what="--arrival-gap", minimum=0)
    seed = _int(values["seed"], "--seed", 0)
    workload = synthetic_workload(
        requests,
        prompt_len=prompt_len,
        output_len=output_len,
        shared_prefixes=shared,
        prefix_len=prefix_len,
        turns=turns,
        arrival_gap=gap,
        seed=seed,
    )
    options = {
        **({"workload": args.workload} if args.workload is not None else {}),
        "requests": requests,
        "prompt_len": str(prompt_len),
        "output_len": str(output_len),
        "shared_prefixes": shared,
        "prefix_len": prefix_len,
        "turns": turns,
        "arrival_gap": str(gap),
        "seed": seed,
    }
    return workload, {"synthetic": options}, None


class _ProgressBar:
    """A rich bar on stderr that appears only once a run has gone on for
    :data:`PROGRESS_DELAY_S` seconds (and only on a terminal)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.start = time.monotonic()
        self.bar: Progress | None = None
        self.task: Any = None

    def __call__(self, step: int, resolved: int, total: int) -> None:
        if self.bar is None:
            if time.monotonic() - self.start < PROGRESS_DELAY_S:
                return
            self.bar = Progress(
                TextColumn("simulating"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("requests, step {task.fields[step]}"),
                console=Console(file=sys.stderr),
                transient=True,
            )
            self.bar.start()
            self.task = self.bar.add_task("run", total=total, step=step)
        self.bar.update(self.task, completed=resolved, step=step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _memories(args: argparse.Namespace) -> list[str | None]:
    """The ``--memory`` values: one, or a comma-separated list (a sweep)."""
    if args.memory is None or "," not in args.memory:
        return [args.memory]
    values = [v.strip() for v in args.memory.split(",")]
    if any(not v for v in values):
        msg = f"--memory takes a size or a comma-separated list of sizes, got {args.memory!r}"
        raise CliUsageError(msg)
    return list(values)


def _plan_doc(planned: Planned) -> dict[str, Any]:
    return {
        "packing_policy": planned.plan.packing_policy,
        "num_blocks": planned.plan.num_blocks,
        "bytes_per_block": planned.plan.bytes_per_block,
        "scheduler_block_size": planned.plan.scheduler_block_size,
        "hash_block_size": planned.plan.hash_block_size,
        "enable_prefix_caching": planned.plan.enable_prefix_caching,
    }


def _ceiling_doc(
    ceiling: TraceCeiling | None, result: SimulationResult
) -> dict[str, Any] | None:
    if ceiling is None:
        return None
    doc = ceiling.to_dict()
    doc["hit_rate_over_ceiling"] = (
        result.prefix_hit_rate / ceiling.rate if ceiling.rate else None
    )
    return doc


def _cmd_simulate(args: argparse.Namespace) -> int:
    _trace_only(args)
    memories = _memories(args)
    if (args.png is not None or args.svg is not None) and args.memory is None:
        msg = "--png and --svg draw hit rate against --memory; give --memory SIZES"
        raise CliUsageError(msg)
    workload, source, loaded = _workload(args)
    max_steps = (
        None if args.max_steps is None else _int(args.max_steps, "--max-steps", 1)
    )
    prefill_rate = _rate(args.prefill_rate, "--prefill-rate", DEFAULT_PREFILL_RATE)
    decode_rate = _rate(args.decode_rate, "--decode-rate", DEFAULT_DECODE_RATE)
    runs: list[tuple[Planned, SimulationResult, TraceCeiling | None]] = []
    for memory in memories:
        one = copy.copy(args)
        one.memory = memory
        planned = plan_from_args(one)
        driver = Driver(
            planned.plan,
            registry=planned.registry,
            max_num_batched_tokens=planned.config.max_num_batched_tokens,
            keep_finished=args.keep_finished,
            max_steps=max_steps,
            validate=args.validate,
            prefill_rate=prefill_rate,
            decode_rate=decode_rate,
        )
        bar = _ProgressBar(len(workload)) if sys.stderr.isatty() else None
        try:
            result = driver.run(workload, progress=bar)
        finally:
            if bar is not None:
                bar.close()
        ceiling = (
            None
            if loaded is None
            else loaded.ceiling(plan_hit_granularity(planned.plan) or 1)
        )
        runs.append((planned, result, ceiling))
    workload_doc = {
        **source,
        "requests": len(workload),
        "prompt_tokens": workload.prompt_tokens,
        "output_tokens": workload.output_tokens,
    }
    clock = {"prefill_rate": prefill_rate, "decode_rate": decode_rate}
    if args.json:
        docs = [
            {
                "memory": planned.budget.to_dict(),
                "plan": _plan_doc(planned),
                "ceiling": _ceiling_doc(ceiling, result),
                "result": result.to_dict(),
            }
            for planned, result, ceiling in runs
        ]
        doc: dict[str, Any] = {
            "schema": SCHEMA_VERSION,
            "model": runs[0][0].model.name,
            **docs[0],
            "workload": workload_doc,
            "clock": clock,
            "keep_finished": args.keep_finished,
            "validate": args.validate,
        }
        if len(runs) > 1:
            doc["runs"] = docs
        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
    else:
        for planned, result, ceiling in runs:
            _print(planned.model.name, planned.memory, workload, result, ceiling)
            line = planned.budget.budget_line()
            if line is not None:
                make_console().print(line, markup=False, highlight=False)
        if len(runs) > 1:
            _print_curve(runs)
    for target, fmt in ((args.svg, "svg"), (args.png, "png")):
        if target is not None:
            _draw_curve(runs, target, fmt)
    return 0


def _draw_curve(
    runs: list[tuple[Planned, SimulationResult, TraceCeiling | None]],
    target: str,
    fmt: str,
) -> None:
    from kvcore.tools.simulate.figure import CurvePoint, save_hit_rate_curve

    points = [
        CurvePoint(p.memory, r.prefix_hit_rate, r.bound_rate, r.preemptions)
        for p, r, _ in runs
    ]
    ceiling = runs[0][2]
    save_hit_rate_curve(
        points,
        target,
        title=f"{runs[0][0].model.name}: prefix-hit rate against KV cache memory",
        ceiling=None if ceiling is None else ceiling.rate,
        fmt=fmt,
    )


def _print_curve(
    runs: list[tuple[Planned, SimulationResult, TraceCeiling | None]],
) -> None:
    console = make_console()
    table = Table(
        title="hit rate against memory", title_justify="left", box=None, pad_edge=False
    )
    for name in ("memory", "blocks", "hit rate", "of ceiling", "bound", "preemptions"):
        table.add_column(name, justify="right")
    for planned, result, ceiling in runs:
        share = (
            "-"
            if ceiling is None or not ceiling.rate
            else f"{result.prefix_hit_rate / ceiling.rate:.1%}"
        )
        table.add_row(
            format_size(planned.memory),
            f"{result.num_blocks - 1:,}",
            f"{result.prefix_hit_rate:.1%}",
            share,
            f"{result.bound_rate:.1%}",
            f"{result.preemptions:,}",
        )
    console.print()
    console.print(table)


def _print(
    model: str,
    memory: int,
    workload: Workload,
    result: SimulationResult,
    ceiling: TraceCeiling | None = None,
) -> None:
    console = make_console()
    usable = result.num_blocks - 1
    table = Table(
        title=f"{model} in {format_size(memory)} of KV cache: {len(workload)} requests, "
        f"{usable:,} usable blocks, {result.max_num_batched_tokens:,} tokens a step",
        title_justify="left",
        box=None,
        pad_edge=False,
        show_header=False,
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = [
        ("requests completed", f"{result.completed:,} of {result.requests:,}"),
        ("steps", f"{result.steps:,}"),
        ("tokens generated", f"{result.tokens_generated:,}"),
        ("tokens computed (recompute included)", f"{result.computed_tokens:,}"),
        (
            "prefix hits",
            f"{result.prefix_hit_tokens:,} of {result.prompt_tokens_looked_up:,} "
            f"tokens ({result.prefix_hit_rate:.1%})",
        ),
        (
            "of them re-admissions after preemption",
            f"{result.readmitted_hit_tokens:,} of "
            f"{result.readmitted_tokens_looked_up:,} tokens",
        ),
        ("hit rate at first admissions", f"{result.first_admission_hit_rate:.1%}"),
        (
            "token-level bound",
            f"{result.token_bound_tokens:,} tokens ({result.bound_rate:.1%})",
        ),
        *(
            []
            if ceiling is None
            else [
                (
                    "trace ceiling (unbounded cache)",
                    f"{ceiling.ceiling_tokens:,} of {ceiling.input_tokens:,} "
                    f"tokens ({ceiling.rate:.1%})",
                ),
                (
                    "hit rate over the ceiling",
                    f"{result.prefix_hit_rate / ceiling.rate:.1%}"
                    if ceiling.rate
                    else "-",
                ),
            ]
        ),
        (
            "peak blocks in use",
            f"{result.peak_blocks_in_use:,} of {usable:,} ({result.peak_usage:.1%})",
        ),
        ("mean blocks in use", f"{result.mean_blocks_in_use:,.1f}"),
        ("peak requests holding blocks", f"{result.peak_running:,}"),
        ("mean requests holding blocks", f"{result.mean_running:,.1f}"),
        *([("simulated time", f"{result.clock_s:,.1f} s")] if result.timed else []),
        ("refused steps", f"{result.refused_steps:,}"),
        ("preemptions", f"{result.preemptions:,}"),
        ("admissions refused (waited)", f"{result.admission_refusals:,}"),
    ]
    rows.append(
        (
            "peak cached blocks (of them states)",
            f"{result.peak_cached_blocks:,} ({result.peak_cached_state_blocks:,})",
        )
    )
    rows.append(("prefix-cache evictions", f"{result.evictions:,}"))
    if result.validated:
        rows.append(
            (
                "invalid hits (content oracle)",
                f"{result.invalid_hits:,} of {result.checked_hits:,} checked",
            )
        )
    if result.unserved:
        rows.append(("unserved requests", f"{len(result.unserved):,}"))
    if result.unfinished:
        rows.append(("unfinished at --max-steps", f"{len(result.unfinished):,}"))
    for row in rows:
        table.add_row(*row)
    console.print(table)
    groups = Table(
        title="blocks per cache group", title_justify="left", box=None, pad_edge=False
    )
    for name in ("group", "kinds", "block", "peak", "mean", "cached peak", "mean"):
        groups.add_column(name, justify="left" if name == "kinds" else "right")
    for g in result.groups:
        groups.add_row(
            str(g.group),
            ", ".join(g.kinds),
            str(g.block_size),
            f"{g.peak_blocks:,}",
            f"{g.mean_blocks:,.1f}",
            f"{g.peak_cached_blocks:,}",
            f"{g.mean_cached_blocks:,.1f}",
        )
    console.print()
    console.print(groups)
    for report in result.invalid_hit_reports:
        console.print(f"invalid hit: {report}")
    for u in result.unserved[:5]:
        console.print(f"unserved {u.id}: {u.reason}")
    if len(result.unserved) > 5:
        console.print(f"... and {len(result.unserved) - 5} more unserved (see --json)")
