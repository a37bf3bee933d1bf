"""The token rule: ints in [0, 2**32), never bools, checked the same way
wherever token ids enter."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest
import torch

from kvcore.errors import KvcoreTypeError, KvcoreValueError
from kvcore.tokens import (
    check_token_ids,
    check_token_sequence,
    pack_token_ids,
    token_ids,
)


class Index:
    """An integer object with ``__index__`` and nothing else (no ordering)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


LENGTHS = [1, 3, 64, 65, 256, 257, 1000]


@pytest.mark.parametrize("length", LENGTHS)
def test_valid_ids_pack_as_little_endian_u32(length: int) -> None:
    tokens = [(i * 2_654_435_761) % 2**32 for i in range(length)]
    tokens[0] = 0
    tokens[-1] = 2**32 - 1
    assert pack_token_ids(tokens) == struct.pack(f"<{length}I", *tokens)
    assert token_ids(tokens, "t") == tokens
    assert token_ids(tokens, "t") is not tokens  # the caller's list is not kept
    check_token_ids(tuple(tokens), "t")


def test_integer_objects_are_taken_by_value() -> None:
    tokens: list[object] = [np.int64(5), np.uint32(0), torch.tensor(7), Index(1), 9]
    assert pack_token_ids(tokens) == struct.pack("<5I", 5, 0, 7, 1, 9)
    check_token_ids(tokens, "t")
    many = [Index(i % 3) for i in range(300)]  # 0s and 1s with no ordering
    assert pack_token_ids(many) is not None


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize(
    ("bad", "error", "words"),
    [
        (True, KvcoreTypeError, "is True (bool); token ids must be ints"),
        (False, KvcoreTypeError, "is False (bool)"),
        (np.bool_(True), KvcoreTypeError, "(bool"),
        (1.0, KvcoreTypeError, "is 1.0 (float)"),
        ("7", KvcoreTypeError, "(str)"),
        (None, KvcoreTypeError, "(NoneType)"),
        (torch.tensor(1.0), KvcoreTypeError, "(Tensor)"),
        (-1, KvcoreValueError, "is -1; token ids must lie in [0, 4294967296)"),
        (2**32, KvcoreValueError, "is 4294967296"),
    ],
)
def test_a_bad_id_is_named_by_position(
    length: int, bad: object, error: type[Exception], words: str
) -> None:
    """Among genuine 0s and 1s (a BOS id) and elsewhere, at every length
    the first bad token is named, counting from ``start``."""
    tokens: list[object] = [1, *range(2, length + 1)][:length]
    at = length // 2
    tokens[at] = bad
    if at + 1 < length:
        tokens[at + 1] = 0
    assert pack_token_ids(tokens) is None
    with pytest.raises(
        error, match=rf"prompt: token id at position {at + 10} "
    ) as info:
        check_token_ids(tokens, "prompt", start=10)
    assert words in str(info.value)
    with pytest.raises(error):
        token_ids(tokens, "prompt")
    assert isinstance(info.value, TypeError if error is KvcoreTypeError else ValueError)


@pytest.mark.parametrize("value", ["abc", b"abc", {1, 2}, {1: 2}, 5, None])
def test_only_a_sequence_is_a_token_sequence(value: object) -> None:
    with pytest.raises(KvcoreTypeError, match="must be a list or tuple of token ids"):
        check_token_sequence(value, "prompt")


def test_a_sequence_leaves_its_checked_head_to_the_caller() -> None:
    assert check_token_sequence(range(5), "p") == [0, 1, 2, 3, 4]
    # The head is the caller's to check; the tail is checked here.
    assert check_token_sequence([True, 2, 3], "p", checked=1) == [True, 2, 3]
    with pytest.raises(KvcoreTypeError, match="position 1 is True"):
        check_token_sequence([2, True, 3], "p", checked=1)


class Converting(list):  # type: ignore[type-arg]
    """A list whose indexing converts what iteration yields as stored."""

    def __getitem__(self, index: Any) -> Any:
        value = super().__getitem__(index)
        return value if isinstance(index, slice) else int(value)


@pytest.mark.parametrize("length", [10, 100, 300])
def test_a_sequence_is_judged_by_what_it_yields(length: int) -> None:
    """Packing iterates; so does the bool search, however the sequence's
    indexing differs; a set (sized, not indexable) is read the same way."""
    tokens = Converting([7] * (length - 1) + [True])
    with pytest.raises(KvcoreTypeError, match=f"position {length - 1} is True"):
        check_token_ids(tokens, "t")
    check_token_ids(set(range(length)), "t")  # type: ignore[arg-type]


@pytest.mark.parametrize("length", [1, 5, 64, 65, 97, 300])
@pytest.mark.parametrize("flag", [True, False])
def test_a_bool_tensor_token_is_refused_like_a_bool(length: int, flag: bool) -> None:
    """A 0-d bool tensor packs by value (as 0 or 1), as an integer tensor
    does; it is refused like a bool, by position, wherever it stands, while
    a 0-d integer tensor of the same value is taken."""
    at = length // 2
    tokens: list[object] = [1000 + i for i in range(length)]
    tokens[at] = torch.tensor(flag)
    with pytest.raises(KvcoreTypeError, match=f"position {at} is tensor\\({flag}\\)"):
        token_ids(tokens, "prompt")
    assert pack_token_ids(tokens) is None
    tokens[at] = torch.tensor(int(flag))
    assert token_ids(tokens, "prompt")[at] == int(flag)
