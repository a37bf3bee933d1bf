"""The ``kvcore`` command line."""

from __future__ import annotations

import json

import pytest

from kvcore.cli import main


def test_kinds_lists_every_builtin_kind(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kinds", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["kind"] for r in rows} >= {
        "full_attention",
        "mla",
        "sliding_window",
        "sliding_window_mla",
        "mamba",
        "circular_buffer",
        "hisparse_hot",
    }
    assert {r["plugin"] for r in rows if r["kind"] == "sliding_window_mla"} == {
        "sliding_window"
    }


def test_plugins_lists_hooks_and_kinds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["mamba"]["kinds"] == ["mamba"]
    assert rows["mamba"]["hooks"] == ["kvcore_register_kinds"]


def test_plan_a_shipped_model(capsys: pytest.CaptureFixture[str]) -> None:
    # Gemma-3-27B: 52 sliding-window and 10 full layers, all 131072-byte pages
    # (16 heads * 16 tokens * (128 + 128) * 2 bytes).  Groups of 13 pad the
    # fewest layer slots (52 = 4 * 13; 10 -> 13 pads 3), so a block is 13 pages.
    args = ["plan", "gemma-3-27b", "--memory-gib", "1", "--policy", "seed", "--json"]
    assert main(args) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [len(g["layer_names"]) for g in plan["kv_cache_groups"]] == [
        13,
        13,
        13,
        13,
        10,
    ]
    assert plan["bytes_per_block"] == 13 * 131072
    assert plan["num_blocks"] == 2**30 // (13 * 131072)
    assert (plan["scheduler_block_size"], plan["hash_block_size"]) == (16, 16)


def test_plan_error_is_reported_not_raised(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "qwen3-next-80b-a3b", "--layout", "LBNHC"]) == 2
    assert "cannot express this model's mixed page sizes" in capsys.readouterr().err


def test_plan_reports_capacity_at_each_context(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["plan", "gemma-3-27b", "--memory-gib", "64", "--context", "32768,4096"]
    assert main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["packing_policy"] == "min_waste"
    assert plan["target_context"] == 32768
    assert [c["context"] for c in plan["capacity"]] == [32768, 4096]
    assert all(c["ratio"] >= 0.98 for c in plan["capacity"])
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "policy min_waste for 32768 tokens" in text
    assert "prefix hits are multiples of" in text


def test_plan_refuses_a_malformed_context(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "gemma-3-27b", "--context", "4k"]) == 2
    assert "--context takes positive token counts" in capsys.readouterr().err
