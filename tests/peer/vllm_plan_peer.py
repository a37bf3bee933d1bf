"""kvcore's plan on vLLM's own worker code (peer suite; needs vLLM 0.33).

For shipped models (``kvcore/tools/zoo``) under kvcore's ``seed`` and
``min_waste`` policies, in a layer-outer and a block-outermost layout:

- the ``KVCacheConfig`` kvcore's plan becomes is allocated by vLLM's worker
  (``vllm.v1.worker.utils.allocate_kv_cache``), and every layer's tensor
  vLLM binds starts at the byte, has the byte strides and reaches the bytes
  that kvcore's pool (:class:`kvcore.KVCachePool`) gives the same layer: the
  addresses agree, and after the pool's bytes are copied into vLLM's buffer
  every layer reads the same bytes through both;
- vLLM's own scheduler-side ``KVCacheManager`` accepts the groups;
- with the builder ``install()`` hooks in, vLLM's engine-core planning
  (``get_global_kv_cache_groups`` and ``get_kv_cache_configs``) hands out
  exactly that config.

Run by ``run_vllm_suite.py`` in the peer environment; by hand:
``python -m pytest tests/peer/vllm_plan_peer.py --confcutdir tests/peer``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from run_vllm_suite import OPT_125M_CONFIG
from vllm.config import CacheConfig as VllmCacheConfig
from vllm.config import ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.core import kv_cache_config_builder
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
from vllm.v1.core.kv_cache_planning import (
    get_global_kv_cache_groups,
    get_kv_cache_configs,
)
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, UniformTypeKVCacheSpecs
from vllm.v1.kv_cache_layout import KVCacheLayout as VllmLayout
from vllm.v1.worker.utils import allocate_kv_cache

import kvcore
import kvcore.integrations.vllm as kvcore_vllm
from kvcore.config import CacheConfig, EngineConfig
from kvcore.errors import InvalidSpecError, KvcoreError
from kvcore.integrations.vllm import builder
from kvcore.integrations.vllm.config import (
    PlanNotExpressibleError,
    to_vllm_kv_cache_config,
    to_vllm_spec,
)
from kvcore.layout import KVCacheLayout
from kvcore.serialize import load_model_file
from kvcore.tools import zoo

MAX_LEN = 128
MEMORY = 160 * 2**20

#: model -> the layouts kvcore plans it in (mixed page sizes overlay only
#: in a block-outermost layout).
MODELS = {
    "llama-3-1-8b": ("LBNHC", "BLHNC"),  # full attention
    "gpt-oss-120b": ("LBNHC", "BLHNC"),  # sliding window + full
    "gemma-3-27b": ("LBNHC", "BLHNC"),  # sliding window 5:1 full
    "llama-4-scout-17b-16e": ("LBNHC", "BLHNC"),  # chunked local + full
    "deepseek-v3": ("LBNHC", "BLHNC"),  # MLA
    "jamba-1-5-mini": ("BLHNC",),  # Mamba + full
    "qwen3-next-80b-a3b": ("BLHNC",),  # gated delta net + full
    "deepseek-v4-flash": ("BLHNC",),  # compressed MLA, rings, padded pages
}
CASES = [
    (model, layout, policy)
    for model, layouts in MODELS.items()
    for layout in layouts
    for policy in ("seed", "min_waste")
]


def _specs(model: str) -> dict[str, Any]:
    return load_model_file(zoo.path(model)).layers


def _plan(model: str, layout: str, policy: str) -> kvcore.KVCacheConfig:
    config = EngineConfig(
        cache_config=CacheConfig(
            kv_cache_layout=KVCacheLayout[layout], packing_policy=policy
        ),
        max_model_len=MAX_LEN,
        max_num_batched_tokens=MAX_LEN,
    )
    return kvcore.plan_kv_cache(config, _specs(model), MEMORY)


def _check_binding(plan: kvcore.KVCacheConfig, vllm_config: Any) -> int:
    """vLLM's worker binds every layer where kvcore's pool does; returns
    the layers checked."""
    layout = VllmLayout[plan.kv_cache_layout.name]  # type: ignore[union-attr]
    caches = allocate_kv_cache(vllm_config, torch.device("cpu"), layout)
    pool = kvcore.KVCachePool(plan, "cpu")
    assert set(caches) == set(pool.views)
    vllm_buffer = next(iter(caches.values()))
    storage = vllm_buffer.untyped_storage()
    assert storage.nbytes() == pool.buffer.numel()
    vllm_base = storage.data_ptr()
    kvcore_base = pool.buffer.data_ptr()
    for name, (raw, ratio) in pool._raws.items():
        assert ratio == 1
        tensor = caches[name]
        size = tensor.element_size()
        assert tensor.data_ptr() - vllm_base == raw.data_ptr() - kvcore_base, name
        assert [s * size for s in tensor.stride()[:3]] == list(raw.stride()[:3]), name
        assert tensor.stride()[3] == 1, name
        assert list(tensor.shape[:3]) == list(raw.shape[:3]), name
        assert tensor.shape[3] * size == raw.shape[3], name
    # The same bytes, not only the same addresses: fill kvcore's pool, copy
    # it into vLLM's buffer, and read every layer through both.
    generator = torch.Generator().manual_seed(0)
    pool.buffer.copy_(
        torch.randint(0, 256, pool.buffer.shape, generator=generator, dtype=torch.uint8)
    )
    whole = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
    whole.copy_(pool.buffer)
    for name, (raw, _) in pool._raws.items():
        assert torch.equal(caches[name].view(torch.uint8), raw), name
    return len(pool._raws)


@pytest.mark.parametrize(("model", "layout", "policy"), CASES)
def test_vllm_worker_binds_the_bytes_kvcore_placed(
    model: str, layout: str, policy: str
) -> None:
    plan = _plan(model, layout, policy)
    config = to_vllm_kv_cache_config(plan)
    assert config.num_blocks == plan.num_blocks
    assert config.kv_cache_layout == layout
    assert [g.layer_names for g in config.kv_cache_groups] == [
        g.layer_names for g in plan.kv_cache_groups
    ]
    assert [g.kv_cache_spec.block_size for g in config.kv_cache_groups] == [
        g.kv_cache_spec.block_size for g in plan.kv_cache_groups
    ]
    assert {t.size for t in config.kv_cache_tensors} == {
        plan.bytes_per_block * plan.num_blocks
    }
    assert _check_binding(plan, config) == len(_specs(model))
    # vLLM's own scheduler-side manager takes the groups and the pool.
    scheduler = generate_scheduler_kv_cache_config([config])
    manager = VllmKVCacheManager(
        scheduler,
        max_model_len=MAX_LEN,
        scheduler_block_size=plan.scheduler_block_size,  # type: ignore[arg-type]
        hash_block_size=plan.hash_block_size,  # type: ignore[arg-type]
        enable_caching=False,
    )
    assert manager.block_pool.get_num_free_blocks() == plan.num_blocks - 1


def test_min_waste_packing_reaches_vllm() -> None:
    """Jamba under min_waste: fewer, wider groups than seed (vLLM's own
    grouping rules), and vLLM's config carries them."""
    seed = to_vllm_kv_cache_config(_plan("jamba-1-5-mini", "BLHNC", "seed"))
    packed = to_vllm_kv_cache_config(_plan("jamba-1-5-mini", "BLHNC", "min_waste"))
    assert len(seed.kv_cache_groups) == 29
    assert len(packed.kv_cache_groups) == 5
    assert [len(g.layer_names) for g in packed.kv_cache_groups] == [7, 7, 7, 7, 4]
    assert all(
        isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs)
        for g in packed.kv_cache_groups
    )
    # One block holds seven Mamba states (311,296 bytes each) side by side.
    assert {t.block_stride for t in packed.kv_cache_tensors} == {7 * 311_296}
    assert {t.block_stride for t in seed.kv_cache_tensors} == {311_296}


def _vllm_config(tmp_path: Path, layout: str) -> VllmConfig:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(OPT_125M_CONFIG))
    config = VllmConfig(
        model_config=ModelConfig(model=str(model), max_model_len=MAX_LEN),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=MAX_LEN,
            max_model_len=MAX_LEN,
            is_encoder_decoder=False,
            async_scheduling=False,
        ),
        cache_config=VllmCacheConfig(block_size=16, enable_prefix_caching=False),
    )
    config.cache_config.kv_cache_layout = layout
    return config


def _engine_core_plan(vllm_config: VllmConfig, specs: dict[str, Any]) -> Any:
    groups = get_global_kv_cache_groups(vllm_config, [specs])
    return get_kv_cache_configs(vllm_config, [specs], [MEMORY], groups)[0]


@pytest.mark.parametrize(
    ("model", "layout", "policy"),
    [
        ("gemma-3-27b", "LBNHC", "min_waste"),
        ("gemma-3-27b", "BLHNC", "min_waste"),
        ("jamba-1-5-mini", "BLHNC", "min_waste"),
        ("jamba-1-5-mini", "BLHNC", "seed"),
        ("qwen3-next-80b-a3b", "BLHNC", "min_waste"),
    ],
)
def test_vllm_engine_core_plans_with_kvcore(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    model: str,
    layout: str,
    policy: str,
) -> None:
    """vLLM's own planning flow, with the builder ``install()`` hooks in,
    hands its workers kvcore's plan: the same config, bound the same."""
    monkeypatch.setattr(
        kv_cache_config_builder, "get_kv_cache_config_builder", builder._builder
    )
    monkeypatch.setenv(builder.PACKING_SWITCH, policy)
    vllm_config = _vllm_config(tmp_path, layout)
    specs = {n: to_vllm_spec(s, layer=n) for n, s in _specs(model).items()}
    got = _engine_core_plan(vllm_config, specs)
    plan = _plan(model, layout, policy)
    want = to_vllm_kv_cache_config(plan)
    assert got.num_blocks == want.num_blocks == plan.num_blocks
    assert got.kv_cache_tensors == want.kv_cache_tensors
    assert [(g.layer_names, g.kv_cache_spec) for g in got.kv_cache_groups] == [
        (g.layer_names, g.kv_cache_spec) for g in want.kv_cache_groups
    ]
    assert _check_binding(plan, got) == len(specs)
    # The scheduler side takes it: the block sizes vLLM's engine core
    # resolves, and both vLLM's own manager and kvcore's.
    scheduler = generate_scheduler_kv_cache_config([got])
    block, hashed = resolve_kv_cache_block_sizes(scheduler, vllm_config)
    for manager_type in (VllmKVCacheManager, kvcore_vllm.KVCacheManager):
        manager = manager_type(
            scheduler,
            max_model_len=MAX_LEN,
            scheduler_block_size=block,
            hash_block_size=hashed,
            enable_caching=False,
        )
        assert manager.block_pool.get_num_free_blocks() == plan.num_blocks - 1


def test_fixed_kernel_block_backends_keep_their_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM never splits a block-outermost block into kernel blocks, so a
    backend of fixed kernel block sizes (its spec marked ``MultipleOf``)
    keeps the model's block: min_waste grows Jamba's attention block to
    128 tokens only where the backend takes any multiple of 16."""
    monkeypatch.setattr(
        kv_cache_config_builder, "get_kv_cache_config_builder", builder._builder
    )
    specs = {n: to_vllm_spec(s, layer=n) for n, s in _specs("jamba-1-5-mini").items()}
    grown = _engine_core_plan(_vllm_config(tmp_path, "BLHNC"), specs)
    assert [g.kv_cache_spec.block_size for g in grown.kv_cache_groups] == [16] * 4 + [
        128
    ]
    fixed = {
        n: (
            dataclasses.replace(s, block_stride_alignment=MultipleOf(64))
            if isinstance(s, FullAttentionSpec)
            else s
        )
        for n, s in specs.items()
    }
    assert len(builder.fixed_kernel_blocks(fixed)) == 4
    kept = _engine_core_plan(_vllm_config(tmp_path, "BLHNC"), fixed)
    assert {g.kv_cache_spec.block_size for g in kept.kv_cache_groups} == {16}


def test_packing_switch_keeps_vllm_planner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    specs = {n: to_vllm_spec(s, layer=n) for n, s in _specs("gpt-oss-120b").items()}
    plain = _engine_core_plan(_vllm_config(tmp_path, "LBNHC"), specs)
    monkeypatch.setattr(
        kv_cache_config_builder, "get_kv_cache_config_builder", builder._builder
    )
    monkeypatch.setenv(builder.PACKING_SWITCH, "vllm")
    kept = _engine_core_plan(_vllm_config(tmp_path, "LBNHC"), specs)
    assert kept.num_blocks == plain.num_blocks
    assert kept.kv_cache_tensors == plain.kv_cache_tensors
    monkeypatch.setenv(builder.PACKING_SWITCH, "densest")
    with pytest.raises(KvcoreError, match="KVCORE_VLLM_PACKING='densest'"):
        _engine_core_plan(_vllm_config(tmp_path, "LBNHC"), specs)


def test_engine_core_refuses_a_kind_the_manager_cannot_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSeek-V4's compressor rings (vLLM's CircularBufferSpec) have no
    kvcore manager for vLLM yet: planning says so instead of placing a
    cache the scheduler then could not run."""
    monkeypatch.setattr(
        kv_cache_config_builder, "get_kv_cache_config_builder", builder._builder
    )
    specs = {
        n: to_vllm_spec(s, layer=n) for n, s in _specs("deepseek-v4-flash").items()
    }
    with pytest.raises(
        InvalidSpecError, match=r"CircularBufferSpec.*unset KVCORE_VLLM"
    ):
        _engine_core_plan(_vllm_config(tmp_path, "BLHNC"), specs)


def test_a_vllm_spec_of_another_geometry_is_refused() -> None:
    spec = _specs("llama-3-1-8b")["model.layers.0.self_attn"]
    base = to_vllm_spec(spec)
    other = dataclasses.replace(base, num_head_slots=4)
    with pytest.raises(PlanNotExpressibleError, match="page grid") as e:
        to_vllm_spec(spec, layer="model.layers.0.self_attn", base=other)
    assert isinstance(e.value, ValueError)
    assert "model.layers.0.self_attn" in str(e.value)
