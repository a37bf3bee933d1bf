"""The example third-party plugin (``examples/third_party_plugin``), loaded
the way kvcore loads an installed distribution: through the entry point its
``pyproject.toml`` declares in group ``kvcore``.  Nothing is installed; the
distribution's metadata (what ``pip install`` would write) lives in a
temporary folder while the plugin manager is built."""

from __future__ import annotations

import contextlib
import importlib
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import kvcore

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "third_party_plugin"
PYPROJECT = tomllib.loads((EXAMPLE / "pyproject.toml").read_text(encoding="utf-8"))
#: The example's distribution name and version, as its pyproject declares.
DISTRIBUTION: str = PYPROJECT["project"]["name"]
VERSION: str = PYPROJECT["project"]["version"]
#: Entry-point name to module, from ``[project.entry-points.kvcore]``.
ENTRY_POINTS: dict[str, str] = PYPROJECT["project"]["entry-points"]["kvcore"]


@contextlib.contextmanager
def example_installed() -> Iterator[Path]:
    """The example importable and its distribution's metadata on
    ``sys.path`` (yields the folder to add to ``PYTHONPATH``, in that order,
    for a subprocess)."""
    with tempfile.TemporaryDirectory() as tmp:
        info = Path(tmp) / f"{DISTRIBUTION.replace('-', '_')}-{VERSION}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {DISTRIBUTION}\nVersion: {VERSION}\n"
        )
        lines = [f"{name} = {module}" for name, module in ENTRY_POINTS.items()]
        (info / "entry_points.txt").write_text("[kvcore]\n" + "\n".join(lines) + "\n")
        added = [str(EXAMPLE), tmp]
        sys.path[:0] = added
        importlib.invalidate_caches()
        try:
            yield Path(tmp)
        finally:
            for path in added:
                sys.path.remove(path)
            importlib.invalidate_caches()


def example_registry() -> kvcore.KindRegistry:
    """kvcore's built-in kinds and the example's, every other installed
    third-party plugin blocked (nothing else installed counts)."""
    with example_installed():
        others = [
            ep.name
            for ep in metadata.entry_points(group=kvcore.plugins.ENTRY_POINT_GROUP)
            if ep.dist is not None and ep.dist.name not in ("kvcore", DISTRIBUTION)
        ]
        pm = kvcore.get_plugin_manager(load_entrypoints=True, block=others)
        return kvcore.KindRegistry.from_plugin_manager(pm, override=())
