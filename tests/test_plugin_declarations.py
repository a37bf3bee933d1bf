"""A kind's planning declarations cross into the planner checked: code that
raises is its plugin's failure, an answer out of range is refused as its
plugin's, never a bare exception or a wrong plan."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import pytest
import torch

import kvcore
from kvcore import AttentionKind, AttentionSpec, KindRegistry, hookimpl
from kvcore.coordinator.managers import PrefixManager
from kvcore.errors import PluginError, PluginResultError
from kvcore_full_attention import FullAttentionSpec


def _raise(*args: object) -> Any:
    raise ZeroDivisionError("plugin bug")


def _plan(body: dict[str, Any]) -> None:
    """Plan two layers of a kind overriding ``body`` beside a built-in one."""
    ns = {"__annotations__": {"kind": ClassVar[str]}, "kind": "odd", **body}
    spec_type = attrs.frozen(kw_only=True)(type("OddSpec", (AttentionSpec,), ns))
    kind = type(
        "OddKind",
        (AttentionKind,),
        {"name": "odd", "spec_type": spec_type, "manager_type": PrefixManager},
    )

    class Plugin:
        @hookimpl
        def kvcore_register_kinds(self) -> list[Any]:
            return [kind()]

    pm = kvcore.get_plugin_manager(load_entrypoints=False)
    pm.register(Plugin(), name="odd_plugin")
    registry = KindRegistry.from_plugin_manager(pm)
    spec = spec_type(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16)
    full = FullAttentionSpec(
        block_size=32, num_kv_heads=2, head_size=8, dtype=torch.float16
    )
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout="BLHNC", enable_prefix_caching=True, target_context=512
        ),
        max_model_len=512,
    )
    specs = {"h0": spec, "h1": spec, "f0": full}
    plan = kvcore.plan_kv_cache(config, specs, 2**24, registry=registry)
    kvcore.plan_capacity(plan, 512, specs=specs)


@pytest.mark.parametrize(
    ("body", "what"),
    [
        ({"num_blocks_held": _raise}, "num_blocks_held"),
        ({"skipped_tokens": _raise}, "skipped_tokens"),
        ({"grown": _raise}, "grown"),
        ({"element_size": property(_raise)}, "element_size"),
        ({"stride_alignment": _raise}, "stride_alignment"),
        ({"allows_sub_block_hashing": property(_raise)}, "allows_sub_block_hashing"),
        ({"copies_partial_block_hits": property(_raise)}, "copies_partial_block_hits"),
    ],
)
def test_a_declaration_that_raises_is_its_plugins_failure(
    body: dict[str, Any], what: str
) -> None:
    with pytest.raises(PluginError, match=rf"plugin 'odd_plugin'.*{what}") as info:
        _plan(body)
    assert info.value.plugin_name == "odd_plugin"
    assert isinstance(info.value.__cause__, ZeroDivisionError)


@pytest.mark.parametrize(
    ("body", "rule"),
    [
        ({"num_blocks_held": lambda self, c, n, b: -1}, r"num_blocks_held\(.*-1"),
        (
            {"grown": lambda self, f: self if f == 1 else "x"},
            r"grown\(2\) returned 'x'",
        ),
        ({"element_size": property(lambda self: 0)}, "element_size is 0"),
        ({"max_block_growth": 0}, "max_block_growth is 0"),
        (
            {"skipped_tokens": lambda self, n: -100},
            r"skipped_tokens\(0\) returned -100",
        ),
        ({"skipped_tokens": lambda self, n: n + 1}, r"skipped_tokens\(0\) returned 1"),
        ({"caches_partial_block_hits": property(lambda self: 1)}, "must be True or"),
    ],
)
def test_an_answer_out_of_range_is_refused_naming_the_plugin(
    body: dict[str, Any], rule: str
) -> None:
    with pytest.raises(PluginResultError, match=rule) as info:
        _plan(body)
    assert info.value.plugin_name == "odd_plugin"
    assert "KVCORE_DISABLE_PLUGINS=odd_plugin" in str(info.value)
    assert isinstance(info.value, TypeError)
