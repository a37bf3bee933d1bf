"""Plan, allocate and use the KV cache of a DeepSeek-V4-style hybrid.

Every layer keeps a 128-token sliding-window MLA latent; ratio-4 layers add a
compressed latent (one state per 4 tokens), indexer keys and two compressor
rings; ratio-128 layers add a compressed latent and one ring.  kvcore groups
the layers, packs every group densely into one block, sizes one allocation,
binds a zero-copy view per layer, and this script writes and reads a few
pages through those views.

    python examples/deepseek_v4_hybrid.py --memory-mib 64
    python examples/deepseek_v4_hybrid.py --model-file ../shared/zoo/deepseek-v4-flash.json
"""

from __future__ import annotations

import argparse

import torch

import kvcore
from kvcore.serialize import dump_config, load_config, load_model_file
from kvcore.tools.report import format_bytes, format_plan
from kvcore_circular_buffer import CircularBufferSpec
from kvcore_mla import MLAAttentionSpec
from kvcore_sliding_window import SlidingWindowMLASpec

FP8_DS_MLA_BYTES = 584  # 448 fp8 NoPE + 64 bf16 RoPE + 7 scale + 1 pad per token
INDEXER_BYTES = 132  # 128 fp8 + one fp32 scale per compressed entry
ROW_ALIGNMENT = 576  # kernels address pages in multiples of 576 bytes


def deepseek_v4_specs(
    num_layers: int = 43, head_dim: int = 512
) -> dict[str, kvcore.KVCacheSpec]:
    """The cache layers of a DeepSeek-V4-Flash-like model, in model order.

    Layers 0 and 1 are sliding-window only; from layer 2 on, even layers
    compress 4 tokens per state (with an indexer), odd layers 128.
    """
    specs: dict[str, kvcore.KVCacheSpec] = {}
    for i in range(num_layers):
        prefix = f"model.layers.{i}.attn"
        specs[f"{prefix}.swa_cache"] = SlidingWindowMLASpec(
            block_size=64,
            num_kv_heads=1,
            head_size=FP8_DS_MLA_BYTES,
            dtype=torch.uint8,
            sliding_window=128,
            alignment=ROW_ALIGNMENT,
        )
        if i < 2:
            continue
        ratio = 4 if i % 2 == 0 else 128
        specs[prefix] = MLAAttentionSpec(
            block_size=256,
            num_kv_heads=1,
            head_size=FP8_DS_MLA_BYTES,
            dtype=torch.uint8,
            tokens_per_state=ratio,
            alignment=ROW_ALIGNMENT,
        )
        # Compressor partial states: fp32 kv + score rows, two per token when
        # the ratio is 4 (overlapping windows), one otherwise.
        coff = 2 if ratio == 4 else 1
        specs[f"{prefix}.compressor.state_cache"] = CircularBufferSpec(
            block_size=coff * ratio,
            num_kv_heads=1,
            head_size=2 * coff * head_dim,
            head_size_v=0,
            dtype=torch.float32,
        )
        if ratio == 4:
            specs[f"{prefix}.indexer.k_cache"] = MLAAttentionSpec(
                block_size=256,
                num_kv_heads=1,
                head_size=INDEXER_BYTES,
                dtype=torch.uint8,
                tokens_per_state=4,
                alignment=ROW_ALIGNMENT,
            )
            specs[f"{prefix}.indexer.compressor.state_cache"] = CircularBufferSpec(
                block_size=8,
                num_kv_heads=1,
                head_size=2 * coff * 128,
                head_size_v=0,
                dtype=torch.float32,
            )
    return specs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--memory-mib", type=int, default=64, help="KV cache memory (default 64 MiB)"
    )
    parser.add_argument(
        "--layout", default="BLHNC", help="KV cache layout (default BLHNC)"
    )
    parser.add_argument("--model-file", help="plan a model file (zoo/*.json) instead")
    parser.add_argument("--device", default="cpu", help="torch device for the pool")
    args = parser.parse_args(argv)

    registry = kvcore.default_registry()
    specs = (
        load_model_file(args.model_file, registry).layers
        if args.model_file
        else deepseek_v4_specs()
    )
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout=args.layout, enable_prefix_caching=True
        )
    )
    groups = kvcore.get_kv_cache_groups(config, specs, registry=registry)
    plan = kvcore.get_kv_cache_config_from_groups(
        config, groups, args.memory_mib * 2**20
    )
    sched, hashing = kvcore.resolve_kv_cache_block_sizes(plan, config)
    print(
        format_plan(plan, title=f"DeepSeek-V4-style hybrid: {len(specs)} cache layers")
    )
    print(f"\n  scheduler block {sched} tokens, hash block {hashing} tokens")

    # The scheduler ships this JSON to its workers; it round-trips exactly.
    shipped = load_config(dump_config(plan, registry), registry)
    if shipped != plan:
        raise SystemExit("the plan did not survive its JSON round trip")

    pool = kvcore.KVCachePool(plan, args.device, registry=registry)
    views = pool.views
    storage = pool.buffer.untyped_storage().data_ptr()
    shared = all(
        t.untyped_storage().data_ptr() == storage
        for v in views.values()
        for t in (v if isinstance(v, tuple) else (v,))
    )
    print(
        f"\n  bound {len(views)} views over one {format_bytes(pool.buffer.numel())} "
        f"buffer on {args.device}; all share its storage: {shared}"
    )

    # A block id belongs to one group at a time: give block 1 to the first
    # group and block 2 to the second, write through their views, read back.
    first, second = plan.kv_cache_groups[0], plan.kv_cache_groups[1]
    a, b = first.layer_names[0], second.layer_names[0]
    va, vb = views[a], views[b]
    if isinstance(va, tuple) or isinstance(vb, tuple):
        raise SystemExit("expected attention views for the first two groups")
    va[1].fill_(7)
    vb[2].fill_(9)
    ok = bool((va[1] == 7).all() and (vb[2] == 9).all() and (va[2] != 7).any())
    print(f"  wrote block 1 of {a!r} and block 2 of {b!r}; read back intact: {ok}")
    same_start = va[1].data_ptr() == vb[1].data_ptr()
    print(
        f"  block 1 of both groups starts at the same byte (groups overlay): {same_start}"
    )
    return 0 if shared and ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
