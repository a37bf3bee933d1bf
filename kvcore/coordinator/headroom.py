"""The free blocks an admission leaves for the running requests' next
block boundary.

A recurrent state's step reads the state in its old block while it writes
the new one, so each time a running request's table crosses a block
boundary its group takes a block that it gives back only once the step
has run (a manager's
:attr:`~kvcore.coordinator.manager.SingleTypeManager.boundary_overlap`).
Decoding requests advance one token a step, so those whose latest steps
ended on the same token modulo the block size cross on the same step.  An
admission that fills the pool leaves nothing for that step: each crossing
then preempts a request, which comes back, fills the pool again and is
preempted again.

An admission therefore leaves free what the busiest coming boundary
takes: per block size, its groups' overlap times the most decoding
requests that hold a crossing's block at once, plus the requests still
prefilling and the one admitted (they cross at every step).  Under
asynchronous scheduling a crossing's old block is released only once the
steps in flight have run (``num_in_flight_tokens``), so requests whose
steps end up to that many tokens apart hold theirs at once: the count is
over that many consecutive tokens.  An admission with no other request
held leaves nothing: it can preempt no one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["BoundaryHeadroom"]


class BoundaryHeadroom:
    """What an admission leaves free for the running requests' busiest
    coming block boundary; built only for a plan where a group declares
    an overlap (see :meth:`of`)."""

    __slots__ = ("lag", "per_request", "sizes")

    def __init__(self, sizes: Iterable[tuple[int, int]]) -> None:
        #: (block size, blocks its groups hold over a boundary per request).
        self.sizes = tuple(sizes)
        #: Blocks one request holds over when all its groups cross at once.
        self.per_request = sum(overlap for _, overlap in self.sizes)
        #: The fewest tokens in flight seen on a running step (a decode
        #: step's; a prefill chunk in flight is longer), at most a block less
        #: one: a crossing's old block outlives its step by that many steps.
        self.lag = 0

    @classmethod
    def of(cls, overlaps: Iterable[tuple[int, int]]) -> BoundaryHeadroom | None:
        """The plan's headroom from each group's (block size, checked
        overlap), or None when no group holds a block over a boundary (an
        admission then leaves nothing free)."""
        sizes: dict[int, int] = {}
        for size, overlap in overlaps:
            if overlap:
                sizes[size] = sizes.get(size, 0) + overlap
        return cls(sorted(sizes.items())) if sizes else None

    def saw_in_flight(self, num_in_flight: int) -> None:
        """A running step with ``num_in_flight`` (> 0) tokens in flight."""
        if not self.lag or num_in_flight < self.lag:
            self.lag = min(num_in_flight, self.sizes[0][0] - 1)

    def blocks(
        self,
        running: Mapping[str, Any],
        scheduled_to: Mapping[str, int],
        spare: int,
        steps: Callable[[Any], bool] | None = None,
    ) -> int:
        """The blocks an admission leaves free beside ``running`` (request id
        -> held request) and the request it admits; none when no other
        request steps (it would preempt no one).  ``scheduled_to``: where
        each request's latest step ended (its next step starts there);
        ``steps``: whether a held request still steps (default: every one
        does; an engine that knows a finished request waits to be freed
        says so).  ``spare`` is what the pool would have free after the
        admission: when it covers every request crossing at once, nothing
        is counted and 0 is returned (it fits either way)."""
        if not running or spare >= self.per_request * (len(running) + 1):
            return 0
        # The admitted request is still prefilling: it crosses every step.
        every = 1
        ends = []
        for rid, request in running.items():
            if steps is not None and not steps(request):
                continue
            end = scheduled_to.get(rid, request.num_computed_tokens)
            if request.num_tokens - end > 1:
                every += 1
            else:
                ends.append(end)
        if every == 1 and not ends:
            return 0  # no held request steps
        total = 0
        for size, overlap in self.sizes:
            total += overlap * (_busiest(ends, size, self.lag + 1) + every)
        return total


def _busiest(ends: list[int], size: int, width: int) -> int:
    """The most of ``ends`` within ``width`` consecutive tokens modulo
    ``size`` (wrapping around)."""
    if not ends:
        return 0
    counts = [0] * size
    for end in ends:
        counts[end % size] += 1
    if width <= 1:
        return max(counts)
    width = min(width, size)
    ring = counts + counts[: width - 1]
    total = most = sum(ring[:width])
    for i in range(width, len(ring)):
        total += ring[i] - ring[i - width]
        if total > most:
            most = total
    return most
