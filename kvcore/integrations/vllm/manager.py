"""The KV-cache manager vLLM's scheduler uses as its own, on kvcore.

vLLM's types go in and out: the scheduler's ``Request`` (read where it is:
ids, block hashes, token counts; nothing is copied per request), vLLM's
``KVCacheBlocks`` and ``PrefixCacheStats``.  kvcore's coordinator owns the
blocks, the prefix cache and every group's table (lists of block ids); vLLM
gets and gives block objects, the pool's read-only views
(:meth:`BlockPool.block`).

Blocks are released on a processed-tokens basis: what a running request no
longer reads is released at ``num_computed_tokens - num_in_flight_tokens``
(or when the scheduler calls :meth:`KVCacheManager.remove_skipped_blocks`
with its processed count), never on tokens a step in flight still computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcore.coordinator.blocks import BlockId, KVCacheBlock
from kvcore.coordinator.coordinator import KVCacheCoordinator
from kvcore.coordinator.counted_release import overstated_release
from kvcore.coordinator.engine_calls import check_state_step, state_writes
from kvcore.coordinator.group_hits import find_longest_cache_hit_per_group
from kvcore.coordinator.headroom import BoundaryHeadroom
from kvcore.errors import InvalidRequestError, UnknownRequestError
from kvcore.integrations.vllm.events import to_vllm_events
from kvcore.integrations.vllm.lookahead import (
    UnsupportedFeatureError,
    reprefillable_tokens,
)
from kvcore.integrations.vllm.specs import admission_caps, to_kvcore_config
from kvcore.integrations.vllm.views import (
    BlockPoolView,
    PlannedRequest,
    ids_of,
    table_extensions,
    view_type,
    views_of,
)
from kvcore.registry import default_registry

__all__ = ["KVCacheManager", "UnsupportedFeatureError"]


class CoordinatorView:
    """The coordinator calls vLLM's scheduler makes directly."""

    enable_partial_hash_hits = False

    def __init__(self, owner: KVCacheManager, vllm_config: Any) -> None:
        self._owner = owner
        self.coordinator = owner.kvcore
        self.num_reprefillable_tokens = owner.num_reprefillable_tokens
        self.single_type_managers = tuple(
            view_type(vllm_group.kv_cache_spec)(
                manager, vllm_group.kv_cache_spec, owner.block_pool
            )
            for manager, vllm_group in zip(
                owner.kvcore.single_type_managers,
                vllm_config.kv_cache_groups,
                strict=True,
            )
        )

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        **_: Any,
    ) -> int:
        owner = self._owner
        hit = ids_of(new_computed_blocks)
        running = request_id in owner._live and not any(hit)
        attach = () if running else self.coordinator.admission_blocks(hit, 0)
        return owner._blocks_needed(request_id, running, attach, num_tokens)

    @property
    def full_attention_group_id(self) -> int | None:
        """The first full-attention group (the per-group hits' reference:
        full attention serves every length up to its hit), or None."""
        return self._owner._full_attention_group

    def find_longest_cache_hit_per_group(
        self, block_hashes: Sequence[Any], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], tuple[int, ...]]:
        """Each group's own hit (blocks, tokens), searched alone."""
        ids, lengths = find_longest_cache_hit_per_group(
            self.coordinator, block_hashes, max_cache_hit_length
        )
        pool = self.coordinator.block_pool
        return tuple(views_of(pool, group) for group in ids), lengths


class HybridCoordinatorView(CoordinatorView):
    """The view of a prefix-cached plan of several groups; it registers as
    vLLM's ``HybridKVCacheCoordinator``, which such a plan has on vLLM."""


def _full_attention_group(config: Any) -> int | None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    for gid, group in enumerate(config.kv_cache_groups):
        if isinstance(group.kv_cache_spec, FullAttentionSpec):
            return gid
    return None


def _coordinator_view(
    owner: KVCacheManager, config: Any, enable_caching: bool
) -> CoordinatorView:
    if not enable_caching or len(config.kv_cache_groups) < 2:
        return CoordinatorView(owner, config)
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator

    HybridKVCacheCoordinator.register(HybridCoordinatorView)
    return HybridCoordinatorView(owner, config)


class KVCacheManager:
    """vLLM 0.33's ``KVCacheManager``, on kvcore (same constructor)."""

    def __init__(
        self,
        kv_cache_config: Any,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: Any = None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
    ) -> None:
        if pcp_world_size != 1:
            msg = (
                "kvcore.integrations.vllm: prefill context parallelism "
                f"(pcp_world_size={pcp_world_size}) is not supported; unset "
                "KVCORE_VLLM or run with pcp_world_size=1"
            )
            raise UnsupportedFeatureError(msg)
        if watermark < 0:
            msg = f"KVCacheManager: watermark must be non-negative, got {watermark}"
            raise InvalidRequestError(msg)
        #: Trailing computed tokens no cache call keys (multi-module MTP
        #: may prefill them again); see kvcore.integrations.vllm.lookahead.
        self.num_reprefillable_tokens = reprefillable_tokens(
            kv_cache_config,
            enable_caching=enable_caching,
            use_eagle=use_eagle,
            enable_kv_cache_events=enable_kv_cache_events,
            scheduler_block_size=scheduler_block_size,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens,
            num_prefill_lookahead=num_prefill_lookahead,
        )
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.metrics.stats import PrefixCacheStats

        self._blocks_cls = KVCacheBlocks
        self._stats_cls = PrefixCacheStats
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.metrics_collector = metrics_collector
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.kv_cache_config = kv_cache_config
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.kvcore = KVCacheCoordinator(
            to_kvcore_config(
                kv_cache_config,
                scheduler_block_size=scheduler_block_size,
                hash_block_size=hash_block_size,
                max_model_len=max_model_len,
                enable_caching=enable_caching,
            ),
            max_model_len=max_model_len,
            enable_caching=enable_caching,
            hash_block_size=hash_block_size,
            scheduler_block_size=scheduler_block_size,
            registry=default_registry(),
            dcp=dcp_world_size,
            use_eagle=use_eagle,
            enable_kv_cache_events=enable_kv_cache_events,
            enable_partial_hits=False,
        )
        self.block_pool = BlockPoolView(self.kvcore.block_pool, self.kvcore.free_popped)
        self._full_attention_group = _full_attention_group(kv_cache_config)
        self._has_states = bool(getattr(kv_cache_config, "has_mamba_layers", False))
        self.coordinator = _coordinator_view(self, kv_cache_config, enable_caching)
        self.mamba_shared_prefix_checkpoint = False
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.empty_kv_cache_blocks = KVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups))
        )
        #: The requests that hold blocks, by id.
        self._live: dict[str, Any] = {}
        #: How far each looked-up request's prompt is shared (the longest
        #: lookup of the groups that keep every block), for its admission.
        self._shared: dict[str, int] = {}
        #: Where each live request's latest step ended, and what admissions
        #: leave free for the running states' next block boundary (see
        #: kvcore.coordinator.headroom).
        self._ends: dict[str, int] = {}
        sizes = [m.block_size for m in self.kvcore.single_type_managers]
        self._headroom = BoundaryHeadroom.of(
            zip(sizes, self.kvcore.boundary_overlaps, strict=True)
        )
        from vllm.v1.request import RequestStatus

        #: vLLM's status of a request that steps (read once: the headroom
        #: asks it of every live request).
        self._running_status = RequestStatus.RUNNING
        #: Live requests given slots since the step began: one freed while
        #: still RUNNING is a preemption in its scheduling step, whose
        #: forward never runs (see :meth:`free`).
        self._scheduled: set[str] = set()
        # vLLM's workers zero new blocks of attention groups (not rings)
        # when the config asks; the scheduler drains their ids each step.
        from vllm.v1.kv_cache_interface import AttentionSpec, CircularBufferSpec

        self._zeroed_groups: tuple[int, ...] = (
            tuple(
                gid
                for gid, group in enumerate(kv_cache_config.kv_cache_groups)
                if isinstance(group.kv_cache_spec, AttentionSpec)
                and not isinstance(group.kv_cache_spec, CircularBufferSpec)
            )
            if getattr(kv_cache_config, "needs_kv_cache_zeroing", False)
            else ()
        )
        self._new_block_ids: list[int] = []
        #: vLLM's cap on each group's blocks in the check that a request's
        #: whole sequence fits (``full_sequence_must_fit``): a group that
        #: releases blocks as the request runs holds at most its window (or
        #: chunk) and the tokens in flight at once; None where uncapped.
        self._admission_caps = admission_caps(
            kv_cache_config,
            max_model_len if max_in_flight_tokens is None else max_in_flight_tokens,
            max_model_len,
        )

    # -- stats ------------------------------------------------------------------

    @property
    def usage(self) -> float:
        return self.kvcore.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> Any:
        """The prefix-cache stats since the last call (then reset)."""
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = self._stats_cls()
        return stats

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        assert self.prefix_cache_stats is not None
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens,
            num_hits=num_hits,
            preempted=request.num_preemptions > 0,
        )

    # -- lookups ----------------------------------------------------------------

    def get_computed_blocks(
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[Any, int, int]:
        """The prefix hit: (blocks, tokens, shared-prefix boundary).  The
        boundary is how far the token-indexed groups share the prompt where
        a state group holds no state that far (else 0): vLLM ends a chunk
        there, so the step's end state is kept where the next request that
        shares the prefix resumes."""
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        coordinator = self.kvcore
        blocks, length = coordinator.find_longest_cache_hit(
            request.block_hashes, max_cache_hit_length
        )
        shared = coordinator.last_shared_prefix
        if coordinator.planning:
            self._shared[request.request_id] = max(shared, length)
        boundary = shared if self._has_states and shared > length else 0
        if not length:
            return self.empty_kv_cache_blocks, 0, boundary
        return self._wrap(blocks), length, boundary

    def get_computed_blocks_for_connector(
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[Any, int, int, bool]:
        """The local hit for a request a KV connector may complete: on a
        hybrid plan with state groups, the full-attention group's own hit,
        flagged as diverged when another group's is shorter (the connector
        must load the rest, else the scheduler falls back to
        :meth:`get_computed_blocks`); when another group's hit is deeper,
        the common hit.  Otherwise the common hit, never diverged."""
        fa = self._full_attention_group
        if fa is None or not self._has_states or self.num_kv_cache_groups < 2:
            return *self.get_computed_blocks(request, max_cache_hit_length), False
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0, False
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        blocks, hits = find_longest_cache_hit_per_group(
            self.kvcore, request.block_hashes, max_cache_hit_length
        )
        num_local = hits[fa]
        if any(hit > num_local for hit in hits):
            # Full attention's tail was evicted below a deeper group's hit:
            # only the common length is resident in every group.
            return *self.get_computed_blocks(request, max_cache_hit_length), False
        if not num_local:
            return self.empty_kv_cache_blocks, 0, 0, False
        return self._wrap(blocks), num_local, 0, min(hits) < num_local

    # -- allocation -------------------------------------------------------------

    def _blocks_needed(
        self,
        rid: str,
        running: bool,
        attach: Sequence[Sequence[BlockId]],
        num_tokens: int,
        num_encoder: int = 0,
        caps: tuple[int | None, ...] | None = None,
    ) -> int:
        """Blocks a step to ``num_tokens`` takes: a running request's
        growth, else an admission's with ``attach`` (its admission blocks);
        ``caps`` as the coordinator takes them."""
        coordinator = self.kvcore
        if running:
            return coordinator.get_num_blocks_to_grow(rid, num_tokens, caps)
        return coordinator.get_num_blocks_to_allocate(
            rid, num_tokens, attach, num_encoder, caps
        )

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> Any:
        """Slots for ``num_new_tokens`` more tokens (vLLM's contract), or
        None when the free blocks, less ``reserved_blocks`` and the
        watermark, cannot hold them (nothing changes then)."""
        from vllm.v1.request import RequestStatus

        if (
            num_new_tokens == 0
            and num_external_computed_tokens == 0
            and num_new_computed_tokens == 0
        ):
            msg = (
                f"allocate_slots for request {request.request_id!r}: no new "
                "tokens and no computed tokens to adopt"
            )
            raise InvalidRequestError(msg)
        if num_encoder_tokens and request.request_id in self._live:
            msg = (
                f"allocate_slots for request {request.request_id!r}: "
                f"{num_encoder_tokens} encoder tokens, but the request already "
                "holds blocks; kvcore gives cross-attention its blocks only when "
                "the request is admitted"
            )
            raise InvalidRequestError(msg)
        coordinator = self.kvcore
        rid = request.request_id
        unwritten = coordinator.unwritten
        hit = ids_of(
            new_computed_blocks.blocks
            if new_computed_blocks is not None
            else self.empty_kv_cache_blocks.blocks
        )
        has_hit = any(hit)
        if unwritten.by_writer and not unwritten.admits(rid, hit if has_hit else None):
            return None  # its hit's state is written by a step not yet run
        num_local = request.num_computed_tokens + num_new_computed_tokens
        total = min(num_local + num_external_computed_tokens, self.max_model_len)
        watermark = 0
        if has_scheduled_reqs and request.status in (
            RequestStatus.WAITING,
            RequestStatus.PREEMPTED,
        ):
            watermark = self.watermark_blocks
        running = rid in self._live and not has_hit and not num_external_computed_tokens
        if running and self._headroom is not None and request.num_in_flight_tokens:
            self._headroom.saw_in_flight(request.num_in_flight_tokens)
        attach: tuple[list[BlockId], ...] = ()
        if not running:
            attach = coordinator.admission_blocks(hit, total)
        planned = not running and bool(coordinator.planning)
        if planned:
            # Where the request keeps windows and states for later hits, as
            # kvcore's own admission plans them (a refusal forgets them).
            shared = max(self._shared.pop(rid, 0), total)
            planning: Any = PlannedRequest(request, shared)
        try:
            if planned:
                coordinator.plan_checkpoints(planning, total)
            out = self._admit_or_grow(
                request,
                running,
                attach,
                total,
                watermark,
                hit,
                num_new_tokens,
                num_lookahead_tokens,
                num_encoder_tokens,
                full_sequence_must_fit,
                reserved_blocks,
                delay_cache_blocks,
                skip_zeroing_group_ids,
            )
        except BaseException:
            if planned:
                coordinator.forget_checkpoints(rid)
            raise
        if out is None and planned:
            coordinator.forget_checkpoints(rid)
        return out

    def _admit_or_grow(
        self,
        request: Any,
        running: bool,
        attach: tuple[list[BlockId], ...],
        total: int,
        watermark: int,
        hit: Sequence[Sequence[BlockId]],
        num_new_tokens: int,
        num_lookahead_tokens: int,
        num_encoder_tokens: int,
        full_sequence_must_fit: bool,
        reserved_blocks: int,
        delay_cache_blocks: bool,
        skip_zeroing_group_ids: tuple[int, ...],
    ) -> Any:
        """:meth:`allocate_slots` once the request's hit is attached
        (``attach``) or it runs on (``running``): None when it does not fit."""
        coordinator = self.kvcore
        pool = coordinator.block_pool
        unwritten = coordinator.unwritten
        rid = request.request_id
        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            need_full = self._blocks_needed(
                rid, running, attach, full, num_encoder_tokens, self._admission_caps
            )
            if need_full > self._room(rid, need_full, watermark):
                return None
        num_main = total + num_new_tokens
        num_slots = min(num_main + num_lookahead_tokens, self.max_model_len)
        # Only what no step in flight reads: the processed tokens.
        processed = max(0, total - request.num_in_flight_tokens)
        if running and coordinator.skipping and processed:
            pool.begin()
            try:
                coordinator.remove_skipped_blocks(rid, processed)
            except BaseException:
                pool.rollback()
                raise
            pool.commit()
        need = self._blocks_needed(rid, running, attach, num_slots, num_encoder_tokens)
        kept = reserved_blocks + watermark
        shed = None
        if need > self._room(rid, need, kept):
            fit = self._shed_to_fit(
                rid, running, attach, (num_slots, num_encoder_tokens, processed), kept
            )
            if fit is None:
                return None
            shed, need = fit
        cache_to = -1
        if self.enable_caching and not delay_cache_blocks:
            cache_to = max(
                0, min(num_main, request.num_tokens) - self.num_reprefillable_tokens
            )
        before = self._held_ids(rid, hit) if self._zeroed_groups else None
        managers = coordinator.single_type_managers
        if running:
            lengths = [len(m.req_to_blocks.get(rid, ())) for m in managers]
        keyed_from = unwritten.keyed_so_far(rid) if unwritten.managers else ()
        pool.begin()
        try:
            if running:
                if shed is not None and processed:
                    # The shed windows leave the table now; the step fitted
                    # by the blocks their release was counted to return.
                    coordinator.remove_skipped_blocks(rid, processed)
                    if pool.get_num_free_blocks() - kept < need:
                        step = (rid, processed)
                        raise overstated_release(coordinator, step, need + kept)
                    if before is not None:
                        # Released blocks the grow hands back are new.
                        before = self._held_ids(rid, hit)
                new = coordinator.grow(rid, num_slots)
                if new is not None:
                    new = table_extensions(managers, rid, lengths, new)
            else:
                coordinator.add_computed_blocks(rid, attach, request.block_hashes)
                new = coordinator.allocate_new_blocks(
                    rid, num_slots, num_encoder_tokens
                )
            if cache_to >= 0:
                coordinator.cache_blocks(request, cache_to)
        except BaseException:
            pool.rollback()
            if shed is not None:
                coordinator.restore_checkpoints(rid, shed)
            raise
        pool.commit()
        if unwritten.managers:
            # The step writes from its processed tokens on.
            unwritten.took(rid, new, keyed_from, processed)
        self._live[rid] = request
        self._ends[rid] = num_main
        self._scheduled.add(rid)
        if before is not None:
            self._record_zeroing(rid, before, total, skip_zeroing_group_ids)
        if new is None or not any(new):
            return self.empty_kv_cache_blocks
        return self._wrap(new)

    def _shed_to_fit(
        self,
        rid: str,
        running: bool,
        attach: tuple[list[BlockId], ...],
        tokens: tuple[int, int, int],
        kept: int,
    ) -> tuple[list[Any], int] | None:
        """A step that does not fit gives up the request's optional
        checkpoints (windows it keeps for later hits), as kvcore's own
        steps do: what was shed and the blocks the step then needs when it
        fits without them (a running request counting the blocks its
        release then returns), else None (they are restored).  ``tokens``:
        the step's slots, encoder tokens and processed tokens."""
        num_slots, num_encoder, processed = tokens
        coordinator = self.kvcore
        shed = coordinator.shed_checkpoints(rid) if coordinator.planning else None
        if shed is None:
            return None
        try:
            need = self._blocks_needed(rid, running, attach, num_slots, num_encoder)
            room = self._room(rid, need, kept)
            if running and processed:
                room += coordinator.count_freeable_skipped(rid, processed)
            if need <= room:
                return shed, need
        except BaseException:
            coordinator.restore_checkpoints(rid, shed)
            raise
        coordinator.restore_checkpoints(rid, shed)
        return None

    def _room(self, rid: str, need: int, kept: int) -> int:
        """The free blocks a step needing ``need`` may take: those the
        ``kept`` blocks (reserved, watermark) leave, less, for a request
        this manager does not hold (an admission), the running states'
        boundary headroom (see kvcore.coordinator.headroom)."""
        free = self.kvcore.block_pool.get_num_free_blocks() - kept
        if self._headroom is not None and rid not in self._live:
            free -= self._headroom.blocks(
                self._live, self._ends, free - need, self._steps
            )
        return free

    def _steps(self, request: Any) -> bool:
        """Whether a live request still steps: RUNNING in vLLM's scheduler (a
        finished request whose free a connector defers, or one waiting for
        remote KV or more streamed input, holds blocks without stepping)."""
        return bool(request.status == self._running_status)

    def _held_ids(self, rid: str, hit: Sequence[Sequence[BlockId]]) -> list[set[int]]:
        """Per zeroed group, the blocks the request holds or attaches now."""
        managers = self.kvcore.single_type_managers
        out = []
        for gid in self._zeroed_groups:
            ids = set(managers[gid].req_to_blocks.get(rid, ()))
            ids.update(hit[gid])
            out.append(ids)
        return out

    def _record_zeroing(
        self, rid: str, before: list[set[int]], total: int, skip: tuple[int, ...]
    ) -> None:
        """Record the step's fresh blocks for zeroing; a group a KV load
        fills (``skip``) keeps its blocks below ``total`` tokens unzeroed."""
        managers = self.kvcore.single_type_managers
        for gid, held in zip(self._zeroed_groups, before, strict=True):
            manager = managers[gid]
            loaded_to = -(-total // manager.block_size) if gid in skip else 0
            for pos, block in enumerate(manager.req_to_blocks.get(rid, ())):
                if not block or block in held or pos < loaded_to:
                    continue
                self._new_block_ids.append(block)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        if self.enable_caching and request.request_id in self._live:
            pool = self.kvcore.block_pool
            pool.begin()
            try:
                self.kvcore.cache_blocks(
                    request, max(0, num_computed_tokens - self.num_reprefillable_tokens)
                )
            except BaseException:
                pool.rollback()
                raise
            pool.commit()

    def free(self, request: Any) -> None:
        rid = request.request_id
        self._shared.pop(rid, None)
        if rid not in self._live:
            return
        pool = self.kvcore.block_pool
        pool.begin()
        try:
            self._forget_unwritten(request)
            self.kvcore.free(rid)
        except BaseException:
            pool.rollback()
            raise
        pool.commit()
        self.kvcore.unwritten.written(rid)
        self._forget_live(rid)

    def _forget_live(self, rid: str) -> None:
        self._live.pop(rid, None)
        self._ends.pop(rid, None)
        self._scheduled.discard(rid)

    def pop_blocks_for_free(self, request: Any) -> list[KVCacheBlock]:
        """The request's blocks, released from its tables but still held:
        the scheduler frees them (``free_blocks`` of the list reversed)
        once no step in flight reads them, which frees them as
        :meth:`free` would have then (see the coordinator's
        ``pop_for_free``).  One transaction: a group that raises leaves
        every table as it was."""
        rid = request.request_id
        self._shared.pop(rid, None)
        if rid not in self._live:
            return []
        pool = self.kvcore.block_pool
        pool.begin()
        try:
            self._forget_unwritten(request)
            out = self.kvcore.pop_for_free(rid)
        except BaseException:
            pool.rollback()
            raise
        pool.commit()
        self.kvcore.unwritten.written(rid)
        self._forget_live(rid)
        return views_of(pool, out)

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Release what the request no longer reads below the processed
        tokens (those no step in flight computes)."""
        coordinator = self.kvcore
        pool = coordinator.block_pool
        if (
            request_id not in self._live
            or not coordinator.skipping
            or (
                pool.journal is None
                and coordinator.releases_nothing(request_id, processed_computed_tokens)
            )
        ):
            return
        pool.begin()
        try:
            coordinator.remove_skipped_blocks(request_id, processed_computed_tokens)
        except BaseException:
            pool.rollback()
            raise
        pool.commit()

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.block_pool.evict_blocks(block_ids)

    def state_write_positions(
        self, request: Any, num_computed_tokens: int, num_tokens: int
    ) -> dict[int, tuple[int, ...]]:
        """kvcore's engine contract for a step computing the request's
        tokens ``num_computed_tokens`` to ``num_tokens`` (call after its
        ``allocate_slots``): per Mamba group, the token counts after which
        the step must write the state, each into table position
        ``ceil(t / block_size) - 1``.  Align-mode groups use the ``steps``
        checkpoint policy, so this is only ever the step's end, which is
        what vLLM's align-mode kernels write."""
        rid = request if isinstance(request, str) else request.request_id
        check_state_step(rid, num_computed_tokens, num_tokens)
        if rid not in self._live:
            msg = (
                f"state_write_positions: request {rid!r} holds no blocks: it "
                "was never allocated or was already freed"
            )
            raise UnknownRequestError(msg)
        return state_writes(self.kvcore, rid, num_computed_tokens, num_tokens)

    def reset_prefix_cache(self) -> bool:
        if not self.kvcore.block_pool.reset_prefix_cache():
            return False
        if self.log_stats:
            assert self.prefix_cache_stats is not None
            self.prefix_cache_stats.reset = True
        return True

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0] * self.num_kv_cache_groups

    def take_events(self) -> list[Any]:
        """The KV-cache events since the last call, as vLLM's event types
        (hashes in vLLM's external form, each stored block's group kind and
        window as vLLM names them)."""
        events = self.kvcore.block_pool.take_events()
        if not events:
            return []
        return to_vllm_events(events, self.kv_cache_config)

    # -- block lists ------------------------------------------------------------

    def get_blocks(self, request_id: str) -> Any:
        if request_id not in self._live:
            return self.empty_kv_cache_blocks
        return self._wrap(self.kvcore.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        if request_id not in self._live:
            return tuple([] for _ in range(self.num_kv_cache_groups))
        return tuple(list(table) for table in self.kvcore.get_blocks(request_id))

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        ids = self.get_block_ids(request_id)
        return tuple(
            group[: -(-num_computed_tokens // manager.block_size)]
            if manager.position_indexed
            else group
            for group, manager in zip(
                ids, self.kvcore.single_type_managers, strict=True
            )
        )

    def estimate_cached_tokens(self, request: Any) -> int:
        """Tokens of the request's table that hold a prefix-cache key, the
        least over cacheable groups."""
        if request.request_id not in self._live:
            return 0
        least: int | None = None
        key_hash = self.kvcore.block_pool.key_hash
        for manager, blocks in zip(
            self.kvcore.single_type_managers,
            self.kvcore.get_blocks(request.request_id),
            strict=True,
        ):
            if not manager.caching:
                continue
            keyed = 0
            for i, block in enumerate(blocks):
                if key_hash[block] is not None:
                    keyed = (i + 1) * manager.block_size
            least = keyed if least is None else min(least, keyed)
        return least or 0

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> Any:
        return self._blocks_cls(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def _wrap(self, ids: tuple[Sequence[BlockId], ...]) -> Any:
        """vLLM's ``KVCacheBlocks`` of per-group block id lists (the shared
        empty instance if all are empty)."""
        pool = self.kvcore.block_pool
        return self.create_kv_cache_blocks(
            tuple(views_of(pool, group) for group in ids)
        )

    def truncate_computed_blocks(self, blocks: Any, num_computed_tokens: int) -> Any:
        pool = self.kvcore.block_pool
        out = [
            list(group)
            if not manager.caching
            else views_of(
                pool,
                manager.truncate_hit([b.block_id for b in group], num_computed_tokens),
            )
            for group, manager in zip(
                blocks.blocks, self.kvcore.single_type_managers, strict=True
            )
        ]
        return self.create_kv_cache_blocks(tuple(out))

    # -- engine hooks kvcore has nothing for yet --------------------------------

    def take_new_block_ids(self) -> list[int]:
        """The ids of blocks to zero since the last call (drained)."""
        ids = self._new_block_ids
        self._new_block_ids = []
        return ids

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """Zero the request's blocks from ``start_token`` on again (a failed
        load left them unwritten)."""
        if request_id not in self._live:
            return
        managers = self.kvcore.single_type_managers
        for gid in self._zeroed_groups:
            manager = managers[gid]
            start = start_token // manager.block_size
            self._new_block_ids.extend(
                b for b in manager.req_to_blocks[request_id][start:] if b
            )

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[KVCacheBlock]]:
        return [], []

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        return {}

    def finalize_partial_tail_offloads(
        self, request: Any
    ) -> list[tuple[int, int, int]]:
        return []

    def new_step_starts(self) -> None:
        """vLLM's step boundary: the states earlier steps keyed are
        written (see :mod:`kvcore.coordinator.unwritten`)."""
        self.kvcore.unwritten.new_step_starts()
        self._scheduled.clear()

    def _forget_unwritten(self, request: Any) -> None:
        """vLLM preempts a request it scheduled in this step (a RUNNING one
        given slots since the step began) by freeing it before the step's
        forward runs and before ``num_computed_tokens`` advances: the blocks
        this step keyed past its computed tokens were never written, so they
        lose their keys (see :meth:`KVCacheCoordinator.forget_unwritten`)."""
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        if rid in self._scheduled and request.status == RequestStatus.RUNNING:
            self.kvcore.forget_unwritten(rid, request.num_computed_tokens)
