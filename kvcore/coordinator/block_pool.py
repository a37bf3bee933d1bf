"""Physical KV-cache blocks: reference counts, the free queue, the prefix cache.

Every cache group draws block ids from one :class:`BlockPool`.  A block is
*in use* while its reference count is positive and *free* otherwise; free
blocks wait in a :class:`FreeBlockQueue` in eviction order.  A full block can
be registered in the prefix cache under ``(block hash, group id)``; it keeps
that key while free, so a later request can hit it, and loses it only when the
pool hands the block out again (or the cache is reset).  Hand-outs take the
blocks without a key at the queue's front first, then the *spare* blocks (keyed blocks a
running request stopped reading and kept for no hit), then the queue's keyed
blocks, the least recently freed first, then the *held-back* blocks (kept
for later hits; see :mod:`kvcore.coordinator.free_moves`).

A block of a group that serves copy-on-write partial hits may also carry
*partial keys*: the chunk hashes of prefixes that end inside it (see
:meth:`BlockPool.add_partial_key`).  They live in a map of their own, are
dropped with the block's full key, and raise no events (``BlockStored`` and
``BlockRemoved`` are about full blocks only).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvcore.coordinator.blocks import (
    UNLINKED,
    BlockHashWithGroupId,
    BlockId,
    FreeBlockQueue,
    KVCacheBlock,
)
from kvcore.coordinator.cache_tables import (
    Entry,
    insert_entry,
    num_entries,
    one_per_group,
    remove_entry,
)
from kvcore.coordinator.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    check_event_groups,
    check_event_inputs,
    stored_events,
)
from kvcore.coordinator.free_moves import FreeMoves
from kvcore.coordinator.hashing import BlockHash
from kvcore.coordinator.pool_checks import (
    check_events_medium,
    check_ids,
    check_num_blocks,
)
from kvcore.coordinator.pool_journal import (
    KEY,
    MOVE,
    NOTHING,
    PARTIAL,
    RELEASE,
    TOUCH,
    UNDO_CALL,
    UNGET,
    UNPARTIAL,
    Record,
    undo_all,
)
from kvcore.coordinator.twin_ops import TwinPoolOps, check_store, double_free, key_spans
from kvcore.errors import (
    BlockSizeError,
    InvalidRequestError,
    KvcoreValueError,
    NoFreeBlocksError,
    ReentrantCallError,
)

__all__ = [
    "AllBlocksCleared",
    "BlockHashWithGroupId",
    "BlockId",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheEvent",
]


class BlockPool(FreeMoves, TwinPoolOps):
    """All blocks of the KV cache, shared by every cache group.

    A block is its id.  The pool keeps every block's state in lists indexed
    by id, read by the coordinator and written only here: :attr:`ref_cnt`,
    the full prefix-cache key (:attr:`key_hash`, :attr:`key_group`), the
    partial keys (:attr:`partial_keys`) and the free queue's links.

    Block 0 is the *null block*: a placeholder for positions a group does not
    keep (e.g. outside a sliding window).  It is taken out at construction,
    never freed, hashed or reference-counted, and does not count as free or
    usable.

    With ``enable_kv_cache_events`` the pool records events for a KV-aware
    router (see :mod:`kvcore.coordinator.events`); ``event_groups`` gives,
    per group id, the ``(block size, kind name, sliding window or None)``
    a :class:`BlockStored` carries, and ``kv_events_medium`` names the medium
    every event carries.
    """

    __slots__ = (
        "_cached",
        "_event_groups",
        "_events",
        "_events_mark",
        "_num_cached",
        "_partial",
        "_views",
        "enable_caching",
        "enable_kv_cache_events",
        "evictions",
        "free_queue",
        "hash_block_size",
        "journal",
        "key_group",
        "key_hash",
        "kv_events_medium",
        "null_block",
        "num_blocks",
        "partial_group",
        "partial_keys",
        "plugin_of",
        "ref_cnt",
        "transactions",
    )

    def __init__(
        self,
        num_blocks: int,
        *,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        event_groups: Sequence[tuple[int, str, int | None]] = (),
        kv_events_medium: str = MEDIUM_GPU,
    ) -> None:
        check_num_blocks(num_blocks)
        if type(hash_block_size) is not int or hash_block_size < 1:
            msg = (
                f"hash_block_size must be a positive int, got {hash_block_size!r}; "
                "pass the number of tokens per hashed chunk"
            )
            raise BlockSizeError(msg)
        self.num_blocks = num_blocks
        self.enable_caching = bool(enable_caching)
        self.hash_block_size = hash_block_size
        self.enable_kv_cache_events = bool(enable_kv_cache_events)
        self._event_groups = check_event_groups(event_groups)
        check_events_medium(kv_events_medium)
        self.kv_events_medium = kv_events_medium
        #: Block id -> its reference count (the null block's stays 0).
        self.ref_cnt: list[int] = [0] * num_blocks
        #: Block id -> the hash of its full prefix-cache key, else None; and
        #: that key's group id (meaningful only while the hash is set).
        self.key_hash: list[BlockHash | None] = [None] * num_blocks
        self.key_group: list[int] = [0] * num_blocks
        #: Block id -> its partial keys: the chunk hashes of the prefixes
        #: that end inside it (a copy-on-write hit source, see
        #: :meth:`add_partial_key`), else None; and (for blocks holding
        #: some) their group id.
        self.partial_keys: list[list[BlockHash] | None] = [None] * num_blocks
        self.partial_group: dict[BlockId, int] = {}
        self.free_queue = FreeBlockQueue(num_blocks)
        # group id -> (block hash -> block id, or {block id: None} in key
        # order when several blocks hold that key).
        self._cached: dict[int, dict[BlockHash, Entry]] = {}
        #: group id -> (chunk hash -> block id, or {block id: None}): the
        #: partial keys (prefixes ending inside a block).
        self._partial: dict[int, dict[BlockHash, Entry]] = {}
        #: group id -> blocks holding a full key of that group (the entries
        #: of ``_cached[group id]``), kept as keys come and go.
        self._num_cached: dict[int, int] = {}
        self._events: list[KVCacheEvent] = []
        #: Undo records of the open transaction (see :meth:`begin`), else
        #: None: plain tuples, an op code first (see :meth:`rollback`).
        self.journal: list[Record] | None = None
        #: Transactions begun so far: state kept beside the pool records
        #: its undo once per transaction (see
        #: SingleTypeManager.record_request_state).
        self.transactions = 0
        #: ``owner -> (plugin, distribution)`` where ``owner`` is a cache
        #: group's manager, else None (set by the coordinator): whom the
        #: error of an undo call a manager recorded names.
        self.plugin_of: Callable[[object], tuple[str, str | None] | None] | None = None
        self._events_mark = 0
        #: Prefix-cache keys dropped so far (evictions and resets): a hit
        #: looked up when this was ``n`` still holds its keys while it is ``n``.
        self.evictions = 0
        #: Block id -> its view once one was asked for (see :meth:`block`);
        #: the list is made on the first request.
        self._views: list[KVCacheBlock | None] | None = None
        self.null_block: BlockId = self.free_queue.popleft()

    def __getstate__(self) -> object:
        """The pool's slots, refused while a transaction is open: a copy
        could not roll back the open step."""
        if self.journal is not None:
            msg = (
                "a block pool (or the KVCacheManager holding it) was copied or "
                "pickled from inside a step; copy it between steps"
            )
            raise ReentrantCallError(msg)
        return object.__getstate__(self)

    def block(self, block_id: BlockId) -> KVCacheBlock:
        """A read-only view of block ``block_id`` (one per id, kept once
        made), for engines and tools that read block objects."""
        if type(block_id) is not int or not 0 <= block_id < self.num_blocks:
            msg = (
                f"block id {block_id!r} is not a block of this pool; ids "
                f"run from 0 to {self.num_blocks - 1}"
            )
            raise KvcoreValueError(msg)
        views = self._views
        if views is None:
            views = self._views = [None] * self.num_blocks
        view = views[block_id]
        if view is None:
            view = views[block_id] = KVCacheBlock(self, block_id)
        return view

    @property
    def blocks(self) -> list[KVCacheBlock]:
        """Every block as a view, by id (O(n); for engines and tests that
        index the pool's blocks)."""
        return [self.block(i) for i in range(self.num_blocks)]

    # -- transactions -------------------------------------------------------

    def begin(self) -> None:
        """Open a transaction: until :meth:`commit` or :meth:`rollback`, every
        change to reference counts, the free queue, the prefix cache and the
        events is recorded so that :meth:`rollback` can undo it exactly.

        A transaction already open means a cache manager called back into
        the ``KVCacheManager`` from inside a step: the nested step is refused
        (:class:`~kvcore.errors.ReentrantCallError`) before it changes
        anything, and the outer step, seeing its manager raise, is undone."""
        if self.journal is not None:
            msg = (
                "a step is already running on this block pool: a cache manager "
                "called back into the KVCacheManager (allocate_slots, free or "
                "reset_prefix_cache) from inside a step or while it was asked a "
                "count or a search; managers must not call the KVCacheManager, "
                "and what the outer call changed is undone"
            )
            raise ReentrantCallError(msg)
        self.journal = []
        self.transactions += 1
        self._events_mark = len(self._events)

    def commit(self) -> None:
        """Keep the open transaction's changes."""
        self.journal = None

    def rollback(self) -> None:
        """Undo every change since :meth:`begin`, newest first: reference
        counts, free-queue order, prefix-cache keys and events are as they
        were.  An undo call that raises or changes the pool is reported as
        a :class:`~kvcore.errors.PluginError` once all are undone."""
        journal = self.journal
        if journal is None:
            return
        # The undo calls run with a journal of their own: a pool change one
        # makes is caught and undone (see undo_all), and a step begun from
        # one is refused as nested.
        self.journal = []
        try:
            undo_all(self, journal)
        finally:
            self.journal = None
            del self._events[self._events_mark :]

    def record(self, undo: Callable[..., object], *args: Any) -> None:
        """Call ``undo(*args)`` if the open transaction rolls back (nothing
        outside a transaction): for state kept beside the pool that a step
        changes.  Records run newest first."""
        journal = self.journal
        if journal is not None:
            journal.append((UNDO_CALL, undo, args))

    # -- allocation ---------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[BlockId]:
        """Hand out ``num_blocks`` free blocks with reference count 1.

        Blocks come from the front of the free queue; any prefix-cache key they
        still hold is evicted.  Spare blocks (see :class:`FreeBlockQueue`)
        go after the blocks without a key at the queue's front and before its keyed
        ones; held-back blocks go last.  Raises :class:`NoFreeBlocksError`,
        changing nothing, when fewer blocks are free.
        """
        queue = self.free_queue
        if num_blocks > queue.num_free or num_blocks < 0:
            raise self._no_free_blocks(num_blocks)
        blocks: list[BlockId] = []
        if not num_blocks:
            return blocks
        journal = self.journal
        if journal is not None:
            # The hand-out's undo goes before the key drops' (a rollback
            # runs newest first); it is filled in once the blocks are known.
            mark = len(journal)
            journal.append(NOTHING)
        # The queue's blocks first, front first, then the held-back ones;
        # spare blocks after the blocks without a key at the queue's front.
        spare = queue.spare
        in_queue = queue.num_free - len(queue.held) - len(spare)
        from_queue = unkeyed = min(num_blocks, in_queue)
        num_spare = 0
        if spare:
            unkeyed = self._count_unkeyed(from_queue)
        if unkeyed < num_blocks and spare:
            num_spare = min(num_blocks - unkeyed, len(spare))
            rest = min(num_blocks - unkeyed - num_spare, in_queue - unkeyed)
            from_queue = unkeyed + rest
            if unkeyed:
                self._take(queue.head, unkeyed, blocks)
            self._take(queue.spare_head, num_spare, blocks)
            spare.difference_update(blocks[unkeyed:])
            if rest:
                self._take(queue.head, rest, blocks)
        else:
            self._take(queue.head, from_queue, blocks)
        taken = from_queue + num_spare
        if taken < num_blocks:
            self._take(queue.held_head, num_blocks - taken, blocks)
            queue.held.difference_update(blocks[taken:])
        queue.num_free -= num_blocks
        if journal is not None:
            journal[mark] = (UNGET, blocks[:], from_queue, unkeyed, num_spare)
        return blocks

    def _count_unkeyed(self, most: int) -> int:
        """How many of the queue's first ``most`` blocks hold no key (the
        blocks freed without one, queued at the front)."""
        next_links = self.free_queue.next
        key_hash = self.key_hash
        partial = self.partial_keys
        block = next_links[self.free_queue.head]
        count = 0
        while count < most and key_hash[block] is None and partial[block] is None:
            count += 1
            block = next_links[block]
        return count

    def eviction_order(self) -> list[BlockId]:
        """Every free block in the order hand-outs take them, front first:
        the blocks without a key at the queue's front, the spare blocks, the queue's
        others, the held-back blocks (O(n); for engines' views, tests and
        debugging)."""
        queue = self.free_queue
        listed = queue.get_all_free_blocks()
        num_queue = queue.num_free - len(queue.held) - len(queue.spare)
        if not queue.spare:
            return listed
        unkeyed = self._count_unkeyed(num_queue)
        num_spare = len(queue.spare)
        return (
            listed[:unkeyed]
            + listed[num_queue : num_queue + num_spare]
            + listed[unkeyed:num_queue]
            + listed[num_queue + num_spare :]
        )

    def _take(self, head: BlockId, count: int, out: list[BlockId]) -> None:
        """Hand out the ``count`` blocks linked after sentinel ``head`` (all
        of them there), appending them to ``out``: one walk that unlinks
        each, drops its keys and gives it one reference, then links
        ``head`` to the block after the last; the keys go after the walk,
        in one eviction."""
        queue = self.free_queue
        prev_links = queue.prev
        next_links = queue.next
        ref = self.ref_cnt
        key_hash = self.key_hash
        partial = self.partial_keys
        append = out.append
        keyed: list[BlockId] = []
        block = next_links[head]
        for _ in range(count):
            append(block)
            nxt = next_links[block]
            prev_links[block] = next_links[block] = UNLINKED
            if key_hash[block] is not None or partial[block] is not None:
                keyed.append(block)
            ref[block] = 1
            block = nxt
        next_links[head] = block
        prev_links[block] = head
        if keyed:
            self._evict_n(keyed)
            for block in keyed:
                if partial[block] is not None:
                    self._drop_partial(block)

    def _no_free_blocks(self, num_blocks: int) -> KvcoreValueError:
        if num_blocks < 0:
            msg = f"cannot allocate {num_blocks} blocks; ask for 0 or more"
            return KvcoreValueError(msg)
        free = self.free_queue.num_free
        msg = (
            f"asked for {num_blocks} KV-cache blocks but only {free} of "
            f"{self.num_blocks - 1} are free; free or preempt requests first, or "
            "give the cache more blocks"
        )
        return NoFreeBlocksError(msg)

    def _evict_n(self, blocks: Sequence[BlockId]) -> None:
        """Drop the full key of each of ``blocks`` that holds one, in order:
        its group's cache entry and count, one ``BlockRemoved`` event per
        key, one journal record for all."""
        key_hash = self.key_hash
        key_group = self.key_group
        groups = self._cached
        counts = self._num_cached
        journal = self.journal
        saved: list[tuple[BlockId, BlockHash, int, Entry | None]] = []
        events = self._events if self.enable_kv_cache_events else None
        for block in blocks:
            key = key_hash[block]
            if key is None:
                continue
            gid = key_group[block]
            key_hash[block] = None
            cached = groups[gid]
            entry = cached.get(key)
            saved.append(
                (block, key, gid, dict(entry) if type(entry) is dict else entry)
            )
            if entry == block:
                del cached[key]
            else:
                remove_entry(cached, key, block)
            counts[gid] -= 1
            if events is not None:
                events.append(BlockRemoved((key,), gid, self.kv_events_medium))
        self.evictions += len(saved)
        if journal is not None and saved:
            journal.append((KEY, saved))

    def forget_key(self, block: BlockId) -> None:
        """Drop ``block``'s full key, leaving the block where it is (held or
        queued) and its partial keys (each names a prefix that ends inside
        it, keyed once computed): its last slots were never written.  Does
        nothing for a block without a full key."""
        self._evict_n((block,))

    def drop_from_cache(self, block: BlockId) -> None:
        """Forget ``block``'s prefix-cache key: content no later request is
        expected to read (a state a newer one replaced).  A free block then
        moves to the front of the free queue, so it is reused first; one in
        use stays with its holders.  Does nothing for the null block or a
        block without a key."""
        self.drop_from_cache_n((block,))

    def drop_from_cache_n(self, blocks: Sequence[BlockId]) -> None:
        """:meth:`drop_from_cache` of each of ``blocks`` in turn, as one
        eviction and one move: the free ones go to the queue's front, the
        last named first (a block named twice counts once).  A value that
        is not a block id of the pool is refused before anything changes."""
        if type(blocks) is not list and type(blocks) is not tuple:
            blocks = list(blocks)  # any iterable, walked twice
        check_ids("drop_from_cache", blocks, self.num_blocks)
        key_hash = self.key_hash
        dropped = [block for block in blocks if block and key_hash[block] is not None]
        if not dropped:
            return
        if len(dropped) > 1 and len(set(dropped)) < len(dropped):
            dropped = list(dict.fromkeys(dropped))
        ref = self.ref_cnt
        queue = self.free_queue
        free = [block for block in dropped if not ref[block]]
        for block in free:
            if queue.prev[block] == UNLINKED:
                queue.remove(block)  # raises: a free block not queued
        self._evict_n(dropped)
        if free:
            links = queue.unlink_n(free)
            if self.journal is not None:
                self.journal.append((MOVE, *links))
            queue.prepend_n(free[::-1])

    def touch(self, blocks: Iterable[BlockId]) -> None:
        """Take a reference on each block, reviving free ones (cache hits).

        The null block is skipped.  Every id is checked before anything
        changes.
        """
        if type(blocks) is not list and type(blocks) is not tuple:
            blocks = list(blocks)  # any iterable, walked once
        queue = self.free_queue
        prev_links = queue.prev
        ref = self.ref_cnt
        num_blocks = self.num_blocks
        revived: list[BlockId] = []
        for block in blocks:
            if type(block) is not int or not 0 <= block < num_blocks:
                check_ids("touch", (block,), num_blocks)  # raises, naming it
            if block and not ref[block]:
                if prev_links[block] == UNLINKED:
                    queue.remove(block)  # raises: free but not queued
                revived.append(block)
        unlinked: list[BlockId] = []
        if revived:
            if len(revived) > 1 and len(set(revived)) < len(revived):
                revived = list(dict.fromkeys(revived))
            unlinked = queue.unlink_n(revived)
        for block in blocks:
            if block:
                ref[block] += 1
        journal = self.journal
        if journal is not None:
            journal.append((TOUCH, tuple(blocks), unlinked))

    def free_blocks(self, ordered_blocks: Iterable[BlockId]) -> None:
        """Drop one reference on each block; blocks reaching 0 become free.

        Pass a request's blocks tail first, so its tail is evicted first (or
        its table as allocated to :meth:`free_table`).  Freed blocks with a
        prefix-cache key (full or partial) go to the back of the free queue
        (least recently used order, kept as given); with caching on, blocks
        without one go to the front, so they are reused before any cached
        block.  The null block is skipped.  Dropping a reference a block
        does not hold (a double free) raises :class:`InvalidRequestError`
        and changes nothing.
        """
        blocks: Sequence[BlockId] = (
            ordered_blocks
            if type(ordered_blocks) is list or type(ordered_blocks) is tuple
            else list(ordered_blocks)
        )
        self._release(blocks, table=False)

    def free_table(self, blocks: Sequence[BlockId]) -> None:
        """Free a request's table, given in allocation order, tail first:
        :meth:`free_blocks` of ``blocks[::-1]`` for a table that lists each
        block once (every table a manager keeps), without copying it
        reversed (``blocks`` itself is never changed).

        The table is walked front to back, one reference dropped per
        listing, and the blocks that reach 0 are queued in the reverse of
        the order they reached it; so a block listed twice is queued by its
        last listing, where ``free_blocks(blocks[::-1])`` would queue it by
        its first.
        """
        if type(blocks) is not list and type(blocks) is not tuple:
            blocks = list(blocks)  # any iterable, walked once
        self._release(blocks, table=True)

    def _release(self, blocks: Sequence[BlockId], *, table: bool) -> None:
        """Drop one reference per listing of ``blocks`` and queue the blocks
        that reach 0: keyed ones (full or partial key, or every block with
        caching off) at the back, the others at the front, in the order
        they reached 0 (``table``: its reverse).  A double free restores
        the counts dropped so far and raises, changing nothing.

        One walk: each block reaching 0 joins one of two chains, the front
        one or the back one, in its final place (``table``: each new block
        before the chain's first, else after its last), each chain ending
        on a scratch id of the queue; the chains are spliced in around
        the queued blocks at the end.  Blocks in use are never queued, so
        no link is checked."""
        queue = self.free_queue
        # A chain grows by linking each new block to the chain's end block:
        # ``table``: before it (the block's next, the end's prev); otherwise
        # after it (the block's prev, the end's next).
        if table:
            to_end, from_end = queue.next, queue.prev
        else:
            to_end, from_end = queue.prev, queue.next
        ref = self.ref_cnt
        key_hash = self.key_hash
        partial = self.partial_keys
        front_ok = self.enable_caching
        # table: the chains' first blocks (they grow at the front);
        # otherwise their last (they grow at the back).
        front = queue.front
        back = queue.back
        not_freed = 0  # listings whose block stays held, or the null block
        it = iter(blocks)
        for block in it:
            cnt = ref[block]
            if cnt == 1:
                ref[block] = 0
                if front_ok and key_hash[block] is None and partial[block] is None:
                    to_end[block] = front
                    from_end[front] = block
                    front = block
                else:
                    to_end[block] = back
                    from_end[back] = block
                    back = block
            elif cnt > 1:
                ref[block] = cnt - 1
                not_freed += 1
            elif block:
                self._restore_release(blocks[: len(blocks) - len(list(it)) - 1])
                raise double_free(block)
            else:
                not_freed += 1
        freed = len(blocks) - not_freed
        if freed:
            queue.splice_chains(front, back, table, freed)
        journal = self.journal
        if journal is not None:
            journal.append((RELEASE, tuple(blocks)))

    def _restore_release(self, blocks: Sequence[BlockId]) -> None:
        """Undo a release's count drops on ``blocks`` (all it walked before a
        double free): each gets its reference back and leaves the chains."""
        queue = self.free_queue
        queue.drop_chains()
        prev_links = queue.prev
        next_links = queue.next
        ref = self.ref_cnt
        for block in blocks:
            if block:
                if ref[block] == 0:
                    prev_links[block] = next_links[block] = UNLINKED
                ref[block] += 1

    # -- prefix cache ---------------------------------------------------------

    def cached_blocks_of(self, group_id: int) -> dict[BlockHash, Entry]:
        """The live prefix cache of one group, for hit searches to read
        (never change it): block hash -> the block id holding it, or
        ``{block id: None}`` (in key order) when several do."""
        group = self._cached.get(group_id)
        if group is None:
            group = self._cached[group_id] = {}
            self._num_cached[group_id] = 0
        return group

    def lookup(self, block_hash: BlockHash, group_id: int) -> BlockId | None:
        """The cached block of one group for ``block_hash``, or None."""
        hit = one_per_group(self._cached, block_hash, (group_id,))
        return None if hit is None else hit[0]

    def get_cached_block(
        self, block_hash: BlockHash, group_ids: Sequence[int]
    ) -> list[BlockId] | None:
        """One cached block per group for ``block_hash``, or None if any misses."""
        return one_per_group(self._cached, block_hash, group_ids)

    def cache_full_blocks(
        self,
        *,
        block_hashes: Sequence[BlockHash],
        blocks: Sequence[BlockId],
        num_cached_blocks: int,
        num_full_blocks: int,
        group_id: int,
        token_ids: Sequence[int] | None = None,
    ) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` in the cache.

        ``block_hashes`` are already at this group's block size (see
        :func:`~kvcore.coordinator.hashing.hashes_at_block_size`); block ``i``
        gets key ``(block_hashes[i], group_id)``.  Null blocks and blocks that
        already hold a key are skipped.  Does nothing when caching is off.

        ``token_ids`` are the request's tokens; with events on they are
        required (a :class:`BlockStored` carries the stored blocks' tokens)
        and sliced only then, so callers pass them always at no cost.
        """
        check_store(
            num_cached_blocks, num_full_blocks, len(blocks), len(block_hashes), group_id
        )
        if not self.enable_caching or num_cached_blocks == num_full_blocks:
            return
        span = range(num_cached_blocks, num_full_blocks)
        key_hash = self.key_hash
        #: Table positions that may be stored (only with events on): the
        #: blocks not yet keyed.
        unkeyed: list[int] | None = None
        if self.enable_kv_cache_events:
            check_event_inputs(self._event_groups, group_id, token_ids, num_full_blocks)
            unkeyed = [
                pos for pos in span if blocks[pos] and key_hash[blocks[pos]] is None
            ]
        key_spans(self, (blocks,), (group_id,), block_hashes, span)
        if unkeyed:
            # A position is stored if its block took that position's hash (a
            # block listed twice is keyed by its first listing only).
            stored = [
                pos for pos in unkeyed if key_hash[blocks[pos]] is block_hashes[pos]
            ]
            assert token_ids is not None  # checked by check_event_inputs
            self._events += stored_events(
                self._event_groups[group_id],
                group_id,
                block_hashes,
                blocks,
                token_ids,
                stored,
                self.kv_events_medium,
            )

    # -- partial keys (copy-on-write hit sources) --------------------------------

    def add_partial_key(
        self, block: BlockId, block_hash: BlockHash, group_id: int
    ) -> None:
        """:meth:`add_partial_keys` of one key."""
        self.add_partial_keys(block, (block_hash,), group_id)

    def add_partial_keys(
        self, block: BlockId, block_hashes: Sequence[BlockHash], group_id: int
    ) -> None:
        """Register ``block`` of group ``group_id`` under each of
        ``block_hashes``, chunk hashes of prefixes that end inside the
        block: a later request with such a prefix may copy the block's
        first slots (a copy-on-write partial hit).  A block may carry
        several partial keys and its full key; they are dropped together
        when the pool hands the block out again or the cache is reset.
        Does nothing when caching is off, for the null block or for no
        hashes; a key the block holds already is passed over.  Raises no
        event."""
        if not self.enable_caching or not block or not block_hashes:
            return
        keys = self.partial_keys[block]
        if keys is None:
            keys = self.partial_keys[block] = []
            self.partial_group[block] = group_id
        elif self.partial_group[block] != group_id:
            msg = (
                f"add_partial_key: block {block} holds partial keys of "
                f"group {self.partial_group[block]}, not {group_id}; a block "
                "belongs to one group's table at a time"
            )
            raise InvalidRequestError(msg)
        group = self._partial.get(group_id)
        if group is None:
            group = self._partial[group_id] = {}
        journal = self.journal
        for block_hash in block_hashes:
            if block_hash in keys:
                continue
            keys.append(block_hash)
            insert_entry(group, block_hash, block)
            if journal is not None:
                journal.append((PARTIAL, group, block_hash, block))

    def _drop_partial(self, block: BlockId) -> None:
        keys = self.partial_keys[block]
        assert keys is not None  # callers check the block holds some
        self.partial_keys[block] = None
        gid = self.partial_group.pop(block)
        self.evictions += 1
        group = self._partial[gid]
        journal = self.journal
        if journal is not None:
            # Each key's entry as it is, so a rollback puts the blocks
            # sharing it back in their order (a lookup takes the first).
            entries = [group.get(key) for key in keys]
            saved = [dict(e) if type(e) is dict else e for e in entries]
            journal.append((UNPARTIAL, group, keys, block, gid, saved))
        for key in keys:
            remove_entry(group, key, block)

    def lookup_partial(
        self, block_hash: BlockHash, group_ids: Sequence[int]
    ) -> list[BlockId] | None:
        """One block per group holding the partial key ``block_hash``, or
        None if any group has none."""
        return one_per_group(self._partial, block_hash, group_ids)

    def has_partial_key(
        self, block: BlockId, block_hash: BlockHash, group_id: int
    ) -> bool:
        """Whether ``block`` holds the partial key ``block_hash`` of group
        ``group_id``."""
        keys = self.partial_keys[block]
        return (
            keys is not None
            and self.partial_group[block] == group_id
            and block_hash in keys
        )

    @property
    def num_partial_keys(self) -> int:
        """Partial keys held, over all blocks (O(n))."""
        return sum(num_entries(group) for group in self._partial.values())

    def record_undo(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` if the open transaction rolls back (nothing outside
        a transaction): for state kept beside the pool that a step changes."""
        journal = self.journal
        if journal is not None:
            journal.append((UNDO_CALL, undo, ()))

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a full prefix-cache key, in use or free (O(groups));
        partial keys are counted by :attr:`num_partial_keys`."""
        return sum(self._num_cached.values())

    def num_cached_blocks_of(self, group_id: int) -> int:
        """Blocks holding a full prefix-cache key of one group (O(1): a count
        kept as keys are given and dropped)."""
        return self._num_cached.get(group_id, 0)

    def reset_prefix_cache(self) -> bool:
        """Forget every prefix-cache key.

        Only allowed while no block other than the null block is in use; returns
        False, changing nothing, otherwise.  Refused inside a step (a cache
        manager calling back, see :meth:`begin`).
        """
        if self.journal is not None:
            msg = (
                "reset_prefix_cache was called from inside a step (by a cache "
                "manager calling back into the KVCacheManager); managers must not "
                "call the KVCacheManager, the outer step is undone"
            )
            raise ReentrantCallError(msg)
        if self.num_blocks - self.free_queue.num_free != 1:
            return False
        for group in self._cached.values():
            group.clear()
        for gid in self._num_cached:
            self._num_cached[gid] = 0
        for group in self._partial.values():
            group.clear()
        self.evictions += 1
        n = self.num_blocks
        self.key_hash[:] = [None] * n
        self.partial_keys[:] = [None] * n
        self.partial_group.clear()
        # No request runs, so no hit is worth holding back: the held-back
        # blocks join the queue's back, in the order they had; no block
        # holds a key, so the spare ones join its front.
        self.free_queue.release_held()
        self.free_queue.release_spare()
        if self.enable_kv_cache_events:
            self._events.append(AllBlocksCleared(self.kv_events_medium))
        return True

    # -- accounting -----------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Blocks that can be handed out (the null block never counts)."""
        return self.free_queue.num_free

    def get_usage(self) -> float:
        """Fraction of usable blocks in use, in [0, 1]."""
        usable = self.num_blocks - 1
        if usable == 0:
            return 0.0
        return 1.0 - self.free_queue.num_free / usable

    def take_events(self) -> list[KVCacheEvent]:
        """Return and clear the events recorded since the last call.
        Refused inside a step or a query (a cache manager taking them): the
        events are the engine's, and a rollback could not put them back."""
        if self.journal is not None:
            msg = (
                "take_events was called from inside a step or a query (by a "
                "cache manager); managers must not take the block pool's "
                "events, which the engine takes between steps"
            )
            raise ReentrantCallError(msg)
        events = self._events
        if not events:
            return []
        self._events = []
        return events
