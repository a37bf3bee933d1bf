"""The recurrent-state contract: where an engine must write states.

``KVCacheManager.state_write_positions`` tells the engine, per state group,
the token counts a step must leave a state at.  An engine whose kernels
write a state only at the end of each step (vLLM's align mode) is safe with
a policy that lists only step ends (``checkpoint_policy="steps"``): every
state a later request restores was written.  Here an engine is simulated
over a multi-turn chat trace with prefix hits, chunked prefill, decode and
eviction pressure; it records which prefix each state block holds and
checks every restored state against it.
"""

from __future__ import annotations

import random
from typing import Any

import coordinator_setup as setup
import pytest

from kvcore.coordinator import KVCacheManager, Request
from kvcore.errors import InvalidRequestError, KvcoreError, UnknownRequestError

BS = 16
STATE = 1  # the Mamba group of state_hybrid


def _trace(seed: int) -> list[tuple[list[int], list[int]]]:
    """Prompts and the outputs the engine samples: three-turn chats over a
    few shared system prompts, each turn's prompt the last turn's prompt
    and output and a new user message."""
    rng = random.Random(seed)
    systems = [
        [rng.randrange(1000) for _ in range(rng.randrange(20, 120))] for _ in range(3)
    ]
    out: list[tuple[list[int], list[int]]] = []
    for _ in range(16):
        prompt = list(rng.choice(systems))
        for _ in range(3):
            prompt = prompt + [rng.randrange(1000) for _ in range(rng.randrange(5, 60))]
            output = [rng.randrange(1000) for _ in range(rng.randrange(1, 24))]
            out.append((prompt, output))
            prompt = prompt + output
    return out


class AlignEngine:
    """A scheduler loop over kvcore whose kernels write each state group's
    state at the step's end only, or (``honours_contract``) at every
    position ``state_write_positions`` lists."""

    def __init__(self, mgr: KVCacheManager, *, honours_contract: bool) -> None:
        self.mgr = mgr
        self.honours = honours_contract
        #: block id -> the token prefix its state was computed over.
        self.written: dict[int, tuple[int, ...]] = {}
        self.restored = 0
        self.never_written = 0
        self.listed_inside_steps = 0

    def _step(
        self, req: Request, start: int, n: int, hit: int = 0, blocks: Any = None
    ) -> bool:
        if self.mgr.allocate_slots(req, n, hit, blocks) is None:
            return False
        end = start + n
        positions = self.mgr.state_write_positions(req, start, end)[STATE]
        assert positions[-1] == end
        self.listed_inside_steps += len(positions) - 1
        table = self.mgr.get_blocks(req.request_id).blocks[STATE]
        tokens = tuple(req.all_token_ids)
        for t in positions if self.honours else (end,):
            block = table[-(-t // BS) - 1]
            assert not block.is_null
            self.written[block.block_id] = tokens[:t]
        return True

    def _admit(self, req: Request, n_chunk: int) -> bool:
        blocks, hit = self.mgr.get_computed_blocks(req)
        n = min(req.num_tokens - hit, n_chunk)
        if not self._step(req, hit, n, hit, blocks):
            return False
        if hit:
            self.restored += 1
            state = blocks.blocks[STATE][-1]
            if self.written.get(state.block_id) != tuple(req.all_token_ids[:hit]):
                self.never_written += 1
        req.num_computed_tokens = hit + n
        return True

    def run(self, trace: list[tuple[list[int], list[int]]], chunks: list[int]) -> None:
        rng = random.Random(1)
        waiting = [
            (Request(f"r{i}", prompt, hash_block_size=BS), output)
            for i, (prompt, output) in enumerate(trace)
        ]
        running: list[tuple[Request, list[int]]] = []
        while waiting or running:
            if (
                waiting
                and len(running) < 3
                and self._admit(waiting[0][0], rng.choice(chunks))
            ):
                running.append(waiting.pop(0))
            for entry in list(running):
                req, output = entry
                if req.num_computed_tokens == req.num_tokens:
                    # The step computed the last token: sample the next.
                    req.append_output_token_ids(output[req.num_output_tokens])
                    if req.num_output_tokens == len(output):
                        self.mgr.free(req)
                        running.remove(entry)
                        continue
                start = req.num_computed_tokens
                n = min(req.num_tokens - start, rng.choice(chunks))
                if self._step(req, start, n):
                    req.num_computed_tokens += n


@pytest.mark.parametrize("honours", [False, True], ids=["step-ends", "contract"])
def test_steps_policy_restores_only_states_written_at_step_ends(
    honours: bool,
) -> None:
    """``steps`` lists only step ends, so an align-mode engine (which writes
    nothing else) and a contract-honouring one agree: over the trace every
    restored state is one the engine wrote, for that very prefix."""
    engine = AlignEngine(
        setup.state_hybrid(90, BS, policy="steps"), honours_contract=honours
    )
    engine.run(_trace(3), chunks=[16, 32, 48, 64, 37])
    assert engine.listed_inside_steps == 0
    # Enough restores for the check to mean something (superseded step
    # ends are spare blocks, the first keyed blocks a tight pool reuses).
    assert engine.restored >= 30
    assert engine.never_written == 0


def test_turns_policy_lists_the_states_it_keeps_inside_steps() -> None:
    """``turns`` keeps prompt ends inside steps and lists them: an engine
    writing every listed position restores only written states, one that
    writes step ends only would restore states it never wrote."""
    honouring = AlignEngine(setup.state_hybrid(90, BS), honours_contract=True)
    honouring.run(_trace(3), chunks=[16, 32, 48, 64, 37])
    assert honouring.listed_inside_steps > 0
    assert honouring.restored >= 20
    assert honouring.never_written == 0
    align_only = AlignEngine(setup.state_hybrid(90, BS), honours_contract=False)
    align_only.run(_trace(3), chunks=[16, 32, 48, 64, 37])
    assert align_only.never_written >= 10


def test_state_write_positions_are_checked() -> None:
    mgr = setup.state_hybrid(20, BS, policy="steps")
    req = Request("a", list(range(40)), hash_block_size=BS)
    with pytest.raises(UnknownRequestError, match="holds no blocks"):
        mgr.state_write_positions(req, 0, 40)
    assert mgr.allocate_slots(req, 40) is not None
    assert mgr.state_write_positions(req, 0, 40) == {STATE: (40,)}
    assert mgr.state_write_positions("a", 40, 40) == {STATE: ()}
    with pytest.raises(InvalidRequestError, match="below num_computed_tokens"):
        mgr.state_write_positions(req, 30, 20)
    with pytest.raises(InvalidRequestError, match="past the 48 its group 1"):
        mgr.state_write_positions(req, 40, 60)
    # Attention-only plans have no state group.
    fa_only = setup.manager_for(
        [setup.fa(BS)], 10, scheduler_block_size=BS, hash_block_size=BS
    )
    other = Request("b", list(range(20)), hash_block_size=BS)
    assert fa_only.allocate_slots(other, 20) is not None
    assert fa_only.state_write_positions(other, 0, 20) == {}


def test_per_group_hits_show_a_deeper_state_than_attention() -> None:
    """Attention tail evicted, a deeper state kept: the common hit is the
    shallower, the per-group lookup reports each group's own."""
    mgr = setup.state_hybrid(40, BS, policy="steps")
    seed = Request("seed", list(range(64)), hash_block_size=BS)
    state_ids = []
    for i in range(4):
        # One block a step: each step's end state is kept.
        assert mgr.allocate_slots(seed, BS) is not None
        seed.num_computed_tokens += BS
        fa_ids, states = mgr.get_block_ids("seed")
        state_ids.append(states[i])
    mgr.free(seed)
    assert mgr.evict_blocks([fa_ids[2], fa_ids[3], state_ids[1], state_ids[2]]) == 4
    replay = Request("replay", list(range(80)), hash_block_size=BS)
    blocks, lengths = mgr.find_longest_cache_hit_per_group(replay)
    assert lengths == (32, 64)
    assert blocks.blocks[STATE][-1].block_id == state_ids[3]
    _, common = mgr.get_computed_blocks(replay)
    assert common == 16
    assert mgr.find_longest_cache_hit_per_group(replay, 40)[1] == (32, 16)


def test_cache_blocks_again_for_computed_tokens_changes_nothing(
    zoo_registry: Any,
) -> None:
    """An engine that also calls cache_blocks for the tokens a step already
    keyed (Jamba: interval checkpoints every 1,024 tokens, chunked prefill)
    keeps the same states, and the request decodes on."""
    import kvcore
    from kvcore.serialize import load_model_file
    from kvcore.tools import zoo

    model = load_model_file(zoo.path("jamba-1-5-mini"), zoo_registry)
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout="BLHNC", enable_prefix_caching=True, target_context=9000
        ),
        max_model_len=9000,
        max_num_batched_tokens=2048,
    )
    plan = kvcore.plan_kv_cache(config, model.layers, 2 * 2**30, registry=zoo_registry)
    rng = random.Random(0)
    prompt = [rng.randrange(1, 50_000) for _ in range(8999)]
    managers = [KVCacheManager.from_plan(plan, registry=zoo_registry) for _ in "ab"]
    requests = [
        Request("r", prompt, hash_block_size=plan.hash_block_size) for _ in "ab"
    ]
    for mgr, again, req in zip(managers, (False, True), requests, strict=True):
        done = 0
        while done < len(prompt):
            step = min(2048, len(prompt) - done)
            assert mgr.allocate_slots(req, step) is not None
            done += step
            req.num_computed_tokens = done
            if again:
                mgr.cache_blocks(req, done)
                mgr.cache_blocks(req, done)
        req.append_output_token_ids(7)
        assert mgr.allocate_slots(req, 1) is not None
    plain, repeated = managers
    assert repeated.get_block_ids("r") == plain.get_block_ids("r")
    assert repeated.block_pool.num_cached_blocks == plain.block_pool.num_cached_blocks


def _a_branching_from_x(zoo_registry: Any) -> tuple[KVCacheManager, Request]:
    """Jamba, with X (100 tokens) computed and freed, and A admitted for its
    100-token prompt, whose first 48 tokens are X's: A keeps the state
    after those 48, written only by this step's forward."""
    mgr = setup.zoo_manager("jamba-1-5-mini", zoo_registry, 150)
    shared = list(range(1, 49))
    x = Request("X", [*shared, *range(1000, 1052)], hash_block_size=16)
    for n in (50, 50):
        assert mgr.allocate_slots(x, n) is not None
        x.num_computed_tokens += n
    mgr.free(x)
    a = Request("A", [*shared, *range(2000, 2052)], hash_block_size=16)
    hit, num_hit = mgr.get_computed_blocks(a)
    assert mgr.allocate_slots(a, 100 - num_hit, num_hit, hit) is not None
    a.num_computed_tokens = 100
    return mgr, a


@pytest.mark.parametrize("boundary", ["writer's next step", "new_step_starts"])
def test_no_hit_resumes_from_a_state_its_step_has_not_written(
    zoo_registry: Any, boundary: str
) -> None:
    """A admits 100 tokens and keeps the state after the 48 it shares with
    an earlier request; that state is written only by this step's forward.
    B, admitted in the same step, would resume from it before the scan
    writes it: it waits a step, then gets its whole hit."""
    # One engine step: A, then B.
    mgr, a = _a_branching_from_x(zoo_registry)
    assert 48 in mgr.state_write_positions(a, 0, 100)[0]
    b = Request("B", a.all_token_ids[:70], hash_block_size=16)
    hit_b, num_b = mgr.get_computed_blocks(b)
    assert num_b == 48
    free = mgr.get_num_free_blocks()
    assert mgr.allocate_slots(b, 70 - num_b, num_b, hit_b) is None
    assert mgr.get_num_free_blocks() == free
    # The next step: A's forward has run.
    if boundary == "new_step_starts":
        mgr.new_step_starts()
    else:
        a.append_output_token_ids(5)
        assert mgr.allocate_slots(a, 1) is not None
    hit_b, num_b = mgr.get_computed_blocks(b)
    assert num_b == 48
    assert mgr.allocate_slots(b, 70 - num_b, num_b, hit_b) is not None


@pytest.mark.parametrize("chunks", [[4, 4], [5, 3], [4, 1, 3]])
def test_a_state_written_in_a_block_the_writer_holds_waits_too(
    chunks: list[int],
) -> None:
    """A computes its first 8-token block in chunks, one engine step each:
    its last chunk's step writes the state at 8 into the block A took at
    its first chunk, and keys it there.  B, admitted in that step, would
    resume from the state before the scan writes it: it waits a step."""
    mgr = setup.state_hybrid(40, 8)
    a = Request("A", list(range(1, 13)), hash_block_size=8)
    for n in chunks:
        mgr.new_step_starts()
        assert mgr.allocate_slots(a, n) is not None
        a.num_computed_tokens += n
    b = Request("B", [*range(1, 9), 99, 98, 97], hash_block_size=8)
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8
    assert hit.get_block_ids()[1] == mgr.get_block_ids("A")[1]
    free = mgr.get_num_free_blocks()
    assert mgr.allocate_slots(b, 3, num_hit, hit) is None
    assert mgr.get_num_free_blocks() == free
    mgr.new_step_starts()  # A's forward has run
    hit, num_hit = mgr.get_computed_blocks(b)
    assert mgr.allocate_slots(b, 3, num_hit, hit) is not None


@pytest.mark.parametrize("policy", ["turns", "steps"])
def test_a_decode_step_ending_a_block_keeps_its_state_from_hits(policy: str) -> None:
    """A decodes token 8 of 4-token blocks: its step keys the state at 8 in
    the block it took for token 7.  B, sharing those 8 tokens, waits for
    the forward."""
    mgr = setup.state_hybrid(40, 4, policy=policy)
    a = Request("A", list(range(1, 7)), hash_block_size=4)
    for n, token in ((6, 50), (1, 51)):
        assert mgr.allocate_slots(a, n) is not None
        a.num_computed_tokens += n
        a.append_output_token_ids(token)
        mgr.new_step_starts()
    assert mgr.allocate_slots(a, 1) is not None
    assert 8 in mgr.state_write_positions("A", 7, 8)[1]
    b = Request("B", [1, 2, 3, 4, 5, 6, 50, 51, 9, 9], hash_block_size=4)
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8
    assert mgr.allocate_slots(b, 10 - num_hit, num_hit, hit) is None
    a.num_computed_tokens += 1
    a.append_output_token_ids(52)
    assert mgr.allocate_slots(a, 1) is not None  # A's next call: written
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8
    assert mgr.allocate_slots(b, 10 - num_hit, num_hit, hit) is not None


def test_a_failed_step_takes_back_the_state_block_it_put_in_place() -> None:
    """A's only state was released (its computed tokens moved past what its
    step was given, then the release ran there), so its next step puts a
    fresh state block back at that position before the step fails for
    want of blocks: the failed step leaves A's tables and the pool as they
    were, and no block is listed by A while another request takes it."""
    mgr = setup.manager_for(
        [setup.fa(4), setup.mamba(4, policy="steps")],
        19,
        scheduler_block_size=4,
        hash_block_size=4,
        max_model_len=128,
    )
    a = Request("A", list(range(1, 70)), hash_block_size=4)
    assert mgr.allocate_slots(a, 4) is not None
    a.num_computed_tokens = 58
    mgr.remove_skipped_blocks(a, 14)
    pool = mgr.block_pool
    before = (mgr.get_block_ids("A"), list(pool.ref_cnt))
    with pytest.raises(KvcoreError):
        mgr.allocate_slots(a, 9)
    assert (mgr.get_block_ids("A"), list(pool.ref_cnt)) == before
    assert mgr.get_block_ids("A")[1] == [pool.null_block]


def test_a_refused_call_leaves_the_writers_state_unwritten(zoo_registry: Any) -> None:
    """A call that raises (another request under a live id) is no step of
    the writer: the state its step took stays unwritten."""
    mgr, a = _a_branching_from_x(zoo_registry)
    with pytest.raises(InvalidRequestError):
        mgr.allocate_slots(
            Request("A", list(range(3000, 3010)), hash_block_size=16), 10
        )
    b = Request("B", a.all_token_ids[:70], hash_block_size=16)
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 48
    assert mgr.allocate_slots(b, 70 - num_hit, num_hit, hit) is None


def test_a_state_taken_again_stays_noted_for_its_new_writer(zoo_registry: Any) -> None:
    """A block released while noted and taken by another step is that
    step's until its writer's next call, not the first writer's."""
    mgr = setup.zoo_manager("jamba-1-5-mini", zoo_registry, 150)
    unwritten = mgr.coordinator.unwritten
    group = unwritten.managers[0].kv_cache_group_id
    block = mgr.block_pool.blocks[7]
    new = [[] for _ in range(mgr.num_kv_cache_groups)]
    new[group] = [block]
    unwritten.took("A", new)
    unwritten.took("D", new)
    unwritten.written("A")
    hit = [[] for _ in range(mgr.num_kv_cache_groups)]
    hit[group] = [block]
    assert unwritten.hit_ends_unwritten(hit)
    unwritten.written("D")
    assert not unwritten.hit_ends_unwritten(hit)
