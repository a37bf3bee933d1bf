"""The device budget line: ``plan``, ``compare`` and ``simulate`` say where
a device's memory goes (weights, KV cache, headroom) whenever ``--gpu`` is
given, in text and JSON, with the weights every shipped model carries."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvcore.tools.accelerators import find_accelerator
from tests.test_cli import plan_json, run

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
LLAMA_WEIGHTS = 16_060_522_496


def test_plan_sets_the_shipped_weights_aside() -> None:
    doc = plan_json("llama-3-1-8b", "--gpu", "H100", "--context", "8K")
    memory = doc["settings"]["memory"]
    device = find_accelerator("H100").memory_bytes
    usable = int(device * 0.9)
    assert memory["weights_bytes"] == LLAMA_WEIGHTS
    assert memory["weights_source"] == "model file"
    assert memory["kv_cache_bytes"] == usable - LLAMA_WEIGHTS
    assert memory["headroom_bytes"] == device - usable
    assert (
        memory["weights_bytes_per_rank"]
        + memory["kv_cache_bytes"]
        + memory["headroom_bytes"]
        == device
    )
    assert doc["notes"][0].startswith("memory: H100 80GB (80.0 GiB) = 15.0 GiB weights")
    assert not any("no weights set aside" in note for note in doc["notes"])


def test_plan_splits_the_weights_over_the_ranks() -> None:
    doc = plan_json("llama-3-1-8b", "--gpu", "H100", "--tp", "2", "--context", "8K")
    memory = doc["settings"]["memory"]
    assert memory["weights_bytes_per_rank"] == LLAMA_WEIGHTS // 2
    assert doc["notes"][0].startswith("memory per rank (2 ranks): H100 80GB")


def test_plan_of_a_config_json_uses_the_estimate_and_lists_it() -> None:
    config = str(FIXTURES / "gemma-3-27b" / "config.json")
    doc = plan_json("--hf-config", config, "--gpu", "H200", "--context", "32K")
    memory = doc["settings"]["memory"]
    assert memory["weights_bytes"] == 54_864_815_584
    assert memory["weights_source"] == "estimated from config.json"
    assert "(estimated from config.json)" in doc["notes"][0]
    assert (
        "weights estimated from the configuration: 27,432,407,792 parameters, "
        "bfloat16" in doc["notes"]
    )


def test_plan_lists_the_defaults_a_mapper_applied(tmp_path: Path) -> None:
    source = (FIXTURES / "gemma-3-27b" / "config.json").read_text()
    path = tmp_path / "config.json"
    path.write_text(source.replace('"head_dim": 128,', ""))
    proc = run("plan", "--hf-config", str(path), "--memory", "16GiB", "--context", "8K")
    assert proc.returncode == 0, proc.stderr
    assert (
        "defaults applied: text_config.head_dim 256 (Gemma3TextConfig's default)"
        in " ".join(proc.stdout.split())
    )


def test_compare_shows_the_budget_line_in_text_and_json() -> None:
    proc = run("compare", "llama-3-1-8b", "--gpu", "H100", "--context", "8K")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "memory: H100 80GB (80.0 GiB) = 15.0 GiB weights (model file) + " in text
    assert "headroom (--gpu-memory-utilization 0.90)" in text
    proc = run("compare", "llama-3-1-8b", "--gpu", "H100", "--context", "8K", "--json")
    doc = json.loads(proc.stdout)
    assert doc["memory"]["weights_bytes"] == LLAMA_WEIGHTS
    assert doc["memory"]["headroom_bytes"] == find_accelerator(
        "H100"
    ).memory_bytes - int(find_accelerator("H100").memory_bytes * 0.9)


def test_compare_warns_when_no_weights_are_set_aside() -> None:
    proc = run(
        "compare", "llama-3-1-8b", "--gpu", "H100", "--weights", "0", "--context", "8K"
    )
    assert proc.returncode == 0, proc.stderr
    assert "warning: no weights set aside" in proc.stdout


def test_compare_without_a_gpu_has_no_device_line() -> None:
    proc = run("compare", "llama-3-1-8b", "--memory", "8GiB", "--context", "8K")
    assert "headroom" not in proc.stdout
    doc = json.loads(
        run(
            "compare", "llama-3-1-8b", "--memory", "8GiB", "--context", "8K", "--json"
        ).stdout
    )
    assert doc["memory"]["gpu"] is None
    assert doc["memory"]["headroom_bytes"] is None


def test_simulate_shows_the_budget_line() -> None:
    args = ("simulate", "llama-3-1-8b", "--gpu", "H100", "--requests", "4")
    proc = run(*args)
    assert proc.returncode == 0, proc.stderr
    assert "memory: H100 80GB (80.0 GiB) = 15.0 GiB weights (model file)" in " ".join(
        proc.stdout.split()
    )
    doc = json.loads(run(*args, "--json").stdout)
    assert doc["memory"]["weights_bytes"] == LLAMA_WEIGHTS
    assert doc["memory"]["weights_source"] == "model file"


def test_plan_draws_the_device_beside_the_capacity(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "plan.svg"
    proc = run(
        "plan", "gemma-3-27b", "--gpu", "H100", "--tp", "2", "--context", "8K,128K",
        "--svg", str(path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    ids = {e.get("id") for e in ET.parse(path).getroot().iter() if e.get("id")}
    assert {"memory:device:weights", "memory:device:kv_cache"} <= ids
    assert {"memory:0:group17", "memory:1:group17", "capacity:plan"} <= ids
    text = path.read_text()
    assert "H100 80GB (1 rank)" in text
    assert "full_attention 96%" in text
