"""The manager contract: the block tables of one cache group.

The coordinator runs one manager per cache group.  Each cache kind's plugin
contributes its manager class (``CacheKind.manager_type``), normally one of
the generic strategies in :mod:`kvcore.coordinator.managers` configured for
the kind.  This module holds what every manager shares: the base class, the
:class:`HitQuery` a hit search receives.

Everything here is on the scheduler's per-step path: no hook calls, no
per-block allocations beyond the block lists themselves."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar

import attrs

from kvcore.checkpoints import GRID_POOL_SHARE
from kvcore.coordinator.block_pool import BlockPool
from kvcore.coordinator.hashing import BlockHash, hashes_at_block_size, prefix_key
from kvcore.coordinator.hold_back import hold_back_twins
from kvcore.coordinator.plugin_results import answered_only, skip_error
from kvcore.coordinator.pool_journal import UNDO_CALL
from kvcore.coordinator.request import Request
from kvcore.coordinator.twin_steps import PROMISES, TWIN_STEPS
from kvcore.coordinator.undo import (
    put_at_each,
    put_back,
    put_back_each,
    put_entries,
    put_entry,
)
from kvcore.spec import HitPolicy

__all__ = ["HitQuery", "SingleTypeManager"]


@attrs.define(kw_only=True)
class HitQuery:
    """One hit search of one spec group (every field by keyword, so the
    query can grow without breaking a manager that reads only some).  A
    fresh query is built for every search; read it, do not keep it.

    :param spec: the groups' merged spec.
    :param block_hashes: the request's chained hashes at the group's block
        size (block ``i`` is named by the hash of the prefix ending with it);
        empty when the block is finer than the hash block, see ``chunk_hashes``.
    :param chunk_hashes: the request's hashes at ``hash_block_size`` tokens.
    :param hash_block_size: tokens per hashed chunk.
    :param max_length: the hit may cover at most this many tokens.
    :param group_ids: the groups searched together; the result holds one
        block list per id, in this order.
    :param block_pool: the pool whose cache is searched.
    :param block_size: tokens per block of these groups.
    :param alignment: the hit's length must be a multiple of this.
    """

    spec: Any
    block_hashes: Sequence[BlockHash]
    chunk_hashes: Sequence[BlockHash]
    hash_block_size: int
    max_length: int
    group_ids: Sequence[int]
    block_pool: BlockPool
    block_size: int
    alignment: int

    @property
    def max_blocks(self) -> int:
        """Blocks the hit may span: bounded by ``max_length`` and the hashes."""
        return min(self.max_length // self.block_size, len(self.block_hashes))


class SingleTypeManager:
    """Block tables of one cache group: the base every manager extends.

    It keeps a block per ``block_size`` tokens, indexed by position, hashes
    full blocks left to right when the group caches, and releases the
    leading positions :meth:`num_skipped_blocks` names when
    :attr:`skips_blocks` is set.  Subclasses say which hit policies they
    serve (:attr:`hit_policies`) and implement the search for them
    (:meth:`find_longest_cache_hit`).

    :param spec: the group's merged spec (``KVCacheGroupSpec.manager_spec``).
    :param block_pool: the pool every group draws from.
    :param group_id: this group's index in the plan.
    :param block_size: tokens per block (the spec's, times context parallelism
        where it applies).
    :param hash_block_size: tokens per hashed chunk.
    :param enable_caching: whether prefix caching is on for the engine.
    :param max_model_len: the longest request, in tokens.
    :param hit_alignment: hits this group takes part in are multiples of this
        many tokens (the coordinator's hit alignment; the block size when
        hits may end on any block, as with EAGLE).
    """

    #: The hit policies (``spec.hit_policy``) this manager serves; the
    #: coordinator refuses a kind whose spec declares another.
    hit_policies: ClassVar[frozenset[HitPolicy]] = frozenset({HitPolicy.NOT_HASHED})
    #: Whether the manager may free blocks a request no longer reads.
    skips_blocks: ClassVar[bool] = False
    #: Whether every block a running request releases stays a hit point (a
    #: state group keeping every step end): it picks none to hold back.
    keeps_releases = False
    #: Whether block lists are indexed by token position (``len * block_size``
    #: covers the request).  False for fixed per-request blocks.
    position_indexed: ClassVar[bool] = True
    #: Whether the table may grow for speculative lookahead tokens.
    supports_lookahead: ClassVar[bool] = True
    #: Whether the manager caches a group whose block is finer than the hash
    #: block (keying only blocks that end on a hash boundary, through
    #: :meth:`block_hash`); others need a multiple of the hash block.
    accepts_coarse_hashes: ClassVar[bool] = False
    #: Whether :meth:`plan_checkpoints` runs at each admission.
    plans_checkpoints: ClassVar[bool] = False
    #: Whether this group comes last in the free order: a freed request's
    #: blocks of it go behind the other groups' the same shortest hit reads
    #: (:meth:`shortest_hit_reading`), or all of theirs beside groups that do
    #: not cache (a state a hit needs, worth more than one block elsewhere).
    evicts_last: ClassVar[bool] = False
    #: Whether the manager's tables take copy-on-write partial hits (see
    #: :mod:`kvcore.coordinator.partial`): position-indexed, every block kept,
    #: a hit block at each position read from the left, when its spec also
    #: declares ``copies_partial_block_hits``.  The partial search extends
    #: PrefixManager's: a subclass replacing ``find_longest_cache_hit``
    #: sets it False.
    partial_copy_hits: ClassVar[bool] = False
    #: Whether the manager keeps per-request state beyond the table, the
    #: hashed and the released count (it extends :meth:`request_state` and
    #: :meth:`restore_request_state`, and calls :meth:`record_request_state`
    #: before changing it): a step records it on its first change.
    keeps_request_state: ClassVar[bool] = False
    #: Whether the group's tables are sized by the request's encoder tokens
    #: (``num_encoder_tokens`` of ``allocate_slots``, passed at admission as
    #: ``num_tokens``) instead of its decoder tokens: encoder cross-attention.
    #: Such a manager is not :attr:`position_indexed`, so a running request
    #: never grows its table.
    takes_encoder_tokens: ClassVar[bool] = False
    #: Whether :meth:`cache_blocks` keys only what the hash chunks ending
    #: within ``num_tokens`` decide: after a call at ``n`` tokens, a call at
    #: ``n' >= n`` with no chunk end in ``(n, n']`` keys and changes nothing
    #: while no other call changes the request's table or this manager's
    #: state for it.  The coordinator then passes over such calls (see
    #: :mod:`kvcore.coordinator.cache_spans`).  A subclass that overrides
    #: :meth:`cache_blocks` or :meth:`cache_twins` makes no such promise
    #: unless it sets this flag in its own body.
    caches_at_chunk_ends: ClassVar[bool] = True
    #: Whether a hit's last block is read before the step that admits it
    #: writes anything (a recurrent state the resuming scan starts from),
    #: so a block keyed by a step whose forward has not run cannot end a
    #: hit yet (see :mod:`kvcore.coordinator.unwritten`).  Attention blocks
    #: keyed in the same step can: each layer writes before it attends.
    reads_hit_before_step: ClassVar[bool] = False
    #: Whether :meth:`allocate_twins` adds and changes nothing for a request
    #: that holds a table when :meth:`get_num_blocks_to_allocate` counts 0
    #: blocks for it (no hit attached): the coordinator then passes over a
    #: running request's step that no class grows, releases or keys in.  A
    #: subclass that overrides :meth:`get_num_blocks_to_allocate`,
    #: :meth:`allocate_new_blocks` or :meth:`allocate_twins` makes no such
    #: promise unless it sets this flag in its own body.
    grows_by_count: ClassVar[bool] = True
    #: Whether :meth:`release_twins` releases and changes nothing for a
    #: request when :meth:`releases_nothing` says so: the coordinator then
    #: passes over a running request's step that no class grows, releases
    #: or keys in.  A subclass that overrides :meth:`remove_skipped_blocks`
    #: or :meth:`release_twins` makes no such promise unless it sets this
    #: flag in its own body.
    releases_by_count: ClassVar[bool] = True
    #: Blocks a running request's step takes each time its table crosses a
    #: block boundary and gives back only after the step: a recurrent
    #: state reads its old block while it writes the new one.  An admission
    #: leaves free what the running requests take at their busiest coming
    #: boundary (see :mod:`kvcore.coordinator.headroom`).  A non-negative int.
    boundary_overlap: int = 0

    def __init__(
        self,
        spec: Any,
        block_pool: BlockPool,
        *,
        group_id: int,
        block_size: int,
        hash_block_size: int,
        enable_caching: bool,
        max_model_len: int,
        hit_alignment: int | None = None,
    ) -> None:
        self.kv_cache_spec = spec
        self.block_pool = block_pool
        self.kv_cache_group_id = group_id
        self.block_size = block_size
        self.hash_block_size = hash_block_size
        self.max_model_len = max_model_len
        self.hit_alignment = block_size if hit_alignment is None else hit_alignment
        #: Set by the coordinator: every hit drops its last block for a
        #: draft model (EAGLE), so a state kind also keeps states a block
        #: before where its hits would otherwise end.
        self.use_eagle = False
        #: Whether this group's blocks are hashed and looked up.
        self.caching = bool(enable_caching) and spec.hit_policy.hashes_blocks
        #: Set by the coordinator when the group releases blocks while a
        #: request runs and another group keeps the request's whole prefix:
        #: one that picks which to keep (not :attr:`keeps_releases`) holds
        #: back those :meth:`kept_for_later` names, the rest spare; one that
        #: keeps all rejoins its keyed ones to the table when it is freed.
        self.holds_back = self.rejoins_releases = False
        #: Set by the coordinator on planning groups (see grid_point_blocks).
        self.grid_point_cost = 0
        self.grid_share = 0.0
        self.grid_prefix_blocks = 0.0
        self.null_block = block_pool.null_block
        #: request id -> the request's block ids (the null block, 0, where
        #: skipped).
        self.req_to_blocks: dict[str, list[int]] = {}
        #: request id -> how many of its blocks are already hashed.
        self.num_cached_block: dict[str, int] = {}
        #: request id -> table positions below this hold the null block
        #: (released or never taken), but for those in :attr:`pinned`; kept
        #: only when the manager skips.
        self.num_released: dict[str, int] = {}
        #: request id -> positions below the release line the request keeps
        #: holding while it runs (a state kind's hit state and branch point,
        #: see CheckpointManager; a window's at its hit points, see
        #: WindowManager): skipping passes over them.
        self.pinned: dict[str, list[int]] = {}
        #: request id -> (table position, block, its key) of the blocks the
        #: running request released and held back (see
        #: :meth:`remove_skipped_blocks`), for :meth:`take_held_back`.
        self.held_back: dict[str, list[tuple[int, int, Any]]] = {}
        #: The transaction and the requests it recorded, each with whether
        #: their whole table was (see :meth:`record_request_state`).
        self._recorded: tuple[int, dict[str, bool]] = (-1, {})
        #: The transaction, request and twins of this manager's last
        #: :meth:`record_twins` (a repeat within the step records nothing).
        self._twins_recorded: tuple[int, str, Any] = (-1, "", None)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A class's twin steps, chosen once when it is defined: its own
        :meth:`allocate_twins`, :meth:`release_twins`, :meth:`cache_twins`,
        :meth:`kept_twins` and :meth:`kept_if_room_twins` where it defines
        them; where it overrides only the one-group step
        (:meth:`allocate_new_blocks`, :meth:`remove_skipped_blocks`,
        :meth:`cache_blocks`, :meth:`kept_for_later`, :meth:`kept_if_room`),
        its twins are stepped group by group through that override.  The
        one-group step reached by ``super()`` runs the class's twin step over
        the group alone, but where an ancestor overrides the one-group step:
        that ancestor's twins step through it, a subclass's twin step
        reaches it by ``super()``, and the base class's twin step runs.
        A promise flag (:attr:`caches_at_chunk_ends`, :attr:`grows_by_count`,
        :attr:`releases_by_count`) is dropped
        where the class overrides a method it covers and sets no flag."""
        super().__init_subclass__(**kwargs)
        own = vars(cls)
        for flag, overrides in PROMISES:
            if flag not in own and any(name in own for name in overrides):
                setattr(cls, flag, False)
        for single, twins, each in TWIN_STEPS:
            if twins in own:
                if not _ancestor_steps_alone(cls, single):
                    setattr(cls, f"_own_{twins}", own[twins])
            elif single in own:
                setattr(cls, twins, each)

    # -- the release rule -----------------------------------------------------

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading table positions a request with ``num_computed_tokens``
        computed tokens never reads again: an int from 0 to
        ``num_computed_tokens // block_size`` (checked).  The one release
        rule, applied everywhere: at admission those positions get the null
        block (hit blocks there are not taken, none is allocated for them),
        and before every later step the blocks still held there go back to
        the pool.  Consulted only when :attr:`skips_blocks` is set.
        Default: the spec's ``skipped_tokens`` in whole blocks, which agrees
        with the default ``num_blocks_held``."""
        skipped: int = self.kv_cache_spec.skipped_tokens(num_computed_tokens)
        return skipped // self.block_size

    def _skip(self, num_computed_tokens: int) -> int:
        if not self.skips_blocks or num_computed_tokens <= 0:
            return 0
        n = self.num_skipped_blocks(num_computed_tokens)
        if type(n) is int and 0 <= n * self.block_size <= num_computed_tokens:
            return n
        raise skip_error(self, num_computed_tokens, n)

    def releases_nothing(self, request_id: str, num_computed_tokens: int) -> bool:
        """Whether releasing at ``num_computed_tokens`` would leave the
        request's table as it is: no position past those already released
        (or never taken) is skipped yet.  The test :meth:`release_twins`
        makes first; consulted only where :attr:`releases_by_count` is
        set."""
        return self._release_line(request_id, num_computed_tokens) < 0

    def _release_line(self, request_id: str, num_computed_tokens: int) -> int:
        """The table position below which releasing at
        ``num_computed_tokens`` leaves the null block, or -1 when that
        releases nothing new."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return -1
        last = min(self._skip(num_computed_tokens), len(blocks))
        return last if last > self.num_released.get(request_id, 0) else -1

    # -- checkpoints ----------------------------------------------------------

    def plan_checkpoints(self, request: Request, num_computed_tokens: int) -> None:
        """At admission (with :attr:`plans_checkpoints` set): choose the
        positions of the request's coming steps to keep; nothing by
        default."""

    def forget_checkpoints(self, request_id: str) -> None:
        """Undo :meth:`plan_checkpoints` for a request whose admission was
        refused; nothing by default."""

    def shed_checkpoints(self, request_id: str) -> Any:
        """Give up the request's optional checkpoints, for a step that does
        not fit with them: what :meth:`restore_checkpoints` needs to undo
        it, or None when there is nothing to give up.  By default its
        :attr:`pinned` blocks, which are then released like the blocks
        around them (the release scan starts again at the lowest)."""
        pins = self.pinned.get(request_id)
        if not pins:
            return None
        # Journaled: the coordinator sheds inside a transaction, so a
        # plugin that raises after this call leaves the pins in place.
        self.record_request_state(request_id)
        self.block_pool.record(put_entry, self.pinned, request_id, pins)
        del self.pinned[request_id]
        released = self.num_released.get(request_id)
        if released is not None:
            # Pins are a kind's answer: a position below 0 is none.
            self.num_released[request_id] = max(0, min(released, *pins))
        return pins, released

    def restore_checkpoints(self, request_id: str, state: Any) -> None:
        """Undo :meth:`shed_checkpoints`."""
        pins, released = state
        self.pinned[request_id] = pins
        put_entry(self.num_released, request_id, released)

    def kept_for_later(
        self,
        request_id: str,
        positions: Sequence[int],
        released: Sequence[int],
    ) -> list[int]:
        """Of the blocks a running request just released (skipped) from
        table ``positions``, those it keeps for later requests' hits: they
        are held back, evicted only after every other free block, until
        the request is freed (:meth:`kept_twins` over this group alone).
        None by default."""
        kept = type(self)._own_kept_twins(
            self, (self,), request_id, positions, [released]
        )
        return kept[0]

    def kept_twins(
        self,
        twins: Sequence[SingleTypeManager],
        request_id: str,
        positions: Sequence[int],
        removed: Sequence[Sequence[int]],
    ) -> list[list[int]]:
        """:meth:`kept_for_later` in each of ``twins`` (this manager first;
        see :meth:`allocate_twins`), which released ``removed`` (one list
        per twin) from table ``positions``: one list per twin.  A subclass
        that changes what is kept overrides this method."""
        return [[] for _ in twins]

    _own_kept_twins = kept_twins

    def kept_if_room(
        self,
        request_id: str,
        positions: Sequence[int],
        released: Sequence[int],
    ) -> list[int]:
        """Like :meth:`kept_for_later` (and never naming a block it names),
        the released blocks kept for hits that are less likely (a grid of
        points where a later request may branch): held back in front of
        the others, so they are evicted before any block
        :meth:`kept_for_later` names, and after every other free block
        (:meth:`kept_if_room_twins` over this group alone).  None by
        default."""
        spare = type(self)._own_kept_if_room_twins(
            self, (self,), request_id, positions, [released]
        )
        return spare[0]

    def kept_if_room_twins(
        self,
        twins: Sequence[SingleTypeManager],
        request_id: str,
        positions: Sequence[int],
        removed: Sequence[Sequence[int]],
    ) -> list[list[int]]:
        """:meth:`kept_if_room` in each of ``twins``, as :meth:`kept_twins`
        is :meth:`kept_for_later`'s: one list per twin.  A subclass that
        changes what is kept if room overrides this method."""
        return [[] for _ in twins]

    _own_kept_if_room_twins = kept_if_room_twins

    def take_held_back(self, request_id: str) -> list[tuple[int, int]]:
        """When the request is freed: ``(table position, block)`` of the
        blocks it held back (or released, see ``rejoins_releases``) that sit
        free still keyed as released; the coordinator puts them back in the
        eviction order beside the request's other blocks at their positions."""
        held = self.held_back.pop(request_id, None)
        if not held:
            return []
        pool = self.block_pool
        pool.record(self.held_back.__setitem__, request_id, held)
        ref, key_hash = pool.ref_cnt, pool.key_hash
        return [
            (pos, block)
            for pos, block, key in held
            if ref[block] == 0 and key_hash[block] is key
        ]

    #: The per-request dicts (attribute names) a free reads after the
    #: request's tables are popped (by :meth:`take_held_back` and
    #: :meth:`take_released_checkpoints`); a subclass keeping more there
    #: lists its own.
    kept_past_pop: ClassVar[tuple[str, ...]] = ("held_back",)

    def park_freed(self, request_id: str, popped_id: str) -> None:
        """A deferred free (the coordinator's ``pop_for_free``): file the
        request's entries of :attr:`kept_past_pop` under ``popped_id``,
        which its release passes to :meth:`take_held_back` and
        :meth:`take_released_checkpoints` in the request id's place."""
        for name in self.kept_past_pop:
            store = getattr(self, name)
            value = store.pop(request_id, None)
            if value is not None:
                store[popped_id] = value
                undo = [(store, popped_id, None), (store, request_id, value)]
                self.block_pool.record(put_entries, undo)

    def take_released_checkpoints(self, request_id: str) -> list[int]:
        """After the request is freed: blocks it kept for later requests
        that were released earlier and sit free; the coordinator moves them
        to the back of the eviction order.  None by default."""
        return []

    def grid_point_blocks(self) -> int:
        """With :attr:`plans_checkpoints`: the blocks a running request keeps
        here at each point of its grid (0: no grid).  The coordinator sums
        every planning group's into :attr:`grid_point_cost`, by which each
        keeps a request's grid to :meth:`grid_pool_share` of the pool."""
        return 0

    def grid_pool_share(self) -> float:
        """With :attr:`plans_checkpoints`: the share of the pool (0 to 1; 0:
        no limit) one request's grid may take, kept as :attr:`grid_share`:
        its interval doubles until it fits (kvcore.checkpoints.grid_interval)."""
        return GRID_POOL_SHARE

    def shortest_hit_reading(self, position: int) -> int:
        """The fewest tokens a hit must cover to read the block at table
        ``position``.  A freed request's blocks of every group are queued
        for eviction by it, the highest first (see
        :mod:`kvcore.coordinator.free_order`), so eviction takes its hit
        points whole from the tail.  Asked once per position, the answer
        kept for the coordinator's life: it depends on the position alone.
        Default: every hit past the block's
        first token reads it (``position * block_size + 1``); a block of a
        table not indexed by position, every hit (1)."""
        if not self.position_indexed:
            return 1
        return position * self.block_size + 1

    # -- allocation -----------------------------------------------------------

    def admission_blocks(
        self, hit: Sequence[int], num_computed_tokens: int
    ) -> list[int]:
        """What a new request attaches at admission with ``num_computed_tokens``
        computed (its hit included): the hit with the null block at every
        position the kind skips, padded with the null block up to the first
        position it reads.  No block is taken or allocated for a skipped
        position, so a group without a hit (a bounded-replay window or a
        chunked-local group beside a prefix-cached one) asks only for the
        blocks the step reads or writes."""
        skip = self._skip(num_computed_tokens)
        if skip <= 0:
            return hit if type(hit) is list else list(hit)
        null = self.null_block
        out = [null if i < skip else block for i, block in enumerate(hit)]
        if len(out) < skip:
            out.extend([null] * (skip - len(out)))
        return out

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[int],
    ) -> int:
        """Free blocks this group needs so the request covers ``num_tokens``:
        new blocks plus hit blocks that must leave the free queue (null
        blocks stand for skipped positions and take nothing)."""
        held = self.req_to_blocks.get(request_id)
        need = -(-num_tokens // self.block_size)
        if held is not None:
            need -= len(held)
        if not new_computed_blocks:
            return need if need > 0 else 0
        need -= len(new_computed_blocks)
        if need < 0:
            need = 0
        ref = self.block_pool.ref_cnt
        for block in new_computed_blocks:
            if block and ref[block] == 0:
                need += 1
        return need

    def add_computed_blocks(self, request_id: str, blocks: Sequence[int]) -> None:
        """Attach admission blocks (see :meth:`admission_blocks`) to a
        request, taking a reference on each that is not the null block."""
        if not blocks:
            return
        self.record_request_state(request_id)
        self.block_pool.touch(blocks)
        held = self.req_to_blocks.get(request_id)
        if held is None:
            held = self.req_to_blocks[request_id] = list(blocks)
            if self.skips_blocks:
                # Leading null blocks are positions already skipped.
                lead = 0
                for block in held:
                    if block:
                        break
                    lead += 1
                self.num_released[request_id] = lead
        else:
            held.extend(blocks)
        self.num_cached_block[request_id] = len(held)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's table to cover ``num_tokens``; return new blocks
        (:meth:`allocate_twins` over this group alone)."""
        new = type(self)._own_allocate_twins(self, (self,), request_id, num_tokens)
        return [] if new is None else new[0]

    def allocate_twins(
        self, twins: Sequence[SingleTypeManager], request_id: str, num_tokens: int
    ) -> list[list[int]] | None:
        """Grow the request's table in each of ``twins`` (this manager first,
        then the other groups of its class: one manager class, spec, block
        size, caching and hit alignment, so their tables have one shape) to
        cover ``num_tokens``:
        each twin's new blocks, in order.  One decision for the class and
        one hand-out from the pool, split in group order (the blocks each
        twin would take growing alone, one after the other); None when no
        twin takes a block.  A subclass
        that changes how a table grows overrides this method; the
        coordinator calls it once per run of consecutive twins, to admit a
        request (its hit attached first) and to grow a running one."""
        held = self.req_to_blocks.get(request_id)
        need = -(-num_tokens // self.block_size) - (0 if held is None else len(held))
        if need <= 0:
            if held is None:
                self.record_twins(twins, request_id)
                for twin in twins:
                    twin.req_to_blocks[request_id] = []
            return None
        self.record_twins(twins, request_id)
        new = self.block_pool.get_new_blocks(need * len(twins))
        if len(twins) == 1:
            out = [new]
        else:
            out = [new[i : i + need] for i in range(0, len(new), need)]
        for twin, blocks in zip(twins, out, strict=True):
            table = twin.req_to_blocks.get(request_id)
            if table is None:
                twin.req_to_blocks[request_id] = blocks[:]
            else:
                table.extend(blocks)
        return out

    #: The twin step the one-group step runs (see __init_subclass__).
    _own_allocate_twins = allocate_twins

    def block_hash(
        self, chunk_hashes: Sequence[BlockHash], index: int
    ) -> BlockHash | None:
        """The cache key of table position ``index``: the hash of the prefix
        ending with that block, or None when that prefix does not end on a
        hash boundary (or is not hashed yet)."""
        return prefix_key(
            chunk_hashes, (index + 1) * self.block_size, self.hash_block_size
        )

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Hash the request's blocks that ``num_tokens`` tokens fill
        (:meth:`cache_twins` over this group alone)."""
        type(self)._own_cache_twins(self, (self,), request, num_tokens)

    def cache_twins(
        self, twins: Sequence[SingleTypeManager], request: Request, num_tokens: int
    ) -> None:
        """:meth:`cache_blocks` in each of ``twins`` (this manager first; see
        :meth:`allocate_twins`): which blocks are hashed is decided once for
        the class, and each twin's are keyed under its own group.  A
        subclass that changes what is cached overrides this method."""
        if not self.caching:
            return
        rid = request.request_id
        num_full = num_tokens // self.block_size
        cached = self.num_cached_block.get(rid, 0)
        if num_full <= cached:
            return
        blocks = self.req_to_blocks[rid]
        hashes = hashes_at_block_size(
            request.block_hashes, self.hash_block_size, self.block_size
        )
        num_full = min(num_full, len(hashes), len(blocks))
        if num_full <= cached:
            return
        self.record_twins(twins, rid)
        self.block_pool.cache_twin_blocks(
            block_hashes=hashes,
            tables=[twin.req_to_blocks[rid] for twin in twins],
            group_ids=[twin.kv_cache_group_id for twin in twins],
            num_cached_blocks=cached,
            num_full_blocks=num_full,
            token_ids=request.all_token_ids,
        )
        for twin in twins:
            twin.num_cached_block[rid] = num_full

    _own_cache_twins = cache_twins

    def free(self, request_id: str) -> None:
        """Release all of a request's blocks, tail first (evicted first)."""
        blocks = self.pop_blocks(request_id)
        if blocks:
            self.block_pool.free_table(blocks)

    def pop_blocks(self, request_id: str) -> list[int] | None:
        """Forget the request and hand back its table (the caller frees it;
        the list is not changed afterwards): :meth:`pop_twins` over this
        group alone."""
        return type(self)._own_pop_twins(self, (self,), request_id)[0]

    def pop_twins(
        self, twins: Sequence[SingleTypeManager], request_id: str
    ) -> list[list[int] | None]:
        """:meth:`pop_blocks` in each of ``twins`` (this manager first; see
        :meth:`allocate_twins`): each twin's table, or None where it holds
        none, with one journal record for the class.  A subclass that
        keeps more per-request state overrides this method (or
        :meth:`pop_blocks`, which pops its twins group by group)."""
        skips = self.skips_blocks  # twins are one class
        out: list[list[int] | None] = []
        entries: list[tuple[Any, ...]] = []
        for twin in twins:
            blocks = twin.req_to_blocks.pop(request_id, None)
            out.append(blocks)
            entries.append(
                (
                    twin,
                    blocks,
                    -1 if blocks is None else len(blocks),
                    twin.num_cached_block.pop(request_id, None),
                    twin.num_released.pop(request_id, None) if skips else None,
                )
            )
        journal = self.block_pool.journal
        if journal is not None:
            journal.append((UNDO_CALL, put_back_each, (request_id, entries)))
        return out

    _own_pop_twins = pop_twins

    # -- transactions -----------------------------------------------------------

    def record_request_state(self, request_id: str, *, whole: bool = False) -> None:
        """Inside a step (a transaction open on the pool): record what a
        rollback needs to put the request's table, hashed count and released
        count back as they were before the step; nothing outside one, and
        nothing after the step's first call for the request (unless
        ``whole`` asks for more than it recorded).  Every method here that
        changes them calls it first, so a step pays only for what it
        changes.  ``whole``: the change rewrites table positions (the table
        is copied); otherwise it only appends (its length is kept).  A
        subclass that changes them itself calls it first too.  One that
        keeps more per-request state (:attr:`keeps_request_state`) calls it
        before changing that state as well: the step's first call also
        records :meth:`request_state`."""
        pool = self.block_pool
        journal = pool.journal
        if journal is None:
            return
        recorded = self._recorded
        if recorded[0] != pool.transactions:
            recorded = self._recorded = (pool.transactions, {})
        seen = recorded[1].get(request_id)
        if seen is not None and (seen or not whole):
            return
        recorded[1][request_id] = whole
        blocks = self.req_to_blocks.get(request_id)
        table = (
            None if blocks is None else (blocks, list(blocks) if whole else len(blocks))
        )
        args = (
            self,
            request_id,
            table,
            self.num_cached_block.get(request_id),
            self.num_released.get(request_id),
        )
        journal.append((UNDO_CALL, put_back, args))
        if seen is None and self.keeps_request_state:
            self._record_own_state(request_id)

    def _record_own_state(self, request_id: str) -> None:
        """Inside a step: record :meth:`request_state` for a rollback, the
        answer checked to have changed nothing in the pool (it only
        answers)."""
        pool = self.block_pool
        journal = pool.journal
        if journal is None:
            return
        mark = len(journal)
        state = self.request_state(request_id)
        answered_only(self, "request_state", journal, mark)
        pool.record(self.restore_request_state, request_id, state)

    def record_twins(self, twins: Sequence[SingleTypeManager], request_id: str) -> None:
        """:meth:`record_request_state` for each of ``twins`` (tables only
        appended to), as one journal record for the class."""
        pool = self.block_pool
        journal = pool.journal
        if journal is None:
            return
        transaction = pool.transactions
        done = self._twins_recorded
        if done[0] == transaction and done[1] == request_id and done[2] is twins:
            return  # every twin recorded by this step already
        self._twins_recorded = (transaction, request_id, twins)
        # One record for the class: a twin's table recorded on its own in
        # the same step is recorded again, which undoes to the same state;
        # its own state (a plugin's snapshot) is taken once.
        entries = [
            (
                twin,
                blocks,
                -1 if blocks is None else len(blocks),
                twin.num_cached_block.get(request_id),
                twin.num_released.get(request_id),
            )
            for twin in twins
            for blocks in (twin.req_to_blocks.get(request_id),)
        ]
        if self.keeps_request_state:  # twins are one class
            for twin in twins:
                recorded = twin._recorded
                if recorded[0] != transaction:
                    twin._recorded = (transaction, {request_id: False})
                elif request_id in recorded[1]:
                    continue
                else:
                    recorded[1][request_id] = False
                twin._record_own_state(request_id)
        journal.append((UNDO_CALL, put_back_each, (request_id, entries)))

    def request_state(self, request_id: str) -> Any:
        """With :attr:`keeps_request_state`: what :meth:`restore_request_state`
        needs to put the request's state beyond its table and counts back as
        it is now, recorded on a step's first :meth:`record_request_state`
        for the request; nothing by default."""
        return None

    def restore_request_state(self, request_id: str, state: Any) -> None:
        """Put back what :meth:`request_state` recorded (the step is undone);
        nothing by default."""

    # -- releasing ------------------------------------------------------------

    def _skipped(self, request_id: str, num_computed_tokens: int) -> list[int]:
        """Positions of the still-held blocks that skipping would release,
        newest first: every real block below the skip line, down to where
        the previous release stopped (null blocks in between, a hit's
        padding or a state kind's unwritten positions, are passed over)."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return []
        last = min(self._skip(num_computed_tokens), len(blocks))
        start = self.num_released.get(request_id, 0)
        if last <= start:
            return []
        null = self.null_block
        pinned = self.pinned.get(request_id) if self.pinned else None
        if pinned:
            pins = set(pinned)
            return [
                i
                for i in range(last - 1, start - 1, -1)
                if blocks[i] != null and i not in pins
            ]
        return [i for i in range(last - 1, start - 1, -1) if blocks[i] != null]

    def count_freeable_skipped(self, request_id: str, num_computed_tokens: int) -> int:
        """Blocks :meth:`remove_skipped_blocks` would return to the free queue."""
        if not self.skips_blocks:
            return 0
        blocks = self.req_to_blocks.get(request_id)
        ref = self.block_pool.ref_cnt
        return sum(
            1
            for i in self._skipped(request_id, num_computed_tokens)
            if blocks is not None and ref[blocks[i]] == 1
        )

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks the request will never read again and put the null
        block in their place (:meth:`release_twins` over this group alone)."""
        type(self)._own_release_twins(self, (self,), request_id, num_computed_tokens)

    def release_twins(
        self,
        twins: Sequence[SingleTypeManager],
        request_id: str,
        num_computed_tokens: int,
    ) -> None:
        """:meth:`remove_skipped_blocks` in each of ``twins`` (this manager
        first; see :meth:`allocate_twins`): one decision for the class, the
        positions it releases found once (twins hold tables of one shape and
        pin the same positions), each twin's blocks freed in group order.
        A subclass that changes what is released overrides this method."""
        last = self._release_line(request_id, num_computed_tokens)
        if last < 0:
            return
        positions = self._skipped(request_id, num_computed_tokens)
        self.record_twins(twins, request_id)
        for twin in twins:
            twin.num_released[request_id] = last
        if not positions:
            return
        null = self.null_block
        tables = [twin.req_to_blocks[request_id] for twin in twins]
        removed: list[list[int]] = []
        for table in tables:
            blocks = []
            for i in positions:
                blocks.append(table[i])
                table[i] = null
            removed.append(blocks)
        pool = self.block_pool
        pool.record(put_at_each, tables, positions, removed)
        pool.free_each(removed, spare=self.holds_back)
        if self.holds_back or self.rejoins_releases:
            hold_back_twins(self, twins, request_id, positions, removed)

    _own_release_twins = release_twins

    def hit_serves(self, blocks: Sequence[int]) -> bool:
        """Whether a hit of ``blocks`` holds what the next token reads.  The
        base rule: every block of the prefix is present."""
        return self.null_block not in blocks

    def truncate_hit(self, blocks: list[int], num_tokens: int) -> list[int]:
        """The first blocks of a hit that cover ``num_tokens`` tokens."""
        return blocks[: num_tokens // self.block_size]

    # -- prefix-cache lookup ----------------------------------------------------

    @classmethod
    @abc.abstractmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> list[list[int]]:
        """The longest cached prefix the query allows: one block list per
        ``query.group_ids``, all of one length, covering a multiple of
        ``query.alignment`` tokens (null blocks where the kind reads
        nothing).  Managers of hashing policies implement it."""
        msg = (
            f"{cls.__name__} does not implement find_longest_cache_hit; a manager "
            "serving a hashing hit policy (prefix, window, checkpoint) must"
        )
        raise NotImplementedError(msg)


def _ancestor_steps_alone(cls: type, single: str) -> bool:
    """Whether an ancestor of ``cls`` below :class:`SingleTypeManager`
    overrides the one-group step ``single``."""
    for klass in cls.__mro__[1:]:
        if klass is SingleTypeManager:
            return False
        if single in vars(klass):
            return True
    return False
