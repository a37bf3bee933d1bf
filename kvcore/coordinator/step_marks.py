"""How far each live request's steps have gone, as the engine calls the
:class:`~kvcore.coordinator.KVCacheManager` can be checked against.

Three marks per live request, each set where a step passes it:

- ``admitted_with``: the tokens its admission's hit covered, written before
  it was admitted;
- ``scheduled_to``: the end of its latest step (lookahead slots left out),
  the most ``cache_blocks`` may key;
- ``released_at``: the processed tokens of its latest release of the blocks
  it no longer reads (or its admission's, below which a plan that skips
  blocks took none), below which no later step may start.
"""

from __future__ import annotations

from kvcore.errors import InvalidRequestError

__all__ = ["StepMarks"]


class StepMarks:
    """The marks of every live request (see the module)."""

    __slots__ = ("admitted_with", "released_at", "scheduled_to")

    def __init__(self) -> None:
        self.admitted_with: dict[str, int] = {}
        self.scheduled_to: dict[str, int] = {}
        self.released_at: dict[str, int] = {}

    def released(self, rid: str, num_processed: int) -> None:
        """The request gave back what it no longer reads at ``num_processed``."""
        if num_processed > self.released_at.get(rid, 0):
            self.released_at[rid] = num_processed

    def check_start(self, rid: str, num_computed: int) -> None:
        """A running step of a plan that skips blocks may not start below
        the tokens at which the request last gave blocks back (or, at its
        admission, never took them): it would read or write them."""
        released_at = self.released_at.get(rid, 0)
        if num_computed >= released_at:
            return
        msg = (
            f"allocate_slots for request {rid!r}: the step starts at "
            f"{num_computed} computed tokens, but the request already released "
            f"the blocks it no longer read at {released_at} processed tokens, so "
            "the step would read or write positions now given back (the null "
            "block); num_computed_tokens must not go below the tokens processed: "
            "to recompute from earlier, free the request and admit it again"
        )
        raise InvalidRequestError(msg)

    def check_running(self, rid: str, num_computed: int, skipping: object) -> None:
        """A running request's step starts within its steps' slots (past
        the end of its latest step, the tokens between were never given
        slots, so no step wrote their KV, yet the step would key the blocks
        holding them); with ``skipping``, see :meth:`check_start`."""
        if num_computed > self.scheduled_to.get(rid, num_computed):
            self._refuse_computed(rid, num_computed)
        if skipping:
            self.check_start(rid, num_computed)

    def _refuse_computed(self, rid: str, num_computed: int) -> None:
        msg = (
            f"allocate_slots for request {rid!r}: num_computed_tokens={num_computed} "
            f"is past the {self.scheduled_to[rid]} tokens its steps have been given "
            "slots for (lookahead slots hold no tokens), so no step computed the "
            "tokens between and their blocks would be cached unwritten; advance "
            "num_computed_tokens by at most the tokens each step scheduled"
        )
        raise InvalidRequestError(msg)

    def check_keyed(self, rid: str, num_computed: int, num_tokens: int) -> None:
        """``cache_blocks`` may key only tokens a step was given slots for."""
        limit = max(num_computed, self.scheduled_to.get(rid, 0))
        if num_tokens <= limit:
            return
        msg = (
            f"cache_blocks for request {rid!r}: num_computed_tokens={num_tokens} "
            f"is past the {limit} tokens its steps have been given slots for "
            "(lookahead slots hold no tokens), so it would key blocks no step "
            "computed; pass the tokens the request has computed"
        )
        raise InvalidRequestError(msg)

    def written(self, rid: str, num_computed: int) -> int:
        """The tokens whose KV is written when the request's last step is
        dropped before its forward: its computed tokens, or its admission's
        hit where that covers more."""
        return max(num_computed, self.admitted_with.get(rid, 0))

    def forget(self, rid: str) -> None:
        """The request is finished."""
        self.admitted_with.pop(rid, None)
        self.scheduled_to.pop(rid, None)
        self.released_at.pop(rid, None)
