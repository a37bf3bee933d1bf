"""The public trace formats: Mooncake and Alibaba Qwen-Bailian JSON lines.

Both describe each request by its lengths, its arrival time and the ids of
its prompt's blocks, never by its tokens:

Mooncake (``timestamp`` in ms, ``input_length``, ``output_length``,
``hash_ids``: one id per 512-token block, the last block may be partial)
    what ``vllm bench serve``, SGLang's ``bench_serving``, AIPerf and
    GuideLLM replay.  Two prompts share a block exactly when they share its
    id and every id before it.
Qwen-Bailian (``chat_id``, ``parent_chat_id`` (-1: none), ``turn``,
``timestamp`` in seconds, ``input_length``, ``output_length``,
``hash_ids`` per 16-token block)
    a turn's prompt holds its parent turn's prompt and output.

Block ids become token ids so that equal ids give equal prefixes at any
kvcore block size: block id ``x`` stands for the first ``block_tokens``
ids of a keyed stream of ``x`` alone (SHAKE-128 of ``"kvcore-trace:x"``
read as little-endian 32-bit words, so ids are in ``[0, 2**32)``); a last,
partial block of ``k`` tokens is the first ``k`` of them.  Tokens past the
last id (a trace that gives fewer ids than blocks) and every output are
drawn from the request's own key, so they are never shared.

A Bailian turn whose parent is in the trace, whose ids start with the
parent's full blocks' ids and whose prompt is at least the parent's prompt
and output long, is the parent's prompt, the parent's output, then the
tokens of its own blocks from that position on: it waits for the parent to
finish and the cache can serve it the parent's output as an engine would.

The ceiling (:meth:`LoadedTrace.ceiling`, :func:`trace_ceiling`) is what an
unbounded cache could serve of each prompt, in arrival order, from every
token earlier requests computed (their prompts and all but their last
output token), at most all but one token of a request, which must be
computed.  From ids alone that is the whole shared blocks (a shared last
block counts the tokens shared with the longest earlier copy of it); a
chat turn can also be served its parent's output.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import attrs

from kvcore.errors import echo
from kvcore.tools.choices import TRACE_FORMATS
from kvcore.tools.limits import (
    MAX_TRACE_BLOCK_TOKENS,
    MAX_TRACE_HASH_ID,
    MAX_TRACE_LINE_CHARS,
    MAX_TRACE_REQUEST_TOKENS,
    MAX_TRACE_TOTAL_TOKENS,
    MAX_WORKLOAD_REQUESTS,
)
from kvcore.tools.records import Record
from kvcore.tools.simulate.bound import ComputedPrefixes
from kvcore.tools.simulate.trace import TraceError, parse_trace, read_trace_lines
from kvcore.tools.simulate.workload import (
    TokenRun,
    Workload,
    WorkloadRequest,
    pack_words,
)

__all__ = [
    "BLOCK_TOKENS",
    "TRACE_FORMATS",
    "LoadedTrace",
    "TraceCeiling",
    "block_tokens_of",
    "detect_trace_format",
    "load_any_trace",
    "parse_any_trace",
    "trace_ceiling",
]

#: Tokens per hash id of each public format.
BLOCK_TOKENS = {"mooncake": 512, "bailian": 16}

#: Seconds per unit of each public format's ``timestamp``.
TIME_UNIT_S = {"mooncake": 1e-3, "bailian": 1.0}

#: The fields each public format requires; others are ignored (the
#: published traces carry extra ones, Bailian's ``type`` for one).
REQUIRED = {
    "mooncake": ("timestamp", "input_length", "output_length", "hash_ids"),
    "bailian": (
        "chat_id",
        "timestamp",
        "input_length",
        "output_length",
        "hash_ids",
    ),
}

_KEY = "kvcore-trace"


def block_tokens_of(block_id: int, count: int) -> bytes:
    """The first ``count`` token ids of block id ``block_id``, as
    little-endian 4-byte words (the same at every block length)."""
    return hashlib.shake_128(f"{_KEY}:{block_id}".encode()).digest(4 * count)


def _own_tokens(key: str, count: int) -> bytes:
    """``count`` token ids drawn from a request's own key (never shared)."""
    if count <= 0:
        return b""
    # A key from a trace may hold a lone surrogate ("\ud800" is valid JSON).
    own = f"{_KEY}:own:{key}".encode("utf-8", "surrogatepass")
    return hashlib.shake_128(own).digest(4 * count)


@attrs.frozen
class TraceCeiling(Record):
    """What an unbounded prefix cache could serve of a trace's prompts,
    from its hash ids alone (see the module docs)."""

    #: Prompt tokens of every request.
    input_tokens: int
    #: Of those, tokens an unbounded cache serves.
    ceiling_tokens: int
    #: The same, counted only in whole multiples of a hit granularity: the
    #: most a cache that hits in blocks of ``granularity`` tokens serves.
    granularity: int = 1
    aligned_tokens: int = 0

    @property
    def rate(self) -> float:
        return self.ceiling_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def aligned_rate(self) -> float:
        return self.aligned_tokens / self.input_tokens if self.input_tokens else 0.0

    json_fields: ClassVar[str] = (
        "input_tokens ceiling_tokens ceiling_rate=rate granularity "
        "aligned_tokens aligned_rate"
    )


@attrs.frozen
class _Record:
    """One checked line of a public trace."""

    line: int
    key: str
    time_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    parent: str | None


@attrs.frozen
class LoadedTrace:
    """A trace file read into a workload, with its format and ceiling."""

    workload: Workload
    format: str
    #: Tokens per hash id (``None`` for the kvcore format, which has none).
    block_tokens: int | None
    #: Chat turns replayed as their parent's prompt and output extended.
    chat_turns: int = 0

    def ceiling(self, granularity: int = 1) -> TraceCeiling | None:
        """The trace's ceiling (see the module docs; ``None`` for the kvcore
        format, which has no hash ids)."""
        if self.block_tokens is None:
            return None
        return _ceiling(self.workload, granularity)


def trace_ceiling(
    records: Iterable[tuple[int, Sequence[int]]],
    block_tokens: int,
    granularity: int = 1,
) -> TraceCeiling:
    """The unbounded-cache ceiling of ``(input_length, hash_ids)`` pairs in
    arrival order, blocks of ``block_tokens`` tokens (see the module docs);
    ``aligned_tokens`` rounds each request's share down to a multiple of
    ``granularity``."""
    recs = [
        _Record(0, str(i), 0.0, length, 1, tuple(ids), None)
        for i, (length, ids) in enumerate(records)
    ]
    workload, _ = _workload(recs, "mooncake", block_tokens, timing=False)
    return _ceiling(workload, granularity)


def _ceiling(workload: Workload, granularity: int) -> TraceCeiling:
    if type(granularity) is not int or granularity < 1:
        msg = f"granularity must be a positive int, got {echo(granularity)}"
        raise TraceError(msg, line=0)
    computed = ComputedPrefixes()
    total = served = aligned = 0
    for request in workload.requests:
        prompt = request.prompt
        words = prompt.words() if isinstance(prompt, TokenRun) else pack_words(prompt)
        length = len(prompt)
        total += length
        share = computed.longest_prefix(words, length - 1) if length > 1 else 0
        served += share
        aligned += share - share % granularity
        # What the request computes: its prompt and every output token but
        # the last, which is sampled and never fed back.
        output = request.output[:-1]
        computed.extend(request.id, words + pack_words(output), length + len(output))
    return TraceCeiling(total, served, granularity, aligned)


def detect_trace_format(record: object) -> str:
    """The format of a trace whose first record is ``record``: ``bailian``
    with ``hash_ids`` and ``chat_id``, ``mooncake`` with ``hash_ids`` and
    ``input_length``, else ``kvcore``."""
    if isinstance(record, dict) and "hash_ids" in record:
        if "chat_id" in record or "parent_chat_id" in record:
            return "bailian"
        if "input_length" in record:
            return "mooncake"
    return "kvcore"


def load_any_trace(
    path: str | Path,
    *,
    trace_format: str | None = None,
    timing: bool = True,
    block_tokens: int | None = None,
) -> LoadedTrace:
    """Read a trace file in any format (see :func:`parse_any_trace`)."""
    return parse_any_trace(
        read_trace_lines(path),
        source=str(path),
        trace_format=trace_format,
        timing=timing,
        block_tokens=block_tokens,
    )


def parse_any_trace(
    lines: Iterable[str],
    *,
    source: str = "trace",
    trace_format: str | None = None,
    timing: bool = True,
    block_tokens: int | None = None,
) -> LoadedTrace:
    """The workload of trace lines in ``trace_format`` (``None``: detected
    from the first record's keys).

    :param timing: arrivals at the trace's times on the simulated clock;
        ``False`` replays the requests in order, all due at once.
    :param block_tokens: tokens per hash id (default: the format's, 512 for
        Mooncake and 16 for Bailian).
    """
    lines = list(lines)
    if trace_format is not None and trace_format not in TRACE_FORMATS:
        msg = (
            f"{source}: unknown trace format {trace_format!r}; the formats are "
            + ", ".join(TRACE_FORMATS)
        )
        raise TraceError(msg, line=0)
    if trace_format is None:
        trace_format = "kvcore"
        for number, raw in enumerate(lines, 1):
            if raw.strip():
                trace_format = detect_trace_format(_load(raw, number, source))
                break
    if trace_format == "kvcore":
        if block_tokens is not None:
            msg = (
                f"{source}: a kvcore-format trace has no hash ids; the block "
                "length applies to the mooncake and bailian formats"
            )
            raise TraceError(msg, line=0)
        return LoadedTrace(parse_trace(lines, source=source), "kvcore", None)
    size = BLOCK_TOKENS[trace_format] if block_tokens is None else block_tokens
    if type(size) is not int or not 1 <= size <= MAX_TRACE_BLOCK_TOKENS:
        msg = (
            f"{source}: the block length must be an int in "
            f"[1, {MAX_TRACE_BLOCK_TOKENS}], got {echo(size)}"
        )
        raise TraceError(msg, line=0)
    records = _records(lines, source, trace_format, size)
    workload, turns = _workload(records, trace_format, size, timing)
    return LoadedTrace(workload, trace_format, size, turns)


def _load(raw: str, number: int, source: str) -> object:
    if len(raw) > MAX_TRACE_LINE_CHARS:
        msg = (
            f"{source} line {number}: {len(raw):,} characters, more than "
            f"kvcore's limit of {MAX_TRACE_LINE_CHARS:,} (MAX_TRACE_LINE_CHARS)"
        )
        raise TraceError(msg, line=number)
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, RecursionError, ValueError) as exc:
        msg = f"{source} line {number}: not valid JSON ({exc})"
        raise TraceError(msg, line=number) from exc


def _records(
    lines: Sequence[str], source: str, fmt: str, size: int
) -> tuple[_Record, ...]:
    records: list[_Record] = []
    keys: set[str] = set()
    latest: dict[str, str] = {}
    last_time = 0.0
    total = 0
    unit = TIME_UNIT_S[fmt]
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue

        def fail(field: str | None, why: str, number: int = number) -> NoReturn:
            where = f"{source} line {number}" + (f", field {field!r}" if field else "")
            msg = f"{where}: {why} ({fmt} format)"
            raise TraceError(msg, line=number, field=field)

        data = _load(raw, number, source)
        if not isinstance(data, dict):
            fail(None, f"a line must be a JSON object, got {type(data).__name__}")
        for field in REQUIRED[fmt]:
            if field not in data:
                fail(field, "missing; every line of this format gives it")
        if len(records) >= MAX_WORKLOAD_REQUESTS:
            fail(
                None,
                f"more than kvcore's limit of {MAX_WORKLOAD_REQUESTS:,} requests "
                "(MAX_WORKLOAD_REQUESTS); replay a part of the trace",
            )

        def length(field: str, low: int, data: dict[str, Any] = data) -> int:
            value = data[field]
            if type(value) is not int or value < low:
                fail(field, f"must be an int >= {low}, got {echo(value)}")
            if value > MAX_TRACE_REQUEST_TOKENS:
                fail(
                    field,
                    f"{echo(value) if value > 2**256 else format(value, ',')} "
                    "tokens is more than kvcore's limit of "
                    f"{MAX_TRACE_REQUEST_TOKENS:,} (MAX_TRACE_REQUEST_TOKENS)",
                )
            return value

        stamp = data["timestamp"]
        # Compared, never converted: NaN and the infinities fail the range,
        # and an int too large for a float is compared exactly.
        if type(stamp) not in (int, float) or not 0 <= stamp <= 1e15:
            fail(
                "timestamp", f"must be a finite number in [0, 1e15], got {echo(stamp)}"
            )
        time_s = stamp * unit
        if time_s < last_time:
            fail(
                "timestamp",
                f"{echo(stamp)} is before the previous line's; list requests in "
                "arrival order",
            )
        last_time = time_s
        input_length = length("input_length", 1)
        output_length = length("output_length", 1)
        ids = data["hash_ids"]
        if not isinstance(ids, list):
            fail("hash_ids", f"must be a list of ints, got {type(ids).__name__}")
        blocks = -(-input_length // size)
        if len(ids) > blocks:
            fail(
                "hash_ids",
                f"{len(ids)} ids but input_length {input_length} fills only "
                f"{blocks} blocks of {size} tokens",
            )
        for pos, bid in enumerate(ids):
            if type(bid) is not int or not 0 <= bid < MAX_TRACE_HASH_ID:
                fail(
                    "hash_ids",
                    f"id {pos} is {echo(bid)}; ids are ints in [0, 2**63)",
                )
        total += input_length + output_length
        if total > MAX_TRACE_TOTAL_TOKENS:
            fail(
                None,
                f"the trace holds more than kvcore's limit of "
                f"{MAX_TRACE_TOTAL_TOKENS:,} tokens (MAX_TRACE_TOTAL_TOKENS); "
                "replay a part of it",
            )
        parent: str | None = None
        if fmt == "bailian":
            chat = _chat_id(data["chat_id"], "chat_id", fail)
            if chat is None:
                fail("chat_id", "must not be -1 or null; it names this request")
            parent = _chat_id(data.get("parent_chat_id"), "parent_chat_id", fail)
            if parent == chat and chat not in latest:
                fail("parent_chat_id", "names the request itself")
            # A parent is the latest earlier line with its id: a published
            # trace may reuse an id, and a reused one gets a key of its own
            # (which an id no earlier line has must not name).
            if parent is not None:
                parent = latest.get(parent)
            key = chat
            while key in keys:
                key = f"{chat}#{number}" if key == chat else f"{key}#"
            latest[chat] = key
            turn = data.get("turn")
            if turn is not None and (type(turn) is not int or turn < 0):
                fail("turn", f"must be an int >= 0, got {echo(turn)}")
        else:
            key = f"line-{number}"
        keys.add(key)
        records.append(
            _Record(
                number,
                key,
                time_s,
                input_length,
                output_length,
                tuple(ids),
                parent,
            )
        )
    if not records:
        msg = f"{source}: the trace holds no requests"
        raise TraceError(msg, line=0)
    return tuple(records)


def _chat_id(value: object, field: str, fail: Any) -> str | None:
    if value is None or value == -1 or value == "-1":
        return None
    if type(value) is int and value >= 0:
        return str(value)
    if type(value) is str and value and len(value) <= 256:
        return value
    fail(
        field, f"must be an int >= 0, a short string, or -1 for none; got {echo(value)}"
    )
    return None  # not reached: fail raises


def _workload(
    records: Sequence[_Record], fmt: str, size: int, timing: bool
) -> tuple[Workload, int]:
    blocks: dict[int, bytes] = {}

    def block(bid: int) -> bytes:
        raw = blocks.get(bid)
        if raw is None:
            raw = blocks[bid] = block_tokens_of(bid, size)
        return raw

    def parts(rec: _Record, start: int) -> list[bytes]:
        """The request's prompt tokens from position ``start`` on."""
        out: list[bytes] = []
        length = rec.input_length
        covered = min(length, len(rec.hash_ids) * size)
        first = start // size
        for i in range(first, len(rec.hash_ids)):
            lo = max(start, i * size) - i * size
            hi = min(size, length - i * size)
            raw = block(rec.hash_ids[i])
            out.append(raw if lo == 0 and hi == size else raw[4 * lo : 4 * hi])
        if length > covered:
            tail = _own_tokens(f"{rec.key}:prompt", length - covered)
            out.append(tail[4 * max(0, start - covered) :])
        return out

    by_key: dict[str, tuple[_Record, WorkloadRequest]] = {}
    requests: list[WorkloadRequest] = []
    turns = 0
    # The clock starts at the first arrival (a trace may stamp epoch times).
    start_s = records[0].time_s if records else 0.0
    for rec in records:
        output_raw = _own_tokens(f"{rec.key}:output", rec.output_length)
        output = tuple(TokenRun((output_raw,)).tokens())
        prompt: TokenRun | None = None
        parent_id: str | None = None
        found = by_key.get(rec.parent) if rec.parent is not None else None
        if found is not None:
            prec, preq = found
            full = prec.input_length // size
            head = prec.input_length + prec.output_length
            if rec.hash_ids[:full] == prec.hash_ids[:full] and rec.input_length >= head:
                assert isinstance(preq.prompt, TokenRun)  # built below
                own = parts(rec, head)
                prompt = TokenRun((*preq.prompt.parts, _pack(preq.output), *own))
                parent_id = prec.key
                turns += 1
        if prompt is None:
            prompt = TokenRun(parts(rec, 0))
        request = WorkloadRequest(
            rec.key,
            0,
            prompt,
            output,
            parent=parent_id,
            arrival_s=rec.time_s - start_s if timing else None,
        )
        requests.append(request)
        by_key[rec.key] = (rec, request)
    return Workload(tuple(requests)), turns


def _pack(tokens: Sequence[int]) -> bytes:
    import numpy as np

    return np.asarray(tokens, dtype="<u4").tobytes()
