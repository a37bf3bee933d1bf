"""Human-readable reports of a plan: a plain-text table and a rich one."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvcore.plan.block_sizes import plan_hit_granularity
from kvcore.structs import KVCacheConfig
from kvcore.tools.summary import GroupSummary, PlanSummary
from kvcore.tools.units import format_size, format_sizes, format_tokens

#: Why each built-in policy is chosen, for the plan's report.
POLICY_REASONS = {
    "min_waste": "the grouping and block sizes that hold the most requests of "
    "the target context (a search over one-stride plans)",
    "seed": "the reference grouping rules, file block sizes kept",
}

__all__ = ["format_bytes", "format_plan", "print_summary", "render_summary"]


def format_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    return format_size(n)


def format_plan(config: KVCacheConfig, *, title: str = "KV cache plan") -> str:
    """A table of the plan's groups: kinds, layers, bytes per block and fill."""
    bpb = config.bytes_per_block
    lines = [
        f"{title}",
        f"  layout {config.kv_cache_layout.name if config.kv_cache_layout else '?'}, "
        f"{len(config.kv_cache_groups)} groups, {config.num_blocks} blocks of "
        f"{format_bytes(bpb)} ({format_bytes(bpb * config.num_blocks)} in one allocation)",
        "",
        f"  {'group':>5}  {'kinds':<34} {'layers':>6} {'block':>6} {'bytes/block':>12} {'fill':>6}",
    ]
    if config.packing_policy:
        reason = POLICY_REASONS.get(config.packing_policy, "")
        lines.insert(
            2,
            f"  policy {config.packing_policy} for {config.target_context} tokens: {reason}",
        )
    hits = plan_hit_granularity(config)
    if hits is not None:
        lines.insert(
            3 if config.packing_policy else 2,
            f"  scheduler block {config.scheduler_block_size} tokens, hash block "
            f"{config.hash_block_size} tokens; prefix hits are multiples of {hits} tokens",
        )
    for i, group in enumerate(config.kv_cache_groups):
        kinds = Counter(group.layer_spec(n).kind for n in group.layer_names)
        kind_text = ", ".join(f"{k}x{v}" for k, v in kinds.items())
        packed = group.packed_bytes
        fill = f"{100 * packed / bpb:.0f}%" if bpb else "-"
        lines.append(
            f"  {i:>5}  {kind_text:<34} {len(group.layer_names):>6} "
            f"{group.kv_cache_spec.block_size:>6} {packed:>12} {fill:>6}"
        )
    return "\n".join(lines)


def _kinds(group: GroupSummary) -> str:
    return ", ".join(
        f"{kind} x{count}" if count > 1 else kind for kind, count in group.kinds.items()
    )


#: Below this many columns the groups print as lines rather than a table.
NARROW = 110


def _groups_lines(summary: PlanSummary) -> Text:
    """The groups for a narrow terminal: one line of figures, then the
    layers, each group."""
    text = Text("cache groups (they overlay each other: a block is one group's)\n")
    for g in summary.groups:
        text.append(
            f"{g.index:>3}  {_kinds(g)}: {g.block_size} tok, "
            f"{format_size(g.packed_bytes)}, {100 * g.fill:.1f}% full, {g.role}\n"
        )
        for layers in g.layer_ranges:
            text.append(f"     {layers}\n", style="dim")
    return text


def _table(title: str) -> Table:
    """A borderless table with its title on the left."""
    return Table(title=title, title_justify="left", box=None, pad_edge=False)


def _groups_table(summary: PlanSummary) -> Table:
    table = _table("cache groups (they overlay each other: a block is one group's)")
    for name, justify in (
        ("group", "right"),
        ("layers", "left"),
        ("kind", "left"),
        ("block", "right"),
        ("packed", "right"),
        ("fill", "right"),
        ("prefix", "left"),
    ):
        table.add_column(
            name,
            justify=justify,  # type: ignore[arg-type]
            overflow="fold",
            no_wrap=name != "layers",
        )
    for g in summary.groups:
        table.add_row(
            str(g.index),
            "\n".join(g.layer_ranges),
            _kinds(g),
            f"{g.block_size} tok",
            format_size(g.packed_bytes),
            f"{100 * g.fill:.1f}%",
            g.role,
        )
    return table


def _limit_text(limit: float) -> str:
    """The physical limit to one decimal, rounded down: 47.96 is ``47.9``,
    never ``48.0`` beside a verdict whose whole-request limit is 47."""
    return f"{math.floor(limit * 10 * (1 + 1e-12)) / 10:.1f}"


def _capacity_table(summary: PlanSummary) -> Table:
    table = _table("capacity (limit: every layer's own pages, no padding, no reserve)")
    for name in ("context", "requests", "tokens", "limit", "ratio", "per request"):
        table.add_column(name, justify="right")
    for row in summary.rows:
        c = row.capacity
        if not row.fits:
            _, need = format_sizes(summary.memory, row.bytes_for_one)
            table.add_row(
                format_tokens(c.context),
                "0",
                "0",
                _limit_text(c.ideal_concurrency),
                "-",
                f"needs {need} for one",
            )
            continue
        table.add_row(
            format_tokens(c.context),
            str(c.concurrency),
            f"{c.tokens:,}",
            _limit_text(c.ideal_concurrency),
            f"{row.ratio:.3f}",
            f"{c.blocks_per_request} blocks, {format_size(c.bytes_per_request)}",
        )
    return table


def workload_line(summary: PlanSummary) -> str | None:
    """The capacity under the ``--context`` mix, in one line."""
    w = summary.workload
    if w is None:
        return None
    grain = (
        f"; prefix hits in multiples of {w.hit_granularity} tokens"
        if w.hit_granularity
        else ""
    )
    return (
        f"under the workload ({w.mix.describe()}): {w.concurrency} requests "
        f"({float(w.blocks_per_request):.1f} blocks a request on average, "
        f"{w.prefill_peak_blocks} for the longest one's prefill{grain})"
    )


def render_summary(summary: PlanSummary, *, width: int | None = None) -> RenderableType:
    """The report ``kvcore plan`` prints: the verdict first, then the groups,
    the stride and the capacity at each context."""
    plan = summary.plan
    parts: list[RenderableType] = [Text(summary.verdict(), style="bold")]
    for note in summary.notes:
        parts.append(Text(f"  {note}", style="dim"))
    layout = plan.kv_cache_layout.name if plan.kv_cache_layout else "?"
    lines = [
        f"policy {plan.packing_policy or '?'}"
        + (
            f" for {format_tokens(plan.target_context)} tokens"
            if plan.target_context
            else ""
        )
        + f", layout {layout}, {len(summary.groups)} groups",
        f"stride {format_size(plan.bytes_per_block)} ({plan.bytes_per_block} B): "
        f"{summary.stride_reason()}",
        f"{plan.num_blocks:,} blocks in {format_size(summary.memory)} "
        f"(block 0 is the null block)",
    ]
    hits = summary.hit_granularity
    if hits is not None:
        whole = plan_hit_granularity(plan, partial_hits=False)
        copied = (
            f"; {whole} without partial-block copies"
            if whole is not None and whole != hits
            else ""
        )
        lines.append(
            f"prefix hits are multiples of {hits} tokens (hash block "
            f"{plan.hash_block_size}, scheduler block {plan.scheduler_block_size}"
            f"{copied})"
        )
    parts.append(Text("\n".join(lines)))
    parts.append(Text(""))
    narrow = width is not None and width < NARROW
    parts.append(_groups_lines(summary) if narrow else _groups_table(summary))
    parts.append(Text(""))
    parts.append(_capacity_table(summary))
    line = workload_line(summary)
    if line is not None:
        parts.append(Text(line, style="bold"))
    return Group(*parts)


def print_summary(
    summary: PlanSummary, console: Console | None = None, *, extra: Sequence[str] = ()
) -> None:
    """Print :func:`render_summary` (to stdout unless ``console`` says)."""
    console = console or Console(highlight=False, soft_wrap=False)
    console.print(render_summary(summary, width=console.width))
    for line in extra:
        console.print(line)
