"""The capacity model against a real KVCacheManager, and plan-time refusals."""

from __future__ import annotations

import pytest
import torch
from coordinator_setup import builtin_registry

import kvcore
from kvcore.coordinator import KVCacheManager, Request
from kvcore.errors import InvalidSpecError, LayoutError, PlanError
from kvcore.plan.capacity import ideal_bytes_per_request
from kvcore.serialize import load_model_file
from kvcore.tools import zoo
from kvcore_full_attention import FullAttentionSpec
from kvcore_hisparse import HiSparseHotSpec
from kvcore_mamba import MambaSpec
from kvcore_mla import MLAAttentionSpec
from kvcore_sliding_window import SlidingWindowSpec

REGISTRY = builtin_registry()


@pytest.fixture(scope="module")
def registry(zoo_registry: kvcore.KindRegistry) -> kvcore.KindRegistry:
    return zoo_registry


def _config(policy: str, context: int, chunk: int) -> kvcore.EngineConfig:
    return kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout="BLHNC", packing_policy=policy, target_context=context
        ),
        max_model_len=context,
        max_num_batched_tokens=chunk,
    )


def _fill(manager: KVCacheManager, context: int, chunk: int) -> int:
    """Admit requests of ``context`` tokens one at a time, as a scheduler
    would: the prompt of ``context - 1`` tokens prefilled in steps of
    ``chunk`` tokens, then the last token; until a step is refused.
    Returns how many were admitted whole."""
    from kvcore.plan.capacity import prefill_steps

    admitted = 0
    while True:
        tokens = [admitted % 30000 + 1] * context
        request = Request(f"r{admitted}", tokens, hash_block_size=None)
        for start, end in prefill_steps(context, chunk):
            assert request.num_computed_tokens == start
            if manager.allocate_slots(request, end - start) is None:
                return admitted
            request.num_computed_tokens = end
        admitted += 1
        if admitted > 10_000:  # pragma: no cover - a runaway fill is a bug
            raise AssertionError("fill never refused")


@pytest.mark.parametrize("policy", ["seed", "min_waste"])
@pytest.mark.parametrize("context", [4096, 32768])
@pytest.mark.parametrize("name", zoo.names())
def test_capacity_model_matches_a_filling_manager(
    registry: kvcore.KindRegistry, name: str, context: int, policy: str
) -> None:
    specs = load_model_file(zoo.path(name), registry).layers
    chunk = 2048
    config = _config(policy, context, chunk)
    # Memory for a handful of requests: the fill must refuse in a few steps.
    memory = 5 * ideal_bytes_per_request(specs, context) + 3 * 2**20
    plan = kvcore.plan_kv_cache(config, specs, memory, registry=registry)
    predicted = kvcore.plan_capacity(plan, context, max_num_batched_tokens=chunk)
    manager = KVCacheManager.from_plan(
        kvcore.generate_scheduler_kv_cache_config([plan]), registry=registry
    )
    assert predicted.concurrency >= 1
    assert _fill(manager, context, chunk) == predicted.concurrency
    # Steady state: the admitted requests hold exactly what the model says.
    held = plan.num_blocks - 1 - manager.block_pool.free_queue.num_free
    partial = manager.coordinator.get_blocks(f"r{predicted.concurrency}")
    in_flight = sum(len([b for b in g if b != 0]) for g in partial)
    assert held - in_flight == predicted.concurrency * predicted.blocks_per_request


def test_capacity_of_a_hand_worked_hybrid() -> None:
    # 2 full-attention layers (page 4096 B at 16 tokens) beside a 1024-token
    # window layer with the same page, one 8 KiB state, BLHNC.
    registry = REGISTRY
    full = FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16
    )
    specs = {
        "full.0": full,
        "full.1": full,
        "swa.0": SlidingWindowSpec(
            block_size=16,
            num_kv_heads=1,
            head_size=64,
            dtype=torch.bfloat16,
            sliding_window=1024,
        ),
        "state.0": MambaSpec(
            block_size=16, shapes=((4096,),), dtypes=(torch.bfloat16,)
        ),
    }
    config = _config("seed", 4096, 1024)
    plan = kvcore.plan_kv_cache(config, specs, 100 * 2**20, registry=registry)
    # seed: buckets full (2), window (1), state (1); no balanced multi-page
    # bucket, so window and state are capped at the anchor (2 * 4096 = 8192):
    # three groups, one 8192-byte block each.
    assert plan.bytes_per_block == 8192
    assert len(plan.kv_cache_groups) == 3
    cap = kvcore.plan_capacity(plan, 4096, max_num_batched_tokens=1024)
    # Computing token 4096: full 4096/16 = 256 blocks; window
    # 256 - (4095 - 1023) // 16 = 64; state 1.  Steady 321 blocks.
    assert cap.blocks_per_request == 256 + 64 + 1
    # The prompt's last 1023-token chunk, [3072, 4095), holds the window of
    # the chunk before it, 256 - (3072 - 1023) // 16 = 128 blocks: 64 more
    # than steady.
    assert cap.prefill_peak_blocks == 321 + 64
    usable = plan.num_blocks - 1
    assert cap.concurrency == 1 + (usable - 385) // 321
    ideal = 2 * 4096 * 256 + 4096 * 64 + 8192
    assert cap.ideal_concurrency == pytest.approx(100 * 2**20 / ideal)


def test_pool_too_small_for_one_request_is_refused_with_the_numbers() -> None:
    full = FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16
    )
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(kv_cache_layout="BLHNC"), max_model_len=4096
    )
    # One request of 4096 tokens needs 256 blocks of 4096 bytes plus the null.
    with pytest.raises(PlanError, match=r"needs 257 .*1052672 bytes") as info:
        kvcore.plan_kv_cache(config, {"a": full}, 100 * 4096, registry=REGISTRY)
    assert isinstance(info.value, ValueError)
    plan = kvcore.plan_kv_cache(config, {"a": full}, 257 * 4096, registry=REGISTRY)
    assert plan.num_blocks == 257


def test_pages_off_their_element_size_are_refused_at_plan_time() -> None:
    registry = REGISTRY
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(kv_cache_layout="BLHNC")
    )
    # A 1-byte-head uint8 MLA layer of 3 tokens (3 bytes) before a bf16 one:
    # the bf16 page would start at byte 3.
    narrow = MLAAttentionSpec(
        block_size=3, num_kv_heads=1, head_size=1, dtype=torch.uint8
    )
    wide = MLAAttentionSpec(
        block_size=3, num_kv_heads=1, head_size=1, dtype=torch.bfloat16
    )
    group = kvcore.KVCacheGroupSpec(
        ["narrow", "wide"],
        kvcore.UniformTypeKVCacheSpecs(
            block_size=3, kv_cache_specs={"narrow": narrow, "wide": wide}
        ),
    )
    with pytest.raises(LayoutError, match=r"layer 'wide'.*offset is 3 bytes"):
        kvcore.get_kv_cache_config_from_groups(config, [group], 2**20)
    # A 3-byte hot page beside a bf16 layer: the stride rounds to both.
    hot = HiSparseHotSpec(block_size=16, page_size=3, blocks_per_request=1)
    bf16 = FullAttentionSpec(
        block_size=1, num_kv_heads=1, head_size=1, dtype=torch.bfloat16
    )
    groups = [
        kvcore.KVCacheGroupSpec(["hot"], hot),
        kvcore.KVCacheGroupSpec(["a"], bf16),
    ]
    bpb = kvcore.kv_cache_bytes_per_block(groups)
    assert bpb % 3 == 0
    assert bpb % 2 == 0
    plan = kvcore.get_kv_cache_config_from_groups(config, groups, 100 * bpb)
    views = kvcore.allocate_kv_cache(plan, "cpu", registry=registry)
    assert views["a"].dtype == torch.bfloat16
    # A state whose narrow dtype comes first is refused when it is built.
    with pytest.raises(InvalidSpecError, match=r"would start at byte 3"):
        MambaSpec(
            block_size=16, shapes=((3,), (4,)), dtypes=(torch.uint8, torch.float32)
        )


def test_from_plan_carries_the_settings() -> None:
    registry = REGISTRY
    specs = load_model_file(zoo.path("gemma-3-27b"), registry).layers
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout="BLHNC", enable_prefix_caching=True
        ),
        max_model_len=8192,
    )
    plan = kvcore.plan_kv_cache(config, specs, 2**33, registry=registry)
    assert plan.packing_policy == "min_waste"
    assert plan.target_context == 8192
    assert (
        plan.scheduler_block_size,
        plan.hash_block_size,
    ) == kvcore.resolve_kv_cache_block_sizes(plan, config)
    manager = KVCacheManager.from_plan(plan, registry=registry)
    assert manager.max_model_len == 8192
    assert manager.enable_caching is True
    assert manager.scheduler_block_size == plan.scheduler_block_size
    assert manager.hash_block_size == plan.hash_block_size
    # Every group's manager runs on the group's merged spec.
    for group, m in zip(
        plan.kv_cache_groups, manager.coordinator.single_type_managers, strict=True
    ):
        assert m.kv_cache_spec == group.manager_spec
        assert m.block_size == group.kv_cache_spec.block_size
    # The JSON a scheduler ships round-trips with every setting.
    from kvcore.serialize import dump_config, load_config

    back = load_config(dump_config(plan, registry), registry)
    assert back == plan
    bare = kvcore.get_kv_cache_config_from_groups(
        kvcore.EngineConfig(cache_config=kvcore.CacheConfig(kv_cache_layout="BLHNC")),
        plan.kv_cache_groups,
        2**30,
    )
    with pytest.raises(kvcore.InvalidRequestError, match="max_model_len"):
        KVCacheManager.from_plan(bare, registry=registry)


def test_planning_is_fast_and_close_to_linear() -> None:
    """Not a timing assertion: the work is bounded.  10,000 layers of 1,000
    distinct windows plus full layers plan without the quadratic repeat
    search (which took tens of seconds at this size)."""
    specs: dict[str, kvcore.KVCacheSpec] = {}
    for i in range(5000):
        specs[f"swa.{i}"] = SlidingWindowSpec(
            block_size=16,
            num_kv_heads=1,
            head_size=64,
            dtype=torch.bfloat16,
            sliding_window=128 + 16 * (i % 1000),
        )
        specs[f"full.{i}"] = FullAttentionSpec(
            block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16
        )
    for policy in ("seed", "min_waste"):
        config = _config(policy, 4096, 2048)
        groups = kvcore.get_kv_cache_groups(config, specs, registry=REGISTRY)
        assert sorted(n for g in groups for n in g.layer_names) == sorted(specs)


def test_a_chunk_aligned_request_still_holds_its_chunk(
    registry: kvcore.KindRegistry,
) -> None:
    # Chunked-local layers alone, 256-token chunks, requests of 512 tokens:
    # computing token 512 reads the second chunk, 256 - 1 earlier tokens of
    # it and itself: 16 blocks of 16 tokens (not 0, though 512 is a whole
    # number of chunks).
    spec_type = registry["chunked_local_attention"].spec_type
    chunked = spec_type(
        block_size=16,
        num_kv_heads=1,
        head_size=64,
        dtype=torch.bfloat16,
        attention_chunk_size=256,
    )
    specs = {"c0": chunked, "c1": chunked}
    config = _config("seed", 512, 256)
    plan = kvcore.plan_kv_cache(config, specs, 100 * 8192, registry=registry)
    cap = kvcore.plan_capacity(plan, 512, max_num_batched_tokens=256)
    assert cap.blocks_per_request == 16
    manager = KVCacheManager.from_plan(plan, registry=registry)
    assert _fill(manager, 512, 256) == cap.concurrency


def test_context_parallel_scales_the_physical_limit_too() -> None:
    # Decode context parallelism gives each rank every dcp-th token: a rank's
    # 16-token page covers 32 tokens at dcp 2, in the plan and in the limit.
    registry = REGISTRY
    specs = {"a": _full_spec(), "b": _full_spec()}
    for dcp in (1, 2, 4):
        config = kvcore.EngineConfig(
            cache_config=kvcore.CacheConfig(kv_cache_layout="BLHNC"),
            parallel_config=kvcore.ParallelConfig(decode_context_parallel_size=dcp),
        )
        plan = kvcore.plan_kv_cache(config, specs, 2**30, registry=registry)
        cap = kvcore.plan_capacity(plan, 4096)
        assert cap.blocks_per_request == 256 // dcp
        assert cap.ratio == pytest.approx(1.0)


def test_capacity_past_max_model_len_is_refused() -> None:
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(kv_cache_layout="BLHNC"), max_model_len=4096
    )
    plan = kvcore.plan_kv_cache(config, {"a": _full_spec()}, 2**30, registry=REGISTRY)
    with pytest.raises(PlanError, match="at most max_model_len=4096"):
        kvcore.plan_capacity(plan, 8192)


def _full_spec() -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16
    )


@pytest.mark.parametrize("mode", ["none", "align", "all"])
@pytest.mark.parametrize("name", ["qwen3-next-80b-a3b", "jamba-1-5-mini"])
def test_prefix_caching_plans_of_mamba_hybrids_run(
    registry: kvcore.KindRegistry, name: str, mode: str
) -> None:
    """With prefix caching on, every hashed group must hold whole hash
    blocks: the default policy never plans what the coordinator refuses."""
    import attrs

    specs = {
        layer: attrs.evolve(spec, mamba_cache_mode=mode)
        if isinstance(spec, MambaSpec)
        else spec
        for layer, spec in load_model_file(zoo.path(name), registry).layers.items()
    }
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout="BLHNC", enable_prefix_caching=True
        ),
        max_model_len=4096,
    )
    plan = kvcore.plan_kv_cache(config, specs, 2**34, registry=registry)
    manager = KVCacheManager.from_plan(plan, registry=registry)
    request = Request("r", list(range(1, 2001)), hash_block_size=plan.hash_block_size)
    assert manager.allocate_slots(request, 2000) is not None
