"""Exceptions raised by kvcore.

Every error subclasses :class:`KvcoreError` and the builtin that matches the
mistake (``ValueError``, ``KeyError``, ``TypeError``), so callers can catch
either.  Messages name the layer, field, request or plugin involved, the rule
that was broken and the fix.
"""

from __future__ import annotations

import difflib
import reprlib
from collections.abc import Callable, Iterable
from typing import Self

from kvcore.limits import MAX_ECHO_CHARS

_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxstring = _REPR.maxother = MAX_ECHO_CHARS
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = 8
_REPR.maxset = _REPR.maxfrozenset = _REPR.maxdeque = _REPR.maxarray = 8
_REPR.maxlong = 40


def escape_controls(text: str) -> str:
    """``text`` with every unprintable character (ESC, a newline, a bidi
    override) written as its Python escape, so no name from a file can
    drive the terminal an error is printed on."""
    if text.isprintable():
        return text
    return "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
        for ch in text
    )


def echo(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """A value as an error message quotes it: its repr, abbreviated
    (long lists show their first items), escaped, and cut to ``limit``
    characters with ``...``, so a two-million-item field gives a readable
    line, not megabytes."""
    if type(value) is int and value.bit_length() > 256:
        # Printing it may take long or be refused (the int-to-string limit).
        return f"an int of about {value.bit_length() * 30103 // 100000 + 1:,} digits"
    text = escape_controls(_REPR.repr(value))
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text


def did_you_mean(
    word: str, choices: Iterable[str], *, key: Callable[[str], str] = str.lower
) -> str:
    """``" (did you mean 'H100 80GB'?)"`` for the choices closest to ``word``
    (:func:`difflib.get_close_matches` on ``key`` of each), else ``""``."""
    by_key: dict[str, str] = {}
    for choice in choices:
        by_key.setdefault(key(choice), choice)
    close = difflib.get_close_matches(key(word), list(by_key), n=3, cutoff=0.6)
    if not close:
        return ""
    named = " or ".join(repr(by_key[k]) for k in close)
    return f" (did you mean {named}?)"


class KvcoreError(Exception):
    """Base class of every error kvcore raises."""


class KvcoreValueError(KvcoreError, ValueError):
    """A value breaks one of kvcore's rules."""


class KvcoreKeyError(KvcoreError, KeyError):
    """A name (layer, request, kind) is not known."""

    def __str__(self) -> str:
        # KeyError quotes its argument; keep the message readable.
        return str(self.args[0]) if self.args else ""


class KvcoreTypeError(KvcoreError, TypeError):
    """An object of the wrong type was passed."""


class InvalidSpecError(KvcoreValueError):
    """A cache spec's fields are inconsistent or out of range."""


class MergeError(KvcoreValueError):
    """Layers that must share one cache group have incompatible specs."""


class LayoutError(KvcoreValueError):
    """The KV-cache layout is unresolved, unknown or cannot express the plan."""


class PlanError(KvcoreValueError):
    """The model's layers cannot be planned into cache groups or blocks."""


class BlockSizeError(KvcoreValueError):
    """The scheduler or hash block size breaks a cache group's alignment."""


class UnknownKindError(KvcoreKeyError):
    """No registered plugin provides the named cache kind."""

    def __init__(self, message: str, *, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class DuplicateKindError(KvcoreValueError):
    """Two plugins register the same cache kind name."""

    def __init__(self, message: str, *, kind: str, first: str, second: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.first = first
        self.second = second


class PluginError(KvcoreValueError):
    """A plugin failed to import, register or answer a hook."""

    def __init__(
        self, message: str, *, plugin_name: str, distribution: str | None = None
    ) -> None:
        super().__init__(message)
        self.plugin_name = plugin_name
        self.distribution = distribution

    @classmethod
    def blockable(
        cls, text: str, plugin: str, distribution: str | None, fix: str = ""
    ) -> Self:
        """``text``, then how to block ``plugin`` (after ``fix``, another remedy
        worded to lead into it: ``"fix or uninstall it, or "``)."""
        msg = f"{text}; {fix}block it with KVCORE_DISABLE_PLUGINS={plugin}"
        return cls(msg, plugin_name=plugin, distribution=distribution)


def collect(errors: list[KvcoreError] | None, error: KvcoreError) -> None:
    """Raise ``error``, or add it to ``errors`` where the caller collects
    every broken plugin's error instead (``kvcore plugins``)."""
    if errors is None:
        raise error
    errors.append(error)


class SerializationError(KvcoreValueError):
    """A JSON document does not describe a valid spec, group or config."""


class UnsafePlanError(SerializationError, PlanError):
    """A plan that cannot be bound safely: a layer placed twice or nowhere,
    a tensor past its pool, or two live pages on one byte.  Raised wherever
    a plan enters a process (a file, another rank, the pool)."""


class NoFreeBlocksError(KvcoreValueError):
    """The block pool holds fewer free blocks than were asked for."""


class InvalidRequestError(KvcoreValueError):
    """A request was used against the rules of the block coordinator."""


class InvalidRequestTypeError(InvalidRequestError, KvcoreTypeError):
    """An argument of a scheduler call of the wrong type (a float or bool
    token count, say): an :class:`InvalidRequestError` that is also a
    ``TypeError``."""


class UnknownRequestError(KvcoreKeyError):
    """The coordinator holds no request with this id."""


class ReentrantCallError(KvcoreError, RuntimeError):
    """A cache manager called back into the ``KVCacheManager`` from inside a
    step; the nested call is refused and the outer step undone."""


class MissingExtraError(KvcoreError, ImportError):
    """An optional dependency is not installed; the message names the extra."""


class PluginResultError(PluginError, TypeError):
    """A plugin's hook or kind returned something of the wrong type or out of
    range; the message names the plugin, its distribution and the rule."""


class PluginBindError(PluginError, LayoutError):
    """A kind's view binder returned a view that does not lie inside its
    layer's region of the pool, or is not in the spec's dtype."""


def require_instance(value: object, cls: type | tuple[type, ...], what: str) -> None:
    """Refuse ``value`` by type at a public entry point: a
    :class:`KvcoreTypeError` naming ``what`` (``"plan_kv_cache: config"``),
    the type expected and the type given."""
    if not isinstance(value, cls):
        names = (
            " or ".join(c.__name__ for c in cls)
            if isinstance(cls, tuple)
            else cls.__name__
        )
        msg = (
            f"{what} must be of type {names}, got {type(value).__name__} {echo(value)}"
        )
        raise KvcoreTypeError(msg)
