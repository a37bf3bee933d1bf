"""Model files of real public models' cache layers, shipped with kvcore.

``path(name)`` finds one by file stem (``"deepseek-v4-flash"``); ``names()``
lists them.  See ``README.md`` here for the format and how the layers were
derived from public configs.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from kvcore.errors import KvcoreKeyError

__all__ = ["names", "path"]


def _dir() -> Path:
    return Path(str(resources.files(__name__)))


def names() -> list[str]:
    """Stems of the shipped model files, sorted."""
    return sorted(p.stem for p in _dir().glob("*.json"))


def path(name: str) -> Path:
    """The model file named ``name`` (a stem such as ``"gemma-3-27b"``)."""
    candidate = _dir() / f"{name}.json"
    if not candidate.is_file():
        msg = f"no shipped model file {name!r}; known: {', '.join(names())}"
        raise KvcoreKeyError(msg)
    return candidate
