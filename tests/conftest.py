"""Shared test setup: the examples directory is importable (its model builders
are reused by tests), and a registry of the kinds the shipped model files use."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

import kvcore

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

THIRD_PARTY = EXAMPLES / "third_party_plugin"


@pytest.fixture(scope="session")
def zoo_registry() -> kvcore.KindRegistry:
    """Built-in kinds plus the example third-party kind the Llama-4 file
    needs, registered explicitly (nothing else installed counts)."""
    sys.path.insert(0, str(THIRD_PARTY))
    try:
        plugin = importlib.import_module("kvcore_chunked_local")
    finally:
        sys.path.remove(str(THIRD_PARTY))
    pm = kvcore.get_plugin_manager(load_entrypoints=False)
    if pm.get_plugin("chunked_local_attention") is None:
        pm.register(plugin, name="chunked_local_attention")
    return kvcore.KindRegistry.from_plugin_manager(pm)
