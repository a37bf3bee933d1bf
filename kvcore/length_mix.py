"""A workload's request lengths: lengths with integer weights.

:class:`LengthMix` is what ``min_waste`` plans for when
``CacheConfig.target_lengths`` is set, instead of one target context, and
what :func:`kvcore.plan.mix_capacity` measures a plan against.  A length is
a request's tokens at its last step (prompt and output, as the capacity
model counts a request of ``T`` tokens); a weight is how many requests of
the mix have that length.  The command line builds mixes from traces and
distributions (``kvcore plan --context lognormal:8k,1.0``).
"""

from __future__ import annotations

from collections.abc import Iterable
from fractions import Fraction
from typing import Any

import attrs

from kvcore.errors import KvcoreTypeError, KvcoreValueError, echo
from kvcore.tokens import check_token_count

__all__ = ["MAX_MIX_LENGTHS", "LengthMix", "LengthMixError"]

#: The most distinct lengths a mix holds (a longer list is summarized first,
#: e.g. by :meth:`LengthMix.quantiles`).
MAX_MIX_LENGTHS = 4096


class LengthMixError(KvcoreValueError):
    """A length mix is empty, too long, or holds a bad length or weight."""


def _check(instance: LengthMix, _attribute: Any, _value: Any) -> None:
    lengths, weights = instance.lengths, instance.weights
    if type(lengths) is not tuple or type(weights) is not tuple:
        msg = (
            "LengthMix.lengths and .weights must be tuples of ints, got "
            f"{type(lengths).__name__} and {type(weights).__name__}"
        )
        raise KvcoreTypeError(msg)
    if not lengths or len(lengths) != len(weights):
        msg = (
            f"a LengthMix needs one weight per length and at least one length, got "
            f"{len(lengths)} lengths and {len(weights)} weights"
        )
        raise LengthMixError(msg)
    if len(lengths) > MAX_MIX_LENGTHS:
        msg = (
            f"a LengthMix holds at most {MAX_MIX_LENGTHS:,} distinct lengths, got "
            f"{len(lengths):,}; summarize it first (LengthMix.quantiles)"
        )
        raise LengthMixError(msg)
    previous = 0
    for length, weight in zip(lengths, weights, strict=True):
        check_token_count(length, "LengthMix length", minimum=1)
        if length <= previous:
            msg = (
                f"LengthMix lengths must increase strictly, got {length:,} after "
                f"{previous:,}; build a mix with LengthMix.of(pairs)"
            )
            raise LengthMixError(msg)
        previous = length
        if type(weight) is not int or weight < 1:
            msg = f"LengthMix weights must be ints >= 1, got {echo(weight)}"
            raise LengthMixError(msg)


@attrs.frozen
class LengthMix:
    """Request lengths (strictly increasing) and how many requests have each.

    Every figure over the mix is exact: an expectation is the weighted sum
    over the lengths divided by :attr:`total_weight`.
    """

    lengths: tuple[int, ...] = attrs.field(validator=_check)
    weights: tuple[int, ...]

    @classmethod
    def of(cls, pairs: Iterable[tuple[int, int]]) -> LengthMix:
        """The mix of ``(length, weight)`` pairs, equal lengths merged."""
        merged: dict[int, int] = {}
        for length, weight in pairs:
            check_token_count(length, "LengthMix length", minimum=1)
            if type(weight) is not int or weight < 1:
                msg = f"LengthMix weights must be ints >= 1, got {echo(weight)}"
                raise LengthMixError(msg)
            merged[length] = merged.get(length, 0) + weight
        ordered = sorted(merged.items())
        return cls(tuple(k for k, _ in ordered), tuple(w for _, w in ordered))

    @classmethod
    def of_lengths(
        cls, lengths: Iterable[int], points: int = MAX_MIX_LENGTHS
    ) -> LengthMix:
        """The empirical mix of ``lengths`` (one request each); with more than
        ``points`` distinct lengths, its :meth:`quantiles` summary."""
        mix = cls._counted(lengths)
        if len(mix) <= points:
            return cls.of(mix.items())
        return cls.quantiles(
            sorted(k for k, w in mix.items() for _ in range(w)), points
        )

    @staticmethod
    def _counted(lengths: Iterable[int]) -> dict[int, int]:
        counts: dict[int, int] = {}
        for length in lengths:
            check_token_count(length, "LengthMix length", minimum=1)
            counts[length] = counts.get(length, 0) + 1
        if not counts:
            msg = "a LengthMix needs at least one length"
            raise LengthMixError(msg)
        return counts

    @classmethod
    def quantiles(cls, ordered: list[int], points: int) -> LengthMix:
        """``points`` equally weighted lengths: the ``(i + 1/2) / points``
        quantiles of the sorted list ``ordered``."""
        n = len(ordered)
        return cls.of(
            (ordered[((2 * i + 1) * n) // (2 * points)], 1) for i in range(points)
        )

    @property
    def total_weight(self) -> int:
        return sum(self.weights)

    @property
    def longest(self) -> int:
        return self.lengths[-1]

    @property
    def mean(self) -> Fraction:
        """The expected length."""
        return Fraction(
            sum(k * w for k, w in zip(self.lengths, self.weights, strict=True)),
            self.total_weight,
        )

    def expected(self, per_length: Iterable[int]) -> Fraction:
        """The expectation of a figure given at each length, in order."""
        total = 0
        count = 0
        for value, weight in zip(per_length, self.weights, strict=True):
            total += value * weight
            count += 1
        if count != len(self.lengths):  # pragma: no cover - strict zip raises
            raise AssertionError
        return Fraction(total, self.total_weight)

    def __len__(self) -> int:
        return len(self.lengths)

    def describe(self) -> str:
        """``"256 lengths 1,024-65,536 tokens, mean 9,871"``."""
        if len(self.lengths) == 1:
            return f"{self.lengths[0]:,} tokens"
        return (
            f"{len(self.lengths):,} lengths {self.lengths[0]:,}-{self.longest:,} "
            f"tokens, mean {round(self.mean):,}"
        )
