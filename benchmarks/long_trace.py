"""A long Mooncake trace made from a short one, deterministically.

``long_trace_lines(lines, n)`` repeats a Mooncake trace's requests until
``n`` are written.  Copy ``k`` (0-based) moves every hash id past the ids of
all copies before it, so copies share no block and each keeps the sharing
of the original within itself, and starts one original span (plus one ms)
after copy ``k - 1`` started, so arrivals stay in order and the load per
second is the original's.  Nothing is random: the same input and ``n`` give
the same lines.

    python benchmarks/long_trace.py ../shared/traces/mooncake_synthetic_trace.jsonl \\
        --requests 12000 > /tmp/trace12k.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path


def long_trace_lines(lines: Sequence[str], requests: int) -> Iterator[str]:
    """``requests`` Mooncake lines: copies of ``lines`` with disjoint ids."""
    records = [json.loads(line) for line in lines if line.strip()]
    if not records:
        msg = "the trace holds no requests"
        raise ValueError(msg)
    id_span = 1 + max((i for r in records for i in r["hash_ids"]), default=0)
    time_span = records[-1]["timestamp"] - records[0]["timestamp"] + 1
    for n in range(requests):
        copy, index = divmod(n, len(records))
        record = dict(records[index])
        record["timestamp"] = record["timestamp"] + copy * time_span
        record["hash_ids"] = [i + copy * id_span for i in record["hash_ids"]]
        yield json.dumps(record)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="a Mooncake JSON-lines trace")
    parser.add_argument("--requests", type=int, default=12000)
    args = parser.parse_args(argv)
    lines = args.trace.read_text().splitlines()
    for line in long_trace_lines(lines, args.requests):
        sys.stdout.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
