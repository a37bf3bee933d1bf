"""Whether a workload's prompts carry earlier outputs back: the evidence a
state group weighs before it keeps a freed request's output-end state.

A state kept where a request's output ended serves only a later prompt
that extends that output (the next turn of a chat, an agent's next call).
Traffic whose prompts never do (shared documents and system prompts,
replayed prompt traces) pays for such a state in every state group and
gets nothing back, while the prefixes it does reuse are evicted first.

:class:`OutputEnds` remembers the keys of recent output-end states and
counts, at each admission, the prompts that pass through one (whether or
not the state was still cached: it measures the traffic, not the pool).
While fewer than one in :data:`REUSE_ODDS` of the output ends it counted
came back, a freed request's output-end state joins the spare blocks,
evicted before every cached prefix but kept while the pool has room;
otherwise it goes to the back of the eviction order with the request's
other blocks.  Counts halve as they grow, so the rule follows a workload
that changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["REUSE_ODDS", "OutputEnds"]

#: An output-end state is kept at the back of the eviction order while at
#: least one in this many of the output ends counted came back in a prompt.
REUSE_ODDS = 16
#: Output ends counted before the evidence decides (until then they are kept).
MIN_EVIDENCE = 64


class OutputEnds:
    """Keys of recent output-end states of one state group, and how many of
    the counted ones later prompts passed through."""

    __slots__ = ("counted", "keys", "memory", "returned")

    def __init__(self, memory: int) -> None:
        #: Keys of the output ends not yet seen in a prompt, oldest first.
        self.keys: dict[Any, None] = {}
        #: At most this many keys are remembered (the oldest leave first).
        self.memory = max(memory, MIN_EVIDENCE)
        #: Output ends counted, and those a later prompt passed through.
        self.counted = 0
        self.returned = 0

    def worth_keeping(self) -> bool:
        """Whether output-end states go to the back of the eviction order."""
        return self.counted < MIN_EVIDENCE or self.returned * REUSE_ODDS >= self.counted

    def note_output_end(self, key: Any) -> None:
        """Count a freed request's output end, kept under ``key``."""
        keys = self.keys
        keys.pop(key, None)
        keys[key] = None
        if len(keys) > self.memory:
            del keys[next(iter(keys))]
        self.counted += 1
        if self.counted >= 2 * self.memory:
            self.counted //= 2
            self.returned //= 2

    def note_prompt(self, hashes: Iterable[Any], pool: Any) -> None:
        """Count the output ends a prompt's chunk hashes pass through (each
        once), undone if ``pool``'s open transaction rolls back."""
        keys = self.keys
        if not keys:
            return
        found = keys.keys() & hashes
        if found:
            for key in found:
                del keys[key]
            self.returned += len(found)
            pool.record(self._unnote_prompt, found)

    def _unnote_prompt(self, found: set[Any]) -> None:
        for key in found:
            self.keys[key] = None
        self.returned -= len(found)

    def spare_output_end(
        self, step_end: tuple[int, int, Any], blocks: list[int], pool: Any
    ) -> list[int] | None:
        """Count a freed request's output-end state ``step_end`` (table
        position, block, key); when the evidence says to, release it now
        into the spare blocks and return the request's popped table
        ``blocks`` without it (else None).  Undone, as is the count, if
        ``pool``'s open transaction rolls back."""
        pos, block, key = step_end
        pool.record(self._unnote_output_end, key, self.counted, self.returned)
        keep = self.worth_keeping()
        self.note_output_end(key)
        if keep:
            return None
        if pos < len(blocks) and blocks[pos] == block:
            blocks = [*blocks]
            blocks[pos] = pool.null_block
            pool.free_each([[block]])
        elif pool.ref_cnt[block] == 0 and pool.key_hash[block] == key:
            pool.to_spare([block])  # released after its step, held back
        return blocks

    def _unnote_output_end(self, key: Any, counted: int, returned: int) -> None:
        self.keys.pop(key, None)
        self.counted = counted
        self.returned = returned
