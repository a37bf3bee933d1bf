"""How many examples a property or fuzz test runs.

The default run (``python -m pytest``) runs each expensive property test
with a quick count; its ``slow``-marked twin (``python -m pytest -m slow``,
which CI runs too) runs the full count.  A test takes an ``examples``
argument and passes it to hypothesis's ``settings(max_examples=...)``::

    @budget(quick=20, full=100)
    def test_something(examples: int) -> None:
        @settings(max_examples=examples)
        @given(...)
        def check(...) -> None: ...

        check()
"""

from __future__ import annotations

import pytest

__all__ = ["budget"]


def budget(*, quick: int, full: int) -> pytest.MarkDecorator:
    """Parametrize ``examples``: ``quick`` in the default run, ``full`` (and
    the ``slow`` mark) in the slow run."""
    if not 0 < quick < full:
        msg = f"quick ({quick}) must be positive and below full ({full})"
        raise ValueError(msg)
    return pytest.mark.parametrize(
        "examples",
        [
            pytest.param(quick, id=f"{quick}-examples"),
            pytest.param(full, id=f"{full}-examples", marks=pytest.mark.slow),
        ],
    )
