"""Requests: token bookkeeping, incremental block hashes, validation."""

from __future__ import annotations

import random
import struct
from typing import Any

import pytest
import torch

from kvcore import KVCacheConfig, KVCacheGroupSpec
from kvcore.coordinator import KVCacheManager, create_requests
from kvcore.coordinator.hashing import NONE_HASH, hash_block_tokens
from kvcore.coordinator.request import Request, RequestStatus, make_requests
from kvcore.errors import (
    BlockSizeError,
    InvalidRequestError,
    KvcoreKeyError,
    KvcoreTypeError,
    KvcoreValueError,
    UnknownRequestError,
)
from kvcore.tokens import _holds_bool
from kvcore_full_attention import FullAttentionSpec


def test_new_request_counts_and_hashes_full_chunks() -> None:
    req = Request("r1", list(range(40)), hash_block_size=16)
    assert req.request_id == "r1"
    assert req.num_tokens == 40
    assert req.num_prompt_tokens == 40
    assert req.num_output_tokens == 0
    assert req.num_computed_tokens == 0
    assert req.prompt_token_ids == tuple(range(40))
    assert req.all_token_ids == list(range(40))
    assert req.status is RequestStatus.WAITING
    assert req.skip_reading_prefix_cache is False
    assert req.hash_block_size == 16
    # 40 tokens, chunks of 16: two full chunks; the last 8 tokens wait.
    assert len(req.block_hashes) == 2
    h0 = hash_block_tokens("sha256", NONE_HASH, list(range(16)))
    assert req.block_hashes == [
        h0,
        hash_block_tokens("sha256", h0, list(range(16, 32))),
    ]


def test_512_token_prompt_has_32_hashes() -> None:
    req = Request("r", [7] * 512, hash_block_size=16)
    assert len(req.block_hashes) == 32
    assert len(set(req.block_hashes)) == 32  # chained: equal chunks, new hashes


def test_appending_tokens_hashes_each_completed_chunk() -> None:
    req = Request("r", list(range(40)), hash_block_size=16)
    for tok in range(40, 47):
        req.append_output_token_ids(tok)
        assert len(req.block_hashes) == 2
    req.append_output_token_ids(47)  # token 48 completes chunk 2
    assert len(req.block_hashes) == 3
    assert req.num_tokens == 48
    assert req.num_output_tokens == 8
    assert req.num_prompt_tokens == 40
    assert (
        req.block_hashes
        == Request("s", list(range(48)), hash_block_size=16).block_hashes
    )
    # A list may complete several chunks at once.
    req.append_output_token_ids(list(range(48, 84)))
    assert len(req.block_hashes) == 5  # 84 // 16
    assert (
        req.block_hashes
        == Request("t", list(range(84)), hash_block_size=16).block_hashes
    )


def test_prompt_is_copied() -> None:
    prompt = [1, 2, 3]
    req = Request("r", prompt, hash_block_size=None)
    prompt.append(4)
    req.append_output_token_ids(9)
    assert req.prompt_token_ids == (1, 2, 3)
    assert req.all_token_ids == [1, 2, 3, 9]


def test_no_hashing_without_hash_block_size() -> None:
    req = Request("r", list(range(64)), hash_block_size=None)
    assert req.block_hashes == []
    assert req.hash_block_size is None
    req.append_output_token_ids(list(range(64)))
    assert req.block_hashes == []


def test_xxh3_and_callable_hash_functions() -> None:
    sha = Request("a", list(range(32)), hash_block_size=16)
    xxh = Request("a", list(range(32)), hash_block_size=16, hash_function="xxh3_128")
    assert len(xxh.block_hashes[0]) == 16
    assert xxh.block_hashes[0] != sha.block_hashes[0]
    calls: list[int] = []

    def counting(data: bytes) -> bytes:
        calls.append(len(data))
        return data[:8]

    Request("c", list(range(32)), hash_block_size=16, hash_function=counting)
    # First chunk: 4 + 32 (root) + 4 + 64; second: 4 + 8 (parent) + 4 + 64.
    assert calls == [104, 80]


def test_salt_lora_and_mm_features_reach_the_hashes() -> None:
    tokens = list(range(32))
    plain = Request("p", tokens, hash_block_size=16).block_hashes
    salted = Request("s", tokens, hash_block_size=16, cache_salt="t1")
    lora = Request("l", tokens, hash_block_size=16, lora_name="ad")
    mm = Request("m", tokens, hash_block_size=16, mm_features=[("img", 20, 4)])
    assert salted.cache_salt == "t1"
    assert lora.lora_name == "ad"
    assert mm.mm_features == (("img", 20, 4),)
    assert salted.block_hashes[0] != plain[0]
    assert lora.block_hashes[0] != plain[0]
    # The image sits in chunk 1 only, so chunk 0 is unchanged.
    assert mm.block_hashes[0] == plain[0]
    assert mm.block_hashes[1] != plain[1]
    assert mm.block_hashes[1] == hash_block_tokens(
        "sha256", plain[0], tokens[16:], (("mm", "img", 4),)
    )


def test_status_and_computed_tokens_are_writable() -> None:
    req = Request("r", [1, 2, 3], hash_block_size=2)
    req.num_computed_tokens = 2
    req.status = RequestStatus.RUNNING
    assert req.num_computed_tokens == 2
    assert not req.is_finished
    done = Request("d", [1], hash_block_size=None)
    done.status = RequestStatus.FINISHED
    assert done.is_finished
    assert {s.name for s in RequestStatus} == {"WAITING", "RUNNING", "FINISHED"}
    with pytest.raises(AttributeError):
        req.extra = 1  # type: ignore[attr-defined]


# -- status, as a real KVCacheManager sets it -------------------------------------


def _manager(num_blocks: int) -> KVCacheManager:
    """One full-attention group of 4-token blocks (block 0 is the null block)."""
    spec = FullAttentionSpec(
        block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
    )
    return KVCacheManager(
        config,
        max_model_len=1024,
        scheduler_block_size=4,
        hash_block_size=4,
        enable_caching=True,
    )


def test_manager_runs_then_finishes_a_request() -> None:
    mgr = _manager(num_blocks=8)
    r = Request("r", list(range(10)), hash_block_size=4)
    assert r.status is RequestStatus.WAITING
    blocks, hit = mgr.get_computed_blocks(r)
    assert r.status is RequestStatus.WAITING  # a lookup changes nothing
    assert mgr.allocate_slots(r, 10, hit, blocks) is not None
    assert r.status is RequestStatus.RUNNING
    assert not r.is_finished
    r.num_computed_tokens = 10
    r.append_output_token_ids(7)
    assert mgr.allocate_slots(r, 1) is not None  # a decode step keeps it running
    assert r.status is RequestStatus.RUNNING
    mgr.free(r)
    assert r.status is RequestStatus.FINISHED
    assert r.is_finished


def test_free_by_id_finishes_the_request() -> None:
    mgr = _manager(num_blocks=8)
    r = Request("r", list(range(6)), hash_block_size=4)
    assert mgr.allocate_slots(r, 6) is not None
    mgr.free("r")
    assert r.is_finished


def test_refused_allocation_leaves_the_request_waiting() -> None:
    # 3 blocks: the null block and 2 usable ones, 8 tokens in all
    mgr = _manager(num_blocks=3)
    r = Request("big", list(range(12)), hash_block_size=4)
    assert mgr.allocate_slots(r, 12) is None
    assert r.status is RequestStatus.WAITING
    assert not r.is_finished
    # a running request refused a step stays running
    small = Request("small", list(range(8)), hash_block_size=4)
    assert mgr.allocate_slots(small, 8) is not None
    small.num_computed_tokens = 8
    small.append_output_token_ids(1)
    assert mgr.allocate_slots(small, 1) is None
    assert small.status is RequestStatus.RUNNING


def test_a_rejected_call_does_not_change_the_status() -> None:
    mgr = _manager(num_blocks=8)
    r = Request("r", list(range(6)), hash_block_size=4)
    with pytest.raises(InvalidRequestError):
        mgr.allocate_slots(r, 0)
    assert r.status is RequestStatus.WAITING
    with pytest.raises(UnknownRequestError):
        mgr.free(r)
    assert r.status is RequestStatus.WAITING


def test_a_freed_request_runs_again_when_re_admitted() -> None:
    """Preemption is a free and a later re-admission: FINISHED, then RUNNING."""
    mgr = _manager(num_blocks=8)
    r = Request("r", list(range(6)), hash_block_size=4)
    assert mgr.allocate_slots(r, 6) is not None
    mgr.free(r)
    assert r.is_finished
    blocks, hit = mgr.get_computed_blocks(r)
    assert mgr.allocate_slots(r, 6 - hit, hit, blocks) is not None
    assert r.status is RequestStatus.RUNNING


# -- validation -----------------------------------------------------------------


def test_empty_prompt_is_rejected() -> None:
    with pytest.raises(InvalidRequestError, match="'r9' has an empty prompt"):
        Request("r9", [], hash_block_size=16)


def test_request_id_must_be_str() -> None:
    with pytest.raises(KvcoreTypeError, match="request_id must be a str"):
        Request(7, [1], hash_block_size=16)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -16, 2.0], ids=["zero", "negative", "float"])
def test_bad_hash_block_size(bad: int) -> None:
    with pytest.raises(BlockSizeError, match="hash_block_size") as info:
        Request("r", [1], hash_block_size=bad)
    assert "while creating request 'r'" in info.value.__notes__


def test_unknown_hash_function_name() -> None:
    with pytest.raises(KvcoreKeyError, match="'sha1'"):
        Request("r", [1], hash_block_size=16, hash_function="sha1")


def test_bad_tokens_name_the_request() -> None:
    with pytest.raises(
        KvcoreValueError, match=r"^request 'neg': prompt: token id at position 3 is -5"
    ):
        Request("neg", [1, 2, 3, -5], hash_block_size=4)
    with pytest.raises(KvcoreTypeError, match="ints"):
        Request("f", [1.0, 2, 3, 4], hash_block_size=4)  # type: ignore[list-item]


def test_bad_output_token_is_refused_before_it_is_appended() -> None:
    req = Request("r", [1, 2, 3], hash_block_size=4)
    with pytest.raises(KvcoreValueError, match="position 3"):
        req.append_output_token_ids(2**32)
    with pytest.raises(KvcoreTypeError, match=r"position 3 is 7\.0"):
        req.append_output_token_ids([7.0])  # type: ignore[list-item]
    assert req.all_token_ids == [1, 2, 3]
    req.append_output_token_ids(4)
    assert len(req.block_hashes) == 1


def test_bad_token_in_the_unhashed_prompt_tail_is_refused_at_once() -> None:
    # 6 tokens at 4 per chunk: tokens 4 and 5 are not hashed yet.
    with pytest.raises(KvcoreTypeError, match="position 5 is 'x'"):
        Request("r", [1, 2, 3, 4, 5, "x"], hash_block_size=4)  # type: ignore[list-item]


def test_salt_and_lora_types() -> None:
    with pytest.raises(KvcoreTypeError, match="cache_salt"):
        Request("r", [1], hash_block_size=None, cache_salt=b"x")  # type: ignore[arg-type]
    with pytest.raises(KvcoreTypeError, match="lora_name"):
        Request("r", [1], hash_block_size=16, lora_name=3)  # type: ignore[arg-type]


def test_mm_feature_must_lie_inside_the_prompt() -> None:
    with pytest.raises(InvalidRequestError, match=r"\[8, 12\).*10 tokens"):
        Request("r", [0] * 10, hash_block_size=4, mm_features=[("img", 8, 4)])
    with pytest.raises(KvcoreValueError, match="overlap"):
        Request(
            "r", [0] * 10, hash_block_size=None, mm_features=[("a", 0, 4), ("b", 3, 2)]
        )


# -- make_requests --------------------------------------------------------------


def test_make_requests_is_deterministic_and_pinned() -> None:
    a = make_requests(2, 20, 16, seed=0, common_prefix_len=4)
    b = make_requests(2, 20, 16, seed=0, common_prefix_len=4)
    assert [r.all_token_ids for r in a] == [r.all_token_ids for r in b]
    assert [r.request_id for r in a] == ["req-0", "req-1"]
    # splitmix64 from seed 0, modulo 32000: fixed on every platform.
    assert a[0].all_token_ids[:4] == [15535, 19700, 25679, 30444]
    assert a[1].all_token_ids[:4] == [15535, 19700, 25679, 30444]
    assert a[0].all_token_ids[4:6] == [22465, 28519]
    assert a[1].all_token_ids[4:6] == [28110, 28226]
    assert make_requests(1, 20, 16, seed=1)[0].all_token_ids != a[0].all_token_ids


def test_make_requests_common_prefix_shares_block_hashes() -> None:
    reqs = make_requests(3, 64, 16, common_prefix_len=40)
    first = reqs[0].block_hashes
    assert all(len(r.block_hashes) == 4 for r in reqs)
    for r in reqs[1:]:
        # 40 shared tokens: chunks 0 and 1 are shared, chunk 2 is not.
        assert r.block_hashes[:2] == first[:2]
        assert r.block_hashes[2] != first[2]
        assert r.all_token_ids[:40] == reqs[0].all_token_ids[:40]


def test_make_requests_options_and_alias() -> None:
    reqs = create_requests(num_requests=1, num_tokens=256, block_size=128)
    assert len(reqs[0].block_hashes) == 2
    none = make_requests(1, 10, None, vocab_size=5, id_prefix="x")
    assert none[0].block_hashes == []
    assert none[0].request_id == "x0"
    assert all(0 <= t < 5 for t in none[0].all_token_ids)
    assert make_requests(0, 10, 16) == []
    with pytest.raises(KvcoreValueError, match="common_prefix_len"):
        make_requests(1, 10, 16, common_prefix_len=11)
    with pytest.raises(KvcoreValueError, match="num_tokens"):
        make_requests(1, 0, 16)


def test_integer_objects_are_taken_by_value() -> None:
    """A numpy integer or a 0-d integer tensor is hashed by its value."""
    import numpy as np
    import torch

    from kvcore.coordinator import Request

    r = Request("r", [np.int64(7), torch.tensor(9), 11, 13], hash_block_size=2)
    plain = Request("p", [7, 9, 11, 13], hash_block_size=2)
    assert r.all_token_ids == [7, 9, 11, 13]
    assert r.block_hashes == plain.block_hashes


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"cache_salt": "tenant"},
        {"lora_name": "ad"},
        {"mm_features": [("img", 1, 2)]},
        {"hash_function": "xxh3_128"},
    ],
    ids=["plain", "salted", "lora", "mm", "xxh3"],
)
@pytest.mark.parametrize("prompt_len", [3, 16, 40])
def test_tokens_appended_one_by_one_hash_as_one_prompt(
    options: dict[str, object], prompt_len: int
) -> None:
    """Decode appends hash each chunk they complete from its parent (the
    plain sha256 case packs the chunk directly); every option gives the
    hashes of the same tokens given at once."""
    tokens = [(7919 * i + 13) % 50021 for i in range(prompt_len + 70)]
    req = Request("r", tokens[:prompt_len], hash_block_size=16, **options)  # type: ignore[arg-type]
    for tok in tokens[prompt_len:]:
        req.append_output_token_ids(tok)
    whole = Request("w", tokens, hash_block_size=16, **options)  # type: ignore[arg-type]
    assert len(req.block_hashes) == len(tokens) // 16
    assert req.block_hashes == whole.block_hashes
    parent = whole.block_hashes[-2]
    last = tokens[(len(tokens) // 16 - 1) * 16 : len(tokens) // 16 * 16]
    if not options:
        assert whole.block_hashes[-1] == hash_block_tokens("sha256", parent, last)


def test_a_token_changed_behind_the_request_is_named_when_hashed() -> None:
    """The appended-chunk path packs without per-token checks; a token put
    into ``all_token_ids`` directly is still refused by name."""
    req = Request("r", list(range(20)), hash_block_size=16)
    for tok in range(20, 31):
        req.append_output_token_ids(tok)
    req.all_token_ids[25] = -4
    with pytest.raises(KvcoreValueError, match="-4") as info:
        req.append_output_token_ids(31)
    assert "'r'" in " ".join(getattr(info.value, "__notes__", [])) + str(info.value)
    assert len(req.block_hashes) == 1


@pytest.mark.parametrize("length", [20, 64, 100, 300, 3000])
@pytest.mark.parametrize("flag", [True, False])
def test_a_bool_token_in_a_prompt_of_any_length_is_refused(
    length: int, flag: bool
) -> None:
    """A bool packs as 1 or 0, so packing alone would take it: short
    prompts are searched for a packed 0 or 1, long ones reduced with numpy,
    and either way the bool is named by position."""
    tokens: list[object] = [1000 + i for i in range(length)]
    at = length // 2 if length > 20 else length - 3  # a hashed chunk, or the tail
    tokens[at] = flag
    with pytest.raises(KvcoreTypeError, match=f"position {at} is {flag}"):
        Request("r", tokens, hash_block_size=16)  # type: ignore[arg-type]
    # Genuine 0 and 1 tokens are taken.
    tokens[at] = int(flag)
    tokens[0] = 1 - int(flag)
    assert len(Request("r", tokens, hash_block_size=16).block_hashes) == length // 16  # type: ignore[arg-type]


@pytest.mark.parametrize("length", [1, 16, 64, 65, 96, 97, 200, 256, 257, 512, 2048])
def test_the_bool_search_agrees_with_reading_every_type(length: int) -> None:
    """Only tokens packed as 0 or 1 have their types read; on random
    prompts full of 0s and 1s (a BOS token, padding, a straddling match)
    the answer is the one reading every token's type gives."""
    rng = random.Random(length)
    for case in range(90):
        tokens: list[int] = [rng.randrange(2, 70_000) for _ in range(length)]
        for _ in range(rng.choice([0, 1, 2, 5, 80])):
            tokens[rng.randrange(length)] = rng.choice([0, 1, False, True])
        if case % 3 == 0:
            # A BOS of 0 or 1 (or a bool there), then maybe one more 0 or 1.
            tokens[0] = rng.choice([0, 1, False, True])
            if case % 2 and length > 1:
                tokens[rng.randrange(1, length)] = rng.choice([0, 1, False, True])
        if case % 7 == 0 and length > 1:
            # Bytes 01 00 | 00 00 across two tokens, neither 0 nor 1.
            at = rng.randrange(length - 1)
            tokens[at : at + 2] = [0x0001_0005, 0x0001_0000]
        data = struct.pack(f"<{length}I", *tokens)
        expected = any(type(t) is bool for t in tokens)
        assert _holds_bool(tokens, data) is expected, (case, tokens)


def test_a_prompt_starting_with_a_bos_of_0_or_1_hashes_as_usual() -> None:
    """A BOS id of 0 or 1 (most vocabularies) is a token like any other."""
    tail = [1000 + i for i in range(511)]
    for bos in (0, 1):
        req = Request("r", [bos, *tail], hash_block_size=128)
        assert req.block_hashes[0] == hash_block_tokens(
            "sha256", NONE_HASH, [bos, *tail[:127]]
        )
        with pytest.raises(KvcoreTypeError, match=f"position 300 is {bool(bos)}"):
            Request(
                "r",
                [bos, *tail[:299], bool(bos), *tail[300:]],  # type: ignore[list-item]
                hash_block_size=128,
            )


def test_requests_without_extra_keys_share_one_hasher() -> None:
    """A hasher holds no per-request state: requests with no salt, LoRA or
    multimodal key share one per block size and hash name, and a salted
    one gets its own."""
    a = Request("a", list(range(40)), hash_block_size=16)
    b = Request("b", list(range(50, 90)), hash_block_size=16)
    salted = Request("s", list(range(40)), hash_block_size=16, cache_salt="t")
    assert a.hasher is not None
    assert a.hasher is b.hasher
    assert salted.hasher is not a.hasher
    assert Request("c", [1], hash_block_size=8).hasher is not a.hasher
    assert Request("d", [1], hash_block_size=None).hasher is None
    # It keys tokens as the request does.
    assert a.hasher.hash_prompt(list(range(40))) == a.block_hashes
    assert salted.hasher.hash_prompt(list(range(40))) is None
    grown: list[bytes] = []
    salted.hasher.hash_new_blocks(list(range(40)), grown)
    assert grown == salted.block_hashes != a.block_hashes
    # Sharing changes no hash.
    assert a.block_hashes == [
        hash_block_tokens("sha256", NONE_HASH, list(range(16))),
        hash_block_tokens(
            "sha256",
            hash_block_tokens("sha256", NONE_HASH, list(range(16))),
            list(range(16, 32)),
        ),
    ]
    # A bad block size is still refused for each request, by name.
    with pytest.raises(BlockSizeError) as info:
        Request("bad", [1, 2], hash_block_size=0)
    assert "'bad'" in " ".join(info.value.__notes__)


@pytest.mark.parametrize(
    "options",
    [{}, {"cache_salt": "s"}, {"lora_name": "L"}, {"hash_function": "xxh3_128"}],
    ids=["plain", "salted", "lora", "xxh3"],
)
def test_a_request_survives_pickling_and_copying(options: dict[str, Any]) -> None:
    """A request (its hasher included) pickles and deep-copies; the copy
    hashes what it is given next exactly as the original does."""
    import copy
    import pickle

    req = Request("r", list(range(40)), hash_block_size=16, **options)
    for other in (pickle.loads(pickle.dumps(req)), copy.deepcopy(req)):
        assert other.block_hashes == req.block_hashes
        assert other.block_hashes is not req.block_hashes
        for tok in range(40, 80):
            other.append_output_token_ids(tok)
        whole = Request("w", list(range(80)), hash_block_size=16, **options)
        assert other.block_hashes == whole.block_hashes
    assert len(req.block_hashes) == 2


def _general_path(request_id: str, tokens: object, **options: Any) -> Request:
    """The request built by the general checks: a hash function passed as a
    callable, not by name, never takes the one-packing path."""
    from kvcore.coordinator.hashing import get_hash_function

    name = options.pop("hash_function", "sha256")
    return Request(
        request_id,
        tokens,  # type: ignore[arg-type]
        hash_function=get_hash_function(name),
        **options,
    )


@pytest.mark.parametrize("compiled", [True, False], ids=["as-built", "python"])
@pytest.mark.parametrize("name", ["sha256", "xxh3_128"])
def test_one_packing_of_a_prompt_hashes_as_the_general_checks(
    name: str, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A list or tuple prompt with a named hash function is checked and
    hashed by one packing of its tokens (``BlockHasher.hash_prompt``: the
    compiled pass where it was built, else Python); on random prompts of
    every length against each block size it gives the general path's
    hashes, tokens and counters, and refuses what that path refuses with
    the same error (the packing defers the refusal: it returns None)."""
    from kvcore.coordinator import hashing
    from kvcore.coordinator.hashing import BlockHasher

    if not compiled:
        monkeypatch.setattr(hashing, "_chain_sha256", None)

    rng = random.Random(7)
    bad_tokens: list[object] = [True, False, -1, 2**32, 1.0, "7", None]
    for case in range(300):
        bs = rng.choice([1, 3, 16, 128])
        # The path reads the hasher an earlier request with these settings
        # left (one is kept for each size and name some request passed).
        Request("warm", [1], hash_block_size=bs, hash_function=name)
        n = rng.randrange(1, 600)
        tokens: list[object] = [
            rng.randrange(2**32 if case % 5 == 0 else 70_000) for _ in range(n)
        ]
        if case % 3 == 0:
            tokens[rng.randrange(n)] = rng.choice(bad_tokens)
        given: object = tuple(tokens) if case % 4 == 0 else tokens
        refused: Exception | None = None
        try:
            want = _general_path("r", given, hash_block_size=bs, hash_function=name)
        except (KvcoreTypeError, KvcoreValueError) as exc:
            refused = exc
        else:
            # The chunk-by-chunk hashing gives the same hashes.
            chunked: list[bytes] = []
            BlockHasher(bs, name).hash_new_blocks(list(tokens), chunked)  # type: ignore[arg-type]
            assert want.block_hashes == chunked, case
        packed = BlockHasher(bs, name).hash_prompt(given)  # type: ignore[arg-type]
        if refused is not None:
            assert packed is None, case
            with pytest.raises(type(refused)) as info:
                Request("r", given, hash_block_size=bs, hash_function=name)  # type: ignore[arg-type]
            assert str(info.value) == str(refused), case
            assert getattr(info.value, "__notes__", None) == getattr(
                refused, "__notes__", None
            ), case
            continue
        got = Request("r", given, hash_block_size=bs, hash_function=name)  # type: ignore[arg-type]
        assert packed is not None, case
        assert got.block_hashes == packed == want.block_hashes, case
        assert len(got.block_hashes) == n // bs
        assert got.all_token_ids == want.all_token_ids == list(tokens)
        assert got.all_token_ids is not given
        assert got.num_prompt_tokens == n
        assert got.hash_block_size == bs
        # Growing it hashes as the general path's request does.
        more = [rng.randrange(70_000) for _ in range(rng.randrange(1, 2 * bs + 2))]
        for req in (got, want):
            for tok in more:
                req.append_output_token_ids(tok)
        assert got.block_hashes == want.block_hashes, case
        assert len(got.block_hashes) == (n + len(more)) // bs


def test_a_prompt_the_one_packing_refuses_is_named_as_before() -> None:
    """The one-packing path defers every refusal to the general checks: an
    empty prompt, a bad id, a bad size or name and a bad token get the
    errors (and notes naming the request) they always did."""
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        Request("r", [], hash_block_size=16)
    with pytest.raises(KvcoreTypeError, match="request_id must be a str"):
        Request(7, [1, 2], hash_block_size=16)  # type: ignore[arg-type]
    with pytest.raises(KvcoreKeyError, match="unknown block hash function") as key:
        Request("named", [1, 2], hash_block_size=16, hash_function="md5")
    assert "'named'" in " ".join(key.value.__notes__)
    with pytest.raises(BlockSizeError) as size:
        Request("sized", [1, 2], hash_block_size=-16)
    assert "'sized'" in " ".join(size.value.__notes__)
    with pytest.raises(
        KvcoreTypeError, match="'r': prompt: token id at position 17 is True"
    ):
        Request("r", [5] * 17 + [True] + [5] * 20, hash_block_size=16)  # type: ignore[list-item]
    with pytest.raises(
        KvcoreTypeError, match="'r': prompt: token id at position 37 is True"
    ):
        Request("r", [5] * 37 + [True], hash_block_size=16)  # type: ignore[list-item]


def test_a_refused_request_leaves_no_hasher_behind() -> None:
    """A request refused for its id, an empty prompt or a bad tail token
    keeps no hasher for its settings (nothing is changed by a refused
    call), so the 64 kept hashers stay for settings requests were built
    with."""
    from kvcore.coordinator.hashing import _PLAIN_HASHERS as kept

    before = dict(kept)
    for bs in range(1_000_001, 1_000_070):
        with pytest.raises(KvcoreTypeError):
            Request(7, [1], hash_block_size=bs)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError):
            Request("r", [], hash_block_size=bs)
        with pytest.raises(KvcoreTypeError, match="position 0 is True"):
            Request("r", [True], hash_block_size=bs)  # type: ignore[list-item]
    assert before == kept


def test_a_hash_block_size_past_a_u32_is_refused_by_name() -> None:
    """A chunk's token count is hashed as a u32, so a size of 2**32 or more
    is refused as a block size, naming the request."""
    with pytest.raises(BlockSizeError, match="below 2\\*\\*32") as info:
        Request("big", [1, 2], hash_block_size=2**32)
    assert "'big'" in " ".join(info.value.__notes__)
    with pytest.raises(KvcoreTypeError, match="request_id must be a str"):
        Request(7, [1], hash_block_size=2**32)  # type: ignore[arg-type]


def test_the_compiled_chain_hashes_as_the_python_path() -> None:
    """The compiled pass (built at install where a C compiler and OpenSSL
    are) gives the Python path's digests for every length and block size,
    the largest token ids included, and answers None for any token but a
    plain int in [0, 2**32), so the Python path decides and names it."""
    chainhash = pytest.importorskip("kvcore.coordinator._chainhash")
    import numpy as np

    from kvcore.coordinator.hashing import BlockHasher

    chain = chainhash.chain_sha256
    rng = random.Random(3)
    for case in range(400):
        bs = rng.choice([1, 2, 7, 16, 128, 1000])
        n = rng.randrange(0, 2100)
        tokens = [rng.choice([0, 1, 2**32 - 1, rng.randrange(2**32)]) for _ in range(n)]
        want: list[bytes] = []
        BlockHasher(bs, "sha256").hash_new_blocks(tokens, want)
        assert chain(tokens, bs) == want, case
        assert chain(tuple(tokens), bs) == want, case

    class Sub(int):
        pass

    for bad in (True, False, -1, 2**32, 2**70, 1.0, "1", None, np.int64(1), Sub(1)):
        for at in (0, 5, 16):  # a hashed chunk, the tail
            tokens2: list[object] = [3] * 17
            tokens2[at] = bad
            assert chain(tokens2, 16) is None, (bad, at)

    class Items(list):  # type: ignore[type-arg]
        pass

    assert chain(Items([1, 2]), 1) is None
    assert chain([], 4) == []
    assert chain([5] * 10, 2**32 - 1) == []  # a chunk longer than the prompt
    for size in (0, -1, 2**32, 2**64):
        with pytest.raises(ValueError, match="block_size"):
            chain([1], size)
    for size in ("4", True, 4.0):
        with pytest.raises(TypeError):
            chain([1], size)
    with pytest.raises(TypeError):
        chain([1])
