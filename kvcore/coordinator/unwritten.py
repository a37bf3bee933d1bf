"""Blocks a step took or keyed whose forward has not run: no hit may read
one before its own step.

A step's blocks are taken, and keyed, when the step is scheduled, before its
forward pass runs.  An attention block taken so can serve a hit admitted in
the same step (each layer writes the step's KV before it attends), but a
recurrent state cannot: a request resuming from it reads the state before
the scan that writes it.  Nor can the source of a copy-on-write hit (see
:mod:`kvcore.coordinator.partial`): the copy runs before the forward.
Groups whose managers declare
:attr:`~kvcore.coordinator.manager.SingleTypeManager.reads_hit_before_step`
have the blocks each step takes noted here, and groups that serve
copy-on-write hits the blocks each step keys; an admission whose hit ends
on a noted state, or copies a noted block, is refused for this step
(``allocate_slots`` returns ``None``, as for a full pool), so the request
is admitted with its whole hit once the block is written.

A state counts as written at its writer's next call (its next step, its
free): an engine schedules a request once a step, and a later step's forward
runs after this one's.  An engine that says where its steps begin
(:meth:`UnwrittenStates.new_step_starts`) ends every wait at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcore.coordinator.twins import twin_runs

if TYPE_CHECKING:
    from kvcore.coordinator.manager import SingleTypeManager

__all__ = ["UnwrittenStates"]


class UnwrittenStates:
    """The state blocks taken or keyed, and the copy sources keyed, by steps
    whose forward may not have run."""

    def __init__(self, managers: Sequence[SingleTypeManager]) -> None:
        #: The managers whose hits read their last block before the step.
        self.managers = tuple(m for m in managers if m.reads_hit_before_step)
        #: The managers of groups that serve copy-on-write hits, whose blocks
        #: a hit may copy before its step (see :meth:`watch_sources`).
        self.sources: tuple[SingleTypeManager, ...] = ()
        #: Runs of twin groups among both (twins key alike): the state
        #: groups' runs first, then the sources'.
        self._runs = self._state_runs = _twin_runs(self.managers)
        #: Writer request id -> the blocks its latest step took or keyed.
        self.by_writer: dict[str, list[int]] = {}
        #: Every noted block id -> the writer whose step took it last (a block
        #: released while noted may be taken again by another step).
        self.blocks: dict[int, str] = {}
        #: Each noted copy source -> the first token of its prefix that the
        #: step keying it writes (a copy may read the tokens before it).
        self.unwritten_from: dict[int, int] = {}

    def watch_sources(self, sources: Sequence[SingleTypeManager]) -> None:
        """Note the blocks steps key in ``sources`` too (groups serving
        copy-on-write hits)."""
        self.sources = tuple(sources)
        self._runs = self._state_runs + _twin_runs(self.sources)

    def keyed_so_far(self, request_id: str) -> list[tuple[int, int]]:
        """Before a step: for each run of twin state or source groups, how
        many blocks it has keyed for the request and how long its table is
        (what :meth:`took` notes the step's keys from)."""
        out = []
        for run in self._runs:
            lead = run[0]
            table = lead.req_to_blocks.get(request_id)
            out.append(
                (lead.num_cached_block.get(request_id, 0), len(table) if table else 0)
            )
        return out

    def took(
        self,
        request_id: str,
        new_blocks: Sequence[Sequence[int]] | None,
        keyed_from: Sequence[tuple[int, int]] = (),
        written_to: int = 0,
    ) -> None:
        """Note, once a step of the request is done, the state blocks it took
        (its new blocks per group) and, given :meth:`keyed_so_far` from
        before it, the blocks it keyed in the state and source groups that
        hold tokens from ``written_to`` (where the step starts) on: a state
        it writes into a block the request held already is keyed there."""
        taken = (
            []
            if new_blocks is None
            else [
                block
                for manager in self.managers
                for block in new_blocks[manager.kv_cache_group_id]
                if block
            ]
        )
        num_state_runs = len(self._state_runs)
        for index, (run, (start, length)) in enumerate(
            zip(self._runs, keyed_from, strict=False)
        ):
            end = run[0].num_cached_block.get(request_id, 0)
            size = run[0].block_size
            # Blocks wholly below the step's start were written before it.
            start = max(start, written_to // size)
            copied = index >= num_state_runs
            if not copied:
                # A state group's new blocks are noted above: only the
                # blocks it held before the step are left.
                end = min(end, length)
            if end <= start:
                continue
            tables = [manager.req_to_blocks.get(request_id) or () for manager in run]
            for pos in range(start, end):
                keyed = [b for t in tables if pos < len(t) and (b := t[pos])]
                taken += keyed
                if copied:
                    self.unwritten_from.update(
                        dict.fromkeys(keyed, max(pos * size, written_to))
                    )
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
            if self.unwritten_from:
                for block in noted:
                    if block not in blocks:
                        self.unwritten_from.pop(block, None)

    def new_step_starts(self) -> None:
        """A new engine step: every state taken before it is written."""
        self.by_writer.clear()
        self.blocks.clear()
        self.unwritten_from.clear()

    def admits(self, request_id: str, hit: Sequence[Sequence[int]] | None) -> bool:
        """A step of the request: what its last step took is written now;
        whether a hit it attaches (``None``: none) can be admitted this
        step (it ends on no state still unwritten)."""
        self.written(request_id)
        return hit is None or not self.hit_ends_unwritten(hit)

    def copies_unwritten(
        self, sources: Sequence[tuple[int, int, int]], hit_end: int
    ) -> bool:
        """Whether a copy-on-write hit ending at ``hit_end`` copies, from one
        of its sources (``(group id, block, tokens)`` each), a token that a
        step keyed before its forward ran."""
        unwritten = self.unwritten_from
        return bool(unwritten) and any(
            hit_end > unwritten.get(block, hit_end) for _, block, _ in sources
        )

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


def _twin_runs(
    managers: Sequence[SingleTypeManager],
) -> tuple[tuple[SingleTypeManager, ...], ...]:
    """``managers`` in runs of consecutive twins (see :func:`twin_runs`)."""
    return tuple(members for _, members in twin_runs(managers))
