"""``kvcore kinds`` and ``kvcore plugins``: what is installed."""

from __future__ import annotations

import argparse
import json

from kvcore.plugins import get_plugin_manager, plugin_distribution
from kvcore.registry import KindRegistry

__all__ = ["register"]


def _registry() -> tuple[KindRegistry, object]:
    pm = get_plugin_manager()
    return KindRegistry.from_plugin_manager(pm), pm


def _cmd_kinds(args: argparse.Namespace) -> int:
    registry, _ = _registry()
    rows = [
        {"kind": name, "spec": kind.spec_type.__name__, "plugin": registry.owner(name)}
        for name, kind in registry.items()
    ]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for row in rows:
            print(f"{row['kind']:<26} {row['spec']:<24} {row['plugin']}")
    return 0


def _cmd_plugins(args: argparse.Namespace) -> int:
    registry, pm = _registry()
    rows = []
    for name, plugin in sorted(pm.list_name_plugin()):  # type: ignore[attr-defined]
        if plugin is None:
            continue
        kinds = [k for k in registry if registry.owner(k) == name]
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or ())  # type: ignore[attr-defined]
        rows.append(
            {
                "name": name,
                "distribution": plugin_distribution(pm, name),  # type: ignore[arg-type]
                "hooks": hooks,
                "kinds": kinds,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for row in rows:
            print(
                f"{row['name']:<20} {row['distribution'] or '-':<22} kinds: {', '.join(row['kinds'])}"
            )
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    kinds = sub.add_parser("kinds", help="list the registered cache kinds")
    kinds.add_argument("--json", action="store_true", help="print JSON")
    kinds.set_defaults(func=_cmd_kinds)
    plugins = sub.add_parser("plugins", help="list the loaded plugins")
    plugins.add_argument("--json", action="store_true", help="print JSON")
    plugins.set_defaults(func=_cmd_plugins)
