"""Chained block hashing for prefix caching.

A request's tokens are cut into chunks of ``hash_block_size`` tokens.  Chunk
``i`` is hashed together with the hash of chunk ``i - 1`` (its *parent*; the
first chunk's parent is :data:`NONE_HASH`) and the chunk's *extra keys*, so two
equal hashes mean two equal prefixes: same tokens, same LoRA, same salt, same
multimodal inputs, all the way from the first token.

The bytes fed to the hash function are fixed by :func:`encode_block` and never
depend on the process, the machine or the Python version (no ``hash()``, no
pickle)::

    u32(len(parent)) || parent || u32(n) || token_0 .. token_{n-1} || extra

where ``u32`` is a 4-byte little-endian unsigned int, every token id is a
4-byte little-endian unsigned int (0 <= id < 2**32), and ``extra`` is empty
when there are no extra keys, else the tagged encoding of the extra-keys tuple
(see :func:`encode_extra_keys`).
"""

from __future__ import annotations

import contextlib
import hashlib
import struct
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator, Sequence
from itertools import pairwise
from typing import Any, TypeAlias, overload

from kvcore.errors import (
    BlockSizeError,
    KvcoreKeyError,
    KvcoreTypeError,
    KvcoreValueError,
)
from kvcore.tokens import (
    check_token_ids,
    check_token_sequence,
    pack_token_ids,
    token_struct,
)

__all__ = [
    "NONE_HASH",
    "TOKEN_ID_LIMIT",
    "BlockHash",
    "BlockHashView",
    "BlockHasher",
    "ExtraKey",
    "HashFunction",
    "HashInputs",
    "MMFeature",
    "block_extra_keys",
    "encode_block",
    "encode_extra_keys",
    "get_hash_function",
    "hash_block_tokens",
    "hash_function_names",
    "hashes_at_block_size",
    "normalize_mm_features",
]

BlockHash: TypeAlias = bytes
"""The digest of one chunk, chained over every chunk before it."""

HashFunction: TypeAlias = Callable[[bytes], bytes]
"""Maps the canonical encoding of a chunk to its digest."""

ExtraKey: TypeAlias = "str | int | bytes | bool | tuple[ExtraKey, ...] | None"
"""One element of a chunk's extra keys; tuples nest."""

MMFeature: TypeAlias = tuple[str, int, int]
"""A multimodal placeholder: ``(identifier, offset, length)`` in token positions."""

NONE_HASH: BlockHash = bytes(32)
"""Parent of the first chunk of every request: 32 zero bytes."""

TOKEN_ID_LIMIT = 1 << 32
"""Token ids must lie in ``[0, TOKEN_ID_LIMIT)``: they are encoded as u32."""

_U32 = struct.Struct("<I")
_pack_u32 = _U32.pack
# Length prefixes for the digest sizes in use (sha256: 32, xxh3_128: 16).
_U32_SMALL = tuple(_pack_u32(i) for i in range(129))


# ---------------------------------------------------------------------------
# Hash functions
# ---------------------------------------------------------------------------


_sha256_new = hashlib.sha256


def _sha256(data: bytes) -> bytes:
    return _sha256_new(data).digest()


#: A sha256 that has absorbed a 32-byte parent's length prefix, which
#: starts every chained encoding after the first chunk's.
_SHA256_AFTER_HEAD32 = _sha256_new(struct.pack("<I", 32))

_chain_sha256: (
    Callable[[list[int] | tuple[int, ...], int], list[BlockHash] | None] | None
)
try:
    # Built at install where a C compiler and OpenSSL are (hatch_build.py).
    from kvcore.coordinator._chainhash import chain_sha256 as _chain_sha256
except ImportError:  # pragma: no cover - depends on the build
    _chain_sha256 = None

COMPILED_PROMPT_HASHING: bool = _chain_sha256 is not None
"""Whether a new request's sha256 chunk hashes come from kvcore's compiled
pass (packing, the token check and every digest in one C loop) rather than
the Python path; the hashes are the same either way."""


def _load_sha256() -> HashFunction:
    return _sha256


def _load_xxh3_128() -> HashFunction:
    try:
        import xxhash
    except ImportError as exc:  # pragma: no cover - xxhash is a dependency
        msg = (
            "hash function 'xxh3_128' needs the 'xxhash' package, which is not "
            "installed; install it (pip install xxhash) or use 'sha256'"
        )
        raise KvcoreValueError(msg) from exc
    fn: HashFunction = xxhash.xxh3_128_digest
    return fn


_HASH_LOADERS: dict[str, Callable[[], HashFunction]] = {
    "sha256": _load_sha256,
    "xxh3_128": _load_xxh3_128,
}
_HASH_CACHE: dict[str, HashFunction] = {}


def hash_function_names() -> tuple[str, ...]:
    """Names accepted by :func:`get_hash_function`, default first."""
    return tuple(_HASH_LOADERS)


def get_hash_function(name: str | HashFunction) -> HashFunction:
    """Return the hash function called ``name``.

    ``"sha256"`` (the default, cryptographic: use it when tenants share a cache
    and rely on ``cache_salt``) or ``"xxh3_128"`` (much faster, not
    cryptographic).  A callable is returned unchanged, so callers may pass
    either.
    """
    if type(name) is str:
        fn = _HASH_CACHE.get(name)
        if fn is not None:
            return fn
        loader = _HASH_LOADERS.get(name)
        if loader is None:
            valid = ", ".join(repr(n) for n in _HASH_LOADERS)
            msg = (
                f"unknown block hash function {name!r}; valid names are {valid}, "
                "or pass a callable mapping bytes to a digest"
            )
            raise KvcoreKeyError(msg)
        fn = _HASH_CACHE[name] = loader()
        return fn
    if callable(name):
        return name
    msg = (
        f"hash_function must be a name ({', '.join(map(repr, _HASH_LOADERS))}) "
        f"or a callable mapping bytes to a digest, not {type(name).__name__}"
    )
    raise KvcoreTypeError(msg)


# ---------------------------------------------------------------------------
# Canonical encoding
# ---------------------------------------------------------------------------


def _encode_key(key: object, out: list[bytes]) -> None:
    # Every value is tag + length (or fixed width) + payload, so the encoding of
    # a tuple is prefix-free and different tuples never encode the same.
    if isinstance(key, str):
        raw = key.encode("utf-8")
        out.append(b"S" + _pack_u32(len(raw)) + raw)
    elif isinstance(key, bool):  # before int: bool is an int subclass
        out.append(b"T" if key else b"F")
    elif isinstance(key, int):
        width = (key.bit_length() + 8) // 8  # room for the sign bit
        out.append(b"I" + _pack_u32(width) + key.to_bytes(width, "little", signed=True))
    elif isinstance(key, bytes):
        out.append(b"B" + _pack_u32(len(key)) + key)
    elif isinstance(key, tuple):
        out.append(b"(" + _pack_u32(len(key)))
        for item in key:
            _encode_key(item, out)
    elif key is None:
        out.append(b"N")
    else:
        msg = (
            f"block hash extra key {key!r} has type {type(key).__name__}; extra "
            "keys must be str, int, bytes, bool, None or tuples of those"
        )
        raise KvcoreTypeError(msg)


def encode_extra_keys(extra_keys: tuple[ExtraKey, ...] | None) -> bytes:
    """Encode a chunk's extra keys; ``None`` and ``()`` both encode to ``b""``.

    Tags: ``S`` + u32 length + UTF-8 for str, ``B`` + u32 length + raw for bytes,
    ``I`` + u32 width + little-endian two's complement for int, ``T``/``F`` for
    True/False, ``N`` for None, ``(`` + u32 count + items for a tuple.  The
    top-level tuple is encoded as a tuple.
    """
    if extra_keys is None or extra_keys == ():
        return b""
    keys: object = extra_keys  # checked at runtime: callers may pass anything
    if not isinstance(keys, tuple):
        msg = (
            f"extra_keys must be a tuple or None, not {type(keys).__name__}; "
            "wrap a single key as (key,)"
        )
        raise KvcoreTypeError(msg)
    out: list[bytes] = []
    _encode_key(keys, out)
    return b"".join(out)


def _pack_tokens(token_ids: Sequence[int], what: str) -> bytes:
    """Tokens as the bytes hashed, by the token rule
    (:func:`kvcore.tokens.pack_token_ids`); a bad token is named."""
    data = pack_token_ids(token_ids)
    if data is None:
        raise _bad_token_error(token_ids, what)
    return data


def _bad_token_error(token_ids: Sequence[object], what: str) -> Exception:
    """The error naming the first bad token, by the one token rule
    (:func:`kvcore.tokens.check_token_ids`); only taken once packing refused."""
    try:
        check_token_ids(token_ids, what)
    except (KvcoreTypeError, KvcoreValueError) as exc:
        return exc
    msg = f"{what}: token ids could not be encoded; they must be ints in [0, 2**32)"
    return KvcoreValueError(msg)


def encode_block(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[ExtraKey, ...] | None = None,
) -> bytes:
    """The exact bytes hashed for one chunk (see the module docstring)."""
    if parent is None:
        parent = NONE_HASH
    plen = len(parent)
    head = _U32_SMALL[plen] if plen < len(_U32_SMALL) else _pack_u32(plen)
    n = len(token_ids)
    ntok = _U32_SMALL[n] if n < len(_U32_SMALL) else _pack_u32(n)
    return (
        head
        + parent
        + ntok
        + _pack_tokens(token_ids, "hash_block_tokens")
        + encode_extra_keys(extra_keys)
    )


def hash_block_tokens(
    hash_function: str | HashFunction,
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[ExtraKey, ...] | None = None,
) -> BlockHash:
    """Hash one chunk chained onto ``parent`` (``None`` means :data:`NONE_HASH`)."""
    fn = get_hash_function(hash_function)
    return fn(encode_block(parent, token_ids, extra_keys))


# ---------------------------------------------------------------------------
# Extra keys of a chunk
# ---------------------------------------------------------------------------


def block_extra_keys(
    start: int,
    end: int,
    *,
    cache_salt: str | None = None,
    lora_name: str | None = None,
    mm_features: Sequence[MMFeature] = (),
) -> tuple[ExtraKey, ...] | None:
    """Extra keys of the chunk covering token positions ``[start, end)``.

    In order: ``("lora", name)`` on every chunk when a LoRA is set, then
    ``("mm", identifier, offset - start)`` for every multimodal feature that
    overlaps the chunk (in the order given; requests sort them by offset),
    then ``("salt", cache_salt)`` on the first chunk (``start == 0``) only.
    Returns ``None`` when there are none.  Each key is tagged, so a LoRA name
    can never pose as a salt.
    """
    keys: list[ExtraKey] = []
    if lora_name is not None:
        keys.append(("lora", lora_name))
    for ident, offset, length in mm_features:
        if offset < end and offset + length > start:
            keys.append(("mm", ident, offset - start))
    if cache_salt is not None and start == 0:
        keys.append(("salt", cache_salt))
    return tuple(keys) if keys else None


# ---------------------------------------------------------------------------
# Incremental hasher
# ---------------------------------------------------------------------------


def check_extra_key_names(cache_salt: object, lora_name: object) -> None:
    """Refuse a cache salt or LoRA name that is neither a str nor None."""
    if cache_salt is not None and type(cache_salt) is not str:
        msg = f"cache_salt must be a str or None, not {type(cache_salt).__name__}"
        raise KvcoreTypeError(msg)
    if lora_name is not None and type(lora_name) is not str:
        msg = f"lora_name must be a str or None, not {type(lora_name).__name__}"
        raise KvcoreTypeError(msg)


class HashInputs:
    """What a chunk's hash mixes in besides its tokens, read-only: the
    salt, the LoRA name and the multimodal placeholders (a subclass holds
    them in its own slots)."""

    __slots__ = ()
    _cache_salt: str | None
    _lora_name: str | None
    _mm_features: tuple[MMFeature, ...]

    @property
    def cache_salt(self) -> str | None:
        """Salt mixed into the first chunk's hash (tenant isolation)."""
        return self._cache_salt

    @property
    def lora_name(self) -> str | None:
        """LoRA adapter name mixed into every chunk's hash."""
        return self._lora_name

    @property
    def mm_features(self) -> tuple[MMFeature, ...]:
        """Multimodal placeholders ``(identifier, offset, length)``, by offset."""
        return self._mm_features


class BlockHasher(HashInputs):
    """Hashes the new full chunks of one request's growing token list.

    The hasher keeps no token state: :meth:`hash_new_blocks` looks at how many
    hashes the caller's list already holds, hashes only the full chunks after
    them, chaining from the last one, and appends the results.
    """

    __slots__ = (
        "_cache_salt",
        "_chunk",
        "_const_extra",
        "_fn",
        "_lora_name",
        "_mm_ends",
        "_mm_features",
        "_mm_offsets",
        "_ntok_prefix",
        "hash_block_size",
        "hash_function",
    )

    def __init__(
        self,
        hash_block_size: int,
        hash_function: str | HashFunction = "sha256",
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        mm_features: Sequence[MMFeature] | None = None,
    ) -> None:
        if type(hash_block_size) is not int or not 0 < hash_block_size < TOKEN_ID_LIMIT:
            msg = (
                f"hash_block_size must be a positive int below 2**32 (a chunk's "
                f"token count is hashed as a u32), got {hash_block_size!r}; "
                "pass the number of tokens per hashed chunk (e.g. 16)"
            )
            raise BlockSizeError(msg)
        check_extra_key_names(cache_salt, lora_name)
        self.hash_block_size = hash_block_size
        self.hash_function = hash_function
        self._fn = get_hash_function(hash_function)
        self._cache_salt = cache_salt
        self._lora_name = lora_name
        self._mm_features: tuple[MMFeature, ...] = normalize_mm_features(mm_features)
        self._mm_offsets = [f[1] for f in self._mm_features]
        self._mm_ends = [f[1] + f[2] for f in self._mm_features]
        self._ntok_prefix = _pack_u32(hash_block_size)
        # Encoded extra keys of a chunk that has no salt and no multimodal key.
        self._const_extra = (
            encode_extra_keys((("lora", lora_name),)) if lora_name is not None else b""
        )
        #: Packs one chunk of checked tokens, for :meth:`_hash_appended_block`'s
        #: plain case (sha256, no extra key on any chunk after the first);
        #: None when that case never applies.
        self._chunk = self._plain_chunk()

    def _plain_chunk(self) -> struct.Struct | None:
        return (
            token_struct(self.hash_block_size)
            if self._fn is _sha256 and not self._const_extra and not self._mm_ends
            else None
        )

    def __getstate__(self) -> dict[str, Any]:
        """The hasher's settings (the chunk packer is rebuilt from them: a
        ``struct.Struct`` cannot be pickled)."""
        return {
            name: getattr(self, name) for name in self.__slots__ if name != "_chunk"
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        self._chunk = self._plain_chunk()

    def extra_keys(self, block_index: int) -> tuple[ExtraKey, ...] | None:
        """Extra keys of chunk ``block_index`` (see :func:`block_extra_keys`)."""
        start = block_index * self.hash_block_size
        end = start + self.hash_block_size
        keys: list[ExtraKey] = []
        if self._lora_name is not None:
            keys.append(("lora", self._lora_name))
        if self._mm_features:
            # Placeholders are sorted and disjoint, so both ends are sorted.
            lo = bisect_right(self._mm_ends, start)
            hi = bisect_left(self._mm_offsets, end)
            for ident, offset, _ in self._mm_features[lo:hi]:
                keys.append(("mm", ident, offset - start))
        if self._cache_salt is not None and start == 0:
            keys.append(("salt", self._cache_salt))
        return tuple(keys) if keys else None

    def _hash_appended_block(
        self, token_ids: list[int], block_hashes: list[BlockHash]
    ) -> int:
        """:meth:`hash_new_blocks` for a decode step: when ``token_ids`` ends
        exactly one chunk past ``block_hashes`` and that chunk's tokens were
        checked when appended (:meth:`Request.append_output_token_ids`), it
        is packed without the per-token checks and hashed straight from its
        parent.  Any other case, and any token the packer refuses, takes
        :meth:`hash_new_blocks`.  Internal: only a request, which checked
        the tokens, may call it.
        """
        chunk = self._chunk
        done = len(block_hashes)
        if chunk is not None and done:
            bs = self.hash_block_size
            end = len(token_ids)
            parent = block_hashes[-1]
            if end == (done + 1) * bs and len(parent) == 32:
                try:
                    data = chunk.pack(*token_ids[end - bs :])
                except (struct.error, TypeError):
                    pass  # hash_new_blocks names the bad token
                else:
                    h = _SHA256_AFTER_HEAD32.copy()
                    h.update(parent + self._ntok_prefix + data)
                    block_hashes.append(h.digest())
                    return 1
        return self.hash_new_blocks(token_ids, block_hashes)

    def hash_prompt(
        self, token_ids: list[int] | tuple[int, ...]
    ) -> list[BlockHash] | None:
        """The hashes of every full chunk of a new request's prompt, its
        tokens (the unhashed tail's included) checked by one packing: the
        compiled pass where kvcore was built with it
        (:data:`COMPILED_PROMPT_HASHING`), else Python.

        ``None`` when this hasher gives some chunk an extra key of its own
        (a salt, a multimodal input), the prompt is empty, or it holds a
        token the token rule refuses: the request then takes its general
        checks, which name what is wrong.  Anything but a list or tuple (bytes,
        a set, a dict's keys) is refused by type as no token sequence."""
        given: object = token_ids  # public: callers pass anything
        if type(given) is not list and type(given) is not tuple:
            token_ids = check_token_sequence(given, "BlockHasher.hash_prompt")
        if self._mm_ends or self._cache_salt is not None or not token_ids:
            return None
        chain = _chain_sha256
        if chain is not None and self._chunk is not None:
            # sha256 and no extra keys: one C pass, or None for any token
            # but a plain int in range (numpy ints, bools and refusals are
            # then the Python path's).
            hashes: list[BlockHash] | None = chain(token_ids, self.hash_block_size)
            if hashes is not None:
                return hashes
        data = pack_token_ids(token_ids)
        if data is None:
            return None
        hashes = []
        full = len(token_ids) // self.hash_block_size
        if full:
            self._hash_plain_chunks(NONE_HASH, data, full, hashes.append)
        return hashes

    def _hash_plain_chunks(
        self,
        parent: BlockHash,
        data: bytes,
        count: int,
        append: Callable[[BlockHash], None],
    ) -> None:
        """Hash the first ``count`` chunks of packed tokens ``data``,
        chained from ``parent``, when no chunk carries a per-chunk extra
        key: every encoding is length, parent, token count, tokens, then the
        constant extra keys."""
        width = 4 * self.hash_block_size
        end = count * width
        fn = self._fn
        ntok = self._ntok_prefix
        const_extra = self._const_extra
        if fn is _sha256 and not const_extra and len(parent) == 32:
            # sha256 inline; every parent is 32 bytes from here on, so every
            # encoding starts with the same length prefix: a copy of a hasher
            # that has absorbed it is cheaper than hashing it again.
            absorbed = _SHA256_AFTER_HEAD32
            for off in range(0, end, width):
                h = absorbed.copy()
                h.update(parent + ntok + data[off : off + width])
                parent = h.digest()
                append(parent)
            return
        small = _U32_SMALL
        for off in range(0, end, width):
            plen = len(parent)
            enc = (
                (small[plen] if plen < 129 else _pack_u32(plen))
                + parent
                + ntok
                + data[off : off + width]
            )
            if const_extra:
                enc += const_extra
            parent = fn(enc)
            append(parent)

    def hash_new_blocks(
        self, token_ids: Sequence[int], block_hashes: list[BlockHash]
    ) -> int:
        """Append the hashes of the full chunks not yet in ``block_hashes``.

        Returns how many hashes were appended.
        """
        bs = self.hash_block_size
        done = len(block_hashes)
        full = len(token_ids) // bs
        if full <= done:
            return 0
        start = done * bs
        width = 4 * bs
        stop = full * bs
        data = _pack_tokens(
            token_ids
            if start == 0 and stop == len(token_ids) and type(token_ids) is list
            else token_ids[start:stop],
            "block hashing",
        )
        parent = block_hashes[-1] if done else NONE_HASH
        append = block_hashes.append
        salted = self._cache_salt is not None
        mm_ends = self._mm_ends
        num_mm = len(mm_ends)
        if not num_mm and not (salted and done == 0):
            # No chunk here carries a per-chunk extra key (the common case).
            self._hash_plain_chunks(parent, data, full - done, append)
            return full - done
        fn = self._fn
        ntok = self._ntok_prefix
        small = _U32_SMALL
        const_extra = self._const_extra
        mm_offsets = self._mm_offsets
        off = 0
        for i in range(done, full):
            plen = len(parent)
            head = small[plen] if plen < 129 else _pack_u32(plen)
            enc = head + parent + ntok + data[off : off + width]
            off += width
            if num_mm:
                # First placeholder ending after this chunk's start: it
                # overlaps the chunk iff it also starts before the chunk's end.
                j = bisect_right(mm_ends, i * bs)
                dynamic = j < num_mm and mm_offsets[j] < (i + 1) * bs
            else:
                dynamic = False
            if dynamic or (salted and i == 0):
                enc += encode_extra_keys(self.extra_keys(i))
            elif const_extra:
                enc += const_extra
            parent = fn(enc)
            append(parent)
        return full - done


_PLAIN_HASHERS: dict[tuple[int, str], BlockHasher] = {}
_MAX_PLAIN_HASHERS = 64


def plain_hasher(
    hash_block_size: int, hash_function: str | HashFunction = "sha256"
) -> BlockHasher:
    """A hasher with no salt, LoRA or multimodal key.  A hasher holds no
    per-request state, so for a named hash function one is shared by every
    request that needs it (a few dozen block sizes and names at most are
    kept); a callable gets a hasher of its own."""
    if type(hash_function) is not str or type(hash_block_size) is not int:
        return BlockHasher(hash_block_size, hash_function)
    key = (hash_block_size, hash_function)
    hasher = _PLAIN_HASHERS.get(key)
    if hasher is None:
        hasher = BlockHasher(hash_block_size, hash_function)
        if len(_PLAIN_HASHERS) < _MAX_PLAIN_HASHERS:
            _PLAIN_HASHERS[key] = hasher
    return hasher


def normalize_mm_features(
    mm_features: Sequence[MMFeature] | None,
) -> tuple[MMFeature, ...]:
    """Check multimodal placeholders and return them sorted by offset.

    Each must be an ``(identifier: str, offset: int >= 0, length: int >= 1)``
    triple, and no two may share a token position.
    """
    if not mm_features:
        return ()
    out: list[MMFeature] = []
    for item in mm_features:
        try:
            ident, offset, length = item
        except (TypeError, ValueError):
            msg = (
                f"multimodal feature {item!r} is not an (identifier, offset, length) "
                "triple; pass one triple per placeholder"
            )
            raise KvcoreTypeError(msg) from None
        if type(ident) is not str:
            msg = (
                f"multimodal feature {item!r}: identifier must be a str (e.g. the "
                f"content hash), not {type(ident).__name__}"
            )
            raise KvcoreTypeError(msg)
        if type(offset) is not int or type(length) is not int:
            msg = f"multimodal feature {item!r}: offset and length must be ints"
            raise KvcoreTypeError(msg)
        if offset < 0 or length < 1:
            msg = (
                f"multimodal feature {ident!r} has offset {offset} and length "
                f"{length}; offset must be >= 0 and length >= 1"
            )
            raise KvcoreValueError(msg)
        out.append((ident, offset, length))
    out.sort(key=lambda f: f[1])
    for prev, cur in pairwise(out):
        if cur[1] < prev[1] + prev[2]:
            msg = (
                f"multimodal features {prev[0]!r} (tokens [{prev[1]}, "
                f"{prev[1] + prev[2]})) and {cur[0]!r} (tokens [{cur[1]}, "
                f"{cur[1] + cur[2]})) overlap; each token position may belong to "
                "one placeholder only"
            )
            raise KvcoreValueError(msg)
    return tuple(out)


# ---------------------------------------------------------------------------
# Coarser block sizes
# ---------------------------------------------------------------------------


class BlockHashView(Sequence[BlockHash]):
    """Live view of chunk hashes at a block size ``k`` times the chunk size.

    Block ``i`` is identified by the hash of its last chunk,
    ``hashes[(i + 1) * k - 1]``; because hashes chain, that one hash names the
    whole prefix up to the end of block ``i``.  The view reads the underlying
    list on every access, so it follows a request's hashes as they grow.
    """

    __slots__ = ("_hashes", "_k")

    def __init__(self, hashes: Sequence[BlockHash], k: int) -> None:
        self._hashes = hashes
        self._k = k

    def __len__(self) -> int:
        return len(self._hashes) // self._k

    @overload
    def __getitem__(self, index: int) -> BlockHash: ...

    @overload
    def __getitem__(self, index: slice) -> list[BlockHash]: ...

    def __getitem__(self, index: int | slice) -> BlockHash | list[BlockHash]:
        k = self._k
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step > 0 and start < stop:
                # One extended slice of the chunk hashes, at C speed.
                with contextlib.suppress(TypeError):  # unless they take none
                    return list(self._hashes[(start + 1) * k - 1 : stop * k : step * k])
            return [self._hashes[(i + 1) * k - 1] for i in range(start, stop, step)]
        n = len(self._hashes) // k
        if index < 0:
            index += n
        if not 0 <= index < n:
            msg = f"block index {index} out of range for {n} blocks"
            raise IndexError(msg)
        return self._hashes[(index + 1) * k - 1]

    def __iter__(self) -> Iterator[BlockHash]:
        hashes = self._hashes
        k = self._k
        for i in range(k - 1, (len(hashes) // k) * k, k):
            yield hashes[i]

    def __repr__(self) -> str:
        return f"BlockHashView(k={self._k}, len={len(self)})"


def prefix_key(
    chunk_hashes: Sequence[BlockHash], end: int, hash_block_size: int
) -> BlockHash | None:
    """The prefix-cache key of a block whose prefix ends after ``end``
    tokens: the chunk hash of that prefix, or None where it does not end on
    a hash-block boundary (such a block is never keyed) or is not hashed
    yet.  The one rule every group's blocks are keyed and checked by."""
    if end <= 0 or end % hash_block_size:
        return None
    chunk = end // hash_block_size - 1
    return chunk_hashes[chunk] if chunk < len(chunk_hashes) else None


def hashes_at_block_size(
    block_hashes: Sequence[BlockHash], hash_block_size: int, block_size: int
) -> Sequence[BlockHash]:
    """Present chunk hashes at ``block_size`` (a multiple of ``hash_block_size``).

    O(1): returns ``block_hashes`` itself when the sizes are equal, else a
    :class:`BlockHashView`.
    """
    if block_size == hash_block_size and type(block_size) is int and block_size > 0:
        return block_hashes
    if (
        type(block_size) is not int
        or type(hash_block_size) is not int
        or block_size < 1
        or hash_block_size < 1
        or block_size % hash_block_size
    ):
        msg = (
            f"block_size={block_size!r} must be a positive multiple of "
            f"hash_block_size={hash_block_size!r} to reuse chunk hashes; choose a "
            "hash block size that divides every prefix-cacheable group's block size"
        )
        raise BlockSizeError(msg)
    return BlockHashView(block_hashes, block_size // hash_block_size)
