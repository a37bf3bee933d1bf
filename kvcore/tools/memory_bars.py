"""Where memory goes: the device, and one request at each asked context.

Two kinds of bar, drawn beside the capacity plot of
:func:`kvcore.tools.picture.save_plan_figure`:

- the device: its memory split into weights (one rank's share), the KV
  cache the plan was sized for, and the headroom ``--gpu-memory-utilization``
  leaves;
- one request of each asked context: the bytes it holds in the pool, a
  segment per cache group (coloured by the group's kind) plus the padding
  its blocks carry up to the block stride.

The block panel shows how layers pack into a block (so Gemma-3's 52 window
layers fill most rows); these bars show what a request holds (at 128k the 10
global layers hold nearly all of it).  The data (:func:`device_bar`,
:func:`request_bars`) needs no matplotlib; :func:`draw_memory_bars` draws it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from kvcore.errors import KvcoreValueError
from kvcore.plan.capacity import Capacity

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = [
    "Bar",
    "Segment",
    "device_bar",
    "draw_memory_bars",
    "kind_totals",
    "request_bars",
]


@attrs.frozen
class Segment:
    """A share of a bar: ``bytes`` of one part (weights, a group, padding)."""

    label: str
    bytes: int
    #: the cache kind (a group's segment), ``"padding"``, or the device
    #: part: ``"weights"``, ``"kv_cache"``, ``"headroom"``.
    kind: str
    #: the cache group's index, for a group's segment.
    group: int | None = None


@attrs.frozen
class Bar:
    """One bar: its label and segments, in drawing order."""

    label: str
    segments: tuple[Segment, ...]

    @property
    def total(self) -> int:
        return sum(s.bytes for s in self.segments)


def device_bar(
    name: str, memory_bytes: int, weights_bytes: int, kv_cache_bytes: int
) -> Bar:
    """The device's memory: weights (one rank's), the KV cache, and what is
    left (the headroom); the three add up to ``memory_bytes``."""
    headroom = memory_bytes - weights_bytes - kv_cache_bytes
    if min(memory_bytes, weights_bytes, kv_cache_bytes) < 0 or headroom < 0:
        msg = (
            f"device bar of {name}: weights {weights_bytes} + KV cache "
            f"{kv_cache_bytes} bytes exceed its {memory_bytes} bytes"
        )
        raise KvcoreValueError(msg)
    return Bar(
        label=name,
        segments=(
            Segment("weights", weights_bytes, "weights"),
            Segment("KV cache", kv_cache_bytes, "kv_cache"),
            Segment("headroom", headroom, "headroom"),
        ),
    )


def request_bars(capacities: Sequence[Capacity]) -> list[Bar]:
    """One bar per capacity: the bytes one request of that context holds,
    a segment per cache group (its blocks x its pages' bytes in a block,
    groups that hold nothing at that length left out), then the padding
    every held block carries up to the stride."""
    bars = []
    for capacity in capacities:
        segments = []
        padding = 0
        for group in capacity.groups:
            if not group.blocks_per_request:
                continue
            kind = "+".join(group.kinds)
            used = group.blocks_per_request * group.packed_bytes
            noun = "layer" if group.num_layers == 1 else "layers"
            segments.append(
                Segment(
                    f"group {group.group}: {kind} ({group.num_layers} {noun})",
                    used,
                    kind,
                    group.group,
                )
            )
            padding += group.blocks_per_request * (
                capacity.bytes_per_block - group.packed_bytes
            )
        if padding:
            segments.append(Segment("padding", padding, "padding"))
        bars.append(Bar(f"1 request, {capacity.context:,} tokens", tuple(segments)))
    return bars


def kind_totals(bar: Bar) -> dict[str, int]:
    """A bar's bytes by kind (groups of one kind summed), largest first."""
    totals: dict[str, int] = {}
    for segment in bar.segments:
        totals[segment.kind] = totals.get(segment.kind, 0) + segment.bytes
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def _bar_label(bar: Bar, format_bytes: Any) -> str:
    """The bar's name, its bytes and, for a request, its largest kind's share."""
    text = f"{bar.label}\n{format_bytes(bar.total)}"
    if bar.segments and bar.segments[0].group is not None:
        kind, size = next(iter(kind_totals(bar).items()))
        text += f", {kind} {100 * size / (bar.total or 1):.0f}%"
    return text


def _color(colors: dict[str, Any], kind: str) -> Any:
    """A kind's colour; a group of several kinds takes its first's."""
    if kind == "padding":
        return "white"
    return colors.get(kind) or colors.get(kind.split("+")[0], "#b0b0b0")


#: Colours of the device's parts (the KV cache's matches no kind's).
_DEVICE_COLORS = {"weights": "#6b6b6b", "kv_cache": "#4c9be8", "headroom": "#d9d9d9"}


def draw_memory_bars(
    ax: Axes,
    device: Bar | None,
    requests: Sequence[Bar],
    colors: dict[str, Any],
    format_bytes: Any,
) -> None:
    """Draw the bars, each as shares of its own total (a request is far
    smaller than a device), labelled with the bytes of its largest parts.

    :param colors: a colour per cache kind (the block panel's).
    :param format_bytes: ``int -> str`` for labels.
    """
    from matplotlib.patches import Patch

    bars = ([device] if device is not None else []) + list(requests)
    for row, bar in enumerate(bars):
        y = len(bars) - 1 - row
        left = 0.0
        total = bar.total or 1
        for segment in bar.segments:
            width = segment.bytes / total
            is_device = bar is device
            face = (
                _DEVICE_COLORS[segment.kind]
                if is_device
                else _color(colors, segment.kind)
            )
            patch = ax.barh(
                y,
                width,
                left=left,
                height=0.6,
                color=face,
                edgecolor="#8c8c8c" if segment.kind == "padding" else "white",
                hatch="///" if segment.kind == "padding" else None,
                linewidth=0.6,
            )[0]
            tag = segment.kind if segment.group is None else f"group{segment.group}"
            patch.set_gid(f"memory:{'device' if is_device else y}:{tag}")
            if width >= 0.09:
                ax.text(
                    left + width / 2,
                    y,
                    f"{segment.label if is_device else segment.kind}\n"
                    f"{format_bytes(segment.bytes)} ({100 * width:.0f}%)",
                    ha="center",
                    va="center",
                    fontsize=6.5,
                )
            left += width
    ax.set_yticks(range(len(bars)))
    ax.set_yticklabels(
        [_bar_label(b, format_bytes) for b in reversed(bars)], fontsize=7
    )
    ax.set_xlim(0, 1)
    ax.set_xticks([0, 0.25, 0.5, 0.75, 1.0])
    ax.set_xticklabels(["0", "25%", "50%", "75%", "100%"], fontsize=7)
    kinds = list(dict.fromkeys(s.kind for b in requests for s in b.segments))
    handles = [
        Patch(
            facecolor=_color(colors, k),
            edgecolor="#8c8c8c",
            hatch="///" if k == "padding" else None,
            label=k,
        )
        for k in kinds
    ]
    if handles:
        ax.legend(handles=handles, fontsize=7, loc="upper right", framealpha=0.9)
    ax.set_title(
        "Where memory goes: the device, and one request by group (share of each bar)",
        fontsize=10,
        loc="left",
    )
