"""KV-cache events for KV-aware routers: what the block pool records.

A router that sends each request to the engine already holding its prefix
needs to know which blocks every engine stores and drops.  The block pool
records :class:`BlockStored`, :class:`BlockRemoved` and
:class:`AllBlocksCleared` (when ``enable_kv_cache_events`` is on) and the
engine drains them with ``KVCacheManager.take_events()``.  Each event
carries everything a router keys on (chained block hashes, the parent hash,
the stored tokens, the group's block size, kind and window, the medium), so
a router in any language can rebuild a prefix tree from the stream alone.

Their wire form and a ZeroMQ publisher are an integration
(:mod:`kvcore.integrations.events`); the core only records events.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import NamedTuple, Protocol, Self, TypeAlias

from kvcore.coordinator.hashing import BlockHash

__all__ = [
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "ClosingPublisher",
    "EventBatch",
    "EventPublisher",
    "GroupEventInfo",
    "KVCacheEvent",
    "NullEventPublisher",
]

MEDIUM_GPU = "GPU"
"""The default medium: blocks of the engine's own (device) KV cache."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive blocks of one group were registered in the prefix cache.

    ``block_hashes[i]`` is the chained hash of the block holding
    ``token_ids[i * block_size : (i + 1) * block_size]``; the first block's
    chain continues from ``parent_block_hash`` (None: it is the request's
    first block).  Blocks that were not stored in between (a window's null
    blocks, already cached ones) split a step's blocks into several events,
    so each event is one unbroken run of the chain.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    #: All tokens of the stored blocks, in order.
    token_ids: tuple[int, ...]
    #: Tokens per block of this group.
    block_size: int
    group_id: int
    #: Registry name of the group's cache kind (``"full_attention"``, ...).
    kind: str
    #: The group's sliding window in tokens, None when the kind has none.
    sliding_window: int | None
    #: The pool's block ids (local to this engine; routers ignore them).
    block_ids: tuple[int, ...]
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks of one group lost their prefix-cache key (evicted)."""

    block_hashes: tuple[BlockHash, ...]
    group_id: int
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache of the medium was reset."""

    medium: str = MEDIUM_GPU


KVCacheEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class GroupEventInfo(NamedTuple):
    """What a :class:`BlockStored` says about its group, given to the pool
    once at construction (the pool knows no kinds)."""

    block_size: int
    kind: str
    sliding_window: int | None


@dataclass(frozen=True, slots=True)
class EventBatch:
    """A decoded batch: when it was encoded (seconds since the epoch) and
    its events, in the order they happened."""

    timestamp: float
    events: tuple[KVCacheEvent, ...]


# ---------------------------------------------------------------------------
# Publishers
# ---------------------------------------------------------------------------


class EventPublisher(Protocol):
    """What an engine loop calls: ``publisher.publish(manager.take_events())``."""

    def publish(
        self, events: Sequence[KVCacheEvent], *, timestamp: float | None = None
    ) -> int | None: ...

    def close(self) -> None: ...


class ClosingPublisher:
    """A publisher usable in a ``with`` block: leaving it calls
    :meth:`close`."""

    def close(self) -> None:
        """Release what the publisher holds (nothing here)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class NullEventPublisher(ClosingPublisher):
    """A publisher that drops every batch, for engines with no router."""

    def publish(
        self, events: Sequence[KVCacheEvent], *, timestamp: float | None = None
    ) -> int | None:
        """Drop ``events``; returns None (no sequence number)."""
        return None
