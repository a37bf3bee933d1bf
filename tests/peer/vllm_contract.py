"""kvcore's engine contract, checked under vLLM 0.33's own async scheduler.

Runs in the vLLM peer environment only: ``run_vllm_suite.py`` runs it with
``KVCORE_VLLM=1`` (vLLM's scheduler on kvcore) and vLLM's source tree as the
working directory.
The default pytest run never collects it (its name is not ``test_*.py``).

Every scenario drives vLLM's ``AsyncScheduler`` as vLLM's engine core does
with asynchronous scheduling: step ``k`` is scheduled before the output of
step ``k - 1`` is applied.  A stand-in for vLLM's model runner executes each
step in order, knowing only what the scheduler outputs tell a worker: it keeps
each request's block tables from them, and it reads and writes what vLLM's
kernels do:

- attention reads the blocks of the tokens a query sees (every earlier token,
  or the last ``sliding_window`` ones);
- Mamba in ``align`` mode (vLLM's ``preprocess_mamba``) reads the state of the
  step's first token from table position ``(start - 1) // block_size`` (the
  previous step's position for a running request) and writes the state after
  the step's last token into position ``cdiv(end, block_size) - 1``: one
  state per step, at the step's end.

Three counts must be zero:

- blocks kvcore returns to the free pool (caught where kvcore's pool drops a
  block's last reference) that a step in flight (scheduled, its output not
  yet applied) reads for a request that held them before the release;
- Mamba states the worker reads (restored from a prefix hit, or carried from
  the previous step) that no earlier step wrote for that same prefix;
- steps for which kvcore's ``state_write_positions`` (its engine contract:
  where the engine must write states) asks for anything but the step's end.

The ``*_is_caught`` tests break kvcore on purpose (releasing on
``num_computed_tokens``, freeing without deferral, keying states inside
steps) and require each check to see it.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import pytest
import torch
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

import kvcore.integrations.vllm as kvcore_vllm
from kvcore.integrations.vllm import manager as kvcore_manager
from kvcore.integrations.vllm import specs as kvcore_specs

BS = 16
WINDOW = 32
MODEL = "facebook/opt-125m"  # its config.json only; the stage writes it
EOS = 2


def _attention(
    window: int | None = None, dtype: torch.dtype = torch.float32
) -> KVCacheSpec:
    common: dict[str, Any] = {
        "block_size": BS,
        "num_kv_heads": 1,
        "head_size": 1,
        "dtype": dtype,
    }
    if window is None:
        return FullAttentionSpec(**common)
    return SlidingWindowSpec(**common, sliding_window=window)


def _mamba() -> KVCacheSpec:
    return MambaSpec(
        block_size=BS,
        shapes=((1, 1),),
        dtypes=(torch.float32,),
        mamba_cache_mode="align",
    )


def _scheduler(
    groups: list[KVCacheSpec],
    *,
    num_blocks: int,
    long_prefill: int = 0,
    max_num_seqs: int = 8,
    prefix_caching: bool = False,
    connector: bool = True,
    max_model_len: int = 2048,
    policy: str = "fcfs",
) -> AsyncScheduler:
    """vLLM's AsyncScheduler over ``groups``, built through vLLM's public
    configs.  ``connector``: :class:`ConsumerConnector`, a KV consumer, which
    makes vLLM defer the frees of finished and preempted requests until no
    step in flight reads their blocks (its contract with overlapping steps)."""
    kv_transfer = None
    if connector:
        kv_transfer = KVTransferConfig(
            kv_connector=ConsumerConnector.__name__,
            kv_connector_module_path=__name__,
            kv_role="kv_consumer",
        )
    align = any(isinstance(g, MambaSpec) for g in groups)
    vllm_config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=1024,
            max_model_len=max_model_len,
            long_prefill_token_threshold=long_prefill,
            enable_chunked_prefill=True,
            async_scheduling=True,
            is_encoder_decoder=False,
            watermark=0.0,
            policy=policy,  # type: ignore[arg-type]
        ),
        model_config=ModelConfig(
            model=MODEL,
            trust_remote_code=True,
            dtype="float16",
            seed=42,
            skip_tokenizer_init=True,
            max_model_len=max_model_len,
        ),
        cache_config=CacheConfig(
            block_size=BS,
            enable_prefix_caching=prefix_caching,
            **({"mamba_cache_mode": "align"} if align else {}),
        ),
        kv_transfer_config=kv_transfer,
    )
    # vLLM's CPU platform turns async scheduling off in the config (its CPU
    # worker cannot overlap steps); the scheduler is the GPU one, so turn it
    # back on as a GPU config keeps it: two batches in flight.
    vllm_config.scheduler_config.async_scheduling = True
    assert vllm_config.max_concurrent_batches == 2
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(groups)
        ],
    )
    register_all_kvcache_specs(vllm_config)
    scheduler = AsyncScheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BS,
        hash_block_size=BS,
        log_stats=True,
    )
    assert isinstance(scheduler.kv_cache_manager, kvcore_vllm.KVCacheManager), (
        "vLLM's scheduler is not on kvcore: run with KVCORE_VLLM=1 "
        "(run_vllm_suite.py does)"
    )
    return scheduler


class ConsumerConnector(KVConnectorBase_V1, SupportsHMA):
    """A KV-consumer connector that loads nothing.  With one, vLLM defers
    the frees of finished and preempted requests while a step in flight
    may still write their blocks (a load into a reused block is not ordered
    after that step); it supports hybrid plans (``SupportsHMA``)."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, None]:
        return False, None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, *args: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


_hashing_ready = False


def _request(
    rid: str, tokens: list[int], max_tokens: int, priority: int = 0
) -> Request:
    global _hashing_ready
    if not _hashing_ready:
        init_none_hash(sha256)
        _hashing_ready = True
    params = SamplingParams(ignore_eos=True, max_tokens=max_tokens)
    params.update_from_generation_config({}, EOS)
    return Request(
        request_id=rid,
        prompt_token_ids=list(tokens),
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BS, sha256),
        priority=priority,
    )


class Worker:
    """The model-runner stand-in: block tables as the scheduler outputs give
    them, attention reads, Mamba align-mode state reads and writes."""

    def __init__(self, scheduler: AsyncScheduler) -> None:
        self.specs = [
            g.kv_cache_spec for g in scheduler.kv_cache_config.kv_cache_groups
        ]
        self.scheduler = scheduler
        manager = scheduler.kv_cache_manager
        self.null_id = manager.kvcore.block_pool.null_block
        #: request id -> per group, the block ids the worker's table holds.
        self.tables: dict[str, list[list[int]]] = {}
        #: request id -> per group and position, the step that handed the
        #: block there over.
        self.since: dict[str, list[list[int]]] = {}
        #: request id -> the table position of its running state (Mamba).
        self.state_pos: dict[str, int] = {}
        #: block id -> (writer request, tokens) of the state it holds.
        self.written: dict[int, tuple[Request, int]] = {}
        #: (reader, tokens, writer, written tokens, restored?) to compare once
        #: every sampled token is known.
        self.state_reads: list[tuple[Request, int, Request | None, int, bool]] = []
        self.requests: dict[str, Request] = {}
        #: Steps of a state group, and those for which kvcore's
        #: ``state_write_positions`` asks for more than the step's end.
        self.state_steps = 0
        self.asked_inside_steps: list[str] = []
        #: Full attention: block id -> slot -> (writer, token position) of
        #: the KV it holds.
        self.kv: dict[int, dict[int, tuple[Request, int]]] = {}
        #: (reader, token position, writer or None, written position) of
        #: each token a request's first step reads from blocks it did not
        #: write (a prefix hit), compared once every sampled token is known.
        self.kv_reads: list[tuple[Request, int, Request | None, int]] = []

    def _take(self, step: int, rid: str, groups: Any, *, replace: bool) -> None:
        if replace or rid not in self.tables:
            self.tables[rid] = [[] for _ in self.specs]
            self.since[rid] = [[] for _ in self.specs]
        for table, since, ids in zip(
            self.tables[rid], self.since[rid], groups, strict=True
        ):
            table.extend(ids)
            since.extend([step] * len(ids))

    def execute(self, step: int, out: Any) -> dict[int, list[tuple[str, int]]]:
        """Run one step; the blocks it reads: block id -> (request id, the
        step that handed the block to that request at the position read)."""
        cached = out.scheduled_cached_reqs
        for rid in (
            *out.finished_req_ids,
            *(out.preempted_req_ids or ()),
            *cached.resumed_req_ids,
        ):
            self.state_pos.pop(rid, None)
        for rid in out.finished_req_ids:
            self.tables.pop(rid, None)
            self.since.pop(rid, None)
        starts: dict[str, int] = {}
        #: Requests whose table starts afresh this step (new or resumed).
        fresh: set[str] = set()
        for new in out.scheduled_new_reqs:
            self._take(step, new.req_id, new.block_ids, replace=True)
            starts[new.req_id] = new.num_computed_tokens
            fresh.add(new.req_id)
        for i, rid in enumerate(cached.req_ids):
            resumed = rid in cached.resumed_req_ids
            if cached.new_block_ids[i] is not None:
                self._take(step, rid, cached.new_block_ids[i], replace=resumed)
            starts[rid] = cached.num_computed_tokens[i]
            if resumed:
                fresh.add(rid)
        reads: dict[int, list[tuple[str, int]]] = {}
        for rid, n in out.num_scheduled_tokens.items():
            request = self.requests.setdefault(rid, self.scheduler.requests[rid])
            start, end = starts[rid], starts[rid] + n
            for gid, (spec, table, since) in enumerate(
                zip(self.specs, self.tables[rid], self.since[rid], strict=True)
            ):
                assert cdiv(end, BS) <= len(table), (
                    f"step {step}: request {rid} computes tokens {start}-{end} "
                    f"but its {type(spec).__name__} table has {len(table)} blocks"
                )
                if type(spec) is FullAttentionSpec:
                    self._attend(request, table, start, end, rid in fresh)
                if isinstance(spec, MambaSpec):
                    positions = self._mamba(request, table, start, end)
                    self._asked(gid, rid, start, end)
                elif isinstance(spec, SlidingWindowSpec):
                    first = max(0, start - spec.sliding_window + 1) // BS
                    positions = range(first, cdiv(end, BS))
                else:
                    positions = range(cdiv(end, BS))
                for pos in positions:
                    bid = table[pos]
                    if bid != self.null_id:
                        reads.setdefault(bid, []).append((rid, since[pos]))
        return reads

    def _attend(
        self, request: Request, table: list[int], start: int, end: int, fresh: bool
    ) -> None:
        """Full attention: a fresh table's first step reads the KV of the
        tokens before ``start`` from its hit blocks; every step writes its
        own tokens' KV."""
        if fresh:
            for pos in range(start):
                slot = self.kv.get(table[pos // BS], {}).get(pos % BS)
                writer, written = slot if slot is not None else (None, -1)
                self.kv_reads.append((request, pos, writer, written))
        for pos in range(start, end):
            self.kv.setdefault(table[pos // BS], {})[pos % BS] = (request, pos)

    def unwritten_kv(self) -> tuple[int, int]:
        """(tokens read from hit blocks, those whose KV no step wrote for that
        prefix at that position)."""
        prefix: dict[str, list[int]] = {}
        bad = 0
        for reader, pos, writer, written in self.kv_reads:
            if writer is None or written != pos:
                bad += 1
                continue
            if writer is reader:
                continue
            for r in (reader, writer):
                if r.request_id not in prefix:
                    prefix[r.request_id] = _prefix_hashes(r.all_token_ids)
            if prefix[reader.request_id][pos] != prefix[writer.request_id][pos]:
                bad += 1
        return len(self.kv_reads), bad

    def _mamba(
        self, request: Request, table: list[int], start: int, end: int
    ) -> list[int]:
        rid = request.request_id
        restored = rid not in self.state_pos
        src = self.state_pos.get(rid, (start - 1) // BS)
        dst = cdiv(end, BS) - 1
        if start > 0:
            writer, length = self.written.get(table[src], (None, 0))
            self.state_reads.append((request, start, writer, length, restored))
        self.written[table[dst]] = (request, end)
        self.state_pos[rid] = dst
        return [src, dst] if start > 0 else [dst]

    def _asked(self, gid: int, rid: str, start: int, end: int) -> None:
        """What kvcore asks the worker to write (its engine contract): only
        the step's end, the one state vLLM's align-mode kernels write."""
        self.state_steps += 1
        manager = self.scheduler.kv_cache_manager
        asked = manager.state_write_positions(rid, start, end)[gid]
        if asked != (end,):
            self.asked_inside_steps.append(
                f"{rid} tokens {start}-{end}: kvcore asks for states after {asked}"
            )

    def unwritten_states(self) -> tuple[int, int, int]:
        """(states restored from hits, states carried between steps, reads
        of a state no step wrote for that prefix)."""
        bad = 0
        for reader, length, writer, written, _ in self.state_reads:
            if (
                writer is None
                or written != length
                or list(writer.all_token_ids[:length])
                != list(reader.all_token_ids[:length])
            ):
                bad += 1
        restored = sum(1 for *_, r in self.state_reads if r)
        return restored, len(self.state_reads) - restored, bad


class Harness:
    """vLLM's engine loop with async scheduling over one scheduler, and the
    release check: every block kvcore's pool frees is checked against the
    reads of the steps in flight.

    A block is *released* by a call when its reference count (public on
    every block of kvcore's pool) goes from positive to 0 across the call,
    or when the call hands it out anew (a block id in the scheduler
    output's new blocks) with one reference left where it had some before:
    its holder let go of it and another request took it in the same call.
    """

    def __init__(self, scheduler: AsyncScheduler, seed: int = 0) -> None:
        self.scheduler = scheduler
        self.worker = Worker(scheduler)
        self.rng = random.Random(seed)
        self.in_flight: deque[tuple[int, Any, dict[str, bool], dict[int, Any]]] = (
            deque()
        )
        self.steps = 0
        self.blocks_checked = 0
        self.checked_in_flight = 0
        self.deferred_checked = 0
        self.violations: list[str] = []
        self.pool = scheduler.kv_cache_manager.kvcore.block_pool
        self.null_id = self.pool.null_block

    def _ref_counts(self) -> list[int]:
        return list(self.pool.ref_cnt)

    def _released(self, before: list[int], out: Any = None) -> list[int]:
        """The blocks the call since ``before`` released (see the class)."""
        after = self._ref_counts()
        released = [
            bid
            for bid, (was, now) in enumerate(zip(before, after, strict=True))
            if was > 0 and now == 0 and bid != self.null_id
        ]
        if out is not None:
            handed: dict[int, None] = {}
            groups = [new.block_ids for new in out.scheduled_new_reqs]
            groups += [g for g in out.scheduled_cached_reqs.new_block_ids if g]
            for per_group in groups:
                for ids in per_group:
                    handed.update(dict.fromkeys(ids))
            released += [
                bid
                for bid in handed
                if bid != self.null_id and before[bid] > 0 and after[bid] == 1
            ]
        return released

    def _check(self, where: str, new_step: int | None, released: list[int]) -> None:
        for bid in released:
            self.blocks_checked += 1
            self.checked_in_flight += bool(self.in_flight)
            for step, _, _, reads in self.in_flight:
                for rid, given in reads.get(bid, ()):
                    if step == new_step and given == new_step:
                        continue  # handed over after the release, this step
                    self.violations.append(
                        f"{where}: block {bid} released while step {step} "
                        f"(in flight) reads it for request {rid}"
                    )

    def schedule(self) -> bool:
        before = self._ref_counts()
        out = self.scheduler.schedule()
        step = self.steps
        self.steps += 1
        if not out.num_scheduled_tokens:
            self._check(f"schedule (step {step}, empty)", None, self._released(before))
            return False
        sampling = {
            rid: not self.scheduler.requests[rid].is_prefill_chunk
            for rid in out.num_scheduled_tokens
        }
        reads = self.worker.execute(step, out)
        self.in_flight.append((step, out, sampling, reads))
        self._check(f"schedule (step {step})", step, self._released(before, out))
        return True

    def complete_oldest(self) -> None:
        step, out, sampling, _ = self.in_flight.popleft()
        req_ids = list(out.num_scheduled_tokens)
        output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=[
                [self.rng.randrange(3, 1000)] if sampling[rid] else []
                for rid in req_ids
            ],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        )
        before = self._ref_counts()
        self.scheduler.update_from_output(out, output)
        checked = self.blocks_checked
        self._check(f"update_from_output (step {step})", None, self._released(before))
        self.deferred_checked += self.blocks_checked - checked

    def run(
        self, arrivals: dict[int, list[Request]], aborts: dict[int, list[str]]
    ) -> None:
        """Add ``arrivals[i]`` and abort ``aborts[i]`` before the i-th
        schedule; apply each step's output one step late (async)."""
        i = 0
        while True:
            for request in arrivals.get(i, ()):
                self.scheduler.add_request(request)
            ids = [r for r in aborts.get(i, ()) if r in self.scheduler.requests]
            if ids:
                before = self._ref_counts()
                self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
                self._check(
                    f"abort before step {self.steps}", None, self._released(before)
                )
            scheduled = self.schedule()
            while len(self.in_flight) > (1 if scheduled else 0):
                self.complete_oldest()
            i += 1
            if (
                i > max(arrivals, default=0)
                and not self.scheduler.has_unfinished_requests()
                and not self.in_flight
            ):
                break
            assert i < 20_000, "the trace does not finish"

    def summary(self) -> str:
        return (
            f"{self.steps} steps, {self.blocks_checked} released blocks checked "
            f"({self.checked_in_flight} while a step was in flight, "
            f"{self.deferred_checked} on applying an output), "
            f"{len(self.violations)} read by a step in flight"
        )


def _prefix_hashes(tokens: Any) -> list[int]:
    """Per position, a hash of the tokens up to and including it."""
    out: list[int] = []
    h = 0
    for token in tokens:
        h = hash((h, token))
        out.append(h)
    return out


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]


def _attention_trace(
    seed: int,
    *,
    num: int,
    lengths: tuple[int, int],
    shared: bool = False,
    priorities: int = 1,
) -> dict[int, list[Request]]:
    """``num`` requests arriving over the first steps; with ``shared`` their
    prompts start with one of three common prefixes (prefix hits); each of
    ``priorities`` levels drawn at random (only 0 by default)."""
    rng = random.Random(seed)
    prefixes = [_tokens(rng, rng.randrange(32, 96)) for _ in range(3)]
    arrivals: dict[int, list[Request]] = {}
    for i in range(num):
        body = _tokens(rng, rng.randrange(*lengths))
        prompt = (rng.choice(prefixes) + body) if shared else body
        request = _request(
            f"r{i}",
            prompt,
            rng.randrange(4, 40),
            rng.randrange(priorities) if priorities > 1 else 0,
        )
        arrivals.setdefault(rng.randrange(0, 3 * num), []).append(request)
    return arrivals


def _sliding_window_run(seed: int = 1) -> Harness:
    harness = Harness(
        _scheduler([_attention(WINDOW)], num_blocks=600, long_prefill=64), seed
    )
    harness.run(_attention_trace(seed, num=12, lengths=(40, 300)), {})
    return harness


def _preemption_run(seed: int = 2) -> tuple[Harness, int]:
    scheduler = _scheduler(
        [_attention(), _attention(WINDOW)],
        num_blocks=56,
        long_prefill=48,
        prefix_caching=True,
    )
    harness = Harness(scheduler, seed)
    arrivals = _attention_trace(seed, num=24, lengths=(60, 200), shared=True)
    harness.run(arrivals, {})
    preemptions = sum(r.num_preemptions for rs in arrivals.values() for r in rs)
    return harness, preemptions


def _priority_scheduler(num_blocks: int) -> AsyncScheduler:
    """One full-attention group, prefix caching, 48-token prefill chunks,
    priority scheduling and no connector: vLLM frees a preempted request at
    once (with one, it never preempts a request whose step is not yet out)."""
    return _scheduler(
        [_attention()],
        num_blocks=num_blocks,
        long_prefill=48,
        prefix_caching=True,
        policy="priority",
        connector=False,
    )


def _in_step_preemption_run(seed: int = 5) -> tuple[Harness, Request]:
    """vLLM preempts a request it already scheduled in the same step, which
    is freed before that step's forward runs.

    ``c`` (priority 0, 8 tokens) and ``a`` (priority 1, 150 tokens, in
    48-token chunks) are admitted at step 0, ``b`` (priority 0, 16 tokens)
    at step 1: the running queue is ``c, a, b``.  At step 2, ``a``'s third
    chunk takes the last three free blocks (keyed: they fill), then ``b``'s
    first decode token needs a block: vLLM preempts ``a``, already
    scheduled, and ``a`` later resumes on a prefix hit."""
    scheduler = _priority_scheduler(num_blocks=12)
    rng = random.Random(seed)
    a = _request("a", _tokens(rng, 150), 4, priority=1)
    b = _request("b", _tokens(rng, 16), 8, priority=0)
    c = _request("c", _tokens(rng, 8), 4, priority=0)
    harness = Harness(scheduler, seed)
    harness.run({0: [a, c], 1: [b]}, {})
    return harness, a


def _priority_run(seed: int = 5) -> tuple[Harness, int]:
    """Priority scheduling of a trace with shared prefixes and too few
    blocks: vLLM preempts the running request of lowest priority."""
    scheduler = _priority_scheduler(num_blocks=40)
    harness = Harness(scheduler, seed)
    arrivals = _attention_trace(
        seed, num=24, lengths=(60, 200), shared=True, priorities=4
    )
    harness.run(arrivals, {})
    preemptions = sum(r.num_preemptions for rs in arrivals.values() for r in rs)
    return harness, preemptions


def _abort_run(seed: int = 3) -> tuple[Harness, int]:
    scheduler = _scheduler(
        [_attention(), _attention(WINDOW)],
        num_blocks=400,
        long_prefill=64,
        prefix_caching=True,
    )
    harness = Harness(scheduler, seed)
    rng = random.Random(seed)
    arrivals = _attention_trace(seed, num=16, lengths=(40, 250), shared=True)
    aborts: dict[int, list[str]] = {}
    aborted = 0
    for rs in arrivals.values():
        for r in rs:
            if rng.random() < 0.5:
                aborts.setdefault(rng.randrange(2, 60), []).append(r.request_id)
                aborted += 1
    harness.run(arrivals, aborts)
    return harness, aborted


def test_sliding_window_frees_nothing_a_step_in_flight_reads() -> None:
    """Sliding-window prefill (chunked) and decode under async scheduling:
    out-of-window blocks go back to the pool only once no step in flight
    reads them."""
    harness = _sliding_window_run()
    print("sliding window:", harness.summary())
    assert harness.violations == []
    assert harness.checked_in_flight >= 100


def test_preemption_frees_nothing_a_step_in_flight_reads() -> None:
    """Full attention + sliding window with prefix caching, chunked prefill
    and too few blocks: requests preempted (their blocks freed, or deferred
    while a step in flight reads them) and readmitted on prefix hits, with
    out-of-window blocks released along the way."""
    harness, preemptions = _preemption_run()
    reads, unwritten = harness.worker.unwritten_kv()
    print(
        f"preemption: {preemptions} preemptions, {reads} hit tokens read, "
        f"{unwritten} never written; {harness.summary()}"
    )
    assert harness.violations == []
    assert preemptions >= 5
    assert harness.deferred_checked >= 20
    assert unwritten == 0
    assert reads >= 200


def test_preemption_in_the_scheduling_step_leaves_no_stale_hit() -> None:
    """A request preempted in the step that scheduled it never runs that
    step, so the blocks it keyed there hold no KV: every token a later hit
    reads was written by an earlier step for that same prefix.  (Without a
    connector vLLM frees a preempted request's blocks while its last step
    is in flight, which the device's stream order makes safe, so the
    release check does not apply here.)"""
    harness, a = _in_step_preemption_run()
    reads, unwritten = harness.worker.unwritten_kv()
    print(
        f"in-step preemption: {a.num_preemptions} of a, {reads} hit tokens "
        f"read, {unwritten} never written; {harness.summary()}"
    )
    assert a.num_preemptions >= 1
    assert reads == 96  # the two chunks whose forward ran
    assert unwritten == 0
    harness, preemptions = _priority_run()
    reads, unwritten = harness.worker.unwritten_kv()
    print(
        f"priority trace: {preemptions} preemptions, {reads} hit tokens "
        f"read, {unwritten} never written; {harness.summary()}"
    )
    assert unwritten == 0
    assert reads >= 200
    assert preemptions >= 5


def test_finished_and_aborted_requests_free_nothing_in_flight() -> None:
    """Requests finished and aborted while their steps are in flight: their
    blocks come back (vLLM's deferred frees) only after those steps."""
    harness, aborted = _abort_run()
    print(f"finish/abort: {aborted} aborted, {harness.summary()}")
    assert harness.violations == []
    assert aborted >= 5
    assert harness.deferred_checked >= 50


def _conversations(seed: int) -> list[list[tuple[list[int], int]]]:
    """Three-turn chats over a few shared system prompts: per chat, each
    turn's new user tokens and its output length."""
    rng = random.Random(seed)
    return [
        [(_tokens(rng, rng.randrange(5, 60)), rng.randrange(1, 24)) for _ in range(3)]
        for _ in range(16)
    ]


def _mamba_run(
    seed: int = 4, *, num_blocks: int = 400, long_prefill: int = 48
) -> Harness:
    """A Mamba hybrid (full attention + align-mode Mamba, prefix caching)
    serving multi-turn chats: each turn's prompt is the previous turn's
    prompt and output and a new user message, submitted once that turn
    finishes; chats share system prompts."""
    scheduler = _scheduler(
        [_attention(), _mamba()],
        num_blocks=num_blocks,
        long_prefill=long_prefill,
        prefix_caching=True,
    )
    harness = Harness(scheduler, seed)
    rng = random.Random(seed)
    systems = [_tokens(rng, rng.randrange(20, 120)) for _ in range(3)]
    chats = _conversations(seed)
    live: dict[str, tuple[int, int]] = {}  # request id -> (chat, turn)
    pending = deque(range(len(chats)))
    counter = 0

    def submit(chat: int, turn: int, history: list[int]) -> None:
        nonlocal counter
        user, out_len = chats[chat][turn]
        request = _request(f"c{chat}t{turn}n{counter}", history + user, out_len)
        counter += 1
        live[request.request_id] = (chat, turn)
        scheduler.add_request(request)

    step = 0
    while pending or live or harness.in_flight:
        if pending and len(live) < 4:
            chat = pending.popleft()
            submit(chat, 0, list(rng.choice(systems)))
        scheduled = harness.schedule()
        while len(harness.in_flight) > (1 if scheduled else 0):
            harness.complete_oldest()
        for rid in list(live):
            request = harness.worker.requests.get(rid)
            if request is None or not request.is_finished():
                continue
            chat, turn = live.pop(rid)
            if turn + 1 < 3:
                submit(chat, turn + 1, list(request.all_token_ids))
        step += 1
        assert step < 20_000, "the chats do not finish"
    return harness


@pytest.mark.parametrize("num_blocks", [400, 40], ids=["roomy", "preempting"])
def test_align_mode_restores_only_states_vllm_wrote(num_blocks: int) -> None:
    """Align-mode Mamba: every state the worker reads (a prefix hit's,
    restored, or the previous step's) was written by an earlier step at the
    end of that very prefix; with 40 blocks, requests are preempted and
    resume on hits."""
    harness = _mamba_run(num_blocks=num_blocks)
    restored, carried, unwritten = harness.worker.unwritten_states()
    preemptions = sum(r.num_preemptions for r in harness.worker.requests.values())
    print(
        f"mamba align ({num_blocks} blocks, {preemptions} preemptions): "
        f"{restored} states restored from hits, {carried} carried between "
        f"steps, {unwritten} never written, "
        f"{len(harness.worker.asked_inside_steps)} of "
        f"{harness.worker.state_steps} steps asked for a state inside the step; "
        f"{harness.summary()}"
    )
    assert unwritten == 0
    assert harness.worker.asked_inside_steps == []
    assert harness.worker.state_steps >= 500
    assert restored >= 20
    assert carried >= 500
    assert harness.violations == []
    if num_blocks == 40:
        assert preemptions >= 3


@pytest.mark.parametrize("loaded", [48, 40], ids=["aligned", "inside-a-block"])
def test_a_connector_load_gives_the_starting_state_a_block(
    monkeypatch: pytest.MonkeyPatch, loaded: int
) -> None:
    """A connector loads a prompt's first tokens synchronously on a Mamba
    hybrid: the Mamba state after them, which the connector writes and the
    first step reads at table position ``(loaded - 1) // BS``, is a block of
    the request's own, not the null block (as in plain vLLM)."""
    told: dict[str, tuple[int, tuple[list[int], ...]]] = {}

    def matched(self: Any, request: Request, num_computed: int) -> tuple[int, bool]:
        return max(0, loaded - num_computed), False

    def after_alloc(self: Any, request: Request, blocks: Any, n: int) -> None:
        told[request.request_id] = (n, blocks.get_block_ids())

    monkeypatch.setattr(ConsumerConnector, "get_num_new_matched_tokens", matched)
    monkeypatch.setattr(ConsumerConnector, "update_state_after_alloc", after_alloc)
    scheduler = _scheduler([_attention(), _mamba()], num_blocks=64, prefix_caching=True)
    scheduler.add_request(_request("a", _tokens(random.Random(0), 100), 4))
    out = scheduler.schedule()
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == loaded
    table = new.block_ids[1]
    start = table[(loaded - 1) // BS]
    null = scheduler.kv_cache_manager.kvcore.block_pool.null_block
    print(f"connector load of {loaded} tokens: mamba table {table}")
    assert start != null
    assert told["a"] == (loaded, new.block_ids)
    assert start not in new.block_ids[0]


def test_a_shared_prefix_without_a_state_ends_a_chunk_where_siblings_resume() -> None:
    """Three prompts share a 64-token prefix, one after another, each in one
    chunk: the second finds the prefix in the attention group but no Mamba
    state there, so kvcore reports the shared-prefix boundary, vLLM ends
    its chunk at 64, and the state kept there serves the third (as on plain
    vLLM: one state restored, 64 hit tokens, all written)."""
    scheduler = _scheduler(
        [_attention(), _mamba()], num_blocks=200, prefix_caching=True
    )
    harness = Harness(scheduler, 0)
    rng = random.Random(0)
    prefix = _tokens(rng, 64)
    for name in "abc":
        harness.run({0: [_request(name, prefix + _tokens(rng, 40), 2)]}, {})
    restored, _, unwritten = harness.worker.unwritten_states()
    reads, stale = harness.worker.unwritten_kv()
    print(f"shared prefix: {reads} hit tokens, {restored} states restored")
    assert (reads, stale) == (64, 0)
    assert (restored, unwritten) == (1, 0)
    assert harness.violations == []


# -- the checks see a broken kvcore ----------------------------------------------


@contextmanager
def _releases_on_num_computed() -> Iterator[None]:
    """kvcore as it was: ``allocate_slots`` releases out-of-window blocks on
    ``num_computed_tokens`` (tokens still in flight count as done)."""
    cls = kvcore_vllm.KVCacheManager
    allocate = cls.allocate_slots

    def allocate_slots(self: Any, request: Any, *args: Any, **kw: Any) -> Any:
        saved = request.num_in_flight_tokens
        request.num_in_flight_tokens = 0
        try:
            return allocate(self, request, *args, **kw)
        finally:
            request.num_in_flight_tokens = saved

    cls.allocate_slots = allocate_slots  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls.allocate_slots = allocate  # type: ignore[method-assign]


@pytest.mark.parametrize("run", ["sliding window", "preemption"])
def test_release_on_num_computed_tokens_is_caught(run: str) -> None:
    with _releases_on_num_computed():
        harness = _sliding_window_run() if run != "preemption" else _preemption_run()[0]
    print(f"broken (release on num_computed_tokens, {run}):", harness.summary())
    assert len(harness.violations) >= 10


def test_undeferred_frees_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A manager that frees an aborted request's blocks at once instead of
    handing them back for vLLM to free after the step in flight."""

    def pop_blocks_for_free(self: Any, request: Any) -> list[Any]:
        self.free(request)
        return []

    monkeypatch.setattr(
        kvcore_manager.KVCacheManager, "pop_blocks_for_free", pop_blocks_for_free
    )
    harness, _ = _abort_run()
    print("broken (frees not deferred):", harness.summary())
    assert len(harness.violations) >= 5


def test_keys_kept_by_a_step_dropped_before_its_forward_are_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kvcore as it was: a request freed in the step that scheduled it kept
    that step's keys, and later hits read blocks no forward wrote."""
    monkeypatch.setattr(
        kvcore_vllm.KVCacheManager, "_forget_unwritten", lambda self, request: None
    )
    harness, _ = _in_step_preemption_run()
    _, unwritten = harness.worker.unwritten_kv()
    print(f"keys of dropped steps kept: {unwritten} hit tokens never written")
    assert unwritten > 0


def test_states_kept_inside_steps_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """kvcore keying the state at every block end a step passes (Mamba's
    ``all`` mode; what the contract assumed before ``state_write_positions``),
    which vLLM's align-mode kernels never write inside a step."""
    convert = kvcore_specs._mamba_spec

    def every_block_end(spec: Any, spec_type: Any, group: int) -> Any:
        return attrs.evolve(convert(spec, spec_type, group), mamba_cache_mode="all")

    monkeypatch.setattr(kvcore_specs, "_mamba_spec", every_block_end)
    harness = _mamba_run(long_prefill=0)
    restored, _, unwritten = harness.worker.unwritten_states()
    asked = len(harness.worker.asked_inside_steps)
    print(
        f"broken (every block end keyed): {unwritten} of {restored} restores "
        f"unwritten, {asked} steps asked for states inside the step"
    )
    assert unwritten >= 5
    assert asked >= 5


# -- speculative-decoding lookahead ---------------------------------------------


def _lookahead_hits(
    manager_cls: type, *, hybrid: bool, use_eagle: bool, later: bool
) -> list[int]:
    """Prefix-hit tokens after each 8-token chunk of a 24-token prompt, with
    multi-module MTP's counts (3 lookahead tokens: every block's hash covers
    the 3 tokens after it, the chunk's last 2 tokens may be prefilled again),
    on ``manager_cls`` built as vLLM's scheduler builds its manager; each
    chunk's blocks cached by ``allocate_slots``, or ``later`` by
    ``cache_blocks``."""
    bs = 4
    common: dict[str, Any] = {
        "block_size": bs,
        "num_kv_heads": 1,
        "head_size": 1,
        "dtype": torch.float32,
    }
    groups: list[KVCacheSpec] = [FullAttentionSpec(**common)]
    if hybrid:
        groups.append(SlidingWindowSpec(**common, sliding_window=8))
    config = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(groups)
        ],
    )
    manager = manager_cls(
        kv_cache_config=config,
        max_model_len=256,
        scheduler_block_size=bs,
        hash_block_size=bs,
        enable_caching=True,
        use_eagle=use_eagle,
        num_hash_lookahead_tokens=3,
        num_prefill_lookahead=3,
    )
    init_none_hash(sha256)
    hasher = get_request_block_hasher(bs, sha256, 3)
    params = SamplingParams(ignore_eos=True, max_tokens=4)
    params.update_from_generation_config({}, EOS)
    tokens = list(range(100, 124))

    def request(rid: str) -> Request:
        return Request(
            request_id=rid,
            prompt_token_ids=tokens,
            sampling_params=params,
            pooling_params=None,
            block_hasher=hasher,
        )

    producer = request("producer")
    hits = []
    for _ in range(3):
        slots = manager.allocate_slots(producer, 8, delay_cache_blocks=later)
        assert slots is not None
        producer.num_computed_tokens += 8
        if later:
            manager.cache_blocks(producer, producer.num_computed_tokens)
        hits.append(manager.get_computed_blocks(request("probe"))[1])
    return hits


@pytest.mark.parametrize("later", [False, True], ids=["allocate", "cache_blocks"])
@pytest.mark.parametrize(
    ("hybrid", "use_eagle"),
    [(False, False), (True, False), (True, True)],
    ids=["one group", "hybrid", "hybrid eagle"],
)
def test_prefill_lookahead_caches_what_vllm_caches(
    hybrid: bool, use_eagle: bool, later: bool
) -> None:
    """The trailing ``num_prefill_lookahead - 1`` tokens of a chunk are not
    final: vLLM's own manager and kvcore's cache the same blocks."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager

    flags = {"hybrid": hybrid, "use_eagle": use_eagle, "later": later}
    theirs = _lookahead_hits(VllmManager, **flags)
    ours = _lookahead_hits(kvcore_vllm.KVCacheManager, **flags)
    print(f"hits after each chunk: vLLM {theirs}, kvcore {ours}")
    assert ours == theirs
    if not hybrid:
        # Chunk ends 8, 16, 24 less the 2 re-prefillable tokens, in whole
        # blocks the hashes (3 tokens ahead, 24 known) reach.
        assert theirs == [4, 12, 20]


def test_lookahead_hashes_with_kv_events_are_refused() -> None:
    config = KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer0"], _attention())],
    )
    with pytest.raises(kvcore_manager.UnsupportedFeatureError, match="KV events"):
        kvcore_vllm.KVCacheManager(
            kv_cache_config=config,
            max_model_len=256,
            scheduler_block_size=BS,
            hash_block_size=BS,
            enable_kv_cache_events=True,
            num_hash_lookahead_tokens=1,
            num_prefill_lookahead=1,
        )


def test_admissions_leave_the_running_states_boundary_headroom() -> None:
    """kvcore's manager under vLLM, as on its own: an admission leaves free
    the state blocks the running requests take when their next steps cross
    a block boundary together (a Mamba step reads the old state's block
    while it writes the new one), so that crossing preempts no one."""
    scheduler = _scheduler(
        [_attention(), _mamba()], num_blocks=9, prefix_caching=True, connector=False
    )
    manager = scheduler.kv_cache_manager
    running = []
    for i in range(2):
        request = _request(f"r{i}", list(range(100 * i, 100 * i + BS)), 8)
        assert manager.allocate_slots(request, BS) is not None
        request.status = RequestStatus.RUNNING  # as vLLM's scheduler sets it
        request.num_computed_tokens = BS
        request.append_output_token_ids(7)
        running.append(request)
    # 8 usable blocks: each request holds an attention block and a state.
    assert manager.block_pool.get_num_free_blocks() == 4
    third = _request("r2", list(range(300, 300 + BS)), 8)
    # It needs 2 of the 4 free, but the two crossings and its own next
    # step's take 3 state blocks.
    assert manager.allocate_slots(third, BS) is None
    assert manager.block_pool.get_num_free_blocks() == 4
    # A finished request whose blocks are not freed yet (a connector still
    # sends them) no longer steps: only r0's crossing and r2's are left.
    running[1].status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert manager.allocate_slots(third, BS) is not None


def _caching_manager(
    groups: list[KVCacheSpec], num_blocks: int
) -> kvcore_vllm.KVCacheManager:
    """kvcore's manager for vLLM over ``groups`` (a layer each), prefix
    caching on, built as vLLM's scheduler builds it."""
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(groups)
        ],
    )
    return kvcore_vllm.KVCacheManager(
        kv_cache_config=config,
        max_model_len=512,
        scheduler_block_size=BS,
        hash_block_size=BS,
        enable_caching=True,
    )


def _free_order(deferred: bool, groups: list[KVCacheSpec]) -> list[int]:
    """The pool's eviction order after three requests sharing a prefix run
    and finish, freed at once or (``deferred``) as vLLM's scheduler frees
    a request whose step may still be in flight: ``pop_blocks_for_free``,
    then ``block_pool.free_blocks`` of the list reversed."""
    manager = _caching_manager(groups, 64)
    shared = list(range(1000, 1000 + 3 * BS))
    for i in range(3):
        request = _request(f"r{i}", shared + list(range(100 * i, 100 * i + 40)), 4)
        hit, num_hit, _ = manager.get_computed_blocks(request)
        num_tokens = request.num_tokens
        assert manager.allocate_slots(request, num_tokens - num_hit, num_hit, hit)
        request.num_computed_tokens = num_tokens
        if deferred:
            blocks = manager.pop_blocks_for_free(request)
            assert blocks
            manager.block_pool.free_blocks(reversed(blocks))
        else:
            manager.free(request)
    queue = manager.block_pool.free_block_queue
    return [block.block_id for block in queue.get_all_free_blocks()]


@pytest.mark.parametrize(
    "groups",
    [
        pytest.param(lambda: [_attention()], id="full"),
        pytest.param(lambda: [_attention(), _attention(WINDOW)], id="full+window"),
        pytest.param(lambda: [_attention(WINDOW), _attention()], id="window+full"),
        pytest.param(lambda: [_attention(), _mamba()], id="full+mamba"),
    ],
)
def test_a_deferred_free_queues_blocks_as_a_free_does(groups: Any) -> None:
    """A request freed late (its blocks popped, then freed by the
    scheduler) leaves the pool's eviction order exactly as ``free`` does:
    the coordinator's free order across groups, tail first."""
    assert _free_order(True, groups()) == _free_order(False, groups())


def _state_free_order(deferred: bool) -> tuple[list[int], set[int]]:
    """The eviction order once request R of a full-attention and Mamba
    plan has decoded past several state blocks (releasing states it keeps
    for later hits) and finished after request O: freed directly, or R
    deferred (popped, O freed, R's list freed by the scheduler).  Also R's
    states still in its table when it finished."""
    manager = _caching_manager([_attention(), _mamba()], 200)
    r = _request("R", list(range(5000, 5040)), 45)
    o = _request("O", list(range(9000, 9040)), 4)
    for request in (r, o):
        hit, num_hit, _ = manager.get_computed_blocks(request)
        assert manager.allocate_slots(
            request, request.num_tokens - num_hit, num_hit, hit
        )
        request.num_computed_tokens = request.num_tokens
    for i in range(40):
        r.append_output_token_ids(7000 + i)
        manager.remove_skipped_blocks(r.request_id, r.num_computed_tokens)
        assert manager.allocate_slots(r, 1)
        r.num_computed_tokens += 1
    in_table = {b for b in manager.get_block_ids("R")[1] if b}
    if deferred:
        blocks = manager.pop_blocks_for_free(r)
        manager.free(o)
        manager.block_pool.free_blocks(reversed(blocks))
    else:
        manager.free(o)
        manager.free(r)
    queue = manager.block_pool.free_block_queue
    return [block.block_id for block in queue.get_all_free_blocks()], in_table


def test_a_deferred_free_queues_kept_states_behind_the_request() -> None:
    """The states a request kept and released while it ran go behind its
    other blocks when vLLM frees its popped list, as a free then does,
    not before them and before the blocks freed meanwhile.  (A state
    still in its table keeps its place among them.)"""
    order, in_table = _state_free_order(True)
    direct, _ = _state_free_order(False)
    assert in_table
    assert [b for b in order if b not in in_table] == [
        b for b in direct if b not in in_table
    ]


@pytest.mark.parametrize("window", [WINDOW, None], ids=["window", "full"])
def test_a_whole_sequence_check_counts_a_window_as_vllm_caps_it(
    window: int | None,
) -> None:
    """``full_sequence_must_fit`` (vLLM's ``scheduler_reserve_full_isl``): a
    window group holds at most its window and the tokens in flight at once,
    so a 199-token prompt is admitted into 11 free blocks, as vLLM admits
    it; a full-attention group needs all 13 blocks and is refused."""
    config = KVCacheConfig(
        num_blocks=12,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer0"], _attention(window))],
    )
    manager = kvcore_vllm.KVCacheManager(
        kv_cache_config=config,
        max_model_len=512,
        scheduler_block_size=BS,
        hash_block_size=BS,
        max_in_flight_tokens=128,
        enable_caching=True,
    )
    request = _request("a", [100 + i for i in range(199)], 4)
    out = manager.allocate_slots(request, 128, full_sequence_must_fit=True)
    if window is None:
        assert out is None
        assert manager.block_pool.get_num_free_blocks() == 11
        return
    assert out is not None
    request.num_computed_tokens = 128
    assert manager.allocate_slots(request, 71, full_sequence_must_fit=True)


def test_a_window_hybrid_keeps_a_prompts_last_window_for_its_next_turn() -> None:
    """Under vLLM, each admission plans where a window group keeps blocks
    for later hits, as kvcore's own admissions do: once a decoding
    request's window has moved past its prompt's end, the blocks of the
    prompt's last window are held back, not spare.  A pool pressed for
    every other free block keeps them, so the next turn (the prompt and
    more) still hits the whole prompt."""
    manager = _caching_manager([_attention(), _attention(WINDOW)], 40)
    prompt = list(range(100, 100 + 6 * BS))
    a = _request("a", prompt, 4 * BS)
    hit, num_hit, _ = manager.get_computed_blocks(a)
    assert manager.allocate_slots(a, len(prompt) - num_hit, num_hit, hit)
    a.num_computed_tokens = len(prompt)
    for i in range(3 * BS):
        a.append_output_token_ids(500 + i)
        manager.remove_skipped_blocks("a", a.num_computed_tokens)
        assert manager.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    pool = manager.kvcore.block_pool
    held = pool.free_queue.held_blocks()
    assert held
    pool.get_new_blocks(pool.get_num_free_blocks() - len(held))
    b = _request("b", [*prompt, 7, 8, 9], 4)
    _, num_hit, _ = manager.get_computed_blocks(b)
    assert num_hit == len(prompt)


def _decoding_past_a_branch_point() -> tuple[kvcore_vllm.KVCacheManager, Request]:
    """A full attention and window manager (40 blocks) where request B hit
    the first 48 tokens of A's cached prompt, so it keeps the window of
    that branch point (positions 1 and 2) in its table, and has decoded to
    the end of a block."""
    manager = _caching_manager([_attention(), _attention(WINDOW, torch.float16)], 40)
    prompt = list(range(100, 100 + 6 * BS))
    a = _request("a", prompt, 4)
    assert manager.allocate_slots(a, len(prompt))
    a.num_computed_tokens = len(prompt)
    manager.free(a)
    b = _request("b", [*prompt[: 3 * BS], *range(3000, 3000 + 2 * BS)], 4 * BS)
    hit, num_hit, _ = manager.get_computed_blocks(b)
    assert num_hit == 3 * BS
    assert manager.allocate_slots(b, b.num_tokens - num_hit, num_hit, hit)
    b.num_computed_tokens = b.num_tokens
    while b.num_computed_tokens % BS:
        b.append_output_token_ids(500 + b.num_computed_tokens)
        manager.remove_skipped_blocks("b", b.num_computed_tokens)
        assert manager.allocate_slots(b, 1)
        b.num_computed_tokens += 1
    return manager, b


def test_a_step_that_does_not_fit_with_its_pinned_window_runs_without_it() -> None:
    """B shares A's first 48 tokens and hits there, so it keeps the window
    of that branch point (positions 1 and 2) in its table as it decodes.
    With the pool full, B's step into a new block fits only without those
    two blocks: under vLLM, as in kvcore's own steps, B gives them up and
    the step runs instead of being refused.  The window's precision is not
    full attention's, so vLLM zeroes new blocks: the shed blocks the step
    takes back are listed for zeroing like any new block."""
    manager, b = _decoding_past_a_branch_point()
    pinned = manager.get_block_ids("b")[1][1:3]
    assert 0 not in pinned
    filled = 0
    while manager.allocate_slots(
        _request(f"f{filled}", [8000 + 4 * filled + i for i in range(3)], 1), 3
    ):
        filled += 1
    assert manager.block_pool.get_num_free_blocks() < 2
    manager.take_new_block_ids()
    b.append_output_token_ids(999)
    manager.remove_skipped_blocks("b", b.num_computed_tokens)
    assert manager.allocate_slots(b, 1)
    assert manager.get_block_ids("b")[1][1:3] == [0, 0]
    new = {g[-1] for g in manager.get_block_ids("b")}
    assert new <= set(pinned)
    assert new <= set(manager.take_new_block_ids())


def test_align_mode_states_a_request_releases_queue_by_age() -> None:
    """vLLM's align-mode Mamba keeps a state at every step end on a block
    boundary, so each state a decoding request releases stays a hit point:
    the group picks none: none is held back (evicted after every other
    free block) and none is spare (before every other cached block).  O's
    prompt is cached and freed first; the states R releases as its
    prompt's chunks go by then queue behind O's blocks, by age, as vLLM's
    own manager queues them."""
    manager = _caching_manager([_attention(), _mamba()], 200)
    pool = manager.kvcore.block_pool
    o = _request("O", list(range(9000, 9040)), 4)
    assert manager.allocate_slots(o, o.num_tokens)
    o.num_computed_tokens = o.num_tokens
    manager.free(o)
    o_blocks = [b for b in pool.eviction_order() if pool.key_hash[b] is not None]
    assert o_blocks
    r = _request("R", list(range(5000, 5000 + 6 * BS)), 4)
    while r.num_computed_tokens < r.num_tokens:  # a chunk of a block a step
        assert manager.allocate_slots(r, BS)
        r.num_computed_tokens += BS
    order = pool.eviction_order()
    released = [
        b
        for b in order
        if pool.key_hash[b] is not None and b not in o_blocks and not pool.ref_cnt[b]
    ]
    assert released  # R's superseded states, still cached
    assert pool.free_queue.spare_blocks() == []
    assert pool.free_queue.held_blocks() == []
    assert min(map(order.index, released)) > max(map(order.index, o_blocks))


def test_a_release_that_raises_before_a_step_is_undone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A running request's release runs before its step is weighed, in a
    transaction of its own: a window manager that raises there leaves the
    pool and the tables as they were, and the next step runs (an open
    transaction would refuse every later step as re-entrant)."""
    from kvcore.errors import PluginError
    from kvcore_sliding_window import SlidingWindowManager

    manager = _caching_manager([_attention(), _attention(WINDOW)], 40)
    prompt = list(range(100, 100 + 4 * BS))
    a = _request("a", prompt, 8)
    assert manager.allocate_slots(a, len(prompt))
    a.num_computed_tokens = len(prompt)
    a.append_output_token_ids(7)
    tables = manager.get_block_ids("a")
    free = manager.block_pool.get_num_free_blocks()
    release = SlidingWindowManager.release_twins

    def broken(self: Any, twins: Any, request_id: str, num_tokens: int) -> None:
        release(self, twins, request_id, num_tokens)
        raise RuntimeError("broken mid-release")

    monkeypatch.setattr(SlidingWindowManager, "release_twins", broken)
    with pytest.raises(PluginError, match="broken mid-release"):
        manager.allocate_slots(a, 1)
    monkeypatch.undo()
    assert manager.get_block_ids("a") == tables
    assert manager.block_pool.get_num_free_blocks() == free
    assert manager.allocate_slots(a, 1)
    assert manager.get_block_ids("a")[1][:2] == [0, 0]


def test_an_overstated_freeable_count_is_blamed_under_vllm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As in the pinned-window test, B's step fits only without its pinned
    window, but here it takes two blocks in each group: the two blocks the
    shed window's release returns are not enough.  A window manager whose
    ``count_freeable_skipped`` claims five more makes the step look as if
    it fits; once the release has run the pool is short, and the error
    names the count (as kvcore's own steps do), not the allocation that
    would run the pool dry.  The step is undone."""
    from kvcore.errors import PluginResultError
    from kvcore_sliding_window import SlidingWindowManager

    manager, b = _decoding_past_a_branch_point()
    filled = 0
    while manager.allocate_slots(
        _request(f"f{filled}", [8000 + 4 * filled + i for i in range(3)], 1), 3
    ):
        filled += 1
    for i in range(BS + 1):
        b.append_output_token_ids(900 + i)
    manager.remove_skipped_blocks("b", b.num_computed_tokens)
    tables = manager.get_block_ids("b")
    free = manager.block_pool.get_num_free_blocks()
    assert manager.allocate_slots(b, BS + 1) is None  # honestly, it does not fit
    count = SlidingWindowManager.count_freeable_skipped

    def overstated(self: Any, request_id: str, num_computed_tokens: int) -> int:
        return count(self, request_id, num_computed_tokens) + 5

    monkeypatch.setattr(SlidingWindowManager, "count_freeable_skipped", overstated)
    with pytest.raises(PluginResultError, match="count_freeable_skipped of"):
        manager.allocate_slots(b, BS + 1)
    monkeypatch.undo()
    assert manager.get_block_ids("b") == tables
    assert manager.block_pool.get_num_free_blocks() == free
