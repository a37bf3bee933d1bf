"""kvcore's plan as vLLM's workers would bind it, without vLLM: the
placement arithmetic of kvcore.integrations.vllm.config.  vLLM's own worker
code checks the same plans in the peer suite (tests/peer/vllm_plan_peer.py).
"""

from __future__ import annotations

import attrs
import pytest

import kvcore
from kvcore.config import CacheConfig, EngineConfig
from kvcore.errors import KvcoreError
from kvcore.integrations.vllm.config import (
    PlanNotExpressibleError,
    vllm_page_strides,
    vllm_placement,
)
from kvcore.layout import KVCacheLayout
from kvcore.serialize import load_model_file
from kvcore.tools import zoo

MAX_LEN = 128
MEMORY = 8 * 2**20


def _plan(model: str, layout: str, policy: str = "min_waste") -> kvcore.KVCacheConfig:
    config = EngineConfig(
        cache_config=CacheConfig(
            kv_cache_layout=KVCacheLayout[layout],
            packing_policy=policy,
            num_gpu_blocks_override=4,
        ),
        max_model_len=MAX_LEN,
        max_num_batched_tokens=MAX_LEN,
    )
    layers = load_model_file(zoo.path(model)).layers
    groups = kvcore.get_kv_cache_groups(config, layers)
    return kvcore.get_kv_cache_config_from_groups(config, groups, MEMORY)


CASES = [
    ("llama-3-1-8b", "LBNHC"),
    ("llama-3-1-8b", "BLHNC"),
    ("llama-3-1-8b", "LBHNC"),
    ("llama-3-1-8b", "BLNHC"),
    ("gpt-oss-120b", "LBNHC"),
    ("gpt-oss-120b", "BLHNC"),
    ("jamba-1-5-mini", "BLHNC"),
    ("deepseek-v4-flash", "BLHNC"),
]


@pytest.mark.parametrize(("model", "layout"), CASES)
def test_vllm_binds_each_layer_where_the_pool_does(model: str, layout: str) -> None:
    """Block ``b`` of layer ``l`` of a vLLM tensor starts at ``offset + l *
    layer_stride + b * block_stride``, and vLLM derives the page's strides
    from the layout: both are where kvcore's pool puts that layer's page."""
    plan = _plan(model, layout)
    placement = vllm_placement(plan)
    assert placement.num_blocks == plan.num_blocks == 4
    assert placement.layout == layout
    pool = kvcore.KVCachePool(plan, "cpu")
    base = pool.buffer.data_ptr()
    group_of = {n: g for g in plan.kv_cache_groups for n in g.layer_names}
    checked = 0
    for tensor in placement.tensors:
        assert tensor.size == plan.bytes_per_block * plan.num_blocks
        for index, name in enumerate(tensor.layers):
            spec = group_of[name].layer_spec(name)
            raw = pool.raw_view(name)
            for block in range(plan.num_blocks):
                start = tensor.offset + index * tensor.layer_stride
                start += block * tensor.block_stride
                assert raw[block].data_ptr() - base == start, (name, block)
            strides = vllm_page_strides(
                KVCacheLayout[layout],
                (len(tensor.layers), plan.num_blocks, *spec.page_grid),
                page_size_padded=placement.page_size_padded[name],
                layer_stride=tensor.layer_stride,
                block_stride=tensor.block_stride,
            )
            assert strides is not None
            assert list(strides[1:4]) == list(raw.stride()[:3]), name
            checked += 1
    assert checked == len(pool.views)


def test_packed_plan_numbers() -> None:
    """Jamba under min_waste in BLHNC: seven Mamba states side by side in a
    block, the four attention layers (their block grown from 16 to 128
    tokens, 524,288-byte pages) overlaid on the same bytes."""
    plan = _plan("jamba-1-5-mini", "BLHNC")
    placement = vllm_placement(plan)
    assert [len(t.layers) for t in placement.tensors] == [7, 7, 7, 7, 4]
    assert {t.block_stride for t in placement.tensors} == {7 * 311_296}
    assert [t.layer_stride for t in placement.tensors] == [311_296] * 4 + [524_288]
    assert [g.kv_cache_spec.block_size for g in plan.kv_cache_groups] == [16] * 4 + [
        128
    ]
    assert {t.offset for t in placement.tensors} == {0}
    assert set(placement.page_size_padded.values()) == {None}
    seed = vllm_placement(_plan("jamba-1-5-mini", "BLHNC", "seed"))
    assert len(seed.tensors) == 29
    assert {t.block_stride for t in seed.tensors} == {311_296}


def test_padded_pages_cross_as_page_size_padded() -> None:
    """DeepSeek-V4's 584-byte latents pad each page to a multiple of 576
    bytes; vLLM's spec carries that page as page_size_padded."""
    plan = _plan("deepseek-v4-flash", "BLHNC", "seed")
    placement = vllm_placement(plan)
    padded = {
        name: size
        for name, size in placement.page_size_padded.items()
        if size is not None
    }
    assert padded
    for group in plan.kv_cache_groups:
        for name in group.layer_names:
            spec = group.layer_spec(name)
            want = (
                spec.page_size_bytes
                if spec.page_size_bytes != spec.real_page_size_bytes
                else None
            )
            assert placement.page_size_padded[name] == want
    window = plan.kv_cache_groups[0].layer_specs()[0]
    assert window.real_page_size_bytes == 64 * 584
    assert placement.page_size_padded[plan.kv_cache_groups[0].layer_names[0]] == 37_440


def test_vllm_page_strides_match_its_rules() -> None:
    # LBNHC, 2 layers, 3 blocks, 2 heads, 4 states, 8 bytes: an unpadded page.
    assert vllm_page_strides(
        KVCacheLayout.LBNHC,
        (2, 3, 2, 4, 8),
        page_size_padded=None,
        layer_stride=192,
        block_stride=64,
    ) == (192, 64, 8, 16, 1)
    # BLHNC with the page padded to 80 bytes and a 160-byte block.
    assert vllm_page_strides(
        KVCacheLayout.BLHNC,
        (2, 3, 2, 4, 8),
        page_size_padded=80,
        layer_stride=80,
        block_stride=160,
    ) == (80, 160, 32, 8, 1)
    # vLLM's worker pads a page only where the axes outside it are L and B.
    assert (
        vllm_page_strides(
            KVCacheLayout.LHBNC,
            (2, 3, 2, 4, 8),
            page_size_padded=80,
            layer_stride=480,
            block_stride=32,
        )
        is None
    )


def _refused(plan: kvcore.KVCacheConfig, *words: str) -> None:
    with pytest.raises(PlanNotExpressibleError) as e:
        vllm_placement(plan)
    assert isinstance(e.value, KvcoreError)
    assert isinstance(e.value, ValueError)
    for word in words:
        assert word in str(e.value)


def test_host_resident_tensors_are_refused() -> None:
    plan = _plan("llama-3-1-8b", "BLHNC")
    tensor = attrs.evolve(plan.kv_cache_tensors[0], host_resident=True)
    _refused(
        attrs.evolve(plan, kv_cache_tensors=[tensor]),
        "'model.layers.0.self_attn'",
        "host-resident",
        "KVCORE_VLLM_PACKING=vllm",
    )


def test_page_strides_vllm_would_derive_otherwise_are_refused() -> None:
    plan = _plan("llama-3-1-8b", "LBNHC")
    tensor = plan.kv_cache_tensors[0]
    assert tensor.page_strides is not None
    h, n, c = tensor.page_strides
    moved = attrs.evolve(tensor, page_strides=(n, h, c))
    _refused(
        attrs.evolve(plan, kv_cache_tensors=[moved]),
        "'model.layers.0.self_attn'",
        "vLLM's worker derives",
        "kvcore.plan_kv_cache",
    )


def test_a_plan_without_a_layout_is_refused() -> None:
    plan = _plan("llama-3-1-8b", "LBNHC")
    _refused(attrs.evolve(plan, kv_cache_layout=None), "kv_cache_layout")


def test_a_layer_without_a_tensor_is_refused() -> None:
    plan = _plan("gpt-oss-120b", "LBNHC")
    _refused(
        attrs.evolve(plan, kv_cache_tensors=plan.kv_cache_tensors[:1]),
        "have no tensor",
    )


@pytest.mark.parametrize("given", [None, {"num_blocks": 4}, "plan"])
def test_a_non_plan_is_refused_with_a_type_error(given: object) -> None:
    with pytest.raises(TypeError, match="takes a kvcore plan") as info:
        vllm_placement(given)  # type: ignore[arg-type]
    assert isinstance(info.value, KvcoreError)
