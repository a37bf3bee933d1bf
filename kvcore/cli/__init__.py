"""``kvcore``: answer "how many requests fit", replay workloads, list plugins.

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

from kvcore.cli import info, plan, simulate
from kvcore.errors import KvcoreError

__all__ = ["build_parser", "main"]

#: The command modules, in the order ``kvcore --help`` lists them.
COMMANDS = (plan, simulate, info)


def build_parser() -> argparse.ArgumentParser:
    """The whole ``kvcore`` parser (the docs' CLI reference is generated
    from it)."""
    parser = argparse.ArgumentParser(
        prog="kvcore",
        description=(__doc__ or "").split("\n\n")[0],
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the full traceback of an error instead of one line",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = bool(getattr(args, "debug", False))
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
        print(f"kvcore: error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    raise SystemExit(main())
