"""The free blocks an admission leaves for the running requests' next
block boundary.

A recurrent state's step reads the state in its old block while it writes
the new one, so each time a running request's table crosses a block
boundary its group takes a block that it gives back only after the step
(a manager's :attr:`~kvcore.coordinator.manager.SingleTypeManager.boundary_overlap`).
Decoding requests advance one token a step, so those whose computed
tokens agree modulo the block size cross on the same step.  An admission
that fills the pool leaves nothing for that step: each crossing then
preempts a request, which comes back, fills the pool again and is
preempted again.  An admission therefore leaves free what the busiest
coming boundary takes: per block size, its groups' overlap times the
most running requests that cross together, where a request still
prefilling (and the one admitted) crosses at every step.  An admission
with nothing else running leaves nothing: it can preempt no one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcore.coordinator.manager import SingleTypeManager

__all__ = ["BoundaryHeadroom"]


class BoundaryHeadroom:
    """What an admission leaves free for the running requests' busiest
    coming block boundary; built only for a plan where a group declares
    an overlap (see :meth:`of`)."""

    __slots__ = ("per_request", "sizes")

    def __init__(self, sizes: Sequence[tuple[int, int]]) -> None:
        #: (block size, blocks its groups hold over a boundary per request).
        self.sizes = tuple(sizes)
        #: Blocks one request holds over when all its groups cross at once.
        self.per_request = sum(overlap for _, overlap in self.sizes)

    @classmethod
    def of(cls, managers: Sequence[SingleTypeManager]) -> BoundaryHeadroom | None:
        """The plan's headroom, or None when no group holds a block over a
        boundary (an admission then leaves nothing free)."""
        sizes: dict[int, int] = {}
        for manager in managers:
            if manager.boundary_overlap:
                size = manager.block_size
                sizes[size] = sizes.get(size, 0) + manager.boundary_overlap
        return cls(sorted(sizes.items())) if sizes else None

    def blocks(
        self, running: Mapping[str, Any], scheduled_to: Mapping[str, int], spare: int
    ) -> int:
        """The blocks an admission leaves free beside ``running`` (request id
        -> held request) and the request it admits; none when nothing else
        runs (it would preempt no one).  ``scheduled_to``: where each
        request's latest step ended (its next step starts there).
        ``spare`` is what the pool would have free after the admission:
        when it covers every request crossing at once, nothing is counted
        and 0 is returned (it fits either way)."""
        if not running or spare >= self.per_request * (len(running) + 1):
            return 0
        # The admitted request is still prefilling: it crosses every step.
        every = 1
        ends = []
        for rid, request in running.items():
            end = scheduled_to.get(rid, request.num_computed_tokens)
            if request.num_tokens - end > 1:
                every += 1
            else:
                ends.append(end)
        total = 0
        for size, overlap in self.sizes:
            crossing = Counter(end % size for end in ends)
            total += overlap * (max(crossing.values(), default=0) + every)
        return total
