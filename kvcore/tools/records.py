"""The JSON form of the tools' result records, read off by name."""

from __future__ import annotations

from collections.abc import Mapping
from operator import attrgetter
from typing import Any, ClassVar

__all__ = ["Record", "record"]


class Record:
    """A result record whose JSON form is :func:`record` of its
    :attr:`json_fields`."""

    __slots__ = ()

    #: The fields :meth:`to_dict` writes, as :func:`record` takes them.
    json_fields: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        return record(self, self.json_fields)


def record(obj: object, fields: str) -> dict[str, Any]:
    """``obj``'s values as a JSON-ready dict, keyed in the order ``fields``
    lists them (space-separated).  A field is an attribute or property name,
    or ``key=path`` to store the dotted attribute ``path`` under ``key``.
    Tuples become lists, mappings dicts, and a value with a ``to_dict``
    method (also inside a tuple) its dict."""
    out: dict[str, Any] = {}
    for field in fields.split():
        key, _, path = field.partition("=")
        out[key] = _plain(attrgetter(path or key)(obj))
    return out


def _plain(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return dict(value)
    return value
