"""KV-cache events on the wire: msgpack batches and a ZeroMQ publisher.

The block pool records events (:mod:`kvcore.coordinator.events`); this
module encodes them for KV-aware routers.  The wire form is msgpack, written
by msgspec; the exact layout is in docs/coordinator.md.  msgspec and pyzmq
are optional (``pip install 'kvcore[events]'``): importing this module needs
neither.
"""

# No ``from __future__ import annotations``: msgspec reads the annotations
# of the wire structs defined inside _get_wire, which strings would hide.
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from kvcore.coordinator.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ClosingPublisher,
    EventBatch,
    KVCacheEvent,
)
from kvcore.errors import (
    KvcoreTypeError,
    KvcoreValueError,
    MissingExtraError,
    echo,
    require_instance,
)

_LOG = logging.getLogger("kvcore.events")
#: The largest value a ZeroMQ int socket option takes.
_MAX_SOCKET_OPTION = 2**31 - 1

__all__ = [
    "ZmqEventPublisher",
    "decode_event_batch",
    "encode_event_batch",
]

# ---------------------------------------------------------------------------
# Wire form
# ---------------------------------------------------------------------------

_EXTRA = "pip install 'kvcore[events]'"


class _Wire(NamedTuple):
    encoder: Any
    decoder: Any
    batch: Any
    stored: Any
    removed: Any
    cleared: Any
    errors: tuple[type[Exception], ...]


_wire: _Wire | None = None


def _get_wire() -> _Wire:
    """The msgspec structs of the wire form, built on first use so that
    importing kvcore never needs msgspec."""
    global _wire
    if _wire is not None:
        return _wire
    try:
        import msgspec
    except ImportError as exc:
        msg = (
            "encoding or decoding KV-cache events needs msgspec, which is not "
            f"installed: {_EXTRA}"
        )
        raise MissingExtraError(msg, name="msgspec") from exc

    # Array-like tagged structs: each event is a msgpack array whose first
    # element is the tag, then the fields in declaration order.
    class Stored(msgspec.Struct, array_like=True, tag="BlockStored", frozen=True):
        block_hashes: list[bytes]
        parent_block_hash: bytes | None
        token_ids: list[int]
        block_size: int
        group_id: int
        kind: str
        sliding_window: int | None
        block_ids: list[int]
        medium: str

    class Removed(msgspec.Struct, array_like=True, tag="BlockRemoved", frozen=True):
        block_hashes: list[bytes]
        group_id: int
        medium: str

    class Cleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared", frozen=True):
        medium: str

    class Batch(msgspec.Struct, array_like=True, frozen=True):
        timestamp: float
        events: list[Stored | Removed | Cleared]

    _wire = _Wire(
        encoder=msgspec.msgpack.Encoder(),
        decoder=msgspec.msgpack.Decoder(Batch),
        batch=Batch,
        stored=Stored,
        removed=Removed,
        cleared=Cleared,
        errors=(msgspec.DecodeError, msgspec.ValidationError),
    )
    return _wire


def encode_event_batch(
    events: Iterable[KVCacheEvent], *, timestamp: float | None = None
) -> bytes:
    """One batch of events in kvcore's wire form (msgpack; layout in
    docs/coordinator.md).  ``timestamp`` defaults to ``time.time()``."""
    require_instance(events, (list, tuple), "encode_event_batch: events")
    wire = _get_wire()
    out: list[Any] = []
    for i, event in enumerate(events):
        if type(event) is BlockStored:
            out.append(
                wire.stored(
                    list(event.block_hashes),
                    event.parent_block_hash,
                    list(event.token_ids),
                    event.block_size,
                    event.group_id,
                    event.kind,
                    event.sliding_window,
                    list(event.block_ids),
                    event.medium,
                )
            )
        elif type(event) is BlockRemoved:
            out.append(
                wire.removed(list(event.block_hashes), event.group_id, event.medium)
            )
        elif type(event) is AllBlocksCleared:
            out.append(wire.cleared(event.medium))
        else:
            msg = (
                f"encode_event_batch: event {i} is a {type(event).__name__}, not "
                "a BlockStored, BlockRemoved or AllBlocksCleared; pass what "
                "KVCacheManager.take_events() returns"
            )
            raise KvcoreTypeError(msg)
    if timestamp is None:
        timestamp = time.time()
    elif isinstance(timestamp, bool) or not isinstance(timestamp, int | float):
        msg = (
            f"encode_event_batch: timestamp must be seconds since the epoch "
            f"(a float) or None, got {timestamp!r}"
        )
        raise KvcoreTypeError(msg)
    data: bytes = wire.encoder.encode(wire.batch(float(timestamp), out))
    return data


def decode_event_batch(data: bytes) -> EventBatch:
    """The batch :func:`encode_event_batch` wrote; a payload that is not one
    raises :class:`~kvcore.errors.KvcoreValueError`."""
    require_instance(data, (bytes, bytearray, memoryview), "decode_event_batch: data")
    wire = _get_wire()
    try:
        batch = wire.decoder.decode(data)
    except wire.errors as exc:
        msg = (
            f"decode_event_batch: not a kvcore KV-cache event batch ({exc}); "
            "decode only payloads that encode_event_batch wrote (the last frame "
            "of a ZmqEventPublisher message)"
        )
        raise KvcoreValueError(msg) from exc
    events: list[KVCacheEvent] = []
    for e in batch.events:
        if type(e) is wire.stored:
            events.append(
                BlockStored(
                    tuple(e.block_hashes),
                    e.parent_block_hash,
                    tuple(e.token_ids),
                    e.block_size,
                    e.group_id,
                    e.kind,
                    e.sliding_window,
                    tuple(e.block_ids),
                    e.medium,
                )
            )
        elif type(e) is wire.removed:
            events.append(BlockRemoved(tuple(e.block_hashes), e.group_id, e.medium))
        else:
            events.append(AllBlocksCleared(e.medium))
    return EventBatch(batch.timestamp, tuple(events))


class ZmqEventPublisher(ClosingPublisher):
    """Publishes event batches on a ZeroMQ socket (XPUB, read by any SUB).

    Every message has three frames: the topic (UTF-8), the batch's sequence
    number (8 bytes, unsigned big-endian, 0 for the first batch and one more
    for each batch after it) and the batch (:func:`encode_event_batch`).  An
    empty event list sends nothing and takes no number.

    The queue is bounded: at most ``max_queued_batches`` batches wait for a
    subscriber that does not read.  A batch that finds the queue full is
    dropped whole, still takes its sequence number (so every subscriber sees
    the gap and resynchronises, e.g. treats that engine's cache as unknown)
    and is counted in :attr:`dropped_batches`; the first drop, and every
    thousandth after it, is logged on the ``kvcore.events`` logger.

    Events carry the token ids of every prompt: bind to loopback
    (``tcp://127.0.0.1:5557``) or a private network's address, never to
    every interface, unless the routers reading them may see every prompt.

    Not thread-safe (ZeroMQ sockets are not): publish from the engine's loop.

    :param endpoint: where to bind (``"tcp://127.0.0.1:5557"``,
        ``"inproc://kv"``), or to connect when ``bind`` is False.
    :param topic: the first frame of every message, for SUB filtering.
    :param context: the ZeroMQ context (default: a new one, terminated by
        :meth:`close`); ``inproc://`` needs the subscriber's context.
    :param linger_ms: how long :meth:`close` waits to flush unsent messages.
    :param max_queued_batches: batches queued for a slow subscriber before
        new ones are dropped.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = "kv-events",
        bind: bool = True,
        context: Any = None,
        linger_ms: int = 100,
        max_queued_batches: int = 256,
    ) -> None:
        given: object = endpoint  # checked: callers pass anything
        if not isinstance(given, str) or not given:
            msg = (
                f"ZmqEventPublisher: endpoint must be a ZeroMQ address such as "
                f"'tcp://127.0.0.1:5557', got {echo(endpoint)}"
            )
            raise KvcoreTypeError(msg)
        named: object = topic
        if not isinstance(named, str):
            msg = f"ZmqEventPublisher: topic must be a str, got {echo(topic)}"
            raise KvcoreTypeError(msg)
        for option, value, low in (
            ("linger_ms", linger_ms, -1),
            ("max_queued_batches", max_queued_batches, 1),
        ):
            if type(value) is not int:
                msg = f"ZmqEventPublisher: {option} must be an int, got {echo(value)}"
                raise KvcoreTypeError(msg)
            if not low <= value <= _MAX_SOCKET_OPTION:
                msg = (
                    f"ZmqEventPublisher: {option} must be between {low} and "
                    f"{_MAX_SOCKET_OPTION}, got {value}"
                )
                raise KvcoreValueError(msg)
        flag: object = bind
        if type(flag) is not bool:
            msg = f"ZmqEventPublisher: bind must be True or False, got {echo(bind)}"
            raise KvcoreTypeError(msg)
        try:
            import zmq
        except ImportError as exc:
            msg = f"ZmqEventPublisher needs pyzmq, which is not installed: {_EXTRA}"
            raise MissingExtraError(msg, name="zmq") from exc
        _get_wire()  # fail here, not at the first publish, without msgspec
        if context is not None and not isinstance(context, zmq.Context):
            msg = (
                f"ZmqEventPublisher: context must be a zmq.Context, got "
                f"{type(context).__name__}"
            )
            raise KvcoreTypeError(msg)
        self._zmq = zmq
        self._owns_context = context is None
        self._context = zmq.Context() if context is None else context
        self._socket: Any = None
        self._closed = True
        try:
            self._socket = self._context.socket(zmq.XPUB)
            self._socket.setsockopt(zmq.LINGER, linger_ms)
            self._socket.setsockopt(zmq.SNDHWM, max_queued_batches)
            # A full queue refuses the send (counted) instead of dropping it
            # silently.
            self._socket.setsockopt(zmq.XPUB_NODROP, 1)
            if bind:
                self._socket.bind(endpoint)
            else:
                self._socket.connect(endpoint)
            self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException as exc:
            # Nothing a refused constructor made is left for the collector.
            if self._socket is not None:
                self._socket.close(linger=0)
            if self._owns_context:
                self._context.term()
            if not isinstance(exc, zmq.ZMQError):
                raise
            how = "bind to" if bind else "connect to"
            msg = (
                f"ZmqEventPublisher: cannot {how} {echo(endpoint)} ({exc}); pick a "
                "free port or a valid ZeroMQ address"
            )
            raise KvcoreValueError(msg) from exc
        self.topic = topic
        self._topic = topic.encode()
        #: The sequence number the next batch gets.
        self.next_seq = 0
        #: Batches dropped because the queue was full (their numbers skipped).
        self.dropped_batches = 0
        self._closed = False

    def publish(
        self, events: Sequence[KVCacheEvent], *, timestamp: float | None = None
    ) -> int | None:
        """Send ``events`` as one batch; returns its sequence number (a
        dropped batch's too), or None when ``events`` is empty (nothing is
        sent)."""
        if self._closed:
            msg = "ZmqEventPublisher: publish after close(); make a new publisher"
            raise KvcoreValueError(msg)
        if not events:
            return None
        payload = encode_event_batch(events, timestamp=timestamp)
        seq = self.next_seq
        self.next_seq = seq + 1
        try:
            self._socket.send_multipart(
                (self._topic, seq.to_bytes(8, "big"), payload),
                flags=self._zmq.NOBLOCK,
            )
        except self._zmq.Again:
            self.dropped_batches += 1
            if self.dropped_batches % 1000 == 1:
                _LOG.warning(
                    "ZmqEventPublisher %s: dropped %d batch(es) so far: a subscriber "
                    "is not reading; it will see a gap in the sequence numbers",
                    self.endpoint,
                    self.dropped_batches,
                )
        return seq

    def close(self) -> None:
        """Close the socket (and the context it made); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._socket.close()
        if self._owns_context:
            self._context.term()
