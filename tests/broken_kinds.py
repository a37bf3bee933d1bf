"""A zoo of deliberately broken cache kinds, one per way a plugin can hand
the core something wrong.  ``tests/test_plugin_boundaries.py`` registers each
and checks the error that names it; nothing here is a fixture of its own."""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from typing import Any, ClassVar, Self

import attrs
import torch

import kvcore
from kvcore import AttentionKind, CacheKind, KindRegistry, hookimpl
from kvcore.kinds import LayerView
from kvcore.spec import AttentionSpec, KVCacheSpec, Sharded
from kvcore_full_attention import FullAttentionManager, FullAttentionSpec


def plugin_with(*kinds: object, answer: object = None) -> object:
    """A plugin object whose ``kvcore_register_kinds`` returns ``kinds`` as a
    list, or ``answer`` itself when given."""

    class Plugin:
        @hookimpl
        def kvcore_register_kinds(self) -> Any:
            return list(kinds) if answer is None else answer

    return Plugin()


def registry_with(plugin: object, name: str) -> KindRegistry:
    """Built-in kinds plus ``plugin`` registered by hand as ``name``."""
    pm = kvcore.get_plugin_manager(load_entrypoints=False)
    pm.register(plugin, name=name)
    return KindRegistry.from_plugin_manager(pm)


def sample(spec_type: type[AttentionSpec], **fields: Any) -> Any:
    return spec_type(
        block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16, **fields
    )


# -- registration -----------------------------------------------------------


@attrs.frozen(kw_only=True)
class OkSpec(AttentionSpec):
    kind: ClassVar[str] = "ok_kind"


class OkKind(AttentionKind):
    name: ClassVar[str] = "ok_kind"
    spec_type = OkSpec


class Raising:
    @hookimpl
    def kvcore_register_kinds(self) -> list[CacheKind]:
        raise RuntimeError("no kinds today")


@attrs.frozen(kw_only=True)
class MistaggedSpec(AttentionSpec):
    kind: ClassVar[str] = "something_else"


class MistaggedKind(AttentionKind):
    name: ClassVar[str] = "mistagged"
    spec_type = MistaggedSpec


class NotAttrsSpec(AttentionSpec):  # no decorator: inherits its fields' class
    kind: ClassVar[str] = "not_attrs"


class NotAttrsKind(AttentionKind):
    name: ClassVar[str] = "not_attrs"
    spec_type = NotAttrsSpec


@attrs.frozen(kw_only=True)
class MutableSpec(AttentionSpec):
    kind: ClassVar[str] = "mutable"


# attrs refuses to freeze a class with its own __setattr__, so thaw it after.
MutableSpec.__setattr__ = object.__setattr__  # type: ignore[method-assign,assignment]


class MutableKind(AttentionKind):
    name: ClassVar[str] = "mutable"
    spec_type = MutableSpec


class NotAManagerKind(AttentionKind):
    name: ClassVar[str] = "ok_kind"
    spec_type = OkSpec
    manager_type = dict  # type: ignore[assignment]


# -- planning ---------------------------------------------------------------


@attrs.frozen(kw_only=True)
class BadPageSpec(AttentionSpec):
    """Its page size is whatever ``bad_page`` says."""

    kind: ClassVar[str] = "bad_page"
    bad_page: Any = 0

    @property
    def page_size_bytes(self) -> Any:
        return self.bad_page


class BadPageKind(AttentionKind):
    name: ClassVar[str] = "bad_page"
    spec_type = BadPageSpec


@attrs.frozen(kw_only=True)
class BadGridSpec(AttentionSpec):
    """Its page grid is whatever ``bad_grid`` says."""

    kind: ClassVar[str] = "bad_grid"
    bad_grid: Any = (0, 16, 32)

    @property
    def page_grid(self) -> Any:
        return self.bad_grid


class BadGridKind(AttentionKind):
    name: ClassVar[str] = "bad_grid"
    spec_type = BadGridSpec


@attrs.frozen(kw_only=True)
class ListKeySpec(AttentionSpec):
    kind: ClassVar[str] = "list_key"

    def group_key(self) -> Hashable:
        return ["list_key", self.block_size]  # type: ignore[return-value]


class ListKeyKind(AttentionKind):
    name: ClassVar[str] = "list_key"
    spec_type = ListKeySpec


@attrs.frozen(kw_only=True)
class RaisingKeySpec(AttentionSpec):
    kind: ClassVar[str] = "raising_key"

    def group_key(self) -> Hashable:
        raise RuntimeError("no key")


class RaisingKeyKind(AttentionKind):
    name: ClassVar[str] = "raising_key"
    spec_type = RaisingKeySpec


@attrs.frozen(kw_only=True)
class OtherKindMergeSpec(AttentionSpec):
    kind: ClassVar[str] = "other_merge"

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec]) -> Self:
        return FullAttentionSpec(  # type: ignore[return-value]
            block_size=16, num_kv_heads=64, head_size=256, dtype=torch.float32
        )


class OtherKindMergeKind(AttentionKind):
    name: ClassVar[str] = "other_merge"
    spec_type = OtherKindMergeSpec


@attrs.frozen(kw_only=True)
class RaisingMergeSpec(AttentionSpec):
    kind: ClassVar[str] = "raising_merge"

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec]) -> Self:
        return specs[0] // 2  # type: ignore[operator, no-any-return]


class RaisingMergeKind(AttentionKind):
    name: ClassVar[str] = "raising_merge"
    spec_type = RaisingMergeSpec


@attrs.frozen(kw_only=True)
class SmallMergeSpec(AttentionSpec):
    """Merges its layers into one of a single KV head: a smaller page."""

    kind: ClassVar[str] = "small_merge"

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec]) -> Self:
        return attrs.evolve(specs[0], num_kv_heads=1)  # type: ignore[return-value]


class SmallMergeKind(AttentionKind):
    name: ClassVar[str] = "small_merge"
    spec_type = SmallMergeSpec


@attrs.frozen(kw_only=True)
class BlockMergeSpec(AttentionSpec):
    """Merges its layers into one of twice their block size."""

    kind: ClassVar[str] = "block_merge"

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec]) -> Self:
        first = specs[0]
        return attrs.evolve(first, block_size=2 * first.block_size)  # type: ignore[return-value]


class BlockMergeKind(AttentionKind):
    name: ClassVar[str] = "block_merge"
    spec_type = BlockMergeSpec


_CALLS = itertools.count()


@attrs.frozen(kw_only=True)
class UnstableKeySpec(AttentionSpec):
    """Its grouping key by ``how``: a call counter, its own id (a copy's
    differs), or a key whose hash changes between calls."""

    kind: ClassVar[str] = "unstable_key"
    how: str = "counter"

    def group_key(self) -> Hashable:
        if self.how == "counter":
            return ("unstable_key", next(_CALLS))
        if self.how == "id":
            return ("unstable_key", id(self))
        return _DriftingHash()


class _DriftingHash:
    """Equal to every other, with a new hash each time."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _DriftingHash)

    def __hash__(self) -> int:
        return next(_CALLS)

    def __repr__(self) -> str:
        return "DriftingHash()"


class UnstableKeyKind(AttentionKind):
    name: ClassVar[str] = "unstable_key"
    spec_type = UnstableKeySpec


@attrs.frozen(kw_only=True)
class VariantSpec(AttentionSpec):
    """Its serving choices (``with_*`` and ``sharded``) answer by ``answer``:
    another kind's spec, this spec at twice the block size asked for (or
    had), ``None`` (``sharded`` only) or an error."""

    kind: ClassVar[str] = "variant"
    answer: str = "another kind"

    def _variant(self, block_size: int) -> Any:
        if self.answer == "another kind":
            return FullAttentionSpec(
                block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16
            )
        if self.answer == "another block size":
            return attrs.evolve(self, block_size=2 * block_size)
        if self.answer == "raises":
            raise RuntimeError("no variant")
        return None

    def with_block_size(self, block_size: int) -> Any:
        return self._variant(block_size)

    def with_cache_dtype(self, dtype: torch.dtype) -> Any:
        return self._variant(self.block_size)

    def with_state_cache_mode(self, mode: str) -> Any:
        return self._variant(self.block_size)

    def sharded(self, tp_size: int) -> Any:
        variant = self._variant(self.block_size)
        return None if variant is None else Sharded(spec=variant)


class VariantKind(AttentionKind):
    name: ClassVar[str] = "variant"
    spec_type = VariantSpec


@attrs.frozen(kw_only=True)
class BadModeSpec(AttentionSpec):
    """Declares ``mode`` as the recurrent-state mode it runs under."""

    kind: ClassVar[str] = "bad_mode"
    mode: Any = None

    @property
    def state_cache_mode(self) -> Any:
        return self.mode


class BadModeKind(AttentionKind):
    name: ClassVar[str] = "bad_mode"
    spec_type = BadModeSpec


# -- binding ----------------------------------------------------------------


@attrs.frozen(kw_only=True)
class BinderSpec(AttentionSpec):
    kind: ClassVar[str] = "binder"


@attrs.frozen(kw_only=True)
class DtypesSpec(AttentionSpec):
    """Declares ``dtypes`` as the dtypes of its views."""

    kind: ClassVar[str] = "dtypes"
    dtypes: Any = None

    @property
    def view_dtypes(self) -> Any:
        if self.dtypes == "raise":
            raise RuntimeError("no dtypes")
        return self.dtypes


class DtypesKind(AttentionKind):
    """Binds two tensors: the page's halves, in the spec's dtype."""

    name: ClassVar[str] = "dtypes"
    spec_type = DtypesSpec

    def bind_view(self, spec: DtypesSpec, raw: torch.Tensor) -> LayerView:
        typed = raw.view(spec.dtype)
        half = typed.shape[-1] // 2
        return (typed[..., :half], typed[..., half:])


class BinderKind(AttentionKind):
    """Binds through ``how``: one of :data:`BINDERS`."""

    name: ClassVar[str] = "binder"
    spec_type = BinderSpec

    def __init__(self, how: str) -> None:
        self.how = how

    def bind_view(self, spec: BinderSpec, raw: torch.Tensor) -> LayerView:
        typed = raw.view(spec.dtype)
        if self.how == "wide":  # twice the states its page holds
            b, h, n, c = typed.shape
            return typed.as_strided((b, h, 2 * n, c), typed.stride())
        if self.how == "fresh":
            return torch.zeros(typed.shape, dtype=spec.dtype)
        if self.how == "clone":
            return typed.clone()
        if self.how == "empty":
            return ()
        if self.how == "half_tuple":
            return (typed, None)  # type: ignore[return-value]
        if self.how == "none":
            return None  # type: ignore[return-value]
        if self.how == "string":
            return "the view"  # type: ignore[return-value]
        if self.how == "bytes":  # not in the spec's dtype
            return raw
        if self.how == "next_layer":  # shifted by one page: the next layer's
            page = typed.shape[1] * typed.shape[2] * typed.shape[3]
            return typed.as_strided(
                typed.shape, typed.stride(), typed.storage_offset() + page
            )
        if self.how == "swapped":  # blocks and token slots swapped
            return typed.transpose(0, 2)
        if self.how == "raises":
            raise RuntimeError("cannot bind")
        if self.how == "interrupt":
            raise KeyboardInterrupt
        return typed


BINDERS = (
    "wide",
    "fresh",
    "clone",
    "none",
    "empty",
    "half_tuple",
    "string",
    "bytes",
    "next_layer",
    "swapped",
    "raises",
    "interrupt",
)


# -- caught by the conformance suite (the core cannot see these) -------------


class HalfPageKind(AttentionKind):
    """Addresses only the first half of each page's states."""

    name: ClassVar[str] = "binder"
    spec_type = BinderSpec

    def bind_view(self, spec: BinderSpec, raw: torch.Tensor) -> LayerView:
        typed = raw.view(spec.dtype)
        return typed[:, :, : typed.shape[2] // 2]


@attrs.frozen(kw_only=True)
class SeededKeySpec(AttentionSpec):
    """Its grouping key lists a set, whose order follows the hash seed."""

    kind: ClassVar[str] = "seeded_key"

    def group_key(self) -> Hashable:
        return tuple({f"part-{i}" for i in range(32)})


class SeededKeyKind(AttentionKind):
    name: ClassVar[str] = "seeded_key"
    spec_type = SeededKeySpec


@attrs.frozen(kw_only=True)
class LenientMergeSpec(AttentionSpec):
    """Merges anything into its first spec."""

    kind: ClassVar[str] = "lenient_merge"

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec]) -> Self:
        return specs[0]  # type: ignore[return-value]


class LenientMergeKind(AttentionKind):
    name: ClassVar[str] = "lenient_merge"
    spec_type = LenientMergeSpec


@attrs.frozen(kw_only=True)
class UncheckedSpec(AttentionSpec):
    """Redeclares block_size without its validator."""

    kind: ClassVar[str] = "unchecked"
    block_size: int = attrs.field()


class UncheckedKind(AttentionKind):
    name: ClassVar[str] = "unchecked"
    spec_type = UncheckedSpec


@attrs.frozen(kw_only=True)
class GroupMergeSpec(FullAttentionSpec):
    """Its ``merge_group`` answers by the class's ``answer``: another kind's
    spec, four times the block size, or an error."""

    kind: ClassVar[str] = "group_merge"
    answer: ClassVar[str] = ""

    @classmethod
    def merge_group(cls, specs: Sequence[KVCacheSpec]) -> KVCacheSpec:
        first = specs[0]
        if cls.answer == "another kind":
            return FullAttentionSpec(
                block_size=first.block_size,
                num_kv_heads=1,
                head_size=8,
                dtype=torch.float16,
            )
        if cls.answer == "another block size":
            return attrs.evolve(first, block_size=first.block_size * 4)
        raise RuntimeError("cannot merge")


class GroupMergeKind(AttentionKind):
    name: ClassVar[str] = "group_merge"
    spec_type = GroupMergeSpec
    manager_type = FullAttentionManager
