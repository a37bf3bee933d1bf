"""Length mixes written on the command line: ``--context lognormal:8k,1.0``.

A mix (:class:`kvcore.LengthMix`) is what ``min_waste`` plans for when a
workload's requests have many lengths.  The forms:

``lognormal:MEDIAN,SIGMA``
    lengths whose logarithm is normal with mean ``ln(MEDIAN)`` and standard
    deviation ``SIGMA`` (``lognormal:8k,1.0``: half the requests under 8,000
    tokens, one in six over 21,700).
``uniform:LO-HI``
    every length from ``LO`` to ``HI`` tokens equally likely.
``mix:A,B*3,C``
    the lengths listed, each weighted by its ``*N`` (default 1).
``trace:FILE``
    the requests of a trace file (any format ``kvcore simulate --trace``
    reads), each at its length: prompt and output tokens, less the last
    sampled token, which is never computed.

A distribution is represented by :data:`QUANTILE_POINTS` equally weighted
lengths, its ``(i + 1/2) / QUANTILE_POINTS`` quantiles (rounded); a trace
by its own lengths (summarized the same way past
:data:`kvcore.length_mix.MAX_MIX_LENGTHS` distinct ones).  Lengths past
``max_model_len`` are dropped: the engine refuses such requests.
"""

from __future__ import annotations

import math
import re
from statistics import NormalDist

from kvcore.errors import KvcoreValueError
from kvcore.length_mix import LengthMix
from kvcore.tools.units import parse_tokens

__all__ = [
    "MIX_FORMS",
    "QUANTILE_POINTS",
    "LengthMixSyntaxError",
    "fixed_lengths",
    "is_mix",
    "parse_length_mix",
]

#: Equally weighted lengths that stand for a distribution.
QUANTILE_POINTS = 256

#: The prefixes that make ``--context`` a mix instead of a list of lengths.
MIX_FORMS = ("lognormal:", "uniform:", "mix:", "trace:")

_NUMBER = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*$")


class LengthMixSyntaxError(KvcoreValueError):
    """A ``--context`` mix does not parse."""


def is_mix(text: str) -> bool:
    """Whether ``--context`` text names a mix rather than lengths."""
    return str(text).strip().lower().startswith(MIX_FORMS)


def parse_length_mix(
    text: str, *, max_model_len: int | None = None, what: str = "--context"
) -> tuple[LengthMix, int]:
    """The mix ``text`` names, and how many of its requests (weights) were
    dropped for passing ``max_model_len``."""
    head, _, body = str(text).strip().partition(":")
    kind = head.strip().lower()
    if kind == "lognormal":
        mix = _lognormal(body, what)
    elif kind == "uniform":
        mix = _uniform(body, what)
    elif kind == "mix":
        mix = _listed(body, what)
    elif kind == "trace":
        mix = _trace(body.strip(), what)
    else:
        msg = f"{what} {text!r}: a mix starts with one of {', '.join(MIX_FORMS)}"
        raise LengthMixSyntaxError(msg)
    if max_model_len is None or mix.longest <= max_model_len:
        return mix, 0
    kept = [
        (k, w)
        for k, w in zip(mix.lengths, mix.weights, strict=True)
        if k <= max_model_len
    ]
    if not kept:
        msg = (
            f"{what} {text!r}: every length passes --max-model-len "
            f"{max_model_len:,}; raise it"
        )
        raise LengthMixSyntaxError(msg)
    dropped = mix.total_weight - sum(w for _, w in kept)
    return LengthMix.of(kept), dropped


def fixed_lengths(mix: LengthMix) -> tuple[int, ...]:
    """The single lengths reported beside a mix: its median, mean, 90th
    percentile and longest, in increasing order, each once."""
    n = mix.total_weight
    picks = {
        _nth(mix, (n - 1) // 2),
        round(mix.mean),
        _nth(mix, (9 * n) // 10 - (n % 10 == 0)),
        mix.longest,
    }
    return tuple(sorted(picks))


def _nth(mix: LengthMix, index: int) -> int:
    """The ``index``-th length (from 0) of the mix laid out in increasing
    order, each length as many times as its weight, without laying it out
    (a weight can be in the billions)."""
    pairs = sorted(zip(mix.lengths, mix.weights, strict=True))
    for length, weight in pairs:
        if index < weight:
            return length
        index -= weight
    return pairs[-1][0]


def _tokens(text: str, what: str) -> int:
    return parse_tokens(text.strip(), what=what)


def _lognormal(body: str, what: str) -> LengthMix:
    parts = body.split(",")
    sigma = _NUMBER.match(parts[1]) if len(parts) == 2 else None
    if sigma is None:
        msg = f"{what}: write lognormal:MEDIAN,SIGMA (e.g. lognormal:8k,1.0), got {body!r}"
        raise LengthMixSyntaxError(msg)
    median = _tokens(parts[0], what)
    s = float(sigma.group(1))
    if not 0 <= s <= 4:
        msg = f"{what}: lognormal SIGMA must be in [0, 4], got {s}"
        raise LengthMixSyntaxError(msg)
    normal = NormalDist(0.0, 1.0)
    lengths = []
    for i in range(QUANTILE_POINTS):
        z = normal.inv_cdf((i + 0.5) / QUANTILE_POINTS)
        lengths.append(max(1, min(2**31, round(median * math.exp(s * z)))))
    return LengthMix.of((k, 1) for k in lengths)


def _uniform(body: str, what: str) -> LengthMix:
    lo_text, dash, hi_text = body.partition("-")
    if not dash:
        msg = f"{what}: write uniform:LO-HI (e.g. uniform:1k-32k), got {body!r}"
        raise LengthMixSyntaxError(msg)
    lo, hi = _tokens(lo_text, what), _tokens(hi_text, what)
    if not 1 <= lo <= hi:
        msg = f"{what}: uniform:LO-HI needs 1 <= LO <= HI, got {body!r}"
        raise LengthMixSyntaxError(msg)
    span = hi - lo + 1
    if span <= QUANTILE_POINTS:
        return LengthMix.of((lo + i, 1) for i in range(span))
    return LengthMix.of(
        (lo + (2 * i + 1) * span // (2 * QUANTILE_POINTS), 1)
        for i in range(QUANTILE_POINTS)
    )


def _listed(body: str, what: str) -> LengthMix:
    pairs = []
    for part in body.split(","):
        if not part.strip():
            continue
        length, star, weight = part.partition("*")
        count = 1
        if star:
            if not weight.strip().isdigit() or int(weight) < 1:
                msg = f"{what}: a weight is a whole number >= 1 (4k*3), got {part!r}"
                raise LengthMixSyntaxError(msg)
            count = int(weight)
        pairs.append((_tokens(length, what), count))
    if not pairs:
        msg = f"{what}: write mix:A,B*3,C (lengths, optional weights), got {body!r}"
        raise LengthMixSyntaxError(msg)
    return LengthMix.of(pairs)


def _trace(path: str, what: str) -> LengthMix:
    from kvcore.tools.simulate.public_traces import load_any_trace

    if not path:
        msg = f"{what}: write trace:FILE, a trace file kvcore simulate reads"
        raise LengthMixSyntaxError(msg)
    loaded = load_any_trace(path, timing=False)
    return LengthMix.of_lengths(r.max_tokens for r in loaded.workload.requests)
