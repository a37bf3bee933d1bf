"""The figures ``kvcore plan`` and ``kvcore compare`` print agree with the
library and with each other: the limit bounds the requests, ``ratio`` is
one figure, and sizes set side by side never read the same when they
differ."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from test_cli import plan_json, run

import kvcore
from kvcore.serialize import load_model_file
from kvcore.tools import zoo
from kvcore.tools.cli.document import load_schema


def test_caching_off_mamba_hybrid_holds_no_more_than_its_limit() -> None:
    doc = plan_json("qwen3-next-80b-a3b", "--context", "4097", "--no-prefix-caching")
    (row,) = doc["capacity"]
    # 59 requests against a limit of 47.7 (ratio 1.26) before: the limit
    # counted the checkpoint a caching-off plan never keeps.
    assert row["concurrency"] == 59
    assert row["physical_limit_requests"] == 61
    assert row["concurrency"] <= row["physical_limit_requests"]
    assert row["ratio"] <= 1.0


def test_ratio_is_the_librarys_in_text_and_json() -> None:
    memory = 8 * 2**30
    doc = plan_json("gemma-3-27b", "--memory", "8GiB", "--context", "4K,32K")
    specs = load_model_file(zoo.path("gemma-3-27b"), kvcore.default_registry()).layers
    for row in doc["capacity"]:
        assert row["ratio"] == pytest.approx(
            row["unreserved_concurrency"] / row["physical_limit"]
        )
    text = run("plan", "gemma-3-27b", "--memory", "8GiB", "--context", "4K")
    verdict = text.stdout.splitlines()[0]
    ratio = float(re.search(r"limit \d+, ([0-9.]+)\)", verdict).group(1))
    assert ratio == round(doc["capacity"][0]["ratio"], 2)
    # The library's Capacity.ratio on the same plan is the same figure.
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout="BLHNC", target_context=4096, enable_prefix_caching=True
        ),
        max_num_batched_tokens=8192,
    )
    lib = kvcore.plan_kv_cache(config, specs, memory)
    capacity = kvcore.plan_capacity(lib, 4096, specs=specs, memory=memory)
    assert capacity.ratio == pytest.approx(doc["capacity"][0]["ratio"])
    schema = load_schema()
    described = schema["properties"]["capacity"]["items"]["properties"]["ratio"]
    assert described["description"].startswith(
        "unreserved_concurrency / physical_limit"
    )
    jsonschema.validate(doc, schema)


def test_compare_prints_the_same_ratio() -> None:
    proc = run(
        "compare", "gemma-3-27b", "--memory", "8GiB", "--context", "4K", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    # vLLM's entry carries the figures vLLM logs, not a kvcore capacity row.
    kvcore_entries = [e for e in doc["policies"] if e["policy"] != "vllm"]
    assert [e["policy"] for e in kvcore_entries] == ["min_waste", "seed"]
    for entry in kvcore_entries:
        for row in entry["capacity"]:
            assert row["ratio"] == pytest.approx(
                row["unreserved_concurrency"] / row["physical_limit"]
            )


def test_a_pool_just_too_small_says_by_how_much() -> None:
    proc = run("plan", "llama-3-1-8b", "--memory", "4GiB", "--context", "32K")
    verdict = proc.stdout.splitlines()[0]
    have, need = re.search(r"fits in (.+); one needs (.+)$", verdict).groups()
    # "fits in 4.0 GiB; one needs 4.0 GiB" before.
    assert have != need
    assert (have, need) == ("4.000 GiB", "4.002 GiB")
    assert f"needs {need} for one" in proc.stdout


def test_sizes_side_by_side_never_read_the_same() -> None:
    from kvcore.tools.units import format_sizes

    assert format_sizes(1536, 2048) == ("1.5 KiB", "2.0 KiB")
    assert format_sizes(2**32, 2**32 + 2**21) == ("4.000 GiB", "4.002 GiB")
    assert format_sizes(2**32, 2**32 + 8192) == ("4,294,967,296 B", "4,294,975,488 B")
    assert format_sizes(2**32, 2**32) == ("4.0 GiB", "4.0 GiB")


def test_the_limit_column_rounds_down() -> None:
    from kvcore.tools.report import _limit_text

    assert _limit_text(47.96) == "47.9"
    assert _limit_text(48.0) == "48.0"
    assert _limit_text(0.99) == "0.9"


def test_weights_just_past_the_budget_read_apart() -> None:
    # One byte more weights than H100 x 0.90 leaves: "72.0 GiB of weights
    # leave no KV cache in ... = 72.0 GiB" before.
    proc = run("plan", "llama-3-1-8b", "--gpu", "H100", "--weights", "77309411329")
    assert proc.returncode != 0
    assert (
        "77,309,411,329 B of weights per rank leave no KV cache in H100 80GB x "
        "0.90 = 77,309,411,328 B"
    ) in proc.stderr
