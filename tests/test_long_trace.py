"""benchmarks/long_trace.py: a long Mooncake trace made of a short one."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from benchmark_scripts import load_benchmark

from kvcore.tools.simulate.public_traces import parse_any_trace

REPO = Path(__file__).resolve().parent.parent
MOONCAKE = REPO / "tests" / "fixtures" / "traces" / "mooncake_synthetic_trace.jsonl.gz"


def _long_trace():
    return load_benchmark("long_trace")


def test_copies_share_nothing_and_keep_their_own_sharing():
    lines = gzip.decompress(MOONCAKE.read_bytes()).decode().splitlines()[:300]
    make = _long_trace().long_trace_lines
    long = list(make(lines, 750))
    assert long == list(make(lines, 750))  # deterministic
    assert len(long) == 750
    records = [json.loads(line) for line in long]
    stamps = [r["timestamp"] for r in records]
    assert stamps == sorted(stamps)
    # copy 1 starts one span (and a ms) after copy 0 started
    first = json.loads(lines[0])
    span = json.loads(lines[-1])["timestamp"] - first["timestamp"] + 1
    assert records[300]["timestamp"] == first["timestamp"] + span
    one = parse_any_trace(lines).ceiling()
    two = parse_any_trace(long[:600]).ceiling()
    assert one is not None
    assert two is not None
    assert two.input_tokens == 2 * one.input_tokens
    assert two.ceiling_tokens == 2 * one.ceiling_tokens
