"""kvcore: answer "how many requests fit", replay workloads, list plugins.

    kvcore plan [MODEL] [--gpu H100 | --memory 80GiB] [--context 4k,32k] ...
    kvcore compare [MODEL] ...
    kvcore simulate [MODEL] [--trace FILE] ...
    kvcore kinds | plugins [--json]

``MODEL`` is a model file path or the name of a shipped one; without it the
commands use the DeepSeek-V4-Flash file.  Each command lives in its own
module here and adds its parser through ``register(subparsers)``.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from importlib.metadata import PackageNotFoundError, version
from typing import NoReturn

from kvcore.errors import KvcoreError, did_you_mean, escape_controls
from kvcore.tools.cli.parsers import COMMANDS
from kvcore.tools.limits import MAX_MESSAGE_CHARS

__all__ = ["build_parser", "main"]


def one_line(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """An error message as one escaped line of at most ``limit`` characters."""
    text = escape_controls(message)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as kvcore's one line and exit status 2."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments: "):
            message += self._suggest(message.split(": ", 1)[1].split())
        sys.stderr.write(f"kvcore: error: {message} (see `{self.prog} --help`)\n")
        raise SystemExit(2)

    #: The command line being parsed (set by :func:`main`), to find the
    #: command whose options an unknown one is compared with.
    words: list[str] | None = None

    def _options(self) -> set[str]:
        """The option strings of this parser and of the command given."""
        found: set[str] = set()
        for action in self._actions:
            found.update(s for s in action.option_strings if s.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                for word in self.words or ():
                    sub = action.choices.get(word)
                    if isinstance(sub, _Parser):
                        found |= sub._options()
                        break
        return found

    def _suggest(self, words: list[str]) -> str:
        """``did you mean`` for the first unknown option close to a known one
        (argparse's own suggestions come with Python 3.12's choices only)."""
        options = self._options()
        for word in words:
            if word.startswith("--"):
                hint = did_you_mean(word.split("=", 1)[0], options)
                if hint:
                    return f"; {word.split('=', 1)[0]}{hint}"
        return ""


def _version() -> str:
    try:
        return version("kvcore")
    except PackageNotFoundError:  # pragma: no cover - a bare checkout
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The whole ``kvcore`` parser (the docs' CLI reference is generated
    from it)."""
    parser = _Parser(
        prog="kvcore",
        description=(__doc__ or "").split("\n\n")[0],
    )
    parser.add_argument("--version", action="version", version=f"kvcore {_version()}")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the full traceback of an error instead of one line "
        "(anywhere on the command line)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in COMMANDS:
        register(sub)
    return parser


_WORDS = {"inf", "infinity", "nan"}


def _join_negative_values(argv: list[str]) -> list[str]:
    """``--memory -5GiB`` -> ``--memory=-5GiB``, so a negative value reaches
    the option's own check (and its message) instead of reading as a flag."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        nxt = argv[i + 1] if i + 1 < len(argv) else ""
        if (
            token.startswith("--")
            and "=" not in token
            and nxt[:1] == "-"
            and (nxt[1:2].isdigit() or nxt[1:2] == "." or nxt[1:].lower() in _WORDS)
        ):
            out.append(f"{token}={nxt}")
            i += 2
            continue
        out.append(token)
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in words
    if isinstance(parser, _Parser):
        parser.words = words
    args = parser.parse_args(
        _join_negative_values([w for w in words if w != "--debug"])
    )
    if sys.stdout is None:
        # ``kvcore plan >&-``: Python starts with no stdout object at all.
        if sys.stderr is not None:
            print(
                "kvcore: error: standard output is closed; redirect it to a file "
                "or /dev/null instead",
                file=sys.stderr,
            )
        return 2
    try:
        code: int = args.func(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # ``kvcore plan --json | head``: the reader left; exit quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except KvcoreError as exc:
        if debug:
            traceback.print_exc()
        print(f"kvcore: error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except OSError as exc:
        # Output that cannot be written (a full disk, a closed terminal).
        if debug:
            traceback.print_exc()
        print(f"kvcore: error: cannot write the output: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    raise SystemExit(main())
