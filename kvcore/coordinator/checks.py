"""The checks of :class:`~kvcore.coordinator.KVCacheManager`'s arguments:
each refuses, before a step changes anything, what an engine passed that
breaks the rules, naming the request, the argument, the rule and the fix.
Each takes the ``KVCacheManager`` (typed ``Any``: this module is imported by
``kv_cache_manager``) first."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict, cast

from kvcore.coordinator.block_pool import BlockPool
from kvcore.coordinator.blocks import BlockId, KVCacheBlock, KVCacheBlocks
from kvcore.coordinator.partial import copy_source_valid
from kvcore.coordinator.request import Request
from kvcore.errors import (
    InvalidRequestError,
    InvalidRequestTypeError,
    KvcoreTypeError,
    PluginError,
)
from kvcore.registry import KindRegistry
from kvcore.structs import KVCacheConfig


class EngineStepKeywords(TypedDict, total=False):
    """The keywords an engine may pass to :meth:`KVCacheManager.allocate_slots`
    by name, besides its positional parameters."""

    #: Tokens after the hit whose KV a KV connector loads.  They get slots
    #: (new blocks, or the null block at positions the group's kind skips)
    #: but take no cached block, and they count as computed: positions
    #: before them that a kind skips are not allocated.  Only when the
    #: request is admitted (it holds no blocks); ``num_new_tokens`` may then
    #: be 0 (a load that completes in a later step).  With a prefix hit
    #: attached (``num_new_computed_tokens``), ``num_new_tokens`` may be 0
    #: too: a chunk that only adopts the hit.
    num_external_computed_tokens: int
    #: The request's encoder tokens, for the groups whose manager takes them
    #: (``takes_encoder_tokens``: encoder cross-attention), which hold
    #: ``ceil(num_encoder_tokens / block_size)`` blocks from admission until
    #: the request is freed.  Only when the request is admitted; refused
    #: when no group of the plan takes encoder tokens.
    num_encoder_tokens: int
    #: Admit only when the pool can hold the request's whole current
    #: sequence (``request.num_tokens``, capped at ``max_model_len``) as well
    #: as this step, so chunked prefill does not admit a request whose later
    #: chunks cannot fit (see :meth:`KVCacheManager.can_fit_full_sequence`).
    full_sequence_must_fit: bool
    #: Tokens of ``request.num_computed_tokens`` that a step still in flight
    #: computes (asynchronous scheduling, pipeline parallelism).  Blocks the
    #: request no longer reads are released only below
    #: ``num_computed_tokens - num_in_flight_tokens``, so none that an
    #: in-flight step reads returns to the pool; call
    #: :meth:`KVCacheManager.remove_skipped_blocks` once the step has
    #: completed.
    num_in_flight_tokens: int
    #: Free blocks the step must leave free (for other requests already in
    #: flight, or a watermark); the step is refused when it would need them.
    reserved_blocks: int


_ENGINE_KEYWORDS = frozenset(EngineStepKeywords.__annotations__)


def checked_hit(
    manager: Any,
    request: Request,
    new_computed_blocks: KVCacheBlocks | None,
    counts: tuple[int, int, int, int],
) -> tuple[Sequence[BlockId], ...] | None:
    """allocate_slots' counts (new, hit, lookahead and external tokens) and
    hit, checked: the hit's block id lists, or None when it attaches no
    block."""
    num_new_tokens, num_new_computed_tokens, num_lookahead_tokens, num_external = counts
    rid = request.request_id
    if (type(num_new_tokens) is not int or num_new_tokens <= 0) and not (
        num_new_tokens == 0
        and type(num_new_tokens) is int
        and (num_external or num_new_computed_tokens)
    ):
        msg = (
            f"allocate_slots for request {rid!r} asks for {num_new_tokens!r} new "
            "tokens; schedule a positive int number of tokens"
        )
        raise wrong(num_new_tokens, msg)
    if (
        type(num_new_computed_tokens) is not int
        or num_new_computed_tokens < 0
        or type(num_lookahead_tokens) is not int
        or num_lookahead_tokens < 0
    ):
        check_counts(
            rid,
            {
                "num_new_computed_tokens": num_new_computed_tokens,
                "num_lookahead_tokens": num_lookahead_tokens,
            },
        )
    hit: object = new_computed_blocks  # checked: engines pass anything
    if hit is not None and not isinstance(hit, KVCacheBlocks):
        msg = (
            f"allocate_slots for request {rid!r}: new_computed_blocks must be "
            f"the KVCacheBlocks get_computed_blocks returned, or None, got "
            f"{type(hit).__name__}"
        )
        raise KvcoreTypeError(msg)
    computed = new_computed_blocks.ids if new_computed_blocks is not None else None
    if computed is not None and not any(computed):
        computed = None
    if num_new_computed_tokens or computed is not None:
        check_hit(
            manager, request, new_computed_blocks, computed, num_new_computed_tokens
        )
    return computed


def check_engine_keywords(
    manager: Any, request: Request, engine: Mapping[str, object]
) -> tuple[int, bool, int, int, int]:
    """The checked engine keywords: (external tokens, full sequence, encoder
    tokens, tokens in flight, reserved blocks)."""
    unknown = sorted(set(engine) - _ENGINE_KEYWORDS)
    if unknown:
        msg = (
            f"allocate_slots got unexpected keyword argument(s) "
            f"{', '.join(unknown)}; the engine keywords are "
            f"{', '.join(sorted(_ENGINE_KEYWORDS))}"
        )
        raise KvcoreTypeError(msg)
    num_external = engine.get("num_external_computed_tokens", 0)
    num_encoder = engine.get("num_encoder_tokens", 0)
    full_sequence_must_fit = engine.get("full_sequence_must_fit", False)
    check_external(manager, request, num_external, num_encoder, full_sequence_must_fit)
    limits = {n: engine.get(n, 0) for n in ("num_in_flight_tokens", "reserved_blocks")}
    check_counts(request.request_id, limits)
    return (
        cast(int, num_external),
        cast(bool, full_sequence_must_fit),
        cast(int, num_encoder),
        cast(int, limits["num_in_flight_tokens"]),
        cast(int, limits["reserved_blocks"]),
    )


def check_external(
    manager: Any,
    request: Request,
    num_external: object,
    num_encoder: object,
    full_sequence_must_fit: object,
) -> None:
    rid = request.request_id
    if type(num_external) is not int or num_external < 0:
        msg = (
            f"allocate_slots for request {rid!r}: num_external_computed_tokens "
            f"must be a non-negative int, got {num_external!r}"
        )
        raise InvalidRequestError(msg)
    if type(num_encoder) is not int or num_encoder < 0:
        msg = (
            f"allocate_slots for request {rid!r}: num_encoder_tokens must be a "
            f"non-negative int, got {num_encoder!r}"
        )
        raise InvalidRequestError(msg)
    if num_encoder and not manager.coordinator.encoder_groups:
        msg = (
            f"allocate_slots for request {rid!r}: {num_encoder} encoder tokens, "
            "but no cache group of this plan takes encoder tokens (no "
            "cross-attention layer); pass num_encoder_tokens=0 for this plan"
        )
        raise InvalidRequestError(msg)
    if num_encoder and request.request_id in manager._requests:
        msg = (
            f"allocate_slots for request {rid!r}: {num_encoder} encoder tokens, "
            "but the request already holds blocks; encoder tokens get their "
            "blocks only when the request is admitted"
        )
        raise InvalidRequestError(msg)
    if type(full_sequence_must_fit) is not bool:
        msg = (
            f"allocate_slots for request {rid!r}: full_sequence_must_fit must "
            f"be a bool, got {full_sequence_must_fit!r}"
        )
        raise InvalidRequestError(msg)
    if num_external and request.request_id in manager._requests:
        msg = (
            f"allocate_slots for request {rid!r}: {num_external} external "
            "computed tokens, but the request already holds blocks; a KV "
            "connector's tokens attach only when the request is admitted"
        )
        raise InvalidRequestError(msg)


def check_same_request(manager: Any, held: Request, request: Request) -> None:
    """A live request id belongs to the request that holds its blocks; a
    request object with the same id and the same tokens stands for it,
    one with other tokens is refused."""
    if (
        held.all_token_ids == request.all_token_ids
        and held.cache_salt == request.cache_salt
        and held.lora_name == request.lora_name
    ):
        return
    rid = request.request_id
    msg = (
        f"request id {rid!r} already holds blocks for another request (other "
        "tokens, cache salt or LoRA); free it before reusing its id, or give "
        "the new request its own id"
    )
    raise InvalidRequestError(msg)


def check_hit(
    kv: Any,
    request: Request,
    hit: KVCacheBlocks | None,
    computed: tuple[Sequence[BlockId], ...] | None,
    num_tokens: int,
) -> None:
    """A prefix hit may attach only to a new request, as one block list
    per group covering exactly ``num_tokens`` tokens, with every block
    still holding this request's prefix (a hit looked up earlier may
    have been evicted since).  The hit this manager's lookup returned
    for the request, with no key dropped from the pool since, is known
    to hold it: its blocks are not checked one by one."""
    rid = request.request_id
    pool: BlockPool = kv.block_pool
    lookup = None if hit is None else hit._lookup
    fresh = (
        lookup is not None
        and lookup[0] is pool
        and lookup[1] == pool.evictions
        and lookup[2] is request
        and lookup[3] is computed
    )
    coordinator = kv.coordinator
    if rid in kv._requests:
        msg = (
            f"request {rid!r} already holds blocks; prefix hits attach only "
            "when a request is first scheduled"
        )
        raise InvalidRequestError(msg)
    if num_tokens % coordinator.cache_hit_alignment:
        msg = (
            f"request {rid!r}: {num_tokens} computed tokens break the cache-hit "
            f"alignment of {coordinator.cache_hit_alignment} tokens; pass the hit "
            "length get_computed_blocks returned"
        )
        raise InvalidRequestError(msg)
    if computed is None or len(computed) != kv.num_kv_cache_groups:
        got = "no blocks" if computed is None else f"{len(computed)} block lists"
        msg = (
            f"request {rid!r}: a hit of {num_tokens} tokens came with {got}; pass "
            f"the blocks get_computed_blocks returned (one list per each of the "
            f"{kv.num_kv_cache_groups} groups)"
        )
        raise InvalidRequestError(msg)
    check_hashing(kv, request)
    if not fresh:
        _check_owned(rid, pool, hit, computed)
    for gid, (manager, blocks) in enumerate(zip(kv._managers, computed, strict=True)):
        if not manager.caching:
            if blocks:
                msg = (
                    f"request {rid!r}: group {gid} is not prefix-cacheable but "
                    f"the hit holds {len(blocks)} blocks for it"
                )
                raise InvalidRequestError(msg)
            continue
        try:
            partial = _check_hit_shape(
                rid,
                (gid, manager, blocks),
                num_tokens,
                gid in coordinator.partial_units,
            )
        except PluginError as exc:
            coordinator.plugin_error(gid, "hit_serves", exc)  # names its plugin
            raise
        if not fresh:
            _check_keys(
                request,
                (gid, manager, pool, blocks),
                -(-num_tokens // manager.block_size) - 1 if partial else -1,
                num_tokens // kv.hash_block_size - 1,
            )


def _check_hit_shape(
    rid: str,
    group: tuple[int, Any, Sequence[BlockId]],
    num_tokens: int,
    partial_group: bool,
) -> bool:
    """One caching group's hit covers exactly ``num_tokens`` and serves the
    next token; whether it ends inside its last block (a copy source,
    only in a ``partial_group``)."""
    gid, manager, blocks = group
    partial = partial_group and bool(num_tokens % manager.block_size)
    expected = -(-num_tokens // manager.block_size)
    if len(blocks) * manager.block_size != num_tokens and not (
        partial and len(blocks) == expected
    ):
        msg = (
            f"request {rid!r}: the hit covers {num_tokens} tokens but group "
            f"{gid} holds {len(blocks)} blocks of {manager.block_size} tokens"
        )
        raise InvalidRequestError(msg)
    try:
        serves = manager.hit_serves(blocks)
    except Exception as exc:
        owner = f"{type(manager).__module__}.{type(manager).__qualname__}"
        msg = (
            f"request {rid!r}: {owner}.hit_serves raised {type(exc).__name__}: "
            f"{exc} on group {gid}'s hit; nothing was attached"
        )
        raise PluginError(msg, plugin_name=type(manager).__module__) from exc
    if not serves:
        msg = (
            f"request {rid!r}: the hit's blocks for group {gid} "
            f"({manager.kv_cache_spec.kind}) lack what the next token reads "
            "(a window or state cut off by truncation); attach the hit "
            "get_computed_blocks returned, uncut"
        )
        raise InvalidRequestError(msg)
    return partial


def _check_owned(
    rid: str,
    pool: BlockPool,
    hit: KVCacheBlocks | None,
    computed: Sequence[Sequence[BlockId]],
) -> None:
    """Every block of a hit belongs to ``pool``: the hit was built by its
    manager and each id is one of its blocks."""
    ours = hit is not None and hit._pool is pool
    num_blocks = pool.num_blocks
    for gid, blocks in enumerate(computed):
        for block in blocks:
            if not ours or type(block) is not int or not 0 <= block < num_blocks:
                msg = (
                    f"request {rid!r}: the hit's blocks for group {gid} do not "
                    "belong to this manager's block pool (they came from another "
                    "KVCacheManager, or were built by hand); attach only the hit "
                    "this manager's get_computed_blocks returned"
                )
                raise InvalidRequestError(msg)


def _check_keys(
    request: Request,
    group: tuple[int, Any, BlockPool, Sequence[BlockId]],
    copy_at: int,
    last_chunk: int,
) -> None:
    """Every block of one group's hit (``group``: its id, manager, pool and
    blocks) still holds the request's prefix: its key, or for the copy
    source at index ``copy_at`` (-1: none) the partial key of chunk
    ``last_chunk``."""
    gid, manager, pool, blocks = group
    rid = request.request_id
    chunks = request.block_hashes
    key_of = manager.block_hash
    key_hash = pool.key_hash
    key_group = pool.key_group
    for i, block in enumerate(blocks):
        if not block:
            continue
        if i == copy_at:
            chunk = chunks[last_chunk] if 0 <= last_chunk < len(chunks) else None
            if copy_source_valid(pool, block, gid, key_of(chunks, i), chunk):
                continue
            msg = (
                f"request {rid!r}: the copy source block {block} "
                f"of group {gid} no longer holds this request's prefix (it "
                "was evicted after the lookup); call get_computed_blocks "
                "again right before allocate_slots"
            )
            raise InvalidRequestError(msg)
        if key_group[block] != gid or key_hash[block] != key_of(chunks, i):
            msg = (
                f"request {rid!r}: hit block {block} of group {gid} "
                "no longer holds this request's prefix (it was evicted after "
                "the lookup); call get_computed_blocks again right before "
                "allocate_slots"
            )
            raise InvalidRequestError(msg)


def check_hashing(manager: Any, request: Request) -> None:
    if request.hash_block_size != manager.hash_block_size:
        msg = (
            f"request {request.request_id!r} is hashed at "
            f"{request.hash_block_size} tokens per chunk but the manager hashes "
            f"at {manager.hash_block_size}; build requests with "
            f"hash_block_size={manager.hash_block_size}"
        )
        raise InvalidRequestError(msg)


# -- allocation -------------------------------------------------------------


def owned(pool: BlockPool, block: object) -> bool:
    """Whether ``block`` is one of ``pool``'s own block views."""
    if not isinstance(block, KVCacheBlock) or block._pool is not pool:
        return False
    bid = block.block_id
    return type(bid) is int and 0 <= bid < pool.num_blocks


def check_counts(rid: str, counts: Mapping[str, object]) -> None:
    """Each of allocate_slots' ``counts``, by name, a non-negative int."""
    for name, value in counts.items():
        if type(value) is not int or value < 0:
            msg = (
                f"allocate_slots for request {rid!r}: {name} must be a "
                f"non-negative int, got {value!r}"
            )
            raise wrong(value, msg)


def wrong(value: object, msg: str) -> InvalidRequestError:
    """The error for a count that breaks the rule: a TypeError as well when
    it is no int at all (a float, a bool, a string)."""
    if type(value) is int:
        return InvalidRequestError(msg)
    return InvalidRequestTypeError(msg)


def check_tokens(what: str, value: object, *args: object) -> None:
    """A token count argument: a non-negative int.  ``what`` names it, with
    ``args`` formatted into it (``%``) only when it is refused, so a hot
    caller builds no message."""
    if type(value) is not int or value < 0:
        if args:
            what %= args
        msg = f"{what} must be a non-negative int number of tokens, got {value!r}"
        raise wrong(value, msg)


def require_type(
    name: str, value: object, expected: type, what: str, *, exact: bool = False
) -> None:
    ok = type(value) is expected if exact else isinstance(value, expected)
    if not ok:
        shown = repr(value)
        if len(shown) > 60:
            shown = "a value"
        msg = f"KVCacheManager: {name} must be {what}, got {shown} ({type(value).__name__})"
        raise KvcoreTypeError(msg)


def positive_int(name: str, value: object) -> None:
    if type(value) is not int:
        msg = (
            f"KVCacheManager: {name} must be a positive int, got {value!r} "
            f"({type(value).__name__})"
        )
        raise KvcoreTypeError(msg)
    if value < 1:
        msg = f"KVCacheManager: {name} must be a positive int, got {value!r}"
        raise InvalidRequestError(msg)


def not_a_request(value: object) -> KvcoreTypeError:
    msg = (
        f"expected a kvcore.coordinator.Request, got {type(value).__name__}; build "
        "requests with Request(request_id, prompt_token_ids, hash_block_size=...)"
    )
    return KvcoreTypeError(msg)


def check_manager_settings(
    kv_cache_config: object,
    registry: object,
    kv_events_medium: object,
    *,
    counts: dict[str, object],
    flags: dict[str, object],
) -> None:
    """KVCacheManager's arguments, checked before anything is built: the
    plan, the registry, the events medium, the positive int ``counts`` and
    the bool ``flags`` (by parameter name)."""
    require_type(
        "kv_cache_config",
        kv_cache_config,
        KVCacheConfig,
        "a kvcore.KVCacheConfig (the scheduler's view of a plan)",
    )
    for name, value in counts.items():
        positive_int(name, value)
    for name, flag in flags.items():
        require_type(name, flag, bool, "a bool (True or False)", exact=True)
    require_type(
        "kv_events_medium", kv_events_medium, str, "a str such as 'GPU'", exact=True
    )
    if not kv_events_medium:
        msg = (
            "KVCacheManager: kv_events_medium must be a non-empty str such "
            "as 'GPU' or 'CPU', got ''"
        )
        raise InvalidRequestError(msg)
    if registry is not None:
        require_type(
            "registry",
            registry,
            KindRegistry,
            "a kvcore.KindRegistry or None (kvcore.default_registry() or "
            "KindRegistry.from_plugin_manager)",
        )
