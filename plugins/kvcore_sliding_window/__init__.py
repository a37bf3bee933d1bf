"""Sliding-window attention: only the last ``sliding_window`` tokens are kept.

With ``bounded_replay`` the window is not prefix-cached at all: after a hit
the scheduler recomputes the hit's last ``sliding_window`` tokens instead.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import ClassVar

import attrs

from kvcore.hookspecs import kinds_impl
from kvcore.kinds import AttentionKind
from kvcore.spec import (
    AttentionSpec,
    HitPolicy,
    PackingRole,
    Sharded,
    cdiv,
    is_bool,
    non_negative_int,
    one_latent,
    positive_int,
    replicate,
)
from kvcore_sliding_window.manager import SlidingWindowManager

__all__ = [
    "SlidingWindowManager",
    "SlidingWindow",
    "SlidingWindowMLA",
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
]


@attrs.frozen(kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """A sliding-window attention layer.

    :param sliding_window: tokens each query attends to (the current one
        included).
    :param extra_retained_tokens: tokens kept beyond the window.
    :param bounded_replay: keep the window out of prefix caching and replay
        it after a hit.
    """

    kind: ClassVar[str] = "sliding_window"
    packing_role: ClassVar[PackingRole] = PackingRole.WINDOW

    sliding_window: int = attrs.field(validator=positive_int)
    extra_retained_tokens: int = attrs.field(default=0, validator=non_negative_int)
    bounded_replay: bool = attrs.field(default=False, validator=is_bool)

    @property
    def hit_policy(self) -> HitPolicy:
        # A bounded-replay window is rebuilt by replaying the window.
        return HitPolicy.NOT_HASHED if self.bounded_replay else HitPolicy.WINDOW

    @property
    def prefix_replay_tokens(self) -> int:
        return self.sliding_window if self.bounded_replay else 0

    @property
    def event_window(self) -> int:
        # A router keys a hit on the window the next token reads.
        return self.sliding_window

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens below the window of the next token to compute."""
        skipped = (
            num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens
        )
        return skipped if skipped > 0 else 0

    def max_num_blocks_per_request(self, max_model_len: int) -> int:
        live = min(self.sliding_window - 1 + self.extra_retained_tokens, max_model_len)
        return min(
            cdiv(live, self.block_size) + 1, cdiv(max_model_len, self.block_size)
        )

    def group_key(self) -> Hashable:
        return (
            self.kind,
            self.block_size,
            self.sliding_window,
            self.extra_retained_tokens,
        )


@attrs.frozen(kw_only=True)
class SlidingWindowMLASpec(SlidingWindowSpec):
    """A sliding window of MLA latents: ``[1, block_size, head_size]``."""

    kind: ClassVar[str] = "sliding_window_mla"

    num_kv_heads: int = attrs.field(validator=one_latent)
    head_size_v: int = attrs.field(default=0, validator=non_negative_int)

    def sharded(self, tp_size: int) -> Sharded:
        """Every rank keeps the whole latent window, as for MLA."""
        return replicate(self, tp_size, "MLA latent")


class SlidingWindow(AttentionKind):
    spec_type = SlidingWindowSpec
    manager_type = SlidingWindowManager


class SlidingWindowMLA(AttentionKind):
    spec_type = SlidingWindowMLASpec
    manager_type = SlidingWindowManager


kvcore_register_kinds = kinds_impl(SlidingWindow(), SlidingWindowMLA())
