"""Stateful test of ``KVCacheManager`` over hybrid plans.

A hypothesis state machine plays a scheduler against small pools (so
allocations are refused) with prompts drawn from a few shared prefixes or cut
from earlier requests' tokens (so prefix hits happen): admit, follow up,
re-admit, continue prefill, decode, preempt, finish.  After
every step the pool and every block table are checked against a reference
model kept here: who holds which block, what each table must look like, what
must be hashed, and that a refused allocation changed nothing.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import kvcore
from kvcore import KVCacheConfig, KVCacheGroupSpec
from kvcore.coordinator import (
    BlockHashWithGroupId,
    BlockPool,
    FixedBlocksManager,
    KVCacheBlocks,
    KVCacheManager,
    Request,
    hashes_at_block_size,
)
from kvcore_circular_buffer import CircularBufferSpec
from kvcore_full_attention import FullAttentionSpec
from kvcore_hisparse import HiSparseHotSpec
from kvcore_mamba import MambaManager, MambaSpec
from kvcore_mla import MLAAttentionSpec
from kvcore_sliding_window import (
    SlidingWindowManager,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

MAX_MODEL_LEN = 512
MAX_LIVE = 7  # running + waiting requests at once
MAX_TOKENS = 140  # no decode past this many tokens


def _fa(bs: int) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float16
    )


def _mla(bs: int, tps: int = 1) -> MLAAttentionSpec:
    return MLAAttentionSpec(
        block_size=bs,
        num_kv_heads=1,
        head_size=16,
        dtype=torch.float16,
        tokens_per_state=tps,
    )


def _sw(bs: int, window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=bs,
        num_kv_heads=1,
        head_size=8,
        dtype=torch.float16,
        sliding_window=window,
    )


def _sw_mla(bs: int, window: int) -> SlidingWindowMLASpec:
    return SlidingWindowMLASpec(
        block_size=bs,
        num_kv_heads=1,
        head_size=16,
        dtype=torch.float16,
        sliding_window=window,
    )


def _mamba(bs: int, mode: str) -> MambaSpec:
    return MambaSpec(
        block_size=bs, shapes=((2, 4),), dtypes=(torch.float32,), mamba_cache_mode=mode
    )


def _ring(bs: int) -> CircularBufferSpec:
    return CircularBufferSpec(
        block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float16
    )


def _hot(bs: int, n: int) -> HiSparseHotSpec:
    return HiSparseHotSpec(block_size=bs, page_size=64, blocks_per_request=n)


#: name -> (group specs, num_blocks, scheduler block, hash block)
PLANS: dict[str, tuple[list[Any], int, int, int]] = {
    "full": ([_fa(4)], 24, 4, 4),
    "full_sw": ([_fa(4), _sw(4, 8)], 40, 4, 4),
    "full_sw_mamba_ring": (
        [_fa(4), _sw(4, 8), _mamba(4, "align"), _ring(4)],
        44,
        4,
        4,
    ),
    "mla_swmla_ring_hot": (
        [_mla(8), _sw_mla(4, 8), _ring(8), _hot(4, 2)],
        44,
        8,
        4,
    ),
    # Partial hits: Mamba block 8 > hash 4 -> hits align to 4 tokens, finer
    # than the 16-token full-attention block.
    "partial_fa16_sw_mamba8": (
        [_fa(16), _sw(4, 8), _mamba(8, "align"), _ring(4)],
        56,
        16,
        4,
    ),
    "two_fa_sizes_sw_mamba_none": (
        [_fa(4), _fa(8), _sw(4, 12), _mamba(8, "none")],
        64,
        8,
        4,
    ),
    # Copy-on-write hits in a DeepSeek-V4 shape: MLA blocks of 16 tokens
    # (one group compressed 4 to a state), an SW-MLA window of 4-token
    # blocks, a ring; hash 4 -> hits on multiples of 4 inside MLA blocks.
    "mla16_tps4_swmla_ring": (
        [_mla(16), _mla(16, tps=4), _sw_mla(4, 4), _ring(4)],
        72,
        16,
        4,
    ),
}

# Three shared prefixes of 64 tokens; tails come from a tiny vocabulary so
# different requests also collide after the prefix.
PREFIXES = [[(p * 7919 + i * 104729) % 30011 + 10 for i in range(64)] for p in range(3)]
# Chunks of 8, 24 and 40 end on Mamba-8 boundaries that are not full-
# attention-16 boundaries: the partial-hit plan's interesting case.
CHUNKS = st.sampled_from([1, 3, 4, 8, 12, 16, 24, 40, 64])


def _window_block_serves(m: SlidingWindowManager, i: int, cached: int) -> bool:
    """Whether a window group hashes block ``i`` once ``cached`` tokens are
    computed: hits are multiples of the hit alignment, so a block is kept
    only if the window before the end of its alignment unit reads it, and
    only once that unit is complete."""
    bs = m.block_size
    per_unit, rest = divmod(m.hit_alignment, bs)
    if rest or per_unit <= 1:
        return True
    unit_end = (i // per_unit + 1) * per_unit
    if unit_end * bs > cached:
        return False
    return m.kv_cache_spec.skipped_tokens(unit_end * bs) // bs <= i


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _key(pool: BlockPool, b: int) -> BlockHashWithGroupId | None:
    """Block ``b``'s prefix-cache key ``(block hash, group id)``, else None."""
    h = pool.key_hash[b]
    return None if h is None else (h, pool.key_group[b])


class CoordinatorMachine(RuleBasedStateMachine):
    PLAN: ClassVar[str] = "full"
    USE_EAGLE: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        specs, num_blocks, sched, hash_bs = PLANS[self.PLAN]
        groups = [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)]
        config = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
        )
        self.mgr = KVCacheManager(
            config,
            max_model_len=MAX_MODEL_LEN,
            scheduler_block_size=sched,
            hash_block_size=hash_bs,
            enable_caching=True,
            use_eagle=self.USE_EAGLE,
        )
        self.num_blocks = num_blocks
        self.hash_bs = hash_bs
        self.managers = self.mgr.coordinator.single_type_managers
        self.running: dict[str, Request] = {}
        self.waiting: list[Request] = []
        # Reference model per running request.
        #: num_computed_tokens when its last successful allocate_slots ran.
        self.nc_at_alloc: dict[str, int] = {}
        #: tokens covered by its tables after the last allocation.
        self.allocated: dict[str, int] = {}
        #: tokens hashed (cache_blocks) by the last allocation.
        self.cached: dict[str, int] = {}
        #: token lists of every request so far (follow-ups reuse them).
        self.history: list[list[int]] = []
        self.counter = 0
        #: The reference content of every block of a position-indexed group
        #: that keeps its tokens (not a recurrent state): block id -> slot
        #: -> the token whose KV the slot holds.  A block handed out fresh
        #: holds nothing; a copy copies the source's slots; a step writes the
        #: tokens it computes.
        self.content: dict[int, dict[int, int]] = {}
        self.copies_seen = 0

    # -- helpers --------------------------------------------------------------

    def _snapshot(self) -> object:
        pool = self.mgr.block_pool
        return (
            [(pool.ref_cnt[b], _key(pool, b)) for b in range(pool.num_blocks)],
            pool.free_queue.get_all_free_blocks(),
            pool.get_num_free_blocks(),
            {rid: self.mgr.get_block_ids(rid) for rid in self.running},
            [dict(m.num_cached_block) for m in self.managers],
            pool.num_cached_blocks,
            pool.num_partial_keys,
        )

    def _check_hit(self, r: Request, blocks: KVCacheBlocks, hit: int) -> None:
        coordinator = self.mgr.coordinator
        assert 0 <= hit <= r.num_tokens - 1
        assert hit % coordinator.cache_hit_alignment == 0
        assert len(blocks.ids) == len(self.managers)
        for gid, (m, hit_blocks) in enumerate(
            zip(self.managers, blocks.ids, strict=True)
        ):
            if not m.caching:
                assert len(hit_blocks) == 0, f"group {gid} is not cacheable"
                continue
            # Every cacheable group serves exactly the common hit; a group
            # with copy-on-write hits may end inside its last block.
            partial = gid in coordinator.partial_units and hit % m.block_size
            want = _cdiv(hit, m.block_size) if partial else hit // m.block_size
            assert len(hit_blocks) == want, (gid, len(hit_blocks), hit)
            if not hit:
                continue
            hashes = hashes_at_block_size(r.block_hashes, self.hash_bs, m.block_size)
            pool = self.mgr.block_pool
            for i, b in enumerate(hit_blocks):
                if b == 0:
                    assert m.skips_blocks, f"null block in group {gid}'s hit"
                elif partial and i == want - 1:
                    chunk = r.block_hashes[hit // self.hash_bs - 1]
                    assert _key(pool, b) == (
                        hashes[i] if i < len(hashes) else None,
                        gid,
                    ) or pool.has_partial_key(b, chunk, gid), (gid, i)
                else:
                    assert _key(pool, b) == (hashes[i], gid)
                # No hit serves a slot whose content is not this request's.
                if self._tracks(m) and b != 0:
                    slots = self.content.get(b, {})
                    for slot in range(min(m.block_size, hit - i * m.block_size)):
                        pos = i * m.block_size + slot
                        assert slots.get(slot) == r.all_token_ids[pos], (gid, b, pos)
            assert hit_blocks[-1] != 0
            if isinstance(m, SlidingWindowManager):
                need = _cdiv(m.kv_cache_spec.sliding_window - 1, m.block_size)
                tail = hit_blocks[-need:]
                assert 0 not in tail
            if isinstance(m, MambaManager):
                assert all(b == 0 for b in hit_blocks[:-1])
        if self.PLAN == "full" and hit + 4 <= r.num_tokens - 1:
            # The hit is the longest: the next block is not cached.
            assert self.mgr.block_pool.lookup(r.block_hashes[hit // 4], 0) is None

    def _allocate(
        self,
        r: Request,
        n: int,
        hit: int = 0,
        blocks: KVCacheBlocks | None = None,
    ) -> bool:
        before = self._snapshot()
        nc0 = r.num_computed_tokens
        out = self.mgr.allocate_slots(r, n, hit, blocks)
        if out is None:
            assert self._snapshot() == before, "a refused allocation changed state"
            assert r.num_computed_tokens == nc0
            return False
        assert isinstance(out, KVCacheBlocks)
        self._model_step(r, out, nc0 + hit, nc0 + hit + n, hit)
        self.nc_at_alloc[r.request_id] = nc0
        self.allocated[r.request_id] = nc0 + hit + n
        self.cached[r.request_id] = min(nc0 + hit + n, r.num_tokens)
        r.num_computed_tokens = nc0 + hit + n
        return True

    def _tracks(self, m: Any) -> bool:
        return (
            m.position_indexed
            and not isinstance(m, MambaManager)
            and not isinstance(m, FixedBlocksManager)
        )

    def _model_step(
        self, r: Request, out: KVCacheBlocks, start: int, end: int, hit: int
    ) -> None:
        """The engine's side of a step: fresh blocks hold nothing, the copies
        run (each source's slots below its count into its destination, at the
        position the hit ends in), then the step's tokens are written."""
        for group in out.ids:
            for b in group:
                self.content[b] = {}
        tables = self.mgr.get_blocks(r.request_id).ids
        for copy in out.copies:
            m = self.managers[copy.group_id]
            assert hit
            assert hit % m.block_size == copy.num_tokens
            # The destination is the fresh block at the hit's last position.
            assert tables[copy.group_id][hit // m.block_size] == copy.dst_block_id
            src = self.content.get(copy.src_block_id, {})
            self.content[copy.dst_block_id] = {
                slot: tok for slot, tok in src.items() if slot < copy.num_tokens
            }
            self.copies_seen += 1
        if not out.copies:
            for gid in self.mgr.coordinator.partial_units:
                m = self.managers[gid]
                assert not (hit % m.block_size), "a partial hit recorded no copy"
        for m, table in zip(self.managers, tables, strict=True):
            if not self._tracks(m):
                continue
            bs = m.block_size
            for pos in range(start, min(end, r.num_tokens)):
                b = table[pos // bs]
                if b != 0:
                    self.content.setdefault(b, {})[pos % bs] = r.all_token_ids[pos]

    def _admit(self, r: Request, chunk: int) -> None:
        blocks, hit = self.mgr.get_computed_blocks(r)
        self._check_hit(r, blocks, hit)
        n = min(chunk, r.num_tokens - hit)
        if self._allocate(r, n, hit, blocks):
            self.running[r.request_id] = r
        else:
            with pytest.raises(kvcore.UnknownRequestError):
                self.mgr.get_block_ids(r.request_id)
            self.waiting.append(r)

    def _forget(self, rid: str) -> None:
        for d in (self.nc_at_alloc, self.allocated, self.cached):
            d.pop(rid, None)

    # -- rules ----------------------------------------------------------------

    @initialize()
    def start(self) -> None:
        assert self.mgr.get_num_free_blocks() == self.num_blocks - 1

    @precondition(lambda self: len(self.running) + len(self.waiting) < MAX_LIVE)
    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        prefix_len=st.sampled_from([0, 3, 8, 16, 17, 24, 32, 40, 48, 64]),
        tail=st.lists(st.integers(0, 2), min_size=1, max_size=20),
        chunk=CHUNKS,
    )
    def new_request(
        self, prefix: int, prefix_len: int, tail: list[int], chunk: int
    ) -> None:
        self._new(PREFIXES[prefix][:prefix_len] + tail, chunk)

    @precondition(
        lambda self: self.history and len(self.running) + len(self.waiting) < MAX_LIVE
    )
    @rule(
        source=st.integers(0, 1000),
        cut=st.integers(1, 200),
        tail=st.lists(st.integers(0, 2), min_size=1, max_size=12),
        chunk=CHUNKS,
    )
    def follow_up(self, source: int, cut: int, tail: list[int], chunk: int) -> None:
        """A request continuing an earlier one (a chat turn): the earlier
        request's tokens, outputs included, cut anywhere, then new tokens."""
        tokens = self.history[source % len(self.history)]
        self._new(tokens[: min(cut, len(tokens))] + tail, chunk)

    def _new(self, tokens: list[int], chunk: int) -> None:
        self.counter += 1
        r = Request(f"r{self.counter}", tokens, hash_block_size=self.hash_bs)
        self.history.append(r.all_token_ids)  # grows with r's outputs
        self._admit(r, chunk)

    @precondition(lambda self: self.waiting)
    @rule(index=st.integers(0, MAX_LIVE), chunk=CHUNKS)
    def readmit(self, index: int, chunk: int) -> None:
        r = self.waiting.pop(index % len(self.waiting))
        self._admit(r, chunk)

    def _pick(self, index: int, prefill: bool) -> Request | None:
        cands = [
            r
            for r in self.running.values()
            if (r.num_computed_tokens < r.num_tokens) == prefill
            and (prefill or r.num_tokens < MAX_TOKENS)
        ]
        return cands[index % len(cands)] if cands else None

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, MAX_LIVE), chunk=CHUNKS)
    def prefill(self, index: int, chunk: int) -> None:
        r = self._pick(index, prefill=True)
        if r is None:
            return
        self._allocate(r, min(chunk, r.num_tokens - r.num_computed_tokens))

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, MAX_LIVE), token=st.integers(0, 2))
    def decode(self, index: int, token: int) -> None:
        r = self._pick(index, prefill=False)
        if r is None:
            return
        # The token sampled by the last step; if this step is refused it
        # stays appended and a later prefill/decode step schedules it.
        r.append_output_token_ids(token)
        self._allocate(r, 1)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, MAX_LIVE))
    def preempt(self, index: int) -> None:
        rid = sorted(self.running)[index % len(self.running)]
        r = self.running.pop(rid)
        self.mgr.free(r)
        self._forget(rid)
        r.num_computed_tokens = 0
        self.waiting.append(r)
        with pytest.raises(kvcore.UnknownRequestError):
            self.mgr.get_block_ids(rid)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, MAX_LIVE))
    def finish(self, index: int) -> None:
        rid = sorted(self.running)[index % len(self.running)]
        r = self.running.pop(rid)
        self.mgr.free(r)
        self._forget(rid)
        with pytest.raises(kvcore.UnknownRequestError):
            self.mgr.free(r)

    # -- invariants -------------------------------------------------------------

    @invariant()
    def pool_matches_tables(self) -> None:
        pool = self.mgr.block_pool
        holders: Counter[int] = Counter()
        group_of: dict[int, int] = {}
        for rid in self.running:
            for gid, table in enumerate(self.mgr.get_block_ids(rid)):
                for bid in table:
                    if bid == 0:
                        continue
                    holders[bid] += 1
                    # A block id belongs to one group at a time.
                    assert group_of.setdefault(bid, gid) == gid, (bid, gid)
        ref = pool.ref_cnt
        assert pool.null_block == 0
        for b in range(pool.num_blocks):
            assert ref[b] >= 0
            if b == 0:
                assert _key(pool, b) is None
                continue
            # Reference count == number of table entries holding the block;
            # a block in several tables must be a shared cached block.
            assert ref[b] == holders.get(b, 0), (pool.block(b), holders.get(b))
            if holders.get(b, 0) > 1:
                full = _key(pool, b)
                assert full is not None, pool.block(b)
                assert full[1] == group_of[b]
        free_blocks = pool.free_queue.get_all_free_blocks()
        free_set = set(free_blocks)
        assert len(free_set) == len(free_blocks) == pool.get_num_free_blocks()
        assert free_set == {b for b in range(pool.num_blocks) if b != 0 and ref[b] == 0}
        used = len(holders)
        assert pool.get_num_free_blocks() + used == self.num_blocks - 1
        assert self.mgr.usage == pytest.approx(used / (self.num_blocks - 1))
        hashed = [(b, h) for b, h in enumerate(pool.key_hash) if h is not None]
        assert pool.num_cached_blocks == len(hashed)
        for b, h in hashed:
            assert pool.lookup(h, pool.key_group[b]) is not None
        keyed = [
            (b, keys) for b, keys in enumerate(pool.partial_keys) if keys is not None
        ]
        assert pool.num_partial_keys == sum(len(keys) for _, keys in keyed)
        assert set(pool.partial_group) == {b for b, _ in keyed}
        for b, keys in keyed:
            group = pool.partial_group[b]
            assert group in self.mgr.coordinator.partial_units
            for key in keys:
                assert pool.has_partial_key(b, key, group)
                assert pool.lookup_partial(key, [group]) is not None

    @invariant()
    def tables_match_the_model(self) -> None:
        for rid, r in self.running.items():
            pool = self.mgr.block_pool
            tables = self.mgr.get_blocks(rid).ids
            nc0 = self.nc_at_alloc[rid]
            allocated = self.allocated[rid]
            cached = self.cached[rid]
            for gid, (m, table) in enumerate(zip(self.managers, tables, strict=True)):
                if isinstance(m, FixedBlocksManager):
                    assert len(table) == m.fixed_blocks
                    assert all(b != 0 and _key(pool, b) is None for b in table)
                    continue
                # Position-indexed: one entry per block of allocated tokens.
                assert len(table) == _cdiv(allocated, m.block_size), (gid, len(table))
                hashes = hashes_at_block_size(
                    r.block_hashes, self.hash_bs, m.block_size
                )
                for i, b in enumerate(table):
                    if self._tracks(m) and b != 0:
                        # Every computed slot holds this request's token.
                        slots = self.content.get(b, {})
                        for slot in range(m.block_size):
                            pos = i * m.block_size + slot
                            if pos < r.num_computed_tokens and pos < r.num_tokens:
                                assert slots.get(slot) == r.all_token_ids[pos]
                    key = _key(pool, b)
                    if key is not None:
                        # Hashed under this request's own chained hash, and
                        # only once its tokens are computed.
                        assert key == (hashes[i], gid), (rid, gid, i)
                        assert (i + 1) * m.block_size <= cached, (rid, gid, i, cached)
                if isinstance(m, SlidingWindowManager):
                    spec = m.kv_cache_spec
                    dead = spec.skipped_tokens(nc0) // m.block_size
                    # Below the window: only the windows a running request
                    # keeps (pinned) where its hit ended and at its branch
                    # point, at most two windows, each block hashed.
                    below = [i for i, b in enumerate(table[:dead]) if b != 0]
                    assert set(below) <= set(m.pinned.get(rid, ())), (rid, gid)
                    reads = _cdiv(m.window_tokens, m.block_size) + 1
                    assert len(below) <= 2 * reads, (rid, gid, below)
                    for i in below:
                        assert _key(pool, table[i]) is not None, (rid, gid, i)
                    # Live full blocks of computed tokens are hashed exactly
                    # when some aligned hit reads them.
                    for i in range(dead, cached // m.block_size):
                        b = table[i]
                        if b != 0 and m.caching:
                            want = _window_block_serves(m, i, cached)
                            assert (_key(pool, b) is not None) == want, (gid, i)
                elif isinstance(m, MambaManager):
                    dead = max(nc0 - 1, 0) // m.block_size
                    # Below the read state: only the states a running request
                    # holds (its hit's, its branch point, the shared state on
                    # its path), each hashed.
                    below = [i for i, b in enumerate(table[:dead]) if b != 0]
                    assert len(below) <= 3, (rid, gid, below)
                    assert set(below) <= set(m.pinned.get(rid, ())), (rid, gid)
                    for i in below:
                        assert _key(pool, table[i]) is not None, (rid, gid, i)
                    # The state read, the one written, and the checkpoints
                    # the policy keeps inside the step, each hashed once its
                    # tokens are computed.
                    extra = m.kv_cache_spec.checkpoint_blocks_per_step
                    real = [i for i, b in enumerate(table) if b != 0]
                    assert len(real) <= 2 + extra, (rid, gid, table)
                    assert table[-1] != 0
                    # (Between the read state and the last position.)
                    for i in real:
                        if (
                            dead < i < len(table) - 1
                            and (i + 1) * m.block_size <= cached
                        ):
                            assert _key(pool, table[i]) is not None, (rid, gid, i)
                    if cached and cached % m.unit == 0:
                        last = table[cached // m.block_size - 1]
                        assert _key(pool, last) is not None
                else:  # full attention / MLA keep every block
                    assert 0 not in table
                    assert all(
                        _key(pool, b) is not None
                        for b in table[: cached // m.block_size]
                    )

    def teardown(self) -> None:
        for r in list(self.running.values()):
            self.mgr.free(r)
        self.running.clear()
        pool = self.mgr.block_pool
        assert pool.get_num_free_blocks() == self.num_blocks - 1
        assert all(cnt == 0 for cnt in pool.ref_cnt)
        assert self.mgr.usage == 0.0
        assert self.mgr.reset_prefix_cache() is True
        assert pool.num_cached_blocks == 0


#: Runs of each machine in the slow run (``python -m pytest -m slow``, the
#: ``...AllExamples`` twins below) and in the default run.
SETTINGS = settings(
    max_examples=25,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


QUICK_EXAMPLES = 8
QUICK_PARTIAL_EXAMPLES = 30


def _machine(plan: str) -> type[RuleBasedStateMachine]:
    return type(f"Machine_{plan}", (CoordinatorMachine,), {"PLAN": plan})


TestFull = _machine("full").TestCase
TestFullSW = _machine("full_sw").TestCase
TestFullSWMambaRing = _machine("full_sw_mamba_ring").TestCase
TestMLASWMLARingHot = _machine("mla_swmla_ring_hot").TestCase
TestPartialHits = _machine("partial_fa16_sw_mamba8").TestCase
TestTwoFASizesSWMambaNone = _machine("two_fa_sizes_sw_mamba_none").TestCase
TestMLACopyOnWrite = _machine("mla16_tps4_swmla_ring").TestCase
TestMLACopyOnWriteEagle = type(
    "Machine_mla_eagle",
    (CoordinatorMachine,),
    {"PLAN": "mla16_tps4_swmla_ring", "USE_EAGLE": True},
).TestCase
TestPartialHitsEagle = type(
    "Machine_partial_eagle",
    (CoordinatorMachine,),
    {"PLAN": "partial_fa16_sw_mamba8", "USE_EAGLE": True},
).TestCase
for _case in (
    TestMLACopyOnWrite,
    TestMLACopyOnWriteEagle,
    TestPartialHitsEagle,
    TestFull,
    TestFullSW,
    TestFullSWMambaRing,
    TestMLASWMLARingHot,
    TestTwoFASizesSWMambaNone,
):
    _case.settings = settings(SETTINGS, max_examples=QUICK_EXAMPLES)
del _case
# The plan where hit alignment (4) is finer than a full-attention block (16)
# needs more runs to reach a hit that ends inside a full-attention block.
PARTIAL_HITS = settings(SETTINGS, max_examples=120)
TestPartialHits.settings = settings(PARTIAL_HITS, max_examples=QUICK_PARTIAL_EXAMPLES)


# The slow run's twins: each machine with the full SETTINGS (PARTIAL_HITS).
@pytest.mark.slow
class TestMLACopyOnWriteAllExamples(TestMLACopyOnWrite):
    settings = SETTINGS


@pytest.mark.slow
class TestMLACopyOnWriteEagleAllExamples(TestMLACopyOnWriteEagle):
    settings = SETTINGS


@pytest.mark.slow
class TestPartialHitsEagleAllExamples(TestPartialHitsEagle):
    settings = SETTINGS


@pytest.mark.slow
class TestFullAllExamples(TestFull):
    settings = SETTINGS


@pytest.mark.slow
class TestFullSWAllExamples(TestFullSW):
    settings = SETTINGS


@pytest.mark.slow
class TestFullSWMambaRingAllExamples(TestFullSWMambaRing):
    settings = SETTINGS


@pytest.mark.slow
class TestMLASWMLARingHotAllExamples(TestMLASWMLARingHot):
    settings = SETTINGS


@pytest.mark.slow
class TestTwoFASizesSWMambaNoneAllExamples(TestTwoFASizesSWMambaNone):
    settings = SETTINGS


@pytest.mark.slow
class TestPartialHitsAllExamples(TestPartialHits):
    settings = PARTIAL_HITS


def test_plans_are_what_they_claim() -> None:
    """The plans exercise what the machine is meant to cover."""
    for name, (specs, num_blocks, sched, hash_bs) in PLANS.items():
        groups = [KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)]
        mgr = KVCacheManager(
            KVCacheConfig(
                num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
            ),
            max_model_len=MAX_MODEL_LEN,
            scheduler_block_size=sched,
            hash_block_size=hash_bs,
        )
        cacheable = sum(len(g.group_ids) for g in mgr.coordinator.attention_groups)
        assert cacheable == sum(m.caching for m in mgr.coordinator.single_type_managers)
        assert cacheable >= 1, name
    partial = PLANS["partial_fa16_sw_mamba8"]
    groups = [KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(partial[0])]
    mgr = KVCacheManager(
        KVCacheConfig(
            num_blocks=partial[1], kv_cache_tensors=[], kv_cache_groups=groups
        ),
        max_model_len=MAX_MODEL_LEN,
        scheduler_block_size=partial[2],
        hash_block_size=partial[3],
    )
    assert mgr.coordinator.cache_hit_alignment == 4
