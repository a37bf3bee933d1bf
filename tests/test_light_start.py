"""``kvcore --help``, ``--version`` and argument errors never import torch.

A fresh interpreter is the only place ``sys.modules`` can prove it: the
test process has torch imported long before.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvcore

PROBE = """
import sys
from kvcore.tools.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    print("exit", exc.code)
print("torch" in sys.modules, "kvcore.spec" in sys.modules)
"""


def _fresh(probe: str) -> list[str]:
    """The words a fresh interpreter prints running ``probe``."""
    return subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["--help"], 0),
        (["--version"], 0),
        (["plan", "--help"], 0),
        (["simulate", "--help"], 0),
        (["plan", "--no-such-option"], 2),
        (["plan", "--policy", "nope"], 2),
        ([], 2),
    ],
)
def test_the_parser_never_imports_torch(argv: list[str], code: int) -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.splitlines()
    assert out[-2:] == [f"exit {code}", "False False"]


def test_import_kvcore_is_light_and_its_names_resolve() -> None:
    probe = (
        "import sys, kvcore; light = 'torch' not in sys.modules; "
        "from kvcore import plan_kv_cache, KVCachePool; "
        "print(light, 'torch' in sys.modules, plan_kv_cache.__module__)"
    )
    assert _fresh(probe) == ["True", "True", "kvcore.plan.plan"]


def test_every_public_name_is_lazy_and_listed() -> None:
    assert set(kvcore._LAZY) == set(kvcore.__all__)
    for name in kvcore.__all__:
        assert getattr(kvcore, name) is not None
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = kvcore.no_such_name  # type: ignore[attr-defined]


def test_submodules_are_reachable_from_a_bare_import() -> None:
    """``import kvcore`` then ``kvcore.plugins`` (or any submodule) works as
    it did when the package imported everything eagerly."""
    code = (
        "import kvcore\n"
        "print(kvcore.plugins.get_plugin_manager.__name__, "
        "kvcore.coordinator.KVCacheManager.__name__, "
        "kvcore.serialize.load_config.__name__)\n"
        "try:\n"
        "    kvcore.no_such_name\n"
        "except AttributeError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert (out.returncode, out.stderr) == (0, "")
    assert out.stdout.splitlines() == [
        "get_plugin_manager KVCacheManager load_config",
        "module 'kvcore' has no attribute 'no_such_name'",
    ]


def test_import_kvcore_loads_no_file_or_archive_modules() -> None:
    """``import kvcore`` (its finder of moved module names included) loads
    none of the standard library's file, archive or import-ABC modules: a
    plain finder needs no ``importlib.abc``, whose resources half pulls
    ``tempfile``, ``shutil``, ``bz2`` and ``lzma`` into every start."""
    # Only what ``import kvcore`` adds counts: an interpreter's own start-up
    # (a site's ``.pth`` files) may load some of these before it.
    probe = (
        "import sys; "
        "names = ('importlib.abc', 'importlib.resources', 'tempfile', 'shutil', "
        "'bz2', 'lzma', 'random'); "
        "before = set(sys.modules); "
        "import kvcore; "
        "print(sorted(m for m in names if m in sys.modules and m not in before))"
    )
    assert _fresh(probe) == ["[]"]
