"""The disjointness proof: no plan whose pages may share bytes is accepted,
on the planner's own plans in every layout and on configs written by hand.

Soundness is checked against brute force: every byte of every page of
small random configs is enumerated, and any config the proof accepts must
have no two live pages on one byte (two groups may share a block's bytes
only within one block id).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcore import (
    CacheConfig,
    EngineConfig,
    KindRegistry,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCachePool,
    KVCacheTensor,
    plan_kv_cache,
)
from kvcore.config import PACKING_POLICIES
from kvcore.errors import (
    KvcoreError,
    LayoutError,
    PlanError,
    SerializationError,
    UnsafePlanError,
)
from kvcore.plan.validate import check_disjoint, page_strides
from kvcore.plugins import get_plugin_manager
from kvcore.serialize import dump_config, load_config, load_model_file
from kvcore_full_attention import FullAttentionSpec

ZOO = sorted((Path(__file__).parent.parent / "kvcore" / "tools" / "zoo").glob("*.json"))


@pytest.fixture(scope="module")
def registry() -> KindRegistry:
    return KindRegistry.from_plugin_manager(get_plugin_manager(load_entrypoints=False))


def _spec(heads: int = 1, block: int = 2, head_size: int = 2) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block, num_kv_heads=heads, head_size=head_size, dtype=torch.float16
    )


def _config(
    tensors: list[KVCacheTensor],
    groups: list[list[str]],
    specs: list[FullAttentionSpec],
    num_blocks: int,
) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[
            KVCacheGroupSpec(names, spec)
            for names, spec in zip(groups, specs, strict=True)
        ],
    )


def _aliases(config: KVCacheConfig) -> bool:
    """Brute force: whether two pages that may be live at once share a byte."""
    group_of = {
        n: g
        for g, group in enumerate(config.kv_cache_groups)
        for n in group.layer_names
    }
    owner: dict[tuple[bool, int], tuple[int, int, str]] = {}
    for tensor in config.kv_cache_tensors:
        gid = group_of[tensor.layers[0]]
        spec = config.kv_cache_groups[gid].layer_spec(tensor.layers[0])
        sh, sn, sc = page_strides(
            tensor, spec, None, num_blocks=config.num_blocks, bytes_per_block=0
        )
        h, n, c = spec.page_grid
        for (i, name), b in itertools.product(
            enumerate(tensor.layers), range(config.num_blocks)
        ):
            page = {
                tensor.offset
                + i * tensor.layer_stride
                + b * tensor.block_stride
                + x * sh
                + y * sn
                + z * sc
                for x, y, z in itertools.product(range(h), range(n), range(c))
            }
            if len(page) < h * n * c:
                return True  # a page over itself
            for byte in page:
                key = (tensor.host_resident, byte)
                other = owner.get(key)
                if other is not None and not (other[0] != gid and other[1] == b):
                    return True
                owner[key] = (gid, b, name)
    return False


def _accepted(config: KVCacheConfig) -> bool:
    try:
        check_disjoint(config, None)
    except SerializationError:
        return False
    return True


# -- the planner's own plans ----------------------------------------------


def _zoo_plans(
    registry: KindRegistry,
) -> Iterator[tuple[str, KVCacheConfig, KVCacheLayout]]:
    for path in ZOO:
        try:
            model = load_model_file(path, registry)
        except KvcoreError:
            continue  # a kind this registry lacks
        for layout, policy in itertools.product(KVCacheLayout, PACKING_POLICIES):
            engine = EngineConfig(
                cache_config=CacheConfig(
                    kv_cache_layout=layout.name, packing_policy=policy
                )
            )
            try:
                plan = plan_kv_cache(engine, model.layers, 2**30, registry=registry)
            except LayoutError:
                continue  # the layout cannot express the model
            yield f"{path.stem}/{layout.name}/{policy}", plan, layout


def test_every_planned_layout_is_proved_disjoint(registry: KindRegistry) -> None:
    seen = 0
    for name, plan, layout in _zoo_plans(registry):
        check_disjoint(plan, layout)
        again = load_config(dump_config(plan, registry), registry)
        assert again == plan, name
        seen += 1
    assert seen >= 60


# -- hand-written aliasing, in every layout ---------------------------------


def _two_layer_plan(layout: KVCacheLayout, registry: KindRegistry) -> KVCacheConfig:
    specs = {f"l.{i}": _spec(heads=2) for i in range(2)}
    engine = EngineConfig(cache_config=CacheConfig(kv_cache_layout=layout.name))
    return plan_kv_cache(engine, specs, 2**16, registry=registry)


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
@pytest.mark.parametrize(
    "change",
    ["layer_stride=0", "layer_stride=halved", "block_stride=halved", "block_stride=0"],
)
def test_one_tensor_aliasing_is_refused_in_every_layout(
    layout: KVCacheLayout, change: str, registry: KindRegistry
) -> None:
    plan = _two_layer_plan(layout, registry)
    assert len(plan.kv_cache_tensors) == 1
    tensor = plan.kv_cache_tensors[0]
    field, value = change.split("=")
    new = 0 if value == "0" else getattr(tensor, field) // 2
    bad = attrs.evolve(plan, kv_cache_tensors=[attrs.evolve(tensor, **{field: new})])
    assert _aliases(bad) is True
    with pytest.raises(SerializationError, match=r"overlap|share bytes"):
        load_config(dump_config(bad, registry), registry)


def test_a_layer_listed_twice_and_a_shifted_group_are_refused(
    registry: KindRegistry,
) -> None:
    plan = _two_layer_plan(KVCacheLayout.BLHNC, registry)
    tensor = plan.kv_cache_tensors[0]
    # A second group's tensor one block off: its block b is this group's
    # block b + 1, which another request may hold.
    other = _spec(heads=2)
    shifted = attrs.evolve(
        plan,
        kv_cache_groups=[*plan.kv_cache_groups, KVCacheGroupSpec(["m.0"], other)],
        kv_cache_tensors=[
            tensor,
            attrs.evolve(tensor, layers=["m.0"], offset=tensor.block_stride),
        ],
    )
    assert _aliases(shifted) is True
    with pytest.raises(SerializationError, match="only within one block id"):
        check_disjoint(shifted, KVCacheLayout.BLHNC)
    # The same group overlaid exactly (same offset) is the planner's overlay.
    overlaid = attrs.evolve(
        shifted,
        kv_cache_tensors=[tensor, attrs.evolve(tensor, layers=["m.0"], offset=0)],
    )
    assert _aliases(overlaid) is False
    check_disjoint(overlaid, KVCacheLayout.BLHNC)


# -- soundness against brute force -----------------------------------------


@st.composite
def _configs(draw: st.DrawFn) -> KVCacheConfig:
    num_blocks = draw(st.integers(1, 4))
    num_groups = draw(st.integers(1, 2))
    specs = [
        _spec(
            heads=draw(st.integers(1, 2)),
            block=draw(st.integers(1, 2)),
            head_size=draw(st.integers(1, 2)),
        )
        for _ in range(num_groups)
    ]
    groups: list[list[str]] = []
    tensors: list[KVCacheTensor] = []
    dense = draw(st.booleans())
    for g, spec in enumerate(specs):
        h, n, c = spec.page_grid
        names = [f"g{g}.{i}" for i in range(draw(st.integers(1, 3)))]
        groups.append(names)
        runs = draw(st.integers(1, len(names)))
        cuts = [
            0,
            *sorted(
                draw(st.sets(st.integers(1, len(names) - 1), max_size=runs - 1))
                if len(names) > 1
                else []
            ),
            len(names),
        ]
        for lo, hi in itertools.pairwise(cuts):
            if lo == hi:
                continue
            page = h * n * c
            if dense:
                strides = (n * c, c, 1)
                layer_stride = draw(st.sampled_from([page, page // 2, 0, 2 * page]))
                block_stride = draw(
                    st.sampled_from([page * 3, page * 6, page, page // 2, 0])
                )
                offset = draw(st.sampled_from([0, page, 2 * page, page // 2, 3 * page]))
            else:
                strides = (
                    draw(st.integers(0, 24)),
                    draw(st.integers(0, 12)),
                    draw(st.integers(0, 2)),
                )
                layer_stride = draw(st.integers(0, 64))
                block_stride = draw(st.integers(0, 96))
                offset = draw(st.integers(0, 96))
            tensors.append(
                KVCacheTensor(
                    size=10**6,
                    layers=names[lo:hi],
                    layer_stride=layer_stride,
                    block_stride=block_stride,
                    offset=offset,
                    page_strides=strides,
                )
            )
    return _config(tensors, groups, specs, num_blocks)


@settings(
    max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(_configs())
def test_no_accepted_config_aliases(config: KVCacheConfig) -> None:
    if _accepted(config):
        assert not _aliases(config)


@pytest.mark.slow
@settings(
    max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(_configs())
def test_no_accepted_config_aliases_long_run(config: KVCacheConfig) -> None:
    if _accepted(config):
        assert not _aliases(config)


def test_the_fuzzer_reaches_both_answers() -> None:
    """The strategy draws configs the proof accepts and ones it refuses."""
    answers: set[bool] = set()

    @settings(max_examples=300, deadline=None, database=None)
    @given(_configs())
    def collect(config: KVCacheConfig) -> None:
        answers.add(_accepted(config))

    collect()
    assert answers == {True, False}


@pytest.mark.parametrize("field", ["layer_stride", "block_stride", "offset", "size"])
def test_byte_figures_past_what_torch_addresses_are_refused(
    field: str, registry: KindRegistry
) -> None:
    """A one-layer tensor's layer stride never moves a byte, yet torch must
    take it as a signed 64-bit int: 2**63 is refused by the checks, not by
    torch.as_strided deep inside the pool."""
    plan = _two_layer_plan(KVCacheLayout.BLHNC, registry)
    tensor = plan.kv_cache_tensors[0]
    bad = attrs.evolve(
        plan,
        kv_cache_tensors=[
            attrs.evolve(tensor, layers=["l.0"]),
            attrs.evolve(tensor, layers=["l.1"], **{field: 2**63}),
        ],
    )
    with pytest.raises(
        UnsafePlanError, match=rf"\.{field} is 9,223,372,036,854,775,808"
    ):
        load_config(dump_config(bad, registry), registry)
    # The pool refuses it too (sizes first: they must agree).
    with pytest.raises(PlanError, match=r"9,223|9223"):
        KVCachePool(bad, "cpu", registry=registry)
