"""Output-end states kept by the evidence of the traffic.

A state group keeps the state where a request's output ended for a later
prompt that extends it (a chat's next turn).  When the prompts it has seen
pass through fewer than one in ``REUSE_ODDS`` of the recent output ends, a
freed request's output-end state joins the spare blocks (evicted before
every cached prefix) instead of the back of the eviction order.
"""

from __future__ import annotations

import copy
import random

from coordinator_setup import fa, mamba, manager_for, state_hybrid, state_manager

from kvcore.coordinator import KVCacheManager, Request
from kvcore.coordinator.output_ends import MIN_EVIDENCE, REUSE_ODDS, OutputEnds

BS = 16


def _run(mgr: KVCacheManager, req: Request, outputs: int) -> None:
    """Admit ``req`` (with its prefix hit), compute its prompt and decode
    ``outputs`` tokens one step each; it keeps running."""
    blocks, hit = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
    req.num_computed_tokens = req.num_tokens
    for i in range(outputs):
        req.append_output_token_ids(7000 + i)
        assert mgr.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1


def _serve(mgr: KVCacheManager, req: Request, outputs: int) -> None:
    """:func:`_run`, then free it."""
    _run(mgr, req, outputs)
    mgr.free(req)


def _fresh_traffic(mgr: KVCacheManager) -> None:
    """MIN_EVIDENCE requests of fresh 40-token prompts, 20 outputs each:
    no prompt passes through an earlier output end."""
    for i in range(MIN_EVIDENCE):
        tokens = [100_000 * (i + 1) + t for t in range(40)]
        _serve(mgr, Request(f"r{i}", tokens, hash_block_size=BS), 20)


def _output_end_block(mgr: KVCacheManager, req: Request) -> int:
    """The cached state block at ``req``'s last 16-token boundary."""
    end = len(req.all_token_ids) // BS
    block = mgr.block_pool.lookup(req.block_hashes[end - 1], 1)
    assert block is not None
    return block


def test_output_ends_leave_for_the_spare_blocks_once_prompts_never_extend_them() -> (
    None
):
    """64 requests of fresh 40-token prompts, 20 output tokens each: no
    prompt passes through an earlier output end.  Until 64 were counted
    each output-end state (at 48 tokens) goes to the back of the eviction
    order; the 65th goes to the spare blocks, still cached."""
    mgr = state_hybrid(4000, BS)
    spare = mgr.block_pool.free_queue.spare_blocks
    for i in range(MIN_EVIDENCE + 1):
        req = Request(
            f"r{i}", [100_000 * (i + 1) + t for t in range(40)], hash_block_size=BS
        )
        _serve(mgr, req, 20)
        block = _output_end_block(mgr, req)
        if i < MIN_EVIDENCE:
            assert block not in spare()
            assert mgr.block_pool.eviction_order()[-1] == block
        else:
            assert block in spare()


def test_output_ends_stay_while_prompts_carry_them_back() -> None:
    """A chat: each turn's prompt is the last turn's prompt and output plus
    8 new tokens, so every output end comes back (and is hit).  After 65
    turns, the last output-end state still goes to the back."""
    mgr = state_hybrid(4000, BS)
    tokens = list(range(1, 41))
    for i in range(MIN_EVIDENCE + 1):
        req = Request(f"t{i}", tokens, hash_block_size=BS)
        _serve(mgr, req, 20)
        tokens = [*req.all_token_ids, *range(50_000 + 8 * i, 50_008 + 8 * i)]
    block = _output_end_block(mgr, req)
    assert block not in mgr.block_pool.free_queue.spare_blocks()
    assert mgr.block_pool.eviction_order()[-1] == block


def test_the_evidence_follows_the_traffic() -> None:
    """Output ends are kept until MIN_EVIDENCE were counted; then while at
    least one in REUSE_ODDS came back in a prompt (each counted once);
    counts halve at the memory, and the keys counted before the previous
    turn (every half memory) leave."""
    ends = OutputEnds(memory=MIN_EVIDENCE)
    pool = _NoJournal()
    assert ends.memory == 2 * MIN_EVIDENCE
    for key in range(MIN_EVIDENCE):
        assert ends.keep_output_end(key, pool)
    assert not ends.worth_keeping()
    # 64 counted: 4 returns are one in 16.
    assert 4 * REUSE_ODDS == MIN_EVIDENCE
    assert sorted(ends.note_prompt([1, 2, 3, 5, 10**9])) == [1, 2, 3, 5]
    assert ends.returned == 4
    assert ends.worth_keeping()
    assert ends.note_prompt([1, 2]) == []  # each counted once
    ends.unnote_prompt([5])
    assert (ends.returned, ends.keys[5]) == (3, False)
    for key in range(1000, 1000 + MIN_EVIDENCE):
        ends.keep_output_end(key, pool)
    # The 128th output end halves the counts and drops keys 0-63.
    assert (ends.counted, ends.returned) == (MIN_EVIDENCE, 1)
    assert min(ends.keys) == 1000
    assert not ends.worth_keeping()


def test_a_rolled_back_free_leaves_the_evidence_as_it_was() -> None:
    """The undo records of keep_output_end put every key, flag and count
    back, the halving included."""
    ends = OutputEnds(memory=MIN_EVIDENCE)
    pool = _Journal()
    for key in range(2 * MIN_EVIDENCE - 1):
        ends.keep_output_end(key, pool)
    ends.note_prompt([3])
    before = (dict(ends.keys), ends.counted, ends.returned)
    pool.undo = []
    ends.keep_output_end(3, pool)  # halves: 128 counted
    ends.keep_output_end(10**6, pool)
    # Key 3, counted again, stays in its generation (0-63), which leaves.
    assert (ends.counted, ends.returned, len(ends.keys)) == (65, 0, 64)
    assert min(ends.keys) == 64
    for undo, args in reversed(pool.undo):
        undo(*args)
    assert (dict(ends.keys), ends.counted, ends.returned) == before
    assert list(ends.keys) == list(before[0])


class _NoJournal:
    """A pool with no transaction open: nothing to record."""

    def record(self, *args: object) -> None:
        pass


class _Journal:
    """A pool with a transaction open: the undo records, in order."""

    def __init__(self) -> None:
        self.undo: list[tuple[object, tuple[object, ...]]] = []

    def record(self, undo: object, *args: object) -> None:
        self.undo.append((undo, args))


def test_pop_blocks_for_free_hands_back_the_output_end_state_still_held() -> None:
    """Once the evidence spares output ends, an engine that pops a request's
    blocks to free them after its in-flight step still gets the output-end
    state among them, held: nothing else may be handed it meanwhile."""
    mgr = state_hybrid(4000, BS)
    _fresh_traffic(mgr)
    req = Request("x", [9_000_000 + t for t in range(40)], hash_block_size=BS)
    _run(mgr, req, 24)
    state = mgr.get_blocks("x").ids[1][-1]
    popped = mgr.pop_blocks_for_free(req)
    assert state in [block.block_id for block in popped]
    assert mgr.block_pool.ref_cnt[state] == 1
    assert state not in mgr.block_pool.free_queue.spare_blocks()


def test_a_released_list_spares_the_output_end_state_as_free_does() -> None:
    """Released once its step completes, the popped output-end state joins
    the spare blocks, as a free at that time puts it, not the back."""
    mgr = state_hybrid(400, BS)
    _fresh_traffic(mgr)
    req = Request("x", [9_000_000 + t for t in range(40)], hash_block_size=BS)
    _run(mgr, req, 24)
    state = mgr.get_blocks("x").ids[1][-1]
    popped, popped_req = copy.deepcopy((mgr, req))
    popped.release_blocks(popped.pop_blocks_for_free(popped_req))
    mgr.free(req)
    assert state in popped.block_pool.free_queue.spare_blocks()
    assert popped.block_pool.eviction_order() == mgr.block_pool.eviction_order()


def test_a_refused_admission_leaves_the_evidence_as_it_was() -> None:
    """B's prompt passes through A's output end, but B does not fit: the
    count it made at admission is undone."""
    mgr = state_hybrid(12, BS)
    a = Request("a", list(range(1, 41)), hash_block_size=BS)
    _serve(mgr, a, 20)
    ends = state_manager(mgr).output_ends
    assert (ends.counted, ends.returned) == (1, 0)
    b = Request("b", [*a.all_token_ids, *range(900, 1100)], hash_block_size=BS)
    blocks, hit = mgr.get_computed_blocks(b)
    assert mgr.allocate_slots(b, b.num_tokens - hit, hit, blocks) is None
    assert (ends.counted, ends.returned) == (1, 0)
    assert list(ends.keys.values()) == [False]


def _decoding(mgr: KVCacheManager, rid: str) -> int:
    """A fresh 40-token prompt decoding 10 tokens, still running: the state
    block its step left at 48 tokens, which it has released since."""
    req = Request(rid, [8_000_000 + t for t in range(40)], hash_block_size=BS)
    _run(mgr, req, 10)
    return _output_end_block(
        mgr, Request("probe", req.all_token_ids[:48], hash_block_size=BS)
    )


def test_a_running_requests_step_end_is_held_back_only_while_outputs_return() -> None:
    """A running request's step end is the output end it may leave: held
    back with no evidence yet, and released to the spare blocks once 64
    output ends were counted and none came back in a prompt."""
    fresh = state_hybrid(4000, BS)
    block = _decoding(fresh, "x")
    assert block in fresh.block_pool.free_queue.held_blocks()
    mgr = state_hybrid(4000, BS)
    _fresh_traffic(mgr)
    assert not state_manager(mgr).keeps_output_ends()
    block = _decoding(mgr, "x")
    assert block in mgr.block_pool.free_queue.spare_blocks()
    assert block not in mgr.block_pool.free_queue.held_blocks()


def test_the_evidence_matches_a_model_of_its_generations() -> None:
    """Over many turns, with keys counted again, prompts noted and unnoted,
    and rolled-back frees: the counts, the keys remembered and their flags
    are those of the rule. An output end counted for the i-th time overall
    (never halved) belongs to generation (i - 1) // (memory / 2), unless
    its key was remembered then (a key counted again stays where it was);
    the keys of the current and the previous generation are remembered;
    the counts halve at each turn from the second."""
    rng = random.Random(7)
    ends = OutputEnds(memory=MIN_EVIDENCE)
    half = ends.memory // 2
    total = counted = returned = 0
    home: dict[int, int] = {}  # key -> its generation
    flag: dict[int, bool] = {}
    pool = _Journal()

    def remembered(key: int) -> bool:
        return key in home and home[key] >= total // half - 1

    for _ in range(3000):
        draw = rng.random()
        if draw < 0.6:
            key = rng.randrange(400)
            pool.undo = []
            keep = ends.keep_output_end(key, pool)
            assert keep == (counted < MIN_EVIDENCE or returned * REUSE_ODDS >= counted)
            if rng.random() < 0.1:  # the free is rolled back
                for undo, args in reversed(pool.undo):
                    undo(*args)  # type: ignore[operator]
                continue
            if not remembered(key):
                home[key] = total // half
            flag[key] = False
            total += 1
            counted += 1
            if total % half == 0 and total >= 2 * half:
                counted //= 2
                returned //= 2
        elif draw < 0.9:
            prompt = rng.sample(range(400), 20)
            found = ends.note_prompt(prompt)
            expected = [k for k in prompt if remembered(k) and not flag[k]]
            assert sorted(found) == sorted(expected)
            for key in found:
                flag[key] = True
            returned += len(found)
            if rng.random() < 0.3:  # the admission is refused
                ends.unnote_prompt(found)
                for key in found:
                    flag[key] = False
                returned -= len(found)
        kept = {k: flag[k] for k in home if remembered(k)}
        assert ends.keys == kept
        assert (ends.counted, ends.returned) == (counted, returned)
    assert total > 10 * half  # many turns


def test_twin_state_groups_share_one_evidence_counted_once_a_free() -> None:
    """Three twin Mamba groups beside full attention hold one evidence
    between them, which counts each prompt and each freed output end once:
    the counts follow a plan of one state group over the same traffic, and
    every twin spares the 65th fresh output end as that plan does."""
    one = state_hybrid(4000, BS)
    twins = manager_for(
        [fa(BS), mamba(BS), mamba(BS), mamba(BS)],
        8000,
        scheduler_block_size=BS,
        hash_block_size=BS,
    )
    shared = state_manager(twins, 1).output_ends
    assert all(state_manager(twins, g).output_ends is shared for g in (2, 3))
    spare = twins.block_pool.free_queue.spare_blocks
    tokens = list(range(1, 41))
    for i in range(MIN_EVIDENCE + 1):
        # A chat's turns first, then fresh prompts: returns, then none.
        if i < 8:
            reqs = [Request(f"t{i}", tokens, hash_block_size=BS) for _ in range(2)]
        else:
            fresh = [100_000 * (i + 1) + t for t in range(40)]
            reqs = [Request(f"r{i}", fresh, hash_block_size=BS) for _ in range(2)]
        _serve(one, reqs[0], 20)
        _serve(twins, reqs[1], 20)
        if i < 8:
            tokens = [*reqs[0].all_token_ids, *range(9000 + 8 * i, 9008 + 8 * i)]
        ends = state_manager(one).output_ends
        assert (shared.counted, shared.returned) == (ends.counted, ends.returned)
        assert shared.keys == ends.keys
    end = len(reqs[1].all_token_ids) // BS
    for gid in (1, 2, 3):
        block = twins.block_pool.lookup(reqs[1].block_hashes[end - 1], gid)
        assert block is not None
        assert (block in spare()) == (
            _output_end_block(one, reqs[0]) in one.block_pool.free_queue.spare_blocks()
        )


def test_a_free_named_by_a_token_is_counted_once_and_undone_whole() -> None:
    """Twins ask with the free's token: the first ask counts and answers,
    the others get the same answer and count nothing; rolling the free
    back forgets the token, so the free counts again when retried."""
    ends = OutputEnds(memory=MIN_EVIDENCE)
    pool = _Journal()
    for key in range(MIN_EVIDENCE):
        ends.keep_output_end(key, pool)
    assert not ends.worth_keeping()
    pool.undo = []
    assert not ends.keep_output_end("k", pool, ("r", 7))
    assert ends.keep_output_end("k", pool, ("r", 7)) is False
    assert ends.counted == MIN_EVIDENCE + 1
    for undo, args in reversed(pool.undo):
        undo(*args)  # type: ignore[operator]
    assert (ends.counted, ends.last) == (MIN_EVIDENCE, None)
    assert "k" not in ends.keys
    ends.keep_output_end("k", pool, ("r", 7))
    assert ends.counted == MIN_EVIDENCE + 1
    ends.keep_output_end("k", pool, ("r", 8))  # another free of the key
    assert ends.counted == MIN_EVIDENCE + 2
