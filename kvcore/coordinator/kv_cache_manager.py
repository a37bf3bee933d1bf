"""``KVCacheManager``: what an engine's scheduler calls every step."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Self, TypedDict, Unpack

from kvcore.coordinator.block_pool import KVCacheEvent
from kvcore.coordinator.blocks import BlockId, KVCacheBlocks
from kvcore.coordinator.checks import (
    EngineStepKeywords,
    check_engine_keywords,
    check_hashing,
    check_manager_settings,
    check_same_request,
    check_tokens,
    checked_hit,
    not_a_request,
)
from kvcore.coordinator.coordinator import KVCacheCoordinator
from kvcore.coordinator.counted_release import overstated_release
from kvcore.coordinator.engine_calls import (
    EngineCalls,
    GroupPrefixCacheStats,
    PrefixCacheStats,
)
from kvcore.coordinator.headroom import BoundaryHeadroom
from kvcore.coordinator.locking import ManagerLock, locked_class
from kvcore.coordinator.partial import BlockCopy
from kvcore.coordinator.plugin_results import result_error, shown
from kvcore.coordinator.request import Request, RequestStatus
from kvcore.coordinator.step_marks import StepMarks
from kvcore.coordinator.step_needs import StepNeed, StepNeeds
from kvcore.errors import (
    InvalidRequestError,
    KvcoreTypeError,
)
from kvcore.registry import KindRegistry, default_registry
from kvcore.structs import KVCacheConfig


class ManagerOptions(TypedDict, total=False):
    """The :class:`KVCacheManager` settings a plan does not carry, which
    :meth:`KVCacheManager.from_plan` passes on by name."""

    use_eagle: bool
    enable_kv_cache_events: bool
    kv_events_medium: str
    thread_safe: bool
    enable_partial_hits: bool
    boundary_headroom: bool


#: The engine keywords' values when an engine passes none.
_NO_ENGINE = (0, False, 0, 0, 0)
#: An enum member read from its class costs a lookup through the enum's
#: metaclass on every read: the status a step sets is read once, here.
_RUNNING = RequestStatus.RUNNING

__all__ = [
    "EngineStepKeywords",
    "GroupPrefixCacheStats",
    "KVCacheBlocks",
    "KVCacheManager",
    "ManagerOptions",
    "PrefixCacheStats",
]


class KVCacheManager(StepNeeds, EngineCalls):
    """Allocates, caches and frees every group's blocks for each request.

    :param kv_cache_config: the scheduler's view of the plan
        (:func:`kvcore.generate_scheduler_kv_cache_config`).
    :param max_model_len: the longest request, in tokens.
    :param scheduler_block_size: the token alignment of scheduling (see
        :func:`kvcore.resolve_kv_cache_block_sizes`).
    :param hash_block_size: tokens per hashed chunk; requests must be hashed
        at this size.
    :param enable_caching: prefix caching on or off.
    :param registry: the kinds (default: :func:`kvcore.default_registry`).
    :param dcp: decode context parallelism.
    :param use_eagle: drop the last hit block for a draft model.
    :param enable_kv_cache_events: record stored / removed / cleared events
        for a KV-aware router (:mod:`kvcore.coordinator.events`).
    :param kv_events_medium: the medium those events name (``"GPU"``).
    :param thread_safe: run every public method under one re-entrant lock
        (:attr:`lock`), for engines that call the manager from several
        threads; off, the manager takes no lock at all.
    :param enable_partial_hits: let a hit end inside the block of a group
        whose kind allows it (copy-on-write: the engine runs
        :attr:`KVCacheBlocks.copies` before the forward pass); off, hits are
        whole blocks of every group, as before.
    :param boundary_headroom: an admission leaves free the blocks the
        running requests' states take at their busiest coming block
        boundary (:mod:`kvcore.coordinator.headroom`), so admissions do not
        preempt them there; off, an admission fills the pool.
    """

    #: True on the locked subclass ``thread_safe=True`` builds.
    thread_safe: ClassVar[bool] = False
    #: This class with every public method under :attr:`lock`
    #: (``KVCacheManager(..., thread_safe=True)`` is one).
    ThreadSafe: ClassVar[type[Self]]

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        *,
        scheduler_block_size: int,
        hash_block_size: int | None = None,
        enable_caching: bool = True,
        registry: KindRegistry | None = None,
        dcp: int = 1,
        use_eagle: bool = False,
        enable_kv_cache_events: bool = False,
        kv_events_medium: str = "GPU",
        thread_safe: bool = False,
        enable_partial_hits: bool = True,
        boundary_headroom: bool = True,
    ) -> None:
        if hash_block_size is None:
            hash_block_size = scheduler_block_size
        check_manager_settings(
            kv_cache_config,
            registry,
            kv_events_medium,
            counts={
                "max_model_len": max_model_len,
                "scheduler_block_size": scheduler_block_size,
                "hash_block_size": hash_block_size,
                "dcp": dcp,
            },
            flags={
                "enable_caching": enable_caching,
                "use_eagle": use_eagle,
                "enable_kv_cache_events": enable_kv_cache_events,
                "thread_safe": thread_safe,
                "enable_partial_hits": enable_partial_hits,
                "boundary_headroom": boundary_headroom,
            },
        )
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.scheduler_block_size = scheduler_block_size
        self.coordinator = KVCacheCoordinator(
            kv_cache_config,
            max_model_len=max_model_len,
            enable_caching=enable_caching,
            hash_block_size=hash_block_size,
            scheduler_block_size=scheduler_block_size,
            registry=registry if registry is not None else default_registry(),
            dcp=dcp,
            use_eagle=use_eagle,
            enable_kv_cache_events=enable_kv_cache_events,
            kv_events_medium=kv_events_medium,
            enable_partial_hits=enable_partial_hits,
        )
        self.enable_partial_hits = enable_partial_hits
        self.block_pool = self.coordinator.block_pool
        self.kv_cache_config = kv_cache_config
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.empty_kv_cache_blocks = KVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups)), pool=self.block_pool
        )
        self.prefix_cache_stats = PrefixCacheStats()
        self._managers = self.coordinator.single_type_managers
        self._unwritten = self.coordinator.unwritten
        self._init_live(boundary_headroom)
        #: The re-entrant lock every public method of a thread-safe manager
        #: holds (hold it around a lookup and the allocation that uses its
        #: hit), else None.
        self.lock: ManagerLock | None = ManagerLock() if self.thread_safe else None

    def _init_live(self, boundary_headroom: bool) -> None:
        """What the manager keeps about its live requests."""
        #: The request object of each live id (one holding blocks), so
        #: free() by id can mark it.
        self._requests: dict[str, Request] = {}
        #: The lists pop_blocks_for_free handed out and release_blocks has
        #: not taken back, as handed out (block ids), by their ids sorted
        #: (the null block left out), oldest first: a list released twice is
        #: refused even where another list holds the same blocks.
        self._popped: dict[tuple[int, ...], list[list[BlockId]]] = {}
        #: Each live request's admission hit, step end and release point.
        self._marks = StepMarks()
        #: What an admission leaves free for the running requests' next
        #: block boundary; None when no group holds a block over one.
        overlaps = self.coordinator.boundary_overlaps
        sizes = [m.block_size for m in self._managers]
        self._headroom = (
            BoundaryHeadroom.of(zip(sizes, overlaps, strict=True))
            if boundary_headroom
            else None
        )

    def __new__(cls, *args: Any, thread_safe: bool = False, **kwargs: Any) -> Self:
        """``thread_safe=True`` builds the class's locked subclass
        (:attr:`ThreadSafe`): the choice is made once, here."""
        del args, kwargs
        chosen = cls.ThreadSafe if thread_safe is True else cls
        return object.__new__(chosen)

    def __init_subclass__(cls, *, locked: bool = False, **kwargs: Any) -> None:
        """Every manager class gets its locked subclass beside it."""
        super().__init_subclass__(**kwargs)
        if not locked:
            cls.ThreadSafe = locked_class(cls)

    @classmethod
    def from_plan(
        cls,
        plan: KVCacheConfig,
        *,
        registry: KindRegistry | None = None,
        **options: Unpack[ManagerOptions],
    ) -> KVCacheManager:
        """The scheduler's manager for a plan, with the block sizes,
        ``max_model_len``, prefix caching and context parallelism the plan
        carries (a worker's plan is turned into the scheduler's view).

        :param options: the constructor's other settings, by name
            (:class:`ManagerOptions`)."""
        from kvcore.plan.block_sizes import generate_scheduler_kv_cache_config

        scheduler_block_size = plan.scheduler_block_size
        max_model_len = plan.max_model_len
        missing = [
            name
            for name in ("scheduler_block_size", "hash_block_size", "max_model_len")
            if getattr(plan, name) is None
        ]
        if missing or scheduler_block_size is None or max_model_len is None:
            msg = (
                f"the plan carries no {', '.join(missing)}; build it with "
                "kvcore.plan_kv_cache (or get_kv_cache_config_from_groups with "
                "EngineConfig(max_model_len=...)), or call KVCacheManager(...) "
                "with them"
            )
            raise InvalidRequestError(msg)
        return cls(
            generate_scheduler_kv_cache_config([plan]),
            max_model_len,
            scheduler_block_size=scheduler_block_size,
            hash_block_size=plan.hash_block_size,
            enable_caching=plan.enable_prefix_caching,
            registry=registry,
            dcp=plan.decode_context_parallel_size,
            **options,
        )

    # -- lookups ----------------------------------------------------------------

    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int]:
        """The request's prefix hit (blocks, tokens); the last prompt token is
        always recomputed so the step yields logits.  ``max_cache_hit_length``
        bounds the hit further (a scheduler that must recompute from some
        token on); the hit returned still ends on the hit alignment."""
        if not isinstance(request, Request):
            raise not_a_request(request)
        bound = len(request.all_token_ids) - 1
        if max_cache_hit_length is not None:
            check_tokens(
                "get_computed_blocks: max_cache_hit_length", max_cache_hit_length
            )
            bound = min(bound, max_cache_hit_length)
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0
        coordinator = self.coordinator
        check_hashing(self, request)
        blocks, length = coordinator.find_longest_cache_hit(request.block_hashes, bound)
        if coordinator.planning:
            request.shared_prefix_tokens = max(coordinator.last_shared_prefix, length)
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += len(request.all_token_ids)
        stats.hits += length
        if not length:
            return self.empty_kv_cache_blocks, 0
        pool = self.block_pool
        out = KVCacheBlocks(blocks, pool=pool)
        out._lookup = (pool, pool.evictions, request, blocks)
        return out, length

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
        **engine: Unpack[EngineStepKeywords],
    ) -> KVCacheBlocks | None:
        """Give the request slots for ``num_new_tokens`` more tokens: its
        table covers the computed tokens, the hit attached now, the tokens a
        KV connector loads, the new tokens and the lookahead slots.

        :param num_new_computed_tokens: tokens of the hit ``new_computed_blocks``.
        :param delay_cache_blocks: key nothing; call :meth:`cache_blocks` later.
        :param engine: the engine's keywords, by name: :class:`EngineStepKeywords`.
        :returns: the new blocks per group (the request is then ``RUNNING``), or
            ``None`` when it cannot run now: a full pool, or unwritten hit KV.
        """
        if not isinstance(request, Request):
            raise not_a_request(request)
        rid = request.request_id
        # Engine keywords come in a dict: a step without them pays no defaults.
        external, whole_sequence, num_encoder, num_in_flight, reserved = (
            check_engine_keywords(self, request, engine) if engine else _NO_ENGINE
        )
        want = (num_new_tokens, num_new_computed_tokens, num_lookahead_tokens, external)
        computed = checked_hit(self, request, new_computed_blocks, want)
        hit_end = request.num_computed_tokens + num_new_computed_tokens
        num_computed = hit_end + external
        num_tokens = scheduled_to = num_computed + num_new_tokens
        keyed = self.enable_caching and not delay_cache_blocks
        cache_to = min(num_tokens, len(request.all_token_ids)) if keyed else -1
        if num_lookahead_tokens or num_tokens > self.max_model_len:
            num_tokens = self._with_lookahead(rid, num_tokens, num_lookahead_tokens)
        held = self._requests.get(rid)
        if held is not request and held is not None:
            check_same_request(self, held, request)
        # A live request (held) with no new hit grows; any other is admitted.
        running = computed is None and held is not None
        if running:
            self._marks.check_running(rid, num_computed, self.coordinator.skipping)
        if self._unwritten.by_writer and not self._unwritten.admits(rid, computed):
            return None  # its hit's state is written by a step not yet run
        # Blocks are released only below the tokens no step in flight computes.
        processed = num_computed - num_in_flight
        if not running:
            step = self._admission_need(
                request, computed, (hit_end, num_computed), num_tokens, num_encoder
            )
        else:
            if num_in_flight and self._headroom is not None:
                self._headroom.saw_in_flight(num_in_flight)
            coordinator = self.coordinator
            need = coordinator.get_num_blocks_to_grow(rid, num_tokens)
            skipping = bool(coordinator.skipping) and processed > 0
            if (
                not need
                and held is request
                and coordinator.idle_steps
                and not whole_sequence
                and reserved <= self.block_pool.free_queue.num_free
                and (not skipping or coordinator.releases_nothing(rid, processed))
                and (cache_to < 0 or coordinator.keys_nothing(request, cache_to))
                and self.block_pool.journal is None
            ):
                # Nothing grows, is released or keyed: the step changes nothing
                # (a step already open refuses it, in BlockPool.begin).
                request.status = _RUNNING
                self._marks.scheduled_to[rid] = scheduled_to
                return self.empty_kv_cache_blocks
            step = ((), None, 0, need)
        return self._fit_and_run(
            request,
            held,
            step,
            (running, processed, num_tokens, cache_to, reserved),
            (num_encoder, hit_end, whole_sequence, scheduled_to),
        )

    def _fit_and_run(
        self,
        request: Request,
        held: Request | None,
        need: StepNeed | None,
        span: tuple[bool, int, int, int, int],
        tokens: tuple[int, int, bool, int],
    ) -> KVCacheBlocks | None:
        """Run a step whose need is counted, if it fits.  ``need``: the
        admission blocks (``()`` for a running request, which grows), the
        copy-on-write sources, how many of them leave the free queue and
        the blocks the step takes; ``span``: whether the request runs (it
        holds blocks and attaches no hit), the tokens processed (released
        below), the tokens covered, the keyed end and the blocks it must
        leave free; ``tokens``: the encoder tokens, where the hit ends and
        whether the whole sequence must fit.  None when the pool cannot
        satisfy it, or ``need`` is None: the admission copies tokens a step
        in flight writes (nothing changed)."""
        if need is None:
            return None
        attach, sources, held_sources, num_needed = need
        running, processed, num_tokens, cache_to, reserved = span
        num_encoder, num_hit_tokens, whole_sequence, scheduled_to = tokens
        rid = request.request_id
        coordinator = self.coordinator
        # Blocks that fell out of use are released only once the step is
        # known to fit, so a refused step changes nothing; when the pool is
        # short, the blocks they would return count as free.
        skipping = running and bool(coordinator.skipping) and processed > 0
        args = (running, skipping, attach, processed, num_tokens, cache_to, num_encoder)
        free = (
            self.block_pool.free_queue.num_free - reserved
            if running
            else self._room_to_admit(num_needed, reserved)
        )
        shed = None
        try:
            if whole_sequence and not self._whole_sequence_fits(
                request, running, attach, num_encoder, held_sources
            ):
                return None
            if num_needed > free and not self._fits(rid, num_needed, free, args):
                fits, shed, num_needed = self._shed_to_fit(
                    rid, args, held_sources, free
                )
                if not fits:
                    return None
        except BaseException:
            # A plugin that raised while the step was weighed: an admission
            # forgets the checkpoints it planned, as a refused one does.
            if not running and coordinator.planning:
                coordinator.forget_checkpoints(rid)
            raise
        return self._run_step(
            request,
            held,
            args,
            sources,
            shed,
            (num_hit_tokens, scheduled_to),
            num_needed + reserved if skipping and num_needed > free else 0,
        )

    def _run_step(
        self,
        request: Request,
        held: Request | None,
        args: tuple[bool, bool, tuple[list[BlockId], ...], int, int, int, int],
        sources: list[tuple[int, BlockId, int]] | None,
        shed: list[Any] | None,
        tokens: tuple[int, int],
        counted: int = 0,
    ) -> KVCacheBlocks:
        """Run a step that fits (``args``: :meth:`_step`'s after the
        request) as a transaction and hand out its new blocks; ``counted``:
        the free blocks it needs once its release has run, where it fits
        only by the blocks that release returns (checked, see
        :mod:`kvcore.coordinator.counted_release`)."""
        rid = request.request_id
        running = args[0]
        num_hit_tokens, scheduled_to = tokens
        coordinator = self.coordinator
        # A copy step admits (it has sources); only a running step counts.
        step: Callable[..., tuple[list[BlockId], ...] | None]
        if sources is not None:
            step = functools.partial(self._copy_step, sources)
        elif counted:
            step = functools.partial(self._step, counted=counted)
        else:
            step = self._step
        unwritten = self._unwritten
        watched = unwritten.managers or unwritten.sources
        keyed_from = unwritten.keyed_so_far(rid) if watched else ()
        # Every step is a transaction: a manager that raises leaves the
        # pool, the tables, the keys and the events as they were.
        pool = self.block_pool
        pool.begin()
        try:
            new_blocks = step(request, *args)
        except BaseException:
            # A manager that raised is reported as a PluginError naming it
            # (see KVCacheCoordinator.plugin_error); the step is undone first.
            try:
                pool.rollback()
            finally:
                if shed is not None:
                    # The states were recorded after the shed.
                    coordinator.restore_checkpoints(rid, shed)
                if not running and coordinator.planning:
                    # The states were recorded after plan_checkpoints.
                    coordinator.forget_checkpoints(rid)
            raise
        pool.commit()
        marks = self._marks
        marks.scheduled_to[rid] = scheduled_to
        if args[1] or (not running and coordinator.skipping):
            # Blocks below the processed tokens were released, or (at an
            # admission) never taken: no later step may start below them.
            marks.released(rid, args[3])
        if watched:
            # The step writes from its processed tokens on (see _step's args).
            unwritten.took(rid, new_blocks, keyed_from, args[3])
        request.status = _RUNNING
        if held is not request:
            self._requests[rid] = request
        if not running:
            marks.admitted_with[rid] = num_hit_tokens
        if sources is not None:
            copies = self._copies(rid, sources, num_hit_tokens)
            return KVCacheBlocks(
                new_blocks
                if new_blocks is not None
                else self.empty_kv_cache_blocks.ids,
                copies,
                pool=self.block_pool,
            )
        if new_blocks is None:
            return self.empty_kv_cache_blocks
        return self.create_kv_cache_blocks(new_blocks)

    def _copy_step(
        self,
        sources: list[tuple[int, BlockId, int]],
        request: Request,
        *args: Any,
    ) -> tuple[list[BlockId], ...] | None:
        """:meth:`_step` (``args``: its arguments after the request) for an
        admission with copy-on-write sources: each source is held for the
        step (so this step's allocation cannot evict it) and released after;
        its content stays until the copy runs, since no block is written
        before the forward pass."""
        pool = self.block_pool
        held = [src for _, src, _ in sources]
        pool.touch(held)
        new_blocks = self._step(request, *args)
        pool.free_blocks(held)
        return new_blocks

    def _copies(
        self,
        rid: str,
        sources: list[tuple[int, BlockId, int]],
        num_hit_tokens: int,
    ) -> tuple[BlockCopy, ...]:
        """The copies of an admission: each source into the fresh block at
        its position."""
        out = []
        for gid, src, num_tokens in sources:
            manager = self._managers[gid]
            dst = manager.req_to_blocks[rid][num_hit_tokens // manager.block_size]
            out.append(BlockCopy(gid, src, dst, num_tokens))
        return tuple(out)

    def _step(
        self,
        request: Request,
        running: bool,
        skipping: bool,
        attach: tuple[list[BlockId], ...],
        num_computed: int,
        num_tokens: int,
        cache_to: int,
        num_encoder: int = 0,
        *,
        counted: int = 0,
    ) -> tuple[list[BlockId], ...] | None:
        """The changes of one validated allocate_slots step (``num_encoder``:
        the encoder tokens of an admission; ``counted``: the free blocks it
        needs once its release has run, where it fits only by the blocks
        that release returns)."""
        coordinator = self.coordinator
        rid = request.request_id
        if skipping:
            coordinator.remove_skipped_blocks(rid, num_computed)
            if counted > self.block_pool.free_queue.num_free:
                raise overstated_release(coordinator, (rid, num_computed), counted)
        new_blocks: tuple[list[BlockId], ...] | None
        if running:
            new_blocks = coordinator.grow(rid, num_tokens)
        else:
            coordinator.add_computed_blocks(rid, attach, request.block_hashes)
            new_blocks = coordinator.allocate_new_blocks(rid, num_tokens, num_encoder)
        if cache_to >= 0:
            coordinator.cache_blocks(request, cache_to)
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Hash the request's blocks filled by ``num_computed_tokens``; a
        cache group's manager that raises leaves every group as it was."""
        if not isinstance(request, Request):
            raise not_a_request(request)
        check_tokens(
            "cache_blocks for request %r: num_computed_tokens",
            num_computed_tokens,
            request.request_id,
        )
        if self.enable_caching:
            rid = request.request_id
            self._require_live(rid)
            self._marks.check_keyed(
                rid, request.num_computed_tokens, num_computed_tokens
            )
            coordinator = self.coordinator
            if self.block_pool.journal is None and coordinator.keys_nothing(
                request, num_computed_tokens
            ):
                # Inside the request's cache span: nothing changes.  (A step
                # already open refuses the call, in BlockPool.begin.)
                return
            # A transaction, as every step: a group that raises leaves no
            # other group's keys, counts or events behind.
            self._guarded(coordinator.cache_blocks, request, num_computed_tokens)

    def free(self, request: Request | str, *, forward_ran: bool = True) -> None:
        """Release every block the request holds (tail blocks evicted first)
        and mark the request ``FINISHED``.

        ``forward_ran=False``: the step :meth:`allocate_slots` last scheduled
        for the request is dropped before its forward pass runs (a
        preemption in the scheduling step), with ``num_computed_tokens``
        not yet advanced past it.  Blocks holding a token past what was
        written (the computed tokens, or the admission's hit where that
        covers more) were keyed when the step was scheduled but never
        written, so they lose their prefix-cache keys before they are
        freed, and no later request hits them."""
        self._finish(request, self.coordinator.free, forward_ran)

    # -- block lists ------------------------------------------------------------

    def create_kv_cache_blocks(
        self, blocks: tuple[Sequence[BlockId], ...]
    ) -> KVCacheBlocks:
        """Wrap per-group block id lists (the shared empty instance if all
        empty)."""
        for group in blocks:
            if group:
                return KVCacheBlocks(blocks, pool=self.block_pool)
        return self.empty_kv_cache_blocks

    def truncate_computed_blocks(
        self, blocks: KVCacheBlocks, num_computed_tokens: int
    ) -> KVCacheBlocks:
        """The first ``num_computed_tokens`` of a hit (reference counts are not
        touched).  Non-cacheable groups contribute no hit blocks."""
        given: object = blocks  # checked: engines pass anything
        if not isinstance(given, KVCacheBlocks):
            msg = (
                "truncate_computed_blocks: blocks must be the KVCacheBlocks "
                f"get_computed_blocks returned, got {type(given).__name__}"
            )
            raise KvcoreTypeError(msg)
        check_tokens(
            "truncate_computed_blocks: num_computed_tokens", num_computed_tokens
        )
        out: list[list[BlockId]] = []
        for gid, (manager, group_blocks) in enumerate(
            zip(self._managers, blocks.ids, strict=True)
        ):
            if not manager.kv_cache_spec.prefix_cacheable:
                if group_blocks:
                    msg = (
                        f"group {gid} is not prefix-cacheable but the computed "
                        f"blocks hold {len(group_blocks)} blocks for it"
                    )
                    raise InvalidRequestError(msg)
                out.append([])
                continue
            unit = self.coordinator.partial_units.get(gid)
            # A partial-hit group: the block at the cut is a copy source.
            partial = unit is not None and not num_computed_tokens % unit
            size = manager.block_size
            if manager.position_indexed and not partial and num_computed_tokens % size:
                msg = (
                    f"cannot truncate group {gid}'s hit to {num_computed_tokens} "
                    f"tokens: not a multiple of its block size {size}"
                )
                raise InvalidRequestError(msg)
            keep = -(-num_computed_tokens // size)
            if (partial or manager.position_indexed) and keep > len(group_blocks):
                msg = (
                    f"cannot truncate group {gid}'s hit of {len(group_blocks)} "
                    f"blocks to {num_computed_tokens} tokens: it is shorter"
                )
                raise InvalidRequestError(msg)
            out.append(
                list(group_blocks[:keep])
                if partial
                else self._truncated(gid, group_blocks, num_computed_tokens)
            )
        if not any(out):
            return self.empty_kv_cache_blocks
        # The hit's own pool: a hit of another manager stays foreign.
        return KVCacheBlocks(tuple(out), pool=blocks._pool)

    def _truncated(
        self, gid: int, blocks: Sequence[BlockId], num_tokens: int
    ) -> list[BlockId]:
        """Group ``gid``'s manager's ``truncate_hit`` of ``blocks``, checked
        where it enters the core: the hit's first blocks, each its own or
        the null block."""
        manager = self._managers[gid]
        try:
            cut: object = manager.truncate_hit(list(blocks), num_tokens)
        except Exception as exc:
            raise self.coordinator.plugin_error(gid, "truncate_hit", exc) from exc
        null = self.block_pool.null_block
        if (
            type(cut) is not list
            or len(cut) > len(blocks)
            or any(b != blocks[i] and b != null for i, b in enumerate(cut))
        ):
            raise result_error(
                manager,
                "truncate_hit",
                f"returned {shown(cut)} for group {gid}'s hit of {len(blocks)} "
                f"blocks cut to {num_tokens} tokens; it must return a list of the "
                "hit's first blocks (the null block where the kind reads nothing)",
            )
        return cut

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        self._require_live(request_id)
        return KVCacheBlocks(
            self.coordinator.get_blocks(request_id), pool=self.block_pool
        )

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Every group's block ids for the request (0 is the null block)."""
        return self.get_blocks(request_id).get_block_ids()

    def live_request_ids(self) -> tuple[str, ...]:
        """The ids of the requests that hold blocks now, in the order they
        were first allocated: what :meth:`free` (or
        :meth:`pop_blocks_for_free`) still expects.  An engine checks it is
        empty before :meth:`reset_prefix_cache` or at shutdown (a non-empty
        tuple is a leaked request), and a deep copy of the manager (a
        what-if fork) lists the same ids as its original."""
        return tuple(self._requests)

    # -- pool -------------------------------------------------------------------

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use."""
        return self.block_pool.get_usage()

    def group_usage(self) -> tuple[int, ...]:
        """Blocks each group's requests hold now (a block shared by several
        requests counts once; the null block not at all).  Counted on call."""
        out = []
        for manager in self._managers:
            ids = {
                block
                for blocks in manager.req_to_blocks.values()
                for block in blocks
                if block
            }
            out.append(len(ids))
        return tuple(out)

    def group_prefix_cache_stats(self) -> tuple[GroupPrefixCacheStats, ...]:
        """Each group's share of the prefix-hit statistics, derived on call
        from :attr:`prefix_cache_stats`: kvcore's hit is one length every
        group serves, so every group hit the same tokens, in
        ``hits // block_size`` of its table positions (positions its kind
        skips included)."""
        stats = self.prefix_cache_stats
        return tuple(
            GroupPrefixCacheStats(
                group_id=gid,
                kind=str(manager.kv_cache_spec.kind),
                block_size=manager.block_size,
                prefix_cacheable=manager.caching,
                requests=stats.requests,
                queries=stats.queries,
                hits=stats.hits if manager.caching else 0,
                hit_blocks=stats.hits // manager.block_size if manager.caching else 0,
            )
            for gid, manager in enumerate(self._managers)
        )

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only while no request holds blocks."""
        ok = self.block_pool.reset_prefix_cache()
        if ok:
            self.prefix_cache_stats = PrefixCacheStats()
        return ok

    def take_events(self) -> list[KVCacheEvent]:
        """KV-cache events (stored / removed / cleared) since the last call."""
        return self.block_pool.take_events()


KVCacheManager.ThreadSafe = locked_class(KVCacheManager)
