"""The recurrent-state block manager.

``mamba_cache_mode="none"``: each request holds one state block (plus its
speculative blocks) for its life; nothing is cached.

``"align"`` (what ``"auto"`` becomes with prefix caching on): the table is
indexed by block position like attention, but only the newest state is a
real block; earlier positions are the null block.  The spec's
``checkpoint_policy`` chooses which states on hit boundaries are kept for
later requests (see :mod:`kvcore.checkpoints`).

``"all"``: like ``"align"``, but every state block is kept for the request's
life.
"""

from __future__ import annotations

from typing import Any

from kvcore.checkpoints import CheckpointPolicy, checkpoint_policy
from kvcore.coordinator.block_pool import BlockPool
from kvcore.coordinator.managers import CheckpointManager, FixedBlocksManager
from kvcore.errors import InvalidSpecError

__all__ = ["MambaManager", "MambaStateManager"]


class MambaStateManager(FixedBlocksManager):
    """Mode ``none``: one state block (plus speculative ones) per request."""

    def blocks_per_request(self, spec: Any) -> int:
        return 1 + int(spec.num_speculative_blocks)


class MambaManager(CheckpointManager):
    """Modes ``align`` and ``all``: states at block boundaries."""

    def __init__(self, spec: Any, block_pool: BlockPool, **kwargs: Any) -> None:
        if spec.num_speculative_blocks:
            msg = (
                f"mamba_cache_mode={spec.mamba_cache_mode!r} with "
                f"num_speculative_blocks={spec.num_speculative_blocks} is not "
                "supported: state blocks are cached by position, and speculative "
                "states have none. Use mamba_cache_mode='none' with speculative "
                "decoding"
            )
            raise InvalidSpecError(msg)
        super().__init__(spec, block_pool, **kwargs)

    def keeps_every_state(self, spec: Any) -> bool:
        return bool(spec.mamba_cache_mode == "all")

    def checkpoint_policy(self, spec: Any) -> CheckpointPolicy:
        return checkpoint_policy(spec.checkpoint_policy)
