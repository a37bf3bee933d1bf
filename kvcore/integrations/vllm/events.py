"""kvcore's KV-cache events in vLLM's types, for vLLM's KV-event publisher."""

from __future__ import annotations

from typing import Any

__all__ = ["to_vllm_events"]


def to_vllm_events(events: list[Any], config: Any) -> list[Any]:
    """kvcore's KV-cache events as vLLM's, each stored block's with its
    group's spec kind and sliding window as vLLM reports them."""
    from vllm.distributed import kv_events as ev
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as ext
    from vllm.v1.kv_cache_interface import (
        get_kv_cache_spec_kind,
        get_kv_cache_spec_sliding_window,
    )

    from kvcore.coordinator import events as kv

    groups = config.kv_cache_groups
    out: list[Any] = []
    for event in events:
        if isinstance(event, kv.BlockStored):
            spec = groups[event.group_id].kv_cache_spec
            out.append(
                ev.BlockStored(
                    block_hashes=[ext(h) for h in event.block_hashes],
                    parent_block_hash=None
                    if event.parent_block_hash is None
                    else ext(event.parent_block_hash),
                    token_ids=list(event.token_ids),
                    block_size=event.block_size,
                    lora_id=None,
                    medium=event.medium,
                    lora_name=None,
                    group_idx=event.group_id,
                    kv_cache_spec_kind=get_kv_cache_spec_kind(spec).value,
                    kv_cache_spec_sliding_window=get_kv_cache_spec_sliding_window(spec),
                )
            )
        elif isinstance(event, kv.BlockRemoved):
            out.append(
                ev.BlockRemoved(
                    block_hashes=[ext(h) for h in event.block_hashes],
                    medium=event.medium,
                    group_idx=event.group_id,
                )
            )
        else:
            out.append(ev.AllBlocksCleared())
    return out
