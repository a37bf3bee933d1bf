"""Draw docs/layouts.svg: where each cell of a tiny cache lands in memory.

The cache is ``[L, B, H, N, C]`` with 2 layers, 3 blocks, 2 head slots and
2 states per block; each cell is one state's ``C`` bytes (``C`` is innermost
in every layout, so it is drawn as one cell).  For every member of
``kvcore.layout.KVCacheLayout`` the cells are placed at the byte offsets
``kvcore.layout.compute_layout_strides`` gives them, so the picture is the
code's own answer, not a drawing of it.  Rerun after changing the layouts:

    python docs/layouts_figure.py
"""

from __future__ import annotations

import itertools
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from kvcore.layout import KVCacheLayout, compute_layout_strides

OUT = Path(__file__).resolve().parent / "layouts.svg"
L, B, H, N = 2, 3, 2, 2
AXES = "LBHNC"
BLOCK_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f")  # block 0, 1, 2
CELL_W, CELL_H, ROW_H = 1.0, 1.0, 2.0


def address_order(layout: KVCacheLayout) -> list[tuple[int, int, int, int]]:
    """The cells ``(l, b, h, n)`` sorted by their byte offset under ``layout``."""
    strides = compute_layout_strides(layout, (L, B, H, N, 1), page_bytes=H * N)
    cells = itertools.product(range(L), range(B), range(H), range(N))
    return sorted(
        cells, key=lambda c: sum(i * s for i, s in zip(c, strides[:4], strict=True))
    )


def facts(layout: KVCacheLayout) -> str:
    order = " > ".join(AXES[axis] for axis in layout.value)
    page = "each page contiguous" if layout.is_block_compact else "pages split"
    packs = "mixed pages pack" if layout.can_pack else "no packing"
    return f"{order}   ({page}; {packs})"


def main() -> None:
    plt.rcParams["svg.fonttype"] = "none"  # keep text as text
    plt.rcParams["svg.hashsalt"] = "kvcore-layouts"  # stable ids
    plt.rcParams["font.family"] = "DejaVu Sans"
    layouts = list(KVCacheLayout)
    cells = L * B * H * N
    fig, ax = plt.subplots(figsize=(13.0, 1.05 * len(layouts) + 1.2))
    for row, layout in enumerate(layouts):
        y = -row * ROW_H
        ax.text(
            -0.4,
            y + CELL_H / 2,
            layout.name,
            ha="right",
            va="center",
            fontsize=12,
            fontweight="bold",
            family="DejaVu Sans Mono",
        )
        ax.text(
            0,
            y + CELL_H + 0.15,
            facts(layout),
            ha="left",
            va="bottom",
            fontsize=8.5,
            color="#333333",
        )
        order = address_order(layout)
        for x, (lay, blk, head, state) in enumerate(order):
            ax.add_patch(
                Rectangle(
                    (x * CELL_W, y),
                    CELL_W,
                    CELL_H,
                    facecolor=BLOCK_COLOURS[blk],
                    alpha=1.0 if lay == 0 else 0.45,
                    edgecolor="white",
                    linewidth=0.8,
                    hatch=None if lay == 0 else "///",
                )
            )
            ax.text(
                x * CELL_W + CELL_W / 2,
                y + CELL_H * 0.68,
                f"l{lay} b{blk}",
                ha="center",
                va="center",
                fontsize=6.2,
                color="black",
            )
            ax.text(
                x * CELL_W + CELL_W / 2,
                y + CELL_H * 0.3,
                f"h{head} n{state}",
                ha="center",
                va="center",
                fontsize=6.2,
                color="black",
            )
        # A thick bar wherever the next cell belongs to another page (l, b).
        for x in range(1, cells):
            if order[x][:2] != order[x - 1][:2]:
                ax.plot(
                    [x * CELL_W] * 2,
                    [y - 0.08, y + CELL_H + 0.08],
                    color="black",
                    linewidth=1.6,
                )
    ax.annotate(
        "",
        xy=(cells * CELL_W, 1.9),
        xytext=(0, 1.9),
        arrowprops={"arrowstyle": "->", "color": "#333333"},
    )
    ax.text(
        cells * CELL_W / 2,
        2.05,
        "increasing address (one cell = one state's C bytes)",
        ha="center",
        va="bottom",
        fontsize=9,
        color="#333333",
    )
    legend_y = -len(layouts) * ROW_H + 0.6
    for i, colour in enumerate(BLOCK_COLOURS):
        ax.add_patch(Rectangle((i * 3.2, legend_y), 0.8, 0.6, facecolor=colour))
        ax.text(i * 3.2 + 1.0, legend_y + 0.3, f"block b{i}", va="center", fontsize=8.5)
    ax.add_patch(Rectangle((10.0, legend_y), 0.8, 0.6, facecolor="#999999"))
    ax.text(11.0, legend_y + 0.3, "layer l0", va="center", fontsize=8.5)
    ax.add_patch(
        Rectangle(
            (13.2, legend_y),
            0.8,
            0.6,
            facecolor="#999999",
            alpha=0.45,
            hatch="///",
            edgecolor="white",
        )
    )
    ax.text(14.2, legend_y + 0.3, "layer l1", va="center", fontsize=8.5)
    ax.plot(
        [16.6, 16.6], [legend_y - 0.05, legend_y + 0.65], color="black", linewidth=1.6
    )
    ax.text(
        16.9,
        legend_y + 0.3,
        "page boundary (next cell is another layer's or block's page)",
        va="center",
        fontsize=8.5,
    )
    ax.set_xlim(-2.6, cells * CELL_W + 0.2)
    ax.set_ylim(legend_y - 0.3, 2.6)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.savefig(
        OUT, format="svg", bbox_inches="tight", metadata={"Date": None, "Creator": None}
    )
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
