"""Output-end states kept by the evidence of the traffic.

A state group keeps the state where a request's output ended for a later
prompt that extends it (a chat's next turn).  When the prompts it has seen
pass through fewer than one in ``REUSE_ODDS`` of the recent output ends, a
freed request's output-end state joins the spare blocks (evicted before
every cached prefix) instead of the back of the eviction order.
"""

from __future__ import annotations

from coordinator_setup import state_hybrid

from kvcore.coordinator import KVCacheManager, Request
from kvcore.coordinator.output_ends import MIN_EVIDENCE, REUSE_ODDS, OutputEnds

BS = 16


def _serve(mgr: KVCacheManager, req: Request, outputs: int) -> None:
    """Admit ``req`` (with its prefix hit), compute its prompt, decode
    ``outputs`` tokens one step each, and free it."""
    blocks, hit = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
    req.num_computed_tokens = req.num_tokens
    for i in range(outputs):
        req.append_output_token_ids(7000 + i)
        assert mgr.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
    mgr.free(req)


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
    least one in REUSE_ODDS came back; counts halve once they reach twice
    the memory, so old traffic weighs less."""
    ends = OutputEnds(memory=MIN_EVIDENCE)
    assert ends.memory == MIN_EVIDENCE
    for key in range(MIN_EVIDENCE - 1):
        ends.note_output_end(key)
        assert ends.worth_keeping()
    ends.note_output_end(MIN_EVIDENCE - 1)
    assert not ends.worth_keeping()
    # Only the newest MIN_EVIDENCE keys are remembered: the prompt passes
    # through 4 of them and one never counted.
    needed = -(-ends.counted // REUSE_ODDS)
    assert needed == 4
    ends.note_prompt([1, 2, 3, 5, 10**9], _NoJournal())
    assert ends.returned == 4
    assert ends.worth_keeping()
    ends.note_prompt([1, 2], _NoJournal())  # each counted once
    assert ends.returned == 4
    for key in range(1000, 1000 + MIN_EVIDENCE):
        ends.note_output_end(key)
    assert (ends.counted, ends.returned) == (MIN_EVIDENCE, 2)
    assert not ends.worth_keeping()


class _NoJournal:
    """A pool with no transaction open: nothing to record."""

    def record(self, *args: object) -> None:
        pass
