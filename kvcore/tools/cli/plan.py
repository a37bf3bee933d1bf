"""``kvcore plan`` and ``kvcore compare``: how many requests of each length fit.

``plan`` prints the verdict, the groups, the stride and the capacity at each
context (or the JSON document of :mod:`kvcore.tools.cli.document`), and can draw
the block and the capacity curve.  ``compare`` plans the same model and
memory with every policy and sets them side by side.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import attrs
from rich.console import Console
from rich.table import Table

from kvcore.config import PACKING_POLICIES
from kvcore.engines import EngineEstimate
from kvcore.tools.cli.console import make_console
from kvcore.tools.cli.document import plan_document
from kvcore.tools.cli.options import (
    CliUsageError,
    Planned,
    plan_from_args,
)
from kvcore.tools.cli.parsers import COMPARE_SCHEMA_VERSION
from kvcore.tools.report import print_summary
from kvcore.tools.summary import PlanSummary, summarize
from kvcore.tools.units import format_size, format_tokens

__all__ = ["setting_text", "summary_of", "vllm_estimate_of", "vllm_lines"]

#: The policy that reproduces vLLM's own plan (the ``kvcore_vllm`` plugin).
VLLM_POLICY = "vllm"


def setting_text(planned: Planned, dtype_name: str) -> str:
    """``" on 2x H100 80GB (TP 2), fp8 KV cache"``: what the verdict is about."""
    tp = planned.choices.tensor_parallel_size
    budget = planned.budget
    if budget.gpu is not None:
        text = f" on {tp}x {budget.gpu.name}"
        if tp > 1:
            text += f" (TP {tp})"
    else:
        text = f" in {format_size(budget.kv_bytes)} of KV cache"
        if tp > 1:
            text += f" per rank, TP {tp}"
    if planned.stage is not None:
        stage, stages = planned.stage
        text += f", pipeline stage {stage} of {stages}"
    served = planned.served
    if planned.choices.kv_cache_dtype is not None and len(
        served.dtype_kept_layers
    ) < len(served.layers):
        text += f", {dtype_name} KV cache"
    return text


def summary_of(planned: Planned, dtype_name: str = "auto") -> PlanSummary:
    """The summary every output of ``kvcore plan`` is drawn from."""
    notes = list(planned.served.notes)
    if planned.mapped:
        notes.extend(_mapping_notes(planned.model.notes))
    if planned.budget.gpu is not None:
        notes.insert(0, planned.budget.budget_line() or planned.budget.describe())
        if not planned.budget.weights_bytes:
            notes.insert(
                1,
                "warning: no weights set aside: pass --weights SIZE (or add "
                "weights_bytes to the model file) for a device's real KV budget",
            )
    positions = planned.model.max_position_embeddings
    longer = [c for c in planned.contexts if positions and c > positions]
    if positions and longer:
        notes.insert(
            0,
            f"warning: {', '.join(format_tokens(c) for c in longer)} tokens is past "
            f"the model's max_position_embeddings ({positions:,}); it was not "
            "trained for requests that long, and vLLM refuses them unless "
            "--max-model-len is raised with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1",
        )
    if planned.mix_dropped:
        notes.append(
            f"{planned.mix_dropped} of the workload's requests pass --max-model-len "
            "and are left out of it: the engine refuses them"
        )
    if planned.stage is not None:
        stage, stages = planned.stage
        notes.append(
            f"pipeline parallel {stages}: every stage runs one block count, the "
            f"smallest stage's; stage {stage} ({len(planned.specs)} of "
            f"{len(planned.served.layers)} cache layers) sets it and is the one "
            "planned here"
        )
    summary = summarize(
        planned.plan,
        planned.contexts,
        model_name=planned.model.name,
        specs=planned.specs,
        memory=planned.memory,
        setting=setting_text(planned, dtype_name),
        notes=notes,
        registry=planned.registry,
        mix=planned.mix,
    )
    if planned.max_num_seqs is None:
        return summary
    note = _seqs_note(summary.rows[0].concurrency, planned.max_num_seqs)
    return attrs.evolve(summary, notes=(note, *summary.notes))


def _mapping_notes(notes: str) -> list[str]:
    """The notes of a model mapped from a ``config.json``: the defaults its
    mapper applied and how its weights were found."""
    keep = ("defaults applied", "weights ", "KV cache dtype")
    return [n for n in notes.split("; ") if n.startswith(keep)]


def _seqs_note(fit: int, cap: int) -> str:
    """The engine's ``--max-num-seqs`` next to the requests that fit."""
    noun = "request fits" if fit == 1 else "requests fit"
    if fit > cap:
        return (
            f"{fit} {noun}; vLLM would run at most --max-num-seqs {cap} at once "
            "(the rest wait in its queue)"
        )
    return f"{fit} {noun}, within --max-num-seqs {cap}"


def vllm_estimate_of(planned: Planned) -> EngineEstimate | None:
    """What vLLM 0.33 would plan for the same layers and memory (the ``vllm``
    policy), or ``None`` when no plugin models it."""
    return planned.registry.engine_estimate(
        VLLM_POLICY, planned.config, planned.specs, planned.memory, planned.contexts
    )


def vllm_lines(estimate: EngineEstimate | None) -> list[str]:
    """vLLM's two logged figures per context, or its refusal, as text."""
    if estimate is None:
        return []
    head = f"{estimate.engine} (policy {estimate.policy}; {'; '.join(estimate.notes)})"
    if estimate.refusal is not None:
        return [f"{head} refuses this model: {estimate.refusal}"]
    lines = [f"{head} would log:"]
    lines.extend(
        f"  --max-model-len {f.context}: GPU KV cache size: {f.tokens:,} tokens, "
        f"Maximum concurrency for {f.context:,} tokens per request: "
        f"{f.concurrency:.2f}x"
        for f in estimate.figures
    )
    return lines


def _estimate_dict(estimate: EngineEstimate) -> dict[str, object]:
    return {
        "policy": estimate.policy,
        "engine": estimate.engine,
        "refusal": estimate.refusal,
        "groups": estimate.num_groups,
        "bytes_per_block": estimate.bytes_per_block,
        "num_blocks": estimate.num_blocks,
        "capacity": [
            {"context": f.context, "tokens": f.tokens, "concurrency": f.concurrency}
            for f in estimate.figures
        ],
        "notes": list(estimate.notes),
    }


def _draw(planned: Planned, summary: PlanSummary, path: str, fmt: str) -> None:
    from kvcore.tools.memory_bars import device_bar
    from kvcore.tools.picture import capacity_curve, save_plan_figure

    target = Path(path)
    if not path or path.endswith(("/", "\\")) or target.suffix.lower() != f".{fmt}":
        msg = f"--{fmt} writes {fmt.upper()}; name a .{fmt} file, got {path!r}"
        raise CliUsageError(msg)
    curve = capacity_curve(
        planned.plan,
        max(min(planned.contexts) // 4, 256),
        max(planned.contexts) * 4,
        specs=planned.specs,
        memory=planned.memory,
    )
    budget = planned.budget
    device = None
    if budget.gpu is not None:
        device = device_bar(
            f"{budget.gpu.name} (1 rank)" if budget.ranks > 1 else budget.gpu.name,
            budget.gpu.memory_bytes,
            budget.weights_per_rank,
            budget.kv_bytes,
        )
    try:
        save_plan_figure(
            planned.plan,
            [row.capacity for row in summary.rows],
            target,
            title=summary.verdict(),
            fmt=fmt,
            curve=curve,
            device=device,
        )
    except OSError as exc:
        msg = f"cannot write --{fmt} {path}: {exc.strerror or exc}"
        raise CliUsageError(msg) from exc


def _cmd_plan(args: argparse.Namespace) -> int:
    planned = plan_from_args(args)
    summary = summary_of(planned, args.kv_cache_dtype)
    if args.svg is not None:
        _draw(planned, summary, args.svg, "svg")
    if args.png is not None:
        _draw(planned, summary, args.png, "png")
    estimate = vllm_estimate_of(planned)
    if args.json:
        doc = plan_document(planned, summary, dtype_name=args.kv_cache_dtype)
        if estimate is not None:
            doc["vllm"] = _estimate_dict(estimate)
        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
        return 0
    print_summary(summary, _console(), extra=vllm_lines(estimate))
    return 0


def _console() -> Console:
    return make_console()


def _gain(concurrency: int, estimate: EngineEstimate | None, context: int) -> str:
    figure = estimate.figure(context) if estimate is not None else None
    if figure is None or not figure.concurrency:
        return "-"
    return f"{concurrency / figure.concurrency:.2f}x"


def _cmd_compare(args: argparse.Namespace) -> int:
    results = []
    for policy in PACKING_POLICIES:
        planned = plan_from_args(args, policy=policy)
        results.append((policy, planned, summary_of(planned, args.kv_cache_dtype)))
    estimate = vllm_estimate_of(results[0][1])
    if args.json:
        kvcore_rows = [
            {
                "policy": policy,
                "groups": len(s.groups),
                "bytes_per_block": s.plan.bytes_per_block,
                "num_blocks": s.plan.num_blocks,
                "capacity": [
                    {
                        **r.to_dict(),
                        "gain_over_vllm": _ratio(r.concurrency, estimate, r.context),
                    }
                    for r in s.rows
                ],
                "workload": None if s.workload is None else s.workload.to_dict(),
            }
            for policy, _, s in results
        ]
        vllm_rows = [] if estimate is None else [_estimate_dict(estimate)]
        out = {
            "schema": COMPARE_SCHEMA_VERSION,
            "model": results[0][1].model.name,
            "memory": results[0][1].budget.to_dict(),
            "policies": vllm_rows + kvcore_rows,
        }
        sys.stdout.write(json.dumps(out, indent=1) + "\n")
        return 0
    first = results[0][2]
    table = Table(
        title=f"{first.model_name}{first.setting}: every policy on the same memory",
        title_justify="left",
        box=None,
        pad_edge=False,
    )
    table.add_column("policy")
    table.add_column("groups", justify="right")
    table.add_column("stride", justify="right")
    table.add_column("blocks", justify="right")
    contexts = results[0][1].contexts
    # Under a --context mix, the requests of the mix each policy's plan
    # holds, against seed's (the engine's figures are per context only).
    seed_fit = next(
        (s.workload.concurrency for p, _, s in results if p == "seed" and s.workload),
        None,
    )
    mixed = first.workload is not None
    if mixed:
        table.add_column("workload: requests", justify="right")
        table.add_column("vs seed", justify="right")
    for context in contexts:
        table.add_column(f"{format_tokens(context)}: requests (ratio)", justify="right")
        table.add_column("vs vllm", justify="right")
    if estimate is not None:
        table.add_row(*_vllm_cells(estimate, contexts, mixed=mixed))
    for policy, _, s in results:
        cells = [
            policy,
            str(len(s.groups)),
            format_size(s.plan.bytes_per_block),
            f"{s.plan.num_blocks:,}",
        ]
        if mixed:
            fit = s.workload.concurrency if s.workload is not None else None
            cells.append("-" if fit is None else str(fit))
            cells.append(
                f"{fit / seed_fit:.2f}x" if fit is not None and seed_fit else "-"
            )
        for row in s.rows:
            cells.append(f"{row.concurrency} ({row.ratio:.3f})")
            cells.append(_gain(row.concurrency, estimate, row.context))
        table.add_row(*cells)
    console = _console()
    console.print(table)
    budget = results[0][1].budget
    line = budget.budget_line()
    if line is not None:
        console.print(line, markup=False, highlight=False)
        if not budget.weights_bytes:
            console.print(
                "warning: no weights set aside: pass --weights SIZE (or add "
                "weights_bytes to the model file) for a device's real KV budget",
                markup=False,
                highlight=False,
            )
    if estimate is not None:
        console.print(
            f"vllm: what {estimate.engine} logs as its maximum concurrency "
            f"({'; '.join(estimate.notes)})"
            + (
                f"; it refuses this model: {estimate.refusal}"
                if estimate.refused
                else ""
            )
        )
    return 0


def _ratio(
    concurrency: int, estimate: EngineEstimate | None, context: int
) -> float | None:
    figure = estimate.figure(context) if estimate is not None else None
    if figure is None or not figure.concurrency:
        return None
    return concurrency / figure.concurrency


def _vllm_cells(
    estimate: EngineEstimate, contexts: tuple[int, ...], *, mixed: bool = False
) -> list[str]:
    workload = ["-", "-"] if mixed else []
    if estimate.refused:
        return ["vllm", "-", "-", "-", *workload, *(["refused", "-"] * len(contexts))]
    cells = [
        "vllm",
        str(estimate.num_groups),
        format_size(estimate.bytes_per_block),
        f"{estimate.num_blocks:,}",
        *workload,
    ]
    for context in contexts:
        figure = estimate.figure(context)
        cells.append(f"{figure.concurrency:.2f}" if figure else "-")
        cells.append("1.00x" if figure else "-")
    return cells
