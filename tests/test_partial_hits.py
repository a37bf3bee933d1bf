"""Copy-on-write partial-block hits, worked by hand.

A group whose kind allows it (full attention, MLA) serves a hit that ends
inside its block at a multiple of ``lcm(hash block, tokens_per_state)``; the
hit's last block is copied into a fresh block (``KVCacheBlocks.copies``).
Partial keys are registered only for tokens already computed, so every
prompt below is computed and then decoded one token before it is freed.
"""

from __future__ import annotations

import pytest
import torch
from coordinator_setup import manager_for

from kvcore.coordinator import BlockCopy, KVCacheManager, Request
from kvcore.errors import InvalidRequestError, KvcoreTypeError
from kvcore_circular_buffer import CircularBufferSpec
from kvcore_full_attention import FullAttentionSpec
from kvcore_mamba import MambaSpec
from kvcore_mla import MLAAttentionSpec
from kvcore_sliding_window import SlidingWindowMLASpec


def mla(block_size: int, tps: int) -> MLAAttentionSpec:
    return MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=16,
        dtype=torch.bfloat16,
        tokens_per_state=tps,
    )


def manager(
    specs: list[object],
    *,
    sched: int,
    hash_bs: int,
    num_blocks: int = 400,
    **kw: object,
) -> KVCacheManager:
    """A manager over one group per spec, on the built-in kinds."""
    return manager_for(
        specs, num_blocks, scheduler_block_size=sched, hash_block_size=hash_bs, **kw
    )


def dsv4(**kw: object) -> KVCacheManager:
    """DeepSeek-V4 style: MLA groups of 2048-token blocks (tokens_per_state 4
    and 128), an SW-MLA group of 128-token blocks and window, hash 128, and
    two circular-buffer rings that no hit reads."""
    specs = [
        mla(2048, 4),
        mla(2048, 128),
        SlidingWindowMLASpec(
            block_size=128,
            num_kv_heads=1,
            head_size=16,
            dtype=torch.bfloat16,
            sliding_window=128,
        ),
        CircularBufferSpec(
            block_size=4, num_kv_heads=1, head_size=8, dtype=torch.bfloat16
        ),
        CircularBufferSpec(
            block_size=128, num_kv_heads=1, head_size=8, dtype=torch.bfloat16
        ),
    ]
    return manager(specs, sched=2048, hash_bs=128, **kw)


def qwen3_next(**kw: object) -> KVCacheManager:
    """Qwen3-Next style: full attention of 416-token blocks beside an
    align-mode Mamba group of 16-token blocks, hash 16."""
    specs = [
        FullAttentionSpec(
            block_size=416, num_kv_heads=1, head_size=8, dtype=torch.float16
        ),
        MambaSpec(
            block_size=16,
            shapes=((2, 4),),
            dtypes=(torch.float32,),
            mamba_cache_mode="align",
        ),
    ]
    return manager(specs, sched=416, hash_bs=16, **kw)


def run_and_free(mgr: KVCacheManager, rid: str, tokens: list[int], chunks: list[int]):
    """Compute ``tokens`` in ``chunks``, decode one token, free."""
    r = Request(rid, tokens, hash_block_size=mgr.hash_block_size)
    for n in chunks:
        assert mgr.allocate_slots(r, n) is not None
        r.num_computed_tokens += n
    r.append_output_token_ids(7)
    assert mgr.allocate_slots(r, 1) is not None
    r.num_computed_tokens += 1
    mgr.free(r)


def prompt(n: int, seed: int = 1) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 1 for i in range(n)]


class TestAlignment:
    def test_dsv4_hits_are_multiples_of_128(self):
        assert dsv4().coordinator.cache_hit_alignment == 128
        assert dsv4(enable_partial_hits=False).coordinator.cache_hit_alignment == 2048

    def test_qwen3_next_hits_are_multiples_of_16(self):
        assert qwen3_next().coordinator.cache_hit_alignment == 16
        off = qwen3_next(enable_partial_hits=False)
        assert off.coordinator.cache_hit_alignment == 416

    def test_one_group_at_the_hash_block_has_no_partial_groups(self):
        mgr = manager(
            [
                FullAttentionSpec(
                    block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16
                )
            ],
            sched=16,
            hash_bs=16,
        )
        assert mgr.coordinator.partial is None
        assert mgr.coordinator.partial_groups == ()

    def test_flag_is_a_bool(self):
        with pytest.raises(KvcoreTypeError, match="enable_partial_hits"):
            dsv4(enable_partial_hits=1)


class TestDeepSeekV4Style:
    def test_200_token_prefix_hits_128(self):
        mgr = dsv4()
        shared = prompt(200)
        run_and_free(mgr, "a", shared, [200])
        b = Request("b", [*shared, 5, 6, 7], hash_block_size=128)
        blocks, hit = mgr.get_computed_blocks(b)
        assert hit == 128
        mla4, mla128, swa, r1, r2 = blocks.blocks
        # One entry per MLA group: the copy source (block 0 holds 200 tokens).
        assert len(mla4) == len(mla128) == 1
        assert len(swa) == 1
        assert r1 == []
        assert r2 == []
        out = mgr.allocate_slots(b, len(b.all_token_ids) - hit, hit, blocks)
        assert out is not None
        table = mgr.get_block_ids("b")
        assert out.copies == (
            BlockCopy(0, mla4[0].block_id, table[0][0], 128),
            BlockCopy(1, mla128[0].block_id, table[1][0], 128),
        )
        # The sources are not attached: the request holds fresh blocks.
        assert table[0][0] != mla4[0].block_id
        assert table[2][0] == swa[0].block_id
        # The sources went back to the pool after the step.
        assert mla4[0].ref_cnt == 0
        assert mla128[0].ref_cnt == 0

    def test_2500_token_prefix_hits_2432(self):
        mgr = dsv4()
        shared = prompt(2500)
        run_and_free(mgr, "a", shared, [2500])
        b = Request("b", [*shared, 1, 2, 3], hash_block_size=128)
        blocks, hit = mgr.get_computed_blocks(b)
        assert hit == 2432 == 2048 + 384
        mla4, mla128, swa, _, _ = blocks.blocks
        assert len(mla4) == len(mla128) == 2
        assert len(swa) == 19
        assert all(b.is_null for b in swa[:18])
        out = mgr.allocate_slots(b, len(b.all_token_ids) - hit, hit, blocks)
        assert out is not None
        table = mgr.get_block_ids("b")
        assert out.copies == (
            BlockCopy(0, mla4[1].block_id, table[0][1], 384),
            BlockCopy(1, mla128[1].block_id, table[1][1], 384),
        )
        # Block 0 of each MLA group is shared, not copied.
        assert table[0][0] == mla4[0].block_id
        assert table[1][0] == mla128[0].block_id

    def test_disabled_gives_whole_block_hits(self):
        mgr = dsv4(enable_partial_hits=False)
        shared = prompt(2500)
        run_and_free(mgr, "a", shared, [2500])
        b = Request("b", [*shared, 1, 2, 3], hash_block_size=128)
        blocks, hit = mgr.get_computed_blocks(b)
        assert hit == 2048
        out = mgr.allocate_slots(b, len(b.all_token_ids) - hit, hit, blocks)
        assert out is not None
        assert out.copies == ()
        small = Request("c", [*prompt(200, seed=3)], hash_block_size=128)
        run_and_free(mgr, "c0", list(small.all_token_ids), [200])
        assert mgr.get_computed_blocks(small)[1] == 0

    def test_evicted_copy_source_is_refused_like_a_stale_hit(self):
        mgr = dsv4(num_blocks=12)
        shared = prompt(200)
        run_and_free(mgr, "a", shared, [200])
        b = Request("b", [*shared, 5], hash_block_size=128)
        blocks, hit = mgr.get_computed_blocks(b)
        assert hit == 128
        # Another allocation takes every free block, the copy sources
        # included (their partial keys are dropped).
        pool = mgr.block_pool
        pool.get_new_blocks(pool.get_num_free_blocks())
        src = blocks.ids[0][0]
        assert pool.partial_keys[src] is None
        with pytest.raises(InvalidRequestError, match="no longer holds"):
            mgr.allocate_slots(b, 1 + 200 - hit, hit, blocks)

    def test_step_that_does_not_fit_records_no_copy(self):
        mgr = dsv4(num_blocks=8)
        shared = prompt(200)
        run_and_free(mgr, "a", shared, [200])
        b = Request("b", [*shared, *prompt(6000, seed=4)], hash_block_size=128)
        blocks, hit = mgr.get_computed_blocks(b)
        assert hit == 128
        free = mgr.get_num_free_blocks()
        assert mgr.allocate_slots(b, len(b.all_token_ids) - hit, hit, blocks) is None
        assert mgr.get_num_free_blocks() == free


class TestQwen3NextStyle:
    def test_500_token_prefix_with_mamba_state_at_496_hits_496(self):
        mgr = qwen3_next()
        shared = prompt(500)
        # Chunks end at 416 and 496: Mamba states are kept there.
        run_and_free(mgr, "a", shared, [416, 80, 4])
        b = Request("b", list(shared), hash_block_size=16)
        blocks, hit = mgr.get_computed_blocks(b)
        assert hit == 496
        attn, state = blocks.blocks
        assert len(attn) == 2
        assert len(state) == 31
        out = mgr.allocate_slots(b, 500 - hit, hit, blocks)
        assert out is not None
        table = mgr.get_block_ids("b")
        assert out.copies == (BlockCopy(0, attn[1].block_id, table[0][1], 80),)
        assert table[0][0] == attn[0].block_id

    @staticmethod
    def _block_1_in_flight(
        mgr: KVCacheManager, *, other_run: bool
    ) -> tuple[Request, int]:
        """b computes 480 tokens of a 900-token prompt (its Mamba state at
        480 kept), then its step to 840 is scheduled, its forward not run:
        the step keys b's attention block 1 (tokens 416-831), written up to
        479.  With ``other_run``, a computed the whole prompt before that (a
        Mamba state at 496 kept) and its copy of block 1 lost its key.
        Returns b and its block 1."""
        shared = prompt(900)
        b = Request("b", shared, hash_block_size=16)
        assert mgr.allocate_slots(b, 16) is not None
        b.num_computed_tokens = 16
        if other_run:
            a = Request("a", shared, hash_block_size=16)
            for n in (416, 80, 404):
                assert mgr.allocate_slots(a, n) is not None
                a.num_computed_tokens += n
            a_block = mgr.get_block_ids("a")[0][1]
            mgr.free(a)
            assert mgr.evict_blocks([a_block]) == 1
        assert mgr.allocate_slots(b, 464) is not None
        b.num_computed_tokens = 480
        assert mgr.allocate_slots(b, 360) is not None
        return b, mgr.get_block_ids("b")[0][1]

    def test_a_copy_of_tokens_a_step_has_not_written_waits_for_its_forward(self):
        """The copy runs before the admitted request's forward, so it may not
        read what a step in flight writes: refused (changing nothing) until
        the writer's next call says its forward ran."""
        mgr = qwen3_next()
        b, source = self._block_1_in_flight(mgr, other_run=True)
        c = Request("c", prompt(900)[:832] + prompt(50, seed=9), hash_block_size=16)
        blocks, hit = mgr.get_computed_blocks(c)
        assert hit == 496  # a's state at 496: 80 tokens of b's block 1 to copy
        assert blocks.get_block_ids()[0][1] == source
        free = mgr.block_pool.get_num_free_blocks()
        assert mgr.allocate_slots(c, 882 - hit, hit, blocks) is None
        assert mgr.block_pool.get_num_free_blocks() == free
        assert c.request_id not in mgr.live_request_ids()
        b.num_computed_tokens = 840
        assert mgr.allocate_slots(b, 60) is not None
        blocks, hit = mgr.get_computed_blocks(c)
        out = mgr.allocate_slots(c, 882 - hit, hit, blocks)
        assert out is not None
        table = mgr.get_block_ids("c")[0]
        assert out.copies == (BlockCopy(0, source, table[1], 80),)

    def test_a_copy_of_tokens_written_before_the_step_is_not_held_up(self):
        mgr = qwen3_next()
        _, source = self._block_1_in_flight(mgr, other_run=False)
        c = Request("c", prompt(900)[:832] + prompt(50, seed=9), hash_block_size=16)
        blocks, hit = mgr.get_computed_blocks(c)
        assert hit == 480  # b's state at 480: b wrote 416-479 of block 1
        out = mgr.allocate_slots(c, 882 - hit, hit, blocks)
        assert out is not None
        table = mgr.get_block_ids("c")[0]
        assert out.copies == (BlockCopy(0, source, table[1], 64),)

    def test_disabled_hits_416(self):
        mgr = qwen3_next(enable_partial_hits=False)
        run_and_free(mgr, "a", prompt(500), [416, 80, 4])
        b = Request("b", prompt(500), hash_block_size=16)
        assert mgr.get_computed_blocks(b)[1] == 416


class TestPartialKeys:
    def test_keys_are_dropped_on_reuse_and_reset(self):
        mgr = dsv4(num_blocks=40)
        run_and_free(mgr, "a", prompt(300), [300])
        pool = mgr.block_pool
        assert pool.num_partial_keys == 4  # chunk 128 and 256, two MLA groups
        assert mgr.reset_prefix_cache()
        assert pool.num_partial_keys == 0
        assert all(keys is None for keys in pool.partial_keys)
        assert pool.partial_group == {}

    def test_only_computed_tokens_are_keyed(self):
        mgr = dsv4()
        r = Request("a", prompt(300), hash_block_size=128)
        assert mgr.allocate_slots(r, 300) is not None
        # The step's slots are not written yet: nothing to copy from.
        assert mgr.block_pool.num_partial_keys == 0
        r.num_computed_tokens = 300
        r.append_output_token_ids(3)
        assert mgr.allocate_slots(r, 1) is not None
        assert mgr.block_pool.num_partial_keys == 4

    def test_rollback_undoes_partial_keys(self):
        mgr = dsv4()
        pool = mgr.block_pool
        block = pool.get_new_blocks(1)[0]
        pool.begin()
        pool.add_partial_key(block, b"x" * 32, 0)
        assert pool.lookup_partial(b"x" * 32, [0]) == [block]
        pool.rollback()
        assert pool.partial_keys[block] is None
        assert pool.lookup_partial(b"x" * 32, [0]) is None
        pool.add_partial_key(block, b"x" * 32, 0)
        pool.free_blocks([block])
        pool.begin()
        assert pool.get_new_blocks(pool.get_num_free_blocks())
        assert pool.partial_keys[block] is None
        pool.rollback()
        assert pool.lookup_partial(b"x" * 32, [0]) == [block]


class TestCapacity:
    @pytest.mark.parametrize(("taken", "fits"), [(31, True), (32, False)])
    def test_a_free_copy_source_counts_as_taken_for_the_step(
        self, taken: int, fits: bool
    ):
        """b (203 tokens) hits 128.  It needs: a fresh block per MLA group (2)
        and their free copy sources held for the step (2), SW-MLA's free hit
        block and one new block (2), one block per ring (2): 8 of the 39 free
        blocks.  Taking 31 from the front of the queue leaves exactly 8 (the
        cached blocks sit at the back)."""
        mgr = dsv4(num_blocks=40)
        shared = prompt(200)
        run_and_free(mgr, "a", shared, [200])
        b = Request("b", [*shared, 5, 6, 7], hash_block_size=128)
        blocks, hit = mgr.get_computed_blocks(b)
        assert hit == 128
        pool = mgr.block_pool
        pool.get_new_blocks(taken)
        assert pool.get_num_free_blocks() == 39 - taken
        assert (
            mgr.can_fit_full_sequence(
                b, 203, new_computed_blocks=blocks, num_new_computed_tokens=hit
            )
            is fits
        )
        out = mgr.allocate_slots(b, 203 - hit, hit, blocks, full_sequence_must_fit=True)
        assert (out is not None) is fits
        if fits:
            assert len(out.copies) == 2
            assert pool.get_num_free_blocks() == 2  # the sources, back in the pool


def test_partial_keys_raise_no_events():
    """BlockStored / BlockRemoved are about full blocks: the MLA blocks of a
    200-token prompt hold only partial keys and appear in no event, stored
    or evicted."""
    from kvcore.coordinator import BlockRemoved, BlockStored

    mgr = dsv4(num_blocks=12, enable_kv_cache_events=True)
    run_and_free(mgr, "a", prompt(200), [200])
    pool = mgr.block_pool
    assert pool.num_partial_keys == 2
    stored = [e for e in mgr.take_events() if isinstance(e, BlockStored)]
    assert stored
    assert {e.group_id for e in stored} == {2}  # the SW-MLA block 0..127
    pool.get_new_blocks(pool.get_num_free_blocks())
    assert pool.num_partial_keys == 0
    removed = [e for e in mgr.take_events() if isinstance(e, BlockRemoved)]
    assert {e.group_id for e in removed} == {2}


def test_a_step_that_rolls_back_records_no_copy_and_changes_nothing():
    """A manager that raises in the middle of an admission with copy
    sources: the step is undone (the held sources, the fresh blocks, the
    partial keys), the caller gets the plugin's error and no copy, and the
    same hit then admits with its copies."""
    from kvcore.errors import PluginError

    mgr = dsv4()
    shared = prompt(300)
    run_and_free(mgr, "a", shared, [300])
    pool = mgr.block_pool
    b = Request("b", [*shared, 1, 2], hash_block_size=128)
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 256

    def state() -> object:
        keys = pool.partial_keys
        return (
            [
                (pool.ref_cnt[b], pool.block(b).block_hash, keys[b])
                for b in range(pool.num_blocks)
            ],
            pool.free_queue.get_all_free_blocks(),
            pool.num_partial_keys,
        )

    before = state()
    ring = mgr.coordinator.single_type_managers[3]

    def broken(*args: object) -> list[object]:
        raise RuntimeError("ring allocation failed")

    # The core calls a step through the manager's class: the ring's class
    # fails its allocation for this one step.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(ring), "allocate_twins", broken)
        with pytest.raises(PluginError, match="ring allocation failed"):
            mgr.allocate_slots(b, 302 - hit, hit, blocks)
    assert state() == before
    out = mgr.allocate_slots(b, 302 - hit, hit, blocks)
    assert out is not None
    assert [c.num_tokens for c in out.copies] == [256, 256]


@pytest.mark.parametrize(("forward_ran", "c_hit"), [(True, 2048), (False, 256)])
def test_a_dropped_admission_keys_nothing_its_copy_would_have_written(
    forward_ran: bool, c_hit: int
) -> None:
    """b is admitted on a 256-token partial hit and scheduled through a whole
    2048-token block, whose first 256 tokens a copy fills: dropped before
    its forward (no copy, no write), the block keeps no key, and a later
    request resumes from a's partial hit instead."""
    mgr = dsv4()
    shared = prompt(300)
    run_and_free(mgr, "a", shared, [300])
    tokens = [*shared, *prompt(2000, seed=3)]
    b = Request("b", tokens, hash_block_size=128)
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 256
    out = mgr.allocate_slots(b, len(tokens) - hit, hit, blocks)
    assert out is not None
    assert out.copies
    mgr.free(b, forward_ran=forward_ran)
    c = Request("c", [*tokens, 5], hash_block_size=128)
    assert mgr.get_computed_blocks(c)[1] == c_hit


def test_a_dropped_decode_step_keeps_the_partial_keys_of_written_tokens() -> None:
    """Partial keys name prefixes of computed tokens only: a decode step
    dropped before its forward leaves them, and a later request still
    copies the 256 tokens it would copy had the step run."""
    mgr = dsv4()
    tokens = prompt(300)
    a = Request("a", tokens, hash_block_size=128)
    assert mgr.allocate_slots(a, 300) is not None
    a.num_computed_tokens = 300
    a.append_output_token_ids(7)
    assert mgr.allocate_slots(a, 1) is not None
    keys = mgr.block_pool.num_partial_keys
    assert keys
    mgr.free(a, forward_ran=False)
    assert mgr.block_pool.num_partial_keys == keys
    c = Request("c", [*tokens, 9, 9], hash_block_size=128)
    assert mgr.get_computed_blocks(c)[1] == 256


class TestTruncatedHits:
    """``truncate_computed_blocks`` on a group of 64-token blocks hashed
    every 16 tokens: a cut at a 16-token boundary inside a block keeps
    that block as the copy source; a cut elsewhere or past the hit is
    refused, naming the group."""

    @staticmethod
    def hit() -> tuple[KVCacheManager, Request, object, int]:
        spec = FullAttentionSpec(
            block_size=64, num_kv_heads=1, head_size=8, dtype=torch.float16
        )
        mgr = manager([spec], sched=64, hash_bs=16)
        shared = prompt(180)
        run_and_free(mgr, "a", shared, [180])
        b = Request("b", [*shared, 5, 6, 7], hash_block_size=16)
        blocks, hit = mgr.get_computed_blocks(b)
        assert hit == 176  # two blocks, and 48 tokens of the third
        assert len(blocks.blocks[0]) == 3
        return mgr, b, blocks, hit

    def test_a_cut_inside_a_block_keeps_it_as_the_copy_source(self):
        mgr, b, blocks, _ = self.hit()
        cut = mgr.truncate_computed_blocks(blocks, 160)
        assert cut.get_block_ids() == blocks.get_block_ids()
        out = mgr.allocate_slots(b, len(b.all_token_ids) - 160, 160, cut)
        assert out is not None
        table = mgr.get_block_ids("b")
        source = blocks.get_block_ids()[0][2]
        assert out.copies == (BlockCopy(0, source, table[0][2], 32),)
        assert table[0][:2] == blocks.get_block_ids()[0][:2]

    def test_a_cut_at_a_block_end_keeps_whole_blocks_only(self):
        mgr, b, blocks, _ = self.hit()
        cut = mgr.truncate_computed_blocks(blocks, 128)
        assert cut.get_block_ids() == ([*blocks.get_block_ids()[0][:2]],)
        out = mgr.allocate_slots(b, len(b.all_token_ids) - 128, 128, cut)
        assert out is not None
        assert out.copies == ()

    @pytest.mark.parametrize(
        ("tokens", "match"),
        [
            (100, "not a multiple of its block size 64"),
            (400, "blocks to 400 tokens: it is shorter"),
            (256, "blocks to 256 tokens: it is shorter"),
        ],
    )
    def test_a_cut_off_the_grid_or_past_the_hit_is_refused(self, tokens, match):
        mgr, _, blocks, _ = self.hit()
        with pytest.raises(InvalidRequestError, match=f"group 0's hit .*{match}"):
            mgr.truncate_computed_blocks(blocks, tokens)
