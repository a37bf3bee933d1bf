"""A shadow model drives ``KVCacheManager`` with seeded random traces.

The model knows, from each group's spec alone, how many blocks a request
must hold after a step (``spec.num_blocks_held``) and which of its table
positions a step releases (the spec's skip rule).  After every step it
checks the manager against that: each table holds exactly the blocks the
spec says, the pool lends out exactly the blocks live tables hold (nothing
that no computation reads), a refused step really needed more blocks than
the pool could give, a successful step took exactly what it needed, and at
the end every block is free.

Traces mix shared prefixes (prefix hits, partial hits), chunked prefill,
decode and preemption (``free`` with the request sent back to waiting).
``KVCORE_SHADOW_EXAMPLES`` raises the number of traces per plan (default 3).
"""

from __future__ import annotations

import collections
import math
import os
import random
from typing import Any

import pytest
import torch
from coordinator_setup import zoo_manager

import kvcore
from kvcore import KindRegistry, KVCacheConfig, KVCacheGroupSpec
from kvcore.checkpoints import (
    CHECKPOINT_POLICIES,
    CheckpointPolicy,
    checkpoint_policy,
)
from kvcore.coordinator import KVCacheManager, Request
from kvcore.coordinator.managers import WindowManager
from kvcore_circular_buffer import CircularBufferSpec
from kvcore_full_attention import FullAttentionSpec
from kvcore_hisparse import HiSparseHotSpec
from kvcore_mamba import MambaSpec
from kvcore_sliding_window import SlidingWindowSpec

#: A test-only named policy (registered per test): dense interval states.
GRID_POLICY = "test-grid"
EXAMPLES = int(os.environ.get("KVCORE_SHADOW_EXAMPLES", "3"))
STEPS = 60


def released_below(spec: Any, num_computed: int, block_size: int) -> int:
    """Leading positions a step with ``num_computed`` computed tokens no
    longer reads, from the spec's rules: an align-mode Mamba state keeps only
    the state after the last computed token; everything else skips its
    ``skipped_tokens`` in whole blocks."""
    if isinstance(spec, MambaSpec):
        if spec.mamba_cache_mode == "align" and num_computed > 0:
            return (num_computed - 1) // block_size
        return 0
    return int(spec.skipped_tokens(num_computed)) // block_size


class Shadow:
    """The independent model of one manager's requests."""

    def __init__(self, mgr: KVCacheManager, rng: random.Random) -> None:
        self.mgr = mgr
        self.rng = rng
        managers = mgr.coordinator.single_type_managers
        self.specs = [m.kv_cache_spec for m in managers]
        self.block_sizes = [m.block_size for m in managers]
        self.positioned = [m.position_indexed for m in managers]
        self.usable = mgr.block_pool.num_blocks - 1
        self.unit = mgr.scheduler_block_size
        self.prefixes = [
            [rng.randrange(1, 30000) for _ in range(rng.randrange(1, 4) * self.unit)]
            for _ in range(3)
        ]
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.count = 0
        #: Copy-on-write copies applied so far.
        self.copies = 0
        #: (request id, group) -> leading positions a prefix hit left null in
        #: a Mamba "all" table: a hit restores only the state at its end, so
        #: the states before it are never held (num_blocks_held counts a
        #: state per block, the whole prefix included).
        self.hit_gap: dict[tuple[str, int], int] = {}
        #: (request id, group) -> token positions an align-mode state group
        #: still keeps a checkpoint at, from the policy's own rules.
        self.targets: dict[tuple[str, int], list[int]] = {}
        #: (request id, group) -> its branch-point target, and the positions
        #: it holds below its read position (see states_held).
        self.branch_at: dict[tuple[str, int], int] = {}
        #: (request id, group) -> the interval targets still ahead.
        self.grid: dict[tuple[str, int], list[int]] = {}
        self.holding: dict[tuple[str, int], set[int]] = {}
        #: (group, tokens) -> {key: block id}: the shared states, a branch
        #: point a step kept or a state two admissions resumed from.
        self.shared: dict[tuple[int, int], dict[Any, int]] = {}
        #: (group, block id, key) -> admissions that resumed from it.
        self.resumed: dict[tuple[int, int, Any], int] = {}
        #: The shared state the admission being planned holds (0: none).
        self.path_block = 0
        #: Requests being planned without their optional checkpoints.
        self.shedding: set[str] = set()
        #: Writer -> the state blocks of its latest step (those its tokens
        #: span): written only by that step's forward, so no admission's
        #: hit may end on one until the writer's next step or free.
        self.unwritten: dict[str, set[int]] = {}
        #: Window groups that hold back (beside groups keeping every block):
        #: a running request keeps the window at its hit's end and at its
        #: branch point in its table (pinned), in that group's hit units.
        self.pinning = [
            m.hit_alignment
            if isinstance(m, WindowManager) and m.caching and m.holds_back
            else 0
            for m in managers
        ]
        #: (request id, group) -> the table positions it pins.
        self.pins: dict[tuple[str, int], set[int]] = {}
        alignment = mgr.coordinator.cache_hit_alignment
        self.state_units = [
            math.lcm(m.block_size, alignment, mgr.hash_block_size)
            if isinstance(m.kv_cache_spec, MambaSpec)
            and m.kv_cache_spec.mamba_cache_mode == "align"
            and m.caching
            else 0
            for m in managers
        ]
        #: Groups whose hit resumes from a recurrent state (every caching
        #: Mamba group in "align" or "all" mode): no hit may end on a state
        #: a step took until its writer's next call.
        self.resumes_state = [
            isinstance(m.kv_cache_spec, MambaSpec)
            and m.kv_cache_spec.mamba_cache_mode in ("align", "all")
            and m.caching
            for m in managers
        ]
        #: Block sizes of the groups whose step reads the old state while it
        #: writes the new one (every Mamba group in "align" mode): one per
        #: group, an admission leaves free what they take at the running
        #: requests' busiest coming boundary.
        self.overlapping = [
            m.block_size
            for m in managers
            if isinstance(m.kv_cache_spec, MambaSpec)
            and m.kv_cache_spec.mamba_cache_mode == "align"
        ]

    # -- the model ------------------------------------------------------------

    def headroom(self) -> int:
        """The blocks an admission leaves free beside the running requests:
        per overlapping group, the most running requests whose steps end on
        one token modulo its block size, plus those still prefilling and the
        admitted one (they cross every step); none with nothing running."""
        if not self.running:
            return 0
        prefilling = 1 + sum(
            1 for r in self.running if r.num_tokens - r.num_computed_tokens > 1
        )
        ends = [
            r.num_computed_tokens
            for r in self.running
            if r.num_tokens - r.num_computed_tokens <= 1
        ]
        return sum(
            max(collections.Counter(e % bs for e in ends).values(), default=0)
            + prefilling
            for bs in self.overlapping
        )

    def tables(self, rid: str) -> tuple[list[int], ...]:
        return self.mgr.get_block_ids(rid)

    def holders(self) -> dict[int, int]:
        """block id -> how many live table entries hold it."""
        out: dict[int, int] = {}
        for r in self.running:
            for table in self.tables(r.request_id):
                for bid in table:
                    if bid:
                        out[bid] = out.get(bid, 0) + 1
        return out

    def plan_step(
        self,
        r: Request,
        num_computed: int,
        num_tokens: int,
        hit: tuple[list[int], ...] | None,
    ) -> tuple[list[int], int, int, int]:
        """(blocks each group must hold after the step, blocks the step takes
        from the free queue, blocks it returns to it, free copy sources it
        holds during the step).  A hit that ends inside a block of a
        copy-on-write group does not attach that block: the request gets a
        fresh one and the engine copies the source into it; the source is
        held only for the step."""
        pool = self.mgr.block_pool
        partial_units = self.mgr.coordinator.partial_units
        live = r in self.running
        holders = self.holders() if live else {}
        expected: list[int] = []
        take = give = held = 0
        for g, spec in enumerate(self.specs):
            bs = self.block_sizes[g]
            after = int(spec.num_blocks_held(num_computed, num_tokens, bs))
            if isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "all":
                if not live:
                    gap = len(hit[g]) - 1 if hit is not None and hit[g] else 0
                    self.hit_gap[r.request_id, g] = gap
                after -= self.hit_gap.get((r.request_id, g), 0)
            unit = self.state_units[g]
            held_below: set[int] = set()
            if self.pinning[g]:
                held_below = self.window_pins(r, g, num_computed)
                after += len(held_below)
            if unit:
                after += self.checkpoints_inside(r, g, unit, num_computed, num_tokens)
                self.path_block = 0
                held_below = self.states_held(r, g, hit, num_computed)
                after += len(held_below)
                if not live and self.path_block and pool.ref_cnt[self.path_block]:
                    take -= 1  # another request holds it: not from the free queue
            expected.append(after)
            if not self.positioned[g]:
                if not live:
                    take += after
                continue
            below = released_below(spec, num_computed, bs)
            if live:
                table = self.tables(r.request_id)[g]
                kept = sum(1 for bid in table[below:] if bid) + len(held_below)
                give += sum(
                    1
                    for i, bid in enumerate(table[:below])
                    if bid and holders[bid] == 1 and i not in held_below
                )
            else:
                blocks = hit[g] if hit is not None else []
                if (
                    g in partial_units
                    and num_computed % bs
                    and len(blocks) == -(-num_computed // bs)
                ):
                    held += pool.ref_cnt[blocks[-1]] == 0
                    blocks = blocks[:-1]
                kept = sum(1 for bid in blocks[below:] if bid)
                take += sum(
                    1 for bid in blocks[below:] if bid and pool.ref_cnt[bid] == 0
                )
            take += after - kept
        return expected, take, give, held

    def window_pins(self, r: Request, g: int, num_computed: int) -> set[int]:
        """Positions below the release line a window group keeps holding:
        the windows of the hit's end and of the branch point the admission
        found, each rounded down to the group's hit unit (those before the
        hit's window were never taken: a branch point below a re-admitted
        request's hit)."""
        key = (r.request_id, g)
        bs = self.block_sizes[g]
        below = released_below(self.specs[g], num_computed, bs)
        if r.request_id in self.shedding:
            # The step does not fit with them: released like the rest.
            self.pins[key] = set()
        elif r not in self.running:
            unit = self.pinning[g]
            skipped = self.specs[g].skipped_tokens
            points = (num_computed, min(r.shared_prefix_tokens, r.num_prompt_tokens))
            self.pins[key] = {
                pos
                for point in points
                if point >= unit
                for pos in range(
                    int(skipped(point - point % unit)) // bs,
                    (point - point % unit) // bs,
                )
                if pos >= below
            }
        return {p for p in self.pins.get(key, ()) if p < below}

    def states_held(
        self,
        r: Request,
        g: int,
        hit: tuple[list[int], ...] | None,
        num_computed: int,
    ) -> set[int]:
        """Positions below the read position an align-mode state group still
        holds under a policy with ``hold_shared``: the state the request's
        hit resumed from, and its branch point once a step reached it."""
        key = (r.request_id, g)
        policy = checkpoint_policy(self.specs[g].checkpoint_policy)
        if not policy.hold_shared:
            return set()
        bs = self.block_sizes[g]
        if r not in self.running:
            self.holding[key] = set()
            if hit is not None and hit[g] and hit[g][-1]:
                self.holding[key].add(len(hit[g]) - 1)
                path = self.agreed_path(r, g, num_computed - 1)
                if path is not None and r.request_id not in self.shedding:
                    self.holding[key].add(path[0] // bs - 1)
                    self.path_block = path[1]
        if r.request_id in self.shedding:
            # The step does not fit with them: held states become old ones
            # (at admission the hit's state is taken after, and held).
            if r in self.running:
                self.holding[key] = set()
            self.branch_at[key] = -1
        held = self.holding.setdefault(key, set())
        branch = self.branch_at.get(key, -1)
        if 0 < branch <= num_computed:
            held.add(branch // bs - 1)
        read = (num_computed - 1) // bs if num_computed > 0 else 0
        return {p for p in held if p < read}

    def key_at(self, r: Request, tokens: int) -> Any:
        """The cache key of ``r``'s prefix of ``tokens`` tokens, or None."""
        hash_size = self.mgr.hash_block_size
        chunk = tokens // hash_size - 1
        if tokens % hash_size or not 0 <= chunk < len(r.block_hashes):
            return None
        return r.block_hashes[chunk]

    def shared_on_path(self, r: Request, g: int, limit: int) -> tuple[int, int] | None:
        """(tokens, block id) of the longest shared state of group ``g`` at or
        below ``limit`` tokens on ``r``'s path that is still cached: the one
        an admission holds besides its hit's."""
        pool = self.mgr.block_pool
        best = None
        for (group, tokens), states in self.shared.items():
            if group != g or tokens > limit or (best and tokens <= best[0]):
                continue
            key = self.key_at(r, tokens)
            bid = states.get(key)
            if bid is None:
                continue
            if pool.key_hash[bid] == key and pool.key_group[bid] == g:
                best = (tokens, bid)
        return best

    def agreed_path(self, r: Request, g: int, limit: int) -> tuple[int, int] | None:
        """:meth:`shared_on_path` agreed among ``g``'s twins (state groups of
        one spec and block size): the longest position every twin holds a
        shared state at, or none."""
        twins = [
            t
            for t, unit in enumerate(self.state_units)
            if unit
            and self.specs[t] == self.specs[g]
            and self.block_sizes[t] == self.block_sizes[g]
        ]
        found = {t: self.shared_on_path(r, t, limit) for t in twins}
        while True:
            if any(f is None for f in found.values()):
                return None
            lowest = min(f[0] for f in found.values() if f is not None)
            if all(f is not None and f[0] == lowest for f in found.values()):
                return found[g]
            found = {
                t: f
                if f is not None and f[0] == lowest
                else self.shared_on_path(r, t, lowest)
                for t, f in found.items()
            }

    def record_shared(
        self,
        r: Request,
        hit_ids: tuple[list[int], ...] | None,
        num_computed: int,
        num_tokens: int,
        tables: tuple[list[int], ...],
    ) -> None:
        """After a step: the states it made shared (a second admission
        resuming from one, a branch point the step kept)."""
        for g, unit in enumerate(self.state_units):
            if not unit:
                continue
            bs = self.block_sizes[g]
            if hit_ids is not None and hit_ids[g] and hit_ids[g][-1]:
                tokens = len(hit_ids[g]) * bs
                key = self.key_at(r, tokens)
                bid = hit_ids[g][-1]
                count = self.resumed.get((g, bid, key), 0) + 1
                self.resumed[g, bid, key] = count
                if count == 2:
                    self.shared.setdefault((g, tokens), {})[key] = bid
            branch = self.branch_at.get((r.request_id, g), -1)
            if num_computed < branch <= num_tokens:
                bid = tables[g][branch // bs - 1]
                key = self.key_at(r, branch)
                if bid and key is not None:
                    self.shared.setdefault((g, branch), {})[key] = bid

    def checkpoints_inside(
        self, r: Request, g: int, unit: int, num_computed: int, num_tokens: int
    ) -> int:
        """Checkpoint blocks an align-mode state group takes inside this step
        besides its last position, by the policy's rules: at admission the
        prompt's last boundaries (for a longer prompt, and for the same one
        again) and the branch point its lookup found; each is taken by the
        step whose positions reach it."""
        key = (r.request_id, g)
        policy = checkpoint_policy(self.specs[g].checkpoint_policy)
        if r not in self.running:
            prompt = r.num_prompt_tokens
            marks: set[int] = set()
            if policy.prompt_end:
                marks |= {prompt - prompt % unit, prompt - 1 - (prompt - 1) % unit}
            branch = -1
            if policy.branch_points:
                shared = min(r.shared_prefix_tokens, prompt)
                branch = shared - shared % unit
                marks.add(branch)
            grid: set[int] = set()
            if policy.interval:
                # Every interval of the prompt's new part, doubled until
                # one state a point in every state group takes at most the
                # policy's share of the pool, or 4 points (GRID_MIN_POINTS).
                every = -(-policy.interval // unit) * unit
                start = max(num_computed, branch)
                keeping = sum(1 for u in self.state_units if u)
                budget = max(
                    (self.usable + 1) * policy.interval_pool_share, 4 * keeping
                )
                while policy.interval_pool_share and (
                    (prompt - start) // every * keeping > budget
                ):
                    every *= 2
                first = start // every + 1
                grid = {every * i for i in range(first, prompt // every + 1)} - marks
            self.targets[key] = sorted(t for t in marks if t > num_computed)
            self.grid[key] = sorted(t for t in grid if t > num_computed)
            self.branch_at[key] = branch if branch > num_computed else -1
        if r.request_id in self.shedding:
            self.targets[key] = []
            self.grid[key] = []
        bs = self.block_sizes[g]
        start, end = -(-num_computed // bs), -(-num_tokens // bs)
        if end <= start:
            return 0
        inside = sum(
            1 for t in self.targets.get(key, ()) if start <= t // bs - 1 < end - 1
        )
        spaced = sum(
            1 for t in self.grid.get(key, ()) if start <= t // bs - 1 < end - 1
        )
        if spaced:
            # At most interval_per_step of them: every k-th.
            k = -(-spaced // policy.interval_per_step)
            inside += -(-spaced // k)
        return inside

    def check_pool(self) -> None:
        held = set(self.holders())
        taken = self.usable - self.mgr.get_num_free_blocks()
        assert taken == len(held), (
            f"{taken} blocks are out of the pool but live tables hold {len(held)}"
        )

    # -- the scheduler ----------------------------------------------------------

    def new_request(self) -> Request:
        rng = self.rng
        self.count += 1
        # Shared prefixes cut at multiples of the hit alignment, so hits end
        # inside blocks where copy-on-write hits allow it.
        hit_unit = self.mgr.coordinator.cache_hit_alignment
        cut = rng.randrange(0, 3 * self.unit // hit_unit + 1) * hit_unit
        prefix = rng.choice(self.prefixes)[:cut]
        tail = [rng.randrange(1, 30000) for _ in range(rng.randrange(1, 3 * self.unit))]
        return Request(
            f"r{self.count}", prefix + tail, hash_block_size=self.mgr.hash_block_size
        )

    def step(self, r: Request, num_new: int, *, admit: bool) -> bool:
        mgr = self.mgr
        hit_blocks = None
        hit = 0
        hit_ids: tuple[list[int], ...] | None = None
        self.unwritten.pop(r.request_id, None)  # its last step has run
        if admit:
            hit_blocks, hit = mgr.get_computed_blocks(r)
            hit_ids = hit_blocks.get_block_ids() if hit else None
        pending = set().union(*self.unwritten.values())
        waits = hit_ids is not None and any(
            reads and hit_ids[g] and hit_ids[g][-1] in pending
            for g, reads in enumerate(self.resumes_state)
        )
        num_computed = r.num_computed_tokens + hit
        num_new = min(num_new, r.num_tokens - num_computed)
        num_tokens = num_computed + num_new
        expected, take, give, held = self.plan_step(
            r, num_computed, num_tokens, hit_ids
        )
        free = mgr.get_num_free_blocks()
        room = free - self.headroom() if admit else free
        keys = [(r.request_id, g) for g, u in enumerate(self.state_units) if u]
        pin_keys = [(r.request_id, g) for g, u in enumerate(self.pinning) if u]
        saved_pins = {k: set(self.pins.get(k, ())) for k in pin_keys}
        if take + held > room + give and (
            any(
                self.targets.get(k) or self.grid.get(k) or self.holding.get(k)
                for k in keys
            )
            or any(saved_pins.values())
        ):
            # Checkpoints are optional: the step is tried without them.
            saved = [
                (
                    k,
                    list(self.targets.get(k, ())),
                    set(self.holding.get(k, ())),
                    self.branch_at.get(k, -1),
                    list(self.grid.get(k, ())),
                )
                for k in keys
            ]
            self.shedding.add(r.request_id)
            shed = self.plan_step(r, num_computed, num_tokens, hit_ids)
            self.shedding.discard(r.request_id)
            if shed[1] + shed[3] <= room + shed[2]:
                expected, take, give, held = shed
            else:
                for k, targets, holding, branch, grid in saved:
                    self.targets[k], self.holding[k] = targets, holding
                    self.branch_at[k], self.grid[k] = branch, grid
                self.pins.update(saved_pins)
        out = mgr.allocate_slots(r, num_new, hit, hit_blocks if hit else None)
        if out is None and waits:
            assert mgr.get_num_free_blocks() == free
            self.check_pool()
            return False
        assert not waits, f"{r.request_id}: admitted on a state not yet written"
        if out is None:
            assert take + held > room + give, (
                f"{r.request_id}: refused with {free} free ({room} beside the "
                f"headroom) + {give} released but the step needs {take} "
                f"(+{held} copy sources held)"
            )
            assert mgr.get_num_free_blocks() == free
            self.check_pool()
            return False
        assert mgr.get_num_free_blocks() == free - take + give
        if admit:
            self.waiting.remove(r)
            self.running.append(r)
        tables = self.tables(r.request_id)
        # The step's forward writes the states of every block its tokens
        # span: its new blocks and the one it continues in.
        taken = {
            bid
            for g, reads in enumerate(self.resumes_state)
            if reads
            for bid in tables[g][
                num_computed // self.block_sizes[g] : -(
                    -num_tokens // self.block_sizes[g]
                )
            ]
            if bid
        }
        if taken:
            self.unwritten[r.request_id] = taken
        self.check_copies(r, out.copies, hit, hit_ids, tables)
        self.record_shared(r, hit_ids, num_computed, num_tokens, tables)
        for g, table in enumerate(tables):
            assert sum(1 for bid in table if bid) == expected[g], (
                f"{r.request_id} group {g} ({self.specs[g].kind}) holds "
                f"{sum(1 for bid in table if bid)} blocks after covering "
                f"{num_tokens} tokens with {num_computed} computed; the spec "
                f"says {expected[g]}"
            )
        r.num_computed_tokens = num_tokens
        if r.num_computed_tokens == r.num_tokens:
            r.append_output_token_ids(self.rng.randrange(1, 30000))
        self.check_pool()
        return True

    def check_copies(
        self,
        r: Request,
        copies: Any,
        hit: int,
        hit_ids: tuple[list[int], ...] | None,
        tables: tuple[list[int], ...],
    ) -> None:
        """Apply the copies as the engine would: one per copy-on-write group
        whose hit ends inside a block, from the hit's last block into the
        fresh block at that position (and none otherwise)."""
        want = []
        for g in sorted(self.mgr.coordinator.partial_units):
            bs = self.block_sizes[g]
            if hit_ids is not None and hit % bs:
                src = hit_ids[g][-1]
                dst = tables[g][hit // bs]
                assert dst != src
                assert self.mgr.block_pool.ref_cnt[dst] == 1
                want.append((g, src, dst, hit % bs))
        got = [
            (c.group_id, c.src_block_id, c.dst_block_id, c.num_tokens) for c in copies
        ]
        assert got == want, (r.request_id, got, want)
        self.copies += len(got)

    def free(self, r: Request, *, preempt: bool) -> None:
        self.mgr.free(r)
        self.unwritten.pop(r.request_id, None)
        self.running.remove(r)
        if preempt:
            r.num_computed_tokens = 0
            self.waiting.append(r)
        self.check_pool()

    def run(self, steps: int) -> None:
        rng = self.rng
        limit = self.mgr.max_model_len - 2
        for _ in range(steps):
            action = rng.random()
            if action < 0.3 or not (self.waiting or self.running):
                self.waiting.append(self.new_request())
            if self.waiting and rng.random() < 0.5:
                r = rng.choice(self.waiting)
                self.step(r, rng.randrange(1, 3 * self.unit), admit=True)
            elif self.running:
                r = rng.choice(self.running)
                if r.num_tokens >= limit or rng.random() < 0.1:
                    self.free(r, preempt=rng.random() < 0.5)
                else:
                    left = r.num_tokens - r.num_computed_tokens
                    self.step(r, rng.randrange(1, left + 1), admit=False)
        for r in list(self.running):
            self.free(r, preempt=False)
        assert self.mgr.get_num_free_blocks() == self.usable


# ---------------------------------------------------------------------------
# plans
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", kvcore.tools.zoo.names())
def test_shadow_model_over_every_model_file(
    name: str, zoo_registry: KindRegistry
) -> None:
    for seed in range(EXAMPLES):
        rng = random.Random(f"{name}-{seed}")
        mgr = zoo_manager(name, zoo_registry, rng.choice([40, 80, 200]))
        Shadow(mgr, rng).run(STEPS)


def attn(cls: Any, block_size: int = 4, **kw: Any) -> Any:
    return cls(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16, **kw
    )


def hybrid(name: str, registry: KindRegistry) -> list[Any]:
    chunked = registry["chunked_local_attention"].spec_type
    mamba = lambda mode, bs=8, policy="turns": MambaSpec(  # noqa: E731
        block_size=bs,
        shapes=((2, 4),),
        dtypes=(torch.float32,),
        mamba_cache_mode=mode,
        checkpoint_policy=policy,
    )
    fa = attn(FullAttentionSpec)
    return {
        "replay_window": [
            fa,
            attn(SlidingWindowSpec, sliding_window=8, bounded_replay=True),
        ],
        "window": [fa, attn(SlidingWindowSpec, sliding_window=6)],
        # Full attention in 8-token blocks over a 4-token hash: hits end
        # inside its blocks (copy-on-write).
        "wide_full": [
            attn(FullAttentionSpec, block_size=8),
            attn(SlidingWindowSpec, sliding_window=6),
        ],
        "chunked_local": [fa, attn(chunked, attention_chunk_size=8)],
        "mamba_align": [fa, mamba("align")],
        # Full attention in 8-token blocks beside 4-token states: hits end
        # inside its blocks (copy-on-write) at the states' ends.
        "mamba_wide_full": [attn(FullAttentionSpec, block_size=8), mamba("align", 4)],
        # A state every 8 tokens of a prompt's new part, at most 1 a step.
        "mamba_grid": [fa, mamba("align", policy=GRID_POLICY)],
        "mamba_all": [fa, mamba("all")],
        "mamba_none": [fa, mamba("none")],
        "three_kinds": [
            fa,
            attn(SlidingWindowSpec, sliding_window=5, extra_retained_tokens=2),
            mamba("align"),
        ],
        # Twin groups (one spec each, so stepped a class at a time), runs of
        # a class interleaved with other classes.
        "twins": [
            fa,
            mamba("align"),
            fa,
            mamba("align"),
            attn(SlidingWindowSpec, sliding_window=6),
            attn(SlidingWindowSpec, sliding_window=6),
        ],
        "mamba_grid_twins": [
            fa,
            mamba("align", policy=GRID_POLICY),
            mamba("align", policy=GRID_POLICY),
        ],
        "mamba_all_twins": [fa, mamba("all"), mamba("all")],
        "fixed_blocks": [
            fa,
            attn(CircularBufferSpec),
            HiSparseHotSpec(block_size=4, page_size=64, blocks_per_request=2),
        ],
    }[name]


@pytest.mark.parametrize(
    ("name", "hash_bs", "dcp", "partial"),
    [
        ("replay_window", 4, 1, True),
        ("window", 4, 1, True),
        ("chunked_local", 4, 1, True),
        ("mamba_align", 4, 1, True),
        ("mamba_align", 2, 1, True),  # hashes finer than a Mamba block
        ("mamba_wide_full", 4, 1, True),
        ("mamba_grid", 4, 1, True),
        ("mamba_grid", 2, 1, True),
        ("mamba_all", 4, 1, True),
        ("mamba_none", 4, 1, True),
        ("three_kinds", 4, 1, True),
        ("fixed_blocks", 4, 1, True),
        ("twins", 4, 1, True),
        ("mamba_grid_twins", 4, 1, True),
        ("mamba_all_twins", 4, 1, True),
        ("wide_full", 4, 1, True),
        ("wide_full", 4, 1, False),
        # Decode context parallelism: attention blocks of 4 cover 8 tokens
        # (beside 8-token windows and states, so hits stay whole blocks).
        ("window", 4, 2, True),
        ("mamba_align", 4, 2, True),
        ("three_kinds", 4, 2, True),
    ],
)
def test_shadow_model_over_hand_made_hybrids(
    name: str,
    hash_bs: int,
    dcp: int,
    partial: bool,
    zoo_registry: KindRegistry,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(CHECKPOINT_POLICIES, GRID_POLICY, CheckpointPolicy())
    specs = hybrid(name, zoo_registry)
    groups = [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)]
    sched = 8
    copies = 0
    # The plans whose hits end inside full-attention blocks: enough seeds
    # that some admission copies (one whose state or source its writer's
    # step has not written waits, and often hits elsewhere later).
    copying = partial and name in ("wide_full", "mamba_wide_full")
    for seed in range(max(EXAMPLES, 8) if copying else EXAMPLES):
        rng = random.Random(f"{name}-{hash_bs}-{dcp}-{partial}-{seed}")
        # A dense grid, whole or thinned to a quarter of these small pools.
        monkeypatch.setitem(
            CHECKPOINT_POLICIES,
            GRID_POLICY,
            CheckpointPolicy(
                interval=8,
                interval_per_step=1,
                interval_pool_share=random.Random(seed).choice([0, 1 / 4]),
            ),
        )
        config = KVCacheConfig(
            num_blocks=rng.choice([12, 24, 48]),
            kv_cache_tensors=[],
            kv_cache_groups=groups,
        )
        mgr = KVCacheManager(
            config,
            max_model_len=96,
            scheduler_block_size=sched,
            hash_block_size=hash_bs,
            registry=zoo_registry,
            dcp=dcp,
            enable_partial_hits=partial,
        )
        if not partial:
            assert not mgr.coordinator.partial_units
        shadow = Shadow(mgr, rng)
        shadow.run(STEPS)
        copies += shadow.copies
    if copying:
        # Hits end inside their full-attention blocks: copies were made.
        assert copies > 0
