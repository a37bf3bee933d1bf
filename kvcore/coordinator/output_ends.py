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
other blocks.  Counts halve as they grow, and the keys counted before the
previous halving leave, so the rule follows a workload that changes.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

__all__ = ["REUSE_ODDS", "OutputEnds"]

#: An output-end state is kept at the back of the eviction order while at
#: least one in this many of the output ends counted came back in a prompt.
REUSE_ODDS = 16
#: Output ends counted before the evidence decides (until then they are kept).
MIN_EVIDENCE = 64


class OutputEnds:
    """Keys of recent output-end states of one state group, and how many of
    the counted ones later prompts passed through.

    The keys live in two generations, each the keys counted over half the
    memory: a generation turns over in O(1), so the step that halves the
    counts costs no more than any other, however long the memory."""

    __slots__ = ("counted", "last", "memory", "newer", "older", "returned", "turn_at")

    def __init__(self, memory: int) -> None:
        #: Counts halve once this many output ends were counted.
        self.memory = 2 * max(memory, MIN_EVIDENCE)
        #: Keys of the output ends counted since the last turn, and in the
        #: turn before it (a key counted again stays where it was): whether
        #: a prompt passed through each since.
        self.newer: dict[Any, bool] = {}
        self.older: dict[Any, bool] = {}
        #: The count at which the generations next turn: the newer becomes
        #: the older and the older leaves (half the memory, then the memory,
        #: where the counts halve back to half of it).
        self.turn_at = self.memory // 2
        #: Output ends counted, and those a later prompt passed through.
        self.counted = 0
        self.returned = 0
        #: The token of the last output end counted with one, and what
        #: :meth:`keep_output_end` answered (twin groups share the evidence).
        self.last: tuple[Any, bool] | None = None

    @property
    def keys(self) -> dict[Any, bool]:
        """Every key remembered, oldest generation first, with its flag (a
        copy, O(n): for inspection)."""
        return {**self.older, **self.newer}

    def worth_keeping(self) -> bool:
        """Whether output-end states go to the back of the eviction order."""
        return self.counted < MIN_EVIDENCE or self.returned * REUSE_ODDS >= self.counted

    def keep_output_end(self, key: Any, pool: Any, token: Any = None) -> bool:
        """Count a freed request's output end, kept under ``key``: whether
        it goes to the back of the eviction order (the evidence before it
        was counted).  At :attr:`turn_at` the generations turn, and at the
        memory the counts halve.  A ``token`` names the free: twin groups
        sharing the evidence each ask with the same one, and only the first
        ask counts (the others get its answer).  Undone if ``pool``'s open
        transaction rolls back."""
        last = self.last
        if token is not None and last is not None and last[0] == token:
            return last[1]
        keep = self.worth_keeping()
        older = self.older
        pool.record(
            self._restore,
            older,
            self.newer,
            key,
            older.get(key),
            self.newer.get(key),
            (self.counted, self.returned, self.turn_at, last),
        )
        if token is not None:
            self.last = (token, keep)
        if key in older:
            older[key] = False
        else:
            self.newer[key] = False
        self.counted += 1
        if self.counted >= self.turn_at:
            # The dicts are swapped, not changed: the undo holds them.
            self.older, self.newer = self.newer, {}
            if self.counted >= self.memory:
                self.counted //= 2
                self.returned //= 2
            self.turn_at = self.counted + self.memory // 2
        return keep

    def _restore(
        self,
        older: dict[Any, bool],
        newer: dict[Any, bool],
        key: Any,
        was_older: bool | None,
        was_newer: bool | None,
        counts: tuple[int, int, int, tuple[Any, bool] | None],
    ) -> None:
        for store, was in ((older, was_older), (newer, was_newer)):
            if was is None:
                store.pop(key, None)
            else:
                store[key] = was
        self.older, self.newer = older, newer
        self.counted, self.returned, self.turn_at, self.last = counts

    def note_prompt(self, hashes: Collection[Any]) -> list[Any]:
        """Count the output ends a prompt's chunk hashes pass through that
        no prompt passed through before: their keys, for
        :meth:`unnote_prompt` to undo."""
        found: list[Any] = []
        for keys in (self.older, self.newer):
            if keys:
                new = [key for key in keys.keys() & hashes if not keys[key]]
                for key in new:
                    keys[key] = True
                found += new
        self.returned += len(found)
        return found

    def unnote_prompt(self, found: list[Any]) -> None:
        """Undo :meth:`note_prompt`, which returned ``found``."""
        for key in found:
            for keys in (self.older, self.newer):
                if key in keys:
                    keys[key] = False
        self.returned -= len(found)
