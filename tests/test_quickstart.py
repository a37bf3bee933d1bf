"""Every command and code block of docs/quickstart.md works as written.

The ``pip install ...`` commands are not run (this environment is already
installed); they must be exactly the README's two fresh-machine commands.
Every other shell command runs from the repository root and must exit 0
with output (a ``kvcore`` command runs in this process through the
function the installed script calls, :func:`kvcore.tools.cli.main`;
tests/test_cli.py runs the script itself); every Python block runs in a
fresh interpreter and must exit 0.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import kvcore
from kvcore.tools.cli import main

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "docs" / "quickstart.md"
README = ROOT / "README.md"
CI = ROOT / ".ci" / "run"
TIMEOUT = 600

FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def blocks(text: str, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang == language]


def shell_commands(text: str) -> list[str]:
    """The commands of the ``bash`` blocks: one a line, ``\\`` continuing it,
    blank lines and comments dropped."""
    commands: list[str] = []
    for body in blocks(text, "bash"):
        pending = ""
        for line in body.splitlines():
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            command = (pending + line).strip()
            pending = ""
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def is_install(command: str) -> bool:
    return command.startswith("pip install")


def readme_quick_start() -> str:
    text = README.read_text()
    match = re.search(
        r"^## Quick start \(fresh machine\)\n(.*?)(?=^## )", text, re.M | re.S
    )
    assert match, "README.md has no '## Quick start (fresh machine)' section"
    return match.group(1)


QUICKSTART_TEXT = QUICKSTART.read_text()
RUNNABLE = [c for c in shell_commands(QUICKSTART_TEXT) if not is_install(c)]
PYTHON_BLOCKS = blocks(QUICKSTART_TEXT, "python")


def argv_of(command: str) -> list[str]:
    argv = shlex.split(command, comments=True)
    assert argv, f"empty command {command!r}"
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    return argv


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """``argv`` from the repository root with 120 columns: ``kvcore ...`` in
    this process, anything else in a new one."""
    if argv[0] == "kvcore":
        return run_kvcore(argv)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "120"}
    return subprocess.run(
        argv,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def test_the_quick_start_has_commands_and_code() -> None:
    assert RUNNABLE, "docs/quickstart.md shows no command to run"
    assert any(c.split()[:2] == ["kvcore", "plan"] for c in RUNNABLE)
    assert PYTHON_BLOCKS, "docs/quickstart.md shows no Python block"


def test_install_commands_are_the_readmes() -> None:
    readme = [c for c in shell_commands(readme_quick_start()) if is_install(c)]
    quickstart = [c for c in shell_commands(QUICKSTART_TEXT) if is_install(c)]
    assert quickstart == readme


def test_the_two_fresh_machine_commands() -> None:
    """The README's quick start states the main command and the test
    command, in that order, and nothing else to type."""
    assert shell_commands(readme_quick_start()) == [
        "pip install torch==2.13.0 && pip install -e . && kvcore plan",
        'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest',
    ]


def test_ci_runs_the_readmes_test_command() -> None:
    """CI installs the test extra and runs the tests as the README says."""
    test_command = shell_commands(readme_quick_start())[1]
    steps = [s.strip() for s in test_command.split("&&")]
    ci_lines = [line.strip() for line in CI.read_text().splitlines()]
    assert "python -m pytest" in ci_lines
    assert steps[-1] == "python -m pytest"
    assert 'python -m pip install --quiet -e ".[test]"' in ci_lines
    assert ci_lines.index(
        'python -m pip install --quiet -e ".[test]"'
    ) < ci_lines.index("python -m pytest")
    # ... and then the tests that run deselects (pyproject.toml's addopts),
    # so every test runs in CI.
    assert ci_lines.index("python -m pytest") < ci_lines.index(
        "python -m pytest -m slow"
    )


def run_kvcore(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """``kvcore ...`` in this process, with no default registry built yet,
    as in a new process."""
    kvcore.default_registry.cache_clear()
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLUMNS", "120")
        mp.chdir(ROOT)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv[1:])
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else int(bool(exc.code))
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("command", RUNNABLE)
def test_command_runs(command: str) -> None:
    result = run(argv_of(command))
    assert result.returncode == 0, (
        f"{command!r} exited {result.returncode}\n"
        f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
    assert result.stdout.strip(), f"{command!r} printed nothing"


@pytest.mark.parametrize(
    "code", PYTHON_BLOCKS, ids=[f"python-block-{i}" for i in range(len(PYTHON_BLOCKS))]
)
def test_python_block_runs(code: str) -> None:
    result = run([sys.executable, "-c", code])
    assert result.returncode == 0, (
        f"the Python block exited {result.returncode}\n"
        f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
