"""Every result crossing from plugin code into the core is checked where it
crosses: a kind name taken from another distribution, what
``kvcore_register_kinds`` returns, spec and manager classes, page sizes,
grouping keys, merges, serving choices and bound views.  Each broken kind of
``tests/broken_kinds.py`` is refused with an error naming its plugin."""

from __future__ import annotations

import copy
import importlib
import json
import os
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import attrs
import coordinator_setup as setup
import numpy as np
import pytest
import torch
from broken_kinds import (
    BadGridKind,
    BadGridSpec,
    BadModeKind,
    BadModeSpec,
    BadPageKind,
    BadPageSpec,
    BinderKind,
    BinderSpec,
    BlockMergeKind,
    BlockMergeSpec,
    DtypesKind,
    DtypesSpec,
    GroupMergeKind,
    GroupMergeSpec,
    ListKeyKind,
    ListKeySpec,
    MistaggedKind,
    MutableKind,
    NotAManagerKind,
    NotAttrsKind,
    OkKind,
    OtherKindMergeKind,
    OtherKindMergeSpec,
    Raising,
    RaisingKeyKind,
    RaisingKeySpec,
    RaisingMergeKind,
    RaisingMergeSpec,
    SmallMergeKind,
    SmallMergeSpec,
    UnstableKeyKind,
    UnstableKeySpec,
    VariantKind,
    VariantSpec,
    plugin_with,
    registry_with,
    sample,
)

import kvcore
from kvcore import DuplicateKindError, KindRegistry, PluginError, UnknownKindError
from kvcore.coordinator import BlockPool, KVCacheManager, Request
from kvcore.errors import PluginBindError, PluginResultError
from kvcore.serving import ServingChoices, apply_serving_choices
from kvcore.spec import KVCacheSpec
from kvcore_full_attention import FullAttention, FullAttentionManager, FullAttentionSpec
from kvcore_mamba import Mamba
from kvcore_sliding_window import (
    SlidingWindow,
    SlidingWindowManager,
    SlidingWindowSpec,
)

HAND = "plugin 'broken' (no distribution: registered by hand or from source)"
BLOCK = "block it with KVCORE_DISABLE_PLUGINS=broken"
CONFIG = kvcore.EngineConfig(cache_config=kvcore.CacheConfig(kv_cache_layout="BLHNC"))


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "KVCORE_DISABLE_PLUGIN_AUTOLOAD",
        "KVCORE_DISABLE_PLUGINS",
        "KVCORE_PLUGINS",
        "KVCORE_OVERRIDE_KINDS",
        "KVCORE_TRACE_PLUGINS",
    ):
        monkeypatch.delenv(name, raising=False)


# ---------------------------------------------------------------------------
# A third party cannot take a built-in kind's name
# ---------------------------------------------------------------------------

IMPOSTOR = """
from typing import ClassVar

import attrs
import torch

from kvcore import AttentionKind, hookimpl
from kvcore.spec import AttentionSpec


@attrs.frozen(kw_only=True)
class ImpostorSpec(AttentionSpec):
    kind: ClassVar[str] = "mamba"


class Impostor(AttentionKind):
    name: ClassVar[str] = "mamba"
    spec_type = ImpostorSpec


@hookimpl
def kvcore_register_kinds():
    return [Impostor()]
"""


@pytest.fixture
def impostor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_env: None
) -> Iterator[str]:
    """A fake distribution ``kvcore-impostor 0.1`` whose ``[kvcore]`` entry
    point is named ``mamba`` and registers its own ``mamba`` kind."""
    info = tmp_path / "kvcore_impostor-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kvcore-impostor\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text("[kvcore]\nmamba = kvcore_impostor\n")
    (tmp_path / "kvcore_impostor.py").write_text(textwrap.dedent(IMPOSTOR))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield "kvcore_impostor"
    sys.modules.pop("kvcore_impostor", None)
    importlib.invalidate_caches()


def _own_distribution() -> str | None:
    pm = kvcore.get_plugin_manager(load_entrypoints=False)
    return kvcore.plugins.plugin_distribution(pm, "mamba")


def test_entry_point_named_like_a_builtin_does_not_replace_it(
    impostor: str,
) -> None:
    pm = kvcore.get_plugin_manager(load_entrypoints=True)
    # both are loaded: the built-in under its name, the impostor qualified
    assert pm.get_plugin("mamba") is importlib.import_module("kvcore_mamba")
    assert pm.get_plugin("mamba@kvcore-impostor") is sys.modules[impostor]
    own = _own_distribution()
    first = (
        f"plugin 'mamba' (distribution {own!r})"
        if own
        else "plugin 'mamba' (no distribution: registered by hand or from source)"
    )
    with pytest.raises(DuplicateKindError) as info:
        KindRegistry.from_plugin_manager(pm)
    assert str(info.value) == (
        f"cache kind 'mamba' is registered twice: by {first} and by plugin "
        "'mamba@kvcore-impostor' (distribution 'kvcore-impostor 0.1'); a plugin "
        "cannot replace another's kind silently. Uninstall or block one "
        "(KVCORE_DISABLE_PLUGINS=mamba@kvcore-impostor), or let the later one "
        "replace the earlier with KVCORE_OVERRIDE_KINDS=mamba"
    )
    assert (info.value.first, info.value.second) == (
        "mamba",
        "mamba@kvcore-impostor",
    )
    assert isinstance(info.value, ValueError)


def test_blocking_the_impostor_by_its_qualified_name_keeps_the_builtin(
    impostor: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCORE_DISABLE_PLUGINS", "mamba@kvcore-impostor")
    registry = KindRegistry.from_plugin_manager(
        kvcore.get_plugin_manager(load_entrypoints=True)
    )
    assert isinstance(registry["mamba"], Mamba)
    assert registry.overridden == {}


def test_override_is_explicit_and_recorded(
    impostor: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCORE_OVERRIDE_KINDS", "mamba")
    registry = KindRegistry.from_plugin_manager(
        kvcore.get_plugin_manager(load_entrypoints=True)
    )
    assert type(registry["mamba"]).__name__ == "Impostor"
    assert registry.owner("mamba") == "mamba@kvcore-impostor"
    assert registry.distribution("mamba") == "kvcore-impostor 0.1"
    replaced, by = registry.overridden["mamba"]
    assert replaced.startswith("plugin 'mamba' (")
    assert by == "plugin 'mamba@kvcore-impostor' (distribution 'kvcore-impostor 0.1')"


def test_override_argument_wins_over_the_environment(
    impostor: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCORE_OVERRIDE_KINDS", "mamba")
    pm = kvcore.get_plugin_manager(load_entrypoints=True)
    with pytest.raises(DuplicateKindError):
        KindRegistry.from_plugin_manager(pm, override=())


def test_override_of_a_kind_nobody_registers_is_refused(clean_env: None) -> None:
    pm = kvcore.get_plugin_manager(load_entrypoints=False)
    with pytest.raises(UnknownKindError) as info:
        KindRegistry.from_plugin_manager(pm, override=["mambaa"])
    assert str(info.value) == (
        "KVCORE_OVERRIDE_KINDS (or override=) names kind(s) ['mambaa'] that no "
        "plugin registers; known kinds: chunked_local_attention, circular_buffer, "
        "cross_attention, full_attention, hisparse_hot, mamba, mla, "
        "sliding_window, sliding_window_mla. Check the spelling"
    )


# ---------------------------------------------------------------------------
# What kvcore_register_kinds returns, and the classes of each kind
# ---------------------------------------------------------------------------


def _list_rule() -> str:
    return (
        "it must return a list of kind objects (kvcore.kinds.CacheKind "
        "instances), e.g. [MyKind()], or [] for none"
    )


@pytest.mark.parametrize(
    ("answer", "shown"),
    [
        (OkKind(), "<cache kind 'ok_kind' (OkSpec)> (OkKind)"),
        ("ok_kind", "'ok_kind' (str)"),
        (7, "7 (int)"),
    ],
)
def test_register_kinds_must_return_a_list(answer: object, shown: str) -> None:
    with pytest.raises(PluginResultError) as info:
        registry_with(plugin_with(answer=answer), "broken")
    assert str(info.value) == (
        f"kvcore {HAND}: kvcore_register_kinds returned {shown}; {_list_rule()}"
    )
    assert isinstance(info.value, TypeError)
    assert info.value.plugin_name == "broken"


def test_register_kinds_returning_none_is_refused() -> None:
    class Nothing:
        @kvcore.hookimpl
        def kvcore_register_kinds(self) -> None:
            return None

    with pytest.raises(PluginResultError) as info:
        registry_with(Nothing(), "broken")
    assert str(info.value) == (
        f"kvcore {HAND}: kvcore_register_kinds returned None (NoneType); {_list_rule()}"
    )


def test_register_kinds_raising_is_wrapped_and_chained() -> None:
    with pytest.raises(PluginError) as info:
        registry_with(Raising(), "broken")
    assert str(info.value) == (
        f"kvcore {HAND} raised in kvcore_register_kinds: RuntimeError: no kinds "
        f"today; {BLOCK}"
    )
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize(
    ("kind", "rule"),
    [
        (
            MistaggedKind(),
            "kind 'mistagged' owns MistaggedSpec, whose kind tag is "
            "'something_else'; set MistaggedSpec.kind = 'mistagged'",
        ),
        (
            NotAttrsKind(),
            "kind 'not_attrs' owns NotAttrsSpec, which is not an attrs class of "
            "its own; decorate it with @attrs.frozen(kw_only=True)",
        ),
        (
            MutableKind(),
            "kind 'mutable' owns MutableSpec, which is not frozen (it sets its "
            "own __setattr__); specs are shared and hashed, so they must be "
            "immutable: decorate it with @attrs.frozen(kw_only=True)",
        ),
        (
            NotAManagerKind(),
            "kind 'ok_kind' has manager_type=<class 'dict'>; it must be a "
            "kvcore.coordinator.SingleTypeManager subclass (or None)",
        ),
    ],
    ids=["mistagged", "not-attrs", "not-frozen", "not-a-manager"],
)
def test_kind_classes_checked_at_registration(kind: object, rule: str) -> None:
    with pytest.raises(PluginResultError) as info:
        registry_with(plugin_with(kind), "broken")
    assert str(info.value) == f"kvcore {HAND}: {rule}; {BLOCK}"


def test_a_kind_object_that_is_not_a_kind() -> None:
    with pytest.raises(PluginResultError, match=r"registered <object object at "):
        registry_with(plugin_with(object()), "broken")


# ---------------------------------------------------------------------------
# Spec answers, checked once as planning starts
# ---------------------------------------------------------------------------


def _plan(kind: object, spec: KVCacheSpec) -> dict[str, Any]:
    registry = registry_with(plugin_with(kind), "broken")
    groups = kvcore.get_kv_cache_groups(
        CONFIG, {"a": spec, "b": spec}, registry=registry
    )
    plan = kvcore.get_kv_cache_config_from_groups(CONFIG, groups, 8 * 1024)
    return dict(kvcore.KVCachePool(plan, "cpu", registry=registry).views)


def _spec_error(kind: str, spec_type: str, rule: str) -> str:
    return (
        f"cache kind {kind!r} ({spec_type}) of {HAND}: {rule}. Fix the plugin, "
        "or block it with KVCORE_DISABLE_PLUGINS=broken"
    )


@pytest.mark.parametrize(
    ("page", "shown"),
    [(0, "0 (int)"), (-64, "-64 (int)"), (3.5, "3.5 (float)"), (True, "True (bool)")],
)
def test_page_size_must_be_a_positive_int(page: object, shown: str) -> None:
    with pytest.raises(PluginResultError) as info:
        _plan(BadPageKind(), sample(BadPageSpec, bad_page=page))
    assert str(info.value) == _spec_error(
        "bad_page",
        "BadPageSpec",
        f"page_size_bytes is {shown}; it must be a positive int number of bytes "
        "(a bool or float is not one)",
    )


@pytest.mark.parametrize(
    ("grid", "rule"),
    [
        (
            (0, 16, 32),
            "page_grid is (0, 16, 32); it must be a tuple of three positive ints",
        ),
        (
            (1, -16, 32),
            "page_grid is (1, -16, 32); it must be a tuple of three positive ints",
        ),
        ((1, 16), "page_grid is (1, 16); it must be a tuple of three positive ints"),
        (
            [1, 16, 32],
            "page_grid is [1, 16, 32]; it must be a tuple of three positive ints",
        ),
        (
            (1, True, 32),
            "page_grid is (1, True, 32); it must be a tuple of three positive ints",
        ),
    ],
)
def test_page_grid_must_be_three_positive_ints_inside_the_page(
    grid: object, rule: str
) -> None:
    with pytest.raises(PluginResultError) as info:
        _plan(BadGridKind(), sample(BadGridSpec, bad_grid=grid))
    assert rule in str(info.value)
    assert "cache kind 'bad_grid' (BadGridSpec)" in str(info.value)


def test_a_page_smaller_than_its_grid_is_refused() -> None:
    spec = sample(BadPageSpec, bad_page=64)
    grid = spec.page_grid
    with pytest.raises(PluginResultError) as info:
        _plan(BadPageKind(), spec)
    assert (
        f"page_grid {grid} holds {grid[0] * grid[1] * grid[2]:,} bytes, more than "
        "its page_size_bytes of 64; the grid must fit in the page"
    ) in str(info.value)


def test_page_size_checked_for_hand_built_groups() -> None:
    registry_with(plugin_with(BadPageKind()), "broken")  # names the plugin
    spec = sample(BadPageSpec, bad_page=-64)
    group = kvcore.KVCacheGroupSpec(["a"], spec)
    with pytest.raises(PluginResultError, match=r"page_size_bytes is -64 \(int\)"):
        kvcore.get_kv_cache_config_from_groups(CONFIG, [group], 8 * 1024)


def test_unhashable_group_key() -> None:
    with pytest.raises(PluginResultError) as info:
        _plan(ListKeyKind(), sample(ListKeySpec))
    assert str(info.value) == _spec_error(
        "list_key",
        "ListKeySpec",
        "what group_key() returned (['list_key', 16]) is unhashable (unhashable "
        "type: 'list'); grouping keys and specs are dict keys, so build them from "
        "tuples, ints, strings and other frozen values",
    )
    assert isinstance(info.value, TypeError)


def test_raising_group_key_is_wrapped() -> None:
    with pytest.raises(PluginError) as info:
        _plan(RaisingKeyKind(), sample(RaisingKeySpec))
    assert str(info.value) == _spec_error(
        "raising_key", "RaisingKeySpec", "group_key() raised RuntimeError: no key"
    )
    assert isinstance(info.value.__cause__, RuntimeError)


def test_merge_returning_another_kind_is_refused() -> None:
    with pytest.raises(PluginResultError) as info:
        _plan(OtherKindMergeKind(), sample(OtherKindMergeSpec))
    message = str(info.value)
    assert message.startswith(
        f"cache kind 'other_merge' (OtherKindMergeSpec) of {HAND}: "
        "OtherKindMergeSpec.merge() of 2 spec(s) returned FullAttentionSpec("
    )
    assert message.endswith(
        "; merge must return an instance of OtherKindMergeSpec (the group's spec, "
        "of the same kind) or raise kvcore.MergeError when the specs do not merge. "
        f"Fix the plugin, or {BLOCK}"
    )


def test_merge_raising_is_wrapped() -> None:
    with pytest.raises(PluginError) as info:
        _plan(RaisingMergeKind(), sample(RaisingMergeSpec))
    assert str(info.value) == _spec_error(
        "raising_merge",
        "RaisingMergeSpec",
        "RaisingMergeSpec.merge() raised TypeError: unsupported operand type(s) "
        "for //: 'RaisingMergeSpec' and 'int'",
    )
    assert isinstance(info.value.__cause__, TypeError)


def _refused(
    kind: object, specs: dict[str, KVCacheSpec], error: type[Exception]
) -> pytest.ExceptionInfo[Exception]:
    """Planning ``specs`` with ``kind`` registered raises ``error``; a plan
    and pool made before with the same registry, and ``specs``, are left as
    they were."""
    registry = registry_with(plugin_with(kind), "broken")
    good = {"x": sample(FullAttentionSpec)}
    groups = kvcore.get_kv_cache_groups(CONFIG, good, registry=registry)
    plan = kvcore.get_kv_cache_config_from_groups(CONFIG, groups, 8 * 1024)
    pool = kvcore.KVCachePool(plan, "cpu", registry=registry)
    view = pool.views["x"]
    assert isinstance(view, torch.Tensor)
    view.fill_(3)
    planned, given = copy.deepcopy(plan), dict(specs)

    def plan_them() -> None:
        groups = kvcore.get_kv_cache_groups(CONFIG, specs, registry=registry)
        kvcore.get_kv_cache_config_from_groups(CONFIG, groups, 8 * 1024)

    with pytest.raises(error) as info:
        plan_them()
    assert plan == planned
    assert pool.views["x"] is view
    assert bool((view == 3).all())
    assert specs == given
    assert all(specs[n] is given[n] for n in given)
    return info


def test_merge_to_a_smaller_page_is_refused() -> None:
    """Layers of a merged group are placed at the merged page: one smaller
    than a member's would give that layer less memory than its page."""
    spec = SmallMergeSpec(
        block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16
    )
    info = _refused(SmallMergeKind(), {"a": spec, "b": spec}, PluginResultError)
    assert str(info.value) == _spec_error(
        "small_merge",
        "SmallMergeSpec",
        "SmallMergeSpec.merge() of 2 spec(s) returned a SmallMergeSpec of "
        "page_size_bytes 512, smaller than a member's 1,024; the group's layers "
        "are placed at the merged page, so merge must return a spec whose page is "
        "at least every member's (or raise kvcore.MergeError)",
    )
    assert isinstance(info.value, TypeError)


def test_merge_to_another_block_size_is_refused() -> None:
    spec = sample(BlockMergeSpec)
    info = _refused(BlockMergeKind(), {"a": spec, "b": spec}, PluginResultError)
    assert str(info.value) == _spec_error(
        "block_merge",
        "BlockMergeSpec",
        "BlockMergeSpec.merge() of 2 spec(s) returned a BlockMergeSpec of "
        "block_size 32, but its members' block size is 16; merge must keep its "
        "members' block size (and raise kvcore.MergeError for members of "
        "different block sizes)",
    )


@pytest.mark.parametrize(
    ("how", "shown"),
    [
        ("counter", r"\('unstable_key', \d+\), then \('unstable_key', \d+\)"),
        ("id", r"\('unstable_key', \d+\), then \('unstable_key', \d+\)"),
        ("drift", r"DriftingHash\(\), then DriftingHash\(\) \(hashes \d+ and \d+\)"),
    ],
    ids=["counter", "id", "drift"],
)
def test_unstable_group_key_is_refused(how: str, shown: str) -> None:
    """A key that changes between calls (or for an equal copy) would split a
    bucket's layers apart later, where no plugin is named."""
    spec = sample(UnstableKeySpec, how=how)
    other = attrs.evolve(sample(FullAttentionSpec), block_size=32)  # two buckets
    info = _refused(UnstableKeyKind(), {"a": spec, "b": spec, "c": other}, TypeError)
    assert isinstance(info.value, PluginResultError)
    assert re.fullmatch(
        re.escape(
            f"cache kind 'unstable_key' (UnstableKeySpec) of {HAND}: group_key() "
            "returned "
        )
        + shown
        + re.escape(
            " for the same spec (asked again, of a copy); the key must be a "
            "deterministic hashable function of the spec's fields, equal with an "
            "equal hash every time (no ids, counters, clocks or random values). "
            f"Fix the plugin, or {BLOCK}"
        ),
        str(info.value),
    )


# ---------------------------------------------------------------------------
# Serving choices, checked as each spec answers one
# ---------------------------------------------------------------------------

FULL_16 = (
    "FullAttentionSpec(block_size=16, block_stride_alignment=None, num_kv_heads=1, "
    "head_size=8, dtype=torch.float16, head_size_v=8, tokens_per_state=1, "
    "alignment=None, page_size_padded=None)"
)
OWN = "(its own: a serving choice changes only what it names)"


@pytest.mark.parametrize(
    ("choices", "answer", "rule"),
    [
        (
            ServingChoices(block_size=32),
            "another kind",
            f"VariantSpec.with_block_size(32) for layer 'a' returned "
            f"{FULL_16.replace('=16', '=32', 1)}; it must return None or a "
            "VariantSpec with block_size 32 (the one asked for)",
        ),
        (
            ServingChoices(block_size=32),
            "another block size",
            "VariantSpec.with_block_size(32) for layer 'a' returned a VariantSpec "
            "of block_size 64; it must return None or a VariantSpec with "
            "block_size 32 (the one asked for)",
        ),
        (
            ServingChoices(kv_cache_dtype="fp8"),
            "another block size",
            "VariantSpec.with_cache_dtype(torch.float8_e4m3fn) for layer 'a' "
            "returned a VariantSpec of block_size 32; it must return None or a "
            f"VariantSpec with block_size 16 {OWN}",
        ),
        (
            ServingChoices(mamba_cache_mode="align"),
            "another kind",
            "VariantSpec.with_state_cache_mode('align') for layer 'a' returned "
            f"{FULL_16}; it must return None or a VariantSpec with block_size 16 "
            f"{OWN}",
        ),
        (
            ServingChoices(tensor_parallel_size=2),
            "another block size",
            "VariantSpec.sharded(2) for layer 'a' returned a VariantSpec of "
            "block_size 32; it must return a VariantSpec with block_size 16 in its "
            "Sharded (its own block: ranks split heads or channels, not blocks)",
        ),
        (
            ServingChoices(tensor_parallel_size=2),
            "none",
            "VariantSpec.sharded(2) for layer 'a' returned None; it must return a "
            "kvcore.spec.Sharded",
        ),
    ],
    ids=["block-kind", "block-size", "dtype-size", "mode-kind", "tp-size", "tp-none"],
)
def test_serving_choice_answers_are_checked(
    choices: ServingChoices, answer: str, rule: str
) -> None:
    """A variant of another kind or block size would be planned under the
    wrong manager or block, with nothing said."""
    registry_with(plugin_with(VariantKind()), "broken")  # names the plugin
    spec = sample(VariantSpec, answer=answer)
    specs: dict[str, KVCacheSpec] = {"a": spec, "b": sample(FullAttentionSpec)}
    given = dict(specs)
    with pytest.raises(PluginResultError) as info:
        apply_serving_choices(specs, choices)
    assert str(info.value) == _spec_error("variant", "VariantSpec", rule)
    assert isinstance(info.value, TypeError)
    assert specs == given
    assert specs["a"] is spec


def test_a_raising_serving_choice_is_wrapped() -> None:
    registry_with(plugin_with(VariantKind()), "broken")
    spec = sample(VariantSpec, answer="raises")
    with pytest.raises(PluginError) as info:
        apply_serving_choices({"a": spec}, ServingChoices(block_size=32))
    assert str(info.value) == _spec_error(
        "variant",
        "VariantSpec",
        "with_block_size(32) for layer 'a' raised RuntimeError: no variant",
    )
    assert isinstance(info.value.__cause__, RuntimeError)


# ---------------------------------------------------------------------------
# Bound views, checked as the pool is built
# ---------------------------------------------------------------------------

NOT_SHARED = (
    "bind_view for layer 'a' does not share the pool's storage (a new tensor or a "
    "copy); views must be made from `raw` without copying (view, reshape, slice, "
    ".view(dtype)), or the cache is written nowhere"
)
REGION = "(from byte 0: [8 x 1024 B] runs of 512 B)"


def _outside(shape: str, offset: int) -> str:
    return (
        f"bind_view for layer 'a' (shape {shape}, strides (512, 256, 16, 1), "
        f"torch.float16, storage offset {offset}) reaches bytes outside the "
        f"layer's region of the pool {REGION}, so writes through it would "
        "overwrite other layers or blocks; derive the view from `raw` without "
        "widening it"
    )


@pytest.mark.parametrize(
    ("how", "rule"),
    [
        ("wide", _outside("(8, 1, 32, 16)", 0)),
        ("next_layer", _outside("(8, 1, 16, 16)", 256)),
        (
            "swapped",
            "bind_view for layer 'a' (shape (16, 1, 8, 16), strides (16, 256, 512, "
            "1), torch.float16) does not index blocks on its first axis: view[i] "
            "must be block i's page of the layer (8 blocks, 1024 bytes apart), or "
            "an engine writing one block writes others; keep `raw`'s first axis "
            "first",
        ),
        ("fresh", NOT_SHARED),
        ("clone", NOT_SHARED),
        (
            "none",
            "bind_view for layer 'a' returned NoneType; it must return a tensor "
            "(or a tuple of tensors) viewing the raw region it was given",
        ),
        (
            "empty",
            "bind_view for layer 'a' returned an empty tuple; it must return a "
            "tensor (or a tuple of tensors) viewing the raw region it was given",
        ),
        (
            "half_tuple",
            "bind_view for layer 'a' returned a tuple of Tensor, NoneType; it must "
            "return a tensor (or a tuple of tensors) viewing the raw region it was "
            "given",
        ),
        (
            "string",
            "bind_view for layer 'a' returned str; it must return a tensor (or a "
            "tuple of tensors) viewing the raw region it was given",
        ),
        (
            "bytes",
            "bind_view for layer 'a' is torch.uint8, but the spec's dtype is "
            "torch.float16; view the raw bytes as torch.float16",
        ),
    ],
)
def test_bound_view_checked(how: str, rule: str) -> None:
    with pytest.raises(PluginBindError) as info:
        _plan(BinderKind(how), sample(BinderSpec))
    assert str(info.value) == _spec_error("binder", "BinderSpec", rule)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("dtypes", "error", "rule"),
    [
        (
            torch.float16,
            PluginResultError,
            "view_dtypes is torch.float16; it must be None or a non-empty tuple "
            "of torch dtypes, one per tensor its binder returns (or one for all "
            "of them)",
        ),
        (
            (),
            PluginResultError,
            "view_dtypes is (); it must be None or a non-empty tuple of torch "
            "dtypes, one per tensor its binder returns (or one for all of them)",
        ),
        (
            ("float16",),
            PluginResultError,
            "view_dtypes is ('float16',); it must be None or a non-empty tuple of "
            "torch dtypes, one per tensor its binder returns (or one for all of "
            "them)",
        ),
        (
            (torch.float16,) * 3,
            PluginBindError,
            "bind_view returned 2 tensor(s) but view_dtypes declares 3 dtypes; "
            "declare one dtype per tensor (or one for all of them)",
        ),
        (
            (torch.float16, torch.bfloat16),
            PluginBindError,
            "tensor 1 of bind_view for layer 'a' is torch.float16, but the spec's "
            "dtype is torch.bfloat16; view the raw bytes as torch.bfloat16",
        ),
    ],
)
def test_declared_view_dtypes_checked(
    dtypes: object, error: type[PluginError], rule: str
) -> None:
    with pytest.raises(error) as info:
        _plan(DtypesKind(), sample(DtypesSpec, dtypes=dtypes))
    assert str(info.value) == _spec_error("dtypes", "DtypesSpec", rule)


def test_declared_view_dtypes_one_per_tensor_or_none() -> None:
    for dtypes in (None, (torch.float16,), (torch.float16, torch.float16)):
        views = _plan(DtypesKind(), sample(DtypesSpec, dtypes=dtypes))
        assert [v.dtype for v in views["a"]] == [torch.float16, torch.float16]


def test_declared_view_dtypes_raising_is_wrapped() -> None:
    with pytest.raises(PluginError) as info:
        _plan(DtypesKind(), sample(DtypesSpec, dtypes="raise"))
    assert str(info.value) == _spec_error(
        "dtypes", "DtypesSpec", "view_dtypes raised RuntimeError: no dtypes"
    )
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize(
    ("mode", "shown"), [(1, "1 (int)"), (b"all", "b'all' (bytes)")]
)
def test_state_cache_mode_must_be_a_str_or_none(mode: object, shown: str) -> None:
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout="BLHNC", mamba_cache_mode="align"
        )
    )
    registry = registry_with(plugin_with(BadModeKind()), "broken")
    spec = sample(BadModeSpec, mode=mode)
    with pytest.raises(PluginResultError) as info:
        kvcore.get_kv_cache_groups(config, {"a": spec}, registry=registry)
    assert str(info.value) == _spec_error(
        "bad_mode",
        "BadModeSpec",
        f"state_cache_mode is {shown}; it must be None (the kind keeps no "
        "recurrent state) or the str name of the mode its states are cached "
        "under ('none', 'align' or 'all')",
    )


def test_a_declared_state_mode_must_match_the_engine() -> None:
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout="BLHNC", mamba_cache_mode="align"
        )
    )
    registry = registry_with(plugin_with(BadModeKind()), "broken")
    with pytest.raises(kvcore.PlanError) as info:
        kvcore.get_kv_cache_groups(
            config, {"a": sample(BadModeSpec, mode="all")}, registry=registry
        )
    assert str(info.value) == (
        "layer 'a' (bad_mode) caches its states in mode 'all' but the engine runs "
        "mamba_cache_mode='align'; build its spec with mode 'align' or leave "
        "CacheConfig.mamba_cache_mode unset"
    )
    for mode in (None, "align"):
        groups = kvcore.get_kv_cache_groups(
            config, {"a": sample(BadModeSpec, mode=mode)}, registry=registry
        )
        assert [g.layer_names for g in groups] == [["a"]]


def test_binder_raising_is_wrapped_and_chained() -> None:
    with pytest.raises(PluginError) as info:
        _plan(BinderKind("raises"), sample(BinderSpec))
    assert str(info.value) == _spec_error(
        "binder",
        "BinderSpec",
        "bind_view (layer 'a') raised RuntimeError: cannot bind",
    )
    assert isinstance(info.value.__cause__, RuntimeError)


def test_keyboard_interrupt_is_not_wrapped() -> None:
    with pytest.raises(KeyboardInterrupt):
        _plan(BinderKind("interrupt"), sample(BinderSpec))


def test_a_good_binder_passes_and_its_views_are_disjoint() -> None:
    views = _plan(BinderKind("ok"), sample(BinderSpec))
    views["a"].fill_(7)
    assert not (views["b"] == 7).any()


def test_check_kind_refuses_a_mistagged_kind() -> None:
    from kvcore.testing import ConformanceError, check_kind

    with pytest.raises(ConformanceError, match="whose kind tag is 'something_else'"):
        check_kind(MistaggedKind(), sample(BinderSpec))


def test_check_kind_refuses_an_escaping_binder() -> None:
    from kvcore.testing import ConformanceError, check_kind

    with pytest.raises(ConformanceError, match="reaches bytes outside"):
        check_kind(BinderKind("wide"), sample(BinderSpec))


# ---------------------------------------------------------------------------
# kvcore plugins: every plugin listed, broken ones with their error
# ---------------------------------------------------------------------------

BROKEN_IMPORT = "raise RuntimeError('half installed')\n"
DUPLICATE_KIND = """
from kvcore import hookimpl
from kvcore_full_attention import FullAttention


@hookimpl
def kvcore_register_kinds():
    return [FullAttention()]
"""


@pytest.fixture
def broken_plugins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_env: None
) -> Iterator[None]:
    """Two plugin modules loaded through ``KVCORE_PLUGINS``: one that fails to
    import, one that registers a kind a built-in already has."""
    (tmp_path / "kvcore_half_installed.py").write_text(BROKEN_IMPORT)
    (tmp_path / "kvcore_dup_full.py").write_text(textwrap.dedent(DUPLICATE_KIND))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("KVCORE_PLUGINS", "kvcore_half_installed,kvcore_dup_full")
    monkeypatch.setenv("KVCORE_DISABLE_PLUGIN_AUTOLOAD", "1")
    importlib.invalidate_caches()
    yield
    for module in ("kvcore_half_installed", "kvcore_dup_full"):
        sys.modules.pop(module, None)


def test_plugins_lists_every_plugin_and_the_broken_ones(
    broken_plugins: None, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvcore.tools.cli import main

    assert main(["plugins", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert set(rows) == set(kvcore.plugins.BUILTIN_PLUGINS) | {
        "kvcore_half_installed",
        "kvcore_dup_full",
    }
    assert rows["mamba"]["errors"] == []
    assert rows["mamba"]["kinds"] == ["mamba"]
    assert rows["kvcore_half_installed"]["errors"] == [
        "kvcore plugin 'kvcore_half_installed' failed to import: RuntimeError: "
        "half installed; fix or uninstall it, or block it with "
        "KVCORE_DISABLE_PLUGINS=kvcore_half_installed"
    ]
    assert rows["kvcore_dup_full"]["kinds"] == []
    [dup] = rows["kvcore_dup_full"]["errors"]
    assert dup.startswith("cache kind 'full_attention' is registered twice: by ")
    assert rows["full_attention"]["kinds"] == ["full_attention"]


def test_plugins_check_exits_non_zero_only_when_asked(
    broken_plugins: None, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvcore.tools.cli import main

    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "kvcore_half_installed" in out
    assert "    error: kvcore plugin 'kvcore_half_installed' failed to import" in out
    assert main(["plugins", "--check"]) == 1
    assert capsys.readouterr().err == "kvcore: error: 2 plugin(s) broken\n"


def test_plugins_check_passes_with_only_builtins(
    clean_env: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvcore.tools.cli import main

    monkeypatch.setenv("KVCORE_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert main(["plugins", "--check"]) == 0
    assert "BROKEN" not in capsys.readouterr().out


def test_the_suite_sees_only_builtin_kinds(builtin_registry: KindRegistry) -> None:
    """conftest keeps installed third-party plugins out of the default
    registry, so results do not depend on what is pip-installed."""
    assert os.environ.get("KVCORE_DISABLE_PLUGIN_AUTOLOAD") == "1"
    assert set(kvcore.default_registry()) == set(builtin_registry)
    assert set(builtin_registry) == {
        "chunked_local_attention",
        "circular_buffer",
        "cross_attention",
        "full_attention",
        "hisparse_hot",
        "mamba",
        "mla",
        "sliding_window",
        "sliding_window_mla",
    }


def test_a_plan_with_an_overridden_kind_says_so(
    impostor: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvcore.tools.summary import summarize

    monkeypatch.setenv("KVCORE_OVERRIDE_KINDS", "mamba")
    registry = KindRegistry.from_plugin_manager(
        kvcore.get_plugin_manager(load_entrypoints=True)
    )
    spec = registry["mamba"].spec_type(
        block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    plan = kvcore.plan_kv_cache(CONFIG, {"ssm.0": spec}, 1 << 20, registry=registry)
    replaced, by = registry.overridden["mamba"]
    note = (
        f"kind 'mamba' is overridden: {by} replaces {replaced} (KVCORE_OVERRIDE_KINDS)"
    )
    summary = summarize(plan, [1024], model_name="m", registry=registry)
    assert note in summary.notes
    # a registry without overrides adds no note
    plain = KindRegistry.from_plugin_manager(
        kvcore.get_plugin_manager(load_entrypoints=False), override=()
    )
    assert plain.override_notes() == []


def test_plugins_lists_a_plugin_with_an_unknown_hook(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    clean_env: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvcore.tools.cli import main

    (tmp_path / "kvcore_odd_hook.py").write_text(
        "from kvcore import hookimpl\n\n\n@hookimpl\ndef kvcore_not_a_hook():\n"
        "    return None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("KVCORE_PLUGINS", "kvcore_odd_hook")
    monkeypatch.setenv("KVCORE_DISABLE_PLUGIN_AUTOLOAD", "1")
    try:
        assert main(["plugins", "--json", "--check"]) == 1
    finally:
        sys.modules.pop("kvcore_odd_hook", None)
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    [error] = rows["kvcore_odd_hook"]["errors"]
    assert error.startswith(
        "kvcore plugin 'kvcore_odd_hook' implements a hook kvcore does not define"
    )
    assert rows["mamba"]["errors"] == []


def test_kvcore_plan_refuses_the_impostor(
    impostor: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvcore.tools.cli import main

    kvcore.default_registry.cache_clear()
    try:
        assert main(["plan", "jamba-1-5-mini", "--memory", "1GiB"]) == 2
    finally:
        kvcore.default_registry.cache_clear()
    err = capsys.readouterr().err
    assert "cache kind 'mamba' is registered twice" in err
    assert "'kvcore-impostor 0.1'" in err


# ---------------------------------------------------------------------------
# The region arithmetic itself
# ---------------------------------------------------------------------------


def _raw(padding: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool of 4 blocks of two 2x4x8-byte pages (plus ``padding`` bytes a
    block), and the first layer's raw region ``[4, 2, 4, 8]``."""
    page = 2 * 4 * 8
    block = 2 * page + padding
    buffer = torch.zeros(4 * block, dtype=torch.uint8)
    raw = torch.as_strided(buffer, (4, 2, 4, 8), (block, 32, 8, 1), 0)
    return buffer, raw


@pytest.mark.parametrize("padding", [0, 16])
def test_region_holds_the_views_a_binder_may_make(padding: int) -> None:
    from kvcore.pool import ByteRegion

    _, raw = _raw(padding)
    region = ByteRegion(raw)
    typed = raw.view(torch.float16)
    for view in (
        raw,
        typed,
        typed.permute(0, 2, 1, 3),
        typed.reshape(4, 2, 16),
        typed[:, :, 1:3],
        typed[1:],
        typed[:, 0].view(torch.int32),
        typed.flatten(1)[:, 5:20],
    ):
        assert region.contains(view)


@pytest.mark.parametrize("padding", [0, 16])
def test_region_refuses_views_that_leave_it(padding: int) -> None:
    from kvcore.pool import ByteRegion

    buffer, raw = _raw(padding)
    region = ByteRegion(raw)
    block = raw.stride(0)
    for shape, strides, offset in (
        ((4, 2, 8, 8), (block, 32, 8, 1), 0),  # twice the states
        ((4, 2, 4, 8), (block, 32, 8, 1), 64),  # shifted into the next layer
        ((4, 2, 4, 9), (block, 32, 8, 1), 0),  # one byte too wide a state
        ((4, 64), (block, 1), 1),  # one byte late
    ):
        assert not region.contains(torch.as_strided(buffer, shape, strides, offset))


def test_a_hit_of_values_that_are_not_block_ids_is_refused_naming_the_plugin() -> None:
    """Block ids are ints the pool handed out: a manager whose hit holds
    numpy ints or bools (ids computed with numpy, say) is refused where the
    hit enters the core, naming the manager, and the pool is as it was."""
    from kvcore.coordinator import KVCacheManager, Request
    from kvcore_full_attention import FullAttention, FullAttentionManager

    class NumpyHits(FullAttentionManager):
        @classmethod
        def find_longest_cache_hit(cls, query: Any) -> list[list[int]]:
            found = super().find_longest_cache_hit(query)
            return [[bool(b) if b == 1 else b for b in group] for group in found]

    class NumpyKind(FullAttention):
        manager_type = NumpyHits

    spec = FullAttention().spec_type(
        block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    config = kvcore.KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=[],
        kv_cache_groups=[kvcore.KVCacheGroupSpec(["layer.0"], spec)],
    )
    mgr = KVCacheManager(
        config,
        max_model_len=1024,
        scheduler_block_size=16,
        hash_block_size=16,
        enable_caching=True,
        registry=KindRegistry.from_kinds([NumpyKind()]),
    )
    first = Request("a", list(range(64)), hash_block_size=16)
    mgr.allocate_slots(first, 64)
    first.num_computed_tokens = 64
    mgr.free(first)
    pool = mgr.block_pool
    before = (list(pool.ref_cnt), pool.free_queue.get_all_free_blocks())
    second = Request("b", [*range(64), 7, 8], hash_block_size=16)
    with pytest.raises(
        PluginResultError,
        match=r"NumpyHits.find_longest_cache_hit returned True \(bool\) at "
        r"position 0 of group 0, not a block id",
    ):
        mgr.get_computed_blocks(second)
    assert (list(pool.ref_cnt), pool.free_queue.get_all_free_blocks()) == before


def _pool_state(mgr: KVCacheManager) -> tuple[list[int], list[int]]:
    """Every block's reference count and the free queue's order."""
    pool = mgr.block_pool
    return list(pool.ref_cnt), pool.free_queue.get_all_free_blocks()


class _MisbuiltWindow(SlidingWindow):
    """A window kind whose make_manager changes what the core gives it."""

    change = ""

    def make_manager(self, spec: Any, block_pool: Any, **kwargs: Any) -> Any:
        if self.change == "block_pool":
            block_pool = BlockPool(
                block_pool.num_blocks, enable_caching=True, hash_block_size=16
            )
        elif self.change == "not a manager":
            return object()
        elif self.change:
            kwargs[self.change] = {"group_id": 0}.get(self.change, 32)
        return super().make_manager(spec, block_pool, **kwargs)


@pytest.mark.parametrize(
    ("change", "rule"),
    [
        ("block_pool", "a block pool other than the coordinator's"),
        ("group_id", "group_id=0, not the 1 it was given"),
        ("block_size", "block_size=32, not the 16 it was given"),
        ("hash_block_size", "hash_block_size=32, not the 16 it was given"),
        ("not a manager", "make_manager returned object"),
    ],
)
def test_a_manager_built_over_other_arguments_is_refused(
    change: str, rule: str
) -> None:
    """A manager over a pool of its own would hand out ids other groups
    hold; one stepping another group's table, or blocks of another size,
    would write pages it does not own."""
    kind = _MisbuiltWindow()
    kind.change = change
    attrs_ = {"block_size": 16, "num_kv_heads": 1, "head_size": 8}
    config = kvcore.KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[
            kvcore.KVCacheGroupSpec(
                ["full"], FullAttention().spec_type(dtype=torch.float16, **attrs_)
            ),
            kvcore.KVCacheGroupSpec(
                ["window"],
                kind.spec_type(dtype=torch.float16, sliding_window=64, **attrs_),
            ),
        ],
    )
    with pytest.raises(PluginResultError, match=rf"'sliding_window'.*{rule}"):
        KVCacheManager(
            config,
            max_model_len=1024,
            scheduler_block_size=32,
            hash_block_size=16,
            registry=KindRegistry.from_kinds([FullAttention(), kind]),
        )


def _one_attention_group(manager: type, num_blocks: int) -> KVCacheManager:
    """A manager over one full-attention group of 16-token blocks whose
    kind runs ``manager``."""
    kind = type("ManagedKind", (FullAttention,), {"manager_type": manager})()
    spec = FullAttention().spec_type(
        block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    return KVCacheManager(
        kvcore.KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[kvcore.KVCacheGroupSpec(["l0"], spec)],
        ),
        max_model_len=1024,
        scheduler_block_size=16,
        hash_block_size=16,
        registry=KindRegistry.from_kinds([kind]),
    )


class _HitMethods(FullAttentionManager):
    """A full-attention manager whose hit cut or serve check misbehaves."""

    mode = ""

    def truncate_hit(self, blocks: list[int], num_tokens: int) -> list[int]:
        if self.mode == "cut raises":
            raise RuntimeError("no cut")
        if self.mode == "cut returns None":
            return None  # type: ignore[return-value]
        if self.mode == "cut takes another block":
            return [next(iter(self.req_to_blocks["live"]))]
        return super().truncate_hit(blocks, num_tokens)

    def hit_serves(self, blocks: Any) -> bool:
        if self.mode == "serves raises":
            raise RuntimeError("no answer")
        return super().hit_serves(blocks)


@pytest.mark.parametrize(
    ("mode", "error", "rule"),
    [
        ("cut raises", PluginError, r"raised in truncate_hit: RuntimeError: no cut"),
        (
            "cut returns None",
            PluginResultError,
            r"_HitMethods.truncate_hit returned None for group 0's hit of 4 "
            r"blocks cut to 16 tokens; it must return a list of the hit's first",
        ),
        ("cut takes another block", PluginResultError, r"returned \[1\] for group"),
        (
            "serves raises",
            PluginError,
            r"request 'b': .*_HitMethods.hit_serves raised RuntimeError: no "
            r"answer on group 0's hit; nothing was attached",
        ),
    ],
)
def test_a_managers_hit_cut_and_serve_check_cross_into_the_core_checked(
    mode: str, error: type[Exception], rule: str
) -> None:
    manager = type("_HitMethods", (_HitMethods,), {"mode": mode})
    mgr = _one_attention_group(manager, 16)
    live = Request("live", list(range(900, 932)), hash_block_size=16)
    assert mgr.allocate_slots(live, 32) is not None
    a = Request("a", list(range(64)), hash_block_size=16)
    assert mgr.allocate_slots(a, 64) is not None
    a.num_computed_tokens = 64
    mgr.free(a)
    b = Request("b", list(range(65)), hash_block_size=16)
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 64
    before = _pool_state(mgr)

    def attach() -> object:
        if mode.startswith("cut"):
            return mgr.truncate_computed_blocks(hit, 16)
        return mgr.allocate_slots(b, 65 - num_hit, num_hit, hit)

    with pytest.raises(error, match=rule):
        attach()
    assert _pool_state(mgr) == before
    assert mgr.get_block_ids("live") == ([1, 2],)


@pytest.mark.parametrize(
    ("answer", "error", "rule"),
    [
        (
            "another kind",
            PluginResultError,
            r"GroupMergeSpec.merge_group \(kind 'group_merge'\) returned "
            r"FullAttentionSpec\(.*it must return the GroupMergeSpec the group's "
            r"manager runs on, of the members' block size 16",
        ),
        (
            "another block size",
            PluginResultError,
            r"returned GroupMergeSpec\(block_size=64",
        ),
        (
            "raises",
            PluginError,
            r"GroupMergeSpec.merge_group \(kind 'group_merge'\) raised RuntimeError: "
            r"cannot merge for layers \['a', 'b'\]",
        ),
    ],
)
def test_the_spec_a_groups_manager_runs_on_is_checked(
    answer: str, error: type[Exception], rule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layers of one kind and grouping key whose specs do not merge share a
    group; the kind's merge_group names the spec its manager runs on."""
    monkeypatch.setattr(GroupMergeSpec, "answer", answer)
    registry = KindRegistry.from_kinds([GroupMergeKind()])
    specs = {
        "a": GroupMergeSpec(
            block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16
        ),
        "b": GroupMergeSpec(
            block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16
        ),
    }
    groups = kvcore.get_kv_cache_groups(CONFIG, specs, registry=registry)
    plan = kvcore.get_kv_cache_config_from_groups(CONFIG, groups, 1 << 22)
    with pytest.raises(error, match=rule):
        KVCacheManager(
            plan,
            max_model_len=1024,
            scheduler_block_size=16,
            hash_block_size=16,
            registry=registry,
        )


class _HoldsBack(SlidingWindowManager):
    """A window manager whose answer for a freed request's held-back blocks
    (``take_held_back``) is the class's ``answer`` for request ``a``."""

    answer: Any = None

    def take_held_back(self, request_id: str) -> list[tuple[int, int]]:
        real = super().take_held_back(request_id)
        return real if request_id != "a" else self.answer


@pytest.mark.parametrize(
    ("answer", "shown"),
    [
        ("another request's block", "(9, 3)"),
        ("a position past the table", "(1000000, 3)"),
        ("not pairs", "'nope'"),
    ],
)
def test_held_back_blocks_a_manager_names_are_checked(answer: str, shown: str) -> None:
    """Its window released and held back a's early blocks; the answer at
    a's free would put another request's block (3, b's), or a position
    a's table lacks, among the blocks the free queues."""
    bad = {
        "another request's block": [(9, 3)],
        "a position past the table": [(10**6, 3)],
        "not pairs": "nope",
    }[answer]
    manager = type("_HoldsBack", (_HoldsBack,), {"answer": bad})
    kind = type("HoldsBackKind", (SlidingWindow,), {"manager_type": manager})()
    mgr = setup.beside_full_attention(kind, 40)
    b = Request("b", list(range(500, 532)), hash_block_size=16)
    assert mgr.allocate_slots(b, 32) is not None
    assert mgr.get_block_ids("b")[1][0] == 3
    a = Request("a", list(range(160)), hash_block_size=16)
    for _ in range(5):
        assert mgr.allocate_slots(a, 32) is not None
        a.num_computed_tokens += 32
    before = _pool_state(mgr)
    with pytest.raises(
        PluginResultError,
        match=rf"_HoldsBack.take_held_back returned {re.escape(shown)} for request "
        r"'a' in cache group 1; it must return \(table position, block\) pairs",
    ):
        mgr.free(a)
    assert _pool_state(mgr) == before


class _Attaches(FullAttentionManager):
    """A manager whose admission blocks name a block of its choosing."""

    def admission_blocks(self, hit: Any, num_computed_tokens: int) -> list[int]:
        return [*hit, *self.req_to_blocks.get("live", [])[:1]]


def test_admission_blocks_outside_the_hit_are_refused() -> None:
    """Attaching another request's block to a new request as computed
    would have both write it: refused, nothing attached."""
    mgr = _one_attention_group(_Attaches, 8)
    live = Request("live", list(range(900, 932)), hash_block_size=16)
    assert mgr.allocate_slots(live, 32) is not None
    before = _pool_state(mgr)
    with pytest.raises(
        PluginResultError,
        match=r"_Attaches.admission_blocks returned \[1\] for cache group 0's hit "
        r"\[\]; it must return a list of the hit's blocks at their positions",
    ):
        mgr.allocate_slots(Request("b", list(range(40)), hash_block_size=16), 40)
    assert _pool_state(mgr) == before


class _OddCount(FullAttentionManager):
    """A manager whose block count for a step that takes blocks is the
    class's ``answer`` (a float or numpy integer from arithmetic on
    counts, a bool from a comparison): at admission, or only for a request
    that holds a table when ``growing`` is set."""

    answer: Any = None
    growing = False

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Any
    ) -> int:
        need = super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks
        )
        odd = need and self.growing == (request_id in self.req_to_blocks)
        return self.answer if odd else need  # type: ignore[no-any-return]


@pytest.mark.parametrize("step", ["admission", "growth", "whole sequence"])
@pytest.mark.parametrize(
    ("answer", "shown"),
    [
        (2.0, r"2\.0 \(float\)"),
        (np.int64(2), r"np\.int64\(2\) \(int64\)"),
        (True, r"True \(bool\)"),
        (-1, r"-1 \(int\)"),
    ],
)
def test_a_block_count_that_is_not_a_non_negative_int_is_refused(
    step: str, answer: object, shown: str
) -> None:
    """The step takes that many blocks from the pool: a count of another
    type is the plugin's type error (a ``TypeError``), naming the method
    and the rule, and nothing changes."""
    growing = step == "growth"
    manager = type("_OddCount", (_OddCount,), {"answer": answer, "growing": growing})
    mgr = _one_attention_group(manager, 16)
    live = Request("live", list(range(900, 964)), hash_block_size=16)
    if growing:
        assert mgr.allocate_slots(live, 16) is not None
        live.num_computed_tokens = 16
    before = _pool_state(mgr)
    with pytest.raises(
        PluginResultError,
        match=rf"_OddCount.get_num_blocks_to_allocate of cache group 0 \(kind "
        rf"'full_attention', plugin .*\) returned {shown}; a block count must be "
        r"an int of at least 0 \(not a bool, float or numpy integer\)",
    ) as info:
        mgr.allocate_slots(live, 16, full_sequence_must_fit=step == "whole sequence")
    assert isinstance(info.value, TypeError)
    assert _pool_state(mgr) == before


class _CountsFreeable(SlidingWindowManager):
    """A window manager whose ``count_freeable_skipped`` is the class's
    ``answer`` applied to the true count."""

    answer: Any = None

    def count_freeable_skipped(self, request_id: str, num_computed_tokens: int) -> int:
        true = super().count_freeable_skipped(request_id, num_computed_tokens)
        if self.answer is None:
            return true
        return self.answer(true)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("answer", "rule"),
    [
        (
            lambda n: n + 5,
            r"count_freeable_skipped of .*_CountsFreeable of cache group 1 \(kind "
            r"'sliding_window', plugin .*\) counted the blocks releasing request "
            r"'a' at 128 computed tokens returns to the pool as free, and the step "
            r"fitted only by them, but after remove_skipped_blocks the pool holds "
            r"1 free blocks where the step needs 2",
        ),
        (
            float,
            r"_CountsFreeable.count_freeable_skipped of cache group 1 .* "
            r"returned 1\.0 \(float\); a block count must be an int",
        ),
        (lambda n: n, None),
    ],
    ids=["overstated", "a float", "true"],
)
def test_the_freeable_count_a_short_step_relies_on_is_checked(
    answer: Any, rule: str | None
) -> None:
    """A running window request in a pool one block short counts the block
    its release returns as free; a count that claims more than the release
    returns is the count's fault, not the allocation's that would run the
    pool dry after it."""
    manager = type("_CountsFreeable", (_CountsFreeable,), {})
    kind = type("CountsKind", (SlidingWindow,), {"manager_type": manager})()
    mgr = setup.beside_full_attention(kind, 12)
    a = Request("a", list(range(400)), hash_block_size=16)
    while mgr.block_pool.free_queue.num_free > 0:
        assert mgr.allocate_slots(a, 16) is not None
        a.num_computed_tokens += 16
    # The next step takes a block in each group and its release returns
    # one: it does not fit, and only a count of more than one says it does.
    manager.answer = staticmethod(answer)
    before = _pool_state(mgr)
    if rule is None:  # the true count: the step waits for room
        assert mgr.allocate_slots(a, 16) is None
        assert _pool_state(mgr) == before
        return
    with pytest.raises(PluginResultError, match=rule) as info:
        mgr.allocate_slots(a, 16)
    assert "allocate_new_blocks" not in str(info.value)
    assert _pool_state(mgr) == before


@attrs.frozen(kw_only=True)
class _LiarSpec(SlidingWindowSpec):
    kind: ClassVar[str] = "liar_window"


class _Liar(_CountsFreeable):
    answer = staticmethod(lambda n: n + 3)


class _LiarKind(SlidingWindow):
    name: ClassVar[str] = "liar_window"
    spec_type = _LiarSpec
    manager_type = _Liar


def test_an_overstated_count_blames_the_manager_that_overstated() -> None:
    """Two window groups of 8 tokens, the built-in one honest and another
    plugin's counting three blocks too many.  After an 8-token admission
    (4 of the 7 blocks), a 12-token step needs 6 blocks: 3 are free and at
    8 tokens nothing is released (the window still reads token 1), so only
    the liar's 3 make it fit.  Once the release has run, only the liar
    still counts blocks to free: the error names it alone."""
    registry = KindRegistry(
        [(FullAttention(), "full_attention"), (SlidingWindow(), "sliding_window"),
         (_LiarKind(), "liar")]
    )  # fmt: skip
    window = {"block_size": 4, "num_kv_heads": 1, "head_size": 1, "sliding_window": 8}
    mgr = setup.manager_for(
        [
            SlidingWindowSpec(dtype=torch.float32, **window),
            _LiarSpec(dtype=torch.float32, **window),
        ],
        8,
        scheduler_block_size=4,
        hash_block_size=4,
        registry=registry,
    )
    req = Request("r", list(range(400)), hash_block_size=4)
    assert mgr.allocate_slots(req, 8) is not None
    req.num_computed_tokens = 8
    before = _pool_state(mgr)
    with pytest.raises(PluginResultError) as info:
        mgr.allocate_slots(req, 12)
    assert info.value.plugin_name == "liar"
    message = str(info.value)
    assert "_Liar of cache group 1 (kind 'liar_window', plugin 'liar')" in message
    assert "group 0" not in message
    assert "holds 3 free blocks where the step needs 6" in message
    assert _pool_state(mgr) == before


class _Skips(SlidingWindowManager):
    """A window manager whose release rule answers the class's ``answer``
    once 64 tokens are computed."""

    answer: Any = None

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        if num_computed_tokens < 64:
            return super().num_skipped_blocks(num_computed_tokens)
        return self.answer  # type: ignore[no-any-return]


@pytest.mark.parametrize("step", ["admission with a hit", "running step"])
@pytest.mark.parametrize(
    ("answer", "shown"),
    [
        (10**9, r"1000000000 \(int\)"),
        (5, r"5 \(int\)"),
        (-1, r"-1 \(int\)"),
        (2.0, r"2\.0 \(float\)"),
    ],
)
def test_a_release_rule_past_the_computed_tokens_is_refused(
    step: str, answer: object, shown: str
) -> None:
    """The table is padded with the null block up to the skipped positions:
    an answer past the whole blocks the computed tokens fill (64 tokens: 4)
    would pad it without bound, so it is refused before anything is built."""
    manager = type("_Skips", (_Skips,), {"answer": answer})
    kind = type("SkipsKind", (SlidingWindow,), {"manager_type": manager})()
    spec = kind.spec_type(
        block_size=16,
        num_kv_heads=1,
        head_size=8,
        dtype=torch.float16,
        sliding_window=32,
    )
    mgr = KVCacheManager(
        kvcore.KVCacheConfig(
            num_blocks=16,
            kv_cache_tensors=[],
            kv_cache_groups=[kvcore.KVCacheGroupSpec(["w"], spec)],
        ),
        max_model_len=1024,
        scheduler_block_size=16,
        hash_block_size=16,
        enable_caching=True,
        registry=KindRegistry.from_kinds([kind]),
    )
    a = Request("a", list(range(100)), hash_block_size=16)
    assert mgr.allocate_slots(a, 64) is not None
    a.num_computed_tokens = 64
    if step == "admission with a hit":
        mgr.free(a)
        a = Request("b", list(range(100)), hash_block_size=16)
        hit, num_hit = mgr.get_computed_blocks(a)
        assert num_hit == 64
    steps: dict[str, tuple[Any, ...]] = {"running step": (16,)}
    if step == "admission with a hit":
        steps[step] = (36, num_hit, hit)
    before = _pool_state(mgr)
    with pytest.raises(
        PluginResultError,
        match=rf"_Skips.num_skipped_blocks returned {shown} for 64 computed tokens "
        r"in cache group 0; it must return an int from 0 to 4 \(the whole "
        r"16-token blocks those tokens fill",
    ):
        mgr.allocate_slots(a, *steps[step])
    assert _pool_state(mgr) == before
