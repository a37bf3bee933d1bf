"""The capacity model: how many requests of ``T`` tokens a plan holds.

A request of ``T`` tokens is served at steady state when its ``T``-th token
is computed: with ``T - 1`` tokens behind it (blocks it no longer reads
released), it holds, per group, what its kind's
:meth:`~kvcore.spec.KVCacheSpec.num_blocks_held` says for the step
``[T - 1, T)``: all of ``T`` for full attention and MLA, the window's (or
the current chunk's) blocks, a fixed state, a ring's block, hot pages.  One
prefill of up to ``max_num_batched_tokens`` tokens a step is in flight at a
time: it needs, once per batch, the blocks its request holds beyond steady
state while its prompt (``T - 1`` tokens, then the last one) is computed.
Block 0 is the null block.  So with ``U = num_blocks - 1`` usable blocks,
``s`` blocks per request and a prefill peak of ``p``::

    concurrency = 0 if p > U else 1 + (U - p) // s

The physical limit keeps every layer's own pages at its model-file block
size, each without its alignment padding, with no stride, no padding to a
common page, no reservation and no null block, so no plan exceeds it.  The
layers are counted as the plan runs them: a spec whose defaults depend on
the engine (a recurrent state's caching mode, ``auto`` in a model file) is
resolved for the plan's prefix caching and state-cache mode first, so the
limit never counts a state that mode does not keep.

``ratio`` is ``unreserved_concurrency / ideal_concurrency``: the bytes the
limit holds a request in over the bytes the plan holds it in, unrounded and
with nothing reserved (1.0 is the limit).  It is one figure everywhere:
:attr:`Capacity.ratio`, the ``ratio`` of ``kvcore plan`` and ``kvcore
compare`` and of their JSON documents.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import attrs

from kvcore.errors import PlanError, require_instance
from kvcore.length_mix import LengthMix
from kvcore.plan.block_sizes import effective_block_size, plan_hit_granularity
from kvcore.plan.declarations import (
    checked_blocks_held,
    checked_state_cache_mode,
    resolved_defaults,
)
from kvcore.spec import KVCacheSpec
from kvcore.structs import KVCacheConfig, KVCacheGroupSpec

#: The prefill step the model reserves when neither the call nor the plan
#: says (the engine default of :class:`~kvcore.config.EngineConfig`).
DEFAULT_BATCHED_TOKENS = 8192
#: The most prefill steps the model walks for one request (2**16 steps of
#: 8192 tokens is half a billion tokens).
MAX_PREFILL_STEPS = 2**16

__all__ = [
    "Capacity",
    "GroupCapacity",
    "plan_capacity",
    "ideal_bytes_per_request",
    "ideal_concurrency",
    "prefill_peak_blocks",
    "prefill_steps",
    "serving_blocks",
    "steady_blocks",
]


@attrs.frozen
class GroupCapacity:
    """One group's share of a request of ``context`` tokens."""

    group: int
    kinds: tuple[str, ...]
    num_layers: int
    block_size: int
    packed_bytes: int
    blocks_per_request: int


@attrs.frozen
class Capacity:
    """What a plan holds at one context length.

    :param concurrency: requests of ``context`` tokens that fit together,
        with one prefill step in flight and the null block taken.
    :param ideal_concurrency: the physical limit on the same memory.
    :param unreserved_concurrency: ``memory / (stride x blocks per request)``
        unrounded, with nothing reserved: the figure engines usually quote.
    """

    context: int
    num_blocks: int
    bytes_per_block: int
    blocks_per_request: int
    prefill_peak_blocks: int
    concurrency: int
    unreserved_concurrency: float
    ideal_concurrency: float
    groups: tuple[GroupCapacity, ...]

    @property
    def tokens(self) -> int:
        """Tokens the concurrent requests hold together."""
        return self.concurrency * self.context

    @property
    def ratio(self) -> float:
        """``unreserved_concurrency / ideal_concurrency``: the share of the
        physical limit the plan's packing reaches, before rounding and the
        prefill reservation (1.0 is the limit)."""
        if not self.ideal_concurrency:
            return 0.0
        return self.unreserved_concurrency / self.ideal_concurrency

    @property
    def bytes_per_request(self) -> int:
        return self.blocks_per_request * self.bytes_per_block


def _block_sizes(groups: Sequence[KVCacheGroupSpec], dcp: int) -> list[int]:
    return [effective_block_size(g, dcp) for g in groups]


def serving_blocks(spec: KVCacheSpec, context: int, block_size: int) -> int:
    """Blocks a layer of ``spec`` holds while a request computes its
    ``context``-th token (the step ``[context - 1, context)``)."""
    return checked_blocks_held(spec, context - 1, context, block_size)


def prefill_steps(context: int, max_num_batched_tokens: int) -> list[tuple[int, int]]:
    """The steps that bring a request to ``context`` tokens: its prompt of
    ``context - 1`` tokens in chunks of at most ``max_num_batched_tokens``,
    then its last token.  Refuses a context that would take more than
    :data:`MAX_PREFILL_STEPS` steps (no model serves one that long)."""
    if (context - 1) // max_num_batched_tokens > MAX_PREFILL_STEPS:
        msg = (
            f"a request of {context} tokens takes more than {MAX_PREFILL_STEPS:,} "
            f"prefill steps of {max_num_batched_tokens} tokens; ask about a "
            "shorter context or a larger max_num_batched_tokens"
        )
        raise PlanError(msg)
    steps = []
    start = 0
    while start < context - 1:
        end = min(start + max_num_batched_tokens, context - 1)
        steps.append((start, end))
        start = end
    steps.append((context - 1, context))
    return steps


def steady_blocks(
    groups: Sequence[KVCacheGroupSpec], context: int, *, dcp: int = 1
) -> list[int]:
    """Blocks each group holds for a request computing its ``context``-th
    token."""
    return [
        serving_blocks(g.manager_spec, context, b)
        for g, b in zip(groups, _block_sizes(groups, dcp), strict=True)
    ]


def prefill_peak_blocks(
    groups: Sequence[KVCacheGroupSpec],
    context: int,
    max_num_batched_tokens: int,
    *,
    dcp: int = 1,
) -> int:
    """The most blocks a request holds over its :func:`prefill_steps` (blocks
    it no longer reads are released at the start of each step)."""
    specs = [g.manager_spec for g in groups]
    sizes = _block_sizes(groups, dcp)
    return max(
        sum(
            checked_blocks_held(s, start, end, b)
            for s, b in zip(specs, sizes, strict=True)
        )
        for start, end in prefill_steps(context, max_num_batched_tokens)
    )


def ideal_bytes_per_request(
    specs: Mapping[str, KVCacheSpec], context: int, *, dcp: int = 1
) -> int:
    """Bytes a request of ``context`` tokens holds when every layer keeps
    exactly its own pages at its own block size (times decode context
    parallelism where the layer scales with it: each rank holds a slice),
    each page without its alignment padding, so no plan can beat it."""
    return sum(
        s.real_page_size_bytes
        * serving_blocks(
            s, context, s.block_size * (dcp if s.scales_with_context_parallel else 1)
        )
        for s in specs.values()
    )


def ideal_concurrency(
    specs: Mapping[str, KVCacheSpec], context: int, memory: int, *, dcp: int = 1
) -> float:
    """The physical limit: requests of ``context`` tokens in ``memory`` bytes."""
    per_request = ideal_bytes_per_request(specs, context, dcp=dcp)
    return memory / per_request if per_request else 0.0


def as_planned(
    specs: Mapping[str, KVCacheSpec], plan: KVCacheConfig
) -> dict[str, KVCacheSpec]:
    """``specs`` with their engine-dependent defaults settled as ``plan``
    settled them: its prefix caching, and the state-cache mode its own
    specs of each layer run (a layer it does not hold takes the default for
    its prefix caching)."""
    modes: dict[str, str | None] = {}
    for group in plan.kv_cache_groups:
        for name in group.layer_names:
            modes[name] = checked_state_cache_mode(group.layer_spec(name))
    by_mode: dict[str | None, dict[str, KVCacheSpec]] = {}
    for name, spec in specs.items():
        by_mode.setdefault(modes.get(name), {})[name] = spec
    resolved: dict[str, KVCacheSpec] = {}
    for mode, some in by_mode.items():
        resolved.update(
            resolved_defaults(
                some,
                prefix_caching=plan.enable_prefix_caching,
                state_cache_mode=mode,
            )
        )
    return {name: resolved[name] for name in specs}


def plan_capacity(
    plan: KVCacheConfig,
    context: int,
    *,
    max_num_batched_tokens: int | None = None,
    specs: Mapping[str, KVCacheSpec] | None = None,
    memory: int | None = None,
) -> Capacity:
    """The plan's capacity at ``context`` tokens per request.

    :param max_num_batched_tokens: tokens a prefill step may hold (default:
        the plan's, else 8192).
    :param specs: the model's layer specs at their file block sizes, for the
        physical limit (default: the plan's own layer specs); their
        engine-dependent defaults are settled as the plan's were
        (:func:`as_planned`).
    :param memory: the bytes compared (default: the memory the plan was
        sized for, or its pool's bytes where an override made it larger).
    """
    require_instance(plan, KVCacheConfig, "plan_capacity: plan")
    if type(context) is not int or context < 1:
        msg = f"capacity needs a positive int context length, got {context!r}"
        raise PlanError(msg)
    if max_num_batched_tokens is None:
        max_num_batched_tokens = plan.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS
    if type(max_num_batched_tokens) is not int or max_num_batched_tokens < 1:
        msg = (
            "capacity needs a positive int max_num_batched_tokens, got "
            f"{max_num_batched_tokens!r}"
        )
        raise PlanError(msg)
    _check_max_model_len(plan, context, f"so none of {context} tokens fits")
    groups = plan.kv_cache_groups
    dcp = plan.decode_context_parallel_size
    if specs is None:
        specs = {n: g.layer_spec(n) for g in groups for n in g.layer_names}
    else:
        specs = as_planned(specs, plan)
    per_group = steady_blocks(groups, context, dcp=dcp)
    steady = sum(per_group)
    peak = prefill_peak_blocks(groups, context, max_num_batched_tokens, dcp=dcp)
    if steady <= 0:
        msg = (
            f"the plan's groups hold no blocks for a request of {context} tokens "
            f"(kinds: {sorted({s.kind for g in groups for s in g.layer_specs()})}), "
            "so the cache bounds no concurrency; check the kinds' num_blocks_held"
        )
        raise PlanError(msg)
    fit, memory = _fit(plan, steady, peak, memory)
    sizes = _block_sizes(groups, dcp)
    return Capacity(
        context=context,
        **fit,
        ideal_concurrency=ideal_concurrency(specs, context, memory, dcp=dcp),
        groups=tuple(
            GroupCapacity(
                group=i,
                kinds=tuple(dict.fromkeys(s.kind for s in g.layer_specs())),
                num_layers=len(g.layer_names),
                block_size=b,
                packed_bytes=g.packed_bytes,
                blocks_per_request=n,
            )
            for i, (g, b, n) in enumerate(zip(groups, sizes, per_group, strict=True))
        ),
    )


def _check_max_model_len(plan: KVCacheConfig, longest: int, why: str) -> None:
    """Refuse a question about requests longer than the plan admits."""
    if plan.max_model_len is not None and longest > plan.max_model_len:
        msg = (
            f"the plan admits requests of at most max_model_len={plan.max_model_len} "
            f"tokens, {why}; ask about requests up to max_model_len, or plan "
            "with a larger one"
        )
        raise PlanError(msg)


def _fit(
    plan: KVCacheConfig, steady: int | Fraction, peak: int, memory: int | None
) -> tuple[dict[str, Any], int]:
    """The figures :class:`Capacity` and :class:`MixCapacity` share, for
    requests of ``steady`` blocks (at least one) beside one prefill of
    ``peak`` blocks: the pool, ``concurrency`` (those that fit in its
    usable blocks) and ``unreserved_concurrency`` (the same over ``memory``
    unrounded, nothing reserved); and ``memory`` (None: the plan's, or the
    pool's own bytes where an override gave it more blocks than its memory
    holds: the limit bounds what the pool holds)."""
    if memory is None:
        memory = max(plan.available_memory or 0, plan.num_blocks * plan.bytes_per_block)
    usable = plan.num_blocks - 1
    bpb = plan.bytes_per_block
    fit = {
        "num_blocks": plan.num_blocks,
        "bytes_per_block": bpb,
        "blocks_per_request": steady,
        "prefill_peak_blocks": peak,
        "concurrency": 0 if peak > usable else 1 + int((usable - peak) // steady),
        "unreserved_concurrency": float(memory / (bpb * steady)) if bpb else 0.0,
    }
    return fit, memory


def min_blocks_for_one_request(
    groups: Sequence[KVCacheGroupSpec],
    max_model_len: int,
    max_num_batched_tokens: int,
    *,
    dcp: int = 1,
) -> int:
    """Blocks a pool needs to run one request of ``max_model_len`` tokens:
    its prefill peak plus the null block."""
    return (
        prefill_peak_blocks(groups, max_model_len, max_num_batched_tokens, dcp=dcp) + 1
    )


__all__ += ["MixCapacity", "as_planned", "min_blocks_for_one_request", "mix_capacity"]


@attrs.frozen
class MixCapacity:
    """What a plan holds under a mix of request lengths (see
    :func:`mix_capacity`).

    :param blocks_per_request: the expected blocks a request of the mix
        holds at steady state (exact: a weighted mean of whole block counts).
    :param prefill_peak_blocks: the prefill peak of the mix's longest length.
    :param concurrency: requests of the mix that fit together.
    :param unreserved_concurrency: ``memory / (stride x blocks_per_request)``
        with nothing reserved.
    :param hit_granularity: tokens the plan's prefix hits are multiples of
        (what a plan's block growth costs in hits: up to ``granularity - 1``
        tokens of each hit).
    """

    mix: LengthMix
    num_blocks: int
    bytes_per_block: int
    blocks_per_request: Fraction
    prefill_peak_blocks: int
    concurrency: int
    unreserved_concurrency: float
    hit_granularity: int | None

    def to_dict(self) -> dict[str, object]:
        return {
            "lengths": len(self.mix),
            "shortest": self.mix.lengths[0],
            "longest": self.mix.longest,
            "mean_length": float(self.mix.mean),
            "num_blocks": self.num_blocks,
            "bytes_per_block": self.bytes_per_block,
            "blocks_per_request": float(self.blocks_per_request),
            "prefill_peak_blocks": self.prefill_peak_blocks,
            "concurrency": self.concurrency,
            "unreserved_concurrency": self.unreserved_concurrency,
            "hit_granularity": self.hit_granularity,
        }


def mix_capacity(
    plan: KVCacheConfig,
    mix: LengthMix,
    *,
    max_num_batched_tokens: int | None = None,
    memory: int | None = None,
) -> MixCapacity:
    """How many requests of ``mix`` the plan holds together.

    With ``U = num_blocks - 1`` usable blocks, ``s(T)`` the steady blocks a
    request of ``T`` tokens holds (as :func:`plan_capacity` counts them),
    ``S = sum(w(T) s(T)) / sum(w(T))`` their exact mean over the mix and ``P``
    the prefill peak of its longest length::

        concurrency = 0 if P > U else 1 + floor((U - P) / S)

    the requests, in the mix's proportions, that fit with one prefill in
    flight.  A mix of one length gives :func:`plan_capacity`'s figure.
    """
    require_instance(plan, KVCacheConfig, "mix_capacity: plan")
    require_instance(mix, LengthMix, "mix_capacity: mix")
    _check_max_model_len(
        plan, mix.longest, f"and the mix holds requests of {mix.longest:,}"
    )
    if max_num_batched_tokens is None:
        max_num_batched_tokens = plan.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS
    groups = plan.kv_cache_groups
    dcp = plan.decode_context_parallel_size
    steady = mix.expected(sum(steady_blocks(groups, t, dcp=dcp)) for t in mix.lengths)
    if steady <= 0:
        msg = "the plan's groups hold no blocks for the mix's requests"
        raise PlanError(msg)
    peak = prefill_peak_blocks(groups, mix.longest, max_num_batched_tokens, dcp=dcp)
    fit, _ = _fit(plan, steady, peak, memory)
    return MixCapacity(mix=mix, **fit, hit_granularity=plan_hit_granularity(plan))
