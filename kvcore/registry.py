"""The kind registry: an immutable map from kind names to kind objects."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvcore.errors import (
    DuplicateKindError,
    KvcoreError,
    KvcoreTypeError,
    PluginError,
    PluginResultError,
    UnknownKindError,
    collect,
    did_you_mean,
    echo,
)
from kvcore.kinds import CacheKind
from kvcore.owners import (
    call_plugin,
    describe_plugin,
    owner_of,
    record_owner,
    spec_plugin_error,
)
from kvcore.spec import KVCacheSpec

if TYPE_CHECKING:
    import pluggy

    from kvcore.config import EngineConfig
    from kvcore.engines import EngineEstimate
    from kvcore.structs import KVCacheGroupSpec

__all__ = [
    "OVERRIDE_ENV",
    "KindRegistry",
    "call_plugin",
    "default_registry",
    "describe_plugin",
    "owner_of",
    "spec_plugin_error",
]

#: Kind names a user lets a later plugin replace (comma separated), read when
#: a registry is built from a plugin manager without an explicit ``override``.
OVERRIDE_ENV = "KVCORE_OVERRIDE_KINDS"


class KindRegistry(Mapping[str, CacheKind]):
    """Kind name to :class:`~kvcore.kinds.CacheKind`, built once.

    Build it with :meth:`from_plugin_manager` after plugins load (or
    :meth:`from_kinds` in tests).  Lookups are plain dict reads.

    :param kinds: ``(kind, plugin name)`` pairs in registration order.
    :param override: kind names a later plugin may take over from an earlier
        one (the user's explicit opt-in; without it a name registered twice
        is a :class:`DuplicateKindError`).  Each override that happened is in
        :attr:`overridden`.
    :param distributions: plugin name to its distribution (for messages).
    :param errors: collect each broken plugin's error here and skip its
        kinds, rather than raising the first (``kvcore plugins``).
    """

    def __init__(
        self,
        kinds: Iterable[tuple[CacheKind, str]],
        *,
        plugin_manager: pluggy.PluginManager | None = None,
        override: Iterable[str] = (),
        distributions: Mapping[str, str | None] | None = None,
        errors: list[KvcoreError] | None = None,
    ) -> None:
        dists = dict(distributions or {})
        allowed = set(_names(override, "override"))
        by_name: dict[str, CacheKind] = {}
        owners: dict[str, str] = {}
        #: kind name -> ``(replaced plugin, replacing plugin)``, each as
        #: :func:`describe_plugin` words it.
        self.overridden: dict[str, tuple[str, str]] = {}
        for kind, owner in kinds:
            try:
                _check_kind(kind, owner, dists.get(owner))
            except PluginError as exc:
                collect(errors, exc)
                continue
            if kind.name in by_name:
                first = owners[kind.name]
                first_who = describe_plugin(first, dists.get(first))
                second_who = describe_plugin(owner, dists.get(owner))
                if kind.name in allowed:
                    self.overridden[kind.name] = (first_who, second_who)
                else:
                    msg = (
                        f"cache kind {kind.name!r} is registered twice: by "
                        f"{first_who} and by {second_who}; a plugin cannot replace "
                        f"another's kind silently. Uninstall or block one "
                        f"(KVCORE_DISABLE_PLUGINS={owner}), or let the later one "
                        f"replace the earlier with {OVERRIDE_ENV}={kind.name}"
                    )
                    duplicate = DuplicateKindError(
                        msg, kind=kind.name, first=first, second=owner
                    )
                    collect(errors, duplicate)
                    continue
            by_name[kind.name] = kind
            owners[kind.name] = owner
        unknown = sorted(allowed - set(by_name))
        if unknown:
            msg = (
                f"{OVERRIDE_ENV} (or override=) names kind(s) {unknown} that no "
                f"plugin registers; known kinds: {', '.join(sorted(by_name))}. "
                "Check the spelling"
            )
            raise UnknownKindError(msg, kind=unknown[0])
        self._kinds = by_name
        self._owners = owners
        self._distributions = dists
        self._by_type: dict[type, CacheKind] = {
            kind.spec_type: kind for kind in by_name.values()
        }
        for name, kind in by_name.items():
            record_owner(kind.spec_type, owners[name], dists.get(owners[name]))
        self._pm = plugin_manager

    @classmethod
    def from_plugin_manager(
        cls,
        pm: pluggy.PluginManager,
        *,
        override: Iterable[str] | None = None,
        errors: list[KvcoreError] | None = None,
    ) -> KindRegistry:
        """Collect every plugin's kinds, in plugin registration order.

        :param override: kind names a later plugin may take over (default:
            ``KVCORE_OVERRIDE_KINDS``).
        :param errors: collect broken plugins' errors here instead of raising.
        """
        from kvcore.plugins import plugin_distribution

        if override is None:
            override = _split(os.environ.get(OVERRIDE_ENV))
        collected: list[tuple[CacheKind, str]] = []
        dists: dict[str, str | None] = {}
        for impl in pm.hook.kvcore_register_kinds.get_hookimpls():
            name = impl.plugin_name
            try:
                shown = plugin_distribution(pm, name)
            except Exception:  # metadata only decorates messages
                shown = None
            dists[name] = shown
            try:
                kinds = _registered_kinds(impl.function, name, shown)
            except PluginError as exc:
                collect(errors, exc)
                continue
            collected.extend((kind, name) for kind in kinds)
        return cls(
            collected,
            plugin_manager=pm,
            override=override,
            distributions=dists,
            errors=errors,
        )

    @classmethod
    def from_kinds(
        cls,
        kinds: Iterable[CacheKind],
        owner: str = "<manual>",
        *,
        override: Iterable[str] = (),
    ) -> KindRegistry:
        """A registry of the given kinds, with no plugin manager behind it."""
        return cls(((kind, owner) for kind in kinds), override=override)

    # -- Mapping ----------------------------------------------------------
    def __getitem__(self, name: str) -> CacheKind:
        try:
            return self._kinds[name]
        except KeyError:
            msg = (
                f"no cache kind named {name!r}{did_you_mean(name, self._kinds)}; "
                f"known kinds: {self._known()}. Is "
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

    def override_notes(self, kinds: Iterable[str] | None = None) -> list[str]:
        """One line per overridden kind (of ``kinds``, default all), for a
        plan's report: the plan then says which plugin's kind it used."""
        wanted = None if kinds is None else set(kinds)
        return [
            f"kind {name!r} is overridden: {by} replaces {replaced} ({OVERRIDE_ENV})"
            for name, (replaced, by) in sorted(self.overridden.items())
            if wanted is None or name in wanted
        ]

    def distribution(self, name: str) -> str | None:
        """``"dist version"`` of the plugin that registered kind ``name``
        (``None`` when it has none)."""
        return self._distributions.get(self.owner(name))

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
            f"plugin provides{did_you_mean(name, self._kinds)}; known kinds: "
            f"{self._known()}. Install or register "
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

    def engine_estimate(
        self,
        policy: str,
        config: EngineConfig,
        specs: Mapping[str, KVCacheSpec],
        available_memory: int,
        contexts: Sequence[int],
    ) -> EngineEstimate | None:
        """Ask plugins what an engine's own planner does
        (``kvcore_engine_estimate``); ``None`` when no plugin models
        ``policy``."""
        if self._pm is None:
            return None
        hook = self._pm.hook.kvcore_engine_estimate
        result: EngineEstimate | None = hook(
            policy=policy,
            config=config,
            specs=specs,
            available_memory=available_memory,
            contexts=list(contexts),
        )
        return result


def _names(values: Iterable[str], what: str) -> list[str]:
    names: list[object] = [values] if isinstance(values, str) else list(values)
    for name in names:
        if not isinstance(name, str):
            msg = f"{what} takes kind names (str), got {name!r}"
            raise KvcoreTypeError(msg)
    return [str(name) for name in names]


def _split(value: str | None) -> list[str]:
    return [part.strip() for part in (value or "").split(",") if part.strip()]


def _registered_kinds(
    function: Callable[[], object], owner: str, distribution: str | None
) -> list[Any]:
    """Call one plugin's ``kvcore_register_kinds``; its answer must be a list
    or tuple (of kinds, checked next)."""
    who = describe_plugin(owner, distribution)
    try:
        kinds = function()
    except Exception as exc:
        text = f"kvcore {who} raised in kvcore_register_kinds: "
        text += f"{type(exc).__name__}: {exc}"
        raise PluginError.blockable(text, owner, distribution) from exc
    if not isinstance(kinds, list | tuple):
        msg = (
            f"kvcore {who}: kvcore_register_kinds returned {echo(kinds)} "
            f"({type(kinds).__name__}); it must return a list of kind objects "
            "(kvcore.kinds.CacheKind instances), e.g. [MyKind()], or [] for none"
        )
        raise PluginResultError(msg, plugin_name=owner, distribution=distribution)
    return list(kinds)


def _check_kind(kind: Any, owner: str, distribution: str | None = None) -> None:
    """A kind object and its classes, checked once as it is registered."""
    problem = _kind_problem(kind)
    if problem is not None:
        who = describe_plugin(owner, distribution)
        msg = f"kvcore {who}: {problem}"
        raise PluginResultError.blockable(msg, owner, distribution)


def _kind_problem(kind: Any) -> str | None:
    """The first rule ``kind`` breaks, or ``None``."""
    if not isinstance(kind, CacheKind):
        return (
            f"registered {echo(kind)}, which is not a kvcore.kinds.CacheKind "
            "instance; return kind objects from kvcore_register_kinds"
        )
    spec_type = getattr(kind, "spec_type", None)
    name = getattr(kind, "name", None)
    if not isinstance(name, str) or not name:
        return f"registered a kind with no name: {echo(kind)}; set its name"
    if not (isinstance(spec_type, type) and issubclass(spec_type, KVCacheSpec)):
        return (
            f"kind {name!r} has spec_type={spec_type!r}; it must be a "
            "KVCacheSpec subclass"
        )
    if spec_type.kind != name:
        return (
            f"kind {name!r} owns {spec_type.__name__}, whose kind tag is "
            f"{spec_type.kind!r}; set {spec_type.__name__}.kind = {name!r}"
        )
    if "__attrs_attrs__" not in spec_type.__dict__:
        return (
            f"kind {name!r} owns {spec_type.__name__}, which is not an attrs "
            "class of its own; decorate it with @attrs.frozen(kw_only=True)"
        )
    if spec_type.__setattr__ is not KVCacheSpec.__setattr__:
        return (
            f"kind {name!r} owns {spec_type.__name__}, which is not frozen (it "
            "sets its own __setattr__); specs are shared and hashed, so they "
            "must be immutable: decorate it with @attrs.frozen(kw_only=True)"
        )
    manager = getattr(kind, "manager_type", None)
    if manager is not None:
        from kvcore.coordinator.manager import SingleTypeManager

        if not (isinstance(manager, type) and issubclass(manager, SingleTypeManager)):
            return (
                f"kind {name!r} has manager_type={echo(manager)}; it must be a "
                "kvcore.coordinator.SingleTypeManager subclass (or None)"
            )
    return None


@functools.cache
def default_registry() -> KindRegistry:
    """A registry from a default plugin manager, built once per process.

    A convenience for scripts; libraries and tests should build and pass
    their own registry.
    """
    from kvcore.plugins import get_plugin_manager

    return KindRegistry.from_plugin_manager(get_plugin_manager())
