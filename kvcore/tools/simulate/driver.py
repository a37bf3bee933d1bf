"""A small continuous-batching scheduler over the real coordinator.

Every step has a budget of ``max_num_batched_tokens`` tokens:

1. Requests whose arrival step has come (and whose parent turn has
   finished) join the back of the waiting queue.
2. Running requests, oldest admission first, each compute what they have
   left, up to the budget: the next prompt chunk, or their last sampled
   token (a decode).  When the pool refuses a step, the most recently
   admitted running request is preempted (freed, put at the front of the
   waiting queue to recompute its prompt and generated tokens) and the step
   is tried again; a request preempting itself waits for the next step.
3. Unless the step preempted a request (as vLLM's scheduler, which never
   admits in a step that preempted: the blocks a preemption frees go to
   the running requests, not to a newcomer that would be preempted again),
   waiting requests are admitted in order while budget is left, fewer than
   ``max_partial_prefills`` requests are in prefill, and ``allocate_slots``
   (after ``get_computed_blocks`` for the prefix hit) succeeds; the first
   refusal ends admission for the step.
4. The scheduled tokens are computed: their blocks are cached, a request
   whose tokens are all computed samples its next output token, and one
   that has generated its output length finishes and is freed.

A request the pool refuses while no other request runs (nothing left to
preempt) can never fit: it is reported in ``unserved`` and dropped, so no
run loops forever.  The oldest running request progresses every step, so a
run always ends.

Every admission is also measured against the token-level bound
(:mod:`kvcore.tools.simulate.bound`): the longest common token prefix between
the tokens it looks up and the tokens computed before it by any request
(running, finished or preempted), capped at one less than the tokens looked
up.  A re-admission after preemption counts like any admission, in the hits
and in the bound alike, and its own tokens computed before it was preempted
count towards its bound.  With ``validate=True`` a content oracle
(:mod:`kvcore.tools.simulate.oracle`) checks every hit.
"""

from __future__ import annotations

import gc
import math
from array import array
from collections import deque
from collections.abc import Callable, Sequence

from kvcore.coordinator import (
    BlockId,
    CheckpointManager,
    KVCacheBlocks,
    KVCacheManager,
    Request,
)
from kvcore.errors import KvcoreValueError
from kvcore.plan.block_sizes import generate_scheduler_kv_cache_config
from kvcore.plan.capacity import DEFAULT_BATCHED_TOKENS
from kvcore.registry import KindRegistry, default_registry
from kvcore.structs import KVCacheConfig
from kvcore.tools.choices import DEFAULT_DECODE_RATE, DEFAULT_PREFILL_RATE
from kvcore.tools.simulate.bound import ComputedPrefixes
from kvcore.tools.simulate.oracle import ContentOracle
from kvcore.tools.simulate.result import (
    ConcurrencySample,
    GroupUsage,
    SimulationResult,
    Unserved,
)
from kvcore.tools.simulate.workload import (
    TokenRun,
    Workload,
    WorkloadRequest,
    little_endian_words,
    pack_words,
)

__all__ = ["Driver", "ProgressCallback", "SimulationError", "simulate"]

#: Steps between two counts of each group's cached blocks (see ``Driver``).
CACHE_SAMPLE_EVERY = 8

#: At most this many points of admitted concurrency over time are reported.
CONCURRENCY_POINTS = 100

#: Cached blocks one count may pass over per sampling interval: once a
#: count finds more than this many, the next count waits that many times
#: longer, so counting a large prefix cache costs a bounded share of a run.
CACHE_SAMPLE_SPAN = 16384

#: ``progress(step, resolved, total)``: called once per step that did work.
ProgressCallback = Callable[[int, int, int], None]


class SimulationError(KvcoreValueError):
    """The plan or the driver's settings cannot be simulated."""


class _Live:
    """A workload request inside the driver.

    ``words`` packs every token it will ever hold (its prompt, then its
    output) as little-endian 4-byte words: the request's tokens at any
    time are a prefix of them, which the token-level bound reads without
    packing the request's ints again.
    """

    __slots__ = ("generated", "preempted", "request", "spec", "words")

    def __init__(self, spec: WorkloadRequest, request: Request, words: bytes) -> None:
        self.spec = spec
        self.request = request
        self.words = words
        self.generated = 0
        #: Whether it was preempted (its next admission is a re-admission).
        self.preempted = False

    @property
    def remaining(self) -> int:
        return self.request.num_tokens - self.request.num_computed_tokens


def _positive(name: str, value: object) -> int:
    if type(value) is not int or value < 1:
        msg = f"{name} must be a positive int, got {value!r}"
        raise SimulationError(msg)
    return value


def _rate(name: str, value: object) -> float:
    if (
        type(value) not in (int, float)
        or not math.isfinite(value)  # type: ignore[arg-type]
        or value <= 0  # type: ignore[operator]
    ):
        msg = f"{name} must be a positive finite number, got {value!r}"
        raise SimulationError(msg)
    return float(value)  # type: ignore[arg-type]


class Driver:
    """Replays workloads through a fresh :class:`KVCacheManager` of ``plan``.

    :param max_num_batched_tokens: the token budget of a step (default: the
        plan's, else 8192).
    :param max_model_len: the longest request (default: the plan's, else
        the longest request of each workload).
    :param max_partial_prefills: requests that may be in prefill at once
        (1, as the capacity model assumes and vLLM's V0 scheduler defaults).
    :param keep_finished: a finished request keeps its blocks until the run
        ends: every request then sits at its last token, the picture
        :func:`kvcore.plan_capacity` counts, so a run measures how many fit
        (admissions then fill the pool: the manager cannot tell a kept
        request from a running one, so it keeps no boundary headroom).
    :param max_steps: stop after this many steps; requests left are
        reported in ``unfinished``.
    :param validate: check every prefix hit against a model of what each
        block holds (:class:`~kvcore.tools.simulate.oracle.ContentOracle`);
        violations are counted in ``invalid_hits``.  It costs a pass over
        every computed token.
    :param cache_sample_every: count the cached (hashed) blocks of each
        group every this many steps (a pass over the prefix cache; 1 counts
        every step).
    :param prefill_rate: prefill tokens a second, for a timed workload
        (requests with ``arrival_s``): a step costs its prefill tokens over
        this rate ...
    :param decode_rate: ... plus ``1 / decode_rate`` seconds when it
        decodes any request.  A request arrives once the clock reaches its
        ``arrival_s``; an idle clock jumps to the next arrival.
    """

    def __init__(
        self,
        plan: KVCacheConfig,
        *,
        registry: KindRegistry | None = None,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        max_partial_prefills: int = 1,
        keep_finished: bool = False,
        max_steps: int | None = None,
        hash_function: str = "sha256",
        validate: bool = False,
        cache_sample_every: int = CACHE_SAMPLE_EVERY,
        prefill_rate: float = DEFAULT_PREFILL_RATE,
        decode_rate: float = DEFAULT_DECODE_RATE,
    ) -> None:
        scheduler_block_size = plan.scheduler_block_size
        if scheduler_block_size is None or plan.hash_block_size is None:
            msg = (
                "the plan carries no scheduler or hash block size; build it with "
                "kvcore.plan_kv_cache"
            )
            raise SimulationError(msg)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = (
                plan.max_num_batched_tokens or DEFAULT_BATCHED_TOKENS
            )
        self.plan = plan
        self._scheduler_block_size = scheduler_block_size
        self.registry = registry if registry is not None else default_registry()
        self.max_num_batched_tokens = _positive(
            "max_num_batched_tokens", max_num_batched_tokens
        )
        if max_model_len is None:
            max_model_len = plan.max_model_len
        self.max_model_len = (
            None if max_model_len is None else _positive("max_model_len", max_model_len)
        )
        self.max_partial_prefills = _positive(
            "max_partial_prefills", max_partial_prefills
        )
        self.keep_finished = bool(keep_finished)
        self.max_steps = (
            None if max_steps is None else _positive("max_steps", max_steps)
        )
        self.hash_function = hash_function
        self.validate = bool(validate)
        self.cache_sample_every = _positive("cache_sample_every", cache_sample_every)
        self.prefill_rate = _rate("prefill_rate", prefill_rate)
        self.decode_rate = _rate("decode_rate", decode_rate)
        #: The manager of the last run (all its blocks are free after it).
        self.manager: KVCacheManager | None = None

    def _manager(self, workload: Workload) -> tuple[KVCacheManager, int]:
        plan = self.plan
        limit = self.max_model_len
        if limit is None:
            limit = max((r.max_tokens for r in workload.requests), default=1)
            limit = max(limit, 1)
        manager = KVCacheManager(
            generate_scheduler_kv_cache_config([plan]),
            limit,
            scheduler_block_size=self._scheduler_block_size,
            hash_block_size=plan.hash_block_size,
            enable_caching=plan.enable_prefix_caching,
            registry=self.registry,
            dcp=plan.decode_context_parallel_size,
            boundary_headroom=not self.keep_finished,
        )
        return manager, limit

    def run(
        self, workload: Workload, *, progress: ProgressCallback | None = None
    ) -> SimulationResult:
        """Replay ``workload`` from step 0 until every request is resolved.

        Python's cyclic garbage collector is paused while the run lasts
        (and restored after it): a run builds millions of objects that live
        until it ends (the bound's trie, the requests' tables and tokens)
        and drops no reference cycle on the way, so the collector's passes
        over them reclaimed nothing and took about a quarter of a long
        replay's CPU time."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            return _Run(self, workload, progress).result()
        finally:
            if collecting:
                gc.enable()


def simulate(
    plan: KVCacheConfig,
    workload: Workload,
    *,
    registry: KindRegistry | None = None,
    max_num_batched_tokens: int | None = None,
    keep_finished: bool = False,
    max_steps: int | None = None,
    progress: ProgressCallback | None = None,
    validate: bool = False,
) -> SimulationResult:
    """Run ``workload`` through ``plan``'s coordinator (see :class:`Driver`)."""
    driver = Driver(
        plan,
        registry=registry,
        max_num_batched_tokens=max_num_batched_tokens,
        keep_finished=keep_finished,
        max_steps=max_steps,
        validate=validate,
    )
    return driver.run(workload, progress=progress)


class _Run:
    """The state of one run; :meth:`result` drives it to the end."""

    def __init__(
        self, driver: Driver, workload: Workload, progress: ProgressCallback | None
    ) -> None:
        self.driver = driver
        self.workload = workload
        self.progress = progress
        manager, self.max_model_len = driver._manager(workload)
        driver.manager = self.manager = manager
        self.hash_block_size = (
            manager.hash_block_size if manager.enable_caching else None
        )
        self.pending: deque[WorkloadRequest] = deque(workload.requests)
        self.blocked: dict[str, list[WorkloadRequest]] = {}
        self.ready: list[WorkloadRequest] = []
        self.resolved: set[str] = set()
        self.waiting: deque[_Live] = deque()
        self.running: list[_Live] = []
        self.held: list[_Live] = []
        self.unserved: list[Unserved] = []
        num_groups = len(driver.plan.kv_cache_groups)
        self.peak = [0] * num_groups
        self.total = [0] * num_groups
        self.peak_in_use = 0
        self.total_in_use = 0
        self.peak_running = 0
        self.cached_peak = [0] * num_groups
        self.cached_total = [0] * num_groups
        self.cached_samples = 0
        self.next_cache_sample = 0
        self.cached_weight = 0
        #: Peaks over the samples of all groups' cached blocks together, and
        #: of the recurrent-state (checkpoint) groups' alone.
        self.cached_all_peak = 0
        self.cached_states_peak = 0
        self.state_groups = frozenset(
            g
            for g, m in enumerate(manager.coordinator.single_type_managers)
            if isinstance(m, CheckpointManager)
        )
        self.computed_prefixes = ComputedPrefixes()
        #: Requests whose computed tokens the bound has not recorded yet.
        self.dirty: dict[str, _Live] = {}
        self.bound = 0
        self.oracle = ContentOracle(manager) if driver.validate else None
        self.completed = 0
        self.generated = 0
        self.computed = 0
        self.looked_up = 0
        self.hits = 0
        #: Of those, re-admissions' after preemption.
        self.readmitted_looked_up = 0
        self.readmitted_hits = 0
        self.refused = 0
        self.preemptions = 0
        self.admission_refusals = 0
        self.timed = workload.timed
        #: The simulated clock in seconds (advanced only for a timed workload).
        self.clock = 0.0
        #: Requests holding blocks after each step, and the clock then.
        self.running_at = array("I")
        self.clock_at = array("d")
        #: The step's prefill tokens and decodes (for the clock).
        self.step_prefill = 0
        self.step_decodes = 0

    def _due(self, spec: WorkloadRequest) -> bool:
        if self.timed:
            return spec.arrival_s is not None and spec.arrival_s <= self.clock
        return False

    # -- queue ------------------------------------------------------------------

    def _arrive(self, spec: WorkloadRequest) -> None:
        if spec.parent is not None and spec.parent not in self.resolved:
            self.blocked.setdefault(spec.parent, []).append(spec)
            return
        if spec.max_tokens > self.max_model_len:
            self._unserve(
                spec,
                f"it computes {spec.max_tokens} tokens, past max_model_len="
                f"{self.max_model_len}",
            )
            return
        prompt = spec.prompt
        if isinstance(prompt, TokenRun):
            head = prompt.words()
            tokens: Sequence[int] = little_endian_words(head)
        else:
            head = pack_words(prompt)
            tokens = prompt
        request = Request(
            spec.id,
            tokens,
            hash_block_size=self.hash_block_size,
            hash_function=self.driver.hash_function,
        )
        words = head + pack_words(spec.output)
        self.waiting.append(_Live(spec, request, words))

    def _resolve(self, rid: str) -> None:
        self.resolved.add(rid)
        self.ready.extend(self.blocked.pop(rid, ()))

    def _unserve(self, spec: WorkloadRequest, reason: str) -> None:
        self.unserved.append(Unserved(spec.id, reason))
        self._resolve(spec.id)

    def _never_fits(self, live: _Live) -> None:
        held = (
            f", {len(self.held)} finished requests keeping theirs" if self.held else ""
        )
        self._unserve(
            live.spec,
            f"the pool of {self.manager.block_pool.num_blocks - 1} usable blocks "
            f"refused it with no other request to preempt{held}",
        )

    def _record_computed(self) -> None:
        """Give the bound every token computed so far."""
        extend = self.computed_prefixes.extend
        for rid, live in self.dirty.items():
            extend(rid, live.words, live.request.num_computed_tokens)
        self.dirty.clear()

    def _copies(self, blocks: KVCacheBlocks | None) -> None:
        """Apply the block copies a step asks for to the oracle's model."""
        if self.oracle is not None and blocks is not None and blocks.copies:
            self.oracle.apply_copies(blocks.copies)

    def _preempt(self, live: _Live) -> None:
        self._record_computed()
        self.running.remove(live)
        self.manager.free(live.request)
        live.request.num_computed_tokens = 0
        live.preempted = True
        self.waiting.appendleft(live)
        self.preemptions += 1

    # -- one step ---------------------------------------------------------------

    def _schedule_running(self, budget: int) -> tuple[list[tuple[_Live, int]], int]:
        manager = self.manager
        allocate_slots = manager.allocate_slots
        oracle = self.oracle
        running = self.running
        scheduled: list[tuple[_Live, int]] = []
        i = 0
        while i < len(running) and budget:
            live = running[i]
            request = live.request
            n = min(len(request.all_token_ids) - request.num_computed_tokens, budget)
            while (new := allocate_slots(request, n, delay_cache_blocks=True)) is None:
                self.refused += 1
                victim = running[-1]
                if victim is live and len(running) == 1:
                    running.pop()
                    manager.free(request)
                    self._never_fits(live)
                    break
                self._preempt(victim)
                if victim is live:
                    break
            else:
                # Allocated (a ``break`` above: dropped or preempted itself).
                if oracle is not None:
                    self._copies(new)
                scheduled.append((live, n))
                budget -= n
                i += 1
        return scheduled, budget

    def _admit(self, budget: int, scheduled: list[tuple[_Live, int]]) -> None:
        manager = self.manager
        waiting = self.waiting
        if not (waiting and budget):
            return
        prefilling = sum(1 for live in self.running if live.remaining > 1)
        limit = self.driver.max_partial_prefills
        if prefilling < limit:
            self._record_computed()
        while waiting and budget and prefilling < limit:
            live = waiting[0]
            request = live.request
            blocks, hit = manager.get_computed_blocks(request)
            n = min(request.num_tokens - hit, budget)
            new = manager.allocate_slots(
                request, n, hit, blocks, delay_cache_blocks=True
            )
            if new is None:
                if self.running:
                    # Running requests will free blocks: wait for them.
                    self.admission_refusals += 1
                    return
                waiting.popleft()
                self._never_fits(live)
                continue
            waiting.popleft()
            self.looked_up += request.num_tokens
            self.hits += hit
            if live.preempted:
                self.readmitted_looked_up += request.num_tokens
                self.readmitted_hits += hit
            self.bound += self.computed_prefixes.longest_prefix(
                live.words, request.num_tokens - 1
            )
            if self.oracle is not None:
                self.oracle.check_hit(
                    live.spec.id, request.all_token_ids, blocks.ids, hit
                )
                self._copies(new)
            request.num_computed_tokens = hit
            self.running.append(live)
            scheduled.append((live, n))
            budget -= n
            if request.num_tokens - hit > 1:
                prefilling += 1

    def _compute(self, scheduled: list[tuple[_Live, int]]) -> list[_Live]:
        """Compute the step's tokens: cache their blocks, sample where a
        request's tokens are all computed; the requests that finished."""
        manager = self.manager
        cache_blocks = manager.cache_blocks if manager.enable_caching else None
        finished = []
        oracle = self.oracle
        dirty = self.dirty
        prefill = decodes = generated = 0
        for live, n in scheduled:
            request = live.request
            start = request.num_computed_tokens
            if oracle is not None:
                oracle.write(
                    live.spec.id,
                    request.all_token_ids,
                    start,
                    start + n,
                    manager.get_blocks(live.spec.id).ids,
                )
            # ``live.generated`` counts the output tokens the request holds
            # (its last sampled token finishes it, never appended).
            if n == 1 and live.generated:
                decodes += 1
            else:
                prefill += n
            done = request.num_computed_tokens = start + n
            dirty[live.spec.id] = live
            if cache_blocks is not None:
                cache_blocks(request, done)
            if done == len(request.all_token_ids):
                output = live.spec.output
                token = output[live.generated]
                live.generated += 1
                generated += 1
                if live.generated == len(output):
                    finished.append(live)
                else:
                    request.append_output_token_ids(token)
        self.step_prefill += prefill
        self.step_decodes += decodes
        self.computed += prefill + decodes
        self.generated += generated
        return finished

    def _measure_cached(self, step: int) -> None:
        pool = self.manager.block_pool
        self.cached_samples += 1
        states = 0
        counts = [pool.num_cached_blocks_of(g) for g in range(len(self.cached_peak))]
        everything = sum(counts)
        # A count stands for the steps until the next one: the mean weighs
        # it by them (all alike while counts are below CACHE_SAMPLE_SPAN).
        weight = max(1, everything // CACHE_SAMPLE_SPAN)
        self.cached_weight += weight
        for g, count in enumerate(counts):
            self.cached_total[g] += count * weight
            if count > self.cached_peak[g]:
                self.cached_peak[g] = count
            if g in self.state_groups:
                states += count
        self.cached_all_peak = max(self.cached_all_peak, everything)
        self.cached_states_peak = max(self.cached_states_peak, states)
        self.next_cache_sample = step + self.driver.cache_sample_every * weight

    def _measure(self, step: int) -> None:
        if step >= self.next_cache_sample:
            self._measure_cached(step)
        manager = self.manager
        in_use = manager.block_pool.num_blocks - 1 - manager.get_num_free_blocks()
        counts = self._group_counts(in_use)
        for g, count in enumerate(counts):
            self.total[g] += count
            if count > self.peak[g]:
                self.peak[g] = count
        self.total_in_use += in_use
        self.peak_in_use = max(self.peak_in_use, in_use)
        holding = len(self.running) + len(self.held)
        self.peak_running = max(self.peak_running, holding)
        self.running_at.append(holding)

    def _group_counts(self, in_use: int) -> list[int]:
        """The blocks each group's live requests hold (a shared block once).

        Sets of block ids fill at C speed, the null block (id 0) filtered
        out as they fill: the tables counted are mostly null (released
        window blocks, state positions), and a skipped null costs less than
        a set lookup.  Every block in use sits in exactly one group's
        tables, so the group listing the most blocks (a long context's
        attention group beside a few states) is counted by difference;
        with ``validate`` every group is counted."""
        tables = [
            m.req_to_blocks for m in self.manager.coordinator.single_type_managers
        ]
        sizes = [sum(map(len, held.values())) for held in tables]
        largest = -1 if self.oracle is not None else sizes.index(max(sizes))
        counts = []
        for g, held in enumerate(tables):
            if g == largest:
                counts.append(0)
                continue
            ids: set[BlockId] = set()
            for table in held.values():
                ids.update(filter(None, table))
            counts.append(len(ids))
        if largest >= 0:
            counts[largest] = in_use - sum(counts)
        return counts

    def _finish(self, finished: list[_Live]) -> None:
        for live in finished:
            self.running.remove(live)
            if self.driver.keep_finished:
                self.held.append(live)
            else:
                self.manager.free(live.request)
            self.completed += 1
            if self.oracle is not None:
                self.oracle.forget(live.spec.id)
            self._resolve(live.spec.id)

    # -- the run ----------------------------------------------------------------

    def result(self) -> SimulationResult:
        driver = self.driver
        step = 0
        steps = 0
        total = len(self.workload)
        while self.pending or self.waiting or self.running or self.ready:
            if driver.max_steps is not None and step >= driver.max_steps:
                break
            ready, self.ready = self.ready, []
            for spec in ready:
                self._arrive(spec)
            timed = self.timed
            while self.pending and (
                self._due(self.pending[0]) if timed else self.pending[0].arrival <= step
            ):
                self._arrive(self.pending.popleft())
            if not (self.waiting or self.running):
                if self.ready:
                    continue
                if self.pending and timed:
                    arrival_s = self.pending[0].arrival_s
                    assert arrival_s is not None  # a timed workload's requests are
                    self.clock = max(self.clock, arrival_s)
                    continue
                if self.pending:
                    step = self.pending[0].arrival
                    if driver.max_steps is not None:
                        step = min(step, driver.max_steps)
                    continue
                break
            preempted = self.preemptions
            scheduled, budget = self._schedule_running(driver.max_num_batched_tokens)
            if self.preemptions == preempted:
                self._admit(budget, scheduled)
            self.step_prefill = self.step_decodes = 0
            finished = self._compute(scheduled)
            if timed:
                self.clock += self.step_prefill / driver.prefill_rate
                if self.step_decodes:
                    self.clock += 1.0 / driver.decode_rate
            self.clock_at.append(self.clock)
            self._measure(step)
            self._finish(finished)
            step += 1
            steps = step
            if self.progress is not None:
                self.progress(step, len(self.resolved), total)
        return self._close(steps)

    def _concurrency(self) -> tuple[ConcurrencySample, ...]:
        """Requests holding blocks over the run's working steps, in at most
        :data:`CONCURRENCY_POINTS` spans of equal steps."""
        counts = self.running_at
        n = len(counts)
        if not n:
            return ()
        spans = min(n, CONCURRENCY_POINTS)
        samples = []
        for k in range(spans):
            lo = k * n // spans
            hi = (k + 1) * n // spans
            part = counts[lo:hi]
            samples.append(
                ConcurrencySample(
                    first_step=lo,
                    last_step=hi - 1,
                    clock_s=self.clock_at[hi - 1] if self.timed else None,
                    mean=sum(part) / len(part),
                    peak=max(part),
                )
            )
        return tuple(samples)

    def _close(self, steps: int) -> SimulationResult:
        manager = self.manager
        unfinished = [live.spec.id for live in (*self.running, *self.waiting)]
        for live in (*self.running, *self.held):
            manager.free(live.request)
        self.running.clear()
        self.held.clear()
        unfinished += [s.id for s in self.ready]
        unfinished += [s.id for specs in self.blocked.values() for s in specs]
        unfinished += [s.id for s in self.pending]
        plan = self.driver.plan
        oracle = self.oracle
        managers = manager.coordinator.single_type_managers
        groups = tuple(
            GroupUsage(
                group=g,
                kinds=tuple(dict.fromkeys(s.kind for s in group.layer_specs())),
                block_size=managers[g].block_size,
                peak_blocks=self.peak[g],
                mean_blocks=self.total[g] / steps if steps else 0.0,
                peak_cached_blocks=self.cached_peak[g],
                mean_cached_blocks=(
                    self.cached_total[g] / self.cached_weight
                    if self.cached_weight
                    else 0.0
                ),
            )
            for g, group in enumerate(plan.kv_cache_groups)
        )
        return SimulationResult(
            timed=self.timed,
            clock_s=self.clock,
            mean_running=(sum(self.running_at) / len(self.running_at))
            if self.running_at
            else 0.0,
            concurrency=self._concurrency(),
            requests=len(self.workload),
            completed=self.completed,
            steps=steps,
            tokens_generated=self.generated,
            computed_tokens=self.computed,
            prompt_tokens_looked_up=self.looked_up,
            prefix_hit_tokens=self.hits,
            readmitted_tokens_looked_up=self.readmitted_looked_up,
            readmitted_hit_tokens=self.readmitted_hits,
            token_bound_tokens=self.bound,
            refused_steps=self.refused,
            preemptions=self.preemptions,
            admission_refusals=self.admission_refusals,
            peak_running=self.peak_running,
            num_blocks=manager.block_pool.num_blocks,
            peak_blocks_in_use=self.peak_in_use,
            mean_blocks_in_use=self.total_in_use / steps if steps else 0.0,
            max_num_batched_tokens=self.driver.max_num_batched_tokens,
            groups=groups,
            unserved=tuple(self.unserved),
            unfinished=tuple(unfinished),
            evictions=manager.block_pool.evictions,
            peak_cached_blocks=self.cached_all_peak,
            peak_cached_state_blocks=self.cached_states_peak,
            validated=oracle is not None,
            checked_hits=0 if oracle is None else oracle.checked_hits,
            invalid_hits=0 if oracle is None else oracle.invalid_hits,
            invalid_hit_reports=() if oracle is None else tuple(oracle.reports),
        )
