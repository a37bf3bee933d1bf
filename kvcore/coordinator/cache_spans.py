"""Which ``cache_blocks`` calls can key nothing, known without asking a manager.

Decoding calls ``cache_blocks`` for every running request every step, and
most of those calls key nothing: no hash chunk ended since the request's
last call.  When every caching group's manager promises that its keys
follow the hash chunks (:attr:`SingleTypeManager.caches_at_chunk_ends`),
the coordinator keeps, per request, the span of token counts a call may
take without keying anything, and passes over a call inside it.

After a call at ``n`` tokens (for a request hashed up to ``n``'s chunk),
the span is ``[n, e)`` where ``e`` is the next chunk end after ``n`` (from
``n + 1`` when ``n`` is itself a chunk end): a later call there ends no new
chunk.  Whatever may make a key possible again drops the request's span:
any change to its tables or its managers' state (growth, a release, an
admission, a checkpoint plan shed or restored, freeing).  Inside a step
every change to a span is journaled, so a rolled-back step leaves the spans
as they were.
"""

from __future__ import annotations

from kvcore.coordinator.block_pool import BlockPool
from kvcore.coordinator.request import Request
from kvcore.coordinator.undo import put_entry

__all__ = ["CacheSpans"]


class CacheSpans(dict[str, tuple[int, int]]):
    """Request id -> ``(low, high)``: a ``cache_blocks`` call for the request
    at ``low <= num_tokens < high`` keys nothing (see the module)."""

    __slots__ = ("hash_block_size", "pool")

    def __init__(self, pool: BlockPool) -> None:
        super().__init__()
        self.pool = pool
        self.hash_block_size = pool.hash_block_size

    def cached(self, request: Request, num_tokens: int) -> None:
        """Note a call that asked every caching group at ``num_tokens``."""
        rid = request.request_id
        size = self.hash_block_size
        rest = num_tokens % size
        low = num_tokens if rest else num_tokens + 1
        high = num_tokens - rest + size
        old = self.get(rid)
        # A call past the request's hashed chunks (its tokens outrun by
        # num_tokens) may key more once they are hashed: no span then.
        if low < high and num_tokens // size <= len(request.block_hashes):
            span = (low, high)
            if span == old:
                return
            self[rid] = span
        elif old is None:
            return
        else:
            del self[rid]
        self.pool.record(put_entry, self, rid, old)

    def covers(self, request_id: str, num_tokens: int) -> bool:
        """Whether a call for the request at ``num_tokens`` keys nothing."""
        span = self.get(request_id)
        return span is not None and span[0] <= num_tokens < span[1]

    def forget(self, request_id: str) -> None:
        """Drop the request's span: something may key its blocks again."""
        old = self.pop(request_id, None)
        if old is not None:
            self.pool.record(put_entry, self, request_id, old)
