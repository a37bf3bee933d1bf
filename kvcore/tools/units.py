"""Sizes and token counts as people write them: ``80GiB``, ``64GB``, ``32k``.

Byte sizes take IEC prefixes (``KiB``, ``MiB``, ``GiB``, ``TiB``: powers of
1024) or SI ones (``KB``/``kB``, ``MB``, ``GB``, ``TB``: powers of 1000), as
vendors and engines print them; a bare number is bytes.  Token counts take
``k`` and ``m`` as powers of 1024 (``32k`` is 32768, the length model cards
mean), so a context written either way lands on the same number.

Every parse is strict: NaN, infinity, zero, negatives, fractions of a byte
or token and trailing junk are refused with a message that shows the forms
accepted.  The parsers are small and exact, which no maintained units
library offers for both conventions without pulling in a unit system.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

from kvcore.errors import KvcoreValueError
from kvcore.limits import TOKEN_ID_LIMIT

__all__ = [
    "UnitError",
    "format_size",
    "format_tokens",
    "parse_size",
    "parse_tokens",
    "parse_fraction",
]

#: Multipliers of the byte units, lower-cased.
SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "p": 1000**5,
    "pb": 1000**5,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "pib": 1024**5,
}

#: Multipliers of the token units, lower-cased.
TOKEN_UNITS = {"": 1, "k": 1024, "m": 1024**2}

_NUMBER = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")


class UnitError(KvcoreValueError):
    """A size, token count or fraction does not parse or is out of range."""


def _split(text: object, what: str, example: str) -> tuple[Decimal, str]:
    if isinstance(text, bool) or not isinstance(text, str | int | float):
        msg = f"{what} must be written like {example}, got {text!r}"
        raise UnitError(msg)
    if isinstance(text, float) and not math.isfinite(text):
        msg = f"{what} must be a finite positive amount like {example}, got {text!r}"
        raise UnitError(msg)
    match = _NUMBER.match(str(text))
    if match is None:
        msg = (
            f"{what} must be a positive number with an optional unit, like "
            f"{example}; got {text!r}"
        )
        raise UnitError(msg)
    try:
        value = Decimal(match.group(1))
    except InvalidOperation as exc:  # pragma: no cover - the pattern forbids it
        msg = f"{what}: cannot read the number in {text!r}"
        raise UnitError(msg) from exc
    return value, match.group(2).lower()


def _parse(
    text: str | int,
    *,
    what: str,
    units: dict[str, int],
    example: str,
    unit_help: str,
    noun: str,
    maximum: int,
    allow_zero: bool = False,
) -> int:
    """A positive whole count of ``noun`` written with one of ``units``, at
    most ``maximum``."""
    value, unit = _split(text, what, example)
    if unit not in units:
        msg = f"{what}: unknown unit {unit!r} in {text!r}; {unit_help}, like {example}"
        raise UnitError(msg)
    total = value * units[unit]
    if total != total.to_integral_value():
        msg = f"{what} {text!r} is not a whole number of {noun}"
        raise UnitError(msg)
    if total < 0 or (total == 0 and not allow_zero):
        msg = f"{what} must be positive, got {text!r}"
        raise UnitError(msg)
    if total > maximum:
        msg = f"{what} {text!r} is more than {maximum:,} {noun}; check the unit"
        raise UnitError(msg)
    return int(total)


#: The largest size accepted (an exbibyte: beyond any machine).
MAX_SIZE = 2**60
#: The largest token count accepted: token counts follow the token rule,
#: ints in ``[0, 2**32)`` (see :func:`check_token_count`).
MAX_TOKENS = TOKEN_ID_LIMIT - 1


def parse_size(
    text: str | int, *, what: str = "memory", allow_zero: bool = False
) -> int:
    """``"80GiB"`` -> ``85899345920``; ``"64GB"`` -> ``64000000000``."""
    return _parse(
        text,
        what=what,
        units=SIZE_UNITS,
        example="80GiB, 64GB, 1.5TiB or 85899345920",
        unit_help="use B, KiB, MiB, GiB, TiB, PiB (powers of 1024) or KB, MB, GB, TB, PB "
        "(powers of 1000)",
        noun="bytes",
        maximum=MAX_SIZE,
        allow_zero=allow_zero,
    )


def parse_tokens(text: str | int, *, what: str = "context") -> int:
    """``"32k"`` -> ``32768``; ``"4096"`` -> ``4096``."""
    return _parse(
        text,
        what=what,
        units=TOKEN_UNITS,
        example="4096, 4k, 32k or 1m",
        unit_help="token counts take k (1024) or m (1024*1024)",
        noun="tokens",
        maximum=MAX_TOKENS,
    )


def parse_fraction(text: str | float, *, what: str) -> float:
    """A fraction in ``(0, 1]`` (``"0.9"``), refusing NaN and infinity."""
    try:
        value = float(text)
    except (TypeError, ValueError) as exc:
        msg = f"{what} must be a number in (0, 1] such as 0.9, got {text!r}"
        raise UnitError(msg) from exc
    if not math.isfinite(value) or not 0 < value <= 1:
        msg = f"{what} must be in (0, 1] such as 0.9, got {text!r}"
        raise UnitError(msg)
    return value


def format_size(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"`` (IEC units, as the pool is sized)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover


def format_tokens(n: int) -> str:
    """``32768`` -> ``"32k"``; ``1000`` -> ``"1000"`` (exact or plain)."""
    for unit, size in (("m", 1024**2), ("k", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)
