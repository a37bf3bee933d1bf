"""The hit-rate-versus-memory curve of a trace replayed at several pool sizes.

Drawn as :mod:`kvcore.tools.picture` draws a plan: matplotlib (the optional
``plot`` extra) through :class:`matplotlib.figure.Figure` only, and SVG
output byte-identical from run to run.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import attrs

from kvcore.errors import KvcoreValueError
from kvcore.tools.picture import _import_matplotlib, _metadata, _resolve_format

__all__ = ["CurvePoint", "save_hit_rate_curve"]

_SVG_SALT = "kvcore-hit-rate"


@attrs.frozen
class CurvePoint:
    """One replay: the pool's KV cache bytes and what it served."""

    memory_bytes: int
    hit_rate: float
    bound_rate: float
    preemptions: int


def save_hit_rate_curve(
    points: Sequence[CurvePoint],
    path: str | os.PathLike[str],
    *,
    title: str,
    ceiling: float | None = None,
    fmt: str | None = None,
) -> None:
    """Draw prefix-hit rate (and the token-level bound) against memory, with
    the trace's unbounded-cache ceiling as a line, and write it to ``path``.

    :raises MissingExtraError: matplotlib is not installed.
    :raises KvcoreValueError: an unknown format or no point to draw.
    """
    if not points:
        msg = "a hit-rate curve needs at least one replay"
        raise KvcoreValueError(msg)
    target = Path(path)
    fmt = _resolve_format(target, fmt)
    mpl = _import_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ordered = sorted(points, key=lambda p: p.memory_bytes)
    gib = [p.memory_bytes / 2**30 for p in ordered]
    with mpl.rc_context({"svg.hashsalt": _SVG_SALT, "svg.fonttype": "none"}):
        fig = Figure(figsize=(8.0, 4.5), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        ax.plot(gib, [p.hit_rate for p in ordered], marker="o", label="prefix hits")
        ax.plot(
            gib,
            [p.bound_rate for p in ordered],
            marker="x",
            linestyle="--",
            label="token-level bound",
        )
        if ceiling is not None:
            ax.axhline(ceiling, color="grey", linestyle=":", label="trace ceiling")
        for x, p in zip(gib, ordered, strict=True):
            if p.preemptions:
                ax.annotate(
                    f"{p.preemptions:,} preempted",
                    (x, p.hit_rate),
                    textcoords="offset points",
                    xytext=(4, -12),
                    fontsize=8,
                )
        ax.set_xlabel("KV cache memory per rank (GiB)")
        ax.set_ylabel("share of prompt tokens served by the cache")
        ax.set_ylim(0, 1)
        if len(gib) > 1 and gib[-1] / gib[0] >= 8:
            ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower right")
        fig.suptitle(title, fontsize=11, fontweight="bold")
        fig.savefig(target, format=fmt, metadata=_metadata(fmt))
