"""The code limits of pyproject's ``[tool.kvcore.limits]``: no module of
``kvcore/`` or ``plugins/`` over ``max-module-lines`` lines, no function over
ruff's ``max-statements`` (PLR0915), and no function of the
``line-limited-folders`` over ``max-function-lines`` lines.

Each exception is listed once, with its reason, the day it was listed and the
issue that removes it. An exception that is no longer needed fails as surely
as a new long module or function, so the lists only shrink. Ruff counts the
statements (its own rule, so the count is the one ``ruff check`` enforces);
the lines are counted here.
"""

from __future__ import annotations

import ast
import datetime
import json
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
#: The folders whose modules the line limit covers.
SIZED = ("kvcore", "plugins")
RULE = "PLR0915"
HOW_TO_LIST = (
    "list it under [tool.kvcore.limits] {table} in pyproject.toml with a "
    "reason, the date and the issue that removes it"
)


def _pyproject() -> dict[str, Any]:
    with PYPROJECT.open("rb") as f:
        return tomllib.load(f)


CONFIG = _pyproject()
LIMITS: dict[str, Any] = CONFIG["tool"]["kvcore"]["limits"]
MAX_LINES: int = LIMITS["max-module-lines"]
MAX_STATEMENTS: int = CONFIG["tool"]["ruff"]["lint"]["pylint"]["max-statements"]
MAX_FUNCTION_LINES: int = LIMITS["max-function-lines"]
LINE_LIMITED: list[str] = LIMITS["line-limited-folders"]


def module_lines(folders: Iterable[Path], root: Path) -> dict[str, int]:
    """Lines of every ``.py`` file under ``folders``, by path from ``root``."""
    return {
        path.relative_to(root).as_posix(): len(
            path.read_text(encoding="utf-8").splitlines()
        )
        for folder in folders
        for path in sorted(folder.rglob("*.py"))
    }


def module_problems(
    lines: Mapping[str, int], listed: Iterable[str], limit: int
) -> list[str]:
    """Modules over ``limit`` that are not listed, and listed modules that
    are no longer over it (or gone)."""
    listed = set(listed)
    problems = [
        f"{path} has {n} lines, over max-module-lines = {limit}: split it, or "
        + HOW_TO_LIST.format(table="long-modules")
        for path, n in sorted(lines.items())
        if n > limit and path not in listed
    ]
    problems += [
        f"{path} is listed under long-modules but "
        + (f"has {lines[path]} lines" if path in lines else "does not exist")
        + f" (limit {limit}): remove its entry"
        for path in sorted(listed)
        if lines.get(path, 0) <= limit
    ]
    return problems


def function_lines(folders: Iterable[Path], root: Path) -> dict[tuple[str, str], int]:
    """Lines of every function (decorators aside, docstring included) of the
    ``.py`` files under ``folders``, by ``(path from root, qualified name)``."""
    out: dict[tuple[str, str], int] = {}
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            names = _qualified_names(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    key = (path.relative_to(root).as_posix(), names[node.lineno])
                    out[key] = (node.end_lineno or node.lineno) - node.lineno + 1
    return out


def _qualified_names(tree: ast.Module) -> dict[int, str]:
    """The qualified name of every function, by the line of its ``def``."""
    names: dict[int, str] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                names[child.lineno] = prefix + child.name
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return names


def long_functions(
    paths: Iterable[Path], root: Path, config: Path = PYPROJECT
) -> set[tuple[str, str]]:
    """``(path, function)`` of every function ruff finds over max-statements,
    with the per-file ignores and every ``# noqa`` set aside, so an exception
    counts only when it is listed."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--no-cache",
            "--exit-zero",
            "--ignore-noqa",
            "--config",
            str(config),
            "--config",
            "lint.per-file-ignores = {}",
            "--select",
            RULE,
            "--output-format",
            "json",
            *map(str, paths),
        ],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    )
    found = set()
    for violation in json.loads(out.stdout):
        path = Path(violation["filename"])
        names = _qualified_names(ast.parse(path.read_text(encoding="utf-8")))
        found.add(
            (
                path.relative_to(root).as_posix(),
                names[violation["location"]["row"]],
            )
        )
    return found


def function_problems(
    found: Iterable[tuple[str, str]], listed: Iterable[tuple[str, str]]
) -> list[str]:
    """Long functions not listed, and listed functions no longer long."""
    found, listed = set(found), set(listed)
    problems = [
        f"{path}: {name} is over max-statements = {MAX_STATEMENTS} ({RULE}): "
        "split it, or " + HOW_TO_LIST.format(table="long-functions")
        for path, name in sorted(found - listed)
    ]
    problems += [
        f"{path}: {name} is listed under long-functions but is not over "
        f"max-statements = {MAX_STATEMENTS}: remove its entry (and its "
        "per-file ignore)"
        for path, name in sorted(listed - found)
    ]
    return problems


@pytest.mark.parametrize("table", ["long-modules", "long-functions"])
def test_every_exception_says_why_since_when_and_which_issue_removes_it(
    table: str,
) -> None:
    entries = LIMITS[table]
    for entry in entries:
        assert isinstance(entry["path"], str), entry
        assert entry["reason"].strip(), entry
        assert isinstance(entry["since"], datetime.date), entry
        assert isinstance(entry["issue"], int), entry
        assert entry["issue"] > 0, entry
    paths = [(e["path"], e.get("function")) for e in entries]
    assert len(paths) == len(set(paths)), f"{table} lists an entry twice"


def test_no_module_is_over_the_line_limit_unless_listed() -> None:
    lines = module_lines([ROOT / folder for folder in SIZED], ROOT)
    listed = [entry["path"] for entry in LIMITS["long-modules"]]
    assert module_problems(lines, listed, MAX_LINES) == []


def test_no_function_is_over_the_statement_limit_unless_listed() -> None:
    found = long_functions([ROOT], ROOT)
    listed = [(e["path"], e["function"]) for e in LIMITS["long-functions"]]
    assert function_problems(found, listed) == []


def test_no_function_of_the_line_limited_folders_is_over_the_line_limit() -> None:
    assert LINE_LIMITED, "line-limited-folders names no folder"
    lines = function_lines([ROOT / folder for folder in LINE_LIMITED], ROOT)
    assert lines, f"no function found under {LINE_LIMITED}"
    long = {
        f"{path}: {name}": n
        for (path, name), n in sorted(lines.items())
        if n > MAX_FUNCTION_LINES
    }
    assert long == {}, (
        f"over max-function-lines = {MAX_FUNCTION_LINES}: split them into "
        "steps with one job each"
    )


def test_the_function_line_count_covers_methods_and_docstrings(
    tmp_path: Path,
) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "mod.py").write_text(
        'def short() -> None:\n    """Doc."""\n\n\n'
        "class Box:\n    @staticmethod\n    def long() -> None:\n"
        '        """One\n        two."""\n        x = 1\n        y = 2\n'
    )
    assert function_lines([package], tmp_path) == {
        ("pkg/mod.py", "short"): 2,
        ("pkg/mod.py", "Box.long"): 5,
    }


def test_each_long_function_file_has_its_per_file_ignore_and_no_other() -> None:
    ignores = CONFIG["tool"]["ruff"]["lint"]["per-file-ignores"]
    ignored = {path for path, rules in ignores.items() if RULE in rules}
    assert ignored == {entry["path"] for entry in LIMITS["long-functions"]}


def test_the_line_check_finds_a_long_module_and_a_stale_exception(
    tmp_path: Path,
) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "long.py").write_text("x = 1\n" * 11)
    (package / "short.py").write_text("x = 1\n" * 10)
    lines = module_lines([package], tmp_path)
    assert lines == {"pkg/long.py": 11, "pkg/short.py": 10}
    problems = module_problems(lines, ["pkg/short.py", "pkg/gone.py"], 10)
    assert [p.split(" ", 1)[0] for p in problems] == [
        "pkg/long.py",
        "pkg/gone.py",
        "pkg/short.py",
    ]
    assert "has 11 lines, over max-module-lines = 10" in problems[0]
    assert "does not exist (limit 10): remove its entry" in problems[1]
    assert "has 10 lines (limit 10): remove its entry" in problems[2]
    assert module_problems(lines, ["pkg/long.py"], 10) == []


def _function(name: str, statements: int) -> str:
    """A function of ``statements`` statements (its ``def`` is not one)."""
    return f"def {name}() -> None:\n" + "    x = 1\n" * statements + "\n"


def test_the_statement_check_finds_a_long_method_and_a_stale_exception(
    tmp_path: Path,
) -> None:
    code = (
        _function("at_the_limit", MAX_STATEMENTS)
        + "\nclass Box:\n"
        + "".join(
            "    " + line + "\n"
            for line in _function("over", MAX_STATEMENTS + 1).splitlines()
        )
    )
    module = tmp_path / "mod.py"
    module.write_text(code)
    found = long_functions([module], tmp_path)
    assert found == {("mod.py", "Box.over")}
    problems = function_problems(found, [("mod.py", "at_the_limit")])
    assert problems[0].startswith(
        f"mod.py: Box.over is over max-statements = {MAX_STATEMENTS}"
    )
    assert problems[1].startswith(
        "mod.py: at_the_limit is listed under long-functions but is not over"
    )
    assert function_problems(found, [("mod.py", "Box.over")]) == []
