"""The built-in mappers' identities as data: ``mappers.toml``.

A mapper's identity is what it recognises (``architectures``,
``model_types``) and the public source of each rule it applies
(``sources``, copied into every model file it maps).  The built-in mappers
keep theirs in one table, ``mappers.toml`` next to this module, rather than
in each class body; a citation more than one mapper gives stands once under
``[shared]`` and is cited as ``"@<key>"``.  A class takes its entry with
:func:`declared`; its rules (:meth:`~kvcore_hf.mapping.ModelMapper.layer_specs`)
stay in its family module.  Third-party mappers set the same class
attributes directly (see :class:`kvcore_hf.mapping.ModelMapper`).
"""

from __future__ import annotations

import functools
import tomllib
from collections.abc import Callable
from importlib.resources import files
from typing import Any, TypeVar

import attrs

from kvcore.errors import PluginError
from kvcore_hf.mapping import ModelMapper

__all__ = ["CATALOG_FILE", "Identity", "catalog", "declared"]

#: The table's file name, in the ``kvcore_hf`` package.
CATALOG_FILE = "mappers.toml"

_M = TypeVar("_M", bound=type[ModelMapper])


@attrs.frozen
class Identity:
    """One mapper's entry of the table."""

    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    sources: tuple[str, ...]


def _strings(
    name: str, field: str, value: Any, shared: dict[str, str]
) -> tuple[str, ...]:
    """``value`` as a tuple of strings, ``"@key"`` replaced by its shared
    citation; a PluginError naming the entry and field otherwise."""
    where = f"kvcore_hf/{CATALOG_FILE}: mapper {name!r} field {field!r}"
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        msg = f"{where} must be a list of strings, got {value!r}"
        raise PluginError(msg, plugin_name="hf")
    out = []
    for item in value:
        if item.startswith("@"):
            if item[1:] not in shared:
                msg = (
                    f"{where} cites {item!r}, which [shared] does not define; "
                    f"add it there or write the citation out"
                )
                raise PluginError(msg, plugin_name="hf")
            item = shared[item[1:]]
        out.append(item)
    return tuple(out)


@functools.cache
def catalog() -> dict[str, Identity]:
    """Every entry of ``mappers.toml``, by mapper name, in file order."""
    data = tomllib.loads(files("kvcore_hf").joinpath(CATALOG_FILE).read_text("utf-8"))
    shared: dict[str, str] = data.get("shared", {})
    out: dict[str, Identity] = {}
    for name, entry in data.get("mapper", {}).items():
        unknown = set(entry) - {"architectures", "model_types", "sources"}
        if unknown:
            msg = (
                f"kvcore_hf/{CATALOG_FILE}: mapper {name!r} has unknown fields "
                f"{sorted(unknown)}; an entry holds architectures, model_types "
                "and sources"
            )
            raise PluginError(msg, plugin_name="hf")
        out[name] = Identity(
            *(
                _strings(name, field, entry.get(field, []), shared)
                for field in ("architectures", "model_types", "sources")
            )
        )
    return out


def declared(name: str) -> Callable[[_M], _M]:
    """A class decorator: the mapper is ``name``, with the architectures,
    model types and sources of its ``mappers.toml`` entry."""
    identity = catalog().get(name)
    if identity is None:
        msg = (
            f"kvcore_hf/{CATALOG_FILE} has no entry for mapper {name!r}; add a "
            f"[mapper.{name}] table with its architectures, model_types and sources"
        )
        raise PluginError(msg, plugin_name="hf")

    def apply(cls: _M) -> _M:
        cls.name = name
        cls.architectures = identity.architectures
        cls.model_types = identity.model_types
        cls.sources = identity.sources
        return cls

    return apply
