"""Blocks: the pool's per-block metadata (:class:`KVCacheBlock`), the free
queue threaded through it (:class:`FreeBlockQueue`), and the per-group block
lists a step hands the engine (:class:`KVCacheBlocks`) with the block
copies it runs first (:class:`BlockCopy`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeAlias

import attrs

from kvcore.coordinator.hashing import BlockHash
from kvcore.errors import KvcoreValueError, NoFreeBlocksError

__all__ = [
    "BlockCopy",
    "BlockHashWithGroupId",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheBlocks",
]

BlockHashWithGroupId: TypeAlias = tuple[BlockHash, int]
"""Prefix-cache key: the block's chained hash and its cache group id."""


class KVCacheBlock:
    """Metadata of one physical block (the data lives in the pool's tensors)."""

    # Slots are laid out in this order: the fields freeing and allocating
    # touch come first, next to the object header, so that a block's hot
    # fields share a cache line more often (freeing a request's blocks is
    # bound by cache misses).
    __slots__ = (  # noqa: RUF023
        "ref_cnt",
        "key_hash",
        "prev_free",
        "next_free",
        "partial_keys",
        "is_null",
        "block_id",
        "key_group",
        "partial_group",
    )

    block_id: int
    ref_cnt: int
    key_hash: BlockHash | None
    key_group: int
    prev_free: KVCacheBlock | None
    next_free: KVCacheBlock | None
    is_null: bool
    partial_keys: list[BlockHash] | None
    partial_group: int

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        #: The prefix-cache key's two parts, stored apart (no tuple per cached
        #: block): its hash while the block is registered, else None, and its
        #: group id (meaningful only while ``key_hash`` is not None).
        self.key_hash = None
        self.key_group = 0
        #: Free-queue links; both None while the block is not in a queue.
        self.prev_free = None
        self.next_free = None
        #: True only for the pool's placeholder block (id 0).
        self.is_null = False
        #: Partial keys: the chunk hashes of the prefixes that end inside
        #: this block (a copy-on-write hit source, see
        #: :meth:`BlockPool.add_partial_key`), else None; and their group.
        self.partial_keys = None
        self.partial_group = 0

    def __getstate__(self) -> dict[str, Any]:
        """The block's fields (a subclass's too) but its free-queue links:
        the queue relinks its blocks (see :meth:`FreeBlockQueue.__setstate__`),
        so copying or pickling a pool never recurses along the queue."""
        state = {
            name: getattr(self, name)
            for name in _copied_fields(type(self))
            if hasattr(self, name)
        }
        state.update(getattr(self, "__dict__", ()))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.prev_free = self.next_free = None
        for name, value in state.items():
            setattr(self, name, value)

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        """Prefix-cache key ``(block hash, group id)`` while registered, else
        None (built on each read)."""
        h = self.key_hash
        return None if h is None else (h, self.key_group)

    def __repr__(self) -> str:
        key = None if self.key_hash is None else self.key_hash.hex()[:12]
        null = ", null" if self.is_null else ""
        return (
            f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, hash={key}{null})"
        )


def _copied_fields(cls: type) -> tuple[str, ...]:
    """The slots of a block class that a copy keeps: all but the links."""
    fields = _COPIED_FIELDS.get(cls)
    if fields is None:
        fields = _COPIED_FIELDS[cls] = tuple(
            name
            for klass in cls.__mro__
            for name in getattr(klass, "__slots__", ())
            if name not in ("prev_free", "next_free", "__dict__", "__weakref__")
        )
    return fields


_COPIED_FIELDS: dict[type, tuple[str, ...]] = {}


# ---------------------------------------------------------------------------
# Free queue
# ---------------------------------------------------------------------------


class FreeBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks themselves.

    The front is evicted (handed out) first.  Every operation is O(1) per block;
    ``remove`` takes a block out of the middle, which is how a prefix-cache hit
    revives a free block.  Sentinel head and tail blocks (id -1) remove all
    end-of-list special cases.

    Behind the back of the queue, a second list holds *held-back* blocks
    (:meth:`hold`): free blocks evicted only once every other free block is
    gone, front first.  ``remove`` takes a block out of either list; both
    count in ``num_free``, and ``held`` is the set of held-back blocks (so
    their number is known in O(1)).
    """

    __slots__ = (
        "_back",
        "_front",
        "_head",
        "_held_head",
        "_held_tail",
        "_tail",
        "held",
        "num_free",
    )

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._held_head = KVCacheBlock(-1)
        self._held_tail = KVCacheBlock(-1)
        self._held_head.next_free = self._held_tail
        self._held_tail.prev_free = self._held_head
        #: The held-back blocks, as a set (their order is the held list's).
        self.held: set[KVCacheBlock] = set()
        #: Scratch ends of the two chains a release builds before it splices
        #: them in (see BlockPool._release); unlinked between calls.
        self._front = KVCacheBlock(-1)
        self._back = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        self.append_n(list(blocks))

    def __len__(self) -> int:
        return self.num_free

    def __getstate__(self) -> dict[str, Any]:
        """The queue as its blocks, front first, and the held-back blocks
        (the links are not copied: a copy of a long queue would recurse
        along them)."""
        return {"order": _chain(self._head, self._tail), "held": self.held_blocks()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        FreeBlockQueue.__init__(self, state["order"])
        for block in state.get("held", ()):
            self.hold(block)

    def popleft(self) -> KVCacheBlock:
        """Take the front block (a held-back one once no other is left)."""
        block = self._head.next_free
        if block is self._tail:
            block = self._held_head.next_free
        if block is self._held_tail or block is None:
            msg = "the free block queue is empty; free blocks before taking one"
            raise NoFreeBlocksError(msg)
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take the ``n`` front blocks, front first."""
        if n > self.num_free or n < 0:
            msg = (
                f"asked the free block queue for {n} blocks but it holds "
                f"{self.num_free}; ask for between 0 and {self.num_free}"
            )
            raise NoFreeBlocksError(msg)
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it is in the queue."""
        prev = block.prev_free
        nxt = block.next_free
        if prev is None or nxt is None:
            msg = (
                f"block {block.block_id} is not in the free block queue; only a "
                "free block (reference count 0) can be removed from it"
            )
            raise KvcoreValueError(msg)
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1
        if self.held:
            self.held.discard(block)

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the back (evicted last)."""
        if block.prev_free is not None:
            raise _already_queued(block)
        tail = self._tail
        last = tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = tail
        tail.prev_free = block
        self.num_free += 1

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` at the back, in order (the first given leaves first)."""
        if not blocks:
            return
        tail = self._tail
        last = tail.prev_free
        assert last is not None
        self._link_after(last, tail, blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` at the front, in order (the first given leaves first)."""
        if not blocks:
            return
        head = self._head
        first = head.next_free
        assert first is not None
        self._link_after(head, first, blocks)

    def _link_after(
        self, left: KVCacheBlock, right: KVCacheBlock, blocks: Sequence[KVCacheBlock]
    ) -> None:
        for block in blocks:
            if block.prev_free is not None:
                raise _already_queued(block)
        prev = left
        for block in blocks:
            prev.next_free = block
            block.prev_free = prev
            prev = block
        prev.next_free = right
        right.prev_free = prev
        self.num_free += len(blocks)

    def hold(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the back of the held-back blocks: evicted after
        every block of the queue and every block held back before it."""
        if block.prev_free is not None:
            raise _already_queued(block)
        tail = self._held_tail
        last = tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = tail
        tail.prev_free = block
        self.num_free += 1
        self.held.add(block)

    def prepend_held_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` at the front of the held-back blocks, in order."""
        if not blocks:
            return
        first = self._held_head.next_free
        assert first is not None
        self._link_after(self._held_head, first, blocks)
        self.held.update(blocks)

    def release_held(self) -> None:
        """Move every held-back block to the queue's back, in their order
        (the eviction order stays; none is held back any more)."""
        held = self.held_blocks()
        for block in held:
            self.remove(block)
        self.append_n(held)

    def relink(self, links: Sequence[KVCacheBlock]) -> None:
        """Put unlinked blocks back, given flat as ``(block, prev, next)`` in
        the order they were unlinked: newest first, so each goes back
        between the neighbours it had (held back again when they are)."""
        held = self.held
        held_head = self._held_head
        for i in range(len(links) - 3, -1, -3):
            block = links[i]
            prev = links[i + 1]
            nxt = links[i + 2]
            prev.next_free = block
            block.prev_free = prev
            block.next_free = nxt
            nxt.prev_free = block
            self.num_free += 1
            if prev is held_head or prev in held:
                held.add(block)

    def drop_chains(self) -> None:
        """Unlink the scratch ends of the chains a release builds (see
        :meth:`BlockPool._release`), leaving the queue as it was."""
        front_end = self._front
        back_end = self._back
        front_end.prev_free = front_end.next_free = None
        back_end.prev_free = back_end.next_free = None

    def splice_chains(
        self, front: KVCacheBlock, back: KVCacheBlock, table: bool, freed: int
    ) -> None:
        """Splice the two chains of ``freed`` blocks a release built into the
        queue: the front chain before the blocks queued already, the back
        chain after them.  ``front``/``back``: each chain's first block
        (``table``: the chains grew at the front) or its last."""
        front_end = self._front
        back_end = self._back
        head = self._head
        tail = self._tail
        # The segments in queue order, each (first, last): the front
        # chain, the blocks queued before, the back chain.
        segments: list[tuple[KVCacheBlock | None, KVCacheBlock | None]]
        if table:
            segments = [(front, front_end.prev_free), (back, back_end.prev_free)]
        else:
            segments = [(front_end.next_free, front), (back_end.next_free, back)]
        if head.next_free is not tail:
            segments.insert(1, (head.next_free, tail.prev_free))
        prev = head
        for first, last in segments:
            if first is front_end or first is back_end or first is None:
                continue  # an empty chain
            assert last is not None  # a chain's ends are linked
            prev.next_free = first
            first.prev_free = prev
            prev = last
        prev.next_free = tail
        tail.prev_free = prev
        self.drop_chains()
        self.num_free += freed

    def first_held(self) -> KVCacheBlock | None:
        """The held-back block evicted first, or None when none is held."""
        block = self._held_head.next_free
        return None if block is self._held_tail else block

    def held_blocks(self) -> list[KVCacheBlock]:
        """The held-back blocks, front first (O(n))."""
        return _chain(self._held_head, self._held_tail)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks in eviction order, front first: the queue, then
        the held-back blocks (O(n); for tests and debugging)."""
        return _chain(self._head, self._tail) + self.held_blocks()


def _chain(head: KVCacheBlock, tail: KVCacheBlock) -> list[KVCacheBlock]:
    """The blocks linked between two sentinels, in order."""
    out = []
    block = head.next_free
    while block is not tail and block is not None:
        out.append(block)
        block = block.next_free
    return out


def _already_queued(block: KVCacheBlock) -> KvcoreValueError:
    msg = (
        f"block {block.block_id} is already in the free block queue; a block can "
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
    """Blocks of one request step: ``blocks[group]`` is that group's list.

    ``copies`` are the block copies the engine runs before the step's
    forward pass, in order (copy-on-write partial hits, see
    :class:`~kvcore.coordinator.BlockCopy`); empty unless
    :meth:`KVCacheManager.allocate_slots` admitted a request whose hit ends
    inside a block.
    """

    __slots__ = ("_lookup", "blocks", "copies")

    def __init__(
        self,
        blocks: tuple[Sequence[KVCacheBlock], ...],
        copies: tuple[BlockCopy, ...] = (),
    ) -> None:
        self.blocks = blocks
        self.copies = copies
        #: Set by KVCacheManager.get_computed_blocks on the hit it returns:
        #: (its pool, the pool's eviction count then, the request, ``blocks``).
        self._lookup: tuple[object, int, object, object] | None = None

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.blocks)

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(
            tuple([*a, *b] for a, b in zip(self.blocks, other.blocks, strict=True)),
            self.copies + other.copies,
        )

    def __len__(self) -> int:
        return len(self.blocks)

    def __repr__(self) -> str:
        return f"KVCacheBlocks({self.get_block_ids()})"
