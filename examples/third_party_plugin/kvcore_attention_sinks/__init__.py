"""Attention sinks with a sliding window (StreamingLLM): a third-party kind.

A layer of this kind attends to the first ``sink_tokens`` tokens of the
request (the attention sinks) and to the last ``window`` tokens, the current
one included.  Its cache keeps the blocks that hold a sink token and the
blocks of the window; the pages between them are released as the window
moves on.  A prefix hit needs the sink blocks and the window's blocks
cached, nothing in between.

Everything kvcore needs is here: a spec class (page model, release rule,
capacity and grouping declarations), a block manager that releases the
middle of the table and searches hits, a kind object tying them together,
and one ``kvcore_register_kinds`` hook implementation.  The entry point in
``pyproject.toml`` (group ``kvcore``) is how kvcore finds it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, ClassVar

import attrs

from kvcore import AttentionKind, AttentionSpec, CacheKind, HitPolicy, hookimpl
from kvcore.coordinator import BlockPool, HitQuery, SingleTypeManager
from kvcore.spec import PackingRole, cdiv, positive_int

__all__ = ["AttentionSinks", "AttentionSinksManager", "AttentionSinksSpec"]


@attrs.frozen(kw_only=True)
class AttentionSinksSpec(AttentionSpec):
    """An attention layer with ``sink_tokens`` sinks and a ``window``-token
    sliding window.

    :param sink_tokens: leading tokens every query attends to.
    :param window: the latest tokens each query attends to (itself included).
    """

    kind: ClassVar[str] = "attention_sinks"
    packing_role: ClassVar[PackingRole] = PackingRole.WINDOW

    sink_tokens: int = attrs.field(validator=positive_int)
    window: int = attrs.field(validator=positive_int)

    @property
    def hit_policy(self) -> HitPolicy:
        # A hit needs the sinks and the window cached, nothing in between:
        # the manager below hashes the blocks and searches for such hits.
        return HitPolicy.WINDOW

    # ``event_window`` stays None: a router told only the window would count
    # hits whose sink blocks were evicted.  ``skipped_tokens`` stays 0: the
    # leading tokens (the sinks) are always read; the manager releases the
    # middle instead.

    def sink_blocks(self, block_size: int) -> int:
        """Leading blocks that hold a sink token: never released."""
        return cdiv(self.sink_tokens, block_size)

    def first_read(self, num_computed_tokens: int, block_size: int) -> int:
        """The first block the window of the next token reads (its position
        is ``num_computed_tokens``)."""
        return max(num_computed_tokens - self.window + 1, 0) // block_size

    def released_blocks(self, num_computed_tokens: int, block_size: int) -> int:
        """Blocks between the sinks and the window of the next token, which a
        request no longer holds."""
        return max(
            self.first_read(num_computed_tokens, block_size)
            - self.sink_blocks(block_size),
            0,
        )

    def num_blocks_held(
        self, num_computed_tokens: int, num_tokens: int, block_size: int
    ) -> int:
        return cdiv(num_tokens, block_size) - self.released_blocks(
            num_computed_tokens, block_size
        )

    def max_num_blocks_per_request(self, max_model_len: int) -> int:
        # The sink blocks, the window's blocks and one for the boundary.
        live = min(self.window - 1, max_model_len)
        return min(
            self.sink_blocks(self.block_size) + cdiv(live, self.block_size) + 1,
            cdiv(max_model_len, self.block_size),
        )

    def group_key(self) -> Hashable:
        return (self.kind, self.block_size, self.sink_tokens, self.window)


class AttentionSinksManager(SingleTypeManager):
    """Keeps a request's sink blocks and window blocks; the blocks between
    them go back to the pool (their table positions become the null block).

    Tables hold block ids (ints); the null block is id 0, and a block's
    reference count is ``self.block_pool.ref_cnt[block]``.

    Every full block is hashed.  A hit of ``n`` blocks needs the sink blocks
    and the blocks from the window of token ``n * block_size`` on cached,
    and holds the null block in between.
    """

    hit_policies: ClassVar[frozenset[HitPolicy]] = frozenset({HitPolicy.WINDOW})
    skips_blocks: ClassVar[bool] = True

    kv_cache_spec: AttentionSinksSpec

    def __init__(
        self, spec: AttentionSinksSpec, block_pool: BlockPool, **kwargs: Any
    ) -> None:
        super().__init__(spec, block_pool, **kwargs)
        #: Leading table positions that hold a sink token: never released.
        self.sink_blocks = spec.sink_blocks(self.block_size)

    def first_read(self, num_computed_tokens: int) -> int:
        return self.kv_cache_spec.first_read(num_computed_tokens, self.block_size)

    def _released(self, request_id: str, num_computed_tokens: int) -> range:
        """Positions to release now, newest first: between the sinks (or where
        the previous release stopped) and the window."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return range(0)
        end = min(self.first_read(num_computed_tokens), len(blocks))
        start = max(self.num_released.get(request_id, 0), self.sink_blocks)
        return range(end - 1, start - 1, -1)

    def count_freeable_skipped(self, request_id: str, num_computed_tokens: int) -> int:
        blocks = self.req_to_blocks.get(request_id, [])
        ref = self.block_pool.ref_cnt
        return sum(
            1
            for i in self._released(request_id, num_computed_tokens)
            if blocks[i] and ref[blocks[i]] == 1
        )

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        positions = self._released(request_id, num_computed_tokens)
        if not positions:
            return
        # Record the table and counts first, so a rolled-back step puts
        # them back with the pool.
        self.record_request_state(request_id, whole=True)
        blocks = self.req_to_blocks[request_id]
        self.num_released[request_id] = positions.start + 1
        removed = [blocks[i] for i in positions if blocks[i]]
        for i in positions:
            blocks[i] = self.null_block
        if removed:
            self.block_pool.free_blocks(removed)

    def admission_blocks(
        self, hit: Sequence[int], num_computed_tokens: int
    ) -> list[int]:
        """The hit, with the null block between the sinks and the window."""
        out = list(hit)
        first = self.first_read(num_computed_tokens)
        if first <= self.sink_blocks:
            return out
        null = self.null_block
        for i in range(self.sink_blocks, min(first, len(out))):
            out[i] = null
        if self.sink_blocks <= len(out) < first:
            out.extend([null] * (first - len(out)))
        return out

    def hit_serves(self, blocks: Sequence[int]) -> bool:
        sinks = min(self.sink_blocks, len(blocks))
        first = self.first_read(len(blocks) * self.block_size)
        null = self.null_block
        return null not in blocks[:sinks] and null not in blocks[max(first, sinks) :]

    @classmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> list[list[int]]:
        """The longest aligned hit whose sink and window blocks are cached.

        Ends are tried from the right; a miss in the window at block ``j``
        rules out every end above it (their windows start at or below ``j``),
        and a missing sink block rules out every end past it.
        """
        spec: AttentionSinksSpec = query.spec
        size = query.block_size
        pool = query.block_pool
        hashes = query.block_hashes
        sinks = spec.sink_blocks(size)
        seen: dict[int, list[int] | None] = {}

        def cached(j: int) -> list[int] | None:
            if j not in seen:
                seen[j] = pool.get_cached_block(hashes[j], query.group_ids)
            return seen[j]

        end = query.max_blocks
        run = 0
        while run < min(sinks, end) and cached(run) is not None:
            run += 1
        if run < sinks:
            end = min(end, run)
        while end > 0:
            if (end * size) % query.alignment:
                end -= 1
                continue
            first = max(spec.first_read(end * size, size), min(sinks, end))
            j = end - 1
            while j >= first and cached(j) is not None:
                j -= 1
            if j < first:
                null = pool.null_block
                hits = [[null] * end for _ in query.group_ids]
                for i in (*range(min(sinks, end)), *range(first, end)):
                    found = seen[i]
                    assert found is not None  # every block read was cached
                    for out, block in zip(hits, found, strict=True):
                        out[i] = block
                return hits
            end = j
        return [[] for _ in query.group_ids]


class AttentionSinks(AttentionKind):
    name: ClassVar[str] = "attention_sinks"
    spec_type = AttentionSinksSpec
    manager_type = AttentionSinksManager


@hookimpl
def kvcore_register_kinds() -> list[CacheKind]:
    return [AttentionSinks()]
