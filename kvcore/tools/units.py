"""Sizes and token counts as people write them: ``80GiB``, ``64GB``, ``32k``.

One-letter suffixes follow vLLM's rule (``human_readable_int`` in
``vllm/utils/argparse_utils.py``): lower case is decimal (``k`` = 1,000,
``m`` = 10**6, ``g`` = 10**9, ``t`` = 10**12), upper case is binary (``K`` =
1,024, ``M`` = 2**20, ``G`` = 2**30, ``T`` = 2**40), for token counts and
byte sizes alike, so ``32k`` is 32,000 tokens, ``32K`` is 32,768 and
``--memory 80G`` is 80 GiB, as vLLM reads the same text.  Byte sizes also
take the spelled-out units, whose case does not matter: IEC (``KiB``,
``MiB``, ``GiB``, ``TiB``, ``PiB``: powers of 1024) or SI (``KB``, ``MB``,
``GB``, ``TB``, ``PB``: powers of 1000); a bare number is bytes.

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
from kvcore.limits import MAX_BYTE_OFFSET, TOKEN_ID_LIMIT

__all__ = [
    "UnitError",
    "format_size",
    "format_sizes",
    "format_tokens",
    "parse_size",
    "parse_tokens",
    "parse_fraction",
]

#: vLLM's one-letter suffixes, case-sensitive: lower case decimal, upper
#: case binary (``vllm.utils.argparse_utils.human_readable_int``).
LETTER_UNITS = {
    "": 1,
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
    "t": 1000**4,
    "K": 1024,
    "M": 1024**2,
    "G": 1024**3,
    "T": 1024**4,
}

#: The spelled-out byte units, matched in any case.
SPELLED_SIZE_UNITS = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "pb": 1000**5,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "pib": 1024**5,
}

#: Multipliers of the byte units: one letter by vLLM's case rule, spelled
#: units in any case (see :func:`_unit`).
SIZE_UNITS = {**LETTER_UNITS, **SPELLED_SIZE_UNITS}

#: Multipliers of the token units (vLLM's one-letter rule).
TOKEN_UNITS = dict(LETTER_UNITS)

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
    return value, match.group(2)


def _unit(unit: str, units: dict[str, int]) -> str | None:
    """The key of ``units`` that ``unit`` names: one letter as written
    (its case is its meaning), a spelled-out unit in any case."""
    if unit in units and len(unit) <= 1:
        return unit
    if unit == "B" and "b" in units:
        return "b"
    if len(unit) > 1 and unit.lower() in units:
        return unit.lower()
    return None


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
    value, written = _split(text, what, example)
    unit = _unit(written, units)
    if unit is None:
        msg = (
            f"{what}: unknown unit {written!r} in {text!r}; {unit_help}, like {example}"
        )
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
MAX_SIZE = MAX_BYTE_OFFSET
#: The largest token count accepted: token counts follow the token rule,
#: ints in ``[0, 2**32)`` (see :func:`check_token_count`).
MAX_TOKENS = TOKEN_ID_LIMIT - 1


def parse_size(
    text: str | int, *, what: str = "memory", allow_zero: bool = False
) -> int:
    """``"80GiB"`` and ``"80G"`` -> ``85899345920``; ``"64GB"`` and ``"64g"``
    -> ``64000000000``."""
    return _parse(
        text,
        what=what,
        units=SIZE_UNITS,
        example="80GiB, 64GB, 80G, 1.5TiB or 85899345920",
        unit_help="use B, KiB, MiB, GiB, TiB, PiB or K, M, G, T (powers of 1024), "
        "KB, MB, GB, TB, PB or k, m, g, t (powers of 1000)",
        noun="bytes",
        maximum=MAX_SIZE,
        allow_zero=allow_zero,
    )


def parse_tokens(text: str | int, *, what: str = "context") -> int:
    """``"32K"`` -> ``32768``; ``"32k"`` -> ``32000``; ``"4096"`` -> ``4096``."""
    return _parse(
        text,
        what=what,
        units=TOKEN_UNITS,
        example="4096, 4K, 32K (32768), 32k (32000) or 1M",
        unit_help="token counts take k, m, g, t (powers of 1000) or K, M, G, T "
        "(powers of 1024), as vLLM reads them",
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


def format_sizes(*sizes: int) -> tuple[str, ...]:
    """Sizes set side by side, written so that unequal ones never read the
    same: :func:`format_size`'s one decimal, more decimals (up to three)
    where two unequal sizes would round to one text, and exact byte counts
    (``4,294,975,488 B``) where three decimals still do not tell them apart.
    ``format_sizes(2**32, 2**32 + 8192)`` is ``("4,294,967,296 B",
    "4,294,975,488 B")``, never ``"4.0 GiB"`` twice."""

    def written(n: int, digits: int) -> str:
        value = float(n)
        for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(value) < 1024 or unit == "TiB":
                return (
                    f"{value:.0f} {unit}"
                    if unit == "B"
                    else f"{value:.{digits}f} {unit}"
                )
            value /= 1024
        return f"{value:.{digits}f} TiB"  # pragma: no cover

    for digits in (1, 2, 3):
        texts = tuple(written(n, digits) for n in sizes)
        if len(set(texts)) == len(set(sizes)):
            return texts
    return tuple(f"{n:,} B" for n in sizes)


def format_tokens(n: int) -> str:
    """``32768`` -> ``"32K"``; ``32000`` -> ``"32k"``; ``1500`` -> ``"1500"``:
    exact, and read back to the same count by :func:`parse_tokens`."""
    for unit, size in (("M", 1024**2), ("K", 1024), ("m", 1000**2), ("k", 1000)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)
