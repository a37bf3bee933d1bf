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

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import NamedTuple, Protocol, Self, TypeAlias

from kvcore.coordinator.hashing import BlockHash
from kvcore.errors import InvalidRequestError, KvcoreTypeError

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


# -- what the block pool records ------------------------------------------------


def check_event_groups(
    groups: Sequence[tuple[int, str, int | None]],
) -> tuple[GroupEventInfo, ...]:
    out = []
    for gid, item in enumerate(groups):
        given: object = item  # checked: callers pass anything
        ok = isinstance(given, tuple) and len(given) == 3
        if ok:
            size, kind, window = item
            ok = (
                type(size) is int
                and size > 0
                and type(kind) is str
                and (window is None or (type(window) is int and window > 0))
            )
        if not ok:
            msg = (
                f"event_groups[{gid}] must be (block_size: positive int, kind: "
                f"str, sliding_window: positive int or None), got {item!r}"
            )
            raise KvcoreTypeError(msg)
        out.append(GroupEventInfo(size, kind, window))
    return tuple(out)


def check_event_inputs(
    groups: Sequence[GroupEventInfo],
    group_id: int,
    token_ids: Sequence[int] | None,
    num_full_blocks: int,
) -> None:
    """Refuse, before anything changes, a store whose event cannot be
    built."""
    if not 0 <= group_id < len(groups):
        msg = (
            f"cache_full_blocks: KV cache events are on but cache group "
            f"{group_id} has no event facts ({len(groups)} given); build the "
            "BlockPool with event_groups=[(block_size, kind, sliding_window), "
            "...], one per group id (KVCacheCoordinator does)"
        )
        raise InvalidRequestError(msg)
    need = num_full_blocks * groups[group_id].block_size
    if token_ids is None or len(token_ids) < need:
        got = "none" if token_ids is None else str(len(token_ids))
        msg = (
            f"cache_full_blocks for group {group_id}: KV cache events are on, "
            f"so token_ids must hold the {need} tokens of the "
            f"{num_full_blocks} full blocks, got {got}; pass "
            "token_ids=request.all_token_ids"
        )
        raise InvalidRequestError(msg)


def stored_events(
    info: GroupEventInfo,
    group_id: int,
    block_hashes: Sequence[BlockHash],
    blocks: Sequence[int],
    token_ids: Sequence[int],
    stored: list[int],
    medium: str,
) -> list[BlockStored]:
    """One :class:`BlockStored` per unbroken run of ``stored`` positions of
    ``blocks`` (a table of block ids), so each event's parent hash is the
    block right before its first."""
    size = info.block_size
    out = []
    start = prev = stored[0]
    for pos in (*stored[1:], -1):
        if pos == prev + 1:
            prev = pos
            continue
        end = prev + 1
        out.append(
            BlockStored(
                tuple(block_hashes[start:end]),
                block_hashes[start - 1] if start else None,
                # Plain ints, whatever int-like ids (numpy ints) the
                # engine passed: the wire form takes only ints.
                tuple(map(operator.index, token_ids[start * size : end * size])),
                size,
                group_id,
                info.kind,
                info.sliding_window,
                tuple(blocks[start:end]),
                medium,
            )
        )
        start = prev = pos
    return out
