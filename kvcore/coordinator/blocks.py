"""Blocks: block ids, the free queue threaded through the pool's link lists
(:class:`FreeBlockQueue`), the read-only per-block view engines may read
(:class:`KVCacheBlock`), and the per-group block lists a step hands the
engine (:class:`KVCacheBlocks`) with the block copies it runs first
(:class:`BlockCopy`).

Inside the coordinator a block is its id, a plain int: tables are lists of
ids, and the pool keeps every block's state in lists indexed by id.  Block 0
is the null block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeAlias

import attrs

from kvcore.coordinator.hashing import BlockHash
from kvcore.errors import KvcoreValueError, NoFreeBlocksError

__all__ = [
    "NULL_BLOCK",
    "BlockCopy",
    "BlockHashWithGroupId",
    "BlockId",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheBlocks",
]

BlockId: TypeAlias = int
"""A physical block: its index in the pool's tensors and state lists."""

NULL_BLOCK: BlockId = 0
"""The pool's placeholder block, for positions a group does not keep."""

BlockHashWithGroupId: TypeAlias = tuple[BlockHash, int]
"""Prefix-cache key: the block's chained hash and its cache group id."""

#: The link of a block that is not in the free queue.
UNLINKED: BlockId = -1


class BlockState(Protocol):
    """What a block view reads: the per-block state lists of a
    :class:`~kvcore.coordinator.block_pool.BlockPool`, and its views."""

    ref_cnt: list[int]
    key_hash: list[BlockHash | None]
    key_group: list[int]

    def block(self, block_id: BlockId) -> KVCacheBlock: ...


class KVCacheBlock:
    """A read-only view of one block's state in its pool, for engines and
    tools that read block objects (see :meth:`BlockPool.block`).  The
    coordinator itself passes block ids; a view reads the pool's state
    when asked, so it is never stale."""

    __slots__ = ("_pool", "block_id")

    def __init__(self, pool: BlockState, block_id: BlockId) -> None:
        self._pool = pool
        self.block_id = block_id

    @property
    def ref_cnt(self) -> int:
        """Requests (and hits being attached) holding the block."""
        return self._pool.ref_cnt[self.block_id]

    @property
    def key_hash(self) -> BlockHash | None:
        """The hash of the block's full prefix-cache key, else None."""
        return self._pool.key_hash[self.block_id]

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        """Prefix-cache key ``(block hash, group id)`` while registered, else
        None."""
        h = self._pool.key_hash[self.block_id]
        return None if h is None else (h, self._pool.key_group[self.block_id])

    @property
    def is_null(self) -> bool:
        """True only for the pool's placeholder block (id 0)."""
        return self.block_id == NULL_BLOCK

    def __repr__(self) -> str:
        key = self.key_hash
        shown = None if key is None else key.hex()[:12]
        null = ", null" if self.is_null else ""
        return (
            f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, hash={shown}{null})"
        )


# ---------------------------------------------------------------------------
# Free queue
# ---------------------------------------------------------------------------


class FreeBlockQueue:
    """Doubly linked list of free block ids, its links held in two lists
    indexed by block id (``prev``, ``next``; :data:`UNLINKED` for a block
    not in the queue).

    The front is evicted (handed out) first.  Every operation is O(1) per
    block; ``remove`` takes a block out of the middle, which is how a
    prefix-cache hit revives a free block.  Sentinel ids past the pool's
    blocks (a head and a tail) remove all end-of-list special cases.

    Behind the back of the queue, a second list holds *held-back* blocks
    (:meth:`hold`): free blocks evicted only once every other free block is
    gone, front first.  A third list holds *spare* blocks (:meth:`spare_n`):
    keyed blocks a running request stopped reading and kept for no hit
    point, handed out after the blocks without a key at the queue's front and before its
    keyed ones (see :meth:`BlockPool.get_new_blocks`).  ``remove`` takes a
    block out of any list; all count in ``num_free``, and ``held`` and
    ``spare`` are the sets of held-back and spare blocks (so their numbers
    are known in O(1)).
    """

    __slots__ = (
        "back",
        "front",
        "head",
        "held",
        "held_head",
        "held_tail",
        "next",
        "num_free",
        "prev",
        "spare",
        "spare_head",
        "spare_tail",
        "tail",
    )

    def __init__(self, num_blocks: int) -> None:
        """A queue of block ids ``0..num_blocks-1``, in id order (the pool
        checks ``num_blocks`` first)."""
        n = num_blocks
        #: Sentinel ids: the queue's ends, the held-back list's ends, and the
        #: scratch ends of the chains a release builds (see BlockPool._release).
        self.head = n
        self.tail = n + 1
        self.held_head = n + 2
        self.held_tail = n + 3
        self.front = n + 4
        self.back = n + 5
        self.spare_head = n + 6
        self.spare_tail = n + 7
        self.prev: list[BlockId] = [UNLINKED] * (n + 8)
        self.next: list[BlockId] = [UNLINKED] * (n + 8)
        self.next[self.head] = self.tail
        self.prev[self.tail] = self.head
        self.next[self.held_head] = self.held_tail
        self.prev[self.held_tail] = self.held_head
        self.next[self.spare_head] = self.spare_tail
        self.prev[self.spare_tail] = self.spare_head
        #: The held-back blocks, as a set (their order is the held list's).
        self.held: set[BlockId] = set()
        #: The spare blocks, as a set (their order is the spare list's).
        self.spare: set[BlockId] = set()
        self.num_free = n
        if n:
            # Linked in one pass, the lists sharing one int per id.
            ids = list(range(n))
            self.next[self.head] = ids[0]
            self.prev[ids[0]] = self.head
            self.next[: n - 1] = ids[1:]
            self.prev[1:n] = ids[:-1]
            self.next[n - 1] = self.tail
            self.prev[self.tail] = n - 1

    def __len__(self) -> int:
        return self.num_free

    def popleft(self) -> BlockId:
        """Take the front block (a spare one once the queue is empty, a
        held-back one once no other is left)."""
        block = self.next[self.head]
        if block == self.tail:
            block = self.next[self.spare_head]
        if block == self.spare_tail:
            block = self.next[self.held_head]
        if block == self.held_tail:
            msg = "the free block queue is empty; free blocks before taking one"
            raise NoFreeBlocksError(msg)
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[BlockId]:
        """Take the ``n`` front blocks, front first."""
        if n > self.num_free or n < 0:
            msg = (
                f"asked the free block queue for {n} blocks but it holds "
                f"{self.num_free}; ask for between 0 and {self.num_free}"
            )
            raise NoFreeBlocksError(msg)
        return [self.popleft() for _ in range(n)]

    def remove(self, block: BlockId) -> None:
        """Unlink ``block`` from wherever it is in the queue."""
        if self.prev[block] == UNLINKED:
            msg = (
                f"block {block} is not in the free block queue; only a "
                "free block (reference count 0) can be removed from it"
            )
            raise KvcoreValueError(msg)
        self.unlink_n((block,))

    def unlink_n(self, blocks: Sequence[BlockId]) -> list[BlockId]:
        """Unlink ``blocks`` (each queued, each named once) from wherever
        they are in the queue, in order; their links as each had them when
        it was unlinked, flat (``block, prev, next`` each), which
        :meth:`relink` puts back."""
        prev_links = self.prev
        next_links = self.next
        links: list[BlockId] = []
        for block in blocks:
            prev = prev_links[block]
            nxt = next_links[block]
            links += (block, prev, nxt)
            next_links[prev] = nxt
            prev_links[nxt] = prev
            prev_links[block] = next_links[block] = UNLINKED
        self.num_free -= len(blocks)
        if self.held:
            self.held.difference_update(blocks)
        if self.spare:
            self.spare.difference_update(blocks)
        return links

    def append(self, block: BlockId) -> None:
        """Put ``block`` at the back (evicted last)."""
        self._link_after(self.prev[self.tail], self.tail, (block,))

    def append_n(self, blocks: Sequence[BlockId]) -> None:
        """Put ``blocks`` at the back, in order (the first given leaves first)."""
        if blocks:
            self._link_after(self.prev[self.tail], self.tail, blocks)

    def prepend_n(self, blocks: Sequence[BlockId]) -> None:
        """Put ``blocks`` at the front, in order (the first given leaves first)."""
        if blocks:
            self._link_after(self.head, self.next[self.head], blocks)

    def _link_after(
        self, left: BlockId, right: BlockId, blocks: Sequence[BlockId]
    ) -> None:
        prev_links = self.prev
        next_links = self.next
        for block in blocks:
            if prev_links[block] != UNLINKED:
                raise _already_queued(block)
        prev = left
        for block in blocks:
            next_links[prev] = block
            prev_links[block] = prev
            prev = block
        next_links[prev] = right
        prev_links[right] = prev
        self.num_free += len(blocks)

    def hold_n(self, blocks: Sequence[BlockId]) -> None:
        """Put ``blocks`` at the back of the held-back blocks, in order:
        evicted after every block of the queue and every block held back
        before them."""
        if blocks:
            self._link_after(self.prev[self.held_tail], self.held_tail, blocks)
            self.held.update(blocks)

    def prepend_held_n(self, blocks: Sequence[BlockId]) -> None:
        """Put ``blocks`` at the front of the held-back blocks, in order."""
        if not blocks:
            return
        self._link_after(self.held_head, self.next[self.held_head], blocks)
        self.held.update(blocks)

    def spare_n(self, blocks: Sequence[BlockId]) -> None:
        """Put ``blocks`` at the back of the spare blocks, in order."""
        if blocks:
            self._link_after(self.prev[self.spare_tail], self.spare_tail, blocks)
            self.spare.update(blocks)

    def prepend_spare_n(self, blocks: Sequence[BlockId]) -> None:
        """Put ``blocks`` at the front of the spare blocks, in order."""
        if blocks:
            self._link_after(self.spare_head, self.next[self.spare_head], blocks)
            self.spare.update(blocks)

    def release_held(self) -> None:
        """Move every held-back block to the queue's back, in their order
        (the eviction order stays; none is held back any more)."""
        held = self.held_blocks()
        for block in held:
            self.remove(block)
        self.append_n(held)

    def release_spare(self) -> None:
        """Move every spare block to the queue's front, in their order."""
        spare = self.spare_blocks()
        for block in spare:
            self.remove(block)
        self.prepend_n(spare)

    def relink(self, links: Sequence[BlockId]) -> None:
        """Put unlinked blocks back, given flat as ``(block, prev, next)`` in
        the order they were unlinked: newest first, so each goes back
        between the neighbours it had (held back or spare again when they
        are)."""
        prev_links = self.prev
        next_links = self.next
        held = self.held
        held_head = self.held_head
        spare = self.spare
        spare_head = self.spare_head
        for i in range(len(links) - 3, -1, -3):
            block = links[i]
            prev = links[i + 1]
            nxt = links[i + 2]
            next_links[prev] = block
            prev_links[block] = prev
            next_links[block] = nxt
            prev_links[nxt] = block
            self.num_free += 1
            if prev == held_head or prev in held:
                held.add(block)
            elif prev == spare_head or prev in spare:
                spare.add(block)

    def drop_chains(self) -> None:
        """Unlink the scratch ends of the chains a release builds (see
        :meth:`BlockPool._release`), leaving the queue as it was."""
        prev_links = self.prev
        next_links = self.next
        prev_links[self.front] = next_links[self.front] = UNLINKED
        prev_links[self.back] = next_links[self.back] = UNLINKED

    def splice_chains(
        self, front: BlockId, back: BlockId, table: bool, freed: int
    ) -> None:
        """Splice the two chains of ``freed`` blocks a release built into the
        queue: the front chain before the blocks queued already, the back
        chain after them.  ``front``/``back``: each chain's first block
        (``table``: the chains grew at the front) or its last."""
        prev_links = self.prev
        next_links = self.next
        front_end = self.front
        back_end = self.back
        head = self.head
        tail = self.tail
        # In queue order, each segment's first and last block: the front
        # chain (empty: its end or unlinked), the blocks queued before
        # (none: the tail), the back chain; all read before a link changes.
        queued, queued_last = next_links[head], prev_links[tail]
        if table:
            front_last, back_last = prev_links[front_end], prev_links[back_end]
        else:
            front, front_last = next_links[front_end], front
            back, back_last = next_links[back_end], back
        prev = head
        if front != front_end and front != UNLINKED:
            next_links[prev] = front
            prev_links[front] = prev
            prev = front_last
        if queued != tail:
            next_links[prev] = queued
            prev_links[queued] = prev
            prev = queued_last
        if back != back_end and back != UNLINKED:
            next_links[prev] = back
            prev_links[back] = prev
            prev = back_last
        next_links[prev] = tail
        prev_links[tail] = prev
        self.drop_chains()
        self.num_free += freed

    def held_blocks(self) -> list[BlockId]:
        """The held-back blocks, front first (O(n))."""
        return self._chain(self.held_head, self.held_tail)

    def spare_blocks(self) -> list[BlockId]:
        """The spare blocks, front first (O(n))."""
        return self._chain(self.spare_head, self.spare_tail)

    def get_all_free_blocks(self) -> list[BlockId]:
        """All free blocks list by list, front first: the queue, the spare
        blocks, the held-back blocks (O(n); for tests and debugging).
        :meth:`BlockPool.eviction_order` gives the order hand-outs take
        them in."""
        return (
            self._chain(self.head, self.tail) + self.spare_blocks() + self.held_blocks()
        )

    def _chain(self, head: BlockId, tail: BlockId) -> list[BlockId]:
        """The blocks linked between two sentinels, in order."""
        next_links = self.next
        out = []
        block = next_links[head]
        while block != tail and block != UNLINKED:
            out.append(block)
            block = next_links[block]
        return out


def _already_queued(block: BlockId) -> KvcoreValueError:
    msg = (
        f"block {block} is already in the free block queue; a block can "
        "be queued once (take it out with remove() or popleft() first)"
    )
    return KvcoreValueError(msg)


@attrs.frozen
class BlockCopy:
    """One block copy the engine runs before the step's forward pass: the
    first ``num_tokens`` slots of block ``src_block_id`` of cache group
    ``group_id`` into block ``dst_block_id`` (copying the whole block is as
    good: the request overwrites the slots past ``num_tokens``).  Every layer
    of the group is copied (:meth:`kvcore.KVCachePool.copy_blocks`)."""

    group_id: int
    src_block_id: int
    dst_block_id: int
    num_tokens: int


class KVCacheBlocks:
    """Blocks of one request step: ``ids[group]`` is that group's list of
    block ids (``blocks[group]``: the same as block views).

    ``copies`` are the block copies the engine runs before the step's
    forward pass, in order (copy-on-write partial hits, see
    :class:`~kvcore.coordinator.BlockCopy`); empty unless
    :meth:`KVCacheManager.allocate_slots` admitted a request whose hit ends
    inside a block.
    """

    __slots__ = ("_lookup", "_pool", "copies", "ids")

    def __init__(
        self,
        ids: tuple[Sequence[BlockId], ...],
        copies: tuple[BlockCopy, ...] = (),
        pool: BlockState | None = None,
    ) -> None:
        self.ids = ids
        self.copies = copies
        self._pool = pool
        #: Set by KVCacheManager.get_computed_blocks on the hit it returns:
        #: (its pool, the pool's eviction count then, the request, ``ids``).
        self._lookup: tuple[object, int, object, object] | None = None

    @property
    def blocks(self) -> tuple[list[KVCacheBlock], ...]:
        """The blocks as views of their pool's state (made on each read)."""
        pool = self._pool
        if pool is None:
            msg = (
                "these KVCacheBlocks were built without their pool, so they "
                "have ids but no block views; read get_block_ids() or .ids"
            )
            raise KvcoreValueError(msg)
        view = pool.block
        return tuple([view(b) for b in group] for group in self.ids)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple(list(group) for group in self.ids)

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(
            tuple([*a, *b] for a, b in zip(self.ids, other.ids, strict=True)),
            self.copies + other.copies,
            self._pool if self._pool is not None else other._pool,
        )

    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        return f"KVCacheBlocks({self.get_block_ids()})"
