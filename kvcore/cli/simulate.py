"""``kvcore simulate``: replay a workload through the real coordinator."""

from __future__ import annotations

import argparse

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``kvcore simulate`` (filled in by the simulator)."""
