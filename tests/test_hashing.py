"""Chained block hashing: encoding, digests, extra keys, coarse views."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

from kvcore.coordinator.hashing import (
    NONE_HASH,
    BlockHasher,
    BlockHashView,
    ExtraKey,
    block_extra_keys,
    encode_block,
    encode_extra_keys,
    get_hash_function,
    hash_block_tokens,
    hash_function_names,
    hashes_at_block_size,
    normalize_mm_features,
)
from kvcore.errors import (
    BlockSizeError,
    KvcoreKeyError,
    KvcoreTypeError,
    KvcoreValueError,
)

REPO = Path(__file__).resolve().parents[1]

# The documented encoding, rebuilt by hand: u32 len(parent) | parent |
# u32 n | n x u32 token | extra.  Tokens 1..16 under the 32-zero-byte root.
FIRST_BLOCK = list(range(1, 17))
FIRST_ENCODING = (
    struct.pack("<I", 32)
    + bytes(32)
    + struct.pack("<I", 16)
    + struct.pack("<16I", *FIRST_BLOCK)
)
# Pinned digests of FIRST_ENCODING; a change here breaks every stored cache key.
SHA256_FIRST = "51dbadc3b479a75a45bd5f4967f82a728255c751c6565b0b0b8fd5ca69ecb967"
XXH3_FIRST = "f478e53efa0adbb616c8c3f5d6c4210d"


def sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def encoding(parent: bytes, tokens: list[int], extra: bytes = b"") -> bytes:
    return (
        struct.pack("<I", len(parent))
        + parent
        + struct.pack("<I", len(tokens))
        + struct.pack(f"<{len(tokens)}I", *tokens)
        + extra
    )


def enc_str(s: str) -> bytes:
    raw = s.encode()
    return b"S" + struct.pack("<I", len(raw)) + raw


def enc_tuple(*items: bytes) -> bytes:
    return b"(" + struct.pack("<I", len(items)) + b"".join(items)


# -- encoding and digests ------------------------------------------------------


def test_none_hash_is_32_zero_bytes() -> None:
    assert NONE_HASH == b"\x00" * 32


def test_encode_block_matches_documented_layout() -> None:
    assert encode_block(None, FIRST_BLOCK) == FIRST_ENCODING
    assert len(FIRST_ENCODING) == 4 + 32 + 4 + 64


def test_sha256_digest_is_pinned_and_independently_computed() -> None:
    digest = hash_block_tokens("sha256", None, FIRST_BLOCK)
    assert digest == hashlib.sha256(FIRST_ENCODING).digest()
    assert digest.hex() == SHA256_FIRST


def test_xxh3_128_digest_is_pinned_and_independently_computed() -> None:
    digest = hash_block_tokens("xxh3_128", None, FIRST_BLOCK)
    assert digest == xxhash.xxh3_128_digest(FIRST_ENCODING)
    assert digest.hex() == XXH3_FIRST
    assert len(digest) == 16


def test_explicit_none_parent_equals_none_hash_parent() -> None:
    assert hash_block_tokens("sha256", None, [5]) == hash_block_tokens(
        "sha256", NONE_HASH, [5]
    )


def test_extra_keys_encoding_by_hand() -> None:
    got = encode_extra_keys((("lora", "ab"), -1, 255, b"x", True, None))
    want = enc_tuple(
        enc_tuple(enc_str("lora"), enc_str("ab")),
        b"I" + struct.pack("<I", 1) + b"\xff",  # -1: one byte, two's complement
        b"I" + struct.pack("<I", 2) + b"\xff\x00",  # 255 needs a sign byte
        b"B" + struct.pack("<I", 1) + b"x",
        b"T",
        b"N",
    )
    assert got == want


def test_chained_digest_with_extra_keys_by_hand() -> None:
    parent = sha(FIRST_ENCODING)
    extra = (("lora", "a"),)
    want = sha(
        encoding(parent, [7, 8, 9], enc_tuple(enc_tuple(enc_str("lora"), enc_str("a"))))
    )
    assert hash_block_tokens("sha256", parent, [7, 8, 9], extra) == want


def test_no_extra_keys_and_empty_tuple_hash_the_same() -> None:
    assert encode_extra_keys(None) == encode_extra_keys(()) == b""
    assert hash_block_tokens("sha256", None, [1], ()) == hash_block_tokens(
        "sha256", None, [1], None
    )


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (("ab",), ("a", "b")),
        ((1,), (True,)),
        ((1,), ("1",)),
        (("a",), (b"a",)),
        (((1, 2),), (1, 2)),
        ((None,), ((),)),
        ((0,), (False,)),
        ((("lora", "x"),), (("salt", "x"),)),
        ((-1,), (255,)),
        (("",), (b"",)),
    ],
    ids=[
        "split-str",
        "int-vs-bool",
        "int-vs-str",
        "str-vs-bytes",
        "nested-vs-flat",
        "none-vs-empty",
        "zero-vs-false",
        "lora-vs-salt",
        "negative-vs-positive",
        "empty-str-vs-bytes",
    ],
)
def test_different_extra_keys_never_encode_the_same(
    a: tuple[ExtraKey, ...], b: tuple[ExtraKey, ...]
) -> None:
    assert encode_extra_keys(a) != encode_extra_keys(b)
    assert hash_block_tokens("sha256", None, [1], a) != hash_block_tokens(
        "sha256", None, [1], b
    )


def test_extra_keys_of_unsupported_type_are_rejected() -> None:
    with pytest.raises(KvcoreTypeError, match="float"):
        encode_extra_keys((1.5,))  # type: ignore[arg-type]
    with pytest.raises(KvcoreTypeError, match="tuple"):
        encode_extra_keys(["a"])  # type: ignore[arg-type]


def test_token_ids_outside_u32_are_rejected() -> None:
    with pytest.raises(KvcoreValueError, match=r"position 1 is -1"):
        hash_block_tokens("sha256", None, [0, -1])
    with pytest.raises(KvcoreValueError, match="position 0"):
        hash_block_tokens("sha256", None, [2**32])
    with pytest.raises(KvcoreTypeError, match="position 2 is 'x'"):
        hash_block_tokens("sha256", None, [1, 2, "x"])  # type: ignore[list-item]
    # The largest u32 is fine.
    hash_block_tokens("sha256", None, [2**32 - 1])


# -- hash function registry ----------------------------------------------------


def test_hash_function_names() -> None:
    assert hash_function_names() == ("sha256", "xxh3_128")
    assert get_hash_function("sha256")(b"abc") == hashlib.sha256(b"abc").digest()
    assert get_hash_function("xxh3_128")(b"abc") == xxhash.xxh3_128_digest(b"abc")


def test_unknown_hash_function_lists_valid_names() -> None:
    with pytest.raises(KvcoreKeyError, match=r"'md5'.*'sha256', 'xxh3_128'"):
        get_hash_function("md5")


def test_hash_function_of_wrong_type() -> None:
    with pytest.raises(KvcoreTypeError, match="int"):
        get_hash_function(3)  # type: ignore[arg-type]


def test_callable_hash_function_is_used_as_is() -> None:
    def short(data: bytes) -> bytes:
        return hashlib.md5(data).digest()

    assert get_hash_function(short) is short
    assert (
        hash_block_tokens(short, None, FIRST_BLOCK)
        == hashlib.md5(FIRST_ENCODING).digest()
    )


# -- incremental hasher and chaining -------------------------------------------


def manual_chain(
    tokens: list[int], bs: int, extras: list[tuple[ExtraKey, ...] | None]
) -> list[bytes]:
    out: list[bytes] = []
    parent = NONE_HASH
    for i in range(len(tokens) // bs):
        parent = sha(
            encoding(
                parent, tokens[i * bs : (i + 1) * bs], encode_extra_keys(extras[i])
            )
        )
        out.append(parent)
    return out


def test_hasher_hashes_only_full_chunks_and_chains() -> None:
    tokens = list(range(100, 140))  # 40 tokens, bs 16: 2 full chunks, 8 left over
    hasher = BlockHasher(16, "sha256")
    hashes: list[bytes] = []
    assert hasher.hash_new_blocks(tokens, hashes) == 2
    assert hashes == manual_chain(tokens, 16, [None, None])
    assert hashes[0] == hash_block_tokens("sha256", None, tokens[:16])
    assert hashes[1] == hash_block_tokens("sha256", hashes[0], tokens[16:32])
    # Nothing new: no work.
    assert hasher.hash_new_blocks(tokens, hashes) == 0
    # Completing the third chunk hashes only it.
    tokens += [1] * 8
    assert hasher.hash_new_blocks(tokens, hashes) == 1
    assert hashes[2] == hash_block_tokens("sha256", hashes[1], tokens[32:48])


def test_incremental_hashing_equals_one_shot() -> None:
    tokens = [(i * 7919) % 50000 for i in range(100)]
    one_shot: list[bytes] = []
    BlockHasher(8, "xxh3_128").hash_new_blocks(tokens, one_shot)
    grown: list[int] = []
    step: list[bytes] = []
    hasher = BlockHasher(8, "xxh3_128")
    for tok in tokens:
        grown.append(tok)
        hasher.hash_new_blocks(grown, step)
    assert step == one_shot
    assert len(step) == 12  # 100 // 8


def test_equal_hash_means_equal_prefix() -> None:
    a = list(range(48))
    b = list(range(48))
    b[3] = 999  # first chunk differs
    c = list(range(48))
    c[40] = 999  # only the third chunk differs
    ha: list[bytes] = []
    hb: list[bytes] = []
    hc: list[bytes] = []
    for toks, out in ((a, ha), (b, hb), (c, hc)):
        BlockHasher(16).hash_new_blocks(toks, out)
    # A change in chunk 0 changes every later hash, even over equal tokens.
    assert all(x != y for x, y in zip(ha, hb, strict=True))
    assert ha[:2] == hc[:2]
    assert ha[2] != hc[2]


def test_hasher_rejects_bad_block_size() -> None:
    for bad in (0, -16, True, 16.0):
        with pytest.raises(BlockSizeError, match="hash_block_size"):
            BlockHasher(bad)  # type: ignore[arg-type]


# -- extra keys: salt, LoRA, multimodal ----------------------------------------


def test_salt_only_on_first_block() -> None:
    tokens = list(range(48))
    hasher = BlockHasher(16, cache_salt="tenant-a")
    assert hasher.extra_keys(0) == (("salt", "tenant-a"),)
    assert hasher.extra_keys(1) is None
    hashes: list[bytes] = []
    hasher.hash_new_blocks(tokens, hashes)
    assert hashes == manual_chain(tokens, 16, [(("salt", "tenant-a"),), None, None])
    plain: list[bytes] = []
    BlockHasher(16).hash_new_blocks(tokens, plain)
    other: list[bytes] = []
    BlockHasher(16, cache_salt="tenant-b").hash_new_blocks(tokens, other)
    # Through chaining, the salt separates every block.
    assert len({*hashes, *plain, *other}) == 9


def test_lora_on_every_block_and_before_salt() -> None:
    tokens = list(range(32))
    hasher = BlockHasher(16, lora_name="ad", cache_salt="s")
    assert hasher.extra_keys(0) == (("lora", "ad"), ("salt", "s"))
    assert hasher.extra_keys(1) == (("lora", "ad"),)
    hashes: list[bytes] = []
    hasher.hash_new_blocks(tokens, hashes)
    assert hashes == manual_chain(
        tokens, 16, [(("lora", "ad"), ("salt", "s")), (("lora", "ad"),)]
    )
    # Without the salt, block 1 is hashed with the LoRA key alone.
    lora_only: list[bytes] = []
    BlockHasher(16, lora_name="ad").hash_new_blocks(tokens, lora_only)
    assert lora_only == manual_chain(tokens, 16, [(("lora", "ad"),)] * 2)


def test_mm_feature_offsets_relative_to_each_block() -> None:
    # Image at tokens [10, 30), audio at [40, 44); blocks of 16: [0,16) [16,32) [32,48)
    feats = [("aud", 40, 4), ("img", 10, 20)]
    hasher = BlockHasher(16, mm_features=feats)
    assert hasher.mm_features == (("img", 10, 20), ("aud", 40, 4))  # sorted
    assert hasher.extra_keys(0) == (("mm", "img", 10),)
    assert hasher.extra_keys(1) == (("mm", "img", -6),)
    assert hasher.extra_keys(2) == (("mm", "aud", 8),)
    assert hasher.extra_keys(3) is None
    for i in range(4):
        assert hasher.extra_keys(i) == block_extra_keys(
            16 * i, 16 * i + 16, mm_features=hasher.mm_features
        )
    tokens = [0] * 64
    hashes: list[bytes] = []
    hasher.hash_new_blocks(tokens, hashes)
    assert hashes == manual_chain(
        tokens,
        16,
        [(("mm", "img", 10),), (("mm", "img", -6),), (("mm", "aud", 8),), None],
    )


def test_mm_feature_touching_a_block_boundary() -> None:
    # [16, 32) lies exactly in block 1.
    hasher = BlockHasher(16, mm_features=[("x", 16, 16)])
    assert hasher.extra_keys(0) is None
    assert hasher.extra_keys(1) == (("mm", "x", 0),)
    assert hasher.extra_keys(2) is None


def test_mm_identifier_and_position_change_the_hash() -> None:
    tokens = [0] * 32

    def run(feats: list[tuple[str, int, int]]) -> list[bytes]:
        out: list[bytes] = []
        BlockHasher(16, mm_features=feats).hash_new_blocks(tokens, out)
        return out

    base = run([("img-a", 4, 8)])
    assert run([("img-b", 4, 8)])[0] != base[0]
    assert run([("img-a", 5, 8)])[0] != base[0]
    assert run([])[0] != base[0]


def test_mm_feature_validation() -> None:
    with pytest.raises(KvcoreValueError, match="overlap"):
        normalize_mm_features([("a", 0, 10), ("b", 9, 2)])
    with pytest.raises(KvcoreTypeError, match="triple"):
        normalize_mm_features([("a", 0)])  # type: ignore[list-item]
    with pytest.raises(KvcoreTypeError, match="identifier"):
        normalize_mm_features([(1, 0, 2)])  # type: ignore[list-item]
    with pytest.raises(KvcoreValueError, match="length 0"):
        normalize_mm_features([("a", 0, 0)])
    # Adjacent placeholders do not overlap.
    assert normalize_mm_features([("b", 10, 2), ("a", 0, 10)]) == (
        ("a", 0, 10),
        ("b", 10, 2),
    )


# -- hashes at a coarser block size ---------------------------------------------


def test_coarse_view_same_size_is_the_list_itself() -> None:
    hashes = [b"a", b"b"]
    assert hashes_at_block_size(hashes, 16, 16) is hashes


def test_coarse_view_picks_last_chunk_of_each_block() -> None:
    hashes = [bytes([i]) for i in range(10)]
    view = hashes_at_block_size(hashes, 16, 64)  # k = 4
    assert isinstance(view, BlockHashView)
    assert len(view) == 2  # 10 // 4
    assert view[0] == bytes([3])
    assert view[1] == bytes([7])
    assert view[-1] == bytes([7])
    assert view[0:2] == [bytes([3]), bytes([7])]
    assert list(view) == [bytes([3]), bytes([7])]
    assert bytes([7]) in view
    with pytest.raises(IndexError):
        view[2]
    # The view is live: it follows the list as it grows.
    hashes += [bytes([10]), bytes([11])]
    assert len(view) == 3
    assert view[2] == bytes([11])


def test_coarse_view_matches_real_prefixes() -> None:
    # Block i of a 32-token group is named by chunk 2i+1's chained hash, which is
    # the same for two requests exactly when their first 32(i+1) tokens agree.
    a = list(range(64))
    b = list(range(64))
    b[40] = 7
    ha: list[bytes] = []
    hb: list[bytes] = []
    BlockHasher(16).hash_new_blocks(a, ha)
    BlockHasher(16).hash_new_blocks(b, hb)
    va = hashes_at_block_size(ha, 16, 32)
    vb = hashes_at_block_size(hb, 16, 32)
    assert va[0] == vb[0] == ha[1]
    assert va[1] != vb[1]


@pytest.mark.parametrize(
    ("hash_bs", "bs"),
    [(16, 24), (16, 8), (0, 16), (16, 0), (-4, 16)],
    ids=["not-multiple", "smaller", "zero-hash", "zero-block", "negative-hash"],
)
def test_coarse_view_rejects_non_multiples(hash_bs: int, bs: int) -> None:
    with pytest.raises(BlockSizeError, match="multiple of"):
        hashes_at_block_size([], hash_bs, bs)


# -- stability across processes ------------------------------------------------

_CHILD = """
import json
from kvcore.coordinator.hashing import BlockHasher
out = {}
for fn in ("sha256", "xxh3_128"):
    hashes = []
    BlockHasher(16, fn, cache_salt="s", lora_name="l",
                mm_features=[("img", 3, 20)]).hash_new_blocks(list(range(64)), hashes)
    out[fn] = [h.hex() for h in hashes]
print(json.dumps(out))
"""


@pytest.mark.parametrize("seed", ["0", "12345"])
def test_digests_are_identical_in_another_process(seed: str) -> None:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), env.get("PYTHONPATH", "")) if p
    )
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=60,
    )
    child = json.loads(proc.stdout)
    for fn in ("sha256", "xxh3_128"):
        hashes: list[bytes] = []
        BlockHasher(
            16, fn, cache_salt="s", lora_name="l", mm_features=[("img", 3, 20)]
        ).hash_new_blocks(list(range(64)), hashes)
        assert child[fn] == [h.hex() for h in hashes]
        assert len(hashes) == 4


@pytest.mark.parametrize(
    "tokens",
    [
        b"abcdefgh",
        bytearray(b"abcd"),
        {1, 2, 3, 4},
        {1: 0, 2: 0, 3: 0, 4: 0},
        "abcd",
        5,
    ],
    ids=["bytes", "bytearray", "set", "dict", "str", "int"],
)
def test_hash_prompt_refuses_what_is_no_token_sequence(tokens: object) -> None:
    """Bytes, sets and a dict's keys pack as ints but are no token
    sequence: the public hasher refuses them by type, as a request does."""
    from kvcore.coordinator.hashing import BlockHasher
    from kvcore.errors import KvcoreTypeError

    with pytest.raises(KvcoreTypeError, match="must be a list or tuple of token ids"):
        BlockHasher(4, "sha256").hash_prompt(tokens)  # type: ignore[arg-type]
