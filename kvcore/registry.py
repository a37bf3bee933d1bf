"""The kind registry: an immutable map from kind names to kind objects."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from kvcore.errors import DuplicateKindError, PluginError, UnknownKindError
from kvcore.kinds import CacheKind
from kvcore.spec import KVCacheSpec

if TYPE_CHECKING:
    import pluggy

    from kvcore.config import EngineConfig
    from kvcore.structs import KVCacheGroupSpec

__all__ = ["KindRegistry", "default_registry"]


class KindRegistry(Mapping[str, CacheKind]):
    """Kind name to :class:`~kvcore.kinds.CacheKind`, built once.

    Build it with :meth:`from_plugin_manager` after plugins load (or
    :meth:`from_kinds` in tests).  Lookups are plain dict reads.
    """

    def __init__(
        self,
        kinds: Iterable[tuple[CacheKind, str]],
        *,
        plugin_manager: pluggy.PluginManager | None = None,
    ) -> None:
        by_name: dict[str, CacheKind] = {}
        owners: dict[str, str] = {}
        for kind, owner in kinds:
            _check_kind(kind, owner)
            if kind.name in by_name:
                first = owners[kind.name]
                msg = (
                    f"cache kind {kind.name!r} is registered twice: by plugin "
                    f"{first!r} and by plugin {owner!r}; block one with "
                    f"KVCORE_DISABLE_PLUGINS={owner}"
                )
                raise DuplicateKindError(msg, kind=kind.name, first=first, second=owner)
            by_name[kind.name] = kind
            owners[kind.name] = owner
        self._kinds = by_name
        self._owners = owners
        self._by_type: dict[type, CacheKind] = {
            kind.spec_type: kind for kind in by_name.values()
        }
        self._pm = plugin_manager

    @classmethod
    def from_plugin_manager(cls, pm: pluggy.PluginManager) -> KindRegistry:
        """Collect every plugin's kinds, in plugin registration order."""
        collected: list[tuple[CacheKind, str]] = []
        for impl in pm.hook.kvcore_register_kinds.get_hookimpls():
            try:
                kinds: Any = impl.function()
            except Exception as exc:
                msg = (
                    f"kvcore plugin {impl.plugin_name!r} raised in "
                    f"kvcore_register_kinds: {type(exc).__name__}: {exc}; block it "
                    f"with KVCORE_DISABLE_PLUGINS={impl.plugin_name}"
                )
                raise PluginError(msg, plugin_name=impl.plugin_name) from exc
            if kinds is None:
                continue
            for kind in kinds:
                collected.append((kind, impl.plugin_name))
        return cls(collected, plugin_manager=pm)

    @classmethod
    def from_kinds(
        cls, kinds: Iterable[CacheKind], owner: str = "<manual>"
    ) -> KindRegistry:
        """A registry of the given kinds, with no plugin manager behind it."""
        return cls((kind, owner) for kind in kinds)

    # -- Mapping ----------------------------------------------------------
    def __getitem__(self, name: str) -> CacheKind:
        try:
            return self._kinds[name]
        except KeyError:
            msg = (
                f"no cache kind named {name!r}; known kinds: {self._known()}. Is "
                "the plugin that provides it installed? (see `kvcore plugins`; a "
                "plugin module that is not installed loads with "
                "KVCORE_PLUGINS=module)"
            )
            raise UnknownKindError(msg, kind=name) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._kinds)

    def __len__(self) -> int:
        return len(self._kinds)

    def __repr__(self) -> str:
        return f"KindRegistry({self._known()})"

    def _known(self) -> str:
        return ", ".join(sorted(self._kinds)) or "(none)"

    # -- lookups ------------------------------------------------------------
    def owner(self, name: str) -> str:
        """The plugin that registered kind ``name``."""
        self[name]
        return self._owners[name]

    @property
    def spec_types(self) -> tuple[type[KVCacheSpec], ...]:
        """Every registered spec class, in registration order."""
        return tuple(self._by_type)

    def kind_for(self, spec: object, *, layer: str | None = None) -> CacheKind:
        """The kind owning ``spec``'s class (exact class, not a subclass)."""
        kind = self._by_type.get(type(spec))
        if kind is not None:
            return kind
        where = f"layer {layer!r} has a" if layer else "a"
        if not isinstance(spec, KVCacheSpec):
            msg = (
                f"{where} spec of type {type(spec).__name__}, which is not a kvcore "
                "KVCacheSpec; build layer specs from a registered kind's spec class"
            )
            raise UnknownKindError(msg, kind=type(spec).__name__)
        name = type(spec).kind or type(spec).__name__
        owner = self._kinds.get(name)
        if owner is not None:
            msg = (
                f"{where} {type(spec).__name__} spec, a subclass of "
                f"{owner.spec_type.__name__} that inherits its kind tag {name!r}; "
                f"kind {name!r} owns {owner.spec_type.__name__} only. Give "
                f"{type(spec).__name__} its own kind name and register a kind for it"
            )
            raise UnknownKindError(msg, kind=name)
        msg = (
            f"{where} {type(spec).__name__} spec (kind {name!r}) that no registered "
            f"plugin provides; known kinds: {self._known()}. Install or register "
            "the plugin that provides it"
        )
        raise UnknownKindError(msg, kind=name)

    # -- planning hooks ---------------------------------------------------
    def choose_grouping(
        self, config: EngineConfig, specs: Mapping[str, KVCacheSpec]
    ) -> list[KVCacheGroupSpec] | None:
        """Ask plugins for a grouping policy (``kvcore_choose_grouping``)."""
        if self._pm is None:
            return None
        hook = self._pm.hook.kvcore_choose_grouping
        try:
            result: list[KVCacheGroupSpec] | None = hook(config=config, specs=specs)
        except Exception as exc:
            names = [impl.plugin_name for impl in hook.get_hookimpls()]
            msg = (
                f"a kvcore_choose_grouping plugin raised {type(exc).__name__}: {exc} "
                f"(plugins implementing it: {', '.join(names)}); fix it or block it "
                "with KVCORE_DISABLE_PLUGINS"
            )
            raise PluginError(msg, plugin_name=",".join(names)) from exc
        return result


def _check_kind(kind: Any, owner: str) -> None:
    if not isinstance(kind, CacheKind):
        msg = (
            f"kvcore plugin {owner!r} registered {kind!r}, which is not a "
            "kvcore.kinds.CacheKind instance; return kind objects from "
            "kvcore_register_kinds"
        )
        raise PluginError(msg, plugin_name=owner)
    spec_type = getattr(kind, "spec_type", None)
    name = getattr(kind, "name", None)
    if not isinstance(name, str) or not name:
        msg = f"kvcore plugin {owner!r} registered a kind with no name: {kind!r}"
        raise PluginError(msg, plugin_name=owner)
    if not (isinstance(spec_type, type) and issubclass(spec_type, KVCacheSpec)):
        msg = (
            f"kind {name!r} of plugin {owner!r} has spec_type={spec_type!r}; it "
            "must be a KVCacheSpec subclass"
        )
        raise PluginError(msg, plugin_name=owner)
    if spec_type.kind != name:
        msg = (
            f"kind {name!r} of plugin {owner!r} owns {spec_type.__name__}, whose "
            f"kind tag is {spec_type.kind!r}; set {spec_type.__name__}.kind = {name!r}"
        )
        raise PluginError(msg, plugin_name=owner)


@functools.cache
def default_registry() -> KindRegistry:
    """A registry from a default plugin manager, built once per process.

    A convenience for scripts; libraries and tests should build and pass
    their own registry.
    """
    from kvcore.plugins import get_plugin_manager

    return KindRegistry.from_plugin_manager(get_plugin_manager())
