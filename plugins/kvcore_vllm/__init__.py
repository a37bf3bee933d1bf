"""The ``vllm`` policy: what vLLM 0.33's own planner does with a model.

It answers ``kvcore_engine_estimate`` for the policy ``vllm`` with the two
figures vLLM logs at startup for each context used as ``max_model_len``:
``GPU KV cache size: N tokens`` and ``Maximum concurrency for T tokens per
request: Cx``.  It models vLLM as ``vllm serve`` runs by default: the
layer-outer layout (``LBNHC``), the hybrid attention block-size alignment of
Mamba models, the in-flight reservation on sliding-window and chunked-local
layers (``max_num_batched_tokens`` times the concurrent batches: two with
async scheduling, ``pipeline_parallel_size + 1`` with pipeline stages), and
vLLM's refusals (a model whose pages only a block-outermost layout can pack,
such as DeepSeek-V4; a pool that cannot hold one request).

kvcore's ``seed`` policy is something else: the reference grouping rules
inside kvcore's own planner, with kvcore's block stride and capacity model.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

from kvcore.config import EngineConfig
from kvcore.engines import EngineEstimate, EngineFigure
from kvcore.errors import PlanError
from kvcore.hookspecs import hookimpl
from kvcore.spec import KVCacheSpec
from kvcore_vllm.layers import Layer, Settings, to_layers
from kvcore_vllm.planner import (
    align_hybrid_block_size,
    check_fits,
    plan,
    scheduler_blocks,
    worker_blocks,
)

__all__ = ["ENGINE", "POLICY", "in_flight_tokens", "vllm_estimate"]

POLICY = "vllm"
ENGINE = "vLLM 0.33"


def in_flight_tokens(
    max_num_batched_tokens: int, pipeline_parallel_size: int = 1
) -> int:
    """``VllmConfig.max_in_flight_tokens`` with async scheduling and the
    default (V2) model runner: one batch per concurrent step, and
    ``pipeline_parallel_size + 1`` concurrent steps."""
    return (pipeline_parallel_size + 1) * max_num_batched_tokens


def _longest(
    layers: dict[str, Layer], p_settings: Settings, block_outermost: bool, memory: int
) -> int:
    """vLLM's estimate of the longest ``max_model_len`` that fits."""
    groups = plan(layers, memory, block_outermost=block_outermost)

    def fits(length: int) -> bool:
        s = dataclasses.replace(p_settings, max_model_len=length)
        return groups.bytes_per_block * worker_blocks(groups, s) <= memory

    if not fits(1):
        return 0
    low, high = 1, p_settings.max_model_len
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def vllm_estimate(
    specs: Mapping[str, KVCacheSpec],
    available_memory: int,
    contexts: Sequence[int],
    *,
    in_flight: int = 16_384,
    mamba_cache_mode: str = "none",
    block_outermost: bool = False,
    dcp: int = 1,
    num_gpu_blocks_override: int | None = None,
) -> EngineEstimate:
    """vLLM 0.33's figures for ``specs`` (one rank) in ``available_memory``
    bytes, one per context used as ``max_model_len``.

    :param in_flight: tokens vLLM reserves on window and chunked layers
        (:func:`in_flight_tokens`; 16,384 for ``vllm serve`` on an H100/H200).
    :param mamba_cache_mode: ``align`` (vLLM's mode with prefix caching on)
        or ``none``.
    :param block_outermost: plan vLLM's packed path (``BLNHC``) instead of
        its default layer-outer layout.
    """
    note = (
        f"{'BLNHC' if block_outermost else 'LBNHC'} layout, {in_flight:,} tokens "
        "in flight on window and chunked layers"
    )
    if any(spec.kind == "mamba" for spec in specs.values()):
        note += f", Mamba cache mode {mamba_cache_mode}"
    notes = (note,)
    refused = EngineEstimate(POLICY, ENGINE, notes=notes)
    if not specs:
        return refused
    try:
        layers = align_hybrid_block_size(to_layers(specs))
        p = plan(
            layers,
            available_memory,
            block_outermost=block_outermost,
            num_gpu_blocks_override=num_gpu_blocks_override,
        )
        memory = (
            available_memory
            if num_gpu_blocks_override is None
            else num_gpu_blocks_override * p.bytes_per_block
        )
        figures = []
        for context in contexts:
            s = Settings(context, in_flight, mamba_cache_mode, dcp)
            check_fits(
                p, s, memory, functools.partial(_longest, layers, s, block_outermost)
            )
            concurrency = p.num_blocks / scheduler_blocks(p, s)
            figures.append(
                EngineFigure(context, int(concurrency * context), concurrency)
            )
    except PlanError as exc:
        return EngineEstimate(POLICY, ENGINE, refusal=str(exc), notes=notes)
    return EngineEstimate(
        POLICY,
        ENGINE,
        figures=tuple(figures),
        num_groups=len(p.groups),
        bytes_per_block=p.bytes_per_block,
        num_blocks=p.num_blocks,
        notes=notes,
    )


@hookimpl
def kvcore_engine_estimate(
    policy: str,
    config: EngineConfig,
    specs: Mapping[str, KVCacheSpec],
    available_memory: int,
    contexts: Sequence[int],
) -> EngineEstimate | None:
    if policy != POLICY:
        return None
    cache = config.cache_config
    parallel = config.parallel_config
    mode = "none"
    if cache.enable_prefix_caching and cache.mamba_cache_mode in (None, "align"):
        mode = "align"
    return vllm_estimate(
        specs,
        available_memory,
        contexts,
        in_flight=in_flight_tokens(
            config.max_num_batched_tokens, parallel.pipeline_parallel_size
        ),
        mamba_cache_mode=mode,
        dcp=parallel.decode_context_parallel_size,
        num_gpu_blocks_override=cache.num_gpu_blocks_override,
    )
