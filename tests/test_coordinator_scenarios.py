"""Hand-worked scenarios for the block coordinator and ``KVCacheManager``.

Every expected number below is worked out by hand in the comments next to it
(semantics.md section 9): block ids come from the free queue, which starts in
id order with block 0 taken out as the null block; groups allocate in group
order within one step; freed blocks without a hash go to the front of the
queue, hashed ones to the back, a request's tail first.
"""

from __future__ import annotations

import pytest
import torch
from coordinator_setup import builtin_registry

import kvcore
from kvcore import KVCacheConfig, KVCacheGroupSpec
from kvcore.coordinator import (
    AllBlocksCleared,
    BlockHashWithGroupId,
    BlockRemoved,
    BlockStored,
    KVCacheManager,
    Request,
)
from kvcore_circular_buffer import CircularBufferSpec
from kvcore_full_attention import FullAttentionSpec
from kvcore_hisparse import HiSparseHotSpec
from kvcore_mamba import MambaSpec
from kvcore_sliding_window import SlidingWindowSpec

REGISTRY = builtin_registry()

# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def fa(block_size: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16
    )


def sw(block_size: int = 4, window: int = 8, **kw: object) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=8,
        dtype=torch.float16,
        sliding_window=window,
        **kw,
    )


def mamba(block_size: int = 4, mode: str = "align", policy: str = "steps") -> MambaSpec:
    """A Mamba layer; align mode keeps the state every step leaves on a hit
    boundary (policy ``steps``), the rule these scenarios pin block by block
    (the default policy's checkpoints are tests/test_checkpoints.py's)."""
    return MambaSpec(
        block_size=block_size,
        shapes=((2, 4),),
        dtypes=(torch.float32,),
        mamba_cache_mode=mode,
        checkpoint_policy=policy,
    )


def ring(block_size: int = 4) -> CircularBufferSpec:
    return CircularBufferSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16
    )


def hot(block_size: int = 4, blocks_per_request: int = 3) -> HiSparseHotSpec:
    return HiSparseHotSpec(
        block_size=block_size, page_size=64, blocks_per_request=blocks_per_request
    )


def make_manager(
    specs: list[object],
    num_blocks: int,
    *,
    sched: int = 4,
    hash_bs: int = 4,
    max_model_len: int = 1024,
    **kw: object,
) -> KVCacheManager:
    groups = [KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)]
    config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
    )
    return KVCacheManager(
        config,
        max_model_len=max_model_len,
        scheduler_block_size=sched,
        hash_block_size=hash_bs,
        enable_caching=True,
        **kw,
    )


def req(rid: str, tokens: list[int] | range, hash_bs: int = 4) -> Request:
    return Request(rid, list(tokens), hash_block_size=hash_bs)


def admit(
    mgr: KVCacheManager, r: Request, num_new: int | None = None
) -> tuple[int, tuple[list[int], ...]]:
    """Scheduler admission: look up the hit, allocate ``num_new`` tokens after
    it (default: the rest of the prompt), advance.  Returns (hit, hit ids)."""
    blocks, hit = mgr.get_computed_blocks(r)
    hit_ids = blocks.get_block_ids()
    n = r.num_tokens - hit if num_new is None else num_new
    assert mgr.allocate_slots(r, n, hit, blocks) is not None
    r.num_computed_tokens = hit + n
    return hit, hit_ids


def step(mgr: KVCacheManager, r: Request, n: int) -> None:
    """One more chunk for a running request."""
    assert mgr.allocate_slots(r, n) is not None
    r.num_computed_tokens += n


def decode(mgr: KVCacheManager, r: Request, token: int) -> None:
    """Sample ``token`` after the computed tokens and schedule it."""
    assert r.num_computed_tokens == r.num_tokens
    r.append_output_token_ids(token)
    step(mgr, r, 1)


def ids(mgr: KVCacheManager, rid: str) -> tuple[list[int], ...]:
    return mgr.get_block_ids(rid)


def free_ids(mgr: KVCacheManager) -> list[int]:
    return mgr.block_pool.free_queue.get_all_free_blocks()


def refs(mgr: KVCacheManager, *block_ids: int) -> list[int]:
    return [mgr.block_pool.ref_cnt[i] for i in block_ids]


def key(mgr: KVCacheManager, block_id: int) -> BlockHashWithGroupId | None:
    """Block ``block_id``'s prefix-cache key ``(block hash, group id)``, else None."""
    pool = mgr.block_pool
    h = pool.key_hash[block_id]
    return None if h is None else (h, pool.key_group[block_id])


def hashed(mgr: KVCacheManager, block_id: int) -> bool:
    return mgr.block_pool.key_hash[block_id] is not None


def snapshot(mgr: KVCacheManager, rids: list[str]) -> object:
    """Everything a refused allocation must leave alone."""
    pool = mgr.block_pool
    return (
        [(pool.ref_cnt[b], key(mgr, b)) for b in range(pool.num_blocks)],
        free_ids(mgr),
        pool.get_num_free_blocks(),
        {rid: ids(mgr, rid) for rid in rids},
        [dict(m.num_cached_block) for m in mgr.coordinator.single_type_managers],
        pool.num_cached_blocks,
    )


T = list(range(1000, 1100))  # shared prompt tokens: T[i] = 1000 + i


# ---------------------------------------------------------------------------
# full attention
# ---------------------------------------------------------------------------


class TestFullAttention:
    def test_allocation_counts_and_hashing_of_full_blocks(self):
        mgr = make_manager([fa(4)], num_blocks=11)  # 10 usable blocks
        a = req("a", T[:10])
        hit, _ = admit(mgr, a)
        # Nothing cached yet -> no hit; cdiv(10, 4) = 3 blocks, ids 1, 2, 3.
        assert hit == 0
        assert ids(mgr, "a") == ([1, 2, 3],)
        assert mgr.get_num_free_blocks() == 10 - 3
        # 10 // 4 = 2 full blocks are hashed; the third (tokens 8..9) is not.
        assert [hashed(mgr, i) for i in (1, 2, 3)] == [True, True, False]
        assert mgr.coordinator.single_type_managers[0].num_cached_block["a"] == 2

        decode(mgr, a, 7)  # 11 tokens: still cdiv(11, 4) = 3 blocks
        assert ids(mgr, "a") == ([1, 2, 3],)
        assert not hashed(mgr, 3)
        decode(mgr, a, 7)  # 12 tokens: block 3 is now full and hashed
        assert ids(mgr, "a") == ([1, 2, 3],)
        assert hashed(mgr, 3)
        decode(mgr, a, 7)  # 13 tokens: a fourth block, id 4
        assert ids(mgr, "a") == ([1, 2, 3, 4],)
        assert mgr.get_num_free_blocks() == 10 - 4

    def test_chunked_prefill_hashes_only_computed_full_blocks(self):
        mgr = make_manager([fa(4)], num_blocks=11)
        a = req("a", T[:14])
        step(mgr, a, 6)
        # 6 tokens -> cdiv(6, 4) = 2 blocks; only 6 // 4 = 1 is full.  Block 2
        # must not be hashed before tokens 4..7 are computed.
        assert ids(mgr, "a") == ([1, 2],)
        assert [hashed(mgr, i) for i in (1, 2)] == [True, False]
        step(mgr, a, 6)
        # 12 tokens -> 3 blocks, all full and hashed.
        assert ids(mgr, "a") == ([1, 2, 3],)
        assert [hashed(mgr, i) for i in (1, 2, 3)] == [True, True, True]
        step(mgr, a, 2)
        assert ids(mgr, "a") == ([1, 2, 3, 4],)
        assert not hashed(mgr, 4)

    def test_prefix_hit_shares_full_blocks_and_counts_references(self):
        mgr = make_manager([fa(4)], num_blocks=11)
        a = req("a", T[:10])
        admit(mgr, a)  # blocks 1, 2 (hashed), 3
        # b shares tokens 0..7 (two full blocks) and then differs.
        b = req("b", [*T[:8], 1, 2, 3])
        hit, hit_ids = admit(mgr, b)
        assert hit == 8
        assert hit_ids == ([1, 2],)
        # 11 tokens -> 3 blocks: two from the hit and one new (id 4).
        assert ids(mgr, "b") == ([1, 2, 4],)
        assert refs(mgr, 1, 2, 3, 4) == [2, 2, 1, 1]
        assert mgr.get_num_free_blocks() == 10 - 4

    @pytest.mark.parametrize(
        ("num_tokens", "expected_hit"),
        [
            # max hit = num_tokens - 1: the last prompt token is recomputed.
            (8, 4),  # 7 tokens bound -> 1 full block
            (9, 8),  # 8 tokens bound -> 2 full blocks
            (12, 8),  # 11 tokens bound -> 2 blocks (a has only 2 hashed)
        ],
    )
    def test_hit_never_covers_the_last_prompt_token(self, num_tokens, expected_hit):
        mgr = make_manager([fa(4)], num_blocks=11)
        admit(mgr, req("a", T[:10]))  # hashed: blocks for tokens 0..3, 4..7
        blocks, hit = mgr.get_computed_blocks(req("c", T[:num_tokens]))
        assert hit == expected_hit
        assert blocks.get_block_ids() == ([1, 2][: expected_hit // 4],)

    def test_free_order_unhashed_first_then_lru_tail_first(self):
        mgr = make_manager([fa(4)], num_blocks=11)
        a = req("a", T[:10])
        admit(mgr, a)  # [1, 2, 3], 1 and 2 hashed
        b = req("b", [*T[:8], 1, 2, 3])
        admit(mgr, b)  # [1, 2, 4]
        mgr.free(a)
        # a frees 3, 2, 1 (tail first): 3 reaches 0 unhashed -> front; 2 and 1
        # are still held by b.
        assert free_ids(mgr) == [3, 5, 6, 7, 8, 9, 10]
        mgr.free(b)
        # b frees 4, 2, 1: 4 unhashed -> front; 2 then 1 hashed -> back, b's
        # tail block (2) before its head block (1).
        assert free_ids(mgr) == [4, 3, 5, 6, 7, 8, 9, 10, 2, 1]
        assert refs(mgr, 1, 2, 3, 4) == [0, 0, 0, 0]
        assert mgr.get_num_free_blocks() == 10

    def test_hit_revives_free_block_and_allocation_evicts_lru(self):
        # 5 usable blocks.
        mgr = make_manager([fa(4)], num_blocks=6)
        a = req("a", T[:13])
        admit(mgr, a)  # cdiv(13, 4) = 4 blocks [1, 2, 3, 4]; 1, 2, 3 hashed
        assert ids(mgr, "a") == ([1, 2, 3, 4],)
        a_hashes = list(a.block_hashes)
        mgr.free(a)
        # 4 (unhashed) to the front, then the untouched 5, then 3, 2, 1.
        assert free_ids(mgr) == [4, 5, 3, 2, 1]

        # Two unique blocks take the unhashed 4 and 5: nothing is evicted.
        c = req("c", range(5000, 5008))
        admit(mgr, c)
        assert ids(mgr, "c") == ([4, 5],)
        assert free_ids(mgr) == [3, 2, 1]
        # The next block comes from the LRU end: block 3 (a's tail) loses its
        # hash; 2 and 1 keep theirs.  (d's 3 tokens do not fill the block, so
        # d does not hash it again.)
        d = req("d", range(6000, 6003))
        admit(mgr, d)
        assert ids(mgr, "d") == ([3],)
        assert not hashed(mgr, 3)
        assert hashed(mgr, 1)
        assert hashed(mgr, 2)
        pool = mgr.block_pool
        assert pool.lookup(a_hashes[2], 0) is None
        assert pool.lookup(a_hashes[1], 0) == 2

        # a's prompt again: blocks 1, 2 are revived from the free queue
        # (touch), block 3's hash is gone -> hit 8.
        e = req("e", T[:13])
        blocks, hit = mgr.get_computed_blocks(e)
        assert hit == 8
        assert blocks.get_block_ids() == ([1, 2],)
        # Needs cdiv(13, 4) - 2 = 2 new blocks + 2 revived = 4 > 2 free -> refused.
        assert mgr.allocate_slots(e, 5, hit, blocks) is None
        mgr.free(d)  # block 3 holds 3 tokens: unhashed -> front: [3, 2, 1]
        assert free_ids(mgr) == [3, 2, 1]
        assert mgr.allocate_slots(e, 5, hit, blocks) is None  # 4 > 3
        mgr.free(c)  # c's blocks 5, 4 are full and hashed -> back, tail first
        assert free_ids(mgr) == [3, 2, 1, 5, 4]
        assert mgr.allocate_slots(e, 5, hit, blocks) is not None
        # touch takes 2 and 1 out of the queue; the new blocks are 3 and 5
        # (5 loses c's hash).
        assert ids(mgr, "e") == ([1, 2, 3, 5],)
        assert free_ids(mgr) == [4]
        assert refs(mgr, 1, 2) == [1, 1]


# ---------------------------------------------------------------------------
# sliding window
# ---------------------------------------------------------------------------


class TestSlidingWindow:
    def test_blocks_leaving_the_window_become_null(self):
        # window 8, block 4: the token at position p reads p-7..p, so before
        # computing from position n the first (n - 7) // 4 blocks are dead.
        mgr = make_manager([sw(4, 8)], num_blocks=20)
        a = req("a", T[:6])
        admit(mgr, a)  # cdiv(6, 4) = 2 blocks
        assert ids(mgr, "a") == ([1, 2],)
        table = {}
        for token in range(20):
            decode(mgr, a, 90 + token)
            table[a.num_computed_tokens] = ids(mgr, "a")[0]
        # The step from n=7 to 8 skips max(0, 7-7)//4 = 0 blocks.
        assert table[8] == [1, 2]
        # n=11 -> 12: skipped (11-7)//4 = 1 block; cdiv(12,4) = 3 blocks held.
        assert table[12] == [0, 2, 3]
        # n=15 -> 16: skipped 8//4 = 2; cdiv(16, 4) = 4.
        assert table[16] == [0, 0, 3, 4]
        # n=16 -> 17: skipped 9//4 = 2; block 5 for tokens 16..19.
        assert table[17] == [0, 0, 3, 4, 5]
        # n=25 -> 26: skipped 18//4 = 4; cdiv(26, 4) = 7 blocks.
        assert table[26] == [0, 0, 0, 0, 5, 6, 7]
        # Dead blocks went back to the pool (full, so hashed: at the back).
        assert refs(mgr, 1, 2, 3, 4) == [0, 0, 0, 0]
        assert free_ids(mgr)[-4:] == [1, 2, 3, 4]
        assert mgr.get_num_free_blocks() == 19 - 3

    def test_hit_searches_from_the_right_and_needs_only_the_window(self):
        mgr = make_manager([sw(4, 8)], num_blocks=11)  # 10 usable
        a = req("a", T[:24])
        admit(mgr, a)  # 6 blocks [1..6], all full and hashed
        assert ids(mgr, "a") == ([1, 2, 3, 4, 5, 6],)
        decode(mgr, a, 1)
        # n=24: skipped (24-7)//4 = 4 blocks -> 4, 3, 2, 1 freed (hashed ->
        # back of the queue, in that order); 25 tokens need a 7th block: 7.
        assert ids(mgr, "a") == ([0, 0, 0, 0, 5, 6, 7],)
        assert free_ids(mgr) == [8, 9, 10, 4, 3, 2, 1]
        # A filler of 20 tokens takes 5 blocks: 8, 9, 10, then evicts 4 and 3
        # (a's positions 3 and 2; the filler hashes them again under its own
        # tokens).
        admit(mgr, req("f", range(7000, 7020)))
        assert ids(mgr, "f") == ([8, 9, 10, 4, 3],)
        pool = mgr.block_pool
        assert pool.lookup(a.block_hashes[2], 0) is None
        assert pool.lookup(a.block_hashes[3], 0) is None
        assert pool.lookup(a.block_hashes[1], 0) == 2
        # b shares a's 24 prompt tokens.  Bound 24 -> 6 blocks; from the right:
        # block 6 (pos 5) and 5 (pos 4) are cached = cdiv(8-1, 4) = 2 blocks,
        # the whole window -> hit 24 though positions 2, 3 are evicted.
        b = req("b", [*T[:24], 55])
        blocks, hit = mgr.get_computed_blocks(b)
        assert hit == 24
        assert blocks.get_block_ids() == ([0, 0, 0, 0, 5, 6],)
        assert mgr.allocate_slots(b, 1, hit, blocks) is not None
        # 25 tokens -> 7 blocks: 6 from the hit (nulls count) + 1 new from the
        # front of the queue [2, 1] -> block 2 (its hash is evicted).
        assert ids(mgr, "b") == ([0, 0, 0, 0, 5, 6, 2],)
        assert refs(mgr, 5, 6) == [2, 2]
        assert not hashed(mgr, 2)

    def test_hit_without_a_full_window_must_start_at_block_zero(self):
        mgr = make_manager([sw(4, 16)], num_blocks=20)  # needs cdiv(15,4) = 4
        admit(mgr, req("a", T[:12]))  # 3 blocks, all hashed
        # bound 12 -> 3 blocks; the run of 3 < 4 from the right reaches block
        # 0, so the leading run is the hit: 12 tokens.
        blocks, hit = mgr.get_computed_blocks(req("b", [*T[:12], 5]))
        assert hit == 12
        assert blocks.get_block_ids() == ([1, 2, 3],)

    def test_bounded_replay_window_is_never_hashed(self):
        mgr = make_manager([fa(4), sw(4, 8, bounded_replay=True)], num_blocks=40)
        groups = mgr.coordinator.attention_groups
        assert len(groups) == 1
        assert groups[0].group_ids == [0]
        assert isinstance(groups[0].spec, FullAttentionSpec)
        a = req("a", T[:16])
        admit(mgr, a)
        decode(mgr, a, 3)
        fa_ids, sw_ids = ids(mgr, "a")
        # 17 tokens: the 4 full FA blocks are hashed, the fifth is not.
        assert [hashed(mgr, i) for i in fa_ids] == [True] * 4 + [False]
        assert not any(hashed(mgr, i) for i in sw_ids if i)
        assert mgr.coordinator.single_type_managers[1].num_cached_block.get("a", 0) == 0
        # A second request hits through full attention only.
        blocks, hit = mgr.get_computed_blocks(req("b", [*T[:16], 9]))
        assert hit == 16
        assert blocks.get_block_ids() == (fa_ids[:4], [])


# ---------------------------------------------------------------------------
# Mamba
# ---------------------------------------------------------------------------


class TestMamba:
    def test_align_mode_states_at_block_boundaries(self):
        mgr = make_manager([fa(4), mamba(4, "align")], num_blocks=20)
        a = req("a", T[:10])
        step(mgr, a, 8)
        # FA [1, 2]; Mamba cdiv(8, 4) = 2 positions: null, then the state
        # after token 8 in block 3, cached under block 1's hash.
        assert ids(mgr, "a") == ([1, 2], [0, 3])
        assert hashed(mgr, 3)
        step(mgr, a, 2)
        # 10 tokens: FA block 4, Mamba block 5 at position 2 (not a boundary:
        # not hashed).  The state in 3 is still read by this step.
        assert ids(mgr, "a") == ([1, 2, 4], [0, 3, 5])
        assert not hashed(mgr, 5)
        decode(mgr, a, 1)
        # Before computing from n=10 only the state at position (10-1)//4 = 2
        # is read: block 3 goes back to the pool (hashed -> at the back).
        assert ids(mgr, "a") == ([1, 2, 4], [0, 0, 5])
        assert free_ids(mgr)[-1] == 3
        assert refs(mgr, 3) == [0]

        # b shares a's first 8 tokens: FA hits [1, 2]; the Mamba search at 8
        # finds the state after token 8 (block 3) -> hit 8.
        b = req("b", [*T[:8], 77, 78, 79])
        blocks, hit = mgr.get_computed_blocks(b)
        assert hit == 8
        assert blocks.get_block_ids() == ([1, 2], [0, 3])
        assert mgr.allocate_slots(b, 3, hit, blocks) is not None
        # 11 tokens -> 3 positions; the free queue is [6, 7, ..., 19] (3 was
        # revived): FA gets 6, Mamba gets 7.
        assert ids(mgr, "b") == ([1, 2, 6], [0, 3, 7])
        assert refs(mgr, 1, 2, 3) == [2, 2, 1]

    def test_align_mode_state_at_a_later_boundary_wins(self):
        mgr = make_manager([fa(4), mamba(4, "align")], num_blocks=40)
        a = req("a", T[:17])
        for _ in range(4):  # chunks of 4 -> states cached after 4, 8, 12, 16
            step(mgr, a, 4)
        blocks, hit = mgr.get_computed_blocks(req("b", [*T[:14], 5, 5]))
        # bound 15: FA hits 3 blocks (12 tokens); Mamba's latest cached state
        # at or below 12 is the one after token 12, position 2.
        assert hit == 12
        fa_ids, m_ids = blocks.get_block_ids()
        assert len(fa_ids) == 3
        assert m_ids[:2] == [0, 0]
        assert len(m_ids) == 3
        assert m_ids[2] != 0

    def test_align_mode_keeps_at_most_two_states_across_multi_block_chunks(self):
        """Regression: the dead-state scan stopped at the first null, but a
        chunk longer than a block pads the table with nulls *between* states,
        so older state blocks stayed held for the request's whole life."""
        mgr = make_manager([fa(4), mamba(4, "align")], num_blocks=40)
        a = req("a", T[:25])
        step(mgr, a, 8)  # Mamba [0, s8]
        step(mgr, a, 8)  # Mamba [0, s8, 0, s16]
        s8 = ids(mgr, "a")[1][1]
        step(mgr, a, 8)  # before: only the state at (16-1)//4 = 3 is read
        m_ids = ids(mgr, "a")[1]
        s16, s24 = m_ids[3], m_ids[5]
        assert m_ids == [0, 0, 0, s16, 0, s24]
        assert refs(mgr, s8) == [0]
        assert hashed(mgr, s8)
        step(mgr, a, 1)
        m_ids = ids(mgr, "a")[1]
        assert m_ids[:5] == [0, 0, 0, 0, 0]
        assert m_ids[5] == s24
        assert len(m_ids) == 7
        assert refs(mgr, s16) == [0]
        assert hashed(mgr, s16)
        # The freed states are still cached: b resumes from the state at 16.
        blocks, hit = mgr.get_computed_blocks(req("b", [*T[:18], 1]))
        assert hit == 16
        assert blocks.get_block_ids()[1] == [0, 0, 0, s16]

    def test_align_mode_hit_then_long_chunk_releases_the_hit_state(self):
        mgr = make_manager([fa(4), mamba(4, "align")], num_blocks=40)
        a = req("a", T[:9])
        step(mgr, a, 8)  # state after 8 in block 3 (FA took 1, 2)
        mgr.free(a)
        b = req("b", T[:8] + list(range(500, 512)))  # 20 tokens
        hit, hit_ids = admit(mgr, b)
        assert hit == 8
        assert hit_ids == ([1, 2], [0, 3])
        # 20 tokens -> 5 positions: [0, 3, 0, 0, new]
        m_ids = ids(mgr, "b")[1]
        assert m_ids[:4] == [0, 3, 0, 0]
        assert m_ids[4] != 0
        decode(mgr, b, 1)
        # n=20: only position (20-1)//4 = 4 is read; the hit state 3 is freed.
        assert ids(mgr, "b")[1][:5] == [0, 0, 0, 0, m_ids[4]]
        assert refs(mgr, 3) == [0]

    def test_none_mode_one_block_for_life_and_no_hit(self):
        mgr = make_manager([fa(4), mamba(4, "none")], num_blocks=40)
        assert [g.group_ids for g in mgr.coordinator.attention_groups] == [[0]]
        a = req("a", T[:10])
        admit(mgr, a, 5)
        state = ids(mgr, "a")[1]
        assert len(state) == 1
        step(mgr, a, 5)
        for t in range(12):
            decode(mgr, a, t)
            assert ids(mgr, "a")[1] == state
        assert not hashed(mgr, state[0])
        # FA has 8 tokens cached, but the recurrent state after them was
        # never kept: no prefix can be restored, so there is no hit at all.
        assert mgr.coordinator.hit_blockers == (1,)
        blocks, hit = mgr.get_computed_blocks(req("b", [*T[:10], 1]))
        assert hit == 0
        assert blocks.get_block_ids() == ([], [])
        mgr.free(a)
        assert refs(mgr, state[0]) == [0]


# ---------------------------------------------------------------------------
# fixed-block kinds
# ---------------------------------------------------------------------------


class TestFixedBlocks:
    def test_circular_buffer_one_block_for_life(self):
        mgr = make_manager([fa(4), ring(4)], num_blocks=40)
        assert [g.group_ids for g in mgr.coordinator.attention_groups] == [[0]]
        a = req("a", T[:9])
        admit(mgr, a, 4)
        # FA [1]; the ring claims one block (2) on first allocation.
        assert ids(mgr, "a") == ([1], [2])
        step(mgr, a, 5)
        for t in range(20):
            decode(mgr, a, t)
        # 29 tokens: FA cdiv(29, 4) = 8 blocks; the ring still holds block 2.
        assert len(ids(mgr, "a")[0]) == 8
        assert ids(mgr, "a")[1] == [2]
        assert not hashed(mgr, 2)
        assert mgr.coordinator.single_type_managers[1].num_cached_block.get("a", 0) == 0
        b = req("b", [*T[:9], 5])
        blocks, hit = mgr.get_computed_blocks(b)
        assert hit == 8
        assert blocks.get_block_ids()[1] == []
        assert mgr.allocate_slots(b, 2, hit, blocks) is not None
        ring_b = ids(mgr, "b")[1]
        assert len(ring_b) == 1
        assert ring_b != [2]
        fa_a = ids(mgr, "a")[0]
        mgr.free(a)
        # Unhashed blocks go to the front: the ring block and a's last FA block
        # (29 tokens: 7 full blocks + 1 partial); a's hashed blocks not shared
        # with b go to the back.
        assert set(free_ids(mgr)[:2]) == {2, fa_a[-1]}
        assert free_ids(mgr)[-5:] == fa_a[2:7][::-1]

    def test_hisparse_hot_pages_fixed_blocks_per_request(self):
        mgr = make_manager([fa(4), hot(4, 3)], num_blocks=40)
        a = req("a", T[:10])
        admit(mgr, a)
        # FA cdiv(10, 4) = 3 blocks [1, 2, 3]; hot pages [4, 5, 6].
        assert ids(mgr, "a") == ([1, 2, 3], [4, 5, 6])
        for t in range(10):
            decode(mgr, a, t)
        assert ids(mgr, "a")[1] == [4, 5, 6]
        assert not any(hashed(mgr, i) for i in (4, 5, 6))
        b = req("b", T[:10])
        hit, hit_ids = admit(mgr, b)
        assert hit == 8
        assert hit_ids[1] == []
        assert len(ids(mgr, "b")[1]) == 3
        assert set(ids(mgr, "b")[1]).isdisjoint({4, 5, 6})
        free_before = mgr.get_num_free_blocks()
        mgr.free(b)
        # b held 1 new FA block + 3 hot pages (the 2 hit blocks stay with a).
        assert mgr.get_num_free_blocks() == free_before + 4


# ---------------------------------------------------------------------------
# hits across several cacheable groups
# ---------------------------------------------------------------------------


def _fa_sw_mamba(num_blocks: int = 64, **kw: object) -> KVCacheManager:
    return make_manager([fa(4), sw(4, 8), mamba(4, "align")], num_blocks, **kw)


class TestMultiGroupHits:
    def test_three_groups_mamba_state_limits_the_hit(self):
        mgr = _fa_sw_mamba()
        a = req("a", T[:25])
        for n in (8, 8, 8, 1):  # Mamba states cached after 8, 16 and 24
            step(mgr, a, n)
        # Hand trace (free queue starts at 1; groups allocate FA, SW, Mamba):
        #  0->8:  FA [1,2]  SW [3,4]  M [0,5]
        #  8->16: FA [6,7]  SW [8,9]  M [0,5,0,10]
        # 16->24: SW frees pos 0,1 (4, 3); M frees 5; FA [11,12] SW [13,14]
        #         M [0,0,0,10,0,15]
        # 24->25: SW frees pos 2,3 (9, 8); M frees 10; FA 16, SW 17, M 18.
        assert ids(mgr, "a") == (
            [1, 2, 6, 7, 11, 12, 16],
            [0, 0, 0, 0, 13, 14, 17],
            [0, 0, 0, 0, 0, 15, 18],
        )
        # b shares 20 tokens.  FA: blocks 0..4 -> 20.  SW at 20: positions 4
        # (13) and 3 (9, free but cached) cover the window -> 20.  Mamba at
        # 20: no state after 20; the state after 16 (block 10) -> 16.  SW
        # again at 16: positions 3 (9) and 2 (8) -> 16.  FA trimmed to 4.
        b = req("b", [*T[:20], 1, 2, 3, 4, 5])
        blocks, hit = mgr.get_computed_blocks(b)
        assert hit == 16
        assert blocks.get_block_ids() == ([1, 2, 6, 7], [0, 0, 8, 9], [0, 0, 0, 10])
        assert mgr.allocate_slots(b, 9, hit, blocks) is not None
        # Held by a: 1, 2, 6, 7 -> 2 refs; revived from the queue: 8, 9, 10.
        assert refs(mgr, 1, 2, 6, 7, 8, 9, 10) == [2, 2, 2, 2, 1, 1, 1]
        fa_b, sw_b, m_b = ids(mgr, "b")
        # 25 tokens -> 7 positions in every group.
        assert fa_b[:4] == [1, 2, 6, 7]
        assert len(fa_b) == 7
        assert sw_b[:4] == [0, 0, 8, 9]
        assert len(sw_b) == 7
        assert m_b[:4] == [0, 0, 0, 10]
        assert len(m_b) == 7

    def test_eagle_drops_one_alignment_unit(self):
        def run(use_eagle: bool) -> tuple[int, tuple[list[int], ...]]:
            mgr = _fa_sw_mamba(use_eagle=use_eagle)
            a = req("a", T[:25])
            for _ in range(6):  # chunks of 4: states after 4, 8, ..., 24
                step(mgr, a, 4)
            blocks, hit = mgr.get_computed_blocks(req("b", [*T[:24], 9]))
            return hit, blocks.get_block_ids()

        hit, (fa_ids, sw_ids, m_ids) = run(False)
        # bound 24: all three groups serve 24 -> 6 blocks each.
        assert hit == 24
        assert (len(fa_ids), len(sw_ids), len(m_ids)) == (6, 6, 6)
        assert sw_ids[:4] == [0, 0, 0, 0]
        assert m_ids[:5] == [0] * 5
        hit_e, (fa_e, sw_e, m_e) = run(True)
        # eagle: 24 - 4 (alignment = scheduler block 4) = 20 -> 5 blocks each.
        assert hit_e == 20
        assert fa_e == fa_ids[:5]
        # SW now needs positions 3 and 4; position 4 is the same block.
        assert sw_e[:3] == [0, 0, 0]
        assert sw_e[3] != 0
        assert sw_e[4] == sw_ids[4]
        assert m_e[:4] == [0] * 4
        assert m_e[4] != 0

    def test_eagle_on_full_attention_only(self):
        mgr = make_manager([fa(4)], num_blocks=20, use_eagle=True)
        admit(mgr, req("a", T[:13]))
        blocks, hit = mgr.get_computed_blocks(req("b", T[:13]))
        # bound 12 -> 3 blocks -> minus one unit of 4 -> 8.
        assert hit == 8
        assert blocks.get_block_ids() == ([1, 2],)

    def test_two_block_sizes_and_sliding_window(self):
        # FA block 4 (g0), FA block 8 (g1), SW block 4 window 8 (g2).  hash 4,
        # scheduler 8: no partial hits (copy-on-write hits off), so hits are
        # multiples of 8.
        mgr = make_manager(
            [fa(4), fa(8), sw(4, 8)],
            num_blocks=32,
            sched=8,
            hash_bs=4,
            enable_partial_hits=False,
        )
        assert mgr.coordinator.cache_hit_alignment == 8
        assert [g.group_ids for g in mgr.coordinator.attention_groups] == [
            [0],
            [1],
            [2],
        ]
        a = req("a", T[:33])
        step(mgr, a, 32)
        # FA4 [1..8], FA8 [9..12], SW [13..20]: 20 blocks, all hashed.
        assert ids(mgr, "a") == (
            list(range(1, 9)),
            [9, 10, 11, 12],
            list(range(13, 21)),
        )
        step(mgr, a, 1)
        # n=32: SW frees positions 5..0 -> 18, 17, ..., 13 (hashed, to the
        # back); 33 tokens: FA4 21, FA8 22, SW 23.
        assert ids(mgr, "a")[2] == [0] * 6 + [19, 20, 23]
        assert free_ids(mgr) == [*range(24, 32), 18, 17, 16, 15, 14, 13]

        # b shares 14 tokens.  FA4 hits blocks 0..2 = 12 -> aligned to 8 ->
        # [1, 2]; FA8 at 8 -> [9]; SW at 8 -> positions 1, 0 (14, 13) -> 8.
        blocks, hit = mgr.get_computed_blocks(req("b", T[:14] + [7] * 11))
        assert hit == 8
        assert blocks.get_block_ids() == ([1, 2], [9], [13, 14])

        # A 16-token filler needs FA4 4 + FA8 2 + SW 4 = 10 blocks: 24..31 and
        # then the LRU end of the queue: 18 and 17 (SW positions 5 and 4).
        f = req("f", range(8000, 8016))
        admit(mgr, f)
        assert ids(mgr, "f") == ([24, 25, 26, 27], [28, 29], [30, 31, 18, 17])
        assert mgr.block_pool.lookup(a.block_hashes[5], 2) is None
        assert mgr.block_pool.lookup(a.block_hashes[4], 2) is None
        assert mgr.block_pool.lookup(a.block_hashes[3], 2) == 16

        # c shares 26 tokens (6 full 4-blocks).  FA4 -> 24 tokens [1..6]; FA8
        # at 24 -> [9, 10, 11]; SW at 24: positions 5, 4 evicted, 3 (16) and
        # 2 (15) cached -> 16.  FA groups are trimmed to 16.
        blocks, hit = mgr.get_computed_blocks(req("c", T[:26] + [7] * 7))
        assert hit == 16
        assert blocks.get_block_ids() == ([1, 2, 3, 4], [9, 10], [0, 0, 15, 16])

    def test_partial_alignment_hit_is_whole_blocks_of_every_group(self):
        """Regression: with Mamba align hits (alignment = hash block 4 < the
        16-token full-attention block) the fixed point trimmed full attention
        to whole blocks *after* settling the length, so it reported a 24-token
        hit whose full-attention blocks covered only 16 tokens.  (Without
        copy-on-write hits: full attention serves whole blocks only.)"""
        mgr = make_manager(
            [fa(16), sw(4, 8), mamba(8, "align")],
            num_blocks=200,
            sched=16,
            hash_bs=4,
            enable_partial_hits=False,
        )
        assert mgr.coordinator.cache_hit_alignment == 4
        a = req("a", T[:40])
        for n in (8, 8, 8, 12, 4):  # Mamba states after 8, 16, 24, 40 (not 32)
            step(mgr, a, n)
        b = req("b", [*T[:36], 5, 6, 7, 8, 9])
        blocks, hit = mgr.get_computed_blocks(b)
        # bound 40.  FA (block 16) -> 2 blocks = 32; SW -> 32; Mamba at 32: no
        # state after 32 -> the one after 24.  FA serves 24 only as 1 whole
        # block = 16 -> SW at 16 -> 16; Mamba at 16: the state after 16.
        assert hit == 16
        fa_ids, sw_ids, m_ids = blocks.get_block_ids()
        assert len(fa_ids) * 16 == hit
        assert len(sw_ids) * 4 == hit
        assert len(m_ids) * 8 == hit
        assert m_ids[0] == 0
        assert m_ids[1] != 0
        assert mgr.allocate_slots(b, b.num_tokens - hit, hit, blocks) is not None

    def test_partial_alignment_hit_with_copy_on_write(self):
        """The same trace with copy-on-write hits: full attention serves 24
        tokens as block 0 and a copy of block 1's first 8 slots (partial keys
        of a's tokens computed before each step: 4..36 but not 16 or 32)."""
        mgr = make_manager(
            [fa(16), sw(4, 8), mamba(8, "align")], num_blocks=200, sched=16, hash_bs=4
        )
        assert mgr.coordinator.cache_hit_alignment == 4
        a = req("a", T[:40])
        for n in (8, 8, 8, 12, 4):
            step(mgr, a, n)
        fa_a = ids(mgr, "a")[0]
        b = req("b", [*T[:36], 5, 6, 7, 8, 9])
        blocks, hit = mgr.get_computed_blocks(b)
        # bound 40.  FA -> 2 full blocks = 32; SW -> 32; Mamba at 32: none ->
        # 24.  FA serves 24 (block 1 holds the partial key of chunk 24); SW
        # at 24 -> 24; Mamba at 24: the state after 24.
        assert hit == 24
        fa_ids, sw_ids, m_ids = blocks.get_block_ids()
        assert fa_ids == fa_a[:2]
        assert len(sw_ids) * 4 == 24
        assert len(m_ids) * 8 == 24
        out = mgr.allocate_slots(b, b.num_tokens - hit, hit, blocks)
        assert out is not None
        table = ids(mgr, "b")[0]
        assert table[0] == fa_a[0]
        assert table[1] != fa_a[1]
        assert out.copies == (kvcore.coordinator.BlockCopy(0, fa_a[1], table[1], 8),)


# ---------------------------------------------------------------------------
# refused allocations
# ---------------------------------------------------------------------------


class TestRefusedAllocation:
    def test_refused_admission_with_free_hit_blocks_changes_nothing(self):
        mgr = make_manager(
            [fa(4), sw(4, 8), mamba(4, "align"), ring(4)], num_blocks=16
        )  # 15 usable
        a = req("a", T[:13])
        step(mgr, a, 12)
        # FA [1,2,3]; SW [4,5,6]; Mamba [0,0,7] (state after 12, hashed);
        # ring [8].
        assert ids(mgr, "a") == ([1, 2, 3], [4, 5, 6], [0, 0, 7], [8])
        mgr.free(a)
        # Ring 8 is unhashed -> front; then 9..15; then a's blocks by hit
        # point, tail first, each position's FA block then its SW block:
        # 3,6; 2,5; 1,4; last Mamba 7, the prompt-end state a kept.
        assert free_ids(mgr) == [8, *range(9, 16), 3, 6, 2, 5, 1, 4, 7]
        # A 12-token filler: FA 3 + SW 3 + Mamba 1 + ring 1 = 8 blocks.
        f = req("f", range(9000, 9012))
        admit(mgr, f)
        assert free_ids(mgr) == [3, 6, 2, 5, 1, 4, 7]

        b = req("b", [*T[:12], 50, 51, 52, 53, 54])  # 17 tokens
        blocks, hit = mgr.get_computed_blocks(b)
        assert hit == 12
        assert blocks.get_block_ids() == ([1, 2, 3], [0, 5, 6], [0, 0, 7], [])
        # Need: FA 5-3 = 2 new + 3 revived; SW 5-3 = 2 + 2 revived; Mamba 1 +
        # 1 revived; ring 1 -> 12 > 7 free.
        before = snapshot(mgr, ["f"])
        assert mgr.allocate_slots(b, 5, hit, blocks) is None
        assert snapshot(mgr, ["f"]) == before
        with pytest.raises(kvcore.UnknownRequestError):
            mgr.get_block_ids("b")

        mgr.free(f)
        assert mgr.allocate_slots(b, 5, hit, blocks) is not None
        fa_b, sw_b, m_b, ring_b = ids(mgr, "b")
        assert fa_b[:3] == [1, 2, 3]
        assert sw_b[:3] == [0, 5, 6]
        assert m_b[:3] == [0, 0, 7]
        assert len(ring_b) == 1

    def test_refused_decode_step_changes_nothing(self):
        mgr = make_manager([fa(4), ring(4)], num_blocks=6)  # 5 usable
        a = req("a", T[:8])
        admit(mgr, a)  # FA [1, 2], ring [3]
        b = req("b", range(300, 308))
        assert mgr.allocate_slots(b, 8) is None  # needs 2 + 1 > 2 free
        admit(mgr, b, 4)  # FA [4], ring [5]: pool empty
        assert mgr.get_num_free_blocks() == 0
        a.append_output_token_ids(1)  # 9 tokens -> a third FA block
        before = snapshot(mgr, ["a", "b"])
        assert mgr.allocate_slots(a, 1) is None
        assert snapshot(mgr, ["a", "b"]) == before
        mgr.free(b)
        step(mgr, a, 1)
        # b's FA block 4 is full (4 tokens computed) and hashed -> back of the
        # queue; its ring block 5 is unhashed -> front.  a gets 5.
        assert free_ids(mgr) == [4]
        assert ids(mgr, "a") == ([1, 2, 5], [3])


# ---------------------------------------------------------------------------
# invalid use
# ---------------------------------------------------------------------------


class TestInvalidUse:
    def test_unknown_request_and_double_free(self):
        mgr = make_manager([fa(4)], num_blocks=10)
        with pytest.raises(kvcore.UnknownRequestError, match="'ghost'"):
            mgr.get_block_ids("ghost")
        with pytest.raises(KeyError):
            mgr.free("ghost")
        a = req("a", T[:5])
        admit(mgr, a)
        mgr.free(a)
        with pytest.raises(kvcore.UnknownRequestError, match="'a'") as info:
            mgr.free(a)
        assert isinstance(info.value, KeyError)
        with pytest.raises(kvcore.UnknownRequestError, match="'a'"):
            mgr.get_block_ids("a")
        assert mgr.get_num_free_blocks() == 9

    def test_zero_tokens(self):
        mgr = make_manager([fa(4)], num_blocks=10)
        with pytest.raises(kvcore.InvalidRequestError, match="'z'") as info:
            mgr.allocate_slots(req("z", T[:5]), 0)
        assert isinstance(info.value, ValueError)
        assert mgr.get_num_free_blocks() == 9

    def test_misaligned_computed_tokens(self):
        mgr = make_manager([fa(4), sw(4, 8)], num_blocks=40, sched=8, hash_bs=4)
        admit(mgr, req("a", T[:20]))
        b = req("b", T[:20])
        blocks, hit = mgr.get_computed_blocks(b)
        assert hit == 16
        truncated = mgr.truncate_computed_blocks(blocks, 12)
        with pytest.raises(kvcore.InvalidRequestError, match=r"'b'.*alignment of 8"):
            mgr.allocate_slots(b, 8, 12, truncated)
        with pytest.raises(ValueError, match="alignment"):
            mgr.allocate_slots(b, 8, 12, truncated)

    def test_request_hashed_at_another_block_size(self):
        mgr = make_manager([fa(8)], num_blocks=10, sched=8, hash_bs=8)
        with pytest.raises(
            kvcore.InvalidRequestError, match=r"'h4'.*hash_block_size=8"
        ):
            mgr.get_computed_blocks(req("h4", T[:20], hash_bs=4))


# ---------------------------------------------------------------------------
# events, reset and usage
# ---------------------------------------------------------------------------


def test_kv_events_eviction_and_reset():
    mgr = make_manager([fa(4)], num_blocks=6, enable_kv_cache_events=True)

    def stored(hashes, ids, parent, tokens):  # group 0: full attention, block 4
        return BlockStored(
            tuple(hashes), parent, tuple(tokens), 4, 0, "full_attention", None, ids
        )

    a = req("a", T[:9])
    admit(mgr, a)  # [1, 2, 3]; 9 // 4 = 2 full blocks stored
    h = list(a.block_hashes)
    assert mgr.take_events() == [stored(h[:2], (1, 2), None, T[:8])]
    assert mgr.take_events() == []
    for t in (1, 2):
        decode(mgr, a, t)  # 10, 11 tokens: nothing new is full
    assert mgr.take_events() == []
    decode(mgr, a, 3)  # 12 tokens: block 3 full, parent = block 2's hash
    h = list(a.block_hashes)
    assert mgr.take_events() == [stored([h[2]], (3,), h[1], [T[8], 1, 2, 3])]

    assert mgr.reset_prefix_cache() is False  # a holds blocks
    assert mgr.block_pool.num_cached_blocks == 3
    mgr.free(a)  # queue [4, 5, 3, 2, 1]
    c = req("c", range(400, 412))
    admit(mgr, c)  # 3 blocks: 4, 5, then 3 (evicted)
    assert ids(mgr, "c") == ([4, 5, 3],)
    hc = list(c.block_hashes)
    assert mgr.take_events() == [
        BlockRemoved((h[2],), 0),
        stored(hc[:3], (4, 5, 3), None, range(400, 412)),
    ]
    mgr.free(c)
    assert mgr.reset_prefix_cache() is True
    assert mgr.take_events() == [AllBlocksCleared()]
    assert mgr.block_pool.num_cached_blocks == 0
    blocks, hit = mgr.get_computed_blocks(req("d", T[:9]))
    assert hit == 0
    assert blocks.get_block_ids() == ([],)


def test_usage_is_used_over_usable_blocks():
    mgr = make_manager([fa(4)], num_blocks=11)  # 10 usable
    assert mgr.usage == 0.0
    a = req("a", T[:10])
    admit(mgr, a)  # 3 blocks
    assert mgr.usage == pytest.approx(3 / 10)
    b = req("b", [*T[:8], 1, 2, 3])
    admit(mgr, b)  # 2 shared + 1 new -> 4 distinct blocks in use
    assert mgr.usage == pytest.approx(4 / 10)
    assert mgr.get_num_free_blocks() == 6
    mgr.free(a)  # a's own block 3 is freed; 1, 2 stay with b
    assert mgr.usage == pytest.approx(3 / 10)
    mgr.free(b)
    assert mgr.usage == 0.0  # cached but free blocks do not count
    assert mgr.block_pool.num_cached_blocks == 2


def test_allocation_rejects_a_request_hashed_at_another_size() -> None:
    """Even a request that skips reading the cache would store its blocks under
    keys of the wrong granularity, so its first allocation is refused."""
    mgr = make_manager([fa(4)], num_blocks=10)
    r = Request("x", list(range(16)), hash_block_size=8, skip_reading_prefix_cache=True)
    with pytest.raises(kvcore.InvalidRequestError, match=r"'x'.*hash_block_size=4"):
        mgr.allocate_slots(r, 16)
    assert mgr.get_num_free_blocks() == 9


def test_window_hit_covers_the_extra_retained_tokens() -> None:
    """A window that keeps extra tokens needs them cached for a hit too: the
    hit get_computed_blocks returns must be one allocate_slots accepts."""
    import kvcore
    from kvcore.coordinator import KVCacheManager, make_requests
    from kvcore_sliding_window import SlidingWindowSpec

    spec = SlidingWindowSpec(
        block_size=64,
        num_kv_heads=1,
        head_size=100,
        dtype=torch.bfloat16,
        sliding_window=100,
        extra_retained_tokens=64,
    )
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout="BLHNC", enable_prefix_caching=True
        ),
        max_model_len=1100,
    )
    registry = REGISTRY
    plan = kvcore.plan_kv_cache(config, {"l0": spec}, 2**28, registry=registry)
    manager = KVCacheManager.from_plan(plan, registry=registry)
    a, b = make_requests(2, 1000, plan.hash_block_size, common_prefix_len=570)
    manager.allocate_slots(a, 1000)
    a.num_computed_tokens = 1000
    manager.free(a)
    blocks, hit = manager.get_computed_blocks(b)
    # 512 tokens hit; the token after them reads 99 + 64 = 163 tokens back,
    # blocks 5..7 (cdiv(163, 64) = 3 blocks), all cached.
    assert hit == 512
    assert [blk == 0 for blk in blocks.ids[0]] == [True] * 5 + [False] * 3
    assert (
        manager.allocate_slots(
            b,
            b.num_tokens - hit,
            num_new_computed_tokens=hit,
            new_computed_blocks=blocks,
        )
        is not None
    )
