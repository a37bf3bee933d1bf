"""The plan figure: every layer's span sized by its page bytes in one block,
padding to the stride, the capacity panel, output formats and the optional
matplotlib dependency."""

from __future__ import annotations

import importlib.util
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import kvcore
from kvcore.errors import KvcoreError, KvcoreValueError, MissingExtraError
from kvcore.serialize import load_model_file
from kvcore.tools import zoo
from kvcore.tools.picture import block_rows, capacity_curve, save_plan_figure

#: Drawing needs the optional extra; refusals before drawing do not.
needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="kvcore[plot] not installed"
)

SVG = "{http://www.w3.org/2000/svg}"
CONTEXTS = (4096, 16384, 32768)

#: (model, policy, layout): a uniform model, hybrids with padding (one of
#: 100+ layers and several specs per group), and a layer-outer layout.
CASES = [
    ("llama-3-1-8b", "seed", "BLHNC"),
    ("jamba-1-5-mini", "min_waste", "BLHNC"),
    ("deepseek-v4-flash", "seed", "BLHNC"),
    ("gemma-3-27b", "seed", "LBHNC"),
]


def _plan(
    registry: kvcore.KindRegistry, name: str, policy: str, layout: str
) -> tuple[kvcore.KVCacheConfig, dict[str, kvcore.KVCacheSpec]]:
    specs = load_model_file(zoo.path(name), registry).layers
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout=layout, packing_policy=policy, target_context=32768
        ),
        max_model_len=32768,
    )
    plan = kvcore.plan_kv_cache(config, specs, 8 * 2**30, registry=registry)
    return plan, dict(specs)


def _box(path_d: str) -> tuple[float, float, float, float]:
    """``(x0, x1, y0, y1)`` of a path's vertices."""
    values = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", path_d)]
    xs, ys = values[0::2], values[1::2]
    return min(xs), max(xs), min(ys), max(ys)


def _spans(root: ET.Element) -> dict[str, tuple[float, float, float, float]]:
    """Every element id'd ``layer:`` or ``padding:``, with its path's box."""
    found: dict[str, tuple[float, float, float, float]] = {}
    for g in root.iter(f"{SVG}g"):
        gid = g.get("id", "")
        if gid.startswith(("layer:", "padding:")):
            assert gid not in found, f"{gid} drawn twice"
            paths = g.findall(f"{SVG}path")
            assert len(paths) == 1, gid
            found[gid] = _box(paths[0].get("d", ""))
    return found


def _block_axes(root: ET.Element, clip_ref: str) -> tuple[float, float]:
    """``(x, width)`` of the block panel: its clip rectangle is the byte axis
    from 0 to the stride."""
    clip_id = clip_ref.removeprefix("url(#").removesuffix(")")
    for clip in root.iter(f"{SVG}clipPath"):
        if clip.get("id") == clip_id:
            rect = clip.find(f"{SVG}rect")
            assert rect is not None
            return float(rect.get("x", "nan")), float(rect.get("width", "nan"))
    raise AssertionError(f"no clip path {clip_id}")


def _texts(root: ET.Element) -> list[str]:
    return [t.text or "" for t in root.iter(f"{SVG}text")]


@needs_matplotlib
@pytest.mark.parametrize(("name", "policy", "layout"), CASES)
def test_every_page_is_drawn_to_scale_and_padding_fills_the_stride(
    zoo_registry: kvcore.KindRegistry,
    tmp_path: Path,
    name: str,
    policy: str,
    layout: str,
) -> None:
    plan, specs = _plan(zoo_registry, name, policy, layout)
    capacities = [kvcore.plan_capacity(plan, c, specs=specs) for c in CONTEXTS]
    out = tmp_path / "plan.svg"
    save_plan_figure(plan, capacities, out, title=name)
    root = ET.parse(out).getroot()
    spans = _spans(root)
    stride = plan.bytes_per_block

    names = [n for g in plan.kv_cache_groups for n in g.layer_names]
    assert {k for k in spans if k.startswith("layer:")} == {f"layer:{n}" for n in names}
    clip = next(
        g.find(f"{SVG}path").get("clip-path", "")  # type: ignore[union-attr]
        for g in root.iter(f"{SVG}g")
        if g.get("id", "") == f"layer:{names[0]}"
    )
    x0, width = _block_axes(root, clip)
    per_byte = width / stride
    tol = 1e-3 * width

    # Physical offsets in a block-outer layout come from the plan's tensors.
    offsets = {
        n: t.offset + i * t.layer_stride
        for t in plan.kv_cache_tensors
        for i, n in enumerate(t.layers)
    }
    rows_y = []
    for index, group in enumerate(plan.kv_cache_groups):
        boxes = sorted(
            (spans[f"layer:{n}"], n) for n in group.layer_names
        )  # left to right
        ys = {(round(b[2], 3), round(b[3], 3)) for b, _ in boxes}
        assert len(ys) == 1, f"group {index}'s spans are not one row"
        rows_y.append(ys.pop())
        cursor = x0
        for box, layer in boxes:
            page = group.layer_spec(layer).page_size_bytes
            assert box[1] - box[0] == pytest.approx(page * per_byte, rel=5e-3)
            assert box[0] == pytest.approx(cursor, abs=tol), "spans overlap or gap"
            if layout == "BLHNC":
                assert box[0] == pytest.approx(x0 + offsets[layer] * per_byte, abs=tol)
            cursor = box[1]
        padded = stride - group.packed_bytes
        pad = spans.get(f"padding:{index}")
        if padded == 0:
            assert pad is None
            assert cursor == pytest.approx(x0 + width, abs=tol)
        else:
            assert pad is not None, f"group {index} has {padded} bytes of padding"
            assert pad[0] == pytest.approx(cursor, abs=tol)
            assert pad[1] == pytest.approx(x0 + width, abs=tol)
            assert pad[1] - pad[0] == pytest.approx(padded * per_byte, rel=5e-3)
            assert (pad[2], pad[3]) == pytest.approx(rows_y[-1], abs=1e-3)
    # One row per group, top to bottom in group order.
    assert rows_y == sorted(rows_y)
    assert len(set(rows_y)) == len(plan.kv_cache_groups)
    assert len([k for k in spans if k.startswith("padding:")]) == sum(
        g.packed_bytes < stride for g in plan.kv_cache_groups
    )


@needs_matplotlib
def test_hybrid_rows_are_labelled_with_kind_layers_block_and_fill(
    zoo_registry: kvcore.KindRegistry, tmp_path: Path
) -> None:
    plan, _ = _plan(zoo_registry, "jamba-1-5-mini", "min_waste", "BLHNC")
    # 7 groups of 4 Mamba layers (1216 KiB of 1280), 1 of 4 attention layers.
    assert plan.bytes_per_block == 1310720
    out = tmp_path / "plan.svg"
    save_plan_figure(plan, [], out, title="jamba")
    texts = _texts(ET.parse(out).getroot())
    assert "G0 mamba · 4 layers · 16 tok/block" in texts
    assert "G7 full_attention · 4 layers · 80 tok/block" in texts
    assert texts.count("95.0% full, pad 64 KiB") == 7
    assert "100.0% full" in texts
    assert "bytes of one block (stride 1.25 MiB = 1,310,720 B)" in texts
    assert "jamba" in texts
    # No capacities asked: no capacity panel.
    assert not any("Requests that fit" in t for t in texts)


@needs_matplotlib
def test_capacity_panel_draws_the_curve_the_limit_and_the_asked_points(
    zoo_registry: kvcore.KindRegistry, tmp_path: Path
) -> None:
    plan, specs = _plan(zoo_registry, "deepseek-v4-flash", "seed", "BLHNC")
    asked = [kvcore.plan_capacity(plan, c, specs=specs) for c in CONTEXTS]
    curve = capacity_curve(plan, 1024, 10**6, points=20, specs=specs)
    out = tmp_path / "plan.svg"
    save_plan_figure(plan, asked, out, title="v4", curve=curve)
    root = ET.parse(out).getroot()
    lines = {}
    for g in root.iter(f"{SVG}g"):
        if g.get("id") in {"capacity:plan", "capacity:ideal"}:
            path = g.find(f"{SVG}path")
            assert path is not None
            values = [
                float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", path.get("d", ""))
            ]
            lines[g.get("id")] = list(zip(values[0::2], values[1::2], strict=True))
        if g.get("id") == "capacity:asked":
            assert len(g.findall(f".//{SVG}use")) == len(CONTEXTS)
    plan_line, ideal_line = lines["capacity:plan"], lines["capacity:ideal"]
    assert len(plan_line) == len(ideal_line) == len(curve)
    # Longer contexts lie to the right; fewer requests fit there (lower on
    # screen is a larger y), and the limit is never below the plan.
    assert [x for x, _ in plan_line] == sorted(x for x, _ in plan_line)
    assert plan_line[0][1] < plan_line[-1][1]
    for (_, y_plan), (_, y_ideal) in zip(plan_line, ideal_line, strict=True):
        assert y_ideal <= y_plan + 1e-6
    # Each asked point is labelled with its requests and share of the limit.
    texts = _texts(root)
    for c in asked:
        share = round(100 * c.concurrency / c.ideal_concurrency)
        assert f"{c.concurrency:,} ({share}%)" in texts


def test_capacity_curve_spans_the_range_capped_at_max_model_len(
    zoo_registry: kvcore.KindRegistry,
) -> None:
    plan, specs = _plan(zoo_registry, "llama-3-1-8b", "seed", "BLHNC")
    curve = capacity_curve(plan, 1000, 10**7, points=9, specs=specs)
    contexts = [c.context for c in curve]
    assert contexts[0] == 1000
    assert contexts[-1] == 32768  # max_model_len
    assert contexts == sorted(set(contexts))
    assert len(contexts) == 9
    assert curve[3] == kvcore.plan_capacity(plan, contexts[3], specs=specs)
    with pytest.raises(KvcoreValueError, match="1 <= start <= stop"):
        capacity_curve(plan, 40000, 50000)
    with pytest.raises(KvcoreValueError, match="at least 2 points"):
        capacity_curve(plan, 1, 100, points=1)


@needs_matplotlib
def test_svg_is_deterministic(
    zoo_registry: kvcore.KindRegistry, tmp_path: Path
) -> None:
    plan, specs = _plan(zoo_registry, "jamba-1-5-mini", "min_waste", "BLHNC")
    asked = [kvcore.plan_capacity(plan, 8192, specs=specs)]
    first, second = tmp_path / "a.svg", tmp_path / "b.svg"
    save_plan_figure(plan, asked, first, title="t")
    save_plan_figure(plan, asked, second, title="t")
    assert first.read_bytes() == second.read_bytes()
    assert b"<dc:date>" not in first.read_bytes()


@needs_matplotlib
def test_png_and_pdf_are_written_by_suffix_or_format(
    zoo_registry: kvcore.KindRegistry, tmp_path: Path
) -> None:
    import matplotlib

    backend = matplotlib.rcParams["backend"]
    plan, specs = _plan(zoo_registry, "llama-3-1-8b", "seed", "BLHNC")
    asked = [kvcore.plan_capacity(plan, 4096, specs=specs)]
    png = tmp_path / "plan.png"
    save_plan_figure(plan, asked, png, title="png")
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    width = int.from_bytes(data[16:20], "big")
    assert width == 1600  # 16 inches at 100 dpi: memory bars beside the curve
    pdf = tmp_path / "plan.PDF"
    save_plan_figure(plan, asked, pdf, title="pdf")
    assert pdf.read_bytes().startswith(b"%PDF")
    named = tmp_path / "plan.out"
    save_plan_figure(plan, asked, named, title="svg", fmt="SVG")
    assert ET.parse(named).getroot().tag == f"{SVG}svg"
    # The user's backend and rc settings are left as they were.
    assert matplotlib.rcParams["backend"] == backend
    assert matplotlib.rcParams["svg.hashsalt"] is None


@pytest.mark.parametrize(
    ("filename", "fmt", "needle"),
    [
        ("plan.jpeg", None, "'.jpeg'"),
        ("plan", None, "''"),
        ("plan.svg", "gif", "'gif'"),
    ],
)
def test_unknown_format_is_refused_before_drawing(
    zoo_registry: kvcore.KindRegistry,
    tmp_path: Path,
    filename: str,
    fmt: str | None,
    needle: str,
) -> None:
    plan, _ = _plan(zoo_registry, "llama-3-1-8b", "seed", "BLHNC")
    target = tmp_path / filename
    with pytest.raises(KvcoreValueError, match=re.escape(needle)) as info:
        save_plan_figure(plan, [], target, title="x", fmt=fmt)
    assert isinstance(info.value, ValueError)
    assert ".svg, .png, .pdf" in str(info.value)
    assert not target.exists()


def test_missing_matplotlib_names_the_extra(
    zoo_registry: kvcore.KindRegistry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan, _ = _plan(zoo_registry, "llama-3-1-8b", "seed", "BLHNC")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    target = tmp_path / "plan.svg"
    with pytest.raises(
        MissingExtraError, match=re.escape("pip install 'kvcore[plot]'")
    ) as info:
        save_plan_figure(plan, [], target, title="x")
    assert isinstance(info.value, ImportError)
    assert isinstance(info.value, KvcoreError)
    assert info.value.name == "matplotlib"
    assert not target.exists()


def test_capacities_of_another_plan_are_refused(
    zoo_registry: kvcore.KindRegistry, tmp_path: Path
) -> None:
    plan, _ = _plan(zoo_registry, "llama-3-1-8b", "seed", "BLHNC")
    other, _ = _plan(zoo_registry, "jamba-1-5-mini", "min_waste", "BLHNC")
    foreign = kvcore.plan_capacity(other, 4096)
    with pytest.raises(KvcoreValueError, match="compute it with plan_capacity"):
        save_plan_figure(plan, [foreign], tmp_path / "p.svg", title="x")
    with pytest.raises(KvcoreValueError, match="curve at 4096 tokens"):
        save_plan_figure(plan, [], tmp_path / "p.svg", title="x", curve=[foreign])


def test_layer_outer_rows_lay_pages_side_by_side(
    zoo_registry: kvcore.KindRegistry,
) -> None:
    plan, _ = _plan(zoo_registry, "gemma-3-27b", "seed", "LBHNC")
    rows = block_rows(plan)
    assert [r.group for r in rows] == list(range(len(plan.kv_cache_groups)))
    for row, group in zip(rows, plan.kv_cache_groups, strict=True):
        assert [s.layer for s in row.spans] == group.layer_names
        assert row.spans[0].start == 0
        for before, after in zip(row.spans, row.spans[1:], strict=False):
            assert after.start == before.end
        assert row.used_bytes == group.packed_bytes
        end = row.padding.end if row.padding else row.spans[-1].end
        assert end == plan.bytes_per_block
    # Gemma's full-attention group is narrower: 10 pages of 128 KiB in 1.625 MiB.
    assert rows[-1].padding is not None
    assert rows[-1].padding.size == 1703936 - 1310720
