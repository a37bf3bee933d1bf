"""Errors for a manager's answer that the core refuses where it crosses in:
each names the manager class (its module is its plugin), the method, what
it returned (shortened) and the rule."""

from __future__ import annotations

from typing import Any

from kvcore.errors import PluginResultError

__all__ = ["result_error", "shown"]


def shown(value: object) -> str:
    """``repr(value)``, cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def result_error(manager: Any, method: str, problem: str) -> PluginResultError:
    """``{module}.{class}.{method} {problem}``, raised as the plugin's."""
    owner = f"{type(manager).__module__}.{type(manager).__qualname__}"
    return PluginResultError(
        f"{owner}.{method} {problem}", plugin_name=type(manager).__module__
    )
