"""A picture of a plan: where the bytes of one block go, and what it holds.

The top panel draws one block of the pool: a row per cache group, its
layers' pages laid across the block stride at their byte offsets, then the
padding up to the stride (hatched).  Groups overlay each other from byte 0,
so the stride is the widest row; every short row is memory a block of that
group never uses.  The bottom panel draws the plan's concurrency against
the physical limit over context lengths, so the cost of that padding (and of
block granularity and the prefill reservation) reads as a gap.

matplotlib is an optional extra (``pip install 'kvcore[plot]'``); it is
imported only when a figure is drawn, and only through
:class:`matplotlib.figure.Figure`, so the user's pyplot backend and state are
left alone.  SVG output is deterministic (fixed hash salt, no date) and every
span carries an id (``layer:<name>``, ``padding:<group>``) so a file can be
checked or styled by layer.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from kvcore.errors import KvcoreValueError, MissingExtraError
from kvcore.plan.block_sizes import effective_block_size
from kvcore.plan.capacity import Capacity, plan_capacity
from kvcore.structs import KVCacheConfig
from kvcore.tools.memory_bars import Bar, draw_memory_bars, request_bars

if TYPE_CHECKING:
    from collections.abc import Mapping

    from matplotlib.axes import Axes

    from kvcore.spec import KVCacheSpec

__all__ = [
    "FORMATS",
    "BlockRow",
    "Span",
    "block_rows",
    "capacity_curve",
    "save_plan_figure",
]

#: Output formats, by file suffix.
FORMATS = ("svg", "png", "pdf")

#: Salt of the ids matplotlib derives for SVG clip paths and hatches: fixed so
#: two drawings of one plan are byte-identical.
_SVG_SALT = "kvcore-plan"

#: A group with at most this many layers gets a name on each wide span.
_LABELLED_LAYERS = 16

_PADDING_FACE = "#e4e4e4"
_PADDING_EDGE = "#8c8c8c"


@attrs.frozen
class Span:
    """A run of bytes inside one block: a layer's page, or padding."""

    start: int
    size: int
    layer: str | None = None
    kind: str | None = None

    @property
    def end(self) -> int:
        return self.start + self.size


@attrs.frozen
class BlockRow:
    """One cache group's bytes in a block: its layers' pages in byte order
    and the padding from the last page to the stride (``None`` when full)."""

    group: int
    kinds: tuple[str, ...]
    block_size: int
    spans: tuple[Span, ...]
    padding: Span | None

    @property
    def used_bytes(self) -> int:
        return sum(s.size for s in self.spans)


def block_rows(plan: KVCacheConfig) -> list[BlockRow]:
    """Each group's layers inside one block of ``plan``, as the pool places
    them.

    In a block-outermost layout a block is one contiguous row, and each
    layer's page sits at its tensor's ``offset + index * layer_stride`` (so
    runs of one spec appear together, in first-appearance order).  In a
    layer-outer layout a block is scattered over per-layer regions; the row
    then lays the layers' pages side by side in packing order, and the
    padding also counts each page's rounding to its stride alignment.
    Pages are the planned specs' (block-size growth included).
    """
    groups = plan.kv_cache_groups
    stride = plan.bytes_per_block
    if not groups or stride <= 0:
        msg = (
            f"the plan has {len(groups)} cache groups and a block of {stride} bytes: "
            "there is no block to draw; plan a model with at least one cache layer"
        )
        raise KvcoreValueError(msg)
    offsets = _page_offsets(plan)
    rows = []
    for i, group in enumerate(groups):
        specs = {n: group.layer_spec(n) for n in group.layer_names}
        if offsets is not None:
            spans = sorted(
                (
                    Span(offsets[n], s.page_size_bytes, layer=n, kind=s.kind)
                    for n, s in specs.items()
                ),
                key=lambda s: s.start,
            )
        else:
            spans, cursor = [], 0
            for n, s in specs.items():
                spans.append(Span(cursor, s.page_size_bytes, layer=n, kind=s.kind))
                cursor += s.page_size_bytes
        end = max(s.end for s in spans)
        if end > stride:
            msg = (
                f"group {i}'s pages end at byte {end}, past the plan's block of "
                f"{stride} bytes: the plan is inconsistent; re-plan it"
            )
            raise KvcoreValueError(msg)
        rows.append(
            BlockRow(
                group=i,
                kinds=tuple(dict.fromkeys(s.kind for s in specs.values())),
                block_size=effective_block_size(
                    group, plan.decode_context_parallel_size
                ),
                spans=tuple(spans),
                padding=Span(end, stride - end) if end < stride else None,
            )
        )
    return rows


def _page_offsets(plan: KVCacheConfig) -> dict[str, int] | None:
    """Each layer's byte offset inside a block, from the plan's tensors;
    ``None`` when a block is not one contiguous row (layer-outer layout, or
    a hand-built plan whose tensors do not place every layer)."""
    layout = plan.kv_cache_layout
    if layout is None or not layout.is_block_outermost:
        return None
    offsets: dict[str, int] = {}
    for tensor in plan.kv_cache_tensors:
        for index, name in enumerate(tensor.layers):
            offsets[name] = tensor.offset + index * tensor.layer_stride
    names = [n for g in plan.kv_cache_groups for n in g.layer_names]
    if any(n not in offsets for n in names):
        return None
    return offsets


def capacity_curve(
    plan: KVCacheConfig,
    start: int,
    stop: int,
    *,
    points: int = 48,
    specs: Mapping[str, KVCacheSpec] | None = None,
    memory: int | None = None,
    max_num_batched_tokens: int | None = None,
) -> list[Capacity]:
    """The plan's capacity at about ``points`` contexts spaced evenly on a
    log scale from ``start`` to ``stop`` tokens (capped at the plan's
    ``max_model_len``): the smooth line of :func:`save_plan_figure`.
    The keywords are :func:`~kvcore.plan.capacity.plan_capacity`'s."""
    if plan.max_model_len is not None:
        stop = min(stop, plan.max_model_len)
    if type(start) is not int or type(stop) is not int or not 1 <= start <= stop:
        msg = (
            f"a capacity curve needs int contexts 1 <= start <= stop (stop capped at "
            f"max_model_len={plan.max_model_len}), got start={start!r}, stop={stop!r}"
        )
        raise KvcoreValueError(msg)
    if type(points) is not int or points < 2:
        msg = f"a capacity curve needs at least 2 points, got {points!r}"
        raise KvcoreValueError(msg)
    ratio = math.log(stop / start)
    contexts = sorted(
        {round(start * math.exp(ratio * k / (points - 1))) for k in range(points)}
        | {start, stop}
    )
    return [
        plan_capacity(
            plan,
            c,
            max_num_batched_tokens=max_num_batched_tokens,
            specs=specs,
            memory=memory,
        )
        for c in contexts
    ]


def save_plan_figure(
    plan: KVCacheConfig,
    capacities: Sequence[Capacity],
    path: str | os.PathLike[str],
    *,
    title: str,
    fmt: str | None = None,
    curve: Sequence[Capacity] | None = None,
    device: Bar | None = None,
) -> None:
    """Draw ``plan`` and write it to ``path``.

    :param capacities: the plan's capacity at the contexts the user asked
        about (:func:`~kvcore.plan.capacity.plan_capacity`), marked as
        points.  With neither these nor ``curve`` the figure has only the
        block panel.
    :param title: the figure's title (say the model and the policy).
    :param fmt: ``"svg"``, ``"png"`` or ``"pdf"``; default: ``path``'s suffix.
    :param curve: capacities at more contexts (:func:`capacity_curve`), drawn
        as lines under the points.
    :param device: the device's memory (:func:`~kvcore.tools.memory_bars.device_bar`),
        drawn above one bar per asked context of the bytes a request holds
        by group (:func:`~kvcore.tools.memory_bars.request_bars`), beside the
        capacity plot; the block panel is the figure's second view, below.
    :raises MissingExtraError: matplotlib is not installed.
    :raises KvcoreValueError: an unknown format, no block to draw, or
        capacities of another plan.
    """
    target = Path(path)
    fmt = _resolve_format(target, fmt)
    rows = block_rows(plan)
    asked = _checked_capacities(plan, capacities, "capacities")
    line = _checked_capacities(plan, curve or (), "curve")
    mpl = _import_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # Text stays text in SVG (searchable, diffable, small); the viewer's fonts draw it.
    with mpl.rc_context({"svg.hashsalt": _SVG_SALT, "svg.fonttype": "none"}):
        block_height = 1.3 + (0.3 if len(rows) <= 20 else 0.24) * len(rows)
        if not (asked or line):
            fig = Figure(figsize=(11.0, block_height), layout="constrained")
            FigureCanvasAgg(fig)
            fig.suptitle(title, fontsize=12, fontweight="bold")
            _draw_block(fig.subplots(), plan, rows)
            fig.savefig(target, format=fmt, metadata=_metadata(fmt))
            return
        bars = request_bars(asked)
        top = max(3.6, 0.9 + 0.55 * (len(bars) + (device is not None)))
        fig = Figure(figsize=(16.0, top + block_height), layout="constrained")
        FigureCanvasAgg(fig)
        grid = fig.add_gridspec(2, 2, height_ratios=[top, block_height])
        fig.suptitle(title, fontsize=12, fontweight="bold")
        block_ax = fig.add_subplot(grid[1, :])
        colors = _draw_block(block_ax, plan, rows)
        draw_memory_bars(
            fig.add_subplot(grid[0, 0]), device, bars, colors, _format_bytes
        )
        _draw_capacity(fig.add_subplot(grid[0, 1]), plan, asked, line)
        fig.savefig(target, format=fmt, metadata=_metadata(fmt))


def _resolve_format(path: Path, fmt: str | None) -> str:
    chosen = fmt if fmt is not None else path.suffix
    name = chosen.lower().removeprefix(".")
    if name not in FORMATS:
        given = f"format {fmt!r}" if fmt is not None else f"file suffix {path.suffix!r}"
        msg = (
            f"cannot write a plan figure to {str(path)!r}: unknown {given}; "
            f"use one of {', '.join('.' + f for f in FORMATS)}"
        )
        raise KvcoreValueError(msg)
    return name


def _metadata(fmt: str) -> dict[str, Any]:
    """File metadata without the creation time, so outputs diff cleanly."""
    if fmt == "svg":
        return {"Date": None}
    if fmt == "pdf":
        return {"CreationDate": None, "ModDate": None}
    return {}


def _import_matplotlib() -> Any:
    try:
        import matplotlib
        import matplotlib.backends.backend_agg
        import matplotlib.figure
    except ImportError as exc:
        msg = (
            "drawing a plan needs matplotlib, which is not installed: "
            "pip install 'kvcore[plot]'"
        )
        raise MissingExtraError(msg, name="matplotlib") from exc
    return matplotlib


def _checked_capacities(
    plan: KVCacheConfig, capacities: Sequence[Capacity], what: str
) -> list[Capacity]:
    """The capacities sorted by context, refused if another plan made them."""
    for c in capacities:
        item: object = c  # checked: callers pass anything
        if not isinstance(item, Capacity):
            msg = f"{what} must hold Capacity objects (plan_capacity), got {item!r}"
            raise KvcoreValueError(msg)
        if (c.num_blocks, c.bytes_per_block) != (plan.num_blocks, plan.bytes_per_block):
            msg = (
                f"{what} at {c.context} tokens is of a plan of {c.num_blocks} blocks "
                f"of {c.bytes_per_block} bytes, not this one ({plan.num_blocks} of "
                f"{plan.bytes_per_block}); compute it with plan_capacity on this plan"
            )
            raise KvcoreValueError(msg)
    return sorted(capacities, key=lambda c: c.context)


def _format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units, at most 3 significant digits
    below 1000 of a unit)."""
    exponent = 0
    while exponent < 3 and n >= 1024 ** (exponent + 1):
        exponent += 1
    if exponent == 0:
        return f"{n:.0f} B"
    value = n / 1024**exponent
    text = f"{value:.3g}" if value < 1000 else f"{value:.0f}"
    return f"{text} {('KiB', 'MiB', 'GiB')[exponent - 1]}"


def _byte_ticks(stride: int) -> tuple[list[float], int, str]:
    """Ticks at round numbers of the stride's binary unit, at most 9."""
    exponent = 0
    while exponent < 3 and stride >= 1024 ** (exponent + 1):
        exponent += 1
    unit = 1024**exponent
    name = ("B", "KiB", "MiB", "GiB")[exponent]
    span = stride / unit
    step = 1.0
    for magnitude in (10.0**k for k in range(-3, 6)):
        for m in (1.0, 2.0, 2.5, 5.0):
            if span / (m * magnitude) <= 8:
                step = m * magnitude
                break
        else:
            continue
        break
    ticks = [k * step * unit for k in range(int(span / step + 1e-9) + 1)]
    return ticks, unit, name


def _short_names(rows: Sequence[BlockRow]) -> dict[str, str]:
    """Layer names without the dotted prefix every layer shares."""
    names = [s.layer for r in rows for s in r.spans if s.layer is not None]
    parts = [n.split(".") for n in names]
    common = 0
    while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    return {n: ".".join(p[common:]) for n, p in zip(names, parts, strict=True)}


def _kind_colors(rows: Sequence[BlockRow]) -> dict[str, Any]:
    from matplotlib import colormaps

    kinds = list(dict.fromkeys(s.kind for r in rows for s in r.spans if s.kind))
    palette = [c for name in ("tab10", "Dark2") for c in _swatches(colormaps[name])]
    return {k: palette[i % len(palette)] for i, k in enumerate(kinds)}


def _swatches(cmap: Any) -> list[Any]:
    """The distinct colours of a qualitative colormap."""
    return [cmap(i) for i in range(cmap.N)]


def _tint(color: Any, amount: float) -> tuple[float, float, float]:
    """``color`` mixed with white, to tell neighbouring pages of one kind apart."""
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(color)
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


def _draw_block(
    ax: Axes, plan: KVCacheConfig, rows: Sequence[BlockRow]
) -> dict[str, Any]:
    """Draw the block panel; return the colour of each kind it used."""
    from matplotlib.patches import Patch, Rectangle
    from matplotlib.ticker import FuncFormatter
    from matplotlib.transforms import ScaledTranslation

    stride = plan.bytes_per_block
    colors = _kind_colors(rows)
    short = _short_names(rows)
    densest = max(len(r.spans) for r in rows)
    edge = 0.8 if densest <= 32 else 0.5 if densest <= 96 else 0.3
    height = 0.72
    for y, row in enumerate(rows):
        label = len(row.spans) <= _LABELLED_LAYERS
        for k, span in enumerate(row.spans):
            face = colors[str(span.kind)]
            rect = Rectangle(
                (span.start, y - height / 2),
                span.size,
                height,
                facecolor=_tint(face, 0.3) if k % 2 else face,
                edgecolor="white",
                linewidth=edge,
                snap=False,
            )
            rect.set_gid(f"layer:{span.layer}")
            ax.add_patch(rect)
            if label and span.size >= 0.07 * stride and span.layer is not None:
                ax.text(
                    span.start + span.size / 2,
                    y,
                    short[span.layer],
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                    clip_on=True,
                )
        if row.padding is not None:
            pad = row.padding
            rect = Rectangle(
                (pad.start, y - height / 2),
                pad.size,
                height,
                facecolor=_PADDING_FACE,
                edgecolor=_PADDING_EDGE,
                hatch="///",
                linewidth=0.6,
                snap=False,
            )
            rect.set_gid(f"padding:{row.group}")
            ax.add_patch(rect)
            if pad.size >= 0.09 * stride:
                ax.text(
                    pad.start + pad.size / 2,
                    y,
                    f"padding {_format_bytes(pad.size)}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0},
                    clip_on=True,
                )
    ax.set_xlim(0, stride)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ticks, unit, unit_name = _byte_ticks(stride)
    ax.set_xticks(ticks)
    ax.xaxis.set_major_formatter(
        FuncFormatter(lambda v, _pos: f"{v / unit:g} {unit_name}" if v else "0")
    )
    ax.axvline(stride, color="black", linewidth=1.2)
    ax.set_xlabel(
        f"bytes of one block (stride {_format_bytes(stride)} = {stride:,} B)",
        fontsize=9,
    )
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([_row_label(r) for r in rows], fontsize=8)
    right = ax.twinx()
    right.set_ylim(ax.get_ylim())
    right.set_yticks(range(len(rows)))
    right.set_yticklabels(
        [
            f"{100 * r.used_bytes / stride:.1f}% full"
            + (f", pad {_format_bytes(r.padding.size)}" if r.padding else "")
            for r in rows
        ],
        fontsize=8,
    )
    for side in (ax, right):
        side.tick_params(axis="y", length=0)
        for spine in side.spines.values():
            spine.set_visible(False)
    layout = plan.kv_cache_layout.name if plan.kv_cache_layout else "unresolved"
    used = sum(r.used_bytes for r in rows)
    groups = f"{len(rows)} group" + ("s overlaid from byte 0" if len(rows) > 1 else "")
    ax.set_title(
        f"One block: {groups}, layout {layout}, {plan.num_blocks:,} blocks; "
        f"{100 * used / (stride * len(rows)):.1f}% of the group bytes hold pages",
        fontsize=10,
        loc="left",
    )
    handles = [Patch(facecolor=c, label=k) for k, c in colors.items()]
    if any(r.padding for r in rows):
        handles.append(
            Patch(
                facecolor=_PADDING_FACE,
                edgecolor=_PADDING_EDGE,
                hatch="///",
                label="padding to the stride",
            )
        )
    # Below the byte axis and its label: a fixed offset, as their fonts are.
    below = ScaledTranslation(0, -0.42, ax.figure.dpi_scale_trans)
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
        bbox_transform=ax.transAxes + below,
        ncols=min(len(handles), 6),
        fontsize=8,
        frameon=False,
    )
    return colors


def _row_label(row: BlockRow) -> str:
    kinds = "+".join(row.kinds)
    layers = len(row.spans)
    noun = "layer" if layers == 1 else "layers"
    return f"G{row.group} {kinds} · {layers} {noun} · {row.block_size} tok/block"


def _format_tokens(v: float, _pos: object = None) -> str:
    """``32768`` -> ``"32K"``: contexts are usually powers of two."""
    for scale, suffix in ((2**20, "M"), (2**10, "K")):
        if v >= scale:
            return f"{v / scale:.3g}{suffix}"
    return f"{v:.0f}"


def _draw_capacity(
    ax: Axes,
    plan: KVCacheConfig,
    asked: Sequence[Capacity],
    line: Sequence[Capacity],
) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    points = list(line) or list(asked)
    contexts = [c.context for c in points]
    real = [c.concurrency for c in points]
    ideal = [c.ideal_concurrency for c in points]
    smooth = bool(line)
    marker = None if smooth else "o"
    physical = "physical limit (every layer's own pages, nothing reserved)"
    for gid, values, color, dashes, width, label in (
        ("plan", real, "C0", "-", 1.8, "this plan"),
        ("ideal", ideal, "C3", "--", 1.4, physical),
    ):
        (drawn,) = ax.plot(
            contexts,
            values,
            color=color,
            linestyle=dashes,
            linewidth=width,
            label=label,
            marker=marker,
            markersize=4,
        )
        drawn.set_gid(f"capacity:{gid}")
    ax.fill_between(
        contexts, real, ideal, color="C3", alpha=0.08, linewidth=0, label="gap"
    )
    if smooth and asked:
        ax.scatter(
            [c.context for c in asked],
            [c.concurrency for c in asked],
            color="C0",
            zorder=3,
            s=28,
            label="asked contexts",
            gid="capacity:asked",
        )
    for c in asked:
        share = c.concurrency / c.ideal_concurrency if c.ideal_concurrency else 0.0
        ax.annotate(
            f"{c.concurrency:,} ({100 * share:.0f}%)",
            (c.context, c.concurrency),
            textcoords="offset points",
            xytext=(4, 6),
            fontsize=7,
        )
    ax.set_xscale("log", base=2)
    if contexts[0] == contexts[-1]:
        ax.set_xlim(contexts[0] / 2, contexts[0] * 2)
    ax.xaxis.set_major_locator(LogLocator(base=2, numticks=12))
    ax.xaxis.set_major_formatter(FuncFormatter(_format_tokens))
    ax.xaxis.set_minor_formatter(NullFormatter())
    top = max(max(ideal), max(real), 1)
    low = min([v for v in real if v > 0] or [1])
    if top / low > 30:
        # A plan holding no request at some context needs a linear stretch at 0.
        if min(real) > 0:
            ax.set_yscale("log")
        else:
            ax.set_yscale("symlog", linthresh=1)
            ax.set_ylim(bottom=0)
    else:
        ax.set_ylim(bottom=0)
    ax.set_xlabel("context (tokens per request)", fontsize=9)
    ax.set_ylabel("concurrent requests", fontsize=9)
    memory = plan.available_memory or plan.num_blocks * plan.bytes_per_block
    ax.set_title(
        f"Requests that fit in {_format_bytes(memory)} (one prefill step reserved, "
        "null block taken)\nlabels: requests (% of the physical limit)",
        fontsize=10,
        loc="left",
    )
    ax.grid(True, which="major", linewidth=0.4, alpha=0.5)
    ax.legend(fontsize=8, loc="lower left")
