"""Shared test setup: the examples directory is importable (its model builders
are reused by tests), a registry of the built-in kinds, and a registry of the
kinds the shipped model files use (the built-in ones).

The suite does not depend on what else is installed: while it runs,
``KVCORE_DISABLE_PLUGIN_AUTOLOAD=1`` keeps third-party entry points (the
example plugin, if pip-installed) out of ``kvcore.default_registry()`` and of
every CLI run; tests of discovery ask for entry points explicitly.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import coordinator_setup
import pytest

import kvcore

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

_AUTOLOAD = "KVCORE_DISABLE_PLUGIN_AUTOLOAD"
_saved_autoload: list[str | None] = []


def pytest_configure(config: pytest.Config) -> None:
    """Before collection (some modules build a registry at import): only the
    built-in kinds in the default registry."""
    _saved_autoload.append(os.environ.get(_AUTOLOAD))
    os.environ[_AUTOLOAD] = "1"
    kvcore.default_registry.cache_clear()


def pytest_unconfigure(config: pytest.Config) -> None:
    saved = _saved_autoload.pop() if _saved_autoload else None
    if saved is None:
        os.environ.pop(_AUTOLOAD, None)
    else:
        os.environ[_AUTOLOAD] = saved
    kvcore.default_registry.cache_clear()


@pytest.fixture(autouse=True)
def _plain_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Output is read as a pipe's, whatever terminal the suite runs in: no
    width or colour the environment forces (a test that means one sets it)."""
    for name in ("COLUMNS", "LINES", "FORCE_COLOR"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def builtin_registry() -> kvcore.KindRegistry:
    """kvcore's built-in kinds only, whatever is installed: for tests that do
    not mean to test discovery."""
    return coordinator_setup.builtin_registry()


@pytest.fixture(scope="session")
def zoo_registry() -> kvcore.KindRegistry:
    """The kinds the shipped model files use: kvcore's built-in ones (every
    file plans with nothing else installed)."""
    return coordinator_setup.builtin_registry()
