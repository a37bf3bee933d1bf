"""Trace files: a workload as JSON lines, one request a line.

Each line is an object with these fields (docs/simulate.md has examples):

``id``
    a unique string (default ``"line-N"``, N the line number).
``arrival``
    the scheduler step the request arrives at, an int >= 0 (default 0).
    The simulator has no clock: steps, not seconds.  Lines are in arrival
    order.
``prompt`` or ``prompt_len``
    the prompt's token ids, or how many tokens it has; with ``prefix_id``
    or ``parent`` these are the tokens after the prefix.
``prefix_id``, ``prefix_len``
    the prompt starts with the first ``prefix_len`` tokens of the shared
    prefix named ``prefix_id``: equal names give equal token ids.
``parent``
    the id of an earlier line: this turn's prompt is the parent's prompt
    and output, then its own tokens; it waits for the parent to finish.
``output_len``
    tokens the request generates, an int >= 1.

Every line is checked as it is read; an error names the line and field.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NoReturn

from kvcore.coordinator.hashing import TOKEN_ID_LIMIT
from kvcore.errors import KvcoreValueError, echo
from kvcore.tools.limits import MAX_TRACE_BYTES, MAX_TRACE_REQUEST_TOKENS
from kvcore.tools.simulate.workload import (
    Workload,
    WorkloadRequest,
    as_tuple,
    token_stream,
)

__all__ = ["FIELDS", "TraceError", "load_trace", "parse_trace"]

FIELDS = (
    "id",
    "arrival",
    "prompt",
    "prompt_len",
    "prefix_id",
    "prefix_len",
    "parent",
    "output_len",
)


class TraceError(KvcoreValueError):
    """A trace file line is not a valid request."""

    def __init__(self, message: str, *, line: int, field: str | None = None) -> None:
        super().__init__(message)
        self.line = line
        self.field = field


#: Compressed files a trace may come as, told by their first bytes (not
#: their name): the magic, how to open one, and the format's name.
_COMPRESSIONS: tuple[
    tuple[bytes, Callable[[io.BytesIO], io.BufferedIOBase], str], ...
] = (
    (b"\x1f\x8b", lambda raw: gzip.GzipFile(fileobj=raw), "gzip"),
    (b"BZh", bz2.BZ2File, "bzip2"),
    (b"\xfd7zXZ\x00", lzma.LZMAFile, "xz"),
)
_CHUNK_BYTES = 2**24


def read_trace_lines(path: str | Path) -> list[str]:
    """A trace file's lines: UTF-8 JSON lines, plain or compressed with
    gzip, bzip2 or xz (told by the file's first bytes), a leading byte-order
    mark skipped, each line ended by a line feed (a carriage return before
    it dropped).  Refused with the line of the first byte that is not
    UTF-8, and past :data:`~kvcore.tools.limits.MAX_TRACE_BYTES`."""
    path = Path(path)
    try:
        raw, compression = _read_bytes(path)
    except (OSError, EOFError, lzma.LZMAError, zlib.error) as exc:
        what = getattr(exc, "strerror", None) or exc
        msg = f"cannot read trace {path}: {what}"
        raise TraceError(msg, line=0) from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        inside = f" (inside its {compression} compression)" if compression else ""
        msg = f"{path} line {line}: not UTF-8 text{inside}; a trace is UTF-8 JSON lines"
        raise TraceError(msg, line=line) from exc
    # JSON lines end at a line feed only: U+2028, U+2029 and U+0085, which
    # str.splitlines also splits at, may stand raw inside a JSON string.
    lines = text.removeprefix("\ufeff").split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def _read_bytes(path: Path) -> tuple[bytes, str | None]:
    """The file's bytes, decompressed, and the compression's name or None.
    The file is opened once (a named pipe can be read only once)."""
    with path.open("rb") as file:
        raw = _read_capped(file, path, None)
    for magic, opener, name in _COMPRESSIONS:
        if raw.startswith(magic):
            with opener(io.BytesIO(raw)) as stream:
                return _read_capped(stream, path, name), name
    return raw, None


def _read_capped(
    stream: io.BufferedIOBase, path: Path, compression: str | None
) -> bytes:
    """All of ``stream``, refused past MAX_TRACE_BYTES before it is read whole."""
    chunks = []
    total = 0
    while chunk := stream.read(_CHUNK_BYTES):
        total += len(chunk)
        if total > MAX_TRACE_BYTES:
            inside = f" once decompressed ({compression})" if compression else ""
            msg = (
                f"trace {path} holds more than {MAX_TRACE_BYTES:,} bytes"
                f"{inside}, kvcore's limit (MAX_TRACE_BYTES); replay a "
                "part of it (split the file by lines)"
            )
            raise TraceError(msg, line=0)
        chunks.append(chunk)
    return b"".join(chunks)


def load_trace(path: str | Path) -> Workload:
    """The workload of a trace file."""
    return parse_trace(read_trace_lines(path), source=str(path))


def parse_trace(lines: Iterable[str], *, source: str = "trace") -> Workload:
    """The workload of trace lines (blank lines are skipped)."""
    requests: list[WorkloadRequest] = []
    by_id: dict[str, WorkloadRequest] = {}
    prefix_streams: dict[str, list[int]] = {}
    last_arrival = 0
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        request = _parse_line(raw, number, source, by_id, prefix_streams, last_arrival)
        last_arrival = request.arrival
        requests.append(request)
        by_id[request.id] = request
    if not requests:
        msg = f"{source}: the trace holds no requests"
        raise TraceError(msg, line=0)
    return Workload(tuple(requests))


def _parse_line(
    raw: str,
    number: int,
    source: str,
    by_id: dict[str, WorkloadRequest],
    prefixes: dict[str, list[int]],
    last_arrival: int,
) -> WorkloadRequest:
    def fail(field: str | None, why: str) -> NoReturn:
        where = f"{source} line {number}" + (f", field {field!r}" if field else "")
        msg = f"{where}: {why}"
        raise TraceError(msg, line=number, field=field)

    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, RecursionError, ValueError) as exc:
        msg = f"{source} line {number}: not valid JSON ({exc})"
        raise TraceError(msg, line=number) from exc
    if not isinstance(data, dict):
        fail(None, f"a line must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        fail(unknown[0], f"unknown field; the fields are {', '.join(FIELDS)}")

    def count(field: str, low: int, default: int | None = None) -> int:
        value = data.get(field, default)
        if type(value) is not int or value < low:
            fail(field, f"must be an int >= {low}, got {echo(value)}")
        if value > MAX_TRACE_REQUEST_TOKENS:
            fail(
                field,
                f"must be at most {MAX_TRACE_REQUEST_TOKENS:,}, got {echo(value)}",
            )
        return value

    def name(field: str) -> str | None:
        value = data.get(field)
        if value is not None and (type(value) is not str or not value):
            fail(field, f"must be a non-empty string, got {echo(value)}")
        return value

    rid = name("id") or f"line-{number}"
    if rid in by_id:
        fail("id", f"{echo(rid)} is used by an earlier line; ids must be unique")
    arrival = count("arrival", 0, 0)
    if arrival < last_arrival:
        fail(
            "arrival",
            f"step {arrival} is before the previous line's {last_arrival}; "
            "list requests in arrival order",
        )
    output_len = count("output_len", 1)
    if ("prompt" in data) == ("prompt_len" in data):
        fail("prompt", "give exactly one of 'prompt' (token ids) and 'prompt_len'")
    parent_id = name("parent")
    prefix_id = name("prefix_id")
    if parent_id is not None and prefix_id is not None:
        fail(
            "prefix_id",
            "a turn with a parent inherits the parent's prefix; drop prefix_id",
        )
    if (prefix_id is None) != ("prefix_len" not in data):
        field = "prefix_len" if prefix_id is not None else "prefix_id"
        fail(field, "'prefix_id' and 'prefix_len' go together")
    head: tuple[int, ...] = ()
    if parent_id is not None:
        parent = by_id.get(parent_id)
        if parent is None:
            fail("parent", f"{echo(parent_id)} is not the id of an earlier line")
        head = as_tuple(parent.prompt) + parent.output
    if prefix_id is not None:
        length = count("prefix_len", 1)
        stream = prefixes.get(prefix_id, [])
        if len(stream) < length:
            stream = prefixes[prefix_id] = token_stream(
                f"trace:prefix:{prefix_id}", length
            )
        head = tuple(stream[:length])
    if "prompt" in data:
        own = _tokens(data["prompt"], fail)
    else:
        own = tuple(token_stream(f"trace:prompt:{rid}", count("prompt_len", 1)))
    if not head and not own:
        fail("prompt", "the prompt is empty; a request needs a prompt token")
    output = tuple(token_stream(f"trace:output:{rid}", output_len))
    return WorkloadRequest(
        rid, arrival, head + own, output, prefix_id=prefix_id, parent=parent_id
    )


def _tokens(
    value: object, fail: Callable[[str | None, str], NoReturn]
) -> tuple[int, ...]:
    if not isinstance(value, list):
        fail("prompt", f"must be a list of token ids, got {type(value).__name__}")
    for pos, tok in enumerate(value):
        if type(tok) is not int or not 0 <= tok < TOKEN_ID_LIMIT:
            fail(
                "prompt",
                f"token {pos} is {echo(tok)}; token ids are ints in [0, {TOKEN_ID_LIMIT})",
            )
    return tuple(value)
