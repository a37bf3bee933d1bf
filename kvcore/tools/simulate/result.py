"""What a simulation reports: prefix hits, blocks in use, refusals."""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvcore.tools.records import Record

__all__ = ["ConcurrencySample", "GroupUsage", "SimulationResult", "Unserved"]


@attrs.frozen
class ConcurrencySample(Record):
    """Requests holding blocks over a span of working steps (counted after
    each step's allocation; kept finished requests included).

    ``first_step`` and ``last_step`` index the steps that did work (idle
    jumps between arrivals are not steps); ``clock_s`` is the simulated clock
    at the span's end for a timed workload, else ``None``.
    """

    first_step: int
    last_step: int
    clock_s: float | None
    mean: float
    peak: int

    json_fields: ClassVar[str] = "first_step last_step clock_s mean peak"


@attrs.frozen
class GroupUsage(Record):
    """One cache group's blocks over the run: distinct blocks its requests'
    tables hold (blocks shared by a prefix hit count once; the null block
    never), sampled at every step after allocation.

    ``peak_cached_blocks`` and ``mean_cached_blocks`` count the group's
    blocks that hold a prefix-cache key (cached: in a table or free and
    evictable), what the cached states and prefixes cost; they are sampled
    every ``Driver.cache_sample_every`` steps (the first step included),
    sparser once the cache holds more than ``CACHE_SAMPLE_SPAN`` blocks, and
    the mean weighs each count by the steps it stands for.
    """

    group: int
    kinds: tuple[str, ...]
    block_size: int
    peak_blocks: int
    mean_blocks: float
    peak_cached_blocks: int = 0
    mean_cached_blocks: float = 0.0

    json_fields: ClassVar[str] = (
        "group kinds block_size peak_blocks mean_blocks peak_cached_blocks "
        "mean_cached_blocks"
    )


@attrs.frozen
class Unserved(Record):
    """A request the simulator gave up on, and why."""

    id: str
    reason: str

    json_fields: ClassVar[str] = "id reason"


@attrs.frozen
class SimulationResult(Record):
    """The figures of one run.

    :param steps: scheduler steps from step 0 to the last one that did work
        (idle steps between arrivals included).
    :param prompt_tokens_looked_up: tokens of every admitted request at its
        admission (re-admissions after preemption included).
    :param prefix_hit_tokens: of those, tokens the prefix cache served.
    :param readmitted_tokens_looked_up: of the looked-up tokens, those of
        re-admissions after preemption.
    :param readmitted_hit_tokens: of the hits, those of re-admissions: mostly
        the request's own blocks from before it was preempted, so they save
        only what the preemption cost (see :attr:`first_admission_hit_rate`).
    :param token_bound_tokens: of those, tokens a perfect token-level cache
        would serve: at each admission, the longest common token prefix with
        the tokens any request computed before it, capped at the tokens
        looked up less one (the last is always recomputed).
    :param refused_steps: running requests' steps the pool refused (each one
        preempted a request).
    :param admission_refusals: steps whose first waiting request the pool
        refused (it waits; nothing is preempted for it).
    :param computed_tokens: tokens the steps computed, recomputation included.
    :param peak_blocks_in_use: most blocks of the shared pool held at once
        (of ``num_blocks``, block 0 the null block).
    :param unserved: requests that could not run even with nothing left to
        preempt, or are longer than ``max_model_len``.
    :param unfinished: requests still queued or running when ``max_steps``
        ran out.
    :param evictions: prefix-cache keys the pool dropped: to reuse a block
        (its copy-on-write partial keys count too), or a checkpointed state
        a newer one replaced.
    :param peak_cached_blocks: the most blocks holding a prefix-cache key at
        once, all groups together (sampled as ``GroupUsage``'s counts).
    :param peak_cached_state_blocks: the same over the recurrent-state
        (checkpoint) groups alone: what keeping states costs.
    :param timed: whether requests arrived on the simulated clock.
    :param clock_s: the simulated clock at the end (0 when not timed).
    :param mean_running: requests holding blocks, averaged over the working
        steps.
    :param concurrency: the same over time, in spans of steps.
    :param validated: whether the content oracle checked the hits.
    :param checked_hits: admissions with a hit the oracle checked.
    :param invalid_hits: of those, hits whose blocks did not hold the
        request's own tokens (0 when not validated).
    :param invalid_hit_reports: the first few of those, described.
    """

    requests: int
    completed: int
    steps: int
    tokens_generated: int
    computed_tokens: int
    prompt_tokens_looked_up: int
    prefix_hit_tokens: int
    refused_steps: int
    preemptions: int
    admission_refusals: int
    peak_running: int
    num_blocks: int
    peak_blocks_in_use: int
    mean_blocks_in_use: float
    max_num_batched_tokens: int
    groups: tuple[GroupUsage, ...]
    unserved: tuple[Unserved, ...] = ()
    unfinished: tuple[str, ...] = ()
    token_bound_tokens: int = 0
    evictions: int = 0
    peak_cached_blocks: int = 0
    peak_cached_state_blocks: int = 0
    validated: bool = False
    checked_hits: int = 0
    invalid_hits: int = 0
    invalid_hit_reports: tuple[str, ...] = ()
    timed: bool = False
    clock_s: float = 0.0
    mean_running: float = 0.0
    concurrency: tuple[ConcurrencySample, ...] = ()
    readmitted_tokens_looked_up: int = 0
    readmitted_hit_tokens: int = 0

    def _of_looked_up(self, tokens: int) -> float:
        looked_up = self.prompt_tokens_looked_up
        return tokens / looked_up if looked_up else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """Hit tokens over looked-up tokens (0 when nothing was looked up)."""
        return self._of_looked_up(self.prefix_hit_tokens)

    @property
    def hit_rate(self) -> float:
        """Hit tokens over looked-up tokens (the same as ``prefix_hit_rate``)."""
        return self.prefix_hit_rate

    @property
    def first_admission_hit_rate(self) -> float:
        """Hit tokens over looked-up tokens at requests' first admissions
        (re-admissions after preemption left out): the prefill the cache
        saves the traffic, not the recomputation a preemption caused."""
        looked_up = self.prompt_tokens_looked_up - self.readmitted_tokens_looked_up
        hits = self.prefix_hit_tokens - self.readmitted_hit_tokens
        return hits / looked_up if looked_up else 0.0

    @property
    def bound_rate(self) -> float:
        """Token-bound tokens over looked-up tokens (0 when nothing was
        looked up): the hit rate a perfect token-level cache would reach."""
        return self._of_looked_up(self.token_bound_tokens)

    @property
    def peak_usage(self) -> float:
        """Peak blocks in use over the usable blocks."""
        usable = self.num_blocks - 1
        return self.peak_blocks_in_use / usable if usable else 0.0

    json_fields: ClassVar[str] = (
        "requests completed steps tokens_generated computed_tokens "
        "prompt_tokens_looked_up prefix_hit_tokens prefix_hit_rate "
        "token_bound_tokens bound_rate refused_steps preemptions "
        "admission_refusals peak_running num_blocks peak_blocks_in_use "
        "mean_blocks_in_use peak_usage max_num_batched_tokens groups unserved "
        "unfinished evictions peak_cached_blocks peak_cached_state_blocks "
        "validated checked_hits invalid_hits invalid_hit_reports timed clock_s "
        "mean_running concurrency readmitted_tokens_looked_up "
        "readmitted_hit_tokens first_admission_hit_rate"
    )
