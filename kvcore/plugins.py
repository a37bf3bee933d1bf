"""Building kvcore's plugin manager.

Nothing here runs at import time: call :func:`get_plugin_manager` (or
:func:`kvcore.default_registry`) to load plugins.  The ``KVCORE_*``
environment variables it reads are listed in ``docs/plugins.md``.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable
from importlib import metadata
from typing import Any

import pluggy

from kvcore import hookspecs
from kvcore.errors import KvcoreError, PluginError, collect

__all__ = [
    "BUILTIN_PLUGINS",
    "ENTRY_POINT_GROUP",
    "get_plugin_manager",
    "plugin_distribution",
]

ENTRY_POINT_GROUP = "kvcore"
_OWN_DISTRIBUTION = "kvcore"

#: The built-in kinds: entry-point name to module.  They are registered through
#: kvcore's own entry points; this table is the fallback for a source checkout
#: that is not installed.
BUILTIN_PLUGINS: dict[str, str] = {
    "full_attention": "kvcore_full_attention",
    "mla": "kvcore_mla",
    "sliding_window": "kvcore_sliding_window",
    "mamba": "kvcore_mamba",
    "circular_buffer": "kvcore_circular_buffer",
    "hisparse": "kvcore_hisparse",
    "chunked_local": "kvcore_chunked_local",
    "cross_attention": "kvcore_cross_attention",
    "hf": "kvcore_hf",
    "vllm": "kvcore_vllm",
}


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def _split(value: str | None) -> list[str]:
    return [part.strip() for part in (value or "").split(",") if part.strip()]


def get_plugin_manager(
    *,
    load_entrypoints: bool | None = None,
    block: Iterable[str] = (),
    builtins: bool = True,
    errors: list[KvcoreError] | None = None,
) -> pluggy.PluginManager:
    """Build a fresh plugin manager with kvcore's hookspecs and plugins.

    kvcore's own entry points register first, then third-party ones.  A
    third-party entry point whose name another distribution already uses
    (``mamba``, say) is registered as ``name@distribution``, so it neither
    replaces the earlier plugin nor vanishes: if it registers a kind name
    already taken, building the registry raises
    :class:`~kvcore.errors.DuplicateKindError` naming both distributions
    (``KVCORE_OVERRIDE_KINDS`` is the explicit opt-in to let it replace it).

    :param load_entrypoints: load third-party ``kvcore`` entry points; the
        default follows ``KVCORE_DISABLE_PLUGIN_AUTOLOAD``.
    :param block: plugin names to block, on top of ``KVCORE_DISABLE_PLUGINS``.
    :param builtins: register kvcore's built-in kinds.
    :param errors: collect each plugin that fails to load here and go on
        without it, rather than raising the first (``kvcore plugins``).
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in [*_split(os.environ.get("KVCORE_DISABLE_PLUGINS")), *block]:
        pm.set_blocked(name)
    if load_entrypoints is None:
        load_entrypoints = not _truthy(os.environ.get("KVCORE_DISABLE_PLUGIN_AUTOLOAD"))

    def register(name: str, load: Any, distribution: str | None) -> None:
        try:
            _register(pm, name, load, distribution)
        except PluginError as exc:
            collect(errors, exc)

    entry_points = _entry_points()
    own = [ep for ep in entry_points if _is_own(ep)]
    others = [ep for ep in entry_points if not _is_own(ep)]
    # name -> (distribution, entry-point value) of what took the name
    taken: dict[str, tuple[str | None, str]] = {}
    if builtins:
        for ep in own:
            if pm.is_blocked(ep.name) or ep.name in taken:
                continue
            taken[ep.name] = (_dist_name(ep), ep.value)
            register(ep.name, lambda ep=ep: ep.load(), _dist_name(ep))
        for name, module in BUILTIN_PLUGINS.items():
            if name in taken or pm.is_blocked(name):
                continue
            taken[name] = (_OWN_DISTRIBUTION, module)
            register(name, lambda module=module: importlib.import_module(module), None)
    if load_entrypoints:
        for ep in others:
            dist = _dist_name(ep)
            name = ep.name
            if name in taken:
                if taken[name] == (dist, ep.value):
                    continue  # one distribution seen twice on the path
                name = f"{ep.name}@{dist or ep.value}"
            if pm.is_blocked(ep.name) or pm.is_blocked(name) or name in taken:
                continue
            taken[name] = (dist, ep.value)
            register(name, lambda ep=ep: ep.load(), dist)

    for module in _split(os.environ.get("KVCORE_PLUGINS")):
        if pm.is_blocked(module) or pm.get_plugin(module) is not None:
            continue
        register(module, lambda module=module: importlib.import_module(module), None)

    while True:
        try:
            pm.check_pending()
            break
        except pluggy.PluginValidationError as exc:
            plugin_name = pm.get_name(exc.plugin) or repr(exc.plugin)
            shown = plugin_distribution(pm, plugin_name)
            distribution = shown.rsplit(" ", 1)[0] if shown else None
            where = f" (distribution {distribution!r})" if distribution else ""
            msg = (
                f"kvcore plugin {plugin_name!r}{where} implements a hook kvcore does "
                f"not define: {exc}; hooks are listed in kvcore.hookspecs (all start "
                f"with 'kvcore_'). Fix the plugin, or block it with "
                f"KVCORE_DISABLE_PLUGINS={plugin_name}"
            )
            error = PluginError(msg, plugin_name=plugin_name, distribution=distribution)
            error.__cause__ = exc
            collect(errors, error)
            pm.unregister(exc.plugin)
    if _truthy(os.environ.get("KVCORE_TRACE_PLUGINS")):
        pm.trace.root.setwriter(lambda text: sys.stderr.write(text))
        pm.enable_tracing()
    return pm


def _dist_name(ep: metadata.EntryPoint) -> str | None:
    return ep.dist.name if ep.dist is not None else None


def _is_own(ep: metadata.EntryPoint) -> bool:
    dist = _dist_name(ep)
    return dist is not None and _normalise(dist) == _OWN_DISTRIBUTION


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-")


def _entry_points() -> list[metadata.EntryPoint]:
    return sorted(
        metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name
    )


def _register(
    pm: pluggy.PluginManager, name: str, load: Any, distribution: str | None
) -> None:
    where = f" (distribution {distribution!r})" if distribution else ""
    try:
        plugin = load()
    except Exception as exc:
        text = f"kvcore plugin {name!r}{where} failed to import: "
        text += f"{type(exc).__name__}: {exc}"
        fix = "fix or uninstall it, or "
        raise PluginError.blockable(text, name, distribution, fix) from exc
    try:
        pm.register(plugin, name=name)
    except (ValueError, pluggy.PluginValidationError) as exc:
        text = f"kvcore plugin {name!r}{where} could not be registered: {exc}"
        raise PluginError.blockable(text, name, distribution) from exc


def plugin_distribution(pm: pluggy.PluginManager, name: str) -> str | None:
    """``"dist-name version"`` of the distribution that provides plugin
    ``name``, or ``None`` for plugins registered by hand or from source."""
    plugin = pm.get_plugin(name)
    for registered, dist in pm.list_plugin_distinfo():
        if registered is plugin:
            return f"{dist.metadata['name']} {dist.version}"
    base, _, qualifier = name.partition("@")
    # Another distribution may use the same entry-point name: only the entry
    # point that loads this very module names its distribution.
    module = getattr(plugin, "__name__", None)
    for ep in _entry_points():
        if ep.name == base and ep.dist is not None:
            if qualifier and ep.dist.name != qualifier:
                continue
            if module is not None and ep.value.split(":")[0] != module:
                continue
            return f"{ep.dist.name} {ep.dist.version}"
    return None
