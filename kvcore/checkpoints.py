"""Where a recurrent-state group keeps its states for later requests.

A state kind (Mamba, linear attention) serves a prefix hit only from a state
saved exactly at the hit's end, and every saved state costs a whole block.
A :class:`CheckpointPolicy` says which states are worth a block: prompt ends,
output ends, branch points, an interval, or every step end.  What each keeps,
how running requests hold shared states, and the EAGLE and alignment rules
are in ``docs/coordinator.md`` and ``docs/plugins.md`` ("State checkpoints").
"""

from __future__ import annotations

from typing import Any

import attrs

from kvcore.errors import KvcoreValueError

__all__ = [
    "CHECKPOINT_POLICIES",
    "GRID_MIN_POINTS",
    "GRID_POOL_SHARE",
    "DEFAULT_CHECKPOINT_POLICY",
    "CheckpointPolicy",
    "CheckpointPolicyError",
    "checkpoint_policy",
    "grid_interval",
]

#: The share of the pool one request's grid of hit points may take by
#: default (interval states, windows held at grid points): see
#: :func:`grid_interval`.
GRID_POOL_SHARE = 1 / 256
#: The grid points one request may keep whatever the pool (see
#: :func:`grid_interval`).
GRID_MIN_POINTS = 4
#: A window grid's points cost at most this share of the blocks the groups
#: that keep every block take over the tokens between two points (see
#: :meth:`~kvcore.coordinator.managers.WindowManager.plan_checkpoints`).
GRID_PREFIX_SHARE = 1 / 8


class CheckpointPolicyError(KvcoreValueError):
    """A checkpoint policy name or setting that kvcore does not know."""


def _flag(instance: Any, attribute: Any, value: Any) -> None:
    if type(value) is not bool:
        msg = (
            f"CheckpointPolicy.{attribute.name} must be a bool (True or False), "
            f"got {value!r}"
        )
        raise CheckpointPolicyError(msg)


def _count(minimum: int, meaning: str) -> Any:
    """A validator of an int field of at least ``minimum``."""

    def check(instance: Any, attribute: Any, value: Any) -> None:
        if type(value) is not int or value < minimum:
            msg = (
                f"CheckpointPolicy.{attribute.name} must be an int >= {minimum} "
                f"({meaning}), got {value!r}"
            )
            raise CheckpointPolicyError(msg)

    return check


_interval = _count(0, "tokens between checkpoints inside a prefill; 0: none")
_per_step = _count(1, "interval checkpoints one step may keep")


def _fraction(instance: Any, attribute: Any, value: Any) -> None:
    if type(value) not in (int, float) or not 0 <= value <= 1:
        msg = (
            f"CheckpointPolicy.{attribute.name} must be a number from 0 to 1 "
            f"(the share of the pool one request's interval states may take; "
            f"0: no limit), got {value!r}"
        )
        raise CheckpointPolicyError(msg)


@attrs.frozen(kw_only=True)
class CheckpointPolicy:
    """Which states a checkpointed group keeps (see the module docs).

    :param prompt_end: keep the state at the last hit boundary of the prompt.
    :param output_end: keep the state at the last hit boundary a request
        reaches; earlier ones a decoding request passes leave the cache.
    :param branch_points: keep the state where the admission lookup found
        the shared prefix ends.
    :param interval: also keep one every ``interval`` tokens (rounded up to
        the hit unit) of the part of a prompt no earlier request shared; 0
        for none.
    :param interval_per_step: at most this many of those inside one step
        (a long step keeps every k-th, its last one included), which bounds
        the blocks a step takes.
    :param interval_pool_share: the interval doubles (for that request)
        until one request's interval states, one block in every group that
        keeps them, take at most this share of the pool: a state costs a
        block per group, so a small pool keeps a coarser grid and more room
        for the prefixes the grid points into; 0 for no limit.
    :param every_step: keep every state a step leaves on a hit boundary.
    :param hold_shared: a running request holds its hit's state, its
        branch point and the longest shared state on its path until it is
        freed (up to three blocks more per group).
    """

    prompt_end: bool = attrs.field(default=True, validator=_flag)
    output_end: bool = attrs.field(default=True, validator=_flag)
    branch_points: bool = attrs.field(default=True, validator=_flag)
    interval: int = attrs.field(default=1024, validator=_interval)
    interval_per_step: int = attrs.field(default=4, validator=_per_step)
    interval_pool_share: float = attrs.field(
        default=GRID_POOL_SHARE, validator=_fraction
    )
    every_step: bool = attrs.field(default=False, validator=_flag)
    hold_shared: bool = attrs.field(default=True, validator=_flag)

    @property
    def blocks_beyond_live(self) -> int:
        """Blocks a request may hold besides the state it reads and the one
        it writes: checkpoints inside one step (two prompt ends, a branch
        point, the interval ones) and the states it holds (its hit's, its
        branch point, the shared state on its path)."""
        inner = 2 * int(self.prompt_end) + int(self.branch_points)
        if self.interval:
            inner += self.interval_per_step
        held = (2 + int(self.branch_points)) if self.hold_shared else 0
        return inner + held

    @property
    def places_targets(self) -> bool:
        """Whether the policy keeps states inside a step (which then takes a
        block at that position as well as at its end)."""
        return self.prompt_end or self.branch_points or self.interval > 0

    @property
    def keeps_step_ends(self) -> bool:
        """Whether a state a step leaves on a hit boundary is hashed."""
        return self.every_step or self.output_end


#: Named policies a state kind's spec may choose.
CHECKPOINT_POLICIES: dict[str, CheckpointPolicy] = {
    # Chats and shared prompts: prompt end, output end, branch points, and
    # every 1024 tokens of a prompt's new part.
    "turns": CheckpointPolicy(),
    # Only the states steps leave on hit boundaries, every one kept.
    "steps": CheckpointPolicy(
        prompt_end=False,
        output_end=False,
        branch_points=False,
        interval=0,
        every_step=True,
        hold_shared=False,
    ),
    # Prompt ends and branch points: no state kept for a request's output.
    "prompts": CheckpointPolicy(output_end=False),
}

#: The policy a state kind uses unless its spec chooses another.
DEFAULT_CHECKPOINT_POLICY = "turns"


def grid_interval(
    every: int, tokens: int, point_blocks: int, num_blocks: int, share: float
) -> int:
    """The interval of one request's grid of hit points over ``tokens``
    tokens: ``every``, doubled until the grid's points, ``point_blocks``
    blocks each (over every group that keeps blocks there), take at most
    ``share`` of a pool of ``num_blocks`` blocks (0: no limit), or are at
    most :data:`GRID_MIN_POINTS`.  A point costs blocks that the prefixes
    it points into could use, so a small pool keeps a coarser grid; a pool
    of a few requests still keeps a few points, which serve the requests
    that branch from a running prompt."""
    if share and point_blocks:
        budget = max(num_blocks * share, GRID_MIN_POINTS * point_blocks)
        while tokens // every * point_blocks > budget:
            every *= 2
    return every


def checkpoint_policy(
    name: str, *, what: str = "checkpoint_policy"
) -> CheckpointPolicy:
    """The named policy, or a :class:`CheckpointPolicyError` listing them."""
    policy = CHECKPOINT_POLICIES.get(name) if type(name) is str else None
    if policy is None:
        msg = f"{what} must be one of {', '.join(CHECKPOINT_POLICIES)}, got {name!r}"
        raise CheckpointPolicyError(msg)
    return policy
