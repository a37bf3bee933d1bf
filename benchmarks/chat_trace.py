"""A synthetic chat trace in the Qwen-Bailian format, for replaying with
``kvcore simulate --trace`` and ``benchmarks/trace_replay.py --trace``.

The shared Mooncake trace never extends an earlier output; this one does.
Chats open on one of a few shared system prompts, then each turn's prompt
is its parent turn's prompt and output plus a new user message (16-token
hash blocks, ``parent_chat_id`` naming the parent turn), so a replay sees
both kinds of prefix hit a chat service gets: the system prompt across
chats, and the whole conversation within one.  Arrivals spread over
``--span`` seconds; a chat's turns follow one another 20 to 120 s apart.

    python benchmarks/chat_trace.py > chat.jsonl
    python benchmarks/trace_replay.py --trace chat.jsonl --model qwen3-next-80b-a3b
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterator

#: Tokens per hash id in the Bailian format.
BLOCK_TOKENS = 16
#: How many turns a chat has, drawn uniformly from this list.
TURNS = (1, 1, 2, 3, 4, 6, 8)


def chat_trace(
    chats: int, *, seed: int = 7, system_prompts: int = 8, span_s: float = 1800.0
) -> Iterator[dict[str, object]]:
    """The trace's records, by arrival time."""
    rng = random.Random(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        next_id += n
        return list(range(next_id - n, next_id))

    systems = [fresh(rng.randint(20, 200)) for _ in range(system_prompts)]
    records: list[tuple[float, int, dict[str, object]]] = []
    for _ in range(chats):
        t = rng.uniform(0.0, span_s)
        ids = [*rng.choice(systems), *fresh(rng.randint(5, 120))]
        parent = -1
        for turn in range(rng.choice(TURNS)):
            chat_id = len(records) + 1
            output = rng.randint(50, 800)
            records.append(
                (
                    round(t, 3),
                    chat_id,
                    {
                        "chat_id": chat_id,
                        "parent_chat_id": parent,
                        "timestamp": round(t, 3),
                        "input_length": len(ids) * BLOCK_TOKENS,
                        "output_length": output,
                        "turn": turn + 1,
                        "hash_ids": list(ids),
                    },
                )
            )
            # The next turn: this prompt, its output, a new user message.
            ids = ids + fresh(-(-output // BLOCK_TOKENS) + rng.randint(2, 60))
            parent = chat_id
            t += rng.uniform(20.0, 120.0)
    for _, _, record in sorted(records, key=lambda r: r[:2]):
        yield record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chats", type=int, default=700)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--system-prompts", type=int, default=8)
    parser.add_argument("--span", type=float, default=1800.0, help="seconds")
    args = parser.parse_args(argv)
    for record in chat_trace(
        args.chats,
        seed=args.seed,
        system_prompts=args.system_prompts,
        span_s=args.span,
    ):
        sys.stdout.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
