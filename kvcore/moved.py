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
import importlib.util
import sys
import warnings
from types import CodeType, ModuleType
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec

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


class _MovedLoader:
    """Loads an old name as the module at its new place, found as ``spec``.

    (A plain class: ``importlib.abc`` would pull ``importlib.resources``,
    ``tempfile`` and ``shutil`` into every ``import kvcore``.)"""

    def __init__(self, spec: ModuleSpec) -> None:
        self.spec = spec

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} has moved to {self.spec.name}; import it from there "
            "(the old name will be removed)",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(self.spec.name)
        if module.__spec__ is not None:
            self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system gave the module the old name's spec: it keeps
        # its own (the module runs once, under its new name).
        module.__spec__ = self.spec

    def get_code(self, fullname: str) -> CodeType | None:
        """The new module's code: what ``python -m`` runs under an old name."""
        loader = self.spec.loader
        get_code = getattr(loader, "get_code", None)
        if get_code is None:
            msg = f"no code object available for {fullname} ({self.spec.name})"
            raise ImportError(msg, name=fullname)
        code: CodeType | None = get_code(self.spec.name)
        return code


class _MovedFinder:
    """Finds old names before the path finder would load a second copy of
    a moved module's submodule under its old name."""

    def find_spec(
        self,
        fullname: str,
        path: object = None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        if not fullname.startswith("kvcore."):
            return None
        new = new_name(fullname)
        if new is None:
            return None
        # What exists at the new place exists under the old name, a
        # package as a package (``python -m`` runs its ``__main__``).
        found = importlib.util.find_spec(new)
        if found is None:
            return None
        return importlib.util.spec_from_loader(
            fullname,
            # A loader by its methods (the import system asks no more).
            cast("Loader", _MovedLoader(found)),
            origin=found.origin,
            is_package=found.submodule_search_locations is not None,
        )


_FINDER = _MovedFinder()


def install() -> None:
    """Put the finder of old names first on ``sys.meta_path`` (once)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
