"""Old module names keep working after the tools and integrations moved:
each is the module at its new place (never a second copy), with a
DeprecationWarning naming where to import it from."""

from __future__ import annotations

import importlib
import re
import sys

import pytest

from kvcore import moved


def _forget(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Import ``name`` afresh in this test (sys.modules restored after)."""
    for key in list(sys.modules):
        if key == name or key.startswith(name + "."):
            monkeypatch.delitem(sys.modules, key)


@pytest.mark.parametrize(("old", "new"), sorted(moved.MOVED.items()))
def test_an_old_name_is_the_module_at_its_new_place(
    old: str, new: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _forget(monkeypatch, old)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} has moved to {new}")):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__spec__ is not None
    assert module.__name__ == module.__spec__.name == new


def test_a_submodule_under_an_old_name_is_not_a_second_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``kvcore.simulate.trace`` is ``kvcore.tools.simulate.trace`` itself:
    its classes are the same classes (an error raised by one is caught as
    the other's)."""
    from kvcore.tools.simulate.trace import TraceError

    _forget(monkeypatch, "kvcore.simulate")
    with pytest.warns(DeprecationWarning, match="has moved") as caught:
        old = importlib.import_module("kvcore.simulate.trace")
    assert sorted(str(w.message).split()[0] for w in caught) == [
        "kvcore.simulate",
        "kvcore.simulate.trace",
    ]
    assert old.TraceError is TraceError
    assert sys.modules["kvcore.simulate.trace"] is old
    import kvcore

    _forget(monkeypatch, "kvcore.zoo")
    monkeypatch.delattr(kvcore, "zoo", raising=False)
    with pytest.warns(DeprecationWarning, match=r"kvcore\.zoo has moved"):
        zoo = kvcore.zoo  # attribute access imports it as ``import`` does
    assert zoo.path("llama-3-1-8b").name == "llama-3-1-8b.json"


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("kvcore.zoo", "kvcore.tools.zoo"),
        ("kvcore.cli.plan", "kvcore.tools.cli.plan"),
        ("kvcore.plan.stages", "kvcore.integrations.stages"),
        ("kvcore.plan", None),
        ("kvcore.zoology", None),
        ("kvcore.tools.zoo", None),
    ],
)
def test_new_name(old: str, new: str | None) -> None:
    assert moved.new_name(old) == new


def test_a_name_that_never_existed_is_still_not_found() -> None:
    with pytest.raises(ModuleNotFoundError, match=r"kvcore\.nothing"):
        importlib.import_module("kvcore.nothing")


def test_python_m_runs_a_moved_package() -> None:
    """``python -m kvcore.cli`` runs the CLI as ``python -m
    kvcore.tools.cli`` does (the old name of a package is a package, whose
    ``__main__`` is the new one's)."""
    import subprocess

    runs = [
        subprocess.run(
            [sys.executable, "-m", name, "--version"],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        for name in ("kvcore.cli", "kvcore.tools.cli")
    ]
    assert [(r.returncode, r.stdout) for r in runs[:1]] == [
        (runs[1].returncode, runs[1].stdout)
    ]
    assert runs[1].returncode == 0
    assert runs[1].stdout.startswith("kvcore ")


def test_find_spec_finds_only_what_exists_under_an_old_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``importlib.util.find_spec`` under an old name answers as under the
    new one: a spec (a package's, for a package) for what exists, None for
    what does not."""
    import importlib.util

    _forget(monkeypatch, "kvcore.zoo")
    with pytest.warns(DeprecationWarning, match=r"kvcore\.zoo has moved"):
        assert importlib.util.find_spec("kvcore.zoo.no_such_module") is None
    _forget(monkeypatch, "kvcore.simulate")
    spec = importlib.util.find_spec("kvcore.simulate")
    assert spec is not None
    assert spec.submodule_search_locations is not None
