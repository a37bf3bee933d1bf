"""The chunked-local block manager.

Blocks of completed chunks are never read again: they go back to the pool
and become the null block in the request's table.  The release line comes
from the spec's ``skipped_tokens`` (the tokens of completed chunks); the
kind is never hashed (``HitPolicy.NOT_HASHED``), so there is no hit search.
"""

from __future__ import annotations

from kvcore.coordinator.managers import WindowManager

__all__ = ["ChunkedLocalManager"]


class ChunkedLocalManager(WindowManager):
    """Frees the blocks of completed chunks; never hashed."""
