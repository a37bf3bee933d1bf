"""The plugin docs document every hook with its exact signature."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from kvcore import hookspecs

DOCS = Path(__file__).resolve().parent.parent / "docs" / "plugins.md"
HOOKS = [name for name in dir(hookspecs) if name.startswith("kvcore_")]


def test_there_are_hooks() -> None:
    assert "kvcore_register_kinds" in HOOKS


@pytest.mark.parametrize("name", HOOKS)
def test_hook_is_documented_with_its_signature(name: str) -> None:
    params = inspect.signature(getattr(hookspecs, name)).parameters
    heading = f"### {name}({', '.join(params)})"
    assert heading in DOCS.read_text().splitlines()
