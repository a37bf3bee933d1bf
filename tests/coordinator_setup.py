"""What the coordinator tests share: small specs and a manager over a plan
of one layer per group, built on an explicit registry of the built-in kinds
(nothing else installed counts)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import kvcore
from kvcore import KindRegistry, KVCacheConfig, KVCacheGroupSpec
from kvcore.coordinator import CheckpointManager, KVCacheManager, Request
from kvcore.coordinator.blocks import UNLINKED, FreeBlockQueue
from kvcore.serialize import load_model_file
from kvcore.tools import zoo
from kvcore_chunked_local import ChunkedLocalAttention
from kvcore_circular_buffer import CircularBuffer
from kvcore_cross_attention import CrossAttention
from kvcore_full_attention import FullAttention, FullAttentionSpec
from kvcore_hisparse import HiSparseHot
from kvcore_mamba import Mamba, MambaSpec
from kvcore_mla import MLA
from kvcore_sliding_window import SlidingWindow, SlidingWindowMLA, SlidingWindowSpec


def builtin_kinds() -> list[Any]:
    """One instance of each of kvcore's built-in kinds."""
    return [
        FullAttention(),
        MLA(),
        SlidingWindow(),
        SlidingWindowMLA(),
        Mamba(),
        CircularBuffer(),
        HiSparseHot(),
        ChunkedLocalAttention(),
        CrossAttention(),
    ]


BUILT_IN = KindRegistry.from_kinds(builtin_kinds())


def builtin_registry() -> KindRegistry:
    """kvcore's built-in kinds and hooks, no entry point loaded: what the
    default registry holds with nothing else installed, built explicitly."""
    pm = kvcore.get_plugin_manager(load_entrypoints=False)
    return KindRegistry.from_plugin_manager(pm, override=())


def fa(block_size: int) -> FullAttentionSpec:
    """A one-head full-attention layer (page contents do not matter here)."""
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float16
    )


def sw(block_size: int, window: int) -> SlidingWindowSpec:
    """A one-head sliding-window layer."""
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=1,
        dtype=torch.float32,
        sliding_window=window,
    )


def manager_for(
    specs: Sequence[Any],
    num_blocks: int,
    *,
    scheduler_block_size: int,
    hash_block_size: int,
    registry: KindRegistry = BUILT_IN,
    max_model_len: int = 8192,
    **kw: Any,
) -> KVCacheManager:
    """A manager over one group per spec (layer ``layer.i`` in group ``i``)."""
    groups = [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)]
    config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
    )
    return KVCacheManager(
        config,
        max_model_len,
        scheduler_block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        registry=registry,
        **kw,
    )


def beside_full_attention(
    kind: Any,
    num_blocks: int,
    *,
    block_size: int = 16,
    window: int = 32,
    owner: str = "<manual>",
    **kw: Any,
) -> KVCacheManager:
    """A manager over a full-attention group and a group of ``kind`` (a
    sliding-window kind, its window ``window`` tokens), both of
    ``block_size``-token blocks, with a registry of just those two kinds
    (registered by plugin ``owner``)."""
    shape = {"block_size": block_size, "num_kv_heads": 1, "head_size": 8}
    specs = [
        FullAttentionSpec(dtype=torch.float16, **shape),
        kind.spec_type(dtype=torch.float16, sliding_window=window, **shape),
    ]
    return manager_for(
        specs,
        num_blocks,
        scheduler_block_size=block_size,
        hash_block_size=block_size,
        registry=KindRegistry.from_kinds([FullAttention(), kind], owner=owner),
        max_model_len=1024,
        **kw,
    )


def small_manager(
    specs: Sequence[Any], num_blocks: int, *, max_model_len: int = 64, **kw: Any
) -> KVCacheManager:
    """:func:`manager_for` with 4-token scheduler and hash blocks: the small
    pools the engine-contract tests work out by hand."""
    return manager_for(
        specs,
        num_blocks,
        scheduler_block_size=4,
        hash_block_size=4,
        max_model_len=max_model_len,
        **kw,
    )


def small_request(rid: str, tokens: Sequence[int]) -> Request:
    """A request hashed in the 4-token blocks of :func:`small_manager`."""
    return Request(rid, list(tokens), hash_block_size=4)


def mamba(block_size: int, *, mode: str = "align", policy: str = "turns") -> MambaSpec:
    """A small Mamba layer (one float16 state shape)."""
    return MambaSpec(
        block_size=block_size,
        shapes=((4, 8),),
        dtypes=(torch.float16,),
        mamba_cache_mode=mode,  # type: ignore[arg-type]
        checkpoint_policy=policy,
    )


def state_hybrid(
    num_blocks: int,
    block_size: int = 16,
    *,
    mode: str = "align",
    policy: str = "turns",
    **kw: Any,
) -> KVCacheManager:
    """Full attention (group 0) and a Mamba state (group 1), both in
    ``block_size``-token blocks hashed at ``block_size``."""
    return manager_for(
        [fa(block_size), mamba(block_size, mode=mode, policy=policy)],
        num_blocks,
        scheduler_block_size=block_size,
        hash_block_size=block_size,
        **kw,
    )


def state_manager(mgr: KVCacheManager, group_id: int = 1) -> CheckpointManager:
    """The checkpointing manager of one group."""
    manager = mgr.coordinator.single_type_managers[group_id]
    assert isinstance(manager, CheckpointManager)
    return manager


def one_layer_plan(
    block_size: int,
    num_blocks: int,
    *,
    max_model_len: int,
    step_tokens: int,
    caching: bool = True,
) -> KVCacheConfig:
    """A plan of one full-attention layer (8-dim bfloat16 head) with
    ``num_blocks`` blocks (block 0 the null block), ``step_tokens`` tokens a
    step, as ``kvcore simulate`` plans one."""
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.bfloat16
    )
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout="BLHNC", enable_prefix_caching=caching
        ),
        max_model_len=max_model_len,
        max_num_batched_tokens=step_tokens,
    )
    plan = kvcore.plan_kv_cache(
        config, {"a": spec}, num_blocks * spec.page_size_bytes, registry=BUILT_IN
    )
    assert (plan.num_blocks, plan.scheduler_block_size) == (num_blocks, block_size)
    return plan


def assert_free_links_agree(
    queue: FreeBlockQueue, num_blocks: int | None = None
) -> None:
    """The free queue's three lists (the queue, the spare blocks, the
    held-back blocks) are linked both ways, as the public walks see them:
    each block's neighbours point back at it, and each list's ends lead to
    its own sentinels (ids past the pool's ``num_blocks`` blocks; by
    default every id below the sentinels is a block), which point back.
    Every block in no list, and the scratch ends a release builds its
    chains on, is unlinked."""
    held = queue.held_blocks()
    spare = queue.spare_blocks()
    order = queue.get_all_free_blocks()
    num_queue = len(order) - len(held) - len(spare)
    assert order[num_queue : num_queue + len(spare)] == spare
    assert order[len(order) - len(held) :] == held
    prev, nxt = queue.prev, queue.next
    ends = [
        queue.head,
        queue.tail,
        queue.spare_head,
        queue.spare_tail,
        queue.held_head,
        queue.held_tail,
    ]
    assert len(set(ends)) == len(ends)
    if num_blocks is None:
        num_blocks = queue.head  # the sentinels follow the blocks' ids
    assert min(ends) >= num_blocks
    runs = (
        (order[:num_queue], ends[:2]),
        (spare, ends[2:4]),
        (held, ends[4:]),
    )
    for run, (head, tail) in runs:
        for x, y in zip([head, *run], [*run, tail], strict=True):
            assert nxt[x] == y
            assert prev[y] == x
    queued = set(order)
    assert len(queued) == len(order)
    for b in [*range(num_blocks), queue.front, queue.back]:
        if b not in queued:
            assert prev[b] == nxt[b] == UNLINKED, b


def zoo_manager(
    name: str,
    registry: KindRegistry,
    num_blocks: int,
    max_model_len: int | None = None,
) -> KVCacheManager:
    """A manager for a shipped model file's plan of ``num_blocks`` blocks
    (``min_waste``, BLHNC, prefix caching on), as its scheduler builds it;
    ``max_model_len`` defaults to 64 scheduler blocks."""
    model = load_model_file(zoo.path(name), registry)
    cfg = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout="BLHNC",
            enable_prefix_caching=True,
            num_gpu_blocks_override=num_blocks,
        )
    )
    groups = kvcore.get_kv_cache_groups(cfg, model.layers, registry=registry)
    plan = kvcore.get_kv_cache_config_from_groups(cfg, groups, 0)
    sched, hash_bs = kvcore.resolve_kv_cache_block_sizes(plan, cfg)
    return KVCacheManager(
        kvcore.generate_scheduler_kv_cache_config([plan]),
        64 * sched if max_model_len is None else max_model_len,
        scheduler_block_size=sched,
        hash_block_size=hash_bs,
        registry=registry,
    )
