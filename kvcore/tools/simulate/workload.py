"""Workloads: the requests a simulation replays, and synthetic ones.

A :class:`Workload` is a list of :class:`WorkloadRequest` in arrival
order.  Every token id is fixed when the workload is built (the prompt and
the output the request will generate), so a multi-turn chat's next turn can
carry its parent's prompt and output verbatim and the prefix cache sees
equal tokens.  Token ids are drawn from keyed streams: the same key gives
the same ids on every platform and Python version.
"""

from __future__ import annotations

import array
import math
import random
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

import attrs
import numpy as np

from kvcore.errors import KvcoreValueError
from kvcore.tools.choices import NAMED_WORKLOADS
from kvcore.tools.limits import MAX_WORKLOAD_PREFIX_TOKENS, MAX_WORKLOAD_REQUESTS
from kvcore.tools.simulate.lengths import Distribution, parse_distribution

__all__ = [
    "NAMED_WORKLOADS",
    "VOCAB_SIZE",
    "TokenRun",
    "Workload",
    "WorkloadError",
    "WorkloadRequest",
    "named_workload",
    "synthetic_workload",
    "token_stream",
    "workload_names",
]

#: Token ids are drawn from ``[0, VOCAB_SIZE)``.
VOCAB_SIZE = 32000


class WorkloadError(KvcoreValueError):
    """A workload's requests break the simulator's rules."""


def token_stream(key: str, count: int) -> list[int]:
    """``count`` token ids determined by ``key`` alone."""
    if count <= 0:
        return []
    # Seeded by the key's UTF-8 bytes (what seeding by the str does), lone
    # surrogates passed through: a trace's ids may hold them.
    seed = key.encode("utf-8", "surrogatepass")
    raw = random.Random(seed).randbytes(4 * count)
    return (np.frombuffer(raw, dtype="<u4") % VOCAB_SIZE).tolist()  # type: ignore[no-any-return]


#: The array type code of a 4-byte unsigned word on this platform.
_WORD = next(code for code in "IL" if array.array(code).itemsize == 4)


def little_endian_words(raw: bytes) -> list[int]:
    """``raw`` read as little-endian 4-byte unsigned words (an array's
    ``tolist`` makes the ints about twice as fast as numpy's)."""
    words = array.array(_WORD, raw)
    if sys.byteorder == "big":
        words.byteswap()
    return words.tolist()


def pack_words(tokens: Sequence[int]) -> bytes:
    """``tokens`` as little-endian 4-byte unsigned words (the inverse of
    :func:`little_endian_words`); token ids are ints in ``[0, 2**32)``."""
    words = array.array(_WORD, tokens)
    if sys.byteorder == "big":
        words.byteswap()
    return words.tobytes()


class TokenRun(Sequence[int]):
    """An immutable run of token ids kept as little-endian 4-byte words.

    A replayed trace holds millions of prompt tokens; as Python ints they
    cost about 40 bytes each, as words 4, and parts (a trace's blocks) are
    shared between the requests that repeat them.  The ints are made when
    the run is read (:meth:`tokens`).
    """

    __slots__ = ("_len", "_parts")

    def __init__(self, parts: Iterable[bytes]) -> None:
        self._parts = tuple(parts)
        total = sum(len(p) for p in self._parts)
        if total % 4:
            msg = "a token run's parts must hold whole 4-byte token ids"
            raise WorkloadError(msg)
        self._len = total // 4

    @property
    def parts(self) -> tuple[bytes, ...]:
        return self._parts

    def words(self) -> bytes:
        """The token ids as one run of little-endian 4-byte words."""
        return b"".join(self._parts)

    def tokens(self) -> list[int]:
        """The token ids as a new list."""
        return little_endian_words(self.words())

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:
        return iter(self.tokens())

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...
    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        if isinstance(index, slice):
            return tuple(self.tokens()[index])
        return self.tokens()[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenRun):
            return b"".join(self._parts) == b"".join(other._parts)
        if isinstance(other, (tuple, list)):
            return len(other) == self._len and list(other) == self.tokens()
        return NotImplemented

    def __hash__(self) -> int:
        return hash(b"".join(self._parts))

    def __repr__(self) -> str:
        return f"TokenRun({self._len} tokens)"


def as_tuple(tokens: Sequence[int]) -> tuple[int, ...]:
    """``tokens`` as a tuple (a tuple is returned as is)."""
    return tokens if isinstance(tokens, tuple) else tuple(tokens)


@attrs.frozen
class WorkloadRequest:
    """One request: when it arrives, its prompt, and the output it generates.

    :param arrival: the first scheduler step it may be admitted at.
    :param prompt: every prompt token id (a turn's prompt starts with its
        parent's prompt and output).
    :param output: the token ids it generates, one per sampled token; their
        number is its output length.
    :param prefix_id: the shared prefix its prompt starts with, if any.
    :param parent: the earlier turn whose prompt and output this prompt
        extends; the request is not admitted before the parent finishes.
    :param arrival_s: the second it arrives on the simulated clock (a timed
        trace); ``None`` for a request that arrives at step ``arrival``.
        A workload's requests are either all timed or none.
    """

    id: str
    arrival: int
    prompt: tuple[int, ...] | TokenRun
    output: tuple[int, ...]
    prefix_id: str | None = None
    parent: str | None = None
    arrival_s: float | None = None

    @property
    def output_len(self) -> int:
        return len(self.output)

    @property
    def max_tokens(self) -> int:
        """Tokens it holds computed at most: the last sampled token is never
        computed."""
        return len(self.prompt) + len(self.output) - 1


@attrs.frozen
class Workload:
    """Requests in arrival order, with unique ids and parents that come first."""

    requests: tuple[WorkloadRequest, ...]

    def __attrs_post_init__(self) -> None:
        seen: dict[str, WorkloadRequest] = {}
        last_arrival = 0
        last_s = 0.0
        timed = bool(self.requests) and self.requests[0].arrival_s is not None
        for index, request in enumerate(self.requests):
            where = f"request {index} ({request.id!r})"
            if type(request.id) is not str or not request.id:
                msg = f"{where}: id must be a non-empty str"
                raise WorkloadError(msg)
            if request.id in seen:
                msg = f"{where}: id {request.id!r} is used twice; ids must be unique"
                raise WorkloadError(msg)
            if type(request.arrival) is not int or request.arrival < 0:
                msg = f"{where}: arrival must be an int step >= 0, got {request.arrival!r}"
                raise WorkloadError(msg)
            if request.arrival < last_arrival:
                msg = (
                    f"{where}: arrives at step {request.arrival}, before the request "
                    f"ahead of it (step {last_arrival}); list requests in arrival order"
                )
                raise WorkloadError(msg)
            last_arrival = request.arrival
            if (request.arrival_s is not None) != timed:
                msg = (
                    f"{where}: arrival_s is {request.arrival_s!r} but the first "
                    "request's is not; give every request a time or none"
                )
                raise WorkloadError(msg)
            if request.arrival_s is not None:
                t = request.arrival_s
                if type(t) not in (int, float) or not math.isfinite(t) or t < 0:
                    msg = f"{where}: arrival_s must be a finite number >= 0, got {t!r}"
                    raise WorkloadError(msg)
                if t < last_s:
                    msg = (
                        f"{where}: arrives at {t} s, before the request ahead of "
                        f"it ({last_s} s); list requests in arrival order"
                    )
                    raise WorkloadError(msg)
                last_s = t
            if not request.prompt:
                msg = f"{where}: the prompt is empty; a request needs a prompt token"
                raise WorkloadError(msg)
            if not request.output:
                msg = f"{where}: the output is empty; a request generates at least one token"
                raise WorkloadError(msg)
            if request.parent is not None:
                parent = seen.get(request.parent)
                if parent is None:
                    msg = (
                        f"{where}: parent {request.parent!r} is not an earlier request"
                    )
                    raise WorkloadError(msg)
                text = as_tuple(parent.prompt) + parent.output
                if request.prompt[: len(text)] != text:
                    msg = (
                        f"{where}: the prompt does not start with parent "
                        f"{request.parent!r}'s prompt and output"
                    )
                    raise WorkloadError(msg)
            seen[request.id] = request

    @classmethod
    def of(cls, requests: Iterable[WorkloadRequest]) -> Workload:
        return cls(tuple(requests))

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def timed(self) -> bool:
        """Whether the requests arrive at times (``arrival_s``), not steps."""
        return bool(self.requests) and self.requests[0].arrival_s is not None

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(len(r.output) for r in self.requests)


def synthetic_workload(
    num_requests: int,
    *,
    prompt_len: Distribution | str = "1024",
    output_len: Distribution | str = "128",
    shared_prefixes: int = 0,
    prefix_len: int = 0,
    turns: int = 1,
    arrival_gap: Distribution | str = "0",
    seed: int = 0,
) -> Workload:
    """``num_requests`` requests grouped into chats of ``turns`` turns (the
    last chat may be shorter).

    A chat's first prompt is one of ``shared_prefixes`` system prefixes of
    ``prefix_len`` tokens (picked at random; none when 0) followed by
    ``prompt_len`` new tokens; each later turn is its parent's prompt and
    output followed by ``prompt_len`` new tokens.  Chats arrive
    ``arrival_gap`` steps apart (0: all at step 0); a later turn carries its
    chat's arrival and waits for its parent to finish.
    """
    prompt_dist = _dist(prompt_len, "prompt_len", 1)
    output_dist = _dist(output_len, "output_len", 1)
    gap_dist = _dist(arrival_gap, "arrival_gap", 0)
    for name, value, low in (
        ("num_requests", num_requests, 0),
        ("shared_prefixes", shared_prefixes, 0),
        ("prefix_len", prefix_len, 0),
        ("turns", turns, 1),
        ("seed", seed, None),
    ):
        if type(value) is not int or (low is not None and value < low):
            bound = "an int" if low is None else f"an int >= {low}"
            msg = f"{name} must be {bound}, got {value!r}"
            raise WorkloadError(msg)
    if shared_prefixes and not prefix_len:
        msg = f"{shared_prefixes} shared prefixes need a prefix_len >= 1"
        raise WorkloadError(msg)
    # Checked before anything is built: a typo must not cost the machine.
    if num_requests > MAX_WORKLOAD_REQUESTS:
        msg = (
            f"num_requests {num_requests:,} is more than kvcore's limit of "
            f"{MAX_WORKLOAD_REQUESTS:,} (MAX_WORKLOAD_REQUESTS); replay fewer"
        )
        raise WorkloadError(msg)
    if shared_prefixes * prefix_len > MAX_WORKLOAD_PREFIX_TOKENS:
        msg = (
            f"{shared_prefixes:,} shared prefixes of {prefix_len:,} tokens are more "
            f"than kvcore's limit of {MAX_WORKLOAD_PREFIX_TOKENS:,} prefix tokens "
            "(MAX_WORKLOAD_PREFIX_TOKENS); use fewer or shorter prefixes"
        )
        raise WorkloadError(msg)
    rng = random.Random(seed)
    prefixes = [
        tuple(token_stream(f"{seed}:prefix:{k}", prefix_len))
        for k in range(shared_prefixes)
    ]
    requests: list[WorkloadRequest] = []
    arrival = 0
    chat = 0
    while len(requests) < num_requests:
        if chat:
            arrival += gap_dist.sample(rng)
        prefix_id: str | None = None
        text: tuple[int, ...] = ()
        if prefixes:
            k = rng.randrange(len(prefixes))
            prefix_id, text = f"p{k}", prefixes[k]
        parent: str | None = None
        for turn in range(turns):
            if len(requests) == num_requests:
                break
            rid = f"c{chat}" if turns == 1 else f"c{chat}.t{turn}"
            new = token_stream(f"{seed}:prompt:{rid}", prompt_dist.sample(rng))
            out = token_stream(f"{seed}:output:{rid}", output_dist.sample(rng))
            prompt = text + tuple(new)
            requests.append(
                WorkloadRequest(
                    rid,
                    arrival,
                    prompt,
                    tuple(out),
                    prefix_id=prefix_id if parent is None else None,
                    parent=parent,
                )
            )
            text = prompt + tuple(out)
            parent = rid
        chat += 1
    return Workload(tuple(requests))


def _dist(value: Distribution | str, what: str, minimum: int) -> Distribution:
    if isinstance(value, Distribution):
        return value
    return parse_distribution(value, what=what, minimum=minimum)


def workload_names() -> list[str]:
    """The names of :data:`NAMED_WORKLOADS`."""
    return list(NAMED_WORKLOADS)


def named_workload(name: str, *, seed: int = 0) -> Workload:
    """The named workload ``name`` (see :data:`NAMED_WORKLOADS`), drawn from
    ``seed``."""
    options = NAMED_WORKLOADS.get(name) if type(name) is str else None
    if options is None:
        msg = f"no workload named {name!r}; the named workloads are " + ", ".join(
            NAMED_WORKLOADS
        )
        raise WorkloadError(msg)
    return synthetic_workload(
        int(options["requests"]),
        prompt_len=options["prompt_len"],
        output_len=options["output_len"],
        shared_prefixes=int(options["shared_prefixes"]),
        prefix_len=int(options["prefix_len"]),
        turns=int(options["turns"]),
        arrival_gap=options["arrival_gap"],
        seed=seed,
    )
