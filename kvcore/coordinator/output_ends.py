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
        #: Keys of the output ends counted, oldest first: whether a prompt
        #: passed through each since.
        self.keys: dict[Any, bool] = {}
        #: Counts halve, and the older half of the keys leave, once this
        #: many output ends were counted.
        self.memory = 2 * max(memory, MIN_EVIDENCE)
        #: Output ends counted, and those a later prompt passed through.
        self.counted = 0
        self.returned = 0

    def worth_keeping(self) -> bool:
        """Whether output-end states go to the back of the eviction order."""
        return self.counted < MIN_EVIDENCE or self.returned * REUSE_ODDS >= self.counted

    def keep_output_end(self, key: Any, pool: Any) -> bool:
        """Count a freed request's output end, kept under ``key``: whether
        it goes to the back of the eviction order (the evidence before it
        was counted).  Undone if ``pool``'s open transaction rolls back."""
        keep = self.worth_keeping()
        keys = self.keys
        if self.counted + 1 < self.memory:
            pool.record(self._unkeep, key, keys.get(key), self.counted, self.returned)
            keys[key] = False
            self.counted += 1
            return keep
        pool.record(self._restore, dict(keys), self.counted, self.returned)
        keys[key] = False
        self.keys = dict(list(keys.items())[len(keys) // 2 :])
        self.counted = (self.counted + 1) // 2
        self.returned //= 2
        return keep

    def _unkeep(self, key: Any, was: bool | None, counted: int, returned: int) -> None:
        if was is None:
            del self.keys[key]
        else:
            self.keys[key] = was
        self.counted = counted
        self.returned = returned

    def _restore(self, keys: dict[Any, bool], counted: int, returned: int) -> None:
        self.keys = keys
        self.counted = counted
        self.returned = returned

    def note_prompt(self, hashes: Iterable[Any]) -> list[Any]:
        """Count the output ends a prompt's chunk hashes pass through that
        no prompt passed through before: their keys, for
        :meth:`unnote_prompt` to undo."""
        keys = self.keys
        if not keys:
            return []
        found = [key for key in keys.keys() & hashes if not keys[key]]
        for key in found:
            keys[key] = True
        self.returned += len(found)
        return found

    def unnote_prompt(self, found: list[Any]) -> None:
        """Undo :meth:`note_prompt`, which returned ``found``."""
        keys = self.keys
        for key in found:
            if key in keys:
                keys[key] = False
        self.returned -= len(found)
