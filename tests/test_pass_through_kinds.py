"""A third party's kind whose manager overrides every step only to call
``super()`` serves exactly like the built-in kind it wraps.

Such a manager defines every step itself, so the core treats each as a
kind's own code (``twins.own_code``) and checks everything it does: its
answers, the tables and references it leaves, its keys and its hits.  The
checks must never refuse a correct kind: seeded traces (shared prefixes,
chunked prefill, decode, small pools that refuse, preemption, frees) run
through the built-in kinds and through their pass-through twins, and every
call's answer (hit, tables, new blocks, refusals, free blocks) must agree.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import pytest
import torch
from coordinator_setup import builtin_kinds, fa, mamba, manager_for, sw

from kvcore import KindRegistry
from kvcore.coordinator import KVCacheManager, Request
from kvcore.coordinator.manager import HitQuery, SingleTypeManager
from kvcore.coordinator.twins import CORE_MANAGERS, KIND_STEPS, own_code
from kvcore.kinds import CacheKind
from kvcore_chunked_local import ChunkedLocalAttentionSpec
from kvcore_circular_buffer import CircularBufferSpec
from kvcore_cross_attention import CrossAttentionSpec
from kvcore_hisparse import HiSparseHotSpec
from kvcore_mamba import Mamba, MambaStateManager
from kvcore_mla import MLAAttentionSpec
from kvcore_sliding_window import SlidingWindowMLASpec

#: The steps and hooks a pass-through manager overrides (where its parent
#: has them): every step the core checks as a kind's own, and the queries
#: it asks a manager on the way.
STEPS = (
    "allocate_twins",
    "release_twins",
    "kept_twins",
    "kept_if_room_twins",
    "cache_twins",
    "pop_twins",
    "add_computed_blocks",
    "get_num_blocks_to_allocate",
    "plan_checkpoints",
    "block_hash",
    "hit_serves",
    "remove_skipped_blocks",
    "count_freeable_skipped",
    "releases_nothing",
    "admission_blocks",
    "take_held_back",
    "forget_checkpoints",
)
#: The one-group steps (a one-group override is stepped twin by twin).
ONE_GROUP_STEPS = (
    "allocate_new_blocks",
    "cache_blocks",
    "pop_blocks",
    "kept_for_later",
    "kept_if_room",
)
#: The promise flags an override drops unless the class sets them itself.
PROMISE_FLAGS = ("caches_at_chunk_ends", "grows_by_count", "releases_by_count")


def _forward(owner: Callable[[], type], name: str, calls: Counter[str]) -> Any:
    """A step that calls its parent's ``name`` (``super()`` in its two-arg
    form, the class read once it exists), counted in ``calls``."""

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return getattr(super(owner(), self), name)(*args, **kwargs)

    step.__name__ = step.__qualname__ = name
    return step


def pass_through(
    base: type[SingleTypeManager],
    calls: Counter[str],
    *,
    promises: bool = False,
    also: Sequence[str] = (),
) -> type[SingleTypeManager]:
    """A subclass of ``base`` overriding every step of :data:`STEPS` (and
    ``also``) that ``base`` has, and its hit search, with a call to
    ``base``'s (each call counted in ``calls``).  ``promises``: the class
    also declares ``base``'s promise flags in its body (without, the
    overrides drop them and the coordinator passes over no step)."""
    cls: type[SingleTypeManager] | None = None

    def owner() -> type[SingleTypeManager]:
        assert cls is not None
        return cls

    namespace: dict[str, Any] = {
        name: _forward(owner, name, calls)
        for name in (*STEPS, *also)
        if hasattr(base, name)
    }

    def find_longest_cache_hit(klass: Any, query: HitQuery) -> list[list[int]]:
        calls["find_longest_cache_hit"] += 1
        me = owner()
        found: list[list[int]] = super(me, klass).find_longest_cache_hit(query)
        return found

    if not getattr(base.find_longest_cache_hit, "__isabstractmethod__", False):
        namespace["find_longest_cache_hit"] = classmethod(find_longest_cache_hit)
    if promises:
        namespace.update({flag: getattr(base, flag) for flag in PROMISE_FLAGS})
    cls = type(f"PassThrough{base.__name__}", (base,), namespace)
    return cls


def pass_through_kind(kind: CacheKind, calls: Counter[str], **how: Any) -> CacheKind:
    """A third party's kind: ``kind``'s class with a pass-through manager
    (Mamba's ``none`` mode builds its own manager class: wrapped too);
    ``how``: :func:`pass_through`'s keywords."""
    base = type(kind)
    assert base.manager_type is not None
    manager = pass_through(base.manager_type, calls, **how)
    namespace: dict[str, Any] = {"manager_type": manager}
    if issubclass(base, Mamba):
        state = pass_through(MambaStateManager, calls, **how)
        kind_cls: type | None = None

        def make_manager(
            self: Any, spec: Any, block_pool: Any, **kwargs: Any
        ) -> SingleTypeManager:
            if spec.mamba_cache_mode == "none":
                return state(spec, block_pool, **kwargs)
            made: SingleTypeManager = super(kind_cls, self).make_manager(  # type: ignore[arg-type]
                spec, block_pool, **kwargs
            )
            return made

        namespace["make_manager"] = make_manager
    kind_cls = type(f"PassThrough{base.__name__}", (base,), namespace)
    made_kind: CacheKind = kind_cls()
    return made_kind


BUILT_IN = KindRegistry.from_kinds(builtin_kinds())


def third_party(
    promises: bool = False, *, only: str | None = None, also: Sequence[str] = ()
) -> tuple[KindRegistry, Counter[str]]:
    """Every built-in kind (or the one named ``only``, the others left
    built in) as a pass-through kind of plugin ``acme``, and the count of
    their managers' calls by step; ``also``: one-group steps they
    override too."""
    calls: Counter[str] = Counter()
    kinds = [
        (pass_through_kind(k, calls, promises=promises, also=also), "acme")
        if only in (None, k.name)
        else (k, "<manual>")
        for k in builtin_kinds()
    ]
    return KindRegistry(kinds), calls


# -- plans ----------------------------------------------------------------------


def mla(block_size: int, tokens_per_state: int = 1) -> MLAAttentionSpec:
    return MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=16,
        dtype=torch.float16,
        tokens_per_state=tokens_per_state,
    )


def sw_mla(block_size: int, window: int) -> SlidingWindowMLASpec:
    return SlidingWindowMLASpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=16,
        dtype=torch.float16,
        sliding_window=window,
    )


def ring(block_size: int) -> CircularBufferSpec:
    return CircularBufferSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16
    )


def hot(block_size: int, blocks: int) -> HiSparseHotSpec:
    return HiSparseHotSpec(
        block_size=block_size, page_size=64, blocks_per_request=blocks
    )


def chunked(block_size: int, chunk: int) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=8,
        dtype=torch.float16,
        attention_chunk_size=chunk,
    )


def xattn(block_size: int) -> CrossAttentionSpec:
    return CrossAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16
    )


class Plan(NamedTuple):
    """Group specs, pool size, scheduler and hash block sizes, whether
    requests bring encoder tokens, whether prefix hits can happen and
    whether the traces reach copy-on-write partial hits."""

    specs: Sequence[Any]
    num_blocks: int
    block_size: int = 4
    hash_block_size: int = 4
    encoder: bool = False
    hits: bool = True
    copies: bool = False


MODES = ("align", "all", "none", "auto")
POLICIES = ("turns", "steps", "prompts")

PLANS: dict[str, Plan] = {
    "full": Plan([fa(4)], 24),
    "mla": Plan([mla(4)], 24),
    "sliding_window": Plan([sw(4, 8)], 16),
    "sliding_window_mla": Plan([sw_mla(4, 8)], 16),
    "ring": Plan([ring(4)], 6, hits=False),
    "hisparse": Plan([hot(4, 2)], 10, hits=False),
    "chunked_local": Plan([chunked(4, 8)], 14, hits=False),
    **{
        f"mamba_{mode}": Plan(
            [mamba(4, mode=mode)], 12 if mode != "none" else 6, hits=mode != "none"
        )
        for mode in MODES
    },
    "full_sw": Plan([fa(4), sw(4, 8)], 40),
    "full_3sw": Plan([fa(4), sw(4, 8), sw(4, 8), sw(4, 8)], 64),
    "2full_sw_mla": Plan([fa(4), fa(4), sw(4, 12), mla(4)], 64),
    **{
        f"full_sw_mamba_{mode}": Plan(
            [fa(4), sw(4, 8), mamba(4, mode=mode)], 48, hits=mode != "none"
        )
        for mode in MODES
    },
    **{
        f"full_mamba_align_{policy}": Plan(
            [fa(4), mamba(4, mode="align", policy=policy)], 36
        )
        for policy in POLICIES
    },
    **{
        f"full_3mamba_{mode}": Plan(
            [fa(4), mamba(4, mode=mode), mamba(4, mode=mode), mamba(4, mode=mode)],
            64 if mode != "none" else 36,
            hits=mode != "none",
        )
        for mode in ("align", "all", "none")
    },
    "mamba_full_mamba": Plan([mamba(4), fa(4), mamba(4)], 48),
    "full_cross": Plan([fa(4), xattn(4)], 40, encoder=True),
    "full_ring_hot": Plan([fa(4), ring(4), hot(4, 2)], 40),
    "full_chunked": Plan([fa(4), chunked(4, 8)], 40),
    "mla_swmla_ring_hot": Plan(
        [mla(8), sw_mla(4, 8), ring(8), hot(4, 2)], 44, 8, copies=True
    ),
    # Hits align to 4 tokens inside 16-token full-attention blocks: partial
    # (copy-on-write) hits.
    "partial_fa16_sw_mamba8": Plan(
        [fa(16), sw(4, 8), mamba(8), ring(4)], 56, 16, copies=True
    ),
    "mla16_tps4_swmla_ring": Plan(
        [mla(16), mla(16, tokens_per_state=4), sw_mla(4, 4), ring(4)],
        48,
        16,
        copies=True,
    ),
    "two_block_sizes_sw_mamba_none": Plan(
        [fa(4), fa(8), sw(4, 12), mamba(8, mode="none")], 64, 8, hits=False
    ),
}


# -- traces -------------------------------------------------------------------

MAX_MODEL_LEN = 512
MAX_TOKENS = 120
MAX_LIVE = 6
CHUNKS = (1, 3, 4, 8, 12, 16, 24, 64)


class Counts(NamedTuple):
    """What the built-in runs did that makes the comparison worth
    something: admissions with a hit, refused steps, frees, and the block
    copies partial hits asked for."""

    hits: int
    refusals: int
    frees: int
    copies: int


class Trace:
    """One seeded run of a plan under a registry, as a scheduler drives it:
    each call the engine makes, with what the manager answered, in ``log``
    (so two runs agree only if every answer does)."""

    def __init__(self, plan: Plan, registry: KindRegistry, seed: int) -> None:
        self.plan = plan
        self.mgr: KVCacheManager = manager_for(
            plan.specs,
            plan.num_blocks,
            scheduler_block_size=plan.block_size,
            hash_block_size=plan.hash_block_size,
            registry=registry,
            max_model_len=MAX_MODEL_LEN,
        )
        managers = self.mgr.coordinator.single_type_managers
        self.lookahead = all(m.supports_lookahead for m in managers)
        self.rng = rng = random.Random(seed)
        self.prefixes = [
            [rng.randrange(10, 30000) for _ in range(rng.randrange(2, 7) * 8)]
            for _ in range(3)
        ]
        self.history: list[list[int]] = []
        self.waiting: list[Request] = []
        self.running: dict[str, Request] = {}
        self.count = 0
        self.log: list[tuple[Any, ...]] = []
        self.hits = self.refusals = self.frees = self.copies = 0
        #: Blocks of freed requests a step in flight still reads.
        self.in_flight: list[Any] = []

    def note(self, *event: Any) -> None:
        self.log.append((*event, self.mgr.get_num_free_blocks()))

    def allocate(
        self, r: Request, n: int, hit: int = 0, blocks: Any = None, **engine: Any
    ) -> bool:
        """One ``allocate_slots``; the request's computed tokens advance
        when it is granted (its forward pass runs)."""
        if self.plan.encoder and r.request_id not in self.running:
            engine["num_encoder_tokens"] = 1 + len(r.prompt_token_ids) // 2
        out = self.mgr.allocate_slots(r, n, hit, blocks, **engine)
        if out is None:
            self.refusals += 1
            self.note("refused", r.request_id, n, hit, sorted(engine.items()))
            return False
        copies = [
            (c.group_id, c.src_block_id, c.dst_block_id, c.num_tokens)
            for c in out.copies
        ]
        self.copies += len(copies)
        tables = self.mgr.get_block_ids(r.request_id)
        self.note(
            "allocated", r.request_id, n, hit, out.get_block_ids(), copies, tables
        )
        if self.rng.random() < 0.05 and r.request_id in self.running:
            # Preempted before the step's forward pass ran.
            self.running.pop(r.request_id)
            self.free(r, forward_ran=False)
            r.num_computed_tokens = 0
            self.waiting.append(r)
            return False
        r.num_computed_tokens += hit + n
        return True

    def admit(self, r: Request) -> None:
        blocks, hit = self.mgr.get_computed_blocks(r)
        self.hits += hit > 0
        self.note("hit", r.request_id, hit, blocks.get_block_ids())
        n = min(self.rng.choice(CHUNKS), r.num_tokens - hit)
        whole = self.rng.random() < 0.3
        if self.allocate(r, n, hit, blocks, full_sequence_must_fit=whole):
            self.running[r.request_id] = r
        elif r.request_id not in self.running and r not in self.waiting:
            self.waiting.append(r)

    def new(self) -> None:
        rng = self.rng
        if self.history and rng.random() < 0.4:
            # A follow-up turn: an earlier request's tokens, cut, then more.
            tokens = rng.choice(self.history)
            head = tokens[: rng.randrange(1, len(tokens) + 1)]
        else:
            prefix = rng.choice(self.prefixes)
            head = prefix[: rng.randrange(len(prefix) + 1)]
        tail = [rng.randrange(3) for _ in range(rng.randrange(1, 20))]
        self.count += 1
        tokens = (head + tail)[: MAX_TOKENS - 8]
        hash_size = self.plan.hash_block_size
        self.admit(Request(f"r{self.count}", tokens, hash_block_size=hash_size))

    def pick(self, prefill: bool) -> Request | None:
        cands = [
            r
            for r in self.running.values()
            if (r.num_computed_tokens < r.num_tokens) == prefill
            and (prefill or r.num_tokens < MAX_TOKENS)
        ]
        return self.rng.choice(cands) if cands else None

    def free(self, r: Request, *, forward_ran: bool = True) -> None:
        if self.rng.random() < 0.2:
            # Freed while a step in flight still reads its blocks.
            held = self.mgr.pop_blocks_for_free(r, forward_ran=forward_ran)
            self.note("popped", r.request_id, forward_ran, [b.block_id for b in held])
            self.in_flight.append(held)
        else:
            self.mgr.free(r, forward_ran=forward_ran)
        self.frees += 1
        self.note("freed", r.request_id, forward_ran)

    def complete(self) -> None:
        """The step in flight completes: freed requests' blocks go back."""
        for held in self.in_flight:
            self.mgr.release_blocks(held)
            self.note("released", [b.block_id for b in held])
        self.in_flight.clear()

    def step(self) -> None:
        """One scheduler decision, drawn from the trace's seed (the step
        in flight before it completed)."""
        self.complete()
        rng = self.rng
        op = rng.choices(
            ("new", "readmit", "prefill", "decode", "preempt", "finish"),
            (4, 2, 3, 6, 1, 2),
        )[0]
        live = len(self.running) + len(self.waiting)
        if op == "new" and live < MAX_LIVE:
            self.new()
        elif op == "readmit" and self.waiting:
            self.admit(self.waiting.pop(rng.randrange(len(self.waiting))))
        elif op == "prefill" and (r := self.pick(prefill=True)) is not None:
            left = r.num_tokens - r.num_computed_tokens
            self.allocate(r, min(rng.choice(CHUNKS), left))
        elif op == "decode" and (r := self.pick(prefill=False)) is not None:
            r.append_output_token_ids(rng.randrange(3))
            ahead = rng.choice((0, 0, 0, 2, 5)) if self.lookahead else 0
            done = r.num_computed_tokens - 1
            if rng.random() < 0.5 or not done:
                self.allocate(r, 1, num_lookahead_tokens=ahead)
            elif (
                self.allocate(r, 1, num_in_flight_tokens=1)
                and r.request_id in self.running
            ):
                # The step in flight (the last computed token) completes.
                self.mgr.remove_skipped_blocks(r, done + 1)
                self.note(
                    "completed", r.request_id, self.mgr.get_block_ids(r.request_id)
                )
        elif op in ("preempt", "finish") and self.running:
            r = self.running.pop(rng.choice(sorted(self.running)))
            self.free(r)
            if op == "preempt":
                r.num_computed_tokens = 0
                self.waiting.append(r)
            else:
                self.history.append(list(r.all_token_ids))

    def run(self, steps: int) -> Trace:
        """``steps`` decisions, each followed by every live table; then
        every request freed."""
        for i in range(steps):
            try:
                self.step()
            except Exception as exc:
                exc.add_note(f"trace step {i}; the last calls: {self.log[-3:]}")
                raise
            tables = [
                (rid, self.mgr.get_block_ids(rid)) for rid in sorted(self.running)
            ]
            self.note("tables", tables)
        for rid in sorted(self.running):
            self.free(self.running.pop(rid))
        self.complete()
        drained = self.mgr.get_num_free_blocks() == self.plan.num_blocks - 1
        self.note("drained", drained)
        return self


def differ(
    plan: Plan, seeds: Sequence[int], steps: int, **wrapped: Any
) -> tuple[Counts, Counter[str]]:
    """Run each seed's trace through the built-in kinds and through their
    pass-through twins (``wrapped``: :func:`third_party`'s keywords): the
    logs must agree call for call.  What the built-in runs did, summed, and
    the pass-through managers' calls by step."""
    registry, calls = third_party(**wrapped)
    hits = refusals = frees = copies = 0
    for seed in seeds:
        built_in = Trace(plan, BUILT_IN, seed).run(steps)
        third = Trace(plan, registry, seed).run(steps)
        pairs = zip(built_in.log, third.log, strict=False)
        for i, (ours, theirs) in enumerate(pairs):
            assert theirs == ours, f"seed {seed}, call {i}"
        assert len(third.log) == len(built_in.log), f"seed {seed}"
        assert built_in.log[-1][1], "blocks left held once every request is freed"
        hits += built_in.hits
        refusals += built_in.refusals
        frees += built_in.frees
        copies += built_in.copies
    return Counts(hits, refusals, frees, copies), calls


# -- tests ----------------------------------------------------------------------

#: The steps every plan's traces call on the pass-through managers, and
#: those plans with hits call too.
ALWAYS_CALLED = {"allocate_twins", "pop_twins", "get_num_blocks_to_allocate"}
CALLED_WITH_HITS = {"cache_twins", "add_computed_blocks", "find_longest_cache_hit"}


def test_every_step_of_a_pass_through_manager_is_its_own_code() -> None:
    """The wrappers reach every check: each step the core checks as a
    kind's is the third party's own code, for every built-in manager (the
    promise flags dropped unless declared)."""
    steps = [hook for hooks in KIND_STEPS.values() for hook in hooks]
    assert set(steps) <= set(STEPS), "a step the core checks is not wrapped"
    for promises in (False, True):
        registry, _ = third_party(promises)
        mgr = manager_for(
            [fa(4), sw(4, 8), mamba(4), mamba(4, mode="none"), mla(4), ring(4)],
            32,
            scheduler_block_size=4,
            hash_block_size=4,
            registry=registry,
        )
        managers: list[Any] = [type(m) for m in mgr.coordinator.single_type_managers]
        managers += [kind.manager_type for kind in registry.values()]
        for cls in managers:
            assert cls.__name__.startswith("PassThrough")
            assert cls not in CORE_MANAGERS
            assert all(own_code(cls, step) for step in steps), cls
            for flag in PROMISE_FLAGS:
                kept = getattr(cls.__mro__[1], flag)
                assert getattr(cls, flag) is (kept if promises else False), flag


DEFAULT_SEEDS = range(4)
STEPS_PER_TRACE = 100


def check_counts(plan: Plan, counts: Counts) -> None:
    """The traces refused, freed and (where the plan can) hit."""
    assert counts.refusals > 0, counts
    assert counts.frees > 0, counts
    assert (counts.hits > 0) == plan.hits, counts


@pytest.mark.parametrize("promises", [False, True], ids=["dropped", "kept"])
@pytest.mark.parametrize("name", sorted(PLANS))
def test_a_pass_through_kind_serves_like_the_built_in_one(
    name: str, promises: bool
) -> None:
    """Same hits, tables, new blocks, refusals and free blocks, call for
    call, with the promise flags the overrides drop or kept."""
    plan = PLANS[name]
    counts, calls = differ(plan, DEFAULT_SEEDS, STEPS_PER_TRACE, promises=promises)
    check_counts(plan, counts)
    assert set(calls) >= ALWAYS_CALLED, calls
    if plan.hits:
        assert set(calls) >= CALLED_WITH_HITS, calls
    if plan.copies:
        assert counts.copies > 0, counts


def kinds_of(plan: Plan) -> list[str]:
    """The names of the kinds a plan's groups are of."""
    return sorted({type(spec).kind for spec in plan.specs})


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        (name, kind)
        for name in sorted(PLANS)
        for kind in kinds_of(PLANS[name])
        if len(kinds_of(PLANS[name])) > 1
    ],
)
def test_one_pass_through_kind_beside_built_in_ones(name: str, kind: str) -> None:
    """A single third party's kind beside the built-in kinds (its groups a
    class of their own) serves like the built-in kind it wraps."""
    plan = PLANS[name]
    counts, calls = differ(plan, DEFAULT_SEEDS[:2], STEPS_PER_TRACE, only=kind)
    assert counts.frees > 0, counts
    assert {"allocate_twins", "pop_twins"} <= set(calls), calls


#: A plan holding each built-in kind beside others.
KIND_PLANS = {
    "full_attention": "full_sw_mamba_align",
    "mla": "mla_swmla_ring_hot",
    "sliding_window": "full_sw_mamba_align",
    "sliding_window_mla": "mla_swmla_ring_hot",
    "mamba": "full_sw_mamba_align",
    "circular_buffer": "full_ring_hot",
    "hisparse_hot": "full_ring_hot",
    "chunked_local_attention": "full_chunked",
    "cross_attention": "full_cross",
}


@pytest.mark.parametrize("step", ONE_GROUP_STEPS)
@pytest.mark.parametrize("kind", sorted(KIND_PLANS))
def test_a_pass_through_of_a_one_group_step_too(kind: str, step: str) -> None:
    """A pass-through manager that also overrides a one-group step (and
    its twin step, calling ``super()`` in both) serves like the built-in
    kind: where an ancestor overrides the one-group step too (a window's
    keying, a state kind's pop), the ancestor's step reaches the base
    class's twin step, not the subclass's again."""
    plan = PLANS[KIND_PLANS[kind]]
    counts, _ = differ(
        plan, DEFAULT_SEEDS[:2], STEPS_PER_TRACE, only=kind, also=(step,)
    )
    check_counts(plan, counts)


@pytest.mark.slow
@pytest.mark.parametrize("promises", [False, True], ids=["dropped", "kept"])
@pytest.mark.parametrize("name", sorted(PLANS))
def test_a_pass_through_kind_serves_like_the_built_in_one_many_seeds(
    name: str, promises: bool
) -> None:
    """The same over many more and longer traces."""
    plan = PLANS[name]
    counts, _ = differ(plan, range(100, 130), 300, promises=promises)
    check_counts(plan, counts)
