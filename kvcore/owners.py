"""Which plugin owns a spec class, and the errors that name it.

Every check where a kind's answer crosses into the core names the kind, its
plugin and distribution, and how to block the plugin.  The owners are
recorded as registries are built (:meth:`kvcore.KindRegistry.from_kinds`
and friends); this module imports nothing that loads plugins, so a module
the plugin machinery itself imports (serving choices, the planner's
declaration checks) can name a plugin without an import cycle.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TypeVar

from kvcore.errors import KvcoreError, PluginError, PluginResultError

__all__ = [
    "call_plugin",
    "declared",
    "describe_plugin",
    "owner_of",
    "record_owner",
    "spec_plugin_error",
]

_T = TypeVar("_T")

# Spec class -> (plugin, distribution) of the kind that owns it, filled as
# registries are built, so a check deep in the planner can name the plugin.
_OWNERS: weakref.WeakKeyDictionary[type, tuple[str, str | None]] = (
    weakref.WeakKeyDictionary()
)


def record_owner(spec_type: type, plugin: str, distribution: str | None) -> None:
    """Record that ``plugin`` (of ``distribution``) registered the kind whose
    spec class is ``spec_type``."""
    _OWNERS[spec_type] = (plugin, distribution)


def describe_plugin(plugin: str, distribution: str | None) -> str:
    """``plugin 'x' (distribution 'd 1.0')``, the way every message names one."""
    if distribution:
        return f"plugin {plugin!r} (distribution {distribution!r})"
    return f"plugin {plugin!r} (no distribution: registered by hand or from source)"


def owner_of(spec_type: type) -> tuple[str, str | None]:
    """``(plugin, distribution)`` of the kind owning ``spec_type``; the kind
    name and ``None`` for a class no registry has seen."""
    found = _OWNERS.get(spec_type)
    if found is not None:
        return found
    return (getattr(spec_type, "kind", "") or spec_type.__name__, None)


def spec_plugin_error(
    spec: object,
    rule: str,
    *,
    error: type[PluginError] = PluginResultError,
) -> PluginError:
    """The error for a spec's own code breaking ``rule``: names the kind, its
    plugin and distribution, and how to block the plugin."""
    plugin, distribution = owner_of(type(spec))
    kind = getattr(type(spec), "kind", "")
    msg = (
        f"cache kind {kind!r} ({type(spec).__name__}) of "
        f"{describe_plugin(plugin, distribution)}: {rule}. Fix the plugin, or "
        f"block it with KVCORE_DISABLE_PLUGINS={plugin}"
    )
    return error(msg, plugin_name=plugin, distribution=distribution)


def declared(spec: object, name: str) -> object:
    """``spec``'s attribute ``name`` (a property is plugin code), read
    through :func:`call_plugin`."""
    return call_plugin(spec, name, lambda: getattr(spec, name))


def call_plugin(spec: object, what: str, fn: Callable[[], _T]) -> _T:
    """Run plugin code ``what`` of ``spec``'s kind; an exception that is not a
    kvcore error (which plugins raise on purpose) is wrapped in a
    :class:`PluginError` naming the plugin, the original chained."""
    try:
        return fn()
    except KvcoreError:
        raise
    except Exception as exc:
        raise spec_plugin_error(
            spec, f"{what} raised {type(exc).__name__}: {exc}", error=PluginError
        ) from exc
