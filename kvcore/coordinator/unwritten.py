"""States a step took whose forward has not run: no hit may end on one.

A step's blocks are taken, and keyed, when the step is scheduled, before its
forward pass runs.  An attention block taken so can serve a hit admitted in
the same step (each layer writes the step's KV before it attends), but a
recurrent state cannot: a request resuming from it reads the state before
the scan that writes it.  Groups whose managers declare
:attr:`~kvcore.coordinator.manager.SingleTypeManager.reads_hit_before_step`
have the blocks each step takes noted here; an admission whose hit ends on
one is refused for this step (``allocate_slots`` returns ``None``, as for a
full pool), so the request is admitted with its whole hit once the state is
written.

A state counts as written at its writer's next call (its next step, its
free): an engine schedules a request once a step, and a later step's forward
runs after this one's.  An engine that says where its steps begin
(:meth:`UnwrittenStates.new_step_starts`) ends every wait at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcore.coordinator.manager import SingleTypeManager

__all__ = ["UnwrittenStates"]


class UnwrittenStates:
    """The state blocks taken by steps whose forward may not have run."""

    def __init__(self, managers: Sequence[SingleTypeManager]) -> None:
        #: The managers whose hits read their last block before the step.
        self.managers = tuple(m for m in managers if m.reads_hit_before_step)
        #: Writer request id -> the state blocks its latest step took.
        self.by_writer: dict[str, list[int]] = {}
        #: Every noted block id -> the writer whose step took it last (a block
        #: released while noted may be taken again by another step).
        self.blocks: dict[int, str] = {}

    def took(self, request_id: str, new_blocks: Sequence[Sequence[int]]) -> None:
        """Note the state blocks a step of the request took (its new blocks
        per group), once the step is done."""
        taken = [
            block
            for manager in self.managers
            for block in new_blocks[manager.kv_cache_group_id]
            if block
        ]
        if taken:
            self.by_writer[request_id] = taken
            self.blocks.update(dict.fromkeys(taken, request_id))

    def written(self, request_id: str) -> None:
        """The request's next call: what its last step took is written."""
        noted = self.by_writer.pop(request_id, None)
        if noted:
            blocks = self.blocks
            for block in noted:
                if blocks.get(block) == request_id:
                    del blocks[block]

    def new_step_starts(self) -> None:
        """A new engine step: every state taken before it is written."""
        self.by_writer.clear()
        self.blocks.clear()

    def admits(self, request_id: str, hit: Sequence[Sequence[int]] | None) -> bool:
        """A step of the request: what its last step took is written now;
        whether a hit it attaches (``None``: none) can be admitted this
        step (it ends on no state still unwritten)."""
        self.written(request_id)
        return hit is None or not self.hit_ends_unwritten(hit)

    def hit_ends_unwritten(self, hit: Sequence[Sequence[int]]) -> bool:
        """Whether a hit (blocks per group) ends on a state not yet written."""
        blocks = self.blocks
        if not blocks:
            return False
        for manager in self.managers:
            group = hit[manager.kv_cache_group_id] if hit else ()
            if group and group[-1] in blocks:
                return True
        return False
