"""Sizes, token counts and the accelerator table, as people write them."""

from __future__ import annotations

import pytest

from kvcore.errors import KvcoreError
from kvcore.tools.accelerators import (
    ACCELERATORS,
    UnknownAcceleratorError,
    find_accelerator,
)
from kvcore.tools.units import (
    UnitError,
    format_size,
    format_tokens,
    parse_fraction,
    parse_size,
    parse_tokens,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * 2**30),
        ("80 GiB", 80 * 2**30),
        ("64GB", 64 * 10**9),
        ("64gb", 64 * 10**9),
        ("1.5TiB", 3 * 2**39),
        ("512MiB", 2**29),
        ("2KB", 2000),
        ("123", 123),
        (123, 123),
        ("0.5KiB", 512),
        # One letter reads as vLLM reads it: upper case binary, lower decimal.
        ("80G", 80 * 2**30),
        ("80g", 80 * 10**9),
        ("512M", 2**29),
        ("512m", 512 * 10**6),
        ("2K", 2048),
        ("2k", 2000),
        ("1T", 2**40),
        ("1B", 1),
    ],
)
def test_sizes(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nan", "positive number with an optional unit"),
        ("inf", "positive number with an optional unit"),
        ("-1GiB", "positive number with an optional unit"),
        ("0", "must be positive"),
        ("0GiB", "must be positive"),
        ("1.5", "not a whole number of bytes"),
        ("80XB", "unknown unit 'XB'"),
        ("80GiBs", "unknown unit 'GiBs'"),
        ("80P", "unknown unit 'P'"),
        ("", "positive number with an optional unit"),
        (True, "must be written like"),
        (float("nan"), "finite positive amount"),
    ],
)
def test_bad_sizes(text: object, message: str) -> None:
    with pytest.raises(UnitError, match=message) as info:
        parse_size(text)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, KvcoreError)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("4K", 4096),
        ("32K", 32768),
        ("128K", 131072),
        ("1M", 2**20),
        ("1.5K", 1536),
        # vLLM's lower-case suffixes are powers of 1000.
        ("4k", 4000),
        ("32k", 32000),
        ("128k", 128000),
        ("1m", 10**6),
        ("1.5k", 1500),
        ("25.6k", 25600),
        ("1g", 10**9),
    ],
)
def test_tokens(text: str, expected: int) -> None:
    assert parse_tokens(text) == expected


@pytest.mark.parametrize(
    "text", ["0", "0k", "1.0001k", "1.0001K", "4q", "-4k", "4kb", "4G", "4Ki"]
)
def test_bad_tokens(text: str) -> None:
    with pytest.raises(UnitError):
        parse_tokens(text)


def test_fractions() -> None:
    assert parse_fraction("0.9", what="x") == 0.9
    assert parse_fraction("1", what="x") == 1.0
    for bad in ("0", "1.01", "nan", "inf", "-0.5", "most"):
        with pytest.raises(UnitError, match=r"in \(0, 1\]"):
            parse_fraction(bad, what="x")


def test_formatting() -> None:
    assert format_size(1536) == "1.5 KiB"
    assert format_size(100) == "100 B"
    assert format_tokens(32768) == "32K"
    assert format_tokens(2**20) == "1M"
    assert format_tokens(32000) == "32k"
    assert format_tokens(10**6) == "1m"
    assert format_tokens(1500) == "1500"
    for n in (32768, 32000, 2**20, 10**6, 1500, 4096, 131072):
        assert parse_tokens(format_tokens(n)) == n


def test_accelerators_match_loosely_and_refuse_clearly() -> None:
    assert find_accelerator("H100").memory_bytes == 80 * 2**30
    assert find_accelerator("h100-80gb").name == "H100 80GB"
    assert find_accelerator("A100 40GB").memory_gib == 40
    assert find_accelerator("a100").memory_gib == 80
    assert find_accelerator("MI300X").vendor == "AMD"
    assert find_accelerator("h200").memory_gib == 141
    with pytest.raises(UnknownAcceleratorError, match="unknown GPU 'Z9'") as info:
        find_accelerator("Z9")
    assert all(acc.name in str(info.value) for acc in ACCELERATORS)
    assert isinstance(info.value, KeyError)


def test_every_alias_is_unique() -> None:
    names = [n.lower() for acc in ACCELERATORS for n in (acc.name, *acc.aliases)]
    assert len(names) == len(set(names))
