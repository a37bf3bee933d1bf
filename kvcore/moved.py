"""Old module names, kept working after the tools and integrations moved
into folders of their own.

``import kvcore.zoo`` (and ``from kvcore.simulate.trace import ...``) still
works: the old name is the module at its new place, the very same object,
with a :class:`DeprecationWarning` that names where to import it from.  The
core imports none of these modules; a name is resolved only when a caller
imports it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED", "install", "new_name"]

#: Old module name -> where it lives now (its submodules moved with it).
MOVED: dict[str, str] = {
    "kvcore.accelerators": "kvcore.tools.accelerators",
    "kvcore.cli": "kvcore.tools.cli",
    "kvcore.distributed": "kvcore.integrations.distributed",
    "kvcore.mapping": "kvcore_hf.mapping",
    "kvcore.picture": "kvcore.tools.picture",
    "kvcore.plan.stages": "kvcore.integrations.stages",
    "kvcore.report": "kvcore.tools.report",
    "kvcore.simulate": "kvcore.tools.simulate",
    "kvcore.summary": "kvcore.tools.summary",
    "kvcore.units": "kvcore.tools.units",
    "kvcore.zoo": "kvcore.tools.zoo",
}


def new_name(old: str) -> str | None:
    """Where module ``old`` lives now, or None when it did not move."""
    for prefix, new in MOVED.items():
        if old == prefix or old.startswith(prefix + "."):
            return new + old[len(prefix) :]
    return None


class _MovedLoader(importlib.abc.Loader):
    """Loads an old name as the module at its new place."""

    def __init__(self, new: str) -> None:
        self.new = new
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} has moved to {self.new}; import it from there "
            "(the old name will be removed)",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system gave the module the old name's spec: it keeps
        # its own (the module runs once, under its new name).
        module.__spec__ = self.spec


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Finds old names before the path finder would load a second copy of
    a moved module's submodule under its old name."""

    def find_spec(
        self,
        fullname: str,
        path: object = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("kvcore."):
            return None
        new = new_name(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _MovedLoader(new))


_FINDER = _MovedFinder()


def install() -> None:
    """Put the finder of old names first on ``sys.meta_path`` (once)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
