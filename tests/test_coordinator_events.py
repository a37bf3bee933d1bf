"""KV-cache events: what they carry, their wire form, the ZeroMQ publisher."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import ClassVar

import attrs
import msgspec
import pytest
import torch
import zmq

import kvcore
from kvcore import (
    AttentionKind,
    AttentionSpec,
    CacheKind,
    HitPolicy,
    KindRegistry,
    KVCacheConfig,
    KVCacheGroupSpec,
    hookimpl,
)
from kvcore.coordinator import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
    KVCacheManager,
    NullEventPublisher,
    Request,
    WindowManager,
    events,
)
from kvcore.errors import (
    InvalidRequestError,
    KvcoreError,
    KvcoreTypeError,
    KvcoreValueError,
    MissingExtraError,
    PluginError,
)
from kvcore.integrations import events as wire
from kvcore.integrations.events import (
    ZmqEventPublisher,
    decode_event_batch,
    encode_event_batch,
)
from kvcore_full_attention import FullAttentionSpec
from kvcore_sliding_window import SlidingWindowSpec


def h(i: int) -> bytes:
    return bytes([i]) * 32


STORED = BlockStored(
    block_hashes=(h(1), h(2)),
    parent_block_hash=h(9),
    token_ids=tuple(range(10, 18)),
    block_size=4,
    group_id=1,
    kind="sliding_window",
    sliding_window=8,
    block_ids=(4, 5),
    medium="CPU",
)
ALL_KINDS: list[KVCacheEvent] = [
    STORED,
    BlockStored((h(3),), None, (7, 8), 2, 0, "full_attention", None, (1,)),
    BlockRemoved((h(1), h(2)), 1, "CPU"),
    BlockRemoved((h(3),), 0),
    AllBlocksCleared(),
    AllBlocksCleared("STORAGE"),
]


# -- the event types ---------------------------------------------------------------


def test_old_import_paths_still_work() -> None:
    from kvcore.coordinator import block_pool

    assert block_pool.BlockStored is events.BlockStored is BlockStored
    assert block_pool.BlockRemoved is BlockRemoved
    assert block_pool.AllBlocksCleared is AllBlocksCleared
    assert block_pool.KVCacheEvent is events.KVCacheEvent


def test_medium_defaults_to_gpu() -> None:
    assert BlockRemoved((h(1),), 0).medium == "GPU"
    assert AllBlocksCleared().medium == "GPU"
    assert BlockStored((), None, (), 4, 0, "mla", None, ()).medium == "GPU"


# -- wire form ---------------------------------------------------------------------


def test_round_trip_of_every_event_type_with_all_fields() -> None:
    data = encode_event_batch(ALL_KINDS, timestamp=1234.5)
    assert decode_event_batch(data) == EventBatch(1234.5, tuple(ALL_KINDS))


def test_wire_form_is_the_documented_msgpack_layout() -> None:
    # docs/coordinator.md: a batch is [timestamp, [event, ...]]; each event is
    # [tag, fields in declaration order].
    data = encode_event_batch(ALL_KINDS[:5], timestamp=2.0)
    assert msgspec.msgpack.decode(data) == [
        2.0,
        [
            [
                "BlockStored",
                [h(1), h(2)],
                h(9),
                list(range(10, 18)),
                4,
                1,
                "sliding_window",
                8,
                [4, 5],
                "CPU",
            ],
            [
                "BlockStored",
                [h(3)],
                None,
                [7, 8],
                2,
                0,
                "full_attention",
                None,
                [1],
                "GPU",
            ],
            ["BlockRemoved", [h(1), h(2)], 1, "CPU"],
            ["BlockRemoved", [h(3)], 0, "GPU"],
            ["AllBlocksCleared", "GPU"],
        ],
    ]
    # The timestamp is a msgpack float 64 (0xcb) right after the 2-array.
    assert data[:2] == b"\x92\xcb"


def test_timestamp_defaults_to_now() -> None:
    before = time.time()
    batch = decode_event_batch(encode_event_batch([]))
    assert before <= batch.timestamp <= time.time()
    assert batch.events == ()


def test_encode_refuses_what_is_not_an_event() -> None:
    with pytest.raises(KvcoreTypeError, match=r"event 1 is a str") as info:
        encode_event_batch([AllBlocksCleared(), "cleared"])  # type: ignore[list-item]
    assert isinstance(info.value, TypeError)
    with pytest.raises(KvcoreTypeError, match="timestamp must be"):
        encode_event_batch([], timestamp="now")  # type: ignore[arg-type]


def test_decode_refuses_a_foreign_payload() -> None:
    bad = msgspec.msgpack.encode([1.0, [["BlockEvicted", [h(1)], 0, "GPU"]]])
    with pytest.raises(KvcoreValueError, match="not a kvcore KV-cache event batch"):
        decode_event_batch(bad)
    with pytest.raises(KvcoreValueError, match="not a kvcore KV-cache event batch"):
        decode_event_batch(b"\xc1")


def test_missing_msgspec_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "msgspec", None)
    monkeypatch.setattr(wire, "_wire", None)
    for call in (
        lambda: encode_event_batch([AllBlocksCleared()]),
        lambda: decode_event_batch(b"\x92\xcb"),
        lambda: ZmqEventPublisher("inproc://kvcore-no-msgspec"),
    ):
        with pytest.raises(
            MissingExtraError, match=re.escape("pip install 'kvcore[events]'")
        ) as info:
            call()
        assert isinstance(info.value, ImportError)
        assert isinstance(info.value, KvcoreError)
        assert info.value.name == "msgspec"


def test_missing_pyzmq_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zmq", None)
    with pytest.raises(
        MissingExtraError, match=re.escape("pip install 'kvcore[events]'")
    ) as info:
        ZmqEventPublisher("inproc://kvcore-no-zmq")
    assert info.value.name == "zmq"


def test_importing_kvcore_needs_neither_msgspec_nor_pyzmq() -> None:
    code = (
        "import sys\n"
        "sys.modules['msgspec'] = None\n"
        "sys.modules['zmq'] = None\n"
        "import kvcore, kvcore.coordinator\n"
        "from kvcore.coordinator import BlockStored\nfrom kvcore.integrations.events import ZmqEventPublisher\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert (out.returncode, out.stdout, out.stderr) == (0, "ok\n", "")


# -- the pool records them -----------------------------------------------------------


def pool(num_blocks: int = 8, *, kv_events_medium: str = "GPU") -> BlockPool:
    return BlockPool(
        num_blocks,
        enable_caching=True,
        hash_block_size=2,
        enable_kv_cache_events=True,
        event_groups=[(2, "full_attention", None), (2, "sliding_window", 4)],
        kv_events_medium=kv_events_medium,
    )


def test_a_gap_in_stored_blocks_splits_the_event() -> None:
    p = pool()
    a = p.get_new_blocks(3)  # 1 2 3
    table = [a[0], p.null_block, a[1], a[2]]
    p.cache_full_blocks(
        block_hashes=[h(1), h(2), h(3), h(4)],
        blocks=table,
        num_cached_blocks=0,
        num_full_blocks=4,
        group_id=1,
        token_ids=range(100, 109),
    )
    # Position 1 is null (outside the window): two runs, the second
    # chained to position 1's hash.
    assert p.take_events() == [
        BlockStored((h(1),), None, (100, 101), 2, 1, "sliding_window", 4, (1,)),
        BlockStored(
            (h(3), h(4)),
            h(2),
            (104, 105, 106, 107),
            2,
            1,
            "sliding_window",
            4,
            (2, 3),
        ),
    ]


def test_medium_is_configurable() -> None:
    p = pool(kv_events_medium="CPU")
    a = p.get_new_blocks(1)
    p.cache_full_blocks(
        block_hashes=[h(1)],
        blocks=a,
        num_cached_blocks=0,
        num_full_blocks=1,
        group_id=0,
        token_ids=[5, 6],
    )
    p.free_blocks(a)
    p.get_new_blocks(7)  # every free block: block 1 is evicted
    assert p.reset_prefix_cache() is False
    assert p.take_events() == [
        BlockStored((h(1),), None, (5, 6), 2, 0, "full_attention", None, (1,), "CPU"),
        BlockRemoved((h(1),), 0, "CPU"),
    ]
    with pytest.raises(KvcoreValueError, match="kv_events_medium must be"):
        pool(kv_events_medium="")
    with pytest.raises(KvcoreTypeError, match="kv_events_medium must be"):
        pool(kv_events_medium=None)  # type: ignore[arg-type]


def test_store_without_tokens_or_group_facts_is_refused_and_changes_nothing() -> None:
    p = pool()
    a = p.get_new_blocks(2)

    def store(group_id: int, token_ids: Sequence[int] | None) -> None:
        p.cache_full_blocks(
            block_hashes=[h(1), h(2)],
            blocks=a,
            num_cached_blocks=0,
            num_full_blocks=2,
            group_id=group_id,
            token_ids=token_ids,
        )

    with pytest.raises(
        InvalidRequestError, match=r"token_ids must hold the 4 tokens .* got none"
    ):
        store(0, None)
    with pytest.raises(InvalidRequestError, match=r"hold the 4 tokens .* got 3"):
        store(0, [1, 2, 3])
    with pytest.raises(InvalidRequestError, match=r"cache group 2 has no event facts"):
        store(2, range(4))
    assert p.num_cached_blocks == 0
    assert p.take_events() == []
    with pytest.raises(KvcoreTypeError, match=r"event_groups\[1\] must be"):
        BlockPool(
            4,
            enable_caching=True,
            hash_block_size=2,
            event_groups=[(2, "x", None), (0, "y", None)],
        )


def test_a_block_listed_twice_is_stored_once_in_the_event() -> None:
    """A table that lists a block twice (only misuse makes one): the block
    takes its first listing's key, and the event names that key only."""
    p = BlockPool(
        8,
        enable_caching=True,
        hash_block_size=2,
        enable_kv_cache_events=True,
        event_groups=[(2, "full_attention", None)],
    )
    (block,) = p.get_new_blocks(1)
    p.cache_full_blocks(
        block_hashes=[h(1), h(2)],
        blocks=[block, block],
        num_cached_blocks=0,
        num_full_blocks=2,
        group_id=0,
        token_ids=[1, 2, 3, 4],
    )
    assert (p.key_hash[block], p.key_group[block]) == (h(1), 0)
    (event,) = p.take_events()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == (h(1),)
    assert event.block_ids == (block,)
    assert event.token_ids == (1, 2)


def test_events_off_needs_no_tokens() -> None:
    p = BlockPool(4, enable_caching=True, hash_block_size=2)
    a = p.get_new_blocks(1)
    p.cache_full_blocks(
        block_hashes=[h(1)],
        blocks=a,
        num_cached_blocks=0,
        num_full_blocks=1,
        group_id=0,
    )
    assert (p.key_hash[a[0]], p.key_group[a[0]]) == (h(1), 0)
    assert p.take_events() == []


def test_rollback_drops_the_transactions_events() -> None:
    p = pool(4)  # 3 usable blocks
    a = p.get_new_blocks(1)  # 1
    p.cache_full_blocks(
        block_hashes=[h(1)],
        blocks=a,
        num_cached_blocks=0,
        num_full_blocks=1,
        group_id=0,
        token_ids=[1, 2],
    )
    p.free_blocks(a)  # queue: 2 3 1
    before = BlockStored((h(1),), None, (1, 2), 2, 0, "full_attention", None, (1,))

    def step() -> None:
        b = p.get_new_blocks(3)  # 2 3 1: block 1's key is evicted
        p.cache_full_blocks(
            block_hashes=[h(5), h(6)],
            blocks=b,
            num_cached_blocks=0,
            num_full_blocks=2,
            group_id=1,
            token_ids=range(4),
        )

    p.begin()
    step()
    p.rollback()
    assert p.take_events() == [before]
    assert p.lookup(h(1), 0) == a[0]
    # The same step committed keeps its events: the eviction, then the store.
    p.begin()
    step()
    p.commit()
    assert p.take_events() == [
        BlockRemoved((h(1),), 0),
        BlockStored(
            (h(5), h(6)), None, (0, 1, 2, 3), 2, 1, "sliding_window", 4, (2, 3)
        ),
    ]


# -- a real KVCacheManager run ----------------------------------------------------------


def hybrid_manager(kv_events_medium: object = "GPU") -> KVCacheManager:
    fa = FullAttentionSpec(
        block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    sw = SlidingWindowSpec(
        block_size=4,
        num_kv_heads=1,
        head_size=8,
        dtype=torch.float16,
        sliding_window=8,
    )
    config = KVCacheConfig(
        num_blocks=13,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["layer.0"], fa),
            KVCacheGroupSpec(["layer.1"], sw),
        ],
    )
    return KVCacheManager(
        config,
        max_model_len=256,
        scheduler_block_size=4,
        hash_block_size=4,
        enable_kv_cache_events=True,
        kv_events_medium=kv_events_medium,  # type: ignore[arg-type]
    )


def fa_stored(
    hashes: list[bytes],
    parent: bytes | None,
    tokens: Iterable[int],
    ids: tuple[int, ...],
) -> BlockStored:
    return BlockStored(
        tuple(hashes), parent, tuple(tokens), 4, 0, "full_attention", None, ids
    )


def sw_stored(
    hashes: list[bytes],
    parent: bytes | None,
    tokens: Iterable[int],
    ids: tuple[int, ...],
) -> BlockStored:
    return BlockStored(
        tuple(hashes), parent, tuple(tokens), 4, 1, "sliding_window", 8, ids
    )


def test_hybrid_run_cached_evicted_and_reset() -> None:
    mgr = hybrid_manager()  # 12 usable blocks
    prompt = list(range(500, 516))  # 4 blocks of 4
    a = Request("a", prompt, hash_block_size=4)
    ha = list(a.block_hashes)
    # Step 1: 12 tokens, cached later (delay_cache_blocks).  Full attention
    # takes 1 2 3, the window 4 5 6.
    assert mgr.allocate_slots(a, 12, delay_cache_blocks=True) is not None
    a.num_computed_tokens = 12
    assert mgr.take_events() == []
    # Step 2: the last 4 tokens.  The window's first block left the window
    # (12 - 8 + 1 = 5 tokens skipped: 1 block): block 4 is released unhashed
    # to the front of the queue, so full attention takes it and the window
    # takes 7.  The window's position 0 is null: its stored run starts at
    # position 1, with position 0's hash as parent.
    assert mgr.allocate_slots(a, 4) is not None
    a.num_computed_tokens = 16
    assert mgr.get_block_ids("a") == ([1, 2, 3, 4], [0, 5, 6, 7])
    assert mgr.take_events() == [
        fa_stored(ha, None, prompt, (1, 2, 3, 4)),
        sw_stored(ha[1:], ha[0], prompt[4:], (5, 6, 7)),
    ]
    # Tail first by hit point: each position's full-attention block, then
    # its window block: 4 7 3 6 2 5 1.
    mgr.free(a)
    assert mgr.get_num_free_blocks() == 12

    # 24 new tokens take 6 full-attention and 6 window blocks: all 12 free
    # ones in queue order 8 9 10 11 12 4 | 7 3 6 2 5 1, so every one of a's 7
    # cached blocks is evicted as it is handed out, before b's are stored.
    other = list(range(900, 924))
    b = Request("b", other, hash_block_size=4)
    hb = list(b.block_hashes)
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 0
    assert mgr.allocate_slots(b, 24, num_hit, hit) is not None
    assert mgr.get_block_ids("b") == ([8, 9, 10, 11, 12, 4], [7, 3, 6, 2, 5, 1])
    got = mgr.take_events()
    assert got == [
        BlockRemoved((ha[3],), 0),  # block 4
        BlockRemoved((ha[3],), 1),  # blocks 7 3 6 2 5 1, taken by the window
        BlockRemoved((ha[2],), 0),
        BlockRemoved((ha[2],), 1),
        BlockRemoved((ha[1],), 0),
        BlockRemoved((ha[1],), 1),
        BlockRemoved((ha[0],), 0),
        fa_stored(hb, None, other, (8, 9, 10, 11, 12, 4)),
        sw_stored(hb, None, other, (7, 3, 6, 2, 5, 1)),
    ]
    mgr.free(b)
    assert mgr.reset_prefix_cache() is True
    assert mgr.take_events() == [AllBlocksCleared()]

    # The whole run survives the wire.
    assert decode_event_batch(encode_event_batch(got, timestamp=0.0)).events == tuple(
        got
    )


def test_manager_medium_and_validation() -> None:
    mgr = hybrid_manager(kv_events_medium="CPU")
    r = Request("r", list(range(4)), hash_block_size=4)
    assert mgr.allocate_slots(r, 4) is not None
    assert [e.medium for e in mgr.take_events()] == ["CPU", "CPU"]
    with pytest.raises(KvcoreTypeError, match="kv_events_medium must be a str"):
        hybrid_manager(kv_events_medium=b"GPU")
    with pytest.raises(
        InvalidRequestError, match="kv_events_medium must be a non-empty"
    ):
        hybrid_manager(kv_events_medium="")


# -- a third-party kind's declared window ------------------------------------------


@attrs.frozen(kw_only=True)
class RecentSpec(AttentionSpec):
    """A third party's windowed kind: its window field has its own name
    (``recent``), and it tells routers ``announce`` through the declaration."""

    kind: ClassVar[str] = "recent_tokens"

    recent: int = attrs.field(default=8)
    announce: object = attrs.field(default=8)

    @property
    def hit_policy(self) -> HitPolicy:
        return HitPolicy.WINDOW

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(num_computed_tokens - self.recent + 1, 0)

    @property
    def event_window(self) -> int | None:
        if self.announce == "raise":
            raise RuntimeError("no window today")
        return self.announce  # type: ignore[return-value]


class Recent(AttentionKind):
    name: ClassVar[str] = "recent_tokens"
    spec_type = RecentSpec
    manager_type = WindowManager


class RecentPlugin:
    @hookimpl
    def kvcore_register_kinds(self) -> list[CacheKind]:
        return [Recent()]


def recent_manager(announce: object, *, events_on: bool = True) -> KVCacheManager:
    pm = kvcore.get_plugin_manager(load_entrypoints=False)
    pm.register(RecentPlugin(), name="recent-plugin")
    registry = KindRegistry.from_plugin_manager(pm)
    spec = RecentSpec(
        block_size=4,
        num_kv_heads=1,
        head_size=8,
        dtype=torch.float16,
        announce=announce,
    )
    config = KVCacheConfig(
        num_blocks=9,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
    )
    return KVCacheManager(
        config,
        max_model_len=64,
        scheduler_block_size=4,
        hash_block_size=4,
        enable_kv_cache_events=events_on,
        registry=registry,
    )


@pytest.mark.parametrize("announce", [8, 24, None])
def test_a_third_party_kind_declares_the_window_its_events_carry(
    announce: int | None,
) -> None:
    mgr = recent_manager(announce)
    prompt = list(range(100, 112))
    r = Request("r", prompt, hash_block_size=4)
    assert mgr.allocate_slots(r, 12) is not None
    assert mgr.take_events() == [
        BlockStored(
            tuple(r.block_hashes),
            None,
            tuple(prompt),
            4,
            0,
            "recent_tokens",
            announce,
            (1, 2, 3),
        )
    ]


@pytest.mark.parametrize(
    ("announce", "shown"),
    [
        (0, "event_window is 0 (int)"),
        (-8, "event_window is -8 (int)"),
        (True, "event_window is True (bool)"),
        (8.0, "event_window is 8.0 (float)"),
        ("8", "event_window is '8' (str)"),
    ],
)
def test_a_kind_declaring_a_garbage_window_is_refused_naming_it(
    announce: object, shown: str
) -> None:
    with pytest.raises(PluginError) as info:
        recent_manager(announce)
    text = str(info.value)
    assert text.startswith(
        "cache kind 'recent_tokens' (RecentSpec) of plugin 'recent-plugin'"
    )
    assert shown in text
    assert "KVCORE_DISABLE_PLUGINS=recent-plugin" in text
    assert info.value.plugin_name == "recent-plugin"
    assert isinstance(info.value, TypeError)


def test_a_kind_whose_window_raises_is_named() -> None:
    with pytest.raises(PluginError, match="event_window raised RuntimeError") as info:
        recent_manager("raise")
    assert info.value.plugin_name == "recent-plugin"
    assert isinstance(info.value.__cause__, RuntimeError)


def test_the_window_is_read_only_with_events_on() -> None:
    # Nothing asks for the declaration when no event is recorded.
    mgr = recent_manager("raise", events_on=False)
    r = Request("r", list(range(8)), hash_block_size=4)
    assert mgr.allocate_slots(r, 8) is not None
    assert mgr.take_events() == []


# -- publishers ---------------------------------------------------------------------


def _recv(sub: zmq.Socket[bytes], timeout_ms: int) -> list[bytes] | None:
    if sub.poll(timeout_ms):
        return sub.recv_multipart()
    return None


def _subscribed(pub: ZmqEventPublisher, sub: zmq.Socket[bytes]) -> int:
    """Publish probes until the subscription has reached the publisher (a PUB
    socket drops messages sent before); returns the last probe's number."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        seq = pub.publish([AllBlocksCleared("probe")])
        assert seq is not None
        while (msg := _recv(sub, 20)) is not None:
            if int.from_bytes(msg[1], "big") == seq:
                return seq
    pytest.fail("the subscriber never received a batch")


@pytest.mark.parametrize(
    "endpoint", ["inproc://kvcore-events-test", "tcp://127.0.0.1:*"]
)
def test_pub_sub_round_trip_with_sequence_numbers(endpoint: str) -> None:
    ctx = zmq.Context()
    try:
        with ZmqEventPublisher(endpoint, topic="kv@engine0", context=ctx) as pub:
            assert pub.next_seq == 0
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"kv@engine0")
            sub.connect(pub.endpoint)
            try:
                last = _subscribed(pub, sub)
                assert pub.next_seq == last + 1
                assert pub.publish([]) is None  # nothing sent, no number taken
                assert pub.next_seq == last + 1
                assert pub.publish(ALL_KINDS[:3], timestamp=7.0) == last + 1
                assert pub.publish(ALL_KINDS[3:], timestamp=8.0) == last + 2
                first = _recv(sub, 5000)
                second = _recv(sub, 5000)
                assert first is not None
                assert second is not None
                assert first[:2] == [b"kv@engine0", (last + 1).to_bytes(8, "big")]
                assert second[:2] == [b"kv@engine0", (last + 2).to_bytes(8, "big")]
                assert decode_event_batch(first[2]) == EventBatch(
                    7.0, tuple(ALL_KINDS[:3])
                )
                assert decode_event_batch(second[2]) == EventBatch(
                    8.0, tuple(ALL_KINDS[3:])
                )
            finally:
                sub.close()
        with pytest.raises(KvcoreValueError, match="publish after close"):
            pub.publish([AllBlocksCleared()])
        pub.close()  # idempotent
    finally:
        ctx.term()


def test_publisher_refuses_a_bad_endpoint() -> None:
    with pytest.raises(KvcoreValueError, match="cannot bind to 'bogus://x'"):
        ZmqEventPublisher("bogus://x")
    with pytest.raises(KvcoreTypeError, match="endpoint must be a ZeroMQ address"):
        ZmqEventPublisher("")


def test_a_subscriber_that_does_not_read_costs_a_bounded_queue() -> None:
    """Past max_queued_batches, batches are dropped whole, counted, and
    still numbered: the subscriber sees the gap."""
    ctx = zmq.Context()
    try:
        with ZmqEventPublisher(
            "inproc://kvcore-slow-sub", context=ctx, max_queued_batches=4
        ) as pub:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, 1)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(pub.endpoint)
            try:
                start = _subscribed(pub, sub)
                sent = [pub.publish(ALL_KINDS[:1]) for _ in range(200)]
                assert sent == list(range(start + 1, start + 201))
                assert pub.next_seq == start + 201
                # The queue holds a few batches; the rest were dropped.
                assert 180 <= pub.dropped_batches <= 199
                seqs = []
                while (frames := _recv(sub, 200)) is not None:
                    seqs.append(int.from_bytes(frames[1], "big"))
                assert len(seqs) == 200 - pub.dropped_batches
                assert seqs == sorted(seqs)
                # Reading again: the next batch's number shows the gap.
                assert pub.publish(ALL_KINDS[:1]) == start + 201
                frames = _recv(sub, 5000)
                assert frames is not None
                assert int.from_bytes(frames[1], "big") == start + 201 > seqs[-1] + 1
            finally:
                sub.close()
    finally:
        ctx.term()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"linger_ms": "100"}, KvcoreTypeError, "linger_ms must be an int"),
        ({"linger_ms": -2}, KvcoreValueError, "linger_ms must be between -1"),
        ({"max_queued_batches": 0}, KvcoreValueError, "max_queued_batches must be"),
        ({"max_queued_batches": 2**40}, KvcoreValueError, "max_queued_batches"),
        ({"bind": "yes"}, KvcoreTypeError, "bind must be True or False"),
        ({"topic": b"kv"}, KvcoreTypeError, "topic must be a str"),
        ({"context": object()}, KvcoreTypeError, "context must be a zmq.Context"),
    ],
)
def test_publisher_options_are_checked_before_anything_is_made(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ZmqEventPublisher("inproc://kvcore-options", **kwargs)  # type: ignore[arg-type]


def test_a_refused_publisher_leaves_no_socket_behind() -> None:
    """A context with a leaked socket never terminates: after every refusal
    the caller's context still terminates at once."""
    ctx = zmq.Context()
    for endpoint in ("bogus://x", "tcp://256.0.0.1:5557", "tcp://127.0.0.1:notaport"):
        with pytest.raises(KvcoreValueError, match="cannot bind to"):
            ZmqEventPublisher(endpoint, context=ctx)
    done = threading.Event()
    threading.Thread(target=lambda: (ctx.term(), done.set()), daemon=True).start()
    assert done.wait(5), "the context did not terminate: a socket was left open"


def test_null_publisher_sends_nothing() -> None:
    with NullEventPublisher() as pub:
        assert pub.publish(ALL_KINDS) is None
        assert pub.publish([]) is None


def test_the_documented_engine_side_runs() -> None:
    page = (
        Path(__file__).resolve().parent.parent / "docs" / "coordinator.md"
    ).read_text()
    section = page.split("### Publishing", 1)[1].split("\n## ", 1)[0]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "docs/coordinator.md", "exec"), {})


def test_numpy_token_ids_reach_the_wire_as_plain_ints() -> None:
    """An engine's numpy ids are accepted by the token rule; the events
    carry them as ints, so the wire form encodes them."""
    import numpy as np

    spec = FullAttentionSpec(
        block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    config = KVCacheConfig(
        num_blocks=11,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
    )
    mgr = KVCacheManager(
        config, max_model_len=64, scheduler_block_size=4, enable_kv_cache_events=True
    )
    prompt = [np.int64(t) for t in range(1, 11)]
    req = Request("r0", prompt, hash_block_size=4)
    assert mgr.allocate_slots(req, 10) is not None
    req.num_computed_tokens = 10
    req.append_output_token_ids([np.uint32(11), np.int32(12)])
    assert mgr.allocate_slots(req, 2) is not None
    events = mgr.take_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    tokens = [t for e in stored for t in e.token_ids]
    assert tokens == list(range(1, 13))
    assert {type(t) for t in tokens} == {int}
    assert decode_event_batch(encode_event_batch(events)).events == tuple(events)


def test_events_count_blocks_so_a_counting_mirror_matches_the_pool() -> None:
    """Two requests compute the same prefix in one step: each block raises
    its own BlockStored, and evicting one raises one BlockRemoved while the
    other block still holds the hash; a router counting per hash still
    finds it cached, as the pool does."""
    from collections import Counter

    import coordinator_setup as setup

    mgr = setup.small_manager([setup.fa(4)], 10, enable_kv_cache_events=True)
    a = setup.small_request("a", range(1, 10))
    b = setup.small_request("b", range(1, 10))
    assert mgr.get_computed_blocks(b)[1] == 0  # looked up before a is keyed
    assert mgr.allocate_slots(a, 9) is not None
    assert mgr.allocate_slots(b, 9) is not None
    mirror: Counter[bytes] = Counter()

    def replay() -> None:
        for event in mgr.take_events():
            for h in event.block_hashes:
                mirror[h] += 1 if isinstance(event, BlockStored) else -1

    replay()
    assert len(mirror) == 2
    assert set(mirror.values()) == {2}
    mgr.free(a)
    mgr.free(b)
    assert mgr.evict_blocks([1]) == 1
    replay()
    held = Counter(
        {
            h: len(entry) if isinstance(entry, dict) else 1
            for h, entry in mgr.block_pool.cached_blocks_of(0).items()
        }
    )
    assert +mirror == held
    assert sorted(held.values()) == [1, 2]
    assert mgr.get_computed_blocks(setup.small_request("c", range(1, 10)))[1] == 8
