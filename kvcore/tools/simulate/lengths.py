"""Length distributions written as compact strings: ``1024``, ``512-4096``,
``normal:2000,800``, ``lognormal:2000,800``.

A synthetic workload draws its prompt and output lengths (and the gaps
between arrivals) from one of these.  Draws come from the caller's seeded
:class:`random.Random`, so a seed gives the same workload everywhere.
"""

from __future__ import annotations

import math
import random
import re

import attrs

from kvcore.errors import KvcoreValueError
from kvcore.tools.units import LETTER_UNITS

__all__ = ["Distribution", "DistributionError", "parse_distribution"]

KINDS = ("fixed", "uniform", "normal", "lognormal")

_INT = r"\s*([0-9]+[kKmM]?)\s*"
_NUM = r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*"
_FIXED = re.compile(rf"^{_INT}$")
_UNIFORM = re.compile(rf"^{_INT}-{_INT}$")
_SHAPED = re.compile(rf"^\s*(normal|lognormal)\s*:{_NUM},{_NUM}$")

FORMS = "N (4K is 4096, 4k is 4000), LO-HI, normal:MEAN,STD or lognormal:MEAN,STD"


class DistributionError(KvcoreValueError):
    """A length distribution does not parse or is out of range."""


@attrs.frozen
class Distribution:
    """Integers drawn as ``kind`` says, never below ``minimum``.

    ``fixed``: always ``a``.  ``uniform``: ``a`` to ``b`` inclusive.
    ``normal`` / ``lognormal``: mean ``a`` and standard deviation ``b`` of
    the values themselves (a lognormal's log-space parameters are derived
    from them), rounded to the nearest integer and clipped at ``minimum``.
    """

    kind: str
    a: float
    b: float = 0.0
    minimum: int = 1

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return max(int(self.a), self.minimum)
        if self.kind == "uniform":
            return max(rng.randint(int(self.a), int(self.b)), self.minimum)
        if self.kind == "normal":
            value = rng.gauss(self.a, self.b)
        else:
            # Mean m and std s of the values: sigma^2 = ln(1 + s^2/m^2),
            # mu = ln(m) - sigma^2 / 2.
            sigma2 = math.log1p((self.b / self.a) ** 2)
            value = rng.lognormvariate(math.log(self.a) - sigma2 / 2, math.sqrt(sigma2))
        return max(round(value), self.minimum)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        if self.kind == "uniform":
            return f"{int(self.a)}-{int(self.b)}"
        return f"{self.kind}:{self.a:g},{self.b:g}"


#: The longest length a distribution may give (16M tokens).
MAX_LENGTH = 2**24


def _count(text: str) -> int:
    """``"4K"`` -> 4096, ``"4k"`` -> 4000, ``"1M"`` -> 1048576: the letters
    of ``--context`` (lower case decimal, upper case binary, as vLLM)."""
    scale = LETTER_UNITS.get(text[-1], 1) if text[-1].isalpha() else 1
    digits = text[:-1] if scale > 1 else text
    if len(digits) > 9 or int(digits) * scale > MAX_LENGTH:
        msg = f"a length of {text} is more than {MAX_LENGTH:,} tokens"
        raise DistributionError(msg)
    return int(digits) * scale


def parse_distribution(text: object, *, what: str, minimum: int = 1) -> Distribution:
    """Read ``text`` (one of :data:`FORMS`); ``what`` names the option in
    errors and ``minimum`` is the smallest value allowed (1 for lengths, 0 for
    arrival gaps)."""
    if not isinstance(text, str):
        msg = f"{what} must be written as {FORMS}, got {text!r}"
        raise DistributionError(msg)
    if match := _FIXED.match(text):
        value = _count(match.group(1))
        if value < minimum:
            msg = f"{what} must be at least {minimum}, got {text!r}"
            raise DistributionError(msg)
        return Distribution("fixed", value, minimum=minimum)
    if match := _UNIFORM.match(text):
        lo, hi = _count(match.group(1)), _count(match.group(2))
        if lo < minimum or hi < lo:
            msg = f"{what}: a range LO-HI needs {minimum} <= LO <= HI, got {text!r}"
            raise DistributionError(msg)
        return Distribution("uniform", lo, hi, minimum=minimum)
    if match := _SHAPED.match(text):
        kind, mean, std = match.group(1), float(match.group(2)), float(match.group(3))
        if mean <= 0 or not math.isfinite(mean) or not math.isfinite(std):
            msg = f"{what}: {kind} needs a positive finite mean, got {text!r}"
            raise DistributionError(msg)
        return Distribution(kind, mean, std, minimum=minimum)
    msg = f"{what} must be written as {FORMS} (e.g. 1024, 512-4096, lognormal:2000,800); got {text!r}"
    raise DistributionError(msg)
