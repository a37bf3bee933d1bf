"""What an engine calls besides the step: deferred frees, releases and
the prefix-hit statistics it reads per interval.

Under asynchronous scheduling a step in flight may still read blocks the
scheduler is done with; these calls let the engine hand blocks back to the
pool only once the step reading them has completed, and drop cached
content it knows is stale.  Each is a transaction: a manager that raises
leaves the pool, the tables and the keys as they were.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from kvcore.coordinator.blocks import BlockId, KVCacheBlock, KVCacheBlocks
from kvcore.coordinator.checks import check_hashing, check_tokens, not_a_request, owned
from kvcore.coordinator.freeing import list_key
from kvcore.coordinator.group_hits import find_longest_cache_hit_per_group
from kvcore.coordinator.request import Request, RequestStatus
from kvcore.coordinator.state_manager import CheckpointManager
from kvcore.coordinator.step_marks import StepMarks
from kvcore.coordinator.step_needs import ManagerParts
from kvcore.errors import InvalidRequestError, KvcoreTypeError, UnknownRequestError

if TYPE_CHECKING:
    from kvcore.coordinator.coordinator import KVCacheCoordinator

#: The status a free sets, read from the enum once (see kv_cache_manager).
_FINISHED = RequestStatus.FINISHED


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


class EngineCalls(ManagerParts):
    """The engine-contract calls of :class:`KVCacheManager`."""

    _popped: dict[tuple[int, ...], list[list[BlockId]]]
    _marks: StepMarks
    prefix_cache_stats: PrefixCacheStats

    def _require_live(self, rid: str) -> Request:
        """The live request of this id (it holds blocks), or a clear error."""
        held = self._requests.get(rid)
        if held is None:
            msg = (
                f"request {rid!r} holds no blocks: it was never allocated or was "
                "already freed"
            )
            raise UnknownRequestError(msg)
        return held

    def _guarded(self, call: Any, *args: Any) -> Any:
        """Run ``call`` as a transaction: on failure the pool, the tables,
        the keys and the managers' own state are put back."""
        pool = self.block_pool
        pool.begin()
        try:
            out = call(*args)
        except BaseException:
            pool.rollback()
            raise
        pool.commit()
        return out

    def remove_skipped_blocks(self, request: Request | str, num_tokens: int) -> None:
        """Release the blocks the request no longer reads below
        ``num_tokens`` processed tokens (those no step in flight computes),
        e.g. once an asynchronous step has completed; the positions become
        the null block.  Releases nothing for plans with no window or
        state group."""
        rid = _request_id(request)
        check_tokens(
            f"remove_skipped_blocks for request {rid!r}: num_tokens", num_tokens
        )
        held = self._require_live(rid)
        if num_tokens > held.num_computed_tokens:
            msg = (
                f"remove_skipped_blocks for request {rid!r}: num_tokens={num_tokens} "
                f"is past the {held.num_computed_tokens} tokens it has computed, so "
                "it would release blocks its next step reads; pass the tokens whose "
                "steps have completed (at most num_computed_tokens)"
            )
            raise InvalidRequestError(msg)
        coordinator = self.coordinator
        if not coordinator.skipping or not num_tokens:
            return
        # Nothing released, nothing changes; a step already open refuses
        # the call (BlockPool.begin) before its marks move.
        if self.block_pool.journal is not None or not coordinator.releases_nothing(
            rid, num_tokens
        ):
            self._guarded(coordinator.remove_skipped_blocks, rid, num_tokens)
        self._marks.released(rid, num_tokens)

    def pop_blocks_for_free(
        self, request: Request | str, *, forward_ran: bool = True
    ) -> list[KVCacheBlock]:
        """Finish the request (``FINISHED``, its id free for reuse) but keep
        its blocks out of the pool: a step still in flight may read them.
        Pass the list (the blocks as views of the pool) to
        :meth:`release_blocks` once that step completes; until then no
        other request can be given them.  ``forward_ran`` is
        :meth:`KVCacheManager.free`'s."""
        ids: list[BlockId] = self._finish(
            request, self.coordinator.pop_for_free, forward_ran
        )
        self._popped.setdefault(list_key(ids), []).append(ids)
        view = self.block_pool.block
        return [view(b) for b in ids]

    def _finish(self, request: Request | str, call: Any, forward_ran: bool) -> Any:
        """Run ``call(request_id)`` as a transaction, then forget the request
        and mark it ``FINISHED``; returns what ``call`` returned.  With
        ``forward_ran`` false, the keys of the blocks past the request's
        computed tokens go first, in the same transaction."""
        rid = _request_id(request)
        held = self._requests.get(rid) or self._require_live(rid)
        given: object = forward_ran  # checked: engines pass anything
        if type(given) is not bool:
            msg = (
                f"free for request {rid!r}: forward_ran must be a bool (whether "
                "the forward pass of the request's last scheduled step ran), "
                f"got {forward_ran!r}"
            )
            raise KvcoreTypeError(msg)
        if forward_ran:
            out = self._guarded(call, rid)
        else:
            engine_view = request if isinstance(request, Request) else held
            written = self._marks.written(rid, engine_view.num_computed_tokens)
            out = self._guarded(_forget_then, self.coordinator, call, rid, written)
        self._marks.forget(rid)
        coordinator = self.coordinator
        coordinator.unwritten.written(rid)
        if coordinator.partial is not None:
            coordinator.partial.forget(rid)
        del self._requests[rid]
        held.status = _FINISHED
        if request is not held and isinstance(request, Request):
            request.status = _FINISHED
        return out

    def release_blocks(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Return the blocks :meth:`pop_blocks_for_free` handed out to the
        pool, each list once, whole, its blocks in any order: it is freed
        as :meth:`free` of its request would free it now (tail first,
        cached prefixes kept).  A list released twice, or not handed out
        as it is, is refused and nothing changes, even where another list
        still out holds the same blocks or the pool has given them to
        another request."""
        given: object = blocks  # checked: engines pass anything
        pool = self.block_pool
        if not isinstance(given, (list, tuple)) or not all(
            owned(pool, b) for b in given
        ):
            msg = (
                "release_blocks: pass the list pop_blocks_for_free returned "
                "(blocks of this manager's pool)"
            )
            raise KvcoreTypeError(msg)
        key = list_key([b.block_id for b in blocks])
        popped = self._popped
        lists = popped.get(key)
        if not lists:
            msg = (
                f"release_blocks: the list of blocks {list(key[:8])} is not held "
                "for release: it was released already, or pop_blocks_for_free "
                "did not hand it out (a list is released whole, once); pass "
                "each list it returned once"
            )
            raise InvalidRequestError(msg)
        # Freed in the order it was handed out, whatever order it comes in.
        self._guarded(_release_popped, self.coordinator, lists[0], key)
        del lists[0]
        if not lists:
            del popped[key]

    def new_step_starts(self) -> None:
        """Say a new engine step starts: the states earlier steps keyed are
        written, so hits may end on them.  Optional: without it a state
        counts as written at its writer's next call (see
        :mod:`kvcore.coordinator.unwritten`)."""
        self.coordinator.unwritten.new_step_starts()

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix-hit statistics since the last call (or since the
        manager was built, or its prefix cache reset), and start counting
        afresh: an engine reads one interval's hit rate per call."""
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

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
        before = pool.evictions

        self._guarded(pool.drop_from_cache_n, ids)
        return pool.evictions - before

    def find_longest_cache_hit_per_group(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, tuple[int, ...]]:
        """Each group's own prefix hit, searched alone (blocks and length
        per group): what a KV connector may complete where the groups'
        hits differ.  Bounded like :meth:`get_computed_blocks`; nothing is
        attached or counted.  :meth:`allocate_slots` attaches only a hit of
        one length (from :meth:`get_computed_blocks`): the lengths here say
        how far a connector would have to load each group."""
        if not isinstance(request, Request):
            raise not_a_request(request)
        bound = len(request.all_token_ids) - 1
        if max_cache_hit_length is not None:
            check_tokens(
                "find_longest_cache_hit_per_group: max_cache_hit_length",
                max_cache_hit_length,
            )
            bound = min(bound, max_cache_hit_length)
        coordinator = self.coordinator
        pool = self.block_pool
        if not self.enable_caching or request.skip_reading_prefix_cache:
            none: tuple[list[BlockId], ...] = tuple(
                [] for _ in range(coordinator.num_groups)
            )
            return KVCacheBlocks(none, pool=pool), (0,) * coordinator.num_groups
        check_hashing(self, request)
        ids, lengths = find_longest_cache_hit_per_group(
            coordinator, request.block_hashes, bound
        )
        return KVCacheBlocks(ids, pool=pool), lengths

    def state_write_positions(
        self, request: Request | str, num_computed_tokens: int, num_tokens: int
    ) -> dict[int, tuple[int, ...]]:
        """Where the engine must write recurrent states in a step that
        computes the request's tokens ``num_computed_tokens`` to
        ``num_tokens`` (hit and loaded tokens before the step count as
        computed): per state group id, the token counts ``t`` after which
        the state is written, ascending, each into the group's table
        position ``ceil(t / block_size) - 1``.  The last is always
        ``num_tokens`` (the step's end); any before it are checkpoints the
        group's policy keeps inside the step.  Call after the step's
        ``allocate_slots``.  A state kept for later requests is always one
        listed here; with ``checkpoint_policy="steps"`` only step ends are
        listed, which engines whose kernels write a state only at the end
        of each step (vLLM's align mode) need."""
        rid = request if isinstance(request, str) else request.request_id
        check_state_step(rid, num_computed_tokens, num_tokens)
        self._require_live(rid)
        return state_writes(self.coordinator, rid, num_computed_tokens, num_tokens)


def check_state_step(rid: str, num_computed_tokens: int, num_tokens: int) -> None:
    """``state_write_positions``' token counts: non-negative ints, the
    step's first and last (the first not past the last)."""
    for name, value in (
        ("num_computed_tokens", num_computed_tokens),
        ("num_tokens", num_tokens),
    ):
        check_tokens(f"state_write_positions for request {rid!r}: {name}", value)
    if num_tokens < num_computed_tokens:
        msg = (
            f"state_write_positions for request {rid!r}: num_tokens="
            f"{num_tokens} is below num_computed_tokens={num_computed_tokens}; "
            "pass the step's first and last token counts"
        )
        raise InvalidRequestError(msg)


def state_writes(
    coordinator: KVCacheCoordinator,
    rid: str,
    num_computed_tokens: int,
    num_tokens: int,
) -> dict[int, tuple[int, ...]]:
    """Per state group of ``coordinator``, where a step computing the live
    request's tokens ``num_computed_tokens`` to ``num_tokens`` must write
    its states (see :meth:`EngineCalls.state_write_positions`, which checks
    the arguments first; engine integrations share it)."""
    out: dict[int, tuple[int, ...]] = {}
    for gid, manager in enumerate(coordinator.single_type_managers):
        if not isinstance(manager, CheckpointManager):
            continue
        held = len(manager.req_to_blocks.get(rid, ())) * manager.block_size
        if num_tokens > held:
            msg = (
                f"state_write_positions for request {rid!r}: the step ends "
                f"at {num_tokens} tokens, past the {held} its group {gid} "
                "table covers; call it after the step's allocate_slots"
            )
            raise InvalidRequestError(msg)
        out[gid] = tuple(manager.state_writes(rid, num_computed_tokens, num_tokens))
    return out


def _request_id(request: object) -> str:
    """The id of a request given as a :class:`Request` or as its id."""
    if isinstance(request, str):
        return request
    if isinstance(request, Request):
        return request.request_id
    raise not_a_request(request)


def _forget_then(
    coordinator: KVCacheCoordinator, call: Any, rid: str, num_computed_tokens: int
) -> Any:
    """Drop the keys of the blocks past ``num_computed_tokens``, then run
    ``call(rid)``: one transaction for both (see
    :meth:`KVCacheCoordinator.forget_unwritten`)."""
    coordinator.forget_unwritten(rid, num_computed_tokens)
    return call(rid)


def _release_popped(
    coordinator: KVCacheCoordinator, ids: list[BlockId], key: tuple[int, ...]
) -> None:
    """Finish the free of a popped list (its blocks still held, ``key`` its
    list_key): as :meth:`KVCacheCoordinator.free` would now."""
    if not coordinator.free_popped(ids, key):
        coordinator.block_pool.free_table(ids)
