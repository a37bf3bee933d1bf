"""The full-attention block manager: every block stays, hits grow from the left."""

from __future__ import annotations

from kvcore.coordinator.managers import PrefixManager

__all__ = ["FullAttentionManager"]


class FullAttentionManager(PrefixManager):
    """Keeps every block of a request; the prefix hit is the run of cached
    blocks from the first block up to the first miss."""
