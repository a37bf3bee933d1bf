"""vLLM 0.33's speculative-decoding lookahead on kvcore's vLLM manager,
without vLLM: what the manager carries (the re-prefillable tail it leaves
uncached) and what it refuses at construction.  The carried bound is checked
against vLLM's own manager in the peer suite (tests/peer/vllm_contract.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvcore.errors import BlockSizeError, InvalidRequestError, KvcoreError
from kvcore.integrations.vllm.lookahead import (
    UnsupportedFeatureError,
    reprefillable_tokens,
)
from kvcore.integrations.vllm.manager import KVCacheManager


def _config(*flags: bool, cacheable: tuple[bool, ...] = ()) -> Any:
    """A stand-in KVCacheConfig: one group per flag (its is_eagle_group)."""
    cacheable = cacheable or (True,) * len(flags)
    return SimpleNamespace(
        num_blocks=16,
        kv_cache_groups=[
            SimpleNamespace(
                is_eagle_group=flag,
                kv_cache_spec=SimpleNamespace(prefix_cacheable=ok),
            )
            for flag, ok in zip(flags, cacheable, strict=True)
        ],
    )


def _tail(config: Any, **kwargs: Any) -> int:
    args: dict[str, Any] = {
        "enable_caching": True,
        "use_eagle": False,
        "enable_kv_cache_events": False,
        "scheduler_block_size": 16,
        "num_hash_lookahead_tokens": 0,
        "num_prefill_lookahead": 0,
    }
    args.update(kwargs)
    return reprefillable_tokens(config, **args)


def test_one_group_leaves_the_reprefillable_tail_uncached() -> None:
    # vLLM's one-group coordinator caches num_computed - (lookahead - 1).
    assert _tail(_config(False), num_prefill_lookahead=3) == 2
    assert _tail(_config(False), num_prefill_lookahead=3, use_eagle=True) == 2
    assert _tail(_config(False), num_prefill_lookahead=1) == 0
    assert _tail(_config(False), num_prefill_lookahead=0) == 0
    # Without prefix caching nothing is cached, so there is nothing to bound.
    assert _tail(_config(False), num_prefill_lookahead=3, enable_caching=False) == 0


def test_several_groups_bound_the_tail_where_vllm_does() -> None:
    # vLLM bounds only EAGLE-drop groups: none without use_eagle (lookahead
    # hashes clear it), all of them when no group is flagged.
    assert _tail(_config(False, False), num_prefill_lookahead=3) == 0
    assert _tail(_config(False, False), num_prefill_lookahead=3, use_eagle=True) == 2
    assert _tail(_config(True, True), num_prefill_lookahead=3, use_eagle=True) == 2
    # A group that is never prefix-cached needs no flag.
    both = _config(True, False, cacheable=(True, False))
    assert _tail(both, num_prefill_lookahead=3, use_eagle=True) == 2


def test_a_tail_vllm_bounds_in_some_groups_only_is_refused() -> None:
    with pytest.raises(UnsupportedFeatureError) as caught:
        _tail(_config(True, False), num_prefill_lookahead=3, use_eagle=True)
    text = str(caught.value)
    assert "num_prefill_lookahead=3" in text
    assert "groups [0] of the prefix-cacheable groups [0, 1]" in text
    assert "KVCORE_VLLM" in text
    assert isinstance(caught.value, KvcoreError)
    assert isinstance(caught.value, ValueError)


def test_lookahead_hashes_with_kv_events_are_refused() -> None:
    with pytest.raises(UnsupportedFeatureError) as caught:
        _tail(
            _config(False),
            num_hash_lookahead_tokens=2,
            num_prefill_lookahead=2,
            enable_kv_cache_events=True,
        )
    text = str(caught.value)
    assert "num_hash_lookahead_tokens=2" in text
    assert "enable_kv_cache_events=True" in text
    assert "disable_lookahead_block_hashes=True" in text
    assert "KVCORE_VLLM" in text
    # Hashes alone, or events alone, are carried.
    assert _tail(_config(False), num_hash_lookahead_tokens=2) == 0
    assert _tail(_config(False), enable_kv_cache_events=True) == 0


def test_vllm_mtp_block_size_rule_is_kept() -> None:
    # vLLM 0.33 refuses an EAGLE group with prefix caching whose scheduler
    # block is shorter than the prefill lookahead.
    with pytest.raises(BlockSizeError, match="scheduler_block_size >= 4, got 2"):
        _tail(
            _config(False),
            num_prefill_lookahead=4,
            use_eagle=True,
            scheduler_block_size=2,
        )
    with pytest.raises(BlockSizeError):
        _tail(_config(True, False), num_prefill_lookahead=4, scheduler_block_size=2)
    # No EAGLE group, or no caching: no rule.
    assert _tail(_config(False), num_prefill_lookahead=4, scheduler_block_size=2) == 3
    assert (
        _tail(
            _config(False),
            num_prefill_lookahead=4,
            use_eagle=True,
            scheduler_block_size=2,
            enable_caching=False,
        )
        == 0
    )


@pytest.mark.parametrize(
    ("bad", "error"),
    [(-1, InvalidRequestError), (1.5, TypeError), (True, TypeError), (None, TypeError)],
)
def test_counts_must_be_non_negative_ints(bad: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match=f"num_prefill_lookahead must be .*got {bad}"):
        _tail(_config(False), num_prefill_lookahead=bad)
    with pytest.raises(error, match=f"num_hash_lookahead_tokens must .*got {bad}"):
        _tail(_config(False), num_hash_lookahead_tokens=bad)


def test_the_manager_refuses_at_construction() -> None:
    """KVCacheManager applies the rules before anything else (so here,
    before it imports vLLM, which this environment lacks)."""
    with pytest.raises(UnsupportedFeatureError, match="num_hash_lookahead_tokens=1"):
        KVCacheManager(
            _config(False),
            max_model_len=256,
            scheduler_block_size=16,
            hash_block_size=16,
            enable_kv_cache_events=True,
            num_hash_lookahead_tokens=1,
            num_prefill_lookahead=1,
        )
    with pytest.raises(UnsupportedFeatureError, match="pcp_world_size=2"):
        KVCacheManager(
            _config(False),
            max_model_len=256,
            scheduler_block_size=16,
            hash_block_size=16,
            pcp_world_size=2,
        )
