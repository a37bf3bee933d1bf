"""Every shipped model file plans, for every layout that can express it."""

from __future__ import annotations

import pytest

import kvcore
from kvcore.serialize import load_model_file
from kvcore.tools import zoo


@pytest.fixture(scope="module")
def registry(zoo_registry: kvcore.KindRegistry) -> kvcore.KindRegistry:
    return zoo_registry


def _expressible(
    layout: kvcore.KVCacheLayout, groups: list[kvcore.KVCacheGroupSpec]
) -> bool:
    # The rule, restated: mixed page sizes need a block-compact layout, and a
    # layer-outer one only when there is a single group.
    pages = {g.layer_spec(n).page_size_bytes for g in groups for n in g.layer_names}
    if len(pages) == 1:
        return True
    return layout.is_block_compact and (not layout.is_layer_compact or len(groups) == 1)


def test_zoo_ships_the_reference_models() -> None:
    assert "deepseek-v4-flash" in zoo.names()
    assert len(zoo.names()) >= 9


@pytest.mark.parametrize("name", zoo.names())
@pytest.mark.parametrize("layout", list(kvcore.KVCacheLayout), ids=lambda x: x.name)
def test_model_plans_for_every_expressible_layout(
    name: str, layout: kvcore.KVCacheLayout, registry: kvcore.KindRegistry
) -> None:
    model = load_model_file(zoo.path(name), registry)
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout=layout, enable_prefix_caching=True
        )
    )
    # Group in a block-outer layout (grouping does not depend on which one),
    # then ask whether this layout can hold the groups.
    packing = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(kv_cache_layout="BLHNC")
    )
    groups = kvcore.get_kv_cache_groups(packing, model.layers, registry=registry)
    assert sorted(n for g in groups for n in g.layer_names) == sorted(model.layers)
    if not _expressible(layout, groups):
        with pytest.raises(kvcore.LayoutError, match="cannot express"):
            kvcore.get_kv_cache_config_from_groups(config, groups, 2**30)
        return
    groups = kvcore.get_kv_cache_groups(config, model.layers, registry=registry)
    bpb = kvcore.kv_cache_bytes_per_block(groups, layout)
    plan = kvcore.get_kv_cache_config_from_groups(config, groups, 3 * bpb)
    assert plan.num_blocks == 3
    # Every group fits one block.
    assert max(g.packed_bytes for g in groups) <= plan.bytes_per_block
    pool = kvcore.KVCachePool(plan, "cpu", registry=registry)
    assert set(pool.views) == set(model.layers)
    storage = pool.buffer.untyped_storage().data_ptr()
    for view in pool.views.values():
        for tensor in view if isinstance(view, tuple) else (view,):
            assert tensor.untyped_storage().data_ptr() == storage
            assert tensor.shape[0] == plan.num_blocks
    kvcore.resolve_kv_cache_block_sizes(plan, config)


@pytest.mark.parametrize("name", zoo.names())
def test_model_file_round_trips(name: str, registry: kvcore.KindRegistry) -> None:
    from kvcore.serialize import make_converter

    model = load_model_file(zoo.path(name), registry)
    converter = make_converter(registry)
    for spec in model.layers.values():
        assert converter.structure_spec(converter.unstructure(spec)) == spec


def test_unknown_model_name_lists_known_ones() -> None:
    with pytest.raises(kvcore.KvcoreKeyError, match="deepseek-v4-flash"):
        zoo.path("no-such-model")
