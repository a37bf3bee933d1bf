"""Model files of real public models' cache layers, shipped with kvcore.

``path(name)`` finds one by file stem (``"deepseek-v4-flash"``); ``names()``
lists them.  See ``README.md`` here for the format and how the layers were
derived from public configs.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

from kvcore.errors import KvcoreKeyError, did_you_mean, echo

__all__ = ["names", "normalize", "path"]


def _dir() -> Path:
    return Path(str(resources.files(__name__)))


def names() -> list[str]:
    """Stems of the shipped model files, sorted."""
    return sorted(p.stem for p in _dir().glob("*.json"))


def path(name: str) -> Path:
    """The model file named ``name`` (a stem such as ``"gemma-3-27b"``).

    Only the names :func:`names` lists are found: a name is never joined to
    the folder as a path, so ``"../../etc/x"`` cannot reach outside it."""
    known = names()
    stem = normalize(name)
    if stem not in known:
        hint = did_you_mean(stem, known)
        msg = f"no shipped model file {echo(name)}{hint}; known: {', '.join(known)}"
        raise KvcoreKeyError(msg)
    return _dir() / f"{stem}.json"


def normalize(name: str) -> str:
    """The file stem a shipped model's name means: ``"Llama-3.1-8B"`` (the
    name kvcore prints) and ``"llama_3.1_8b"`` are ``"llama-3-1-8b"``."""
    return re.sub(r"[\s._\-]+", "-", name.strip().lower()).strip("-")
