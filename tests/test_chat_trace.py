"""benchmarks/chat_trace.py writes a chat trace in the Qwen-Bailian format
that kvcore reads as chats: each later turn extends its parent's prompt and
output, so a replay can serve it the parent's whole conversation."""

from __future__ import annotations

import json
from typing import Any

import pytest
from benchmark_scripts import load_benchmark

from kvcore.tools.simulate.public_traces import parse_any_trace


@pytest.fixture(scope="module")
def chat_trace() -> Any:
    return load_benchmark("chat_trace").chat_trace


def test_turns_extend_their_parents_and_arrive_in_order(chat_trace: Any) -> None:
    records = list(chat_trace(40, seed=3, system_prompts=2))
    assert records == list(chat_trace(40, seed=3, system_prompts=2))  # seeded
    times = [r["timestamp"] for r in records]
    assert times == sorted(times)
    by_id = {r["chat_id"]: r for r in records}
    later = [r for r in records if r["parent_chat_id"] != -1]
    assert later, "some chats have several turns"
    for turn in later:
        parent = by_id[turn["parent_chat_id"]]
        assert turn["turn"] == parent["turn"] + 1
        assert turn["timestamp"] > parent["timestamp"]
        # The parent's prompt, then its output's blocks, then new ones.
        ids = parent["hash_ids"]
        assert turn["hash_ids"][: len(ids)] == ids
        assert turn["input_length"] > parent["input_length"] + parent["output_length"]
    # Chats open on one of the two system prompts.
    assert len({r["hash_ids"][0] for r in records if r["turn"] == 1}) == 2
    loaded = parse_any_trace([json.dumps(r) for r in records], source="chat")
    assert loaded.format == "bailian"
    # kvcore reads every later turn as its parent's continuation.
    parents = {str(r["chat_id"]): r["parent_chat_id"] for r in records}
    for request in loaded.workload.requests:
        expected = parents[request.id]
        assert request.parent == (None if expected == -1 else str(expected))
