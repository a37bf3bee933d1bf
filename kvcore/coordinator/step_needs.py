"""What a step needs from the pool, and whether it fits: the blocks an
admission or a running request's growth takes, the checkpoints a step that
does not fit sheds, and the whole-sequence check of chunked prefill.

Nothing here changes the pool: a step is counted, then run (see
:meth:`KVCacheManager.allocate_slots`), so a refused step changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from kvcore.coordinator.blocks import KVCacheBlocks
from kvcore.coordinator.checks import (
    check_counts,
    check_external,
    check_hashing,
    not_a_request,
)
from kvcore.coordinator.coordinator import KVCacheCoordinator
from kvcore.coordinator.kind_effects import count_of
from kvcore.coordinator.partial import split_copy_sources
from kvcore.coordinator.plugin_results import block_count
from kvcore.coordinator.request import Request
from kvcore.errors import InvalidRequestError

_COUNT = "get_num_blocks_to_allocate"

if TYPE_CHECKING:
    from kvcore.coordinator.block_pool import BlockPool
    from kvcore.coordinator.headroom import BoundaryHeadroom
    from kvcore.coordinator.manager import SingleTypeManager
    from kvcore.coordinator.step_marks import StepMarks

__all__ = ["ManagerParts", "StepNeed", "StepNeeds"]

#: What a step takes from the pool: every group's admission block ids (none
#: for a running request), the copy-on-write sources of a partial hit
#: (``(group id, block id, tokens)``; None: none), how many of them leave the
#: free queue, and the blocks it needs.
StepNeed: TypeAlias = tuple[
    tuple[list[int], ...],
    list[tuple[int, int, int]] | None,
    int,
    int,
]


class ManagerParts:
    """What :class:`KVCacheManager` supplies to its base classes: the pool,
    the coordinator and its live requests."""

    block_pool: BlockPool
    coordinator: KVCacheCoordinator
    _requests: dict[str, Request]
    enable_caching: bool
    _headroom: BoundaryHeadroom | None
    _marks: StepMarks

    def _room_to_admit(self, need: int, reserved: int = 0) -> int:
        """The free blocks an admission needing ``need`` may take: those
        the engine's ``reserved`` blocks and the running requests' boundary
        headroom leave (see :mod:`kvcore.coordinator.headroom`)."""
        free = self.block_pool.free_queue.num_free - reserved
        if self._headroom is None:
            return free
        marks = self._marks.scheduled_to
        return free - self._headroom.blocks(self._requests, marks, free - need)


class StepNeeds(ManagerParts):
    """The counting half of :class:`KVCacheManager`'s step."""

    _managers: Sequence[SingleTypeManager]
    max_model_len: int
    num_kv_cache_groups: int
    empty_kv_cache_blocks: KVCacheBlocks

    def _with_lookahead(
        self, rid: str, num_tokens: int, num_lookahead_tokens: int
    ) -> int:
        """The tokens a step that ends at ``num_tokens`` covers with its
        lookahead slots (up to ``max_model_len``); called only when it has
        some, or ends past ``max_model_len`` (refused)."""
        if num_tokens > self.max_model_len:
            msg = (
                f"request {rid!r} would hold {num_tokens} tokens, past "
                f"max_model_len={self.max_model_len}; stop or truncate it first"
            )
            raise InvalidRequestError(msg)
        if self.coordinator.lookahead_refusers:
            gid = self.coordinator.lookahead_refusers[0]
            kind = self._managers[gid].kv_cache_spec.kind
            msg = (
                f"request {rid!r}: group {gid} ({kind}) cannot hold "
                "speculative lookahead slots (its state sits at the last "
                "computed position); schedule without lookahead for this plan"
            )
            raise InvalidRequestError(msg)
        return min(num_tokens + num_lookahead_tokens, self.max_model_len)

    def _whole_sequence_fits(
        self,
        request: Request,
        running: bool,
        attach: tuple[list[int], ...],
        num_encoder: int,
        held_sources: int,
    ) -> bool:
        """Whether the pool holds the request's whole current sequence
        (``full_sequence_must_fit``); an admission that does not forgets the
        checkpoints it planned."""
        need = (
            self._full_sequence_blocks(
                request,
                min(request.num_tokens, self.max_model_len),
                attach,
                num_encoder,
            )
            + held_sources
        )
        free = (
            self.block_pool.free_queue.num_free
            if running
            else self._room_to_admit(need)
        )
        if need <= free:
            return True
        if not running and self.coordinator.planning:
            self.coordinator.forget_checkpoints(request.request_id)
        return False

    def _admission_need(
        self,
        request: Request,
        computed: tuple[Sequence[int], ...] | None,
        computed_tokens: tuple[int, int],
        num_tokens: int,
        num_encoder: int,
    ) -> StepNeed | None:
        """What admitting ``request`` attaches and needs: every group's
        admission blocks, the copy-on-write sources of a partial hit (None:
        none), how many of them leave the free queue, and the blocks the
        step takes from it; None when a source is not written yet (see
        :mod:`kvcore.coordinator.unwritten`).  ``computed_tokens``: where the hit ends, and
        the tokens computed once it and any KV a connector loads are
        attached.  Checkpoint positions are planned here; a refused step
        forgets them."""
        hit_end, num_computed = computed_tokens
        coordinator = self.coordinator
        if self.enable_caching:
            check_hashing(self, request)
        sources: list[tuple[int, int, int]] | None = None
        if computed is not None and coordinator.partial_groups:
            # A hit that ends inside a block of a partial-hit group: its
            # last block is copied into a fresh one, not attached.
            computed, found = split_copy_sources(
                computed, coordinator.partial_groups, hit_end
            )
            if found:
                if coordinator.unwritten.copies_unwritten(found, hit_end):
                    # The copy runs before this step's forward: a source a
                    # step keyed this round is not written yet.
                    return None
                sources = found
        attach = coordinator.admission_blocks(
            computed if computed is not None else self.empty_kv_cache_blocks.ids,
            num_computed,
        )
        try:
            if coordinator.planning:
                coordinator.plan_checkpoints(request, num_computed)
            need = coordinator.get_num_blocks_to_allocate(
                request.request_id, num_tokens, attach, num_encoder
            )
        except BaseException:
            if coordinator.planning:
                coordinator.forget_checkpoints(request.request_id)
            raise
        held_sources = 0
        if sources:
            # A free source leaves the free queue for the step.
            ref = self.block_pool.ref_cnt
            held_sources = sum(1 for _, src, _ in sources if ref[src] == 0)
            need += held_sources
        return attach, sources, held_sources, need

    def _fits(
        self,
        rid: str,
        need: int,
        free: int,
        args: tuple[bool, bool, tuple[list[int], ...], int, int, int, int],
    ) -> bool:
        """Whether a step needing ``need`` blocks fits in ``free``: a running
        request that skips (``args``: the step's, see ``_run_step``) counts
        the blocks its release would return as free."""
        skipping, processed = args[1], args[3]
        return need <= free or (
            skipping
            and need <= free + self.coordinator.count_freeable_skipped(rid, processed)
        )

    def _shed_to_fit(
        self,
        rid: str,
        args: tuple[bool, bool, tuple[list[int], ...], int, int, int, int],
        held_sources: int,
        free: int,
    ) -> tuple[bool, list[Any] | None, int]:
        """A step that does not fit sheds its checkpoints, which are
        optional: one that fits without them runs without them (the request
        gives up the states it would keep inside the step and those it holds
        for others).  Whether it fits now, what was shed and the blocks the
        step then needs; a step that still does not fit gets its
        checkpoints back (and an admission forgets those it planned)."""
        running, _, attach, _, num_tokens, _, num_encoder = args
        coordinator = self.coordinator
        shed = coordinator.shed_checkpoints(rid) if coordinator.planning else None
        if shed is not None:
            try:
                if running:
                    need = coordinator.get_num_blocks_to_grow(rid, num_tokens)
                else:
                    need = (
                        coordinator.get_num_blocks_to_allocate(
                            rid, num_tokens, attach, num_encoder
                        )
                        + held_sources
                    )
                if self._fits(rid, need, free, args):
                    return True, shed, need
            except BaseException:
                # A plugin raised while the step was weighed again: the
                # request keeps its checkpoints, as a refused step does.
                coordinator.restore_checkpoints(rid, shed)
                raise
            coordinator.restore_checkpoints(rid, shed)
        if not running and coordinator.planning:
            coordinator.forget_checkpoints(rid)
        return False, None, 0

    def _full_sequence_blocks(
        self,
        request: Request,
        num_tokens: int,
        attach: Sequence[Sequence[int]],
        num_encoder: int = 0,
    ) -> int:
        """Free blocks the request draws from the pool, at its peak, to cover
        ``num_tokens`` with ``attach`` (its admission blocks, or nothing for
        a request that holds blocks).  A group whose kind skips positions
        holds at most its per-request bound of blocks at once (blocks it
        holds now count toward that bound); other groups hold every block."""
        rid = request.request_id
        total = 0
        empty: tuple[int, ...] = ()
        watched = self.coordinator.kind_counts
        for gid, manager in enumerate(self._managers):
            computed = attach[gid] if attach else empty
            try:
                tokens = num_encoder if manager.takes_encoder_tokens else num_tokens
                answer = count_of(manager, gid in watched, rid, tokens, computed)
                need = block_count(answer)
            except Exception as exc:
                err = self.coordinator.plugin_error(gid, _COUNT, exc)
                raise err from exc
            spec = manager.kv_cache_spec
            if manager.skips_blocks and manager.block_size == spec.block_size:
                held = manager.req_to_blocks.get(rid, empty)
                live = sum(1 for b in held if b)
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
            raise not_a_request(request)
        rid = request.request_id
        if num_tokens is None:
            num_tokens = request.num_tokens
        if type(num_tokens) is not int or num_tokens <= 0:
            msg = (
                f"can_fit_full_sequence for request {rid!r}: num_tokens must be a "
                f"positive int, got {num_tokens!r}"
            )
            raise InvalidRequestError(msg)
        check_counts(rid, {"num_new_computed_tokens": num_new_computed_tokens})
        check_external(self, request, num_external_computed_tokens, 0, False)
        attach: tuple[list[int], ...] = ()
        held = 0
        if rid not in self._requests:
            hit = (
                new_computed_blocks.ids
                if new_computed_blocks is not None and any(new_computed_blocks.ids)
                else self.empty_kv_cache_blocks.ids
            )
            if len(hit) != self.num_kv_cache_groups:
                msg = (
                    f"can_fit_full_sequence for request {rid!r}: the hit has "
                    f"{len(hit)} block lists for {self.num_kv_cache_groups} groups"
                )
                raise InvalidRequestError(msg)
            if self.coordinator.partial_groups and num_new_computed_tokens:
                # A copy-on-write source is not attached (a fresh block takes
                # its place) but is held while the step runs.
                hit, sources = split_copy_sources(
                    hit, self.coordinator.partial_groups, num_new_computed_tokens
                )
                ref = self.block_pool.ref_cnt
                held = sum(1 for _, src, _ in sources if ref[src] == 0)
            attach = self.coordinator.admission_blocks(
                hit, num_new_computed_tokens + num_external_computed_tokens
            )
        elif new_computed_blocks is not None and any(new_computed_blocks.ids):
            msg = (
                f"can_fit_full_sequence for request {rid!r}: the request already "
                "holds blocks; a prefix hit attaches only at admission"
            )
            raise InvalidRequestError(msg)
        full = min(num_tokens, self.max_model_len)
        need = self._full_sequence_blocks(request, full, attach) + held
        if rid in self._requests:
            return need <= self.block_pool.free_queue.num_free
        return need <= self._room_to_admit(need)
