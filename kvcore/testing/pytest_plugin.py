"""kvcore's conformance suite as an opt-in pytest plugin.

Not loaded unless asked for (kvcore registers no ``pytest11`` entry point):
add ``pytest_plugins = ["kvcore.testing.pytest_plugin"]`` to a test module or
the root ``conftest.py``, or run ``pytest -p kvcore.testing.pytest_plugin``.
Then every test of a :class:`~kvcore.testing.conformance.KindConformance`
subclass runs once per sample spec of every kind under test.
"""

from __future__ import annotations

import pytest

from kvcore.testing.conformance import KindConformance

__all__ = ["KindConformance", "pytest_generate_tests"]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``kvcore_case`` over the suite's kinds and samples."""
    if "kvcore_case" not in metafunc.fixturenames:
        return
    suite = metafunc.cls
    if suite is None or not issubclass(suite, KindConformance):
        msg = (
            f"{metafunc.function.__name__} takes kvcore_case, which only tests of "
            "a kvcore.testing.conformance.KindConformance subclass get"
        )
        raise pytest.UsageError(msg)
    cases = suite.conformance_cases()
    metafunc.parametrize("kvcore_case", cases, ids=[case.id for case in cases])
