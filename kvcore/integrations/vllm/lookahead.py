"""vLLM 0.33's speculative-decoding lookahead on kvcore's vLLM manager.

With EAGLE or MTP drafting and prefix caching, vLLM 0.33's scheduler hands
its ``KVCacheManager`` two counts:

``num_hash_lookahead_tokens``
    the tokens after each block that its hash covers.  The request's block
    hasher computes those hashes (a block is hashed only once its lookahead
    tokens exist), and the scheduler then passes ``use_eagle=False`` (the
    hashes prove the boundary token, so no hit drops its last block).  The
    manager itself reads the count only for its KV events, whose stored
    blocks carry their lookahead tokens; kvcore's events carry none.

``num_prefill_lookahead``
    the prefill tokens past a chunk the drafter reads.  The trailing
    ``num_prefill_lookahead - 1`` computed tokens of a chunk (multi-module
    MTP) may be prefilled again, so vLLM caches no block that ends inside
    them: in every group of a one-group model, and in the EAGLE groups of a
    model of several groups (none when ``use_eagle`` is off).  vLLM also
    refuses an EAGLE group with prefix caching whose scheduler block is
    shorter than ``num_prefill_lookahead``.

:func:`reprefillable_tokens` decides, once at construction, how kvcore
carries these: the cache bound kvcore applies to every group (kvcore caches
every group to one token count), or a refusal where kvcore cannot match vLLM.
"""

from __future__ import annotations

import operator
from typing import Any

from kvcore.errors import (
    BlockSizeError,
    InvalidRequestError,
    InvalidRequestTypeError,
    echo,
)

__all__ = ["UnsupportedFeatureError", "reprefillable_tokens"]

_FIX = "unset KVCORE_VLLM to run vLLM's own KV-cache manager"


class UnsupportedFeatureError(InvalidRequestError):
    """A vLLM setting kvcore's vLLM manager cannot carry as vLLM 0.33 does;
    the message names the setting, its value and how to run without it."""


def _count(name: str, source: str, value: Any) -> int:
    """``value`` as a count, refused unless a non-negative int."""
    error: type[InvalidRequestError] = InvalidRequestTypeError
    count = -1
    if not isinstance(value, bool):
        try:
            count = operator.index(value)
            error = InvalidRequestError
        except TypeError:
            pass
    if count < 0:
        msg = (
            f"KVCacheManager: {name} must be a non-negative int (vLLM's "
            f"VllmConfig.{source}), got {echo(value)}"
        )
        raise error(msg)
    return count


def reprefillable_tokens(
    kv_cache_config: Any,
    *,
    enable_caching: bool,
    use_eagle: bool,
    enable_kv_cache_events: bool,
    scheduler_block_size: int,
    num_hash_lookahead_tokens: int,
    num_prefill_lookahead: int,
) -> int:
    """The trailing computed tokens kvcore leaves uncached in every group
    (vLLM 0.33's ``num_reprefillable_tokens`` where vLLM applies it to every
    cacheable group, else 0 where it applies it to none).

    :raises BlockSizeError: vLLM's own rule: an EAGLE group with prefix
        caching and ``scheduler_block_size < num_prefill_lookahead``.
    :raises UnsupportedFeatureError: lookahead hashes with KV events on, or
        a re-prefillable tail that vLLM bounds in only some of the groups.
    """
    hash_lookahead = _count(
        "num_hash_lookahead_tokens",
        "num_hash_lookahead_tokens",
        num_hash_lookahead_tokens,
    )
    prefill_lookahead = _count(
        "num_prefill_lookahead", "num_prefill_lookahead_tokens", num_prefill_lookahead
    )
    if not enable_caching:
        return 0
    groups = kv_cache_config.kv_cache_groups
    flagged = [i for i, g in enumerate(groups) if getattr(g, "is_eagle_group", False)]
    eagle = flagged or (list(range(len(groups))) if use_eagle else [])
    if eagle and scheduler_block_size < prefill_lookahead:
        msg = (
            f"KVCacheManager: num_prefill_lookahead={prefill_lookahead} with "
            f"EAGLE groups {eagle} and prefix caching needs "
            f"scheduler_block_size >= {prefill_lookahead}, got "
            f"{scheduler_block_size} (vLLM 0.33's rule: a hit drops a whole "
            "scheduler block, which must hold the drafter's lookahead); use a "
            "larger block size or fewer speculative tokens"
        )
        raise BlockSizeError(msg)
    if hash_lookahead and enable_kv_cache_events:
        msg = (
            f"KVCacheManager: num_hash_lookahead_tokens={hash_lookahead} with "
            "enable_kv_cache_events=True is not supported: each block's hash "
            f"covers the {hash_lookahead} tokens after it, which vLLM's "
            "BlockStored events carry (lookahead_token_ids) and kvcore's do "
            "not, so a router could not rebuild the hashes; turn KV events "
            "off, set speculative_config disable_lookahead_block_hashes=True, "
            f"or {_FIX}"
        )
        raise UnsupportedFeatureError(msg)
    tail = max(0, prefill_lookahead - 1)
    if not tail or len(groups) == 1:
        return tail
    if not use_eagle:
        return 0
    cacheable = [
        i
        for i, g in enumerate(groups)
        if getattr(g.kv_cache_spec, "prefix_cacheable", True)
    ]
    if all(i in eagle for i in cacheable):
        return tail
    msg = (
        f"KVCacheManager: num_prefill_lookahead={prefill_lookahead} with "
        f"use_eagle=True is not supported when only groups {flagged} of the "
        f"prefix-cacheable groups {cacheable} are EAGLE groups: vLLM leaves "
        f"the trailing {tail} computed tokens uncached in the EAGLE groups "
        "alone, and kvcore caches every group to one bound; run without "
        f"prefix caching or {_FIX}"
    )
    raise UnsupportedFeatureError(msg)
