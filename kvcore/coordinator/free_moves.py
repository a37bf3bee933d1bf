"""Moving free blocks between the free queue's lists: to the queue's back,
or into the held-back blocks (kept for later hits), with the cap that keeps
the held-back blocks at most as many as the other free blocks.
:class:`FreeMoves` is a base of :class:`~kvcore.coordinator.block_pool.BlockPool`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvcore.coordinator.blocks import UNLINKED, BlockId
from kvcore.coordinator.pool_checks import check_ids
from kvcore.coordinator.pool_journal import MOVE

if TYPE_CHECKING:
    from kvcore.coordinator.blocks import FreeBlockQueue
    from kvcore.coordinator.hashing import BlockHash
    from kvcore.coordinator.pool_journal import Record

__all__ = ["FreeMoves"]


class FreeMoves:
    """Moves of free blocks within the free queue (the pool supplies the
    queue, the counts, the keys and the journal)."""

    __slots__ = ()

    free_queue: FreeBlockQueue
    ref_cnt: list[int]
    key_hash: list[BlockHash | None]
    journal: list[Record] | None
    num_blocks: int

    def requeue_at_back(self, blocks: Sequence[BlockId]) -> None:
        """Move free blocks to the back of the free queue (held-back ones
        included), in the given order, as if just freed; blocks in use, the
        null block and blocks without a key are left where they are."""
        self._move_free(blocks, self.free_queue.append_n)

    def to_spare(self, blocks: Sequence[BlockId]) -> None:
        """Move free blocks to the back of the spare blocks (held-back ones
        included), in the given order: evicted before every other keyed
        block; blocks in use, the null block and blocks without a key are
        left where they are."""
        self._move_free(blocks, self.free_queue.spare_n)

    def hold_back(self, blocks: Sequence[BlockId]) -> None:
        """Move free blocks behind every other free block, in the given
        order: they are evicted only once no other free block is left
        (blocks a running request released that later requests' hits need,
        see :meth:`FreeBlockQueue.hold_n`).  Blocks in use, the null block
        and blocks without a key are left where they are; a block revived by
        a hit leaves the held-back blocks, and :meth:`requeue_at_back` puts
        one back in the queue.

        Holding back leaves the held-back blocks at most as many as the
        other free blocks: past that, those evicted first among them go to
        the back of the queue.  Holding back bets on later hits of running
        requests, the queue's order on returning prefixes; neither bet may
        take the whole free pool.  (Hand-outs draw the queue first, so
        between holds the held-back blocks may outnumber the rest.)"""
        self._move_free(blocks, self.free_queue.hold_n)
        self._spill_held()

    def hold_back_first(self, blocks: Sequence[BlockId]) -> None:
        """:meth:`hold_back`, but in front of the held-back blocks (in the
        given order): evicted once no other free block is left, before
        every block held back with :meth:`hold_back` (blocks kept only
        while the pool has room for them)."""
        queue = self.free_queue
        # Walked back to front, each block placed in front of those after
        # it: a block named twice stays where its first naming puts it.
        self._move_free(blocks[::-1], lambda moved: queue.prepend_held_n(moved[::-1]))
        self._spill_held()

    def _spill_held(self) -> None:
        """Move the held-back blocks evicted first to the back of the queue
        until they are at most as many as the other free blocks."""
        queue = self.free_queue
        excess = 2 * len(queue.held) - queue.num_free
        if excess <= 0:
            return
        first: list[BlockId] = []
        block = queue.held_head
        next_links = queue.next
        for _ in range((excess + 1) // 2):  # each move takes 2 off the excess
            block = next_links[block]
            first.append(block)
        self._move_free(first, queue.append_n)

    def _move_free(
        self, blocks: Sequence[BlockId], put_n: Callable[[list[BlockId]], None]
    ) -> None:
        """Unlink the free keyed blocks of ``blocks`` from the queue, then
        place them all with one ``put_n`` call, in the given order (a block
        named twice by its last naming: where moving one block at a time
        would leave it)."""
        queue = self.free_queue
        prev_links = queue.prev
        ref = self.ref_cnt
        key_hash = self.key_hash
        check_ids("moving free blocks", blocks, self.num_blocks)
        moved = [
            block
            for block in blocks
            if block
            and not ref[block]
            and key_hash[block] is not None
            and prev_links[block] != UNLINKED
        ]
        if not moved:
            return
        if len(set(moved)) < len(moved):
            moved = list(dict.fromkeys(reversed(moved)))[::-1]
        links = queue.unlink_n(moved)
        if self.journal is not None:
            self.journal.append((MOVE, *links))
        put_n(moved)
