"""Replaying the public trace formats (Mooncake, Qwen-Bailian)."""

from __future__ import annotations

import gzip
import json
from functools import cache
from pathlib import Path

import pytest

import kvcore
import kvcore.tools.zoo
from kvcore.coordinator import Request
from kvcore.errors import KvcoreValueError
from kvcore.plan.block_sizes import plan_hit_granularity
from kvcore.serialize import load_model_file
from kvcore.structs import KVCacheConfig
from kvcore.tools.cli import main
from kvcore.tools.limits import MAX_TRACE_REQUEST_TOKENS
from kvcore.tools.simulate import Driver, TraceError, load_trace
from kvcore.tools.simulate.public_traces import (
    block_tokens_of,
    detect_trace_format,
    load_any_trace,
    parse_any_trace,
    trace_ceiling,
)
from kvcore.tools.simulate.trace import read_trace_lines
from kvcore.tools.simulate.workload import TokenRun

MOONCAKE = (
    Path(__file__).parent / "fixtures" / "traces" / "mooncake_synthetic_trace.jsonl.gz"
)


@cache
def mooncake_lines() -> tuple[str, ...]:
    return tuple(gzip.decompress(MOONCAKE.read_bytes()).decode().splitlines())


def mooncake(ts: int, length: int, out: int, ids: list[int]) -> str:
    return json.dumps(
        {"timestamp": ts, "input_length": length, "output_length": out, "hash_ids": ids}
    )


def bailian(
    chat: int, parent: int, ts: float, length: int, out: int, ids: list[int]
) -> str:
    return json.dumps(
        {
            "chat_id": chat,
            "parent_chat_id": parent,
            "turn": 1 if parent < 0 else 2,
            "timestamp": ts,
            "input_length": length,
            "output_length": out,
            "hash_ids": ids,
            "type": "text",
        }
    )


@cache
def llama_plan(
    memory: int, max_model_len: int = 2**18
) -> tuple[KVCacheConfig, kvcore.KindRegistry]:
    registry = kvcore.default_registry()
    model = load_model_file(kvcore.tools.zoo.path("llama-3-1-8b"), registry)
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout="BLHNC", enable_prefix_caching=True
        ),
        max_model_len=max_model_len,
    )
    return kvcore.plan_kv_cache(
        config, model.layers, memory, registry=registry
    ), registry


def independent_ceiling(
    lines: list[str] | tuple[str, ...], block: int
) -> tuple[int, int]:
    """Prompt tokens, and those an unbounded cache serves: whole shared
    blocks (a block is shared when its chain of ids was seen), less one
    token of a request served whole."""
    seen: set[tuple[int, ...]] = set()
    total = served = 0
    for line in lines:
        rec = json.loads(line)
        length, ids = rec["input_length"], rec["hash_ids"]
        total += length
        k = 0
        while k < len(ids) and tuple(ids[: k + 1]) in seen:
            k += 1
        served += min(k * block, length - 1)
        seen.update(tuple(ids[: i + 1]) for i in range(len(ids)))
    return total, served


# -- formats -----------------------------------------------------------------------


def test_formats_are_detected_from_the_first_record() -> None:
    assert detect_trace_format(json.loads(mooncake(0, 10, 1, [1]))) == "mooncake"
    assert detect_trace_format(json.loads(bailian(1, -1, 0, 10, 1, [1]))) == "bailian"
    assert detect_trace_format({"prompt_len": 3, "output_len": 1}) == "kvcore"
    assert detect_trace_format([1, 2]) == "kvcore"
    assert parse_any_trace(["", mooncake(0, 10, 1, [1])]).format == "mooncake"
    loaded = parse_any_trace([bailian(1, -1, 0, 10, 1, [1])])
    assert (loaded.format, loaded.block_tokens) == ("bailian", 16)
    kv = parse_any_trace(['{"prompt_len": 3, "output_len": 1}'])
    assert kv.format == "kvcore"
    assert kv.ceiling() is None
    # Forced: a Mooncake line read as Bailian misses chat_id.
    with pytest.raises(TraceError, match="field 'chat_id'"):
        parse_any_trace([mooncake(0, 10, 1, [1])], trace_format="bailian")
    with pytest.raises(TraceError, match="unknown trace format 'vllm'"):
        parse_any_trace([mooncake(0, 10, 1, [1])], trace_format="vllm")


def test_a_mooncake_line_becomes_its_blocks_tokens() -> None:
    loaded = parse_any_trace(
        [mooncake(0, 1000, 3, [7, 8]), mooncake(1500, 600, 2, [7, 9])]
    )
    a, b = loaded.workload.requests
    assert (a.arrival_s, b.arrival_s) == (0.0, 1.5)  # ms on the clock
    assert isinstance(a.prompt, TokenRun)
    tokens_a, tokens_b = list(a.prompt), list(b.prompt)
    assert len(tokens_a) == 1000
    assert len(tokens_b) == 600
    assert a.output_len == 3
    assert all(0 <= t < 2**32 for t in tokens_a + tokens_b)
    own = list(TokenRun((block_tokens_of(7, 512),)))
    assert tokens_a[:512] == tokens_b[:512] == own
    # The partial last block is the first tokens of its id's stream.
    assert tokens_a[512:] == list(TokenRun((block_tokens_of(8, 512),)))[:488]
    assert tokens_b[512:] != tokens_a[512:600]
    # The clock starts at the first arrival, however the trace stamps it.
    epoch = parse_any_trace(
        [mooncake(1_700_000_000_000 + t, 10, 1, [t]) for t in (0, 250)]
    )
    assert [r.arrival_s for r in epoch.workload.requests] == [0.0, 0.25]
    untimed = parse_any_trace([mooncake(0, 10, 1, [1])], timing=False)
    assert untimed.workload.requests[0].arrival_s is None
    assert not untimed.workload.timed


@pytest.mark.parametrize("block_size", [16, 64, 256, 2048])
def test_equal_ids_give_equal_prefixes_at_any_block_size(block_size: int) -> None:
    # Five shared 512-token blocks (2,560 tokens), then different ones.
    shared = [11, 12, 13, 14, 15]
    loaded = parse_any_trace(
        [
            mooncake(0, 4096, 1, [*shared, 20, 21, 22]),
            mooncake(0, 4096, 1, [*shared, 30, 31, 32]),
        ]
    )
    hashes = [
        Request(r.id, list(r.prompt), hash_block_size=block_size).block_hashes
        for r in loaded.workload.requests
    ]
    same = 2560 // block_size
    assert len(hashes[0]) == len(hashes[1]) == 4096 // block_size
    assert hashes[0][:same] == hashes[1][:same]
    assert hashes[0][same] != hashes[1][same]
    # A block id's stream is the same at every block length it is cut to.
    assert block_tokens_of(12, 16) == block_tokens_of(12, 512)[: 4 * 16]


def test_a_bailian_turn_extends_its_parents_chat() -> None:
    lines = [
        # Chat 1: 40 prompt tokens (16 + 16 + 8), 10 output tokens.
        bailian(1, -1, 0.0, 40, 10, [100, 101, 102]),
        # Its next turn: the parent's full blocks, then the rest of the chat.
        bailian(2, 1, 5.0, 70, 4, [100, 101, 200, 201, 202]),
        # Same parent, but ids that do not start with the parent's: a fresh
        # prompt, not a continuation.
        bailian(3, 1, 6.0, 70, 4, [300, 301, 302, 303, 304]),
        # A parent outside the trace: a first turn.
        bailian(4, 99, 7.0, 20, 1, [400, 401]),
    ]
    loaded = parse_any_trace(lines)
    assert loaded.chat_turns == 1
    one, two, three, four = loaded.workload.requests
    assert two.parent == "1"
    assert three.parent is None
    assert four.parent is None
    chat = list(one.prompt) + list(one.output)
    assert list(two.prompt)[:50] == chat
    assert len(two.prompt) == 70
    # The tokens after the parent's prompt and output are the turn's own
    # blocks' tokens at those positions (position 50 is offset 2 of block 3).
    assert (
        list(two.prompt)[50:]
        == list(TokenRun((block_tokens_of(201, 16),)))[2:]
        + list(TokenRun((block_tokens_of(202, 16),)))[:6]
    )
    # Replayed, the turn hits its parent's prompt and output (49 computed
    # tokens: three whole 16-token blocks).
    plan, registry = llama_plan(2**30, 4096)
    result = Driver(plan, registry=registry).run(loaded.workload)
    assert result.completed == 4
    assert result.prefix_hit_tokens == 48
    # The ceiling counts what an unbounded cache serves, the parent's output
    # too: the 49 tokens turn 1 computed (its last output token is sampled,
    # never computed); in 16-token hits, the 48 the replay served.
    ceiling = loaded.ceiling(16)
    assert ceiling is not None
    assert (ceiling.ceiling_tokens, ceiling.aligned_tokens) == (49, 48)
    assert ceiling.aligned_tokens == result.prefix_hit_tokens


def test_the_ceiling_counts_whole_shared_blocks() -> None:
    records = [
        (8, [1, 2]),  # nothing before it
        (10, [1, 2, 3]),  # shares both blocks: 8
        (6, [1, 9]),  # shares block 1: 4
        (8, [1, 2]),  # shares everything, less the token it computes: 7
        (6, [5, 6]),  # block 6 holds 2 tokens
        (8, [5, 6]),  # shares 4 + the 2 tokens of block 6 seen before: 6
        (8, [5, 6]),  # block 6 was seen whole now: all but one, 7
    ]
    ceiling = trace_ceiling(records, 4)
    assert ceiling.input_tokens == 54
    assert ceiling.ceiling_tokens == 8 + 4 + 7 + 6 + 7
    aligned = trace_ceiling(records, 4, granularity=4)
    assert aligned.aligned_tokens == 8 + 4 + 4 + 4 + 4


# -- hostile lines -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "field", "match"),
    [
        ('{"timestamp": 0, "input_length": ', None, "not valid JSON"),
        ("[1, 2]", None, "must be a JSON object"),
        (mooncake(0, -5, 1, []), "input_length", "must be an int >= 1"),
        (mooncake(0, 10, 0, [1]), "output_length", "must be an int >= 1"),
        (mooncake(0, 1024, 1, [1, 2, 3]), "hash_ids", "fills only 2 blocks"),
        (mooncake(0, 10, 1, ["a"]), "hash_ids", "id 0 is 'a'"),
        (mooncake(0, 10, 1, [1.5]), "hash_ids", "id 0 is 1.5"),
        (mooncake(0, 10, 1, [True]), "hash_ids", "id 0 is True"),
        (mooncake(0, 10, 1, [-1]), "hash_ids", "id 0 is -1"),
        (mooncake(0, 10, 1, [2**64]), "hash_ids", "ids are ints in"),
        (
            mooncake(0, MAX_TRACE_REQUEST_TOKENS + 1, 1, [1]),
            "input_length",
            "MAX_TRACE_REQUEST_TOKENS",
        ),
        (mooncake(0, 10, 10**12, [1]), "output_length", "MAX_TRACE_REQUEST_TOKENS"),
        (mooncake(-1, 10, 1, [1]), "timestamp", "finite number"),
        (mooncake(10**400, 10, 1, [1]), "timestamp", "an int of about 401 digits"),
        (mooncake(0, 10**400, 1, [1]), "input_length", "an int of about 401 digits"),
        (
            '{"timestamp": NaN, "input_length": 1, "output_length": 1, "hash_ids": []}',
            "timestamp",
            "finite",
        ),
        (
            '{"timestamp": 9, "input_length": 10, "hash_ids": [1]}',
            "output_length",
            "missing",
        ),
        (mooncake(9, 10, 1, 7), "hash_ids", "must be a list"),  # type: ignore[arg-type]
    ],
)
def test_hostile_mooncake_lines_are_refused(
    line: str, field: str | None, match: str
) -> None:
    first = mooncake(0, 10, 1, [1])
    with pytest.raises(TraceError, match=match) as info:
        parse_any_trace([first, line], source="t.jsonl", trace_format="mooncake")
    err = info.value
    assert isinstance(err, KvcoreValueError)
    assert isinstance(err, ValueError)
    assert err.line == 2
    assert err.field == field
    assert str(err).startswith("t.jsonl line 2")
    if field is not None:
        assert f"field {field!r}" in str(err)


@pytest.mark.parametrize(
    ("line", "field", "match"),
    [
        (bailian(-1, -1, 1, 10, 1, [1]), "chat_id", "must not be -1"),
        (bailian(2, 2, 1, 10, 1, [1]), "parent_chat_id", "names the request itself"),
        (
            json.dumps(
                {
                    "chat_id": [1],
                    "timestamp": 1,
                    "input_length": 1,
                    "output_length": 1,
                    "hash_ids": [],
                }
            ),
            "chat_id",
            "must be an int >= 0",
        ),
    ],
)
def test_hostile_bailian_lines_are_refused(line: str, field: str, match: str) -> None:
    with pytest.raises(TraceError, match=match) as info:
        parse_any_trace([bailian(1, -1, 0, 10, 1, [1]), line], trace_format="bailian")
    assert (info.value.line, info.value.field) == (2, field)


def test_a_trace_out_of_arrival_order_is_refused() -> None:
    lines = [mooncake(8, 10, 1, [1]), mooncake(5, 10, 1, [1])]
    with pytest.raises(TraceError, match="before the previous line's") as info:
        parse_any_trace(lines)
    assert (info.value.line, info.value.field) == (2, "timestamp")


def test_an_empty_trace_is_refused() -> None:
    with pytest.raises(TraceError, match="holds no requests"):
        parse_any_trace(["", "  "], trace_format="mooncake")


# -- replay ------------------------------------------------------------------------


def test_a_timed_trace_runs_on_the_simulated_clock() -> None:
    lines = [mooncake(0, 100, 3, [1]), mooncake(10_000, 100, 3, [2])]
    loaded = parse_any_trace(lines)
    plan, registry = llama_plan(2**30, 4096)
    driver = Driver(plan, registry=registry, prefill_rate=1000.0, decode_rate=50.0)
    result = driver.run(loaded.workload)
    # Each: a 100-token prefill (0.1 s) and two decodes (0.02 s each); the
    # idle clock jumps to the second arrival at 10 s.
    assert result.timed
    assert result.clock_s == pytest.approx(10.14)
    assert result.steps == 6
    assert [c.peak for c in result.concurrency] == [1] * 6
    assert result.concurrency[-1].clock_s == pytest.approx(10.14)
    untimed = Driver(plan, registry=registry).run(
        parse_any_trace(lines, timing=False).workload
    )
    assert not untimed.timed
    assert untimed.clock_s == 0.0
    assert untimed.completed == 2


def test_a_trace_subset_replays_to_its_ceiling() -> None:
    lines = mooncake_lines()[:60]
    loaded = parse_any_trace(lines)
    plan, registry = llama_plan(128 * 2**30)
    granularity = plan_hit_granularity(plan)
    assert granularity == 16
    ceiling = loaded.ceiling(granularity)
    assert ceiling is not None
    total, served = independent_ceiling(lines, 512)
    assert (ceiling.input_tokens, ceiling.ceiling_tokens) == (total, served)
    assert ceiling.ceiling_tokens > 0
    for workload in (loaded.workload, parse_any_trace(lines, timing=False).workload):
        result = Driver(plan, registry=registry).run(workload)
        assert result.completed == 60
        assert result.preemptions == 0
        assert result.evictions == 0
        # An ample pool serves exactly the ceiling, rounded down to whole
        # 16-token blocks per request; a perfect token cache, the ceiling.
        assert result.prefix_hit_tokens == ceiling.aligned_tokens
        assert result.token_bound_tokens == ceiling.ceiling_tokens
        assert result.prompt_tokens_looked_up == total


def test_the_shared_traces_ceiling_is_65_1_percent() -> None:
    loaded = parse_any_trace(mooncake_lines())
    assert len(loaded.workload) == 3993
    ceiling = loaded.ceiling(16)
    assert ceiling is not None
    total, served = independent_ceiling(mooncake_lines(), 512)
    assert (ceiling.input_tokens, ceiling.ceiling_tokens) == (total, served)
    assert round(ceiling.rate, 3) == 0.651


@pytest.mark.slow
def test_the_shared_trace_replays_to_its_ceiling() -> None:
    loaded = parse_any_trace(mooncake_lines())
    plan, registry = llama_plan(3 * 2**40)
    ceiling = loaded.ceiling(plan_hit_granularity(plan))
    assert ceiling is not None
    result = Driver(plan, registry=registry).run(loaded.workload)
    assert result.completed == 3993
    assert result.preemptions == 0
    assert result.evictions == 0
    assert result.prefix_hit_tokens == ceiling.aligned_tokens
    assert result.token_bound_tokens == ceiling.ceiling_tokens
    assert round(result.prefix_hit_rate, 3) == 0.651


# -- the command -------------------------------------------------------------------


def test_simulate_replays_a_mooncake_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "mooncake.jsonl"
    trace.write_text("\n".join(mooncake_lines()[:60]) + "\n")
    args = ["simulate", "llama-3-1-8b", "--trace", str(trace)]
    assert main([*args, "--memory", "128GiB", "--no-timing", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workload"]["format"] == "mooncake"
    assert doc["workload"]["block_tokens"] == 512
    assert doc["workload"]["timed"] is False
    result, ceiling = doc["result"], doc["ceiling"]
    assert result["completed"] == 60
    assert result["prefix_hit_tokens"] == ceiling["aligned_tokens"] > 0
    assert (
        ceiling["ceiling_tokens"] == independent_ceiling(mooncake_lines()[:60], 512)[1]
    )
    assert ceiling["hit_rate_over_ceiling"] == pytest.approx(
        ceiling["aligned_tokens"] / ceiling["ceiling_tokens"]
    )
    assert len(result["concurrency"]) <= 100
    assert result["mean_running"] > 0
    # A sweep over memory, drawn.
    svg = tmp_path / "curve.svg"
    sweep = [*args, "--memory", "2GiB,128GiB", "--svg", str(svg), "--json"]
    assert main(sweep) == 0
    doc = json.loads(capsys.readouterr().out)
    runs = doc["runs"]
    assert [r["memory"]["kv_cache_bytes"] for r in runs] == [2 * 2**30, 128 * 2**30]
    small, ample = (r["result"] for r in runs)
    # The timed replay of an ample pool serves the ceiling too; a pool of
    # 1,023 blocks cannot hold the longest prompts.
    assert ample["prefix_hit_tokens"] == runs[1]["ceiling"]["aligned_tokens"]
    assert not ample["unserved"]
    assert small["unserved"]
    assert doc["result"] == runs[0]["result"]
    assert svg.read_text().startswith("<?xml")
    assert main([*args, "--memory", "2GiB,128GiB"]) == 0
    text = capsys.readouterr().out
    assert "trace ceiling (unbounded cache)" in text
    assert "hit rate against memory" in text


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--trace-format", "mooncake"], "--trace-format shapes how a --trace"),
        (["--no-timing"], "--no-timing shapes how a --trace"),
        (["--svg", "x.svg"], "give --memory SIZES"),
        (["--memory", "1GiB,,2GiB"], "comma-separated list"),
        (
            ["--trace", "TRACE", "--prefill-rate", "0"],
            "--prefill-rate takes a positive",
        ),
        (
            ["--trace", "TRACE", "--trace-block-tokens", "0"],
            "--trace-block-tokens takes an int >= 1",
        ),
    ],
)
def test_simulate_refuses_bad_trace_options(
    extra: list[str], match: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(mooncake(0, 10, 1, [1]) + "\n")
    extra = [str(trace) if e == "TRACE" else e for e in extra]
    assert main(["simulate", "llama-3-1-8b", *extra]) == 2
    assert match in capsys.readouterr().err


def test_simulate_names_the_bad_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(mooncake(0, 10, 1, [1]) + "\n" + mooncake(1, 10, 1, [1, 2]) + "\n")
    assert main(["simulate", "llama-3-1-8b", "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcore: error: ")
    assert "line 2, field 'hash_ids'" in err


@pytest.mark.parametrize("compression", ["gzip", "bzip2", "xz", None])
def test_a_trace_file_reads_plain_or_compressed(
    tmp_path: Path, compression: str | None
) -> None:
    """A trace compressed with gzip, bzip2 or xz is told by its first bytes
    (its name says nothing) and reads as the plain file does; a leading
    byte-order mark is skipped."""
    import bz2
    import lzma

    lines = list(mooncake_lines()[:20])
    text = ("\ufeff" if compression is None else "") + "\n".join(lines) + "\n"
    pack = {"gzip": gzip.compress, "bzip2": bz2.compress, "xz": lzma.compress}
    data = text.encode()
    path = tmp_path / "trace.jsonl"
    path.write_bytes(pack[compression](data) if compression else data)
    loaded = load_any_trace(path)
    assert loaded.format == "mooncake"
    assert read_trace_lines(path) == lines
    assert loaded.ceiling() == parse_any_trace(lines).ceiling()


def test_a_broken_or_oversized_trace_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A truncated compressed file and bytes that are not UTF-8 inside one
    are named; a file past MAX_TRACE_BYTES (once decompressed) is refused
    before it is read whole."""
    import kvcore.tools.simulate.trace as trace_module

    whole = gzip.compress("\n".join(mooncake_lines()[:20]).encode())
    cut = tmp_path / "cut.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(TraceError, match=r"cannot read trace .*cut\.gz") as info:
        read_trace_lines(cut)
    assert isinstance(info.value, KvcoreValueError)
    latin = tmp_path / "latin.gz"
    latin.write_bytes(gzip.compress(mooncake(0, 10, 1, [1]).encode() + b"\n\xe9\n"))
    with pytest.raises(TraceError, match=r"line 2: not UTF-8 text \(inside its gzip"):
        read_trace_lines(latin)
    monkeypatch.setattr(trace_module, "MAX_TRACE_BYTES", 1000)
    monkeypatch.setattr(trace_module, "_CHUNK_BYTES", 256)
    big = tmp_path / "big.jsonl.gz"
    big.write_bytes(gzip.compress(b"\n" * 5000))
    with pytest.raises(TraceError, match=r"more than 1,000 bytes once decompressed"):
        read_trace_lines(big)
    plain = tmp_path / "big.jsonl"
    plain.write_bytes(b"\n" * 1001)
    with pytest.raises(TraceError, match="MAX_TRACE_BYTES"):
        read_trace_lines(plain)
    plain.write_bytes(b"\n" * 1000)
    assert read_trace_lines(plain) == [""] * 1000


def test_a_reused_bailian_chat_id_names_its_latest_line() -> None:
    """A published trace may give two lines one chat id: both replay (the
    second under a key of its own), and a later turn's parent is the latest
    earlier line with that id, itself included."""
    lines = [
        bailian(1, -1, 0.0, 40, 10, [100, 101, 102]),
        bailian(1, -1, 1.0, 40, 10, [300, 301, 302]),
        # Extends the second chat 1 (its ids start with that one's).
        bailian(2, 1, 5.0, 70, 4, [300, 301, 400, 401, 402]),
        # Names its own id, used before: the chat it extends.
        bailian(2, 2, 6.0, 90, 4, [300, 301, 400, 401, 402, 500]),
    ]
    loaded = parse_any_trace(lines)
    first, second, third, fourth = loaded.workload.requests
    assert [r.id for r in loaded.workload.requests] == ["1", "1#2", "2", "2#4"]
    parents = (first.parent, second.parent, third.parent, fourth.parent)
    assert parents == (None, None, "1#2", "2")
    assert loaded.chat_turns == 2
    assert list(third.prompt)[:50] == list(second.prompt) + list(second.output)
    plan, registry = llama_plan(2**30, 4096)
    result = Driver(plan, registry=registry).run(loaded.workload)
    assert result.completed == 4


@pytest.mark.parametrize("compressed", [False, True])
def test_a_trace_streamed_through_a_pipe_is_read_once(
    tmp_path: Path, compressed: bool
) -> None:
    """A named pipe (``--trace <(zcat ...)``) can be opened and read only
    once: its first bytes tell the compression without a second open, and
    every line arrives.  The writer opens the pipe a second time to end a
    second read with nothing, were there one."""
    import os
    import threading

    lines = list(mooncake_lines()[:5])
    data = ("\n".join(lines) + "\n").encode()
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)

    def write() -> None:
        try:
            with fifo.open("wb") as out:
                out.write(gzip.compress(data) if compressed else data)
        except BrokenPipeError:
            pass
        with fifo.open("wb"):
            pass

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        assert read_trace_lines(fifo) == lines
    finally:
        # Let the writer's second open return: hold a reader open until the
        # writer is done (its open may come after this one, on a busy host).
        while writer.is_alive():
            reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
            writer.join(0.05)
            os.close(reader)


def test_a_corrupt_deflate_stream_is_a_trace_error(tmp_path: Path) -> None:
    """A gzip header over data that is not deflate is named as unreadable,
    as a truncated file is, not raised as zlib's own error."""
    path = tmp_path / "bad.gz"
    path.write_bytes(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + b"\xff" * 20)
    with pytest.raises(TraceError, match=r"cannot read trace .*bad\.gz: .*invalid"):
        read_trace_lines(path)


def test_a_parent_id_no_line_has_never_names_a_reused_line() -> None:
    """A reused chat id's line gets a key such as ``"1#2"``; a later line
    whose parent_chat_id is the string ``"1#2"`` (an id no line has) has
    no parent in the trace, not the reused line."""
    second = json.loads(bailian(1, -1, 1.0, 40, 10, [100, 101, 102]))
    orphan = json.loads(bailian(3, -1, 5.0, 70, 4, [100, 101, 400, 401, 402]))
    orphan["parent_chat_id"] = "1#2"
    lines = [
        bailian(1, -1, 0.0, 40, 10, [100, 101, 102]),
        json.dumps(second),
        json.dumps(orphan),
    ]
    loaded = parse_any_trace(lines)
    assert [r.id for r in loaded.workload.requests] == ["1", "1#2", "3"]
    assert [r.parent for r in loaded.workload.requests] == [None, None, None]
    assert loaded.chat_turns == 0


def test_a_trace_splits_lines_only_at_line_feeds(tmp_path: Path) -> None:
    """JSON lines end at ``\\n`` (or ``\\r\\n``) only: U+2028, U+2029 and
    U+0085 are valid raw inside a JSON string (an id written by a tool that
    does not escape them) and stay in it."""
    ids = ["a\u2028b", "c\u2029d", "e\x85f"]
    text = "".join(
        json.dumps({"id": rid, "prompt_len": 4, "output_len": 1}, ensure_ascii=False)
        + "\r\n"
        for rid in ids
    )
    path = tmp_path / "trace.jsonl"
    path.write_bytes(text.encode())
    assert len(read_trace_lines(path)) == 3
    assert [r.id for r in load_trace(path).requests] == ids


def test_ids_with_lone_surrogates_replay() -> None:
    """``"\\ud800"`` is valid JSON: a chat id or a request id holding it
    names its request like any other text."""
    chat = '{"chat_id": "\\ud800", "parent_chat_id": -1, "timestamp": 0, '
    chat += '"input_length": 10, "output_length": 2, "hash_ids": [1]}'
    loaded = parse_any_trace([chat, chat.replace("0, ", "1, ", 1)])
    assert [r.id for r in loaded.workload.requests] == ["\ud800", "\ud800#2"]
    kv = parse_any_trace(['{"id": "\\ud800", "prompt_len": 10, "output_len": 2}'])
    assert len(kv.workload.requests[0].prompt) == 10


def test_an_int_too_long_to_print_is_refused_on_any_line() -> None:
    first = '{"prompt_len": 10, "output_len": 2}'
    huge = '{"prompt_len": ' + "9" * 5000 + ', "output_len": 2}'
    with pytest.raises(TraceError, match="line 2: not valid JSON") as info:
        parse_any_trace([first, huge], source="t.jsonl")
    assert info.value.line == 2
