"""The generic manager of recurrent states: :class:`CheckpointManager`
(Mamba and linear-attention states), a state kept at block boundaries where
later requests are likely to resume; a hit is one saved state.  Exported by
:mod:`kvcore.coordinator.managers` with the other generic managers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any, ClassVar, cast

from kvcore.checkpoints import (
    CHECKPOINT_POLICIES,
    DEFAULT_CHECKPOINT_POLICY,
    CheckpointPolicy,
    CheckpointPolicyError,
    grid_interval,
)
from kvcore.coordinator.block_pool import BlockPool
from kvcore.coordinator.hashing import hashes_at_block_size
from kvcore.coordinator.manager import HitQuery, SingleTypeManager
from kvcore.coordinator.output_ends import OutputEnds
from kvcore.coordinator.request import Request
from kvcore.coordinator.state_kept import checkpoints_kept, interval_states_kept
from kvcore.coordinator.step_ends import ChunkEnds, replace_step_ends
from kvcore.coordinator.undo import put_at_each, put_entry
from kvcore.spec import HitPolicy, cdiv

__all__ = ["CheckpointManager"]


class CheckpointManager(SingleTypeManager):
    """A recurrent state, kept where later requests are likely to resume.

    The table is indexed by position: the block at position ``i`` holds the
    state after the tokens up to the end of block ``i`` (or up to the step's
    last token, for the step's last position).  A step writes its final
    state into its last position and, at every other position of the step
    that holds a real block, the state at that block's end; every other
    position is the null block.  Only the newest state is read again, so
    older positions are released after each step, unless
    :meth:`keeps_every_state` says to keep them all.

    With prefix caching on, the group's :meth:`checkpoint_policy` chooses
    which states are hashed for later requests (see
    :mod:`kvcore.checkpoints`): only states on a multiple of the
    hit unit (:attr:`unit`), since a hit ends only there.  A block finer
    than the hash block is fine: the unit is a multiple of the hash block.
    """

    reads_hit_before_step: ClassVar[bool] = True

    hit_policies: ClassVar[frozenset[HitPolicy]] = frozenset({HitPolicy.CHECKPOINT})
    skips_blocks: ClassVar[bool] = True
    # The state is written at the last computed position; slots past it for
    # speculative tokens would move it.
    supports_lookahead: ClassVar[bool] = False
    accepts_coarse_hashes: ClassVar[bool] = True
    plans_checkpoints: ClassVar[bool] = True
    evicts_last: ClassVar[bool] = True
    # States are keyed at targets and step ends, all on hit boundaries,
    # which are chunk ends (see cache_twins); a table grows only past its
    # end, as counted.
    caches_at_chunk_ends: ClassVar[bool] = True
    grows_by_count: ClassVar[bool] = True
    # The step reads the state at the old position and writes the new one.
    boundary_overlap = 1

    def __init__(self, spec: Any, block_pool: BlockPool, **kwargs: Any) -> None:
        super().__init__(spec, block_pool, **kwargs)
        self.keep_all = self.keeps_every_state(spec)
        if self.keep_all:
            self.boundary_overlap = 0  # every block stays: none is given back
        policy: object = self.checkpoint_policy(spec)
        if not isinstance(policy, CheckpointPolicy):
            msg = (
                f"{type(self).__name__}.checkpoint_policy returned {policy!r}; it "
                "must return a kvcore.coordinator.CheckpointPolicy"
            )
            raise CheckpointPolicyError(msg)
        self.policy = policy
        #: Hits end on multiples of this many tokens, so only states there
        #: are worth keeping.
        self.unit = math.lcm(self.block_size, self.hit_alignment, self.hash_block_size)
        self._targets_on = self.caching and not self.keep_all and policy.places_targets
        self._step_ends = self.caching and (self.keep_all or policy.keeps_step_ends)
        self._replaces = not (self.keep_all or policy.every_step)
        self.keeps_releases = not self._replaces
        self._holds_shared = self.caching and not self.keep_all and policy.hold_shared
        #: Whether prompts carried output ends back (with step ends replaced):
        #: one evidence for a class of twins (see assembly.share_evidence).
        self.output_ends = OutputEnds(min(block_pool.num_blocks, 1 << 16))
        self._weighs_ends = self._step_ends and self._replaces
        #: Whether this group counts the prompts for its class's evidence
        #: (the first twin; every group on its own).
        self._notes_prompts = True
        #: Whether its twins share the evidence (frees then name themselves).
        self._shares_evidence = False
        #: request id -> the output ends its prompt passed through (counted
        #: at admission, undone by forget_checkpoints unless it was admitted).
        self._returned: dict[str, list[Any]] = {}
        #: freed request id -> (block, key) of the output-end state that
        #: take_released_checkpoints moves to the spare blocks.
        self._spared: dict[str, tuple[int, Any]] = {}
        #: request id -> token positions still to checkpoint, ascending.
        self.targets: dict[str, list[int]] = {}
        #: request id -> (position, block, key) of its newest step-end
        #: state, which the next one replaces.
        self.step_end: dict[str, tuple[int, int, Any]] = {}
        #: With EAGLE: request id -> the step-end state before the newest,
        #: kept too (a hit drops a block, so it may end there).
        self.step_before: dict[str, tuple[int, int, Any]] = {}
        #: request id -> checkpoint blocks it kept (refreshed in the
        #: eviction order when the request is freed).
        #: Each with the key it was cached under: a block evicted since may
        #: hold another request's content.
        self.kept: dict[str, list[tuple[int, Any]]] = {}
        #: request id -> interval states it kept while the group holds back
        #: (see :meth:`kept_if_room_twins`), each with the key it was cached under.
        self.spaced: dict[str, list[tuple[int, Any]]] = {}
        #: freed request id -> the kept blocks :meth:`take_released_checkpoints`
        #: hands the coordinator once.
        self._released_kept: dict[str, list[tuple[int, Any]]] = {}
        #: request id -> the branch-point target planned at admission.
        self.branch: dict[str, int] = {}
        #: request id -> its targets that only the interval placed (thinned
        #: per step; kept like the others only where the group holds back,
        #: see :meth:`kept_if_room_twins`).
        self.grid: dict[str, frozenset[int]] = {}
        #: Shared states (branch points, and states more than one request
        #: resumed from) by the tokens they resume after: key -> block.
        #: Entries evicted since are skipped, and pruned with hit_counts.
        self.shared_states: dict[int, dict[Any, int]] = {}
        self._num_shared = 0
        #: State block -> (the key it was hit under, hits under that key).
        self.hit_counts: dict[int, tuple[Any, int]] = {}
        #: request id -> (tokens, block, key) of the longest shared state
        #: below its hit on its prompt's path, found at admission: the
        #: request holds it while it runs.
        self.on_path: dict[str, tuple[int, int, Any]] = {}

    def keeps_every_state(self, spec: Any) -> bool:
        """Whether every block-boundary state stays for the request's life
        (more blocks held, more resume points); only the newest by default."""
        return False

    def checkpoint_policy(self, spec: Any) -> CheckpointPolicy:
        """Which states are kept for later requests; the default policy
        (``turns``: prompt end, output end, branch points) unless a kind's
        manager chooses another, for example from a field of its spec."""
        return CHECKPOINT_POLICIES[DEFAULT_CHECKPOINT_POLICY]

    # -- where the checkpoints go -----------------------------------------------

    def plan_checkpoints(self, request: Request, num_computed_tokens: int) -> None:
        """At admission: the positions inside the request's coming steps
        whose states the policy keeps (after ``num_computed_tokens``, the
        hit included)."""
        rid = request.request_id
        if self._weighs_ends and self._notes_prompts:
            found = self.output_ends.note_prompt(request.block_hashes)
            if found:
                self._returned[rid] = found
        path = None
        if self._holds_shared and self.shared_states:
            path = self._shared_on_path(request, num_computed_tokens - 1)
        if path is not None:
            self.on_path[rid] = path
        else:
            self.on_path.pop(rid, None)
        if not self._targets_on:
            return
        policy = self.policy
        unit = self.unit
        prompt = request.num_prompt_tokens
        marks: set[int] = set()
        if policy.prompt_end:
            # The prompt extended (a longer prompt, the next turn) resumes at
            # its last boundary; the same prompt again at the last boundary
            # before its final token, which is always recomputed.
            last = (prompt - 1) - (prompt - 1) % unit
            marks.add(last)
            if self.use_eagle:
                # Every hit drops a block: a lookup reaching ``last`` ends a
                # block earlier when the state's own block bounds it, so the
                # boundary before is kept too (instead of the prompt's end,
                # which only a longer prompt reaches).
                marks.add(last - unit)
            else:
                marks.add(prompt - prompt % unit)
        branch = -1
        if policy.branch_points:
            shared = min(request.shared_prefix_tokens, prompt)
            branch = shared - shared % unit
            marks.add(branch)
        grid: set[int] = set()
        if policy.interval:
            # Only the part of the prompt no earlier request shared: a
            # shared part has its branch point.
            start = max(num_computed_tokens, branch)
            cost, pool = self.grid_point_cost, self.block_pool.num_blocks
            every = cdiv(policy.interval, unit) * unit
            every = grid_interval(every, prompt - start, cost, pool, self.grid_share)
            grid.update(range(start - start % every + every, prompt + 1, every))
            grid -= marks
        targets = sorted(t for t in marks | grid if t > num_computed_tokens)
        if targets:
            self.targets[rid] = targets
        else:
            self.targets.pop(rid, None)
        if grid:
            self.grid[rid] = frozenset(grid)
        else:
            self.grid.pop(rid, None)
        if branch > num_computed_tokens:
            self.branch[rid] = branch
        else:
            self.branch.pop(rid, None)

    @staticmethod
    def agree_on_path(twins: Sequence[CheckpointManager], request: Request) -> None:
        """Make twin groups hold the shared state at one position for an
        admission (the longest every twin holds, or none): each twin's own
        search may find a different one where one twin's state was evicted
        and another's not, and twins keep equal tables."""
        found = [t.on_path.get(request.request_id) for t in twins]
        if all(f is None for f in found):
            return
        while True:
            if any(f is None for f in found):
                for twin in twins:
                    twin.on_path.pop(request.request_id, None)
                return
            lowest = min(f[0] for f in found if f is not None)
            if all(f is not None and f[0] == lowest for f in found):
                break
            found = [
                f
                if f is not None and f[0] == lowest
                else t._shared_on_path(request, lowest)
                for t, f in zip(twins, found, strict=True)
            ]
        for twin, f in zip(twins, found, strict=True):
            if f is not None:
                twin.on_path[request.request_id] = f

    def shed_checkpoints(self, request_id: str) -> Any:
        # No checkpoint inside the coming steps; the states it holds for
        # others become ordinary old states, released before the step
        # (the pins, as the base class sheds them).
        targets = self.targets.get(request_id)
        path = self.on_path.get(request_id)
        pins = super().shed_checkpoints(request_id)
        if pins is None and not targets and path is None:
            return None
        stores = self._shed_stores
        for store in stores:
            self._save(store, request_id)
        return (pins, *(store.pop(request_id, None) for store in stores))

    def restore_checkpoints(self, request_id: str, state: Any) -> None:
        pins, *values = state
        if pins is not None:
            super().restore_checkpoints(request_id, pins)
        for store, value in zip(self._shed_stores, values, strict=True):
            if value is not None:
                store[request_id] = value

    @property
    def _shed_stores(self) -> tuple[dict[str, Any], ...]:
        """The per-request plans a shed step gives up besides the pins."""
        return (self.targets, self.branch, self.grid, self.on_path)

    def forget_checkpoints(self, request_id: str) -> None:
        """Drop what :meth:`plan_checkpoints` planned for a request that was
        not admitted after all (it holds no blocks)."""
        if request_id not in self.req_to_blocks:
            self.targets.pop(request_id, None)
            self.branch.pop(request_id, None)
            self.grid.pop(request_id, None)
            self.on_path.pop(request_id, None)
            returned = self._returned.pop(request_id, None)
            if returned is not None:
                self.output_ends.unnote_prompt(returned)

    def _inner_targets(self, request_id: str, start: int, end: int) -> list[int]:
        """Table positions in ``[start, end - 1)`` that a target state
        ends: they take a block besides the step's last position.  Of the
        interval targets, at most ``interval_per_step``: every k-th, counted
        from the step's end."""
        targets = self.targets.get(request_id)
        if not targets:
            return []
        block_size = self.block_size
        grid = self.grid.get(request_id)
        out = []
        spaced = []
        for t in targets:
            pos = t // block_size - 1
            if pos >= end - 1:
                break
            if pos >= start:
                if grid is not None and t in grid:
                    spaced.append(pos)
                else:
                    out.append(pos)
        if spaced:
            cap = self.policy.interval_per_step
            if len(spaced) > cap:
                spaced = spaced[::-1][:: cdiv(len(spaced), cap)]
            out = sorted(out + spaced)
        return out

    # -- allocation -------------------------------------------------------------

    def admission_blocks(
        self, hit: Sequence[int], num_computed_tokens: int
    ) -> list[int]:
        """The hit, with the null block at the positions no step reads again
        and, where no hit block holds the state the first step starts from
        (a KV connector loads it), the null block at its position too: that
        position takes a fresh block when the request is admitted (see
        :meth:`allocate_twins`), for the connector to write and the step to
        read."""
        out = super().admission_blocks(hit, num_computed_tokens)
        if num_computed_tokens <= 0 or self.keep_all:
            return out  # nothing read yet, or every position takes a block
        read = (num_computed_tokens - 1) // self.block_size
        if len(out) > read:
            return out
        return [*out, *[self.null_block] * (read + 1 - len(out))]

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[int],
    ) -> int:
        held = self.req_to_blocks.get(request_id)
        have = len(new_computed_blocks) + (len(held) if held is not None else 0)
        # An admission whose starting state no hit holds: a block for it.
        loaded = held is None and bool(new_computed_blocks)
        loaded = loaded and not new_computed_blocks[-1]
        target = cdiv(num_tokens, self.block_size)
        # Every missing position gets a state block, or only the newest and
        # the checkpoints inside the step.
        if self.keep_all:
            need = max(target - have, 0)
        elif target > have:
            need = 1
            if self.targets:
                need += len(self._inner_targets(request_id, have, target))
        else:
            need = 0
        ref = self.block_pool.ref_cnt
        for block in new_computed_blocks:
            if block and ref[block] == 0:
                need += 1
        if (
            held is None
            and self.on_path
            and new_computed_blocks
            and new_computed_blocks[-1]
        ):
            # Held with a hit's state (see add_computed_blocks).
            path = self.on_path.get(request_id)
            if path is not None and ref[path[1]] == 0:
                need += 1  # the shared state it will hold leaves the free queue
        return need + loaded

    def allocate_twins(
        self, twins: Sequence[SingleTypeManager], request_id: str, num_tokens: int
    ) -> list[list[int]] | None:
        held = self.req_to_blocks.get(request_id)
        start = 0 if held is None else len(held)
        end = cdiv(num_tokens, self.block_size)
        missing = end - start
        # Just admitted with its starting state's position null (see
        # admission_blocks): the state a connector loads takes a block.
        loaded = held is not None and len(held) > 0 and not held[-1]
        if held is not None and missing <= 0 and not loaded:
            return None
        self.record_twins(twins, request_id)
        if held is None:
            for twin in twins:
                twin.req_to_blocks[request_id] = []
        if loaded:
            self._give_loaded_state(twins, request_id, start - 1)
        if missing <= 0:
            return None
        # Every missing position gets a state block, or only the step's last
        # and the checkpoints inside it.
        inner = (
            []
            if self.keep_all or not self.targets
            else self._inner_targets(request_id, start, end)
        )
        need = missing if self.keep_all else 1 + len(inner)
        new = self.block_pool.get_new_blocks(need * len(twins))
        out = (
            [new]
            if len(twins) == 1
            else [new[i : i + need] for i in range(0, len(new), need)]
        )
        if need == missing:
            # Every missing position takes a block.
            for twin, blocks in zip(twins, out, strict=True):
                twin.req_to_blocks[request_id] += blocks
            return out
        null = self.null_block
        for twin, blocks in zip(twins, out, strict=True):
            table = twin.req_to_blocks[request_id]
            extension = [null] * missing
            for pos, block in zip(inner, blocks, strict=False):
                extension[pos - start] = block
            # The step's final state is written at its last position.
            extension[-1] = blocks[-1]
            table.extend(extension)
        return out

    def _give_loaded_state(
        self, twins: Sequence[SingleTypeManager], request_id: str, pos: int
    ) -> None:
        """Put a fresh block at position ``pos`` of each twin's table, where
        a just-admitted request's first step reads a state no hit holds; the
        position is no longer counted as released."""
        fresh = self.block_pool.get_new_blocks(len(twins))
        tables = [twin.req_to_blocks[request_id] for twin in twins]
        # Written in place: a rollback puts the null block back.
        self.block_pool.record(put_at_each, tables, [pos], [[t[pos]] for t in tables])
        for twin, block in zip(twins, fresh, strict=True):
            twin.req_to_blocks[request_id][pos] = block
            if twin.num_released.get(request_id, 0) > pos:
                twin.num_released[request_id] = pos

    def state_writes(self, request_id: str, start: int, end: int) -> list[int]:
        """The token counts after which a step computing tokens ``start`` to
        ``end`` must write the request's state, ascending, each into table
        position ``cdiv(t, block_size) - 1``: the step's end, and the end of
        every block of the step that holds a real block before its last
        position (a checkpoint the policy keeps inside the step; every block
        with :meth:`keeps_every_state`).  A step starting inside a block
        reads its state from that block; the state at the block's end is
        written back into it only where the policy may keep it there.  Call
        after the step's allocation."""
        if end <= start:
            return []
        blocks = self.req_to_blocks.get(request_id, ())
        size = self.block_size
        last = min(cdiv(end, size) - 1, len(blocks))
        first = cdiv(start, size)
        if start % size and (self.keep_all or self._targets_on):
            first -= 1
        out = [(pos + 1) * size for pos in range(first, last) if blocks[pos]]
        out.append(end)
        return out

    # -- caching ----------------------------------------------------------------

    def cache_twins(
        self, twins: Sequence[SingleTypeManager], request: Request, num_tokens: int
    ) -> None:
        """Key the states the policy keeps once ``num_tokens`` are computed,
        in each of ``twins`` (see :meth:`SingleTypeManager.cache_twins`):
        which states is decided once for the class, from this manager's
        targets and step end (twins plan and reach the same ones)."""
        if not self.caching:
            return
        rid = request.request_id
        if not self.req_to_blocks.get(rid):
            return
        targets = self.targets.get(rid)
        # The last target the step reaches (targets ascend), or -1.
        reached = -1
        if targets and targets[0] <= num_tokens:
            reached = max(t for t in targets if t <= num_tokens)
        every = self._step_ends and self.keep_all
        step_end = (
            self._step_ends
            and not self.keep_all
            and not num_tokens % self.unit
            and num_tokens != reached
        )
        if reached < 0 and not every and not step_end:
            return
        pos = num_tokens // self.block_size - 1
        if reached < 0 and self.num_cached_block.get(rid, 0) > pos:
            # An earlier call keyed these tokens (the step's own, then the
            # engine's cache_blocks): keeping the state again as a step end
            # would replace, and so drop, a checkpoint kept there.
            return
        # Twins are one class: CheckpointManagers like this one.
        states = cast("Sequence[CheckpointManager]", twins)
        if step_end:
            # The hashed counts keeping the step's end changes, recorded once
            # for the class (the step ends: see replace_step_ends).
            self.record_twins(states, rid)
        if reached < 0 and not every:
            replace_step_ends(self, states, request, pos)
            return
        # Each twin's states in turn, so events keep their order.
        for twin in states:
            if reached >= 0:
                twin._reach_targets(request, num_tokens)
            if every:
                twin._keep_every_state(request, num_tokens)
            elif step_end:
                replace_step_ends(self, (twin,), request, pos)

    def _reach_targets(self, request: Request, num_tokens: int) -> None:
        """Keep the states of the targets ``num_tokens`` reaches."""
        rid = request.request_id
        blocks = self.req_to_blocks[rid]
        targets = self.targets[rid]
        block_size = self.block_size
        self._save(self.targets, rid)
        self._save(self.grid, rid)
        grid = self.grid.get(rid)
        while targets and targets[0] <= num_tokens:
            reached = targets.pop(0)
            pos = reached // block_size - 1
            spaced = grid is not None and reached in grid
            block = self._keep(request, blocks, pos, kept=not spaced)
            if spaced and block is not None and self.holds_back:
                self._save(self.spaced, rid)
                key = self.block_pool.key_hash[block]
                self.spaced.setdefault(rid, []).append((block, key))
            if block is not None and self.branch.get(rid) == reached:
                self._mark_shared(reached, block)
                if self._holds_shared:
                    self._save(self.pinned, rid)
                    self.pinned.setdefault(rid, []).append(pos)
        if not targets:
            del self.targets[rid]
            self.grid.pop(rid, None)

    def _keep_every_state(self, request: Request, num_tokens: int) -> None:
        """With every state held: key each one on a hit boundary."""
        rid = request.request_id
        blocks = self.req_to_blocks[rid]
        block_size = self.block_size
        first = self.num_cached_block.get(rid, 0)
        per_unit = self.unit // block_size
        pos = cdiv(first + 1, per_unit) * per_unit - 1
        last = num_tokens // block_size - 1
        while pos <= last:
            self._keep(request, blocks, pos, kept=False)
            pos += per_unit

    def _keep(
        self, request: Request, blocks: list[int], pos: int, *, kept: bool
    ) -> int | None:
        """Hash the state at table position ``pos``; the block, or None when
        there is no real block there or its prefix is not hashed yet."""
        if pos < 0 or pos >= len(blocks):
            return None
        block = blocks[pos]
        if not block:
            return None
        rid = request.request_id
        chunks = request.block_hashes
        if self.block_hash(chunks, pos) is None:
            return None
        key_hash = self.block_pool.key_hash
        newly = key_hash[block] is None
        if newly:
            if self.block_size % self.hash_block_size:
                # Finer than the hash block: the table is seen one position
                # per hash chunk (the state at each chunk's end), so the key,
                # its parent and the event's tokens all describe whole chunks.
                ratio = self.hash_block_size // self.block_size
                view: Sequence[int] = ChunkEnds(blocks, ratio)
                index = (pos + 1) // ratio - 1
                self.block_pool.cache_full_blocks(
                    block_hashes=chunks,
                    blocks=view,
                    num_cached_blocks=index,
                    num_full_blocks=index + 1,
                    group_id=self.kv_cache_group_id,
                    token_ids=request.all_token_ids,
                )
            else:
                self.block_pool.cache_full_blocks(
                    block_hashes=hashes_at_block_size(
                        chunks, self.hash_block_size, self.block_size
                    ),
                    blocks=blocks,
                    num_cached_blocks=pos,
                    num_full_blocks=pos + 1,
                    group_id=self.kv_cache_group_id,
                    token_ids=request.all_token_ids,
                )
        if self.num_cached_block.get(rid, 0) <= pos:
            self.record_request_state(rid)
            self.num_cached_block[rid] = pos + 1
        if kept and newly and not self.keep_all:
            self._save(self.kept, rid)
            self.kept.setdefault(rid, []).append((block, key_hash[block]))
        return block

    def hit_serves(self, blocks: Sequence[int]) -> bool:
        # The next token reads the state at the hit's last position.
        return not blocks or blocks[-1] != 0

    def grid_pool_share(self) -> float:
        return self.policy.interval_pool_share

    def grid_point_blocks(self) -> int:
        return int(self._targets_on and self.policy.interval > 0)

    def shortest_hit_reading(self, position: int) -> int:
        # The state at a position serves only the hit ending there.
        return (position + 1) * self.block_size

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        # Only the state after the last computed token is read again.
        if self.keep_all or num_computed_tokens <= 0:
            return 0
        return (num_computed_tokens - 1) // self.block_size

    # -- freeing ----------------------------------------------------------------

    def add_computed_blocks(self, request_id: str, blocks: Sequence[int]) -> None:
        super().add_computed_blocks(request_id, blocks)
        if not blocks or not blocks[-1]:
            return
        hit = blocks[-1]
        key = self.block_pool.key_hash[hit]
        counted = self.hit_counts.get(hit)
        # Keyed by block: at most one entry per block, a stale key replaced
        # when the block is hit again.
        hits = counted[1] + 1 if counted is not None and counted[0] == key else 1
        self.hit_counts[hit] = (key, hits)
        self.block_pool.record_undo(partial(self._uncount, hit, counted))
        if hits == 2:
            # A second request resumes here: the prefix is shared.
            self._mark_shared(len(blocks) * self.block_size, hit)
        if not self._holds_shared:
            return
        # The hit's state stays held while the request runs, and so does the
        # longest shared state below it on its path (as the attention
        # blocks of a shared prefix are): a later request on that prefix
        # resumes there even once this request's own states are evicted.
        pinned = [len(blocks) - 1]
        path = self.on_path.get(request_id)
        if path is not None:
            tokens, block, key = path
            pos = tokens // self.block_size - 1
            table = self.req_to_blocks[request_id]
            if pos < len(table) - 1 and not table[pos] and self._holds(block, key):
                self.record_request_state(request_id, whole=True)
                self.block_pool.touch((block,))
                table[pos] = block
                pinned.insert(0, pos)
        self._save(self.pinned, request_id)
        self.pinned[request_id] = pinned

    def _uncount(self, hit: int, counted: tuple[Any, int] | None) -> None:
        """Undo one hit's count (its step rolled back)."""
        if counted is None:
            self.hit_counts.pop(hit, None)
        else:
            self.hit_counts[hit] = counted

    def _mark_shared(self, tokens: int, block: int) -> None:
        """Note ``block``'s state, resumed after ``tokens``, as shared (a
        rolled-back step's mark is undone)."""
        states = self.shared_states.setdefault(tokens, {})
        key = self.block_pool.key_hash[block]
        before = states.get(key)
        if before is None:
            self._num_shared += 1
        states[key] = block
        self.block_pool.record_undo(partial(self._unmark_shared, tokens, key, before))
        if self._num_shared > 2 * self.block_pool.num_blocks:
            self._prune_shared()

    def _unmark_shared(self, tokens: int, key: Any, before: int | None) -> None:
        states = self.shared_states.get(tokens)
        if states is None:
            return
        if before is not None:
            states[key] = before
        elif states.pop(key, None) is not None:
            self._num_shared -= 1
            if not states:
                del self.shared_states[tokens]

    def _prune_shared(self) -> None:
        """Forget the states evicted since they were hit or marked shared
        (into new maps: a rolled-back step puts the old ones back)."""
        self.block_pool.record(
            self._put_shared, self.hit_counts, self.shared_states, self._num_shared
        )
        group = self.kv_cache_group_id
        key_hash = self.block_pool.key_hash
        key_group = self.block_pool.key_group
        self.hit_counts = {
            b: v
            for b, v in self.hit_counts.items()
            if key_hash[b] == v[0] and key_group[b] == group
        }
        shared: dict[int, dict[Any, int]] = {}
        for tokens, states in self.shared_states.items():
            live = {k: b for k, b in states.items() if self._holds(b, k)}
            if live:
                shared[tokens] = live
        self.shared_states = shared
        self._num_shared = sum(map(len, shared.values()))

    def _put_shared(
        self,
        hit_counts: dict[int, tuple[Any, int]],
        shared_states: dict[int, dict[Any, int]],
        num_shared: int,
    ) -> None:
        self.hit_counts = hit_counts
        self.shared_states = shared_states
        self._num_shared = num_shared

    def _shared_on_path(
        self, request: Request, limit: int
    ) -> tuple[int, int, Any] | None:
        """The longest shared state at or below ``limit`` tokens that
        ``request``'s prompt passes through (probing whichever is fewer:
        the positions shared states sit at, or the request's boundaries)."""
        shared = self.shared_states
        unit = self.unit
        limit -= limit % unit
        candidates: Iterable[int]
        if len(shared) <= limit // unit:
            candidates = sorted((t for t in shared if t <= limit), reverse=True)
        else:
            candidates = range(limit, 0, -unit)
        chunks = request.block_hashes
        size = self.block_size
        for tokens in candidates:
            states = shared.get(tokens)
            if not states:
                continue
            key = self.block_hash(chunks, tokens // size - 1)
            block = states.get(key)
            if block is not None and self._holds(block, key):
                return (tokens, block, key)
        return None

    def pop_blocks(self, request_id: str) -> list[int] | None:
        self._record_own_state(request_id)
        self.on_path.pop(request_id, None)
        self.targets.pop(request_id, None)
        self.pinned.pop(request_id, None)
        self.branch.pop(request_id, None)
        self.grid.pop(request_id, None)
        step_end = self.step_end.pop(request_id, None)
        step_before = self.step_before.pop(request_id, None)
        kept = self.kept.pop(request_id, None)
        spaced = self.spaced.pop(request_id, None)
        if spaced:
            kept = [*(kept or ()), *spaced]
        blocks = super().pop_blocks(request_id)
        if step_before is not None:
            kept = [*(kept or ()), step_before[1:]]
        pool = self.block_pool
        returned = self._returned.pop(request_id, None)
        if returned is not None:  # admitted: its count stands
            pool.record(self._returned.__setitem__, request_id, returned)
        ends = self.output_ends
        token = (request_id, pool.transactions) if self._shares_evidence else None
        if (
            step_end is not None
            and self._weighs_ends
            and not ends.keep_output_end(step_end[2], pool, token)
        ):
            self._spared[request_id] = step_end[1:]
            pool.record(self._spared.pop, request_id, None)
            step_end = None
        if step_end is not None:
            kept = [*(kept or ()), step_end[1:]]
        if kept:
            self._released_kept[request_id] = kept
        return blocks

    kept_twins = checkpoints_kept
    kept_if_room_twins = interval_states_kept

    def keeps_output_ends(self) -> bool:
        """Whether the group holds back and keeps output-end states (and a
        running request's step ends) for later prompts: unless the recent
        prompts did not carry them back (see :mod:`~kvcore.coordinator.output_ends`)."""
        return not self._weighs_ends or self.output_ends.worth_keeping()

    kept_past_pop = ("held_back", "_spared", "_released_kept")

    def take_released_checkpoints(self, request_id: str) -> list[int]:
        """The states the freed request kept for later requests that sit
        free in the pool already (released after their step): the
        coordinator moves them to the back of the eviction order with the
        request's other blocks, since a hit needs its state.  An output-end
        state the evidence does not keep (see
        :mod:`~kvcore.coordinator.output_ends`) goes to the spare blocks
        instead, once free."""
        pool = self.block_pool
        ref = pool.ref_cnt
        spared = self._spared.pop(request_id, None)
        kept = self._released_kept.pop(request_id, None)
        if pool.journal is not None:  # filed by an earlier step (a pop)
            pool.record(put_entry, self._spared, request_id, spared)
            pool.record(put_entry, self._released_kept, request_id, kept)
        if spared is not None and ref[spared[0]] == 0 and self._holds(*spared):
            pool.to_spare([spared[0]])
        if not kept:
            return []
        return [b for b, key in kept if ref[b] == 0 and self._holds(b, key)]

    def _save(self, store: dict[str, Any], request_id: str) -> None:
        """Inside a step: record ``store``'s entry for the request (a list
        copied) for a rollback to put back, before the step changes it."""
        if self.block_pool.journal is not None:
            value = store.get(request_id)
            if type(value) is list:
                value = list(value)
            self.block_pool.record_undo(partial(put_entry, store, request_id, value))

    def _holds(self, block: int, key: Any) -> bool:
        """Whether ``block`` is still cached as the state this group kept
        under ``key`` (not evicted and reused since)."""
        pool = self.block_pool
        return (
            key is not None
            and pool.key_hash[block] == key
            and pool.key_group[block] == self.kv_cache_group_id
        )

    def request_state(self, request_id: str) -> Any:
        targets = self.targets.get(request_id)
        kept = self.kept.get(request_id)
        pinned = self.pinned.get(request_id)
        spaced = self.spaced.get(request_id)
        return (
            None if targets is None else list(targets),
            self.step_end.get(request_id),
            None if kept is None else list(kept),
            None if spaced is None else list(spaced),
            None if pinned is None else list(pinned),
            self.branch.get(request_id),
            self.grid.get(request_id),
            self.step_before.get(request_id),
            self.on_path.get(request_id),
        )

    def restore_request_state(self, request_id: str, state: Any) -> None:
        stores: tuple[dict[str, Any], ...] = (
            self.targets,
            self.step_end,
            self.kept,
            self.spaced,
            self.pinned,
            self.branch,
            self.grid,
            self.step_before,
            self.on_path,
        )
        for store, value in zip(stores, state, strict=True):
            put_entry(store, request_id, value)
        self._released_kept.pop(request_id, None)

    @classmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> list[list[int]]:
        """The latest cached state at an aligned block end that is also a
        hash boundary."""
        block_size = query.block_size
        hash_size = query.hash_block_size
        chunks = query.chunk_hashes
        step = math.lcm(block_size, query.alignment, hash_size)
        end = min(query.max_length, len(chunks) * hash_size)
        end -= end % step
        pool = query.block_pool
        while end > 0:
            cached = pool.get_cached_block(
                chunks[end // hash_size - 1], query.group_ids
            )
            if cached is not None:
                pad = [pool.null_block] * (end // block_size - 1)
                return [[*pad, block] for block in cached]
            end -= step
        return [[] for _ in query.group_ids]
