"""The token rule: which token ids and token counts kvcore takes.

Token ids and token counts are ints in ``[0, 2**32)``, never bools (nor 0-d
bool tensors): ids are hashed as 4-byte unsigned ints, and a count past that
is a unit slip.
Integer objects (a numpy integer, a 0-d integer tensor) are taken as ids by
value.  Every place a token id or count enters (the command line, model
files, requests, configs) checks it here, and the hashing packs ids with
:func:`pack_token_ids`, so a token is accepted or refused the same way
everywhere.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Sequence
from typing import cast

import numpy as np
import torch

from kvcore.errors import KvcoreTypeError, KvcoreValueError, echo
from kvcore.limits import TOKEN_ID_LIMIT

__all__ = [
    "check_token_count",
    "check_token_ids",
    "check_token_sequence",
    "pack_token_ids",
    "token_ids",
    "token_struct",
]


def check_token_count(value: object, what: str, *, minimum: int = 0) -> int:
    """``value`` if it is an int in ``[minimum, 2**32)``, else a kvcore error
    naming ``what`` (a :class:`~kvcore.errors.KvcoreTypeError` for a bool
    or non-int)."""
    if type(value) is not int:
        msg = (
            f"{what} must be an int number of tokens, got {echo(value)} "
            f"({type(value).__name__})"
        )
        raise KvcoreTypeError(msg)
    if not minimum <= value < TOKEN_ID_LIMIT:
        msg = f"{what} must be a token count in [{minimum}, 2**32), got {value:,}" + (
            "; check the unit" if value >= TOKEN_ID_LIMIT else ""
        )
        raise KvcoreValueError(msg)
    return value


# -- packing ---------------------------------------------------------------------
_TOKEN_STRUCTS: dict[int, struct.Struct] = {}


def token_struct(n: int) -> struct.Struct:
    """The packer of ``n`` token ids (kept for a few thousand lengths)."""
    st = _TOKEN_STRUCTS.get(n)
    if st is None:
        st = struct.Struct(f"<{n}I")
        if n <= 4096:
            _TOKEN_STRUCTS[n] = st
    return st


def pack_token_ids(tokens: Sequence[object]) -> bytes | None:
    """``tokens`` as little-endian 4-byte unsigned ints (the bytes hashed),
    or ``None`` when one is not a valid token id.

    Packing refuses non-integers and values out of range at C speed; a bool
    packs as 0 or 1, so the types of the tokens that packed as 0 or 1 are
    then read (see :func:`_holds_bool`).
    """
    if type(tokens) is not list and type(tokens) is not tuple:
        # Packing iterates, and the bool search indexes: one list serves
        # both, however the sequence's iteration and indexing differ.
        tokens = list(tokens)
    try:
        data = token_struct(len(tokens)).pack(*tokens)
    except (struct.error, TypeError, ValueError, OverflowError):
        return None
    if _holds_bool(tokens, data):
        return None
    return data


def _holds_bool(tokens: Sequence[object], data: bytes) -> bool:
    """Whether a token is a bool, given the tokens packed as ``data``.

    Only a token that packed as 0 or 1 can be one, and most vocabularies
    start every prompt with such a token (a BOS id of 0 or 1), so only the
    types of those tokens are read: a byte search or ``min`` finds whether
    there are any, numpy finds where they are.
    """
    n = len(tokens)
    if n <= _BYTE_SEARCH_TOKENS:
        # A match may straddle two tokens; then the types decide.
        if _PACKED_ZERO not in data and _PACKED_ONE not in data:
            return False
        if n <= 64:
            return _any_bool(tokens)
        words = np.frombuffer(data, dtype=_U32_LE)
    else:
        words = np.frombuffer(data, dtype=_U32_LE)
        at = words.argmin()  # argmin costs less than min
        if words[at] > 1:
            return False
        if at == 0:
            # A BOS id of 0 or 1 (the first minimum): its type is read,
            # and only the rest reduced again.
            if _is_bool(tokens[0]):
                return True
            rest = words[1:]
            if rest[rest.argmin()] > 1:
                return False
    where = (words <= 1).nonzero()[0]
    if len(where) > 64:
        return _any_bool(tokens)
    return any(_is_bool(tokens[i]) for i in where.tolist())


def _is_bool(token: object) -> bool:
    """Whether ``token`` is a bool: a Python bool, or a 0-d bool tensor
    (which packs by value, as 0 or 1)."""
    return type(token) is bool or (
        isinstance(token, torch.Tensor) and token.dtype == torch.bool
    )


def _any_bool(tokens: Sequence[object]) -> bool:
    """:func:`_is_bool` of every token, reading each one's type once."""
    types = set(map(type, tokens))
    if bool in types:
        return True
    return any(issubclass(t, torch.Tensor) for t in types) and any(
        map(_is_bool, tokens)
    )


#: Up to this many tokens, a byte search for a packed 0 or 1 goes first (it
#: rarely matches and is cheaper than a numpy reduction); above it, the byte
#: search costs more (every token under 65,536 packs two zero bytes, which
#: slows it), so the reduction runs alone.  Measured with numpy 2: the two
#: cost the same at about 100 tokens (0.9 us), and the search twice the
#: reduction at 256.
_BYTE_SEARCH_TOKENS = 96

_PACKED_ZERO = struct.pack("<I", 0)
_PACKED_ONE = struct.pack("<I", 1)
_U32_LE = np.dtype("<u4")


# -- checking --------------------------------------------------------------------
def check_token_ids(tokens: Sequence[object], what: str, start: int = 0) -> None:
    """Raise a kvcore error unless every token is an integer in
    ``[0, 2**32)`` and not a bool (see :func:`token_ids`)."""
    if tokens and pack_token_ids(tokens) is None:
        _name_bad_token(tokens, what, start)


def token_ids(tokens: Sequence[object], what: str, start: int = 0) -> list[int]:
    """``tokens`` as a list, if every one is an integer in ``[0, 2**32)``
    and not a bool.  Positions in messages count from ``start``.

    A whole list is checked at C speed by :func:`pack_token_ids`; only a
    refused list is walked to name the position."""
    check_token_ids(tokens, what, start)
    return list(cast("Sequence[int]", tokens))


def _name_bad_token(tokens: Sequence[object], what: str, start: int) -> None:
    """Raise the error naming the first bad token, or return if there is
    none (a token whose ``__index__`` answers differently the second time)."""
    for pos, tok in enumerate(tokens, start):
        try:
            if _is_bool(tok):
                raise TypeError
            value = operator.index(cast("int", tok))
        except TypeError:
            msg = (
                f"{what}: token id at position {pos} is {echo(tok)} "
                f"({type(tok).__name__}); token ids must be ints"
            )
            raise KvcoreTypeError(msg) from None
        if not 0 <= value < TOKEN_ID_LIMIT:
            msg = (
                f"{what}: token id at position {pos} is {echo(tok)}; token ids "
                f"must lie in [0, {TOKEN_ID_LIMIT})"
            )
            raise KvcoreValueError(msg)


def check_token_sequence(
    tokens: object, what: str, start: int = 0, *, checked: int = 0
) -> list[int]:
    """``tokens`` as a list, if it is a sequence (a list, tuple or range) of
    valid token ids; a string, bytes, dict or set is not a token sequence.
    The first ``checked`` tokens are left to the caller (a request's full
    chunks are checked as they are hashed)."""
    if not isinstance(tokens, Sequence) or isinstance(
        tokens, str | bytes | bytearray | memoryview
    ):
        msg = (
            f"{what} must be a list or tuple of token ids, got "
            f"{type(tokens).__name__} {echo(tokens)}"
        )
        raise KvcoreTypeError(msg)
    if checked <= 0:
        return token_ids(tokens, what, start)
    items = list(cast("Sequence[int]", tokens))
    if checked < len(items):
        token_ids(items[checked:], what, start + checked)
    return items
