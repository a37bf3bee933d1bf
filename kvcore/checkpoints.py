"""Where a recurrent-state group keeps its states for later requests.

A state kind (Mamba, linear attention) can serve a prefix hit only from a
state saved exactly at the hit's end, and every saved state costs a whole
block.  A :class:`CheckpointPolicy` says which states are worth a block: the
positions later requests are likely to resume from.

- **prompt end**: the last hit boundary at or below the end of the prompt
  (the same prompt sent again, or the same prompt with another answer);
- **output end**: the last hit boundary a request reaches before it
  finishes (the next turn of a chat extends exactly that).  While the
  request decodes, each boundary it reaches replaces the one before, which
  leaves the cache unless another request holds it;
- **branch points**: where the prefix a request shares with earlier ones
  ends, as its admission lookup found it (the other groups hold that
  prefix, this group had no state there); the next request sharing the
  prefix resumes there;
- **interval**: every ``interval`` tokens inside long prefills;
- **every step**: every state a step leaves on a hit boundary, all kept
  (the most resume points, the most blocks).

States at positions no hit can end at (not a multiple of the hit unit) are
never kept.
"""

from __future__ import annotations

from typing import Any

import attrs

from kvcore.errors import KvcoreValueError

__all__ = [
    "CHECKPOINT_POLICIES",
    "DEFAULT_CHECKPOINT_POLICY",
    "CheckpointPolicy",
    "CheckpointPolicyError",
    "checkpoint_policy",
]


class CheckpointPolicyError(KvcoreValueError):
    """A checkpoint policy name or setting that kvcore does not know."""


def _flag(instance: Any, attribute: Any, value: Any) -> None:
    if type(value) is not bool:
        msg = (
            f"CheckpointPolicy.{attribute.name} must be a bool (True or False), "
            f"got {value!r}"
        )
        raise CheckpointPolicyError(msg)


def _interval(instance: Any, attribute: Any, value: Any) -> None:
    if type(value) is not int or value < 0:
        msg = (
            "CheckpointPolicy.interval must be an int >= 0 (tokens between "
            f"checkpoints inside a prefill; 0: none), got {value!r}"
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
        the hit unit) inside a prefill; 0 for none.
    :param every_step: keep every state a step leaves on a hit boundary.
    """

    prompt_end: bool = attrs.field(default=True, validator=_flag)
    output_end: bool = attrs.field(default=True, validator=_flag)
    branch_points: bool = attrs.field(default=True, validator=_flag)
    interval: int = attrs.field(default=0, validator=_interval)
    every_step: bool = attrs.field(default=False, validator=_flag)

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
    # Chats and shared prompts: prompt end, output end, branch points.
    "turns": CheckpointPolicy(),
    # Only the states steps leave on hit boundaries, every one kept.
    "steps": CheckpointPolicy(
        prompt_end=False, output_end=False, branch_points=False, every_step=True
    ),
    # Prompt ends and branch points: no state kept for a request's output.
    "prompts": CheckpointPolicy(output_end=False),
}

#: The policy a state kind uses unless its spec chooses another.
DEFAULT_CHECKPOINT_POLICY = "turns"


def checkpoint_policy(
    name: str, *, what: str = "checkpoint_policy"
) -> CheckpointPolicy:
    """The named policy, or a :class:`CheckpointPolicyError` listing them."""
    policy = CHECKPOINT_POLICIES.get(name) if type(name) is str else None
    if policy is None:
        msg = f"{what} must be one of {', '.join(CHECKPOINT_POLICIES)}, got {name!r}"
        raise CheckpointPolicyError(msg)
    return policy
