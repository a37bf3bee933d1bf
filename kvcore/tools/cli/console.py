"""The rich console the commands print through."""

from __future__ import annotations

import os
import sys
from typing import Any

from rich.console import Console

__all__ = ["make_console"]


class _Console(Console):
    """A closed pipe (``kvcore plan | head``) reaches the CLI's own handler,
    which exits quietly, instead of rich's exit status 1."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError


def make_console(**kwargs: Any) -> Console:
    """Rich output at the terminal's width; 120 columns when piped, unless
    ``COLUMNS`` says otherwise."""
    piped = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    kwargs.setdefault("width", 120 if piped else None)
    return _Console(highlight=False, soft_wrap=False, **kwargs)
