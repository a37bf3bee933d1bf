"""vLLM's ``KVCacheConfig`` and cache specs as kvcore's.

Only facts cross: each vLLM group's layers, block size, heads, head sizes,
dtype and window become the kvcore spec of the kind that manages them.  A
vLLM spec with no kvcore counterpart here is refused with the list of those
that have one.
"""

from __future__ import annotations

from typing import Any

from kvcore.errors import InvalidSpecError
from kvcore.registry import KindRegistry, default_registry
from kvcore.spec import KVCacheSpec
from kvcore.structs import KVCacheConfig, KVCacheGroupSpec

__all__ = [
    "SUPPORTED_SPECS",
    "VLLM_CHECKPOINT_POLICY",
    "admission_caps",
    "to_kvcore_config",
    "to_kvcore_spec",
]

#: vLLM spec classes (by name) that convert, and the kvcore kind each becomes.
SUPPORTED_SPECS = {
    "FullAttentionSpec": "full_attention",
    "MLAAttentionSpec": "mla",
    "SlidingWindowSpec": "sliding_window",
    "SlidingWindowMLASpec": "sliding_window_mla",
    "ChunkedLocalAttentionSpec": "chunked_local_attention",
    "CrossAttentionSpec": "cross_attention",
    "MambaSpec": "mamba",
}

#: The checkpoint policy of a converted align-mode MambaSpec: vLLM's
#: align-mode kernels write a state only at the end of each step, so only
#: step ends may be kept (kvcore.checkpoints, "steps").
VLLM_CHECKPOINT_POLICY = "steps"


def to_kvcore_spec(
    spec: Any, *, group: int = 0, registry: KindRegistry | None = None
) -> KVCacheSpec:
    """The kvcore spec of one vLLM group spec (the kinds' spec classes come
    from ``registry``, default :func:`kvcore.default_registry`)."""
    name = type(spec).__name__
    if name not in SUPPORTED_SPECS:
        msg = (
            f"kvcore.integrations.vllm: cache group {group} has a vLLM {name}, "
            f"which kvcore does not manage for vLLM yet (supported: "
            f"{', '.join(SUPPORTED_SPECS)}); unset KVCORE_VLLM to run this model "
            "on vLLM's own KV-cache manager"
        )
        raise InvalidSpecError(msg)
    kinds = registry if registry is not None else default_registry()
    spec_type: Any = kinds[SUPPORTED_SPECS[name]].spec_type
    if name == "MambaSpec":
        return _mamba_spec(spec, spec_type, group)
    common: dict[str, Any] = {
        "block_size": spec.block_size,
        "num_kv_heads": spec.num_kv_heads,
        "head_size": spec.head_size,
        "dtype": spec.dtype,
        "head_size_v": spec.head_size_v,
    }
    if name in ("SlidingWindowSpec", "SlidingWindowMLASpec"):
        return spec_type(  # type: ignore[no-any-return]
            **common,
            sliding_window=spec.sliding_window,
            extra_retained_tokens=spec.extra_retained_tokens,
            bounded_replay=bool(getattr(spec, "bounded_replay", False)),
        )
    if name == "ChunkedLocalAttentionSpec":
        return spec_type(  # type: ignore[no-any-return]
            **common, attention_chunk_size=spec.attention_chunk_size
        )
    if name == "MLAAttentionSpec" and getattr(spec, "model_version", None):
        msg = (
            f"kvcore.integrations.vllm: cache group {group}'s MLAAttentionSpec "
            f"is a {spec.model_version} sparse-attention cache, which kvcore "
            "does not manage for vLLM yet; unset KVCORE_VLLM for this model"
        )
        raise InvalidSpecError(msg)
    if getattr(spec, "attention_chunk_size", None) or getattr(
        spec, "non_causal", False
    ):
        msg = (
            f"kvcore.integrations.vllm: cache group {group}'s FullAttentionSpec "
            "is chunked-local or non-causal, which kvcore does not manage for "
            "vLLM yet; unset KVCORE_VLLM for this model"
        )
        raise InvalidSpecError(msg)
    return spec_type(**common)  # type: ignore[no-any-return]


def _mamba_spec(spec: Any, spec_type: Any, group: int) -> KVCacheSpec:
    """vLLM's ``MambaSpec``: its state shapes and dtypes, its cache mode
    (``align`` keeps step-end states, ``none`` only the live one)."""
    mode = spec.mamba_cache_mode
    where = f"kvcore.integrations.vllm: cache group {group}'s MambaSpec"
    if mode not in ("align", "none"):
        msg = (
            f"{where} has mamba_cache_mode={mode!r}; kvcore manages 'align' "
            "and 'none' for vLLM"
        )
        raise InvalidSpecError(msg)
    if mode == "align" and (
        spec.num_speculative_blocks or spec.num_prefill_checkpoint_blocks
    ):
        msg = (
            f"{where} asks for {spec.num_speculative_blocks} speculative and "
            f"{spec.num_prefill_checkpoint_blocks} prefill-checkpoint state "
            "blocks in align mode, which kvcore does not manage for vLLM yet; "
            "unset KVCORE_VLLM for this model, or run it without speculative "
            "decoding and prefill checkpoints"
        )
        raise InvalidSpecError(msg)
    return spec_type(  # type: ignore[no-any-return]
        block_size=spec.block_size,
        shapes=spec.shapes,
        dtypes=spec.dtypes,
        tp_replicated=bool(spec.tp_replicated),
        mamba_cache_mode=mode,
        checkpoint_policy=VLLM_CHECKPOINT_POLICY,
        num_speculative_blocks=spec.num_speculative_blocks,
        page_size_padded=spec.page_size_padded,
    )


def to_kvcore_config(
    config: Any,
    *,
    scheduler_block_size: int,
    hash_block_size: int,
    max_model_len: int,
    enable_caching: bool,
    registry: KindRegistry | None = None,
) -> KVCacheConfig:
    """The scheduler's kvcore view of a vLLM ``KVCacheConfig`` (groups and
    block count; the tensors stay vLLM's)."""
    groups = [
        KVCacheGroupSpec(
            list(group.layer_names),
            to_kvcore_spec(group.kv_cache_spec, group=gid, registry=registry),
        )
        for gid, group in enumerate(config.kv_cache_groups)
    ]
    return KVCacheConfig(
        num_blocks=config.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        scheduler_block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_caching,
    )


def admission_caps(
    kv_cache_config: Any, max_in_flight_tokens: int, max_model_len: int
) -> tuple[int | None, ...] | None:
    """Each group's ``max_admission_blocks_per_request`` where vLLM 0.33
    caps its whole-sequence check by it (the specs whose managers recycle
    blocks: sliding window, chunked local, hi-sparse resident), else None;
    None for a config with no capped group."""
    import vllm.v1.kv_cache_interface as specs

    capped = tuple(
        getattr(specs, name)
        for name in (
            "SlidingWindowSpec",
            "ChunkedLocalAttentionSpec",
            "HiSparseResidentSpec",
        )
        if hasattr(specs, name)
    )
    caps = tuple(
        group.kv_cache_spec.max_admission_blocks_per_request(
            max_in_flight_tokens=max_in_flight_tokens, max_model_len=max_model_len
        )
        if isinstance(group.kv_cache_spec, capped)
        else None
        for group in kv_cache_config.kv_cache_groups
    )
    return caps if any(cap is not None for cap in caps) else None
