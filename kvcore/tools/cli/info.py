"""``kvcore kinds`` and ``kvcore plugins``: what is installed."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvcore.errors import KvcoreError
from kvcore.plugins import get_plugin_manager, plugin_distribution
from kvcore.registry import KindRegistry

__all__: list[str] = []


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
        # Columns as wide as their longest entry, so a long name never
        # runs into the next column.
        kind_width = max((len(row["kind"]) for row in rows), default=0)
        spec_width = max((len(row["spec"]) for row in rows), default=0)
        for row in rows:
            print(
                f"{row['kind']:<{kind_width}}  {row['spec']:<{spec_width}}  "
                f"{row['plugin']}"
            )
    return 0


def _cmd_plugins(args: argparse.Namespace) -> int:
    """Every plugin, loaded or broken: one that fails to import, register or
    check is listed with its error instead of hiding the others."""
    errors: list[KvcoreError] = []
    pm = get_plugin_manager(errors=errors)
    registry = KindRegistry.from_plugin_manager(pm, errors=errors)
    broken: dict[str, list[str]] = {}
    for error in errors:
        name = getattr(error, "plugin_name", None) or getattr(error, "second", "?")
        broken.setdefault(str(name), []).append(str(error))
    rows: list[dict[str, Any]] = []
    for name, plugin in sorted(pm.list_name_plugin()):
        if plugin is None:
            continue
        kinds = [k for k in registry if registry.owner(k) == name]
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or ())
        rows.append(
            {
                "name": name,
                "distribution": plugin_distribution(pm, name),
                "hooks": hooks,
                "kinds": kinds,
                "errors": broken.pop(name, []),
            }
        )
    for name, messages in sorted(broken.items()):  # failed before registering
        shown = next(
            (
                getattr(e, "distribution", None)
                for e in errors
                if getattr(e, "plugin_name", None) == name
            ),
            None,
        )
        rows.append(
            {
                "name": name,
                "distribution": shown,
                "hooks": [],
                "kinds": [],
                "errors": messages,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for row in rows:
            status = "BROKEN" if row["errors"] else "ok"
            print(
                f"{row['name']:<20} {row['distribution'] or '-':<22} {status:<7} "
                f"kinds: {', '.join(row['kinds']) or '-'}"
            )
            for message in row["errors"]:
                print(f"    error: {message}")
    if args.check and any(row["errors"] for row in rows):
        count = sum(1 for row in rows if row["errors"])
        print(f"kvcore: error: {count} plugin(s) broken", file=sys.stderr)
        return 1
    return 0
