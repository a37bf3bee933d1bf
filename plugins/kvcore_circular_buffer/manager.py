"""The ring's block manager: one block per request for its whole life."""

from __future__ import annotations

from kvcore.coordinator.managers import FixedBlocksManager

__all__ = ["CircularBufferManager"]


class CircularBufferManager(FixedBlocksManager):
    """Claims exactly one block when a request first allocates and keeps it
    until the request is freed; never hashed, never a hit."""
