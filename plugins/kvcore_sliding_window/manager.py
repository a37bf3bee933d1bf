"""The sliding-window block manager.

Blocks that leave the window go back to the pool and become the null block
in the request's table.  A prefix hit needs only the window's tokens cached,
so the search runs from the right; the window and the tokens kept with it
come from the spec's ``skipped_tokens``.
"""

from __future__ import annotations

from kvcore.coordinator.managers import WindowManager

__all__ = ["SlidingWindowManager"]


class SlidingWindowManager(WindowManager):
    """Frees blocks below the window; hits need the last window of blocks."""
