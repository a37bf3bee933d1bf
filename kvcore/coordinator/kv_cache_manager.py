"""``KVCacheManager``: what an engine's scheduler calls every step."""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, TypedDict, Unpack, cast

from kvcore.coordinator.block_pool import KVCacheBlock, KVCacheEvent
from kvcore.coordinator.coordinator import KVCacheCoordinator, _count
from kvcore.coordinator.partial import BlockCopy, copy_source_valid, split_copy_sources
from kvcore.coordinator.request import Request, RequestStatus
from kvcore.errors import (
    InvalidRequestError,
    InvalidRequestTypeError,
    KvcoreTypeError,
    UnknownRequestError,
)
from kvcore.registry import KindRegistry, default_registry
from kvcore.structs import KVCacheConfig

__all__ = [
    "EngineStepKeywords",
    "GroupPrefixCacheStats",
    "KVCacheBlocks",
    "KVCacheManager",
    "PrefixCacheStats",
]


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


class PrefixCacheStats:
    """Lookups since the last reset: requests, queried and hit tokens."""

    __slots__ = ("hits", "queries", "requests")

    def __init__(self) -> None:
        self.requests = 0
        self.queries = 0
        self.hits = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class EngineStepKeywords(TypedDict, total=False):
    """The keywords an engine may pass to :meth:`KVCacheManager.allocate_slots`
    besides its positional parameters (each described there)."""

    num_external_computed_tokens: int
    num_encoder_tokens: int
    full_sequence_must_fit: bool
    num_in_flight_tokens: int
    reserved_blocks: int


_ENGINE_KEYWORDS = frozenset(EngineStepKeywords.__annotations__)
#: Read on every free (an enum member lookup costs more than a global).
_FINISHED = RequestStatus.FINISHED


class GroupPrefixCacheStats(NamedTuple):
    """One group's view of the prefix-hit statistics (see
    :meth:`KVCacheManager.group_prefix_cache_stats`)."""

    group_id: int
    kind: str
    block_size: int
    prefix_cacheable: bool
    requests: int
    queries: int
    hits: int
    hit_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
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
    """

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
    ) -> None:
        _require_type(
            "kv_cache_config",
            kv_cache_config,
            KVCacheConfig,
            "a kvcore.KVCacheConfig (the scheduler's view of a plan)",
        )
        if hash_block_size is None:
            hash_block_size = scheduler_block_size
        for name, value in (
            ("max_model_len", max_model_len),
            ("scheduler_block_size", scheduler_block_size),
            ("hash_block_size", hash_block_size),
            ("dcp", dcp),
        ):
            _positive_int(name, value)
        for name, flag in (
            ("enable_caching", enable_caching),
            ("use_eagle", use_eagle),
            ("enable_kv_cache_events", enable_kv_cache_events),
            ("thread_safe", thread_safe),
            ("enable_partial_hits", enable_partial_hits),
        ):
            _require_type(name, flag, bool, "a bool (True or False)", exact=True)
        _require_type(
            "kv_events_medium", kv_events_medium, str, "a str such as 'GPU'", exact=True
        )
        if not kv_events_medium:
            msg = (
                "KVCacheManager: kv_events_medium must be a non-empty str such "
                "as 'GPU' or 'CPU', got ''"
            )
            raise InvalidRequestError(msg)
        if registry is not None:
            _require_type(
                "registry",
                registry,
                KindRegistry,
                "a kvcore.KindRegistry or None (kvcore.default_registry() or "
                "KindRegistry.from_plugin_manager)",
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
            tuple(() for _ in range(self.num_kv_cache_groups))
        )
        self.prefix_cache_stats = PrefixCacheStats()
        self._managers = self.coordinator.single_type_managers
        #: The request object of each live id (one holding blocks), so
        #: free() by id can mark it.
        self._requests: dict[str, Request] = {}
        self.thread_safe = thread_safe
        #: The re-entrant lock every public method holds with
        #: ``thread_safe=True`` (hold it around a lookup and the allocation
        #: that uses its hit), else None.
        self.lock: threading.RLock | None = None
        self._bind_methods()

    def _bind_methods(self) -> None:
        """With ``thread_safe``, every public method under the lock, bound
        as an instance attribute (so the unlocked manager pays nothing: no
        lock, no flag test per call)."""
        if self.thread_safe:
            lock = self.lock = threading.RLock()
            for name in _public_methods(type(self)):
                setattr(self, name, _locked(getattr(self, name), lock))

    def __getstate__(self) -> dict[str, Any]:
        """The manager's state without its lock and the locked methods (a
        lock cannot be copied): a copy or an unpickled manager makes its
        own."""
        state = self.__dict__.copy()
        if self.thread_safe:
            for name in ("lock", *_public_methods(type(self))):
                state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.lock = None
        self._bind_methods()

    @classmethod
    def from_plan(
        cls,
        plan: KVCacheConfig,
        *,
        registry: KindRegistry | None = None,
        use_eagle: bool = False,
        enable_kv_cache_events: bool = False,
        kv_events_medium: str = "GPU",
        thread_safe: bool = False,
        enable_partial_hits: bool = True,
    ) -> KVCacheManager:
        """The scheduler's manager for a plan, with the block sizes,
        ``max_model_len``, prefix caching and context parallelism the plan
        carries (a worker's plan is turned into the scheduler's view)."""
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
            use_eagle=use_eagle,
            enable_kv_cache_events=enable_kv_cache_events,
            kv_events_medium=kv_events_medium,
            thread_safe=thread_safe,
            enable_partial_hits=enable_partial_hits,
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
            raise _not_a_request(request)
        bound = len(request.all_token_ids) - 1
        if max_cache_hit_length is not None:
            _check_tokens(
                "get_computed_blocks: max_cache_hit_length", max_cache_hit_length
            )
            bound = min(bound, max_cache_hit_length)
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0
        coordinator = self.coordinator
        self._check_hashing(request)
        blocks, length = coordinator.find_longest_cache_hit(request.block_hashes, bound)
        if coordinator.planning:
            request.shared_prefix_tokens = max(coordinator.last_shared_prefix, length)
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += len(request.all_token_ids)
        stats.hits += length
        if not length:
            return self.empty_kv_cache_blocks, 0
        out = KVCacheBlocks(blocks)
        pool = self.block_pool
        out._lookup = (pool, pool.evictions, request, blocks)
        return out, length

    def _check_hashing(self, request: Request) -> None:
        if request.hash_block_size != self.hash_block_size:
            msg = (
                f"request {request.request_id!r} is hashed at "
                f"{request.hash_block_size} tokens per chunk but the manager hashes "
                f"at {self.hash_block_size}; build requests with "
                f"hash_block_size={self.hash_block_size}"
            )
            raise InvalidRequestError(msg)

    # -- allocation -------------------------------------------------------------

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
        """Give the request slots for ``num_new_tokens`` more tokens.

        The table covers, in order: the tokens already computed, the prefix
        hit attached now, the tokens a KV connector loads, the new tokens
        and the lookahead slots.

        :param num_new_computed_tokens: tokens of a prefix hit attached now
            (from :meth:`get_computed_blocks`).
        :param new_computed_blocks: the hit's blocks.
        :param num_lookahead_tokens: extra slots for speculative tokens.
        :param delay_cache_blocks: hash nothing this step (the blocks' KV
            arrives later, e.g. an asynchronous connector load); call
            :meth:`cache_blocks` once it has arrived.
        :param num_external_computed_tokens: tokens after the hit whose KV a
            KV connector loads.  They get slots (new blocks, or the null block
            at positions the group's kind skips) but take no cached block, and
            they count as computed: positions before them that a kind skips
            are not allocated.  Only when the request is admitted (it holds no
            blocks); ``num_new_tokens`` may then be 0 (a load that completes
            in a later step).  With a prefix hit attached
            (``num_new_computed_tokens``), ``num_new_tokens`` may be 0 too:
            a chunk that only adopts the hit.
        :param num_encoder_tokens: encoder tokens for cross-attention groups.
            kvcore has no cross-attention kind, so a nonzero value is refused
            (reserving nothing would leave the encoder's KV without slots).
        :param full_sequence_must_fit: admit only when the pool can hold the
            request's whole current sequence (``request.num_tokens``, capped at
            ``max_model_len``) as well as this step, so chunked prefill does
            not admit a request whose later chunks cannot fit (see
            :meth:`can_fit_full_sequence`).
        :param num_in_flight_tokens: tokens of ``request.num_computed_tokens``
            that a step still in flight computes (asynchronous scheduling,
            pipeline parallelism).  Blocks the request no longer reads are
            released only below ``num_computed_tokens - num_in_flight_tokens``,
            so none that an in-flight step reads returns to the pool; call
            :meth:`remove_skipped_blocks` once the step has completed.
        :param reserved_blocks: free blocks the step must leave free (for
            other requests already in flight, or a watermark); the step is
            refused when it would need them.
        :returns: the newly allocated blocks per group, or ``None`` when the
            pool cannot satisfy the step (nothing is changed then, the
            request's status included); on success the request's status is
            ``RUNNING``.
        """
        if not isinstance(request, Request):
            raise _not_a_request(request)
        rid = request.request_id
        # The engine keywords travel in a dict so a step without them pays
        # for no keyword-only defaults.
        num_external_computed_tokens = 0
        full_sequence_must_fit = False
        num_in_flight = reserved = 0
        if engine:
            num_external_computed_tokens, full_sequence_must_fit = (
                self._check_engine_keywords(request, engine)
            )
            num_in_flight, reserved = _step_limits(rid, engine)
        if (type(num_new_tokens) is not int or num_new_tokens <= 0) and not (
            num_new_tokens == 0
            and type(num_new_tokens) is int
            and (num_external_computed_tokens or num_new_computed_tokens)
        ):
            msg = (
                f"allocate_slots for request {rid!r} asks for {num_new_tokens!r} new "
                "tokens; schedule a positive int number of tokens"
            )
            raise _wrong(num_new_tokens, msg)
        if (
            type(num_new_computed_tokens) is not int
            or num_new_computed_tokens < 0
            or type(num_lookahead_tokens) is not int
            or num_lookahead_tokens < 0
        ):
            _check_counts(rid, num_new_computed_tokens, num_lookahead_tokens)
        hit: object = new_computed_blocks  # checked: engines pass anything
        if hit is not None and not isinstance(hit, KVCacheBlocks):
            msg = (
                f"allocate_slots for request {rid!r}: new_computed_blocks must be "
                f"the KVCacheBlocks get_computed_blocks returned, or None, got "
                f"{type(hit).__name__}"
            )
            raise KvcoreTypeError(msg)
        coordinator = self.coordinator
        computed = (
            new_computed_blocks.blocks if new_computed_blocks is not None else None
        )
        if computed is not None and not any(computed):
            computed = None
        if num_new_computed_tokens or computed is not None:
            self._check_hit(
                request, new_computed_blocks, computed, num_new_computed_tokens
            )
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        if num_external_computed_tokens:
            num_computed += num_external_computed_tokens
        num_tokens = num_computed + num_new_tokens
        if num_tokens > self.max_model_len:
            msg = (
                f"request {rid!r} would hold {num_tokens} tokens, past "
                f"max_model_len={self.max_model_len}; stop or truncate it first"
            )
            raise InvalidRequestError(msg)
        cache_to = -1
        if self.enable_caching and not delay_cache_blocks:
            cache_to = min(num_tokens, len(request.all_token_ids))
        if num_lookahead_tokens:
            if coordinator.lookahead_refusers:
                gid = coordinator.lookahead_refusers[0]
                kind = self._managers[gid].kv_cache_spec.kind
                msg = (
                    f"request {rid!r}: group {gid} ({kind}) cannot hold speculative "
                    "lookahead slots (its state sits at the last computed "
                    "position); schedule without lookahead for this plan"
                )
                raise InvalidRequestError(msg)
            num_tokens += num_lookahead_tokens
            if num_tokens > self.max_model_len:
                num_tokens = self.max_model_len
        held = self._requests.get(rid)
        if held is not request and held is not None:
            self._check_same_request(held, request)
        # A live request (held) with no new hit grows; any other is admitted.
        running = computed is None and held is not None
        # Every group's table is sized by one rule at num_computed tokens:
        # positions its kind skips are null, the others hold a block.  A
        # running request first releases the blocks it no longer reads; a new
        # one never takes them (see SingleTypeManager.num_skipped_blocks).
        attach: tuple[list[KVCacheBlock], ...] = ()
        # Copy-on-write sources of a partial hit (None: none, the usual case).
        sources: list[tuple[int, KVCacheBlock, int]] | None = None
        held_sources = 0
        if running:
            need = coordinator.get_num_blocks_to_grow(rid, num_tokens)
        else:
            if self.enable_caching:
                self._check_hashing(request)
            if computed is not None and coordinator.partial_groups:
                # A hit that ends inside a block of a partial-hit group: its
                # last block is copied into a fresh one, not attached.
                computed, found = split_copy_sources(
                    computed,
                    coordinator.partial_groups,
                    request.num_computed_tokens + num_new_computed_tokens,
                )
                if found:
                    sources = found
            attach = coordinator.admission_blocks(
                computed if computed is not None else self.empty_kv_cache_blocks.blocks,
                num_computed,
            )
            if coordinator.planning:
                coordinator.plan_checkpoints(request, num_computed)
            need = coordinator.get_num_blocks_to_allocate(rid, num_tokens, attach)
            if sources:
                # A free source leaves the free queue for the step.
                held_sources = sum(1 for _, src, _ in sources if src.ref_cnt == 0)
                need += held_sources
        if (
            full_sequence_must_fit
            and self._full_sequence_blocks(
                request, min(request.num_tokens, self.max_model_len), attach
            )
            + held_sources
            > self.block_pool.free_queue.num_free
        ):
            if not running and coordinator.planning:
                coordinator.forget_checkpoints(rid)
            return None
        # Blocks that fell out of use are released only once the step is
        # known to fit, so a refused step changes nothing; when the pool is
        # short, the blocks they would return count as free.
        # Released only below the tokens no step in flight still computes.
        processed = num_computed - num_in_flight if num_in_flight else num_computed
        skipping = running and bool(coordinator.skipping) and processed > 0
        free = self.block_pool.free_queue.num_free
        if reserved:
            free -= reserved
        shed = None
        if need > free and (
            not skipping
            or need > free + coordinator.count_freeable_skipped(rid, processed)
        ):
            # Checkpoints are optional: a step that fits without them runs
            # without them (the request gives up the states it would keep
            # inside the step and those it holds for others).
            shed = coordinator.shed_checkpoints(rid) if coordinator.planning else None
            if shed is not None:
                if running:
                    need = coordinator.get_num_blocks_to_grow(rid, num_tokens)
                else:
                    need = (
                        coordinator.get_num_blocks_to_allocate(rid, num_tokens, attach)
                        + held_sources
                    )
            if shed is None or (
                need > free
                and (
                    not skipping
                    or need > free + coordinator.count_freeable_skipped(rid, processed)
                )
            ):
                if shed is not None:
                    coordinator.restore_checkpoints(rid, shed)
                if not running and coordinator.planning:
                    coordinator.forget_checkpoints(rid)
                return None
        step = (
            self._step
            if sources is None
            else functools.partial(self._copy_step, sources)
        )
        # Every step is a transaction: a manager that raises leaves the
        # pool, the tables, the keys and the events as they were.
        pool = self.block_pool
        states = coordinator.request_state(rid)
        pool.begin()
        try:
            new_blocks = step(
                request, running, skipping, attach, processed, num_tokens, cache_to
            )
        except BaseException:
            # A manager that raised is reported as a PluginError naming it
            # (see KVCacheCoordinator.plugin_error); the step is undone first.
            pool.rollback()
            coordinator.restore_request_state(rid, states)
            if shed is not None:
                # The states were recorded after the shed.
                coordinator.restore_checkpoints(rid, shed)
            if not running and coordinator.planning:
                # The states were recorded after plan_checkpoints.
                coordinator.forget_checkpoints(rid)
            raise
        pool.commit()
        request.status = RequestStatus.RUNNING
        if held is not request:
            self._requests[rid] = request
        if sources is not None:
            copies = self._copies(
                rid, sources, request.num_computed_tokens + num_new_computed_tokens
            )
            return KVCacheBlocks(
                new_blocks
                if new_blocks is not None
                else self.empty_kv_cache_blocks.blocks,
                copies,
            )
        if new_blocks is None:
            return self.empty_kv_cache_blocks
        return self.create_kv_cache_blocks(new_blocks)

    def _copy_step(
        self,
        sources: list[tuple[int, KVCacheBlock, int]],
        request: Request,
        running: bool,
        skipping: bool,
        attach: tuple[list[KVCacheBlock], ...],
        num_computed: int,
        num_tokens: int,
        cache_to: int,
    ) -> tuple[list[KVCacheBlock], ...] | None:
        """:meth:`_step` for an admission with copy-on-write sources: each
        source is held for the step (so this step's allocation cannot evict
        it) and released after; its content stays until the copy runs,
        since no block is written before the forward pass."""
        pool = self.block_pool
        held = [src for _, src, _ in sources]
        pool.touch(held)
        new_blocks = self._step(
            request, running, skipping, attach, num_computed, num_tokens, cache_to
        )
        pool.free_blocks(held)
        return new_blocks

    def _copies(
        self,
        rid: str,
        sources: list[tuple[int, KVCacheBlock, int]],
        num_hit_tokens: int,
    ) -> tuple[BlockCopy, ...]:
        """The copies of an admission: each source into the fresh block at
        its position."""
        out = []
        for gid, src, num_tokens in sources:
            manager = self._managers[gid]
            dst = manager.req_to_blocks[rid][num_hit_tokens // manager.block_size]
            out.append(BlockCopy(gid, src.block_id, dst.block_id, num_tokens))
        return tuple(out)

    def _check_engine_keywords(
        self, request: Request, engine: Mapping[str, object]
    ) -> tuple[int, bool]:
        """The checked engine keywords: (external tokens, full sequence)."""
        unknown = sorted(set(engine) - _ENGINE_KEYWORDS)
        if unknown:
            msg = (
                f"allocate_slots got unexpected keyword argument(s) "
                f"{', '.join(unknown)}; the engine keywords are "
                f"{', '.join(sorted(_ENGINE_KEYWORDS))}"
            )
            raise KvcoreTypeError(msg)
        num_external = engine.get("num_external_computed_tokens", 0)
        num_encoder = engine.get("num_encoder_tokens", 0)
        full_sequence_must_fit = engine.get("full_sequence_must_fit", False)
        self._check_external(request, num_external, num_encoder, full_sequence_must_fit)
        return cast(int, num_external), cast(bool, full_sequence_must_fit)

    def _check_external(
        self,
        request: Request,
        num_external: object,
        num_encoder: object,
        full_sequence_must_fit: object,
    ) -> None:
        rid = request.request_id
        if type(num_external) is not int or num_external < 0:
            msg = (
                f"allocate_slots for request {rid!r}: num_external_computed_tokens "
                f"must be a non-negative int, got {num_external!r}"
            )
            raise InvalidRequestError(msg)
        if type(num_encoder) is not int or num_encoder < 0:
            msg = (
                f"allocate_slots for request {rid!r}: num_encoder_tokens must be a "
                f"non-negative int, got {num_encoder!r}"
            )
            raise InvalidRequestError(msg)
        if num_encoder:
            msg = (
                f"allocate_slots for request {rid!r}: {num_encoder} encoder tokens, "
                "but kvcore has no cross-attention kind to hold them; pass "
                "num_encoder_tokens=0 (decoder-only plans)"
            )
            raise InvalidRequestError(msg)
        if type(full_sequence_must_fit) is not bool:
            msg = (
                f"allocate_slots for request {rid!r}: full_sequence_must_fit must "
                f"be a bool, got {full_sequence_must_fit!r}"
            )
            raise InvalidRequestError(msg)
        if num_external and request.request_id in self._requests:
            msg = (
                f"allocate_slots for request {rid!r}: {num_external} external "
                "computed tokens, but the request already holds blocks; a KV "
                "connector's tokens attach only when the request is admitted"
            )
            raise InvalidRequestError(msg)

    def _full_sequence_blocks(
        self,
        request: Request,
        num_tokens: int,
        attach: Sequence[Sequence[KVCacheBlock]],
    ) -> int:
        """Free blocks the request draws from the pool, at its peak, to cover
        ``num_tokens`` with ``attach`` (its admission blocks, or nothing for
        a request that holds blocks).  A group whose kind skips positions
        holds at most its per-request bound of blocks at once (blocks it
        holds now count toward that bound); other groups hold every block."""
        rid = request.request_id
        total = 0
        empty: tuple[KVCacheBlock, ...] = ()
        for gid, manager in enumerate(self._managers):
            computed = attach[gid] if attach else empty
            try:
                need = _count(
                    manager.get_num_blocks_to_allocate(rid, num_tokens, computed)
                )
            except Exception as exc:
                err = self.coordinator.plugin_error(
                    gid, "get_num_blocks_to_allocate", exc
                )
                raise err from exc
            spec = manager.kv_cache_spec
            if manager.skips_blocks and manager.block_size == spec.block_size:
                held = manager.req_to_blocks.get(rid, empty)
                live = sum(1 for b in held if not b.is_null)
                bound = spec.max_num_blocks_per_request(num_tokens) - live
                need = min(need, bound if bound > 0 else 0)
            total += need
        return total

    def can_fit_full_sequence(
        self,
        request: Request,
        num_tokens: int | None = None,
        *,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_new_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> bool:
        """Whether the free blocks could hold the request's whole sequence now.

        :param num_tokens: the sequence length (default ``request.num_tokens``;
            an engine passes prompt + max tokens); capped at ``max_model_len``.
        :param new_computed_blocks: the hit the request would attach (from
            :meth:`get_computed_blocks`), with ``num_new_computed_tokens``.
        :param num_external_computed_tokens: tokens a KV connector would load.

        Nothing changes.  The count is the one ``full_sequence_must_fit``
        applies; it does not include the current step's lookahead slots.
        """
        if not isinstance(request, Request):
            raise _not_a_request(request)
        rid = request.request_id
        if num_tokens is None:
            num_tokens = request.num_tokens
        if type(num_tokens) is not int or num_tokens <= 0:
            msg = (
                f"can_fit_full_sequence for request {rid!r}: num_tokens must be a "
                f"positive int, got {num_tokens!r}"
            )
            raise InvalidRequestError(msg)
        _check_counts(rid, num_new_computed_tokens, 0)
        self._check_external(request, num_external_computed_tokens, 0, False)
        attach: tuple[list[KVCacheBlock], ...] = ()
        if rid not in self._requests:
            hit = (
                new_computed_blocks.blocks
                if new_computed_blocks is not None and any(new_computed_blocks.blocks)
                else self.empty_kv_cache_blocks.blocks
            )
            if len(hit) != self.num_kv_cache_groups:
                msg = (
                    f"can_fit_full_sequence for request {rid!r}: the hit has "
                    f"{len(hit)} block lists for {self.num_kv_cache_groups} groups"
                )
                raise InvalidRequestError(msg)
            held = 0
            if self.coordinator.partial_groups and num_new_computed_tokens:
                # A copy-on-write source is not attached (a fresh block takes
                # its place) but is held while the step runs.
                hit, sources = split_copy_sources(
                    hit, self.coordinator.partial_groups, num_new_computed_tokens
                )
                held = sum(1 for _, src, _ in sources if src.ref_cnt == 0)
            attach = self.coordinator.admission_blocks(
                hit, num_new_computed_tokens + num_external_computed_tokens
            )
        elif new_computed_blocks is not None and any(new_computed_blocks.blocks):
            msg = (
                f"can_fit_full_sequence for request {rid!r}: the request already "
                "holds blocks; a prefix hit attaches only at admission"
            )
            raise InvalidRequestError(msg)
        else:
            held = 0
        full = min(num_tokens, self.max_model_len)
        need = self._full_sequence_blocks(request, full, attach) + held
        return need <= self.block_pool.free_queue.num_free

    def _step(
        self,
        request: Request,
        running: bool,
        skipping: bool,
        attach: tuple[list[KVCacheBlock], ...],
        num_computed: int,
        num_tokens: int,
        cache_to: int,
    ) -> tuple[list[KVCacheBlock], ...] | None:
        """The changes of one validated allocate_slots step (``num_computed``:
        the processed tokens, below which skipped blocks are released)."""
        coordinator = self.coordinator
        rid = request.request_id
        if skipping:
            coordinator.remove_skipped_blocks(rid, num_computed)
        new_blocks: tuple[list[KVCacheBlock], ...] | None
        if running:
            new_blocks = coordinator.grow(rid, num_tokens)
        else:
            coordinator.add_computed_blocks(rid, attach)
            new_blocks = coordinator.allocate_new_blocks(rid, num_tokens)
        if cache_to >= 0:
            coordinator.cache_blocks(request, cache_to)
        return new_blocks

    def _check_same_request(self, held: Request, request: Request) -> None:
        """A live request id belongs to the request that holds its blocks; a
        request object with the same id and the same tokens stands for it,
        one with other tokens is refused."""
        if (
            held.all_token_ids == request.all_token_ids
            and held.cache_salt == request.cache_salt
            and held.lora_name == request.lora_name
        ):
            return
        rid = request.request_id
        msg = (
            f"request id {rid!r} already holds blocks for another request (other "
            "tokens, cache salt or LoRA); free it before reusing its id, or give "
            "the new request its own id"
        )
        raise InvalidRequestError(msg)

    def _check_hit(
        self,
        request: Request,
        hit: KVCacheBlocks | None,
        computed: tuple[Sequence[KVCacheBlock], ...] | None,
        num_tokens: int,
    ) -> None:
        """A prefix hit may attach only to a new request, as one block list
        per group covering exactly ``num_tokens`` tokens, with every block
        still holding this request's prefix (a hit looked up earlier may
        have been evicted since).  The hit this manager's lookup returned
        for the request, with no key dropped from the pool since, is known
        to hold it: its blocks are not checked one by one."""
        rid = request.request_id
        pool = self.block_pool
        lookup = None if hit is None else hit._lookup
        fresh = (
            lookup is not None
            and lookup[0] is pool
            and lookup[1] == pool.evictions
            and lookup[2] is request
            and lookup[3] is computed
        )
        coordinator = self.coordinator
        if rid in self._requests:
            msg = (
                f"request {rid!r} already holds blocks; prefix hits attach only "
                "when a request is first scheduled"
            )
            raise InvalidRequestError(msg)
        if num_tokens % coordinator.cache_hit_alignment:
            msg = (
                f"request {rid!r}: {num_tokens} computed tokens break the cache-hit "
                f"alignment of {coordinator.cache_hit_alignment} tokens; pass the hit "
                "length get_computed_blocks returned"
            )
            raise InvalidRequestError(msg)
        if computed is None or len(computed) != self.num_kv_cache_groups:
            got = "no blocks" if computed is None else f"{len(computed)} block lists"
            msg = (
                f"request {rid!r}: a hit of {num_tokens} tokens came with {got}; pass "
                f"the blocks get_computed_blocks returned (one list per each of the "
                f"{self.num_kv_cache_groups} groups)"
            )
            raise InvalidRequestError(msg)
        self._check_hashing(request)
        own = pool.blocks
        for gid, blocks in enumerate(() if fresh else computed):
            for block in blocks:
                if not _owned(own, block):
                    msg = (
                        f"request {rid!r}: the hit's blocks for group {gid} do not "
                        "belong to this manager's block pool (they came from another "
                        "KVCacheManager, or were built by hand); attach only the hit "
                        "this manager's get_computed_blocks returned"
                    )
                    raise InvalidRequestError(msg)
        for gid, (manager, blocks) in enumerate(
            zip(self._managers, computed, strict=True)
        ):
            if not manager.caching:
                if blocks:
                    msg = (
                        f"request {rid!r}: group {gid} is not prefix-cacheable but "
                        f"the hit holds {len(blocks)} blocks for it"
                    )
                    raise InvalidRequestError(msg)
                continue
            # A partial-hit group's hit may end inside its last block, a
            # copy source.
            partial = gid in coordinator.partial_units and bool(
                num_tokens % manager.block_size
            )
            expected = -(-num_tokens // manager.block_size)
            if len(blocks) * manager.block_size != num_tokens and not (
                partial and len(blocks) == expected
            ):
                msg = (
                    f"request {rid!r}: the hit covers {num_tokens} tokens but group "
                    f"{gid} holds {len(blocks)} blocks of {manager.block_size} tokens"
                )
                raise InvalidRequestError(msg)
            if not manager.hit_serves(blocks):
                msg = (
                    f"request {rid!r}: the hit's blocks for group {gid} "
                    f"({manager.kv_cache_spec.kind}) lack what the next token reads "
                    "(a window or state cut off by truncation); attach the hit "
                    "get_computed_blocks returned, uncut"
                )
                raise InvalidRequestError(msg)
            if fresh:
                continue
            chunks = request.block_hashes
            key_of = manager.block_hash
            for i, block in enumerate(blocks):
                if block.is_null:
                    continue
                if partial and i == expected - 1:
                    end = num_tokens // self.hash_block_size - 1
                    chunk = chunks[end] if 0 <= end < len(chunks) else None
                    if copy_source_valid(
                        self.block_pool, block, gid, key_of(chunks, i), chunk
                    ):
                        continue
                    msg = (
                        f"request {rid!r}: the copy source block {block.block_id} "
                        f"of group {gid} no longer holds this request's prefix (it "
                        "was evicted after the lookup); call get_computed_blocks "
                        "again right before allocate_slots"
                    )
                    raise InvalidRequestError(msg)
                if block.key_group != gid or block.key_hash != key_of(chunks, i):
                    msg = (
                        f"request {rid!r}: hit block {block.block_id} of group {gid} "
                        "no longer holds this request's prefix (it was evicted after "
                        "the lookup); call get_computed_blocks again right before "
                        "allocate_slots"
                    )
                    raise InvalidRequestError(msg)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Hash the request's blocks filled by ``num_computed_tokens``."""
        if not isinstance(request, Request):
            raise _not_a_request(request)
        _check_tokens(
            f"cache_blocks for request {request.request_id!r}: num_computed_tokens",
            num_computed_tokens,
        )
        if self.enable_caching:
            self._require_live(request.request_id)
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def free(self, request: Request | str) -> None:
        """Release every block the request holds (tail blocks evicted first)
        and mark the request ``FINISHED``."""
        if isinstance(request, str):
            rid = request
        elif isinstance(request, Request):
            rid = request.request_id
        else:
            raise _not_a_request(request)
        requests = self._requests
        held = requests.get(rid)
        if held is None:
            self._require_live(rid)
        coordinator = self.coordinator
        pool = self.block_pool
        states = coordinator.request_state(rid)
        pool.begin()
        try:
            coordinator.free(rid)
        except BaseException:
            # A manager that raised is reported as a PluginError naming it
            # (see KVCacheCoordinator.plugin_error); the step is undone first.
            pool.rollback()
            coordinator.restore_request_state(rid, states)
            raise
        pool.commit()
        if coordinator.partial is not None:
            coordinator.partial.forget(rid)
        del requests[rid]
        assert held is not None
        held.status = _FINISHED
        if request is not held and isinstance(request, Request):
            request.status = _FINISHED

    def remove_skipped_blocks(self, request: Request | str, num_tokens: int) -> None:
        """Release the blocks the request no longer reads below
        ``num_tokens`` processed tokens (those no step in flight computes),
        e.g. once an asynchronous step has completed; the positions become
        the null block.  Releases nothing for plans with no window or
        state group."""
        rid = request if isinstance(request, str) else request.request_id
        _check_tokens(
            f"remove_skipped_blocks for request {rid!r}: num_tokens", num_tokens
        )
        self._require_live(rid)
        coordinator = self.coordinator
        if not coordinator.skipping or not num_tokens:
            return
        pool = self.block_pool
        states = coordinator.request_state(rid)
        pool.begin()
        try:
            coordinator.remove_skipped_blocks(rid, num_tokens)
        except BaseException:
            pool.rollback()
            coordinator.restore_request_state(rid, states)
            raise
        pool.commit()

    def pop_blocks_for_free(self, request: Request | str) -> list[KVCacheBlock]:
        """Finish the request (``FINISHED``, its id free for reuse) but keep
        its blocks out of the pool: a step still in flight may read them.
        Pass the list to :meth:`release_blocks` once that step completes;
        until then no other request can be given them."""
        if isinstance(request, str):
            rid = request
        elif isinstance(request, Request):
            rid = request.request_id
        else:
            raise _not_a_request(request)
        held = self._requests.get(rid)
        if held is None:
            self._require_live(rid)
        coordinator = self.coordinator
        pool = self.block_pool
        states = coordinator.request_state(rid)
        pool.begin()
        try:
            blocks = coordinator.pop_for_free(rid)
        except BaseException:
            pool.rollback()
            coordinator.restore_request_state(rid, states)
            raise
        pool.commit()
        if coordinator.partial is not None:
            coordinator.partial.forget(rid)
        del self._requests[rid]
        assert held is not None
        held.status = _FINISHED
        if request is not held and isinstance(request, Request):
            request.status = _FINISHED
        return blocks

    def release_blocks(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Return the blocks :meth:`pop_blocks_for_free` handed out to the
        pool, each list once (tail first; cached prefixes stay cached).  A
        block released twice is refused and nothing changes."""
        given: object = blocks  # checked: engines pass anything
        if not isinstance(given, (list, tuple)) or not all(
            _owned(self.block_pool.blocks, b) for b in given
        ):
            msg = (
                "release_blocks: pass the list pop_blocks_for_free returned "
                "(blocks of this manager's pool)"
            )
            raise KvcoreTypeError(msg)
        pool = self.block_pool
        pool.begin()
        try:
            pool.free_table(blocks)
        except BaseException:
            pool.rollback()
            raise
        pool.commit()

    def _require_live(self, rid: str) -> None:
        if rid not in self._requests:
            msg = (
                f"request {rid!r} holds no blocks: it was never allocated or was "
                "already freed"
            )
            raise UnknownRequestError(msg)

    # -- block lists ------------------------------------------------------------

    def create_kv_cache_blocks(
        self, blocks: tuple[Sequence[KVCacheBlock], ...]
    ) -> KVCacheBlocks:
        """Wrap per-group block lists (the shared empty instance if all empty)."""
        for group in blocks:
            if group:
                return KVCacheBlocks(blocks)
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
        _check_tokens(
            "truncate_computed_blocks: num_computed_tokens", num_computed_tokens
        )
        out: list[list[KVCacheBlock]] = []
        for gid, (manager, group_blocks) in enumerate(
            zip(self._managers, blocks.blocks, strict=True)
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
            if unit is not None and not num_computed_tokens % unit:
                # A partial-hit group: the block at the cut is a copy source.
                keep = -(-num_computed_tokens // manager.block_size)
                if keep > len(group_blocks):
                    msg = (
                        f"cannot truncate group {gid}'s hit of {len(group_blocks)} "
                        f"blocks to {num_computed_tokens} tokens: it is shorter"
                    )
                    raise InvalidRequestError(msg)
                out.append(list(group_blocks[:keep]))
                continue
            if manager.position_indexed:
                if num_computed_tokens % manager.block_size:
                    msg = (
                        f"cannot truncate group {gid}'s hit to {num_computed_tokens} "
                        f"tokens: not a multiple of its block size {manager.block_size}"
                    )
                    raise InvalidRequestError(msg)
                if num_computed_tokens // manager.block_size > len(group_blocks):
                    msg = (
                        f"cannot truncate group {gid}'s hit of {len(group_blocks)} "
                        f"blocks to {num_computed_tokens} tokens: it is shorter"
                    )
                    raise InvalidRequestError(msg)
            out.append(manager.truncate_hit(list(group_blocks), num_computed_tokens))
        return self.create_kv_cache_blocks(tuple(out))

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        self._require_live(request_id)
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Every group's block ids for the request (0 is the null block)."""
        return self.get_blocks(request_id).get_block_ids()

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
                block.block_id
                for blocks in manager.req_to_blocks.values()
                for block in blocks
                if not block.is_null
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

    def evict_blocks(self, block_ids: Iterable[int]) -> int:
        """Drop the prefix-cache key of each chosen block (content an engine
        knows is stale, e.g. a failed load); returns how many keys went.  A
        block in use stays with its holders, a free one is reused first; a
        block without a key or the null block is passed over.  Ids outside
        the pool are refused before anything changes."""
        pool = self.block_pool
        ids = list(dict.fromkeys(block_ids))
        bad = [b for b in ids if type(b) is not int or not 0 <= b < pool.num_blocks]
        if bad:
            msg = (
                f"evict_blocks: block ids {bad[:5]} are not blocks of this pool "
                f"(0 to {pool.num_blocks - 1}); pass ids the manager handed out"
            )
            raise InvalidRequestError(msg)
        blocks = pool.blocks
        before = pool.evictions
        pool.begin()
        try:
            for bid in ids:
                pool.drop_from_cache(blocks[bid])
        except BaseException:
            pool.rollback()
            raise
        pool.commit()
        return pool.evictions - before

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix-hit statistics since the last call (or since the
        manager was built, or its prefix cache reset), and start counting
        afresh: an engine reads one interval's hit rate per call."""
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only while no request holds blocks."""
        ok = self.block_pool.reset_prefix_cache()
        if ok:
            self.prefix_cache_stats = PrefixCacheStats()
        return ok

    def take_events(self) -> list[KVCacheEvent]:
        """KV-cache events (stored / removed / cleared) since the last call."""
        return self.block_pool.take_events()


def _public_methods(cls: type) -> list[str]:
    """Names of ``cls``'s public instance methods (its own and inherited)."""
    names: dict[str, None] = {}
    for klass in cls.__mro__:
        if klass is object:
            continue
        for name, value in vars(klass).items():
            if not name.startswith("_") and inspect.isfunction(value):
                names[name] = None
    return list(names)


def _locked(method: Callable[..., Any], lock: threading.RLock) -> Callable[..., Any]:
    """``method`` run while holding ``lock``."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return method(*args, **kwargs)

    return run


def _owned(own: list[KVCacheBlock], block: object) -> bool:
    """Whether ``block`` is one of the pool's own block objects."""
    if not isinstance(block, KVCacheBlock):
        return False
    bid = block.block_id
    return 0 <= bid < len(own) and own[bid] is block


def _check_counts(
    rid: str, num_new_computed_tokens: object, num_lookahead: object
) -> None:
    for name, value in (
        ("num_new_computed_tokens", num_new_computed_tokens),
        ("num_lookahead_tokens", num_lookahead),
    ):
        if type(value) is not int or value < 0:
            msg = (
                f"allocate_slots for request {rid!r}: {name} must be a "
                f"non-negative int, got {value!r}"
            )
            raise _wrong(value, msg)


def _step_limits(rid: str, engine: Mapping[str, object]) -> tuple[int, int]:
    """The checked ``num_in_flight_tokens`` and ``reserved_blocks``."""
    out = []
    for name in ("num_in_flight_tokens", "reserved_blocks"):
        value = engine.get(name, 0)
        if type(value) is not int or value < 0:
            msg = (
                f"allocate_slots for request {rid!r}: {name} must be a "
                f"non-negative int, got {value!r}"
            )
            raise _wrong(value, msg)
        out.append(value)
    return out[0], out[1]


def _wrong(value: object, msg: str) -> InvalidRequestError:
    """The error for a count that breaks the rule: a TypeError as well when
    it is no int at all (a float, a bool, a string)."""
    if type(value) is int:
        return InvalidRequestError(msg)
    return InvalidRequestTypeError(msg)


def _check_tokens(what: str, value: object) -> None:
    """A token count argument: a non-negative int."""
    if type(value) is not int or value < 0:
        msg = f"{what} must be a non-negative int number of tokens, got {value!r}"
        raise _wrong(value, msg)


def _require_type(
    name: str, value: object, expected: type, what: str, *, exact: bool = False
) -> None:
    ok = type(value) is expected if exact else isinstance(value, expected)
    if not ok:
        shown = repr(value)
        if len(shown) > 60:
            shown = "a value"
        msg = f"KVCacheManager: {name} must be {what}, got {shown} ({type(value).__name__})"
        raise KvcoreTypeError(msg)


def _positive_int(name: str, value: object) -> None:
    if type(value) is not int:
        msg = (
            f"KVCacheManager: {name} must be a positive int, got {value!r} "
            f"({type(value).__name__})"
        )
        raise KvcoreTypeError(msg)
    if value < 1:
        msg = f"KVCacheManager: {name} must be a positive int, got {value!r}"
        raise InvalidRequestError(msg)


def _not_a_request(value: object) -> KvcoreTypeError:
    msg = (
        f"expected a kvcore.coordinator.Request, got {type(value).__name__}; build "
        "requests with Request(request_id, prompt_token_ids, hash_block_size=...)"
    )
    return KvcoreTypeError(msg)
