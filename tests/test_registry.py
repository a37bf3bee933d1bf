"""The plugin manager and the kind registry: built-ins, duplicates, unknown
kinds, failing plugins, entry-point loading from a fake distribution, the
environment switches and the planning hooks.

Every test builds its own plugin manager; none touches
``kvcore.default_registry()``.  The tests pass whether or not kvcore is
pip-installed (built-ins then come from kvcore's own entry points instead of
``BUILTIN_PLUGINS``).
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pluggy
import pytest
import torch

import kvcore
from kvcore import (
    CacheConfig,
    CacheKind,
    DuplicateKindError,
    EngineConfig,
    KindRegistry,
    KVCacheGroupSpec,
    KVCacheSpec,
    PlanError,
    PluginError,
    UnknownKindError,
    hookimpl,
    hookspecs,
)
from kvcore.kinds import AttentionKind
from kvcore.plugins import plugin_distribution
from kvcore.spec import AttentionSpec
from kvcore_full_attention import FullAttention, FullAttentionSpec
from kvcore_mamba import MambaSpec

BUILTIN_KINDS = {
    "full_attention",
    "mla",
    "sliding_window",
    "sliding_window_mla",
    "mamba",
    "circular_buffer",
    "hisparse_hot",
    "chunked_local_attention",
    "cross_attention",
}
ENV_VARS = (
    "KVCORE_DISABLE_PLUGINS",
    "KVCORE_DISABLE_PLUGIN_AUTOLOAD",
    "KVCORE_OVERRIDE_KINDS",
    "KVCORE_PLUGINS",
    "KVCORE_TRACE_PLUGINS",
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def pm(clean_env: None) -> pluggy.PluginManager:
    """A fresh manager with only kvcore's built-in kinds."""
    return kvcore.get_plugin_manager(load_entrypoints=False)


def _full(block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.float16
    )


# ---------------------------------------------------------------------------
# A fake installed distribution
# ---------------------------------------------------------------------------

DIST = "fake-kvcore-plugin"

GOOD_PLUGIN = """
from typing import ClassVar

import attrs

from kvcore import hookimpl
from kvcore.kinds import AttentionKind
from kvcore.spec import AttentionSpec


@attrs.frozen(kw_only=True)
class DemoSpec(AttentionSpec):
    kind: ClassVar[str] = "demo_kind"


class DemoKind(AttentionKind):
    name: ClassVar[str] = "demo_kind"
    spec_type = DemoSpec


@hookimpl
def kvcore_register_kinds():
    return [DemoKind()]
"""

RAISES_ON_IMPORT = """
raise RuntimeError("fake plugin exploded on import")
"""

UNKNOWN_HOOK = """
from kvcore import hookimpl


@hookimpl
def kvcore_not_a_hook():
    return None
"""

BAD_HOOK_ARGUMENT = """
from kvcore import hookimpl


@hookimpl
def kvcore_choose_grouping(config, specs, budget):
    return None
"""


@pytest.fixture
def fake_dist(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_env: None
) -> Iterator[Callable[[str, str, str], None]]:
    """Install a fake distribution ``fake-kvcore-plugin 0.1`` whose
    ``[kvcore]`` entry point ``ep_name`` is module ``module``."""
    modules: list[str] = []

    def install(ep_name: str, module: str, source: str) -> None:
        info = tmp_path / "fake_kvcore_plugin-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {DIST}\nVersion: 0.1\n"
        )
        (info / "entry_points.txt").write_text(f"[kvcore]\n{ep_name} = {module}\n")
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        modules.append(module)
        monkeypatch.syspath_prepend(str(tmp_path))
        importlib.invalidate_caches()
        # Only kvcore's own entry points and this one: whatever else is
        # installed (the example plugin, say) is not under test.
        everything = kvcore.plugins._entry_points
        monkeypatch.setattr(
            kvcore.plugins,
            "_entry_points",
            lambda: [
                ep
                for ep in everything()
                if ep.dist is not None and ep.dist.name in {"kvcore", DIST}
            ],
        )

    yield install
    for module in modules:
        sys.modules.pop(module, None)
    importlib.invalidate_caches()


# ---------------------------------------------------------------------------
# Built-ins
# ---------------------------------------------------------------------------


def test_registry_has_exactly_the_builtin_kinds(pm: pluggy.PluginManager) -> None:
    registry = KindRegistry.from_plugin_manager(pm)
    assert set(registry) == BUILTIN_KINDS
    assert len(registry) == 9


@pytest.mark.parametrize(
    ("kind", "plugin"),
    [
        ("full_attention", "full_attention"),
        ("mla", "mla"),
        ("sliding_window", "sliding_window"),
        # one plugin registers both sliding-window kinds
        ("sliding_window_mla", "sliding_window"),
        ("mamba", "mamba"),
        ("circular_buffer", "circular_buffer"),
        ("hisparse_hot", "hisparse"),
        ("chunked_local_attention", "chunked_local"),
        ("cross_attention", "cross_attention"),
    ],
)
def test_owner_of_builtin_kinds(
    pm: pluggy.PluginManager, kind: str, plugin: str
) -> None:
    registry = KindRegistry.from_plugin_manager(pm)
    assert registry.owner(kind) == plugin
    assert registry[kind].name == kind
    assert registry[kind].spec_type.kind == kind


def test_get_plugin_manager_is_fresh_each_call(clean_env: None) -> None:
    a = kvcore.get_plugin_manager(load_entrypoints=False)
    b = kvcore.get_plugin_manager(load_entrypoints=False)
    assert a is not b
    assert a.get_plugin("mla") is not None
    assert a.get_plugin("mla") is b.get_plugin("mla")  # the same module object


def test_builtins_can_be_left_out(clean_env: None) -> None:
    pm = kvcore.get_plugin_manager(load_entrypoints=False, builtins=False)
    assert len(KindRegistry.from_plugin_manager(pm)) == 0


# ---------------------------------------------------------------------------
# Duplicates, unknown kinds, failing plugins
# ---------------------------------------------------------------------------


def test_duplicate_kind_names_both_plugins_builtin_first(
    pm: pluggy.PluginManager,
) -> None:
    class P:
        @hookimpl
        def kvcore_register_kinds(self) -> list[CacheKind]:
            return [FullAttention()]

    pm.register(P(), name="kvcore-dup-test")
    with pytest.raises(
        DuplicateKindError,
        match=r"by plugin 'full_attention' \(.*\) and by plugin 'kvcore-dup-test'",
    ) as info:
        KindRegistry.from_plugin_manager(pm)
    err = info.value
    assert isinstance(err, ValueError)
    assert (err.kind, err.first, err.second) == (
        "full_attention",
        "full_attention",
        "kvcore-dup-test",
    )
    assert "KVCORE_DISABLE_PLUGINS=kvcore-dup-test" in str(err)


def test_unknown_kind_lists_known_kinds(pm: pluggy.PluginManager) -> None:
    registry = KindRegistry.from_plugin_manager(pm)
    with pytest.raises(
        UnknownKindError, match="no cache kind named 'chunked_local'"
    ) as info:
        registry["chunked_local"]
    err = info.value
    assert isinstance(err, KeyError)
    assert err.kind == "chunked_local"
    # the known kinds, sorted, in the message
    assert ", ".join(sorted(BUILTIN_KINDS)) in str(err)
    # the Mapping contract survives the custom KeyError
    assert "chunked_local" not in registry
    assert registry.get("chunked_local") is None


def test_kind_for_an_unregistered_spec_class_names_the_layer(
    pm: pluggy.PluginManager,
) -> None:
    @attrs.frozen(kw_only=True)
    class ChunkedLocalSpec(FullAttentionSpec):
        kind: ClassVar[str] = "chunked_local"

    spec = ChunkedLocalSpec(
        block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    registry = KindRegistry.from_plugin_manager(pm)
    with pytest.raises(
        UnknownKindError, match=r"layer 'model\.layers\.3\.attn'"
    ) as info:
        registry.kind_for(spec, layer="model.layers.3.attn")
    assert info.value.kind == "chunked_local"
    assert "ChunkedLocalSpec" in str(info.value)
    # the exact class counts: a subclass does not borrow its parent's kind
    assert registry.kind_for(_full()) is registry["full_attention"]
    # planning reports the same layer
    with pytest.raises(UnknownKindError, match=r"layer 'local\.0'"):
        kvcore.get_kv_cache_groups(
            EngineConfig(), {"full.0": _full(), "local.0": spec}, registry=registry
        )


def test_kind_for_a_non_spec_object(pm: pluggy.PluginManager) -> None:
    registry = KindRegistry.from_plugin_manager(pm)
    with pytest.raises(UnknownKindError, match="not a kvcore KVCacheSpec"):
        registry.kind_for({"block_size": 16}, layer="x")


def test_plugin_raising_in_register_kinds_is_named(pm: pluggy.PluginManager) -> None:
    class Broken:
        @hookimpl
        def kvcore_register_kinds(self) -> list[CacheKind]:
            raise RuntimeError("boom")

    pm.register(Broken(), name="kvcore-broken-test")
    with pytest.raises(PluginError, match=r"'kvcore-broken-test'.*boom") as info:
        KindRegistry.from_plugin_manager(pm)
    assert info.value.plugin_name == "kvcore-broken-test"
    assert isinstance(info.value.__cause__, RuntimeError)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("returned", "match"),
    [
        pytest.param(["not a kind"], "not a kvcore.kinds.CacheKind", id="not-a-kind"),
        pytest.param("mismatched", "kind tag is 'full_attention'", id="tag-mismatch"),
    ],
)
def test_plugin_returning_bad_kinds_is_named(
    pm: pluggy.PluginManager, returned: object, match: str
) -> None:
    class Mislabelled(CacheKind):
        name: ClassVar[str] = "mislabelled"
        spec_type = FullAttentionSpec  # whose kind tag is "full_attention"

    class Bad:
        @hookimpl
        def kvcore_register_kinds(self) -> object:
            return [Mislabelled()] if returned == "mismatched" else returned

    pm.register(Bad(), name="kvcore-bad-test")
    with pytest.raises(PluginError, match=match) as info:
        KindRegistry.from_plugin_manager(pm)
    assert info.value.plugin_name == "kvcore-bad-test"
    assert "'kvcore-bad-test'" in str(info.value)


# ---------------------------------------------------------------------------
# Entry points from a fake distribution
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "match"),
    [
        pytest.param(
            RAISES_ON_IMPORT,
            "failed to import: RuntimeError: fake plugin exploded on import",
            id="raises-on-import",
        ),
        pytest.param(UNKNOWN_HOOK, "kvcore_not_a_hook", id="unknown-hook"),
        pytest.param(BAD_HOOK_ARGUMENT, "'budget'", id="bad-hook-argument"),
    ],
)
def test_broken_entry_point_is_named_with_its_distribution(
    fake_dist: Callable[[str, str, str], None], source: str, match: str
) -> None:
    """Style §F: name the plugin and its distribution, and give the fix."""
    fake_dist("fake_broken", "fake_kvcore_broken", source)
    with pytest.raises(PluginError, match=match) as info:
        kvcore.get_plugin_manager()
    err = info.value
    assert isinstance(err, ValueError)
    assert err.plugin_name == "fake_broken"
    assert "'fake_broken'" in str(err)
    assert err.distribution == DIST
    assert f"(distribution '{DIST}')" in str(err)
    assert "KVCORE_DISABLE_PLUGINS=fake_broken" in str(err)


def test_broken_entry_point_can_be_blocked(
    fake_dist: Callable[[str, str, str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_dist("fake_broken", "fake_kvcore_broken", RAISES_ON_IMPORT)
    monkeypatch.setenv("KVCORE_DISABLE_PLUGINS", "fake_broken")
    pm = kvcore.get_plugin_manager()
    assert pm.is_blocked("fake_broken")
    assert set(KindRegistry.from_plugin_manager(pm)) == BUILTIN_KINDS


def test_broken_entry_point_is_not_imported_without_autoload(
    fake_dist: Callable[[str, str, str], None],
) -> None:
    fake_dist("fake_broken", "fake_kvcore_broken", RAISES_ON_IMPORT)
    pm = kvcore.get_plugin_manager(load_entrypoints=False)
    assert set(KindRegistry.from_plugin_manager(pm)) == BUILTIN_KINDS
    assert "fake_kvcore_broken" not in sys.modules


def test_third_party_distribution_is_loaded(
    fake_dist: Callable[[str, str, str], None],
) -> None:
    fake_dist("fake_demo", "fake_kvcore_demo", GOOD_PLUGIN)
    pm = kvcore.get_plugin_manager()
    assert pm.get_plugin("fake_demo") is sys.modules["fake_kvcore_demo"]
    registry = KindRegistry.from_plugin_manager(pm)
    assert set(registry) == BUILTIN_KINDS | {"demo_kind"}
    assert registry.owner("demo_kind") == "fake_demo"
    assert plugin_distribution(pm, "fake_demo") == f"{DIST} 0.1"

    # The new kind plans and binds like a built-in one.
    demo_spec = registry["demo_kind"].spec_type(
        block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    # C = (8+8)*2 = 32, N = 16 -> 512 B per page
    assert demo_spec.page_size_bytes == 512
    config = EngineConfig(cache_config=CacheConfig(kv_cache_layout="BLHNC"))
    groups = kvcore.get_kv_cache_groups(
        config, {"demo.0": demo_spec, "demo.1": demo_spec}, registry=registry
    )
    assert [g.layer_names for g in groups] == [["demo.0", "demo.1"]]
    # 2 * 512 B per block, 4 blocks
    plan = kvcore.get_kv_cache_config_from_groups(config, groups, 4 * 1024)
    pool = kvcore.KVCachePool(plan, registry=registry)
    assert pool.views["demo.0"].shape == (4, 1, 16, 16)  # type: ignore[union-attr]


def test_third_party_distribution_not_loaded_with_autoload_disabled(
    fake_dist: Callable[[str, str, str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_dist("fake_demo", "fake_kvcore_demo", GOOD_PLUGIN)
    monkeypatch.setenv("KVCORE_DISABLE_PLUGIN_AUTOLOAD", "1")
    pm = kvcore.get_plugin_manager()
    assert pm.get_plugin("fake_demo") is None
    assert "fake_kvcore_demo" not in sys.modules
    # the built-ins still load
    assert set(KindRegistry.from_plugin_manager(pm)) == BUILTIN_KINDS
    # an explicit request overrides the environment
    pm = kvcore.get_plugin_manager(load_entrypoints=True)
    assert "demo_kind" in KindRegistry.from_plugin_manager(pm)


# ---------------------------------------------------------------------------
# Blocking
# ---------------------------------------------------------------------------


def test_disable_plugins_blocks_mamba(
    clean_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCORE_DISABLE_PLUGINS", "mamba")
    pm = kvcore.get_plugin_manager(load_entrypoints=False)
    assert pm.is_blocked("mamba")
    registry = KindRegistry.from_plugin_manager(pm)
    assert set(registry) == BUILTIN_KINDS - {"mamba"}
    with pytest.raises(UnknownKindError, match="no cache kind named 'mamba'"):
        registry["mamba"]
    ssm = MambaSpec(block_size=16, shapes=((32,),), dtypes=(torch.bfloat16,))
    with pytest.raises(UnknownKindError, match=r"layer 'ssm\.0'"):
        kvcore.get_kv_cache_groups(EngineConfig(), {"ssm.0": ssm}, registry=registry)


def test_disable_plugins_takes_a_list(
    clean_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCORE_DISABLE_PLUGINS", " mamba , hisparse,")
    pm = kvcore.get_plugin_manager(load_entrypoints=False, block=["mla"])
    registry = KindRegistry.from_plugin_manager(pm)
    assert set(registry) == BUILTIN_KINDS - {"mamba", "hisparse_hot", "mla"}


# ---------------------------------------------------------------------------
# Hooks
# ---------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class _DemoSpec(AttentionSpec):
    kind: ClassVar[str] = "demo_inline"


class _DemoKind(AttentionKind):
    name: ClassVar[str] = "demo_inline"
    spec_type = _DemoSpec


def test_hook_kvcore_register_kinds(pm: pluggy.PluginManager) -> None:
    """The hook collects kinds from every plugin; an empty list adds none."""

    class Demo:
        @hookimpl
        def kvcore_register_kinds(self) -> list[CacheKind]:
            return [_DemoKind()]

    class Nothing:
        @hookimpl
        def kvcore_register_kinds(self) -> list[CacheKind]:
            return []

    pm.register(Demo(), name="kvcore-demo-test")
    pm.register(Nothing(), name="kvcore-nothing-test")
    registry = KindRegistry.from_plugin_manager(pm)
    assert set(registry) == BUILTIN_KINDS | {"demo_inline"}
    assert registry.owner("demo_inline") == "kvcore-demo-test"
    spec = _DemoSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16)
    assert isinstance(registry.kind_for(spec), _DemoKind)


def test_hook_kvcore_register_model_mappers(pm: pluggy.PluginManager) -> None:
    """The hook collects mappers from every plugin, later plugins first; a
    ``None`` answer adds none."""
    from kvcore_hf.mapping import MapperRegistry, ModelMapper

    class DemoMapper(ModelMapper):
        name = "demo-mapper"
        architectures = ("DemoForCausalLM",)

    class Demo:
        @hookimpl
        def kvcore_register_model_mappers(self) -> list[ModelMapper]:
            return [DemoMapper()]

    class Nothing:
        @hookimpl
        def kvcore_register_model_mappers(self) -> None:
            return None

    pm.register(Demo(), name="kvcore-demo-mappers")
    pm.register(Nothing(), name="kvcore-no-mappers")
    mappers = MapperRegistry.from_plugin_manager(pm)
    first = next(iter(mappers))
    assert first.name == "demo-mapper"
    assert mappers.owner(first) == "kvcore-demo-mappers"
    assert "llama" in {m.name for m in mappers}


def _four_layers() -> dict[str, KVCacheSpec]:
    return {f"l.{i}": _full() for i in range(4)}


class _Grouping:
    """A kvcore_choose_grouping plugin returning a fixed answer."""

    def __init__(self, answer: Callable[[], list[KVCacheGroupSpec] | None]) -> None:
        self.answer = answer
        self.calls: list[tuple[EngineConfig, Mapping[str, KVCacheSpec]]] = []

    @hookimpl
    def kvcore_choose_grouping(
        self, config: EngineConfig, specs: Mapping[str, KVCacheSpec]
    ) -> list[KVCacheGroupSpec] | None:
        self.calls.append((config, specs))
        return self.answer()


def test_hook_kvcore_read_model(pm: pluggy.PluginManager) -> None:
    """kvcore_hf reads a config.json (never the hub for a path); a later
    plugin is asked first; a source no plugin takes is None."""
    from kvcore.serialize import ModelFile
    from kvcore.serving import ServingChoices

    registry = KindRegistry.from_plugin_manager(pm)
    choices = ServingChoices()
    fixture = Path(__file__).parent / "fixtures" / "hf" / "llama-3-1-8b"
    model = pm.hook.kvcore_read_model(
        source=str(fixture), choices=choices, registry=registry, allow_hub=False
    )
    assert isinstance(model, ModelFile)
    assert len(model.layers) == 32
    assert "llama" in model.notes
    # Not a path, not a hub id: kvcore_hf declines.
    assert (
        pm.hook.kvcore_read_model(
            source="not a hub id", choices=choices, registry=registry, allow_hub=True
        )
        is None
    )

    class Demo:
        @hookimpl
        def kvcore_read_model(
            self, source: str, choices: Any, registry: Any, allow_hub: bool
        ) -> ModelFile | None:
            if not source.startswith("demo:"):
                return None
            return ModelFile(name=source, layers={"l.0": _full()})

    pm.register(Demo(), name="kvcore-demo-reader")
    got = pm.hook.kvcore_read_model(
        source="demo:x", choices=choices, registry=registry, allow_hub=True
    )
    assert got == ModelFile(name="demo:x", layers={"l.0": _full()})
    again = pm.hook.kvcore_read_model(
        source=str(fixture), choices=choices, registry=registry, allow_hub=False
    )
    assert again == model


def test_hook_kvcore_choose_grouping(pm: pluggy.PluginManager) -> None:
    """A plugin's grouping replaces kvcore's (which would be one group)."""
    specs = _four_layers()
    config = EngineConfig(cache_config=CacheConfig(kv_cache_layout="BLHNC"))
    default = kvcore.get_kv_cache_groups(
        config, specs, registry=KindRegistry.from_plugin_manager(pm)
    )
    assert [g.layer_names for g in default] == [["l.0", "l.1", "l.2", "l.3"]]

    chosen = [
        KVCacheGroupSpec(["l.0", "l.2"], _full()),
        KVCacheGroupSpec(["l.1", "l.3"], _full()),
    ]
    plugin = _Grouping(lambda: chosen)
    pm.register(plugin, name="kvcore-grouping-test")
    registry = KindRegistry.from_plugin_manager(pm)
    groups = kvcore.get_kv_cache_groups(config, specs, registry=registry)
    assert groups is chosen
    assert len(plugin.calls) == 1
    called_config, called_specs = plugin.calls[0]
    assert called_config is config
    assert dict(called_specs) == specs


def test_hook_kvcore_engine_estimate(pm: pluggy.PluginManager) -> None:
    """A plugin answers for the engine policies it models; the built-in
    ``kvcore_vllm`` answers ``vllm``; nobody answers an unknown name."""
    from kvcore.engines import EngineEstimate, EngineFigure

    class Other:
        @kvcore.hookimpl
        def kvcore_engine_estimate(
            self,
            policy: str,
            config: Any,
            specs: Any,
            available_memory: int,
            contexts: Any,
        ) -> EngineEstimate | None:
            if policy != "other":
                return None
            return EngineEstimate(
                "other",
                "Other 1.0",
                figures=tuple(EngineFigure(c, available_memory, 1.0) for c in contexts),
            )

    pm.register(Other(), name="kvcore-engine-test")
    registry = KindRegistry.from_plugin_manager(pm)
    specs = _four_layers()
    other = registry.engine_estimate("other", EngineConfig(), specs, 1 << 30, [4096])
    assert other is not None
    assert other.figures == (EngineFigure(4096, 1 << 30, 1.0),)
    vllm = registry.engine_estimate("vllm", EngineConfig(), specs, 1 << 30, [4096])
    assert vllm is not None
    assert vllm.engine == "vLLM 0.33"
    # Four 2-head x 64 fp16 layers of 16-token pages (8 KiB each): 32 KiB a
    # block, 32,768 blocks, 256 blocks a request.
    assert vllm.figures[0].concurrency == 128.0
    assert vllm.figures[0].tokens == 128 * 4096
    assert registry.engine_estimate("none", EngineConfig(), specs, 1, [1]) is None


def test_choose_grouping_none_defers_to_kvcore(pm: pluggy.PluginManager) -> None:
    plugin = _Grouping(lambda: None)
    pm.register(plugin, name="kvcore-grouping-test")
    registry = KindRegistry.from_plugin_manager(pm)
    groups = kvcore.get_kv_cache_groups(
        EngineConfig(), _four_layers(), registry=registry
    )
    assert [g.layer_names for g in groups] == [["l.0", "l.1", "l.2", "l.3"]]
    assert len(plugin.calls) == 1


def test_choose_grouping_is_not_asked_without_a_plugin_manager() -> None:
    registry = KindRegistry.from_kinds([FullAttention()])
    assert registry.choose_grouping(EngineConfig(), _four_layers()) is None


@pytest.mark.parametrize(
    ("groups", "match"),
    [
        pytest.param(
            [KVCacheGroupSpec(["l.0", "l.1", "l.2"], _full())],
            r"missing: \['l.3'\]",
            id="misses-a-layer",
        ),
        pytest.param(
            [
                KVCacheGroupSpec(["l.0", "l.1"], _full()),
                KVCacheGroupSpec(["l.1", "l.2", "l.3"], _full()),
            ],
            "layer 'l.1' in groups 0 and 1",
            id="layer-twice",
        ),
        pytest.param(
            [KVCacheGroupSpec(["l.0", "l.1", "l.2", "l.3", "l.9"], _full())],
            r"unknown: \['l.9'\]",
            id="unknown-layer",
        ),
    ],
)
def test_choose_grouping_must_cover_every_layer_once(
    pm: pluggy.PluginManager, groups: list[KVCacheGroupSpec], match: str
) -> None:
    pm.register(_Grouping(lambda: groups), name="kvcore-grouping-test")
    registry = KindRegistry.from_plugin_manager(pm)
    with pytest.raises(PlanError, match=match):
        kvcore.get_kv_cache_groups(EngineConfig(), _four_layers(), registry=registry)


def _hook_names() -> list[str]:
    return sorted(n for n in dir(hookspecs) if n.startswith("kvcore_"))


def test_every_hook_has_a_test() -> None:
    hooks = _hook_names()
    assert hooks, "kvcore.hookspecs defines no kvcore_* hooks"
    module: dict[str, Any] = globals()
    missing = [h for h in hooks if not callable(module.get(f"test_hook_{h}"))]
    assert not missing, f"hooks without a test_hook_<name> test: {missing}"


def test_every_hookspec_is_on_the_manager(pm: pluggy.PluginManager) -> None:
    on_pm = sorted(n for n in dir(pm.hook) if n.startswith("kvcore_"))
    assert on_pm == _hook_names()


def test_a_third_party_mapper_arrives_through_an_entry_point(
    fake_dist: Callable[[str, str, str], None],
) -> None:
    """An installed distribution's mapper is found by kvcore's default
    mapper lookup and maps an architecture kvcore does not know."""
    from kvcore_hf.mapping import default_mappers, map_model_config

    fake_dist(
        "my_lm",
        "fake_kvcore_mapper",
        """
        import torch
        from kvcore import hookimpl
        from kvcore_hf.mapping import ModelMapper
        from kvcore_full_attention import FullAttentionSpec

        class MyLM(ModelMapper):
            name = "my-lm"
            architectures = ("MyLMForCausalLM",)

            def layer_specs(self, config, choices):
                spec = FullAttentionSpec(
                    block_size=16,
                    num_kv_heads=config.positive("num_key_value_heads"),
                    head_size=config.positive("head_dim"),
                    dtype=config.model_dtype(),
                )
                n = config.positive("num_hidden_layers")
                return {f"model.layers.{i}.attn": spec for i in range(n)}

        @hookimpl
        def kvcore_register_model_mappers():
            return [MyLM()]
        """,
    )
    mappers = default_mappers()
    mapper = next(iter(mappers))
    assert mapper.name == "my-lm"
    assert mappers.owner(mapper) == "my_lm"
    model = map_model_config(
        {
            "architectures": ["MyLMForCausalLM"],
            "num_key_value_heads": 4,
            "head_dim": 64,
            "num_hidden_layers": 3,
            "torch_dtype": "float16",
        },
        mappers=mappers,
    )
    assert list(model.layers) == [f"model.layers.{i}.attn" for i in range(3)]
    assert model.layers["model.layers.0.attn"].page_size_bytes == 2 * 16 * 4 * 64 * 2


def test_a_built_in_is_not_credited_to_another_distribution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A third party's entry point may reuse a built-in's entry-point name;
    the built-in plugin registered by hand is not credited to it."""
    from kvcore.plugins import plugin_distribution

    info = tmp_path / "evil_kinds-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: evil-kinds\nVersion: 1.0\n"
    )
    (info / "entry_points.txt").write_text("[kvcore]\nmamba = evil_kinds_module\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pm = kvcore.get_plugin_manager(load_entrypoints=False)
    assert plugin_distribution(pm, "mamba") != "evil-kinds 1.0"
