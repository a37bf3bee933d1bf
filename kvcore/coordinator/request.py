"""The coordinator's view of one inference request."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from kvcore.coordinator.hashing import (
    BlockHash,
    BlockHasher,
    HashFunction,
    HashInputs,
    MMFeature,
    check_extra_key_names,
    normalize_mm_features,
    plain_hasher,
)
from kvcore.errors import (
    InvalidRequestError,
    KvcoreError,
    KvcoreTypeError,
    KvcoreValueError,
)
from kvcore.tokens import check_token_ids, check_token_sequence

__all__ = ["Request", "RequestStatus", "create_requests", "make_requests"]


class RequestStatus(enum.Enum):
    """Where a request is in its life, as the
    :class:`~kvcore.coordinator.KVCacheManager` last saw it.

    A request starts ``WAITING``; it becomes ``RUNNING`` when
    :meth:`~kvcore.coordinator.KVCacheManager.allocate_slots` gives it slots
    (a refused step leaves it as it was), and ``FINISHED`` when
    :meth:`~kvcore.coordinator.KVCacheManager.free` releases its blocks.  A
    scheduler that preempts by freeing and later re-admits the request sees
    it ``RUNNING`` again once its next step is allocated.
    """

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request(HashInputs):
    """Tokens, chunk hashes and progress of one request.

    ``block_hashes`` holds the chained hash of every full ``hash_block_size``
    chunk of ``all_token_ids``; it is extended at construction and by
    :meth:`append_output_token_ids`.  With ``hash_block_size=None`` nothing is
    hashed and ``block_hashes`` stays empty.

    ``all_token_ids`` and ``block_hashes`` are the request's own lists: read
    them, but grow them only through :meth:`append_output_token_ids`.
    """

    __slots__ = (
        "_cache_salt",
        "_hasher",
        "_lora_name",
        "_mm_features",
        "_next_hash_at",
        "_num_prompt_tokens",
        "_prompt_token_ids",
        "all_token_ids",
        "block_hashes",
        "num_computed_tokens",
        "request_id",
        "shared_prefix_tokens",
        "skip_reading_prefix_cache",
        "status",
    )

    request_id: str
    all_token_ids: list[int]
    block_hashes: list[BlockHash]
    num_computed_tokens: int
    #: Tokens of its prompt that the last prefix-cache lookup found other
    #: requests had computed (what the token-indexed groups hold), even
    #: where a hit could not use them; state groups keep a checkpoint there.
    shared_prefix_tokens: int
    skip_reading_prefix_cache: bool
    status: RequestStatus

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        hash_block_size: int | None,
        hash_function: str | HashFunction = "sha256",
        cache_salt: str | None = None,
        lora_name: str | None = None,
        mm_features: Sequence[MMFeature] | None = None,
        skip_reading_prefix_cache: bool = False,
    ) -> None:
        prompt, hasher, features = _checked_inputs(
            request_id,
            prompt_token_ids,
            hash_block_size,
            hash_function,
            cache_salt,
            lora_name,
            mm_features,
        )
        self.request_id = request_id
        #: The prompt as a tuple, made on first read.
        self._prompt_token_ids: tuple[int, ...] | None = None
        self._num_prompt_tokens = len(prompt)
        self.all_token_ids = prompt
        self.num_computed_tokens = 0
        self.shared_prefix_tokens = 0
        self._cache_salt = cache_salt
        self._lora_name = lora_name
        self._mm_features = features
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        self.status = RequestStatus.WAITING
        self._hasher = hasher
        self.block_hashes = []
        #: Token count at which the next chunk fills (never, unhashed).
        self._next_hash_at = _NEVER
        if hasher is None:
            return
        # The prompt's chunks in one packing (the compiled pass where kvcore
        # was built with it); a prompt it does not take (a salt, a
        # multimodal input, a refused token) is hashed chunk by chunk.
        hashes = hasher.hash_prompt(prompt)
        if hashes is not None:
            self.block_hashes = hashes
            self._next_hash_at = (len(hashes) + 1) * hasher.hash_block_size
        else:
            try:
                self._hash(hasher)
            except KvcoreError:
                # Name the bad token as the prompt's, not the hasher's.
                check_token_ids(prompt, f"request {request_id!r}: prompt")
                raise

    def _hash(self, hasher: BlockHasher, *, appended_one: bool = False) -> None:
        """Hash the chunks the tokens completed; ``appended_one``: the last
        token, appended and checked alone, completed one chunk."""
        try:
            if appended_one:
                hasher._hash_appended_block(self.all_token_ids, self.block_hashes)
            else:
                hasher.hash_new_blocks(self.all_token_ids, self.block_hashes)
        except KvcoreError as exc:
            exc.add_note(f"in request {self.request_id!r}")
            raise
        self._next_hash_at = (len(self.block_hashes) + 1) * hasher.hash_block_size

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        """The prompt, as given at construction."""
        prompt = self._prompt_token_ids
        if prompt is None:
            prompt = tuple(self.all_token_ids[: self._num_prompt_tokens])
            self._prompt_token_ids = prompt
        return prompt

    @property
    def num_prompt_tokens(self) -> int:
        """Number of prompt tokens."""
        return self._num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        """Number of prompt plus output tokens."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Number of tokens appended after the prompt."""
        return len(self.all_token_ids) - self._num_prompt_tokens

    @property
    def hasher(self) -> BlockHasher | None:
        """The :class:`~kvcore.coordinator.hashing.BlockHasher` that keys this
        request's chunks (salt, LoRA and multimodal keys included), or
        ``None`` when the request is not hashed.  A router or a what-if tool
        keys further tokens with it exactly as the request will, with its
        ``hash_new_blocks`` (its
        :meth:`~kvcore.coordinator.hashing.BlockHasher.hash_prompt` answers
        ``None`` when there is a salt or a multimodal key).  It holds no
        per-request state, so requests with no extra key share one per
        block size and hash name."""
        return self._hasher

    @property
    def hash_block_size(self) -> int | None:
        """Tokens per hashed chunk, or ``None`` when the request is not hashed."""
        hasher = self._hasher
        return None if hasher is None else hasher.hash_block_size

    @property
    def is_finished(self) -> bool:
        """Whether :attr:`status` is ``FINISHED``: the manager freed the
        request's blocks and has not allocated it again since."""
        return self.status is RequestStatus.FINISHED

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append generated tokens and hash any chunk they complete.

        Invalid tokens (not ints in ``[0, 2**32)``) are refused before
        anything is appended.
        """
        tokens = self.all_token_ids
        if type(token_ids) is int and 0 <= token_ids < 4294967296:  # 2**32
            tokens.append(token_ids)
            if len(tokens) >= self._next_hash_at:
                hasher = self._hasher
                assert hasher is not None  # internal invariant: set when hashed
                self._hash(hasher, appended_one=True)
            return
        what = f"request {self.request_id!r}: appended tokens"
        if isinstance(token_ids, int):
            check_token_ids([token_ids], what, len(tokens))
        new = check_token_sequence(token_ids, what, len(tokens))
        tokens.extend(new)
        if len(tokens) >= self._next_hash_at:
            hasher = self._hasher
            assert hasher is not None  # internal invariant: set when hashed
            self._hash(hasher)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, num_tokens={len(self.all_token_ids)}, "
            f"num_computed_tokens={self.num_computed_tokens}, "
            f"status={self.status.name})"
        )


_NEVER = 1 << 62
"""``_next_hash_at`` of a request that is not hashed."""


def _checked_inputs(
    request_id: object,
    prompt_token_ids: Sequence[int],
    hash_block_size: int | None,
    hash_function: str | HashFunction,
    cache_salt: str | None,
    lora_name: str | None,
    mm_features: Sequence[MMFeature] | None,
) -> tuple[list[int], BlockHasher | None, tuple[MMFeature, ...]]:
    """A new request's prompt (as its own list), hasher and placeholders,
    every argument checked; errors name the request.  The prompt's full
    chunks are left to the hashing, which checks them at C speed."""
    if type(request_id) is not str:
        msg = (
            f"request_id must be a str, not {type(request_id).__name__} "
            f"({request_id!r}); convert it with str()"
        )
        raise KvcoreTypeError(msg)
    what = f"request {request_id!r}: prompt"
    given: object = prompt_token_ids  # checked: callers pass anything
    chunk = (
        hash_block_size if type(hash_block_size) is int and hash_block_size > 0 else 0
    )
    if type(given) is list or type(given) is tuple:
        prompt = list(prompt_token_ids)
        hashed = len(prompt) - len(prompt) % chunk if chunk else 0
        if hashed < len(prompt):
            check_token_ids(prompt[hashed:], what, hashed)
    else:
        hashed = 0
        if chunk:
            count = len(given) if isinstance(given, Sequence) else 0
            hashed = count - count % chunk
        prompt = check_token_sequence(prompt_token_ids, what, checked=hashed)
    num_prompt = len(prompt)
    if num_prompt == 0:
        msg = (
            f"request {request_id!r} has an empty prompt; a request needs at "
            "least one prompt token"
        )
        raise InvalidRequestError(msg)
    hasher: BlockHasher | None
    try:
        check_extra_key_names(cache_salt, lora_name)
        features = normalize_mm_features(mm_features) if mm_features else ()
        if hash_block_size is None:
            hasher = None
        elif cache_salt is None and lora_name is None and not features:
            hasher = plain_hasher(hash_block_size, hash_function)
        else:
            hasher = BlockHasher(
                hash_block_size,
                hash_function,
                cache_salt=cache_salt,
                lora_name=lora_name,
                mm_features=features,
            )
    except KvcoreError as exc:
        exc.add_note(f"while creating request {request_id!r}")
        raise
    for ident, offset, length in features:
        if offset + length > num_prompt:
            msg = (
                f"request {request_id!r}: multimodal feature {ident!r} spans "
                f"tokens [{offset}, {offset + length}) but the prompt has "
                f"{num_prompt} tokens; placeholders must lie inside the prompt"
            )
            raise InvalidRequestError(msg)
    return prompt, hasher, features


def _splitmix64(state: int) -> tuple[int, int]:
    # A tiny, fully specified generator: the same seed gives the same tokens on
    # every Python version and platform.
    state = (state + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return state, z ^ (z >> 31)


def _token_stream(seed: int, count: int, vocab_size: int) -> list[int]:
    state = seed & 0xFFFFFFFFFFFFFFFF
    out = []
    for _ in range(count):
        state, value = _splitmix64(state)
        out.append(value % vocab_size)
    return out


def make_requests(
    num_requests: int,
    num_tokens: int,
    block_size: int | None,
    *,
    hash_function: str | HashFunction = "sha256",
    common_prefix_len: int = 0,
    seed: int = 0,
    vocab_size: int = 32000,
    id_prefix: str = "req-",
) -> list[Request]:
    """Build ``num_requests`` requests of ``num_tokens`` prompt tokens each.

    Token ids are drawn deterministically from ``seed`` (the same on every
    platform).  The first ``common_prefix_len`` tokens are shared by every
    request; the rest differ per request.  ``block_size`` is the hash block size
    (``None``: no hashing).  Ids are ``f"{id_prefix}{i}"``.
    """
    if type(num_requests) is not int or num_requests < 0:
        msg = f"num_requests must be an int >= 0, got {num_requests!r}"
        raise KvcoreValueError(msg)
    if type(num_tokens) is not int or num_tokens < 1:
        msg = f"num_tokens must be an int >= 1, got {num_tokens!r}"
        raise KvcoreValueError(msg)
    if type(common_prefix_len) is not int or not 0 <= common_prefix_len <= num_tokens:
        msg = (
            f"common_prefix_len must be an int in [0, num_tokens={num_tokens}], "
            f"got {common_prefix_len!r}"
        )
        raise KvcoreValueError(msg)
    if type(vocab_size) is not int or vocab_size < 1:
        msg = f"vocab_size must be an int >= 1, got {vocab_size!r}"
        raise KvcoreValueError(msg)
    prefix = _token_stream(seed, common_prefix_len, vocab_size)
    tail_len = num_tokens - common_prefix_len
    requests = []
    for i in range(num_requests):
        tail = _token_stream(seed * 1_000_003 + i + 1, tail_len, vocab_size)
        requests.append(
            Request(
                f"{id_prefix}{i}",
                prefix + tail,
                hash_block_size=block_size,
                hash_function=hash_function,
            )
        )
    return requests


create_requests = make_requests
"""Alias of :func:`make_requests` (the name the seed tests use)."""
