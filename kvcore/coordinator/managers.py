"""Generic managers: the strategies a cache kind configures rather than copies.

Each serves some hit policies (``spec.hit_policy``, see
:class:`~kvcore.spec.HitPolicy`); a kind's plugin picks one as its
``manager_type`` (or subclasses it to set a parameter):

- :class:`PrefixManager`: every block kept, hits grow from the left
  (full attention, MLA).
- :class:`WindowManager`: blocks the kind's release rule skips go back to
  the pool; a hit needs only the blocks the next token reads (sliding
  window, and unhashed skipping kinds such as chunked-local attention).
- :class:`CheckpointManager`: a recurrent state kept at block boundaries; a
  hit is one saved state (Mamba and linear-attention states).
- :class:`FixedBlocksManager`: a fixed number of blocks per request for its
  whole life, never hashed (rings, hot pages, a state kept only live).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from itertools import islice, takewhile
from operator import is_not
from typing import Any, ClassVar, cast

from kvcore.checkpoints import GRID_PREFIX_SHARE, grid_interval
from kvcore.coordinator.block_pool import BlockPool
from kvcore.coordinator.hashing import BlockHash, hashes_at_block_size
from kvcore.coordinator.manager import HitQuery, SingleTypeManager
from kvcore.coordinator.request import Request
from kvcore.coordinator.state_manager import CheckpointManager
from kvcore.spec import HitPolicy

__all__ = [
    "CheckpointManager",
    "FixedBlocksManager",
    "PrefixManager",
    "WindowManager",
    "prefix_hit",
]


class PrefixManager(SingleTypeManager):
    """Keeps every block of a request; the hit is the run of cached blocks
    from the first block up to the first miss (hashes chain, so a miss ends
    the prefix)."""

    hit_policies: ClassVar[frozenset[HitPolicy]] = frozenset({HitPolicy.PREFIX})
    partial_copy_hits: ClassVar[bool] = True

    @classmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> list[list[int]]:
        return prefix_hit(
            query.block_hashes,
            query.max_blocks,
            query.group_ids,
            query.block_pool,
            query.block_size,
            query.alignment,
        )


def prefix_hit(
    hashes: Sequence[BlockHash],
    limit: int,
    group_ids: Sequence[int],
    pool: BlockPool,
    block_size: int,
    alignment: int,
) -> list[list[int]]:
    """:class:`PrefixManager`'s search over at most ``limit`` blocks; the
    coordinator calls it directly for a group whose manager keeps that search
    (one lookup a step, so no query object is built)."""
    if len(group_ids) == 1:
        # The group's hash -> block map, read directly (see
        # BlockPool.lookup): an entry is a block id or {block_id: None}.
        hits = [_cached_run(pool.cached_blocks_of(group_ids[0]), hashes, limit)]
    else:
        # Group by group: each group's run of cached blocks, bounded by the
        # shortest run so far; a group with no block ends the search (the
        # hit is empty whatever the others hold).
        hits = []
        for gid in group_ids:
            run = _cached_run(pool.cached_blocks_of(gid), hashes, limit)
            hits.append(run)
            limit = len(run)
            if not limit:
                return [[] for _ in group_ids]
        hits = [h if len(h) == limit else h[:limit] for h in hits]
    if alignment > block_size:
        keep = (len(hits[0]) * block_size // alignment) * alignment // block_size
        if keep != len(hits[0]):
            hits = [h[:keep] for h in hits]
    return hits


def _cached_run(
    cached: dict[BlockHash, Any], hashes: Sequence[BlockHash], limit: int
) -> list[int]:
    """The blocks ``cached`` (one group's live map, see
    :meth:`BlockPool.cached_blocks_of`) holds for ``hashes[0]``,
    ``hashes[1]``, ... up to the first miss, at most ``limit``."""
    run: list[Any] = list(takewhile(_is_entry, map(cached.get, islice(hashes, limit))))
    if dict in map(type, run):
        # Several blocks hold the hash: the first stands for them.
        run = [next(iter(e)) if type(e) is dict else e for e in run]
    return run


_is_entry = partial(is_not, None)


class WindowManager(SingleTypeManager):
    """Releases the leading blocks the spec's ``skipped_tokens`` names (the
    release rule must not decrease as tokens grow); a hit of ``n`` tokens
    needs cached blocks only from ``skipped_tokens(n)`` on, and earlier
    positions are the null block.

    With prefix caching on, only blocks that can serve a hit are hashed:
    hits are multiples of the hit alignment, so a block is kept in the cache
    only if the window before some aligned end reads it.  The others stay
    unhashed and are reused first once freed.
    """

    hit_policies: ClassVar[frozenset[HitPolicy]] = frozenset(
        {HitPolicy.WINDOW, HitPolicy.NOT_HASHED}
    )
    skips_blocks: ClassVar[bool] = True
    plans_checkpoints: ClassVar[bool] = True
    # Keys whole alignment units of hashed blocks (see cache_blocks).
    caches_at_chunk_ends: ClassVar[bool] = True

    def __init__(self, spec: Any, block_pool: BlockPool, **kwargs: Any) -> None:
        super().__init__(spec, block_pool, **kwargs)
        #: request id -> (where its grid starts, its prompt's length, its
        #: grid's interval or 0): it also keeps the window of every hit
        #: point in its prompt's last window, and at every multiple of the
        #: interval between the two lengths.
        self.grid_end: dict[str, tuple[int, int, int]] = {}
        end = max(self.max_model_len, 1)
        #: Tokens a hit's window reads (0: the spec skips no token).
        self.window_tokens = end - int(spec.skipped_tokens(end))
        if self.window_tokens >= end:
            self.window_tokens = 0
        #: Tokens between the grid's hit points (a multiple of the hit
        #: alignment), or 0 for no grid (see :meth:`hold_every`).
        self.hold_interval = self.hold_every(spec)
        if self.hold_interval:
            unit = self.hit_alignment
            self.hold_interval = -(-self.hold_interval // unit) * unit

    def hold_every(self, spec: Any) -> int:
        """Tokens between the hit points of a grid whose windows a running
        request keeps too (beside its hit's end and its prompt's end), for
        a later request that branches from its prompt while it runs, or
        from what is left of its prefix once freed: a hit there resumes at
        the grid point below the branch (rounded up to the hit alignment;
        0: no grid).  Default: eight times the tokens a hit's window reads,
        so the windows kept cost an eighth of the group's blocks over the
        prompt; more often, the held windows crowd the cached prefixes
        out of a tight pool."""
        end = max(self.max_model_len, 1)
        reads = end - int(spec.skipped_tokens(end))
        return 8 * reads if 0 < reads < end else 0

    def grid_point_blocks(self) -> int:
        # The blocks a hit's window reads, where the group keeps a grid.
        if not (self.hold_interval and self.holds_back):
            return 0
        return -(-self.window_tokens // self.block_size)

    def plan_checkpoints(self, request: Request, num_computed_tokens: int) -> None:
        """At admission: the hit points whose window blocks the request
        keeps for later requests.  The windows of the points an earlier
        request shared, where its hit ended and its branch point (how far
        the groups that keep every block found the prefix), stay in its
        table while it runs (pinned: not released, unless a step does not
        fit with them, see :meth:`shed_checkpoints`), as the prefix before
        them does in those groups: requests sharing a prefix share its
        window's blocks, so a busy prefix keeps its window whatever the
        pressure, at no cost beyond the first request's.  The others are
        held back once released, until the request is freed (see
        :meth:`kept_for_later`): every point in the last window of its
        prompt (its end, where the same prompt hits again and a longer one
        resumes, and where a prompt that shares all but its last part
        parts from it: these windows cost two windows' blocks), and every
        multiple of :attr:`hold_interval` in the part of the prompt no
        earlier request shared (doubled until the grid takes at most
        :attr:`grid_share` of the pool; see :meth:`grid_pool_share`)."""
        unit = self.hit_alignment
        rid = request.request_id
        prompt = request.num_prompt_tokens
        shared = min(request.shared_prefix_tokens, prompt)
        start = max(num_computed_tokens, shared)
        # (Planned afresh: an admission that failed before its step may
        # have left the last plan for this id.)
        self.pinned.pop(rid, None)
        if not self.holds_back:
            self.grid_end[rid] = (start, prompt, 0)
            return
        size = self.block_size
        skipped = self.kv_cache_spec.skipped_tokens
        # (Not below the hit's window: a request never takes those.)
        first = int(skipped(num_computed_tokens)) // size
        pins = {
            pos
            for point in (num_computed_tokens, shared)
            if point >= unit
            for pos in range(
                max(int(skipped(point - point % unit)) // size, first),
                (point - point % unit) // size,
            )
        }
        if pins:
            self.pinned[rid] = sorted(pins)
        every = 0
        if self.hold_interval:
            every = grid_interval(
                max(self.hold_interval, self._grid_cost_interval()),
                prompt - start,
                self.grid_point_cost,
                self.block_pool.num_blocks,
                self.grid_share,
            )
        self.grid_end[rid] = (start, prompt, every)

    def _grid_cost_interval(self) -> int:
        """The shortest grid interval (a multiple of the hit alignment)
        whose points, :attr:`grid_point_cost` blocks each, cost at most
        :data:`~kvcore.checkpoints.GRID_PREFIX_SHARE` of the blocks the
        groups that keep every block take between two points.  A tight pool
        keeps little more of a window group's prefix than its grid, so the
        grid is priced against what it makes reachable; while the pool has
        room, released window blocks stay cached (spare) and serve a hit
        anywhere, grid or not."""
        if not self.grid_prefix_blocks:
            return 0
        tokens = self.grid_point_cost / (GRID_PREFIX_SHARE * self.grid_prefix_blocks)
        unit = self.hit_alignment
        return -(-math.ceil(tokens) // unit) * unit

    def forget_checkpoints(self, request_id: str) -> None:
        self.pinned.pop(request_id, None)
        self.grid_end.pop(request_id, None)

    def pop_twins(
        self, twins: Sequence[SingleTypeManager], request_id: str
    ) -> list[list[int] | None]:
        record = self.block_pool.record
        for twin in cast("Sequence[WindowManager]", twins):
            pins = twin.pinned.pop(request_id, None)
            if pins is not None:
                record(twin.pinned.__setitem__, request_id, pins)
            end = twin.grid_end.pop(request_id, None)
            if end is not None:
                record(twin.grid_end.__setitem__, request_id, end)
        return super().pop_twins(twins, request_id)

    def kept_for_later(
        self,
        request_id: str,
        positions: Sequence[int],
        released: Sequence[int],
    ) -> list[int]:
        """The released blocks a hit at one of the request's held-back hit
        points reads (see :meth:`plan_checkpoints`)."""
        start, prompt, every = self.grid_end.get(request_id, (0, 0, 0))
        if not prompt:
            return []
        size = self.block_size
        skipped = self.kv_cache_spec.skipped_tokens
        # The windows of every hit point in the prompt's last window, from
        # the last one before its final token (where the same prompt hits
        # again) on.
        unit = self.hit_alignment
        last = prompt - 1
        first = min(
            -(-(prompt - self.window_tokens) // unit) * unit, last - last % unit
        )
        tail = (skipped(max(first, 0)) // size, prompt // size)
        kept = []
        key_hash = self.block_pool.key_hash
        for pos, block in zip(positions, released, strict=True):
            if key_hash[block] is None:
                continue
            if tail[0] <= pos < tail[1]:
                kept.append(block)
            elif every:
                # The grid point above the block is the only one whose
                # window can read it (a window reads less than the interval).
                point = (pos * size // every + 1) * every
                if (
                    start < point < prompt
                    and skipped(point) // size <= pos < point // size
                ):
                    kept.append(block)
        return kept

    def hit_serves(self, blocks: Sequence[int]) -> bool:
        # The next token reads the blocks from the release line on.
        skipped = self.kv_cache_spec.skipped_tokens(len(blocks) * self.block_size)
        return self.null_block not in blocks[skipped // self.block_size :]

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        block_size = self.block_size
        per_unit, rest = divmod(self.hit_alignment, block_size)
        if rest or per_unit <= 1:
            super().cache_blocks(request, num_tokens)
            return
        if not self.caching:
            return
        rid = request.request_id
        cached = self.num_cached_block.get(rid, 0)
        blocks = self.req_to_blocks[rid]
        hashes = hashes_at_block_size(
            request.block_hashes, self.hash_block_size, block_size
        )
        num_full = min(num_tokens // block_size, len(hashes), len(blocks))
        # Only whole alignment units can be judged: a block's first possible
        # hit ends at the end of its unit.
        decided = num_full - num_full % per_unit
        if decided <= cached:
            return
        self.record_request_state(rid)
        skipped = self.kv_cache_spec.skipped_tokens
        cache = self.block_pool.cache_full_blocks
        gid = self.kv_cache_group_id
        for unit_end in range(
            cached - cached % per_unit + per_unit, decided + 1, per_unit
        ):
            # The window before this unit's end reads blocks from `first` on;
            # a later end reads no earlier block (the rule never decreases).
            first = max(
                skipped(unit_end * block_size) // block_size,
                unit_end - per_unit,
                cached,
            )
            if first < unit_end:
                cache(
                    block_hashes=hashes,
                    blocks=blocks,
                    num_cached_blocks=first,
                    num_full_blocks=unit_end,
                    group_id=gid,
                    token_ids=request.all_token_ids,
                )
        self.num_cached_block[rid] = decided

    @classmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> list[list[int]]:
        """The longest aligned hit whose read blocks are all cached.

        Ends are tried from the right.  A miss at block ``j`` rules out every
        end above it (their windows start at or below ``j``, since the
        release rule never decreases), so the next end tried is ``j``.
        """
        block_size = query.block_size
        alignment = query.alignment
        skipped = query.spec.skipped_tokens
        pool = query.block_pool
        group_ids = query.group_ids
        hashes = query.block_hashes
        seen: dict[int, list[int] | None] = {}
        end = query.max_blocks
        while end > 0:
            if (end * block_size) % alignment:
                end -= 1
                continue
            first = skipped(end * block_size) // block_size
            j = end - 1
            while j >= first:
                if j not in seen:
                    seen[j] = pool.get_cached_block(hashes[j], group_ids)
                if seen[j] is None:
                    break
                j -= 1
            if j < first:
                null = pool.null_block
                hits = [[null] * end for _ in group_ids]
                for i in range(first, end):
                    found = seen[i]
                    assert found is not None  # every block in range was cached
                    for out, block in zip(hits, found, strict=True):
                        out[i] = block
                return hits
            end = j
        return [[] for _ in group_ids]


class FixedBlocksManager(SingleTypeManager):
    """A fixed number of blocks per request for its whole life.

    The blocks cover no token range: they are never hashed, never hit, and
    the request keeps them until it is freed.  Subclasses say how many with
    :meth:`blocks_per_request`.  A kind that needs the whole prefix but
    keeps only this live state declares ``HitPolicy.BLOCKS_HITS``; one that
    is rebuilt after another group's hit declares ``NOT_HASHED``.
    """

    hit_policies: ClassVar[frozenset[HitPolicy]] = frozenset(
        {HitPolicy.NOT_HASHED, HitPolicy.BLOCKS_HITS}
    )
    position_indexed: ClassVar[bool] = False
    # Never keys anything; a request holding its blocks takes no more.
    caches_at_chunk_ends: ClassVar[bool] = True
    grows_by_count: ClassVar[bool] = True

    def __init__(self, spec: Any, block_pool: BlockPool, **kwargs: Any) -> None:
        super().__init__(spec, block_pool, **kwargs)
        self.caching = False
        self.fixed_blocks = self.blocks_per_request(spec)

    def blocks_per_request(self, spec: Any) -> int:
        """Blocks each request holds; one by default."""
        return 1

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[int],
    ) -> int:
        if request_id in self.req_to_blocks:
            return 0
        return self.fixed_blocks

    def add_computed_blocks(self, request_id: str, blocks: Sequence[int]) -> None:
        return

    def allocate_twins(
        self, twins: Sequence[SingleTypeManager], request_id: str, num_tokens: int
    ) -> list[list[int]] | None:
        if request_id in self.req_to_blocks:
            return None
        # One hand-out for the class, split in group order.
        self.record_twins(twins, request_id)
        each = self.fixed_blocks
        new = self.block_pool.get_new_blocks(each * len(twins))
        out = [new[i * each : (i + 1) * each] for i in range(len(twins))]
        for twin, blocks in zip(twins, out, strict=True):
            twin.req_to_blocks[request_id] = blocks[:]
        return out

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        return

    @classmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> list[list[int]]:
        return [[] for _ in query.group_ids]
