"""The hot-page block manager: ``blocks_per_request`` private blocks."""

from __future__ import annotations

from typing import Any

from kvcore.coordinator.managers import FixedBlocksManager

__all__ = ["HiSparseHotManager"]


class HiSparseHotManager(FixedBlocksManager):
    """Each request holds its spec's ``blocks_per_request`` hot-page blocks
    for its whole life; they are private, so never hashed."""

    def blocks_per_request(self, spec: Any) -> int:
        return int(spec.blocks_per_request)
