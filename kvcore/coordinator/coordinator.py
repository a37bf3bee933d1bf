"""The coordinator: one manager per cache group over one block pool.

It finds the longest prefix every prefix-cacheable group can serve (a fixed
point over any number of groups), attaches hits in two phases (every group's
hit blocks are touched before any group allocates, so one group's allocation
never evicts another's hit), and forwards allocation, caching and freeing to
every group's manager.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from kvcore.coordinator.assembly import (
    ManagerSettings,
    SpecGroup,
    build_managers,
    check_hash_block,
    checkpoint_twins,
    event_groups,
    hit_units,
    search_groups,
    share_evidence,
)
from kvcore.coordinator.block_pool import BlockPool
from kvcore.coordinator.cache_spans import CacheSpans
from kvcore.coordinator.checkpoint_steps import CheckpointSteps
from kvcore.coordinator.counted_release import freeable_counts
from kvcore.coordinator.found_hits import check_found_hit
from kvcore.coordinator.freeing import FreeSteps
from kvcore.coordinator.hashing import BlockHash, hashes_at_block_size
from kvcore.coordinator.kind_effects import (
    check_attached,
    check_count_covers,
    checked_step,
    count_of,
    step_snapshot,
    watched_query,
)
from kvcore.coordinator.manager import HitQuery, SingleTypeManager
from kvcore.coordinator.partial import PartialKeys, partial_prefix_hit
from kvcore.coordinator.plugin_results import (
    BadCount,
    admission_error,
    block_count,
    count_error,
    grid_answer,
    group_plugin,
    result_error,
    within_hit,
)
from kvcore.coordinator.request import Request
from kvcore.coordinator.twins import Runs, kind_steps, record_whole, twin_runs
from kvcore.coordinator.unwritten import UnwrittenStates
from kvcore.errors import PluginError
from kvcore.registry import KindRegistry
from kvcore.spec import HitPolicy
from kvcore.structs import KVCacheConfig

__all__ = ["KVCacheCoordinator", "SpecGroup"]

_SEARCH = "find_longest_cache_hit"


class KVCacheCoordinator(FreeSteps, CheckpointSteps):
    """Runs every cache group's manager over one :class:`BlockPool`.

    :param kv_cache_config: the scheduler's view of the plan.
    :param max_model_len: the longest request, in tokens.
    :param enable_caching: prefix caching on or off.
    :param hash_block_size: tokens per hashed chunk.
    :param scheduler_block_size: the token alignment of scheduling.
    :param registry: kinds, for each group's manager.
    :param dcp: decode context parallelism (scales attention block sizes).
    :param use_eagle: drop the last block of every hit, so a draft model
        recomputes it.
    :param enable_partial_hits: let groups whose kind allows it serve hits
        that end inside a block, by copy-on-write (see
        :mod:`kvcore.coordinator.partial`); off, hits are whole blocks of
        every group.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        *,
        max_model_len: int,
        enable_caching: bool,
        hash_block_size: int,
        scheduler_block_size: int,
        registry: KindRegistry,
        dcp: int = 1,
        use_eagle: bool = False,
        enable_kv_cache_events: bool = False,
        kv_events_medium: str = "GPU",
        enable_partial_hits: bool = True,
    ) -> None:
        groups = kv_cache_config.kv_cache_groups
        check_hash_block(hash_block_size, scheduler_block_size)
        self.block_pool = BlockPool(
            kv_cache_config.num_blocks,
            enable_caching=enable_caching,
            hash_block_size=hash_block_size,
            enable_kv_cache_events=enable_kv_cache_events,
            event_groups=event_groups(groups, hash_block_size, dcp)
            if enable_kv_cache_events
            else (),
            kv_events_medium=kv_events_medium,
        )
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.scheduler_block_size = scheduler_block_size
        self.max_model_len = max_model_len
        self.use_eagle = use_eagle
        #: Hits are multiples of ``cache_hit_alignment`` tokens (see
        #: hit_alignment); ``partial_units``: the groups that copy hits
        #: ending inside their blocks, and their units.
        self.cache_hit_alignment, partial_units = hit_units(
            groups,
            registry,
            (scheduler_block_size, hash_block_size, dcp),
            enable_caching=enable_caching,
            enable_partial_hits=enable_partial_hits,
        )
        built = build_managers(
            groups,
            self.block_pool,
            registry,
            ManagerSettings(
                hash_block_size=hash_block_size,
                scheduler_block_size=scheduler_block_size,
                enable_caching=enable_caching,
                max_model_len=max_model_len,
                dcp=dcp,
                use_eagle=use_eagle,
                hit_alignment=self.cache_hit_alignment,
            ),
        )
        self.single_type_managers = managers = built.managers
        self._owners = built.owners
        self.block_pool.plugin_of = functools.partial(group_plugin, self)
        #: Each group's checked boundary overlap (see headroom).
        self.boundary_overlaps = built.overlaps
        self._plugin_manager = getattr(registry, "_pm", None)
        #: Each plugin's distribution, kept by a copy (which drops the
        #: plugin manager) for its error messages.
        self._distributions: dict[str, str | None] = {}
        self.num_groups = len(managers)
        self._init_steps(managers)
        # Prefix-cacheable groups with equal specs are searched together.
        self.attention_groups: list[SpecGroup] = search_groups(
            managers, built.policies, partial_units
        )
        #: After a lookup: tokens the groups that keep every block served
        #: (searched first), where a window or state group keeps the
        #: request's branch point.
        self.last_shared_prefix = 0
        #: States taken by steps whose forward may not have run: no
        #: admission's hit ends on one (see kvcore.coordinator.unwritten).
        self.unwritten = UnwrittenStates(managers)
        self._init_free_order(managers)
        self._init_hits(managers, built.policies)

    def _init_steps(self, managers: tuple[SingleTypeManager, ...]) -> None:
        """How a request's steps visit the groups: who skips, who takes
        encoder tokens, the runs of twins each step walks."""
        #: Managers that release blocks a request no longer reads.
        self.skipping = tuple(m for m in managers if m.skips_blocks)
        #: Managers that choose checkpoint positions at admission.
        self.planning = tuple(m for m in managers if m.caching and m.plans_checkpoints)
        self.lookahead_refusers = tuple(
            gid for gid, m in enumerate(managers) if not m.supports_lookahead
        )
        # A group that releases blocks while a request runs, beside one that
        # keeps the request's whole prefix (which no eviction can reach
        # while it runs), holds back the released blocks its hits need (and
        # spares the rest), or rejoins them all if each stays a hit point.
        if any(m.caching and not m.skips_blocks for m in managers):
            for m in managers:
                m.holds_back = m.caching and m.skips_blocks and not m.keeps_releases
                m.rejoins_releases = m.caching and m.skips_blocks and m.keeps_releases
        self._init_grid(managers)
        #: Groups whose tables are sized by the request's encoder tokens
        #: (``SingleTypeManager.takes_encoder_tokens``); empty for a
        #: decoder-only plan.
        self.encoder_groups = tuple(
            gid for gid, m in enumerate(managers) if m.takes_encoder_tokens
        )
        # Twin groups (see twin_key) hold tables of one shape and equal
        # per-request state, so a running request's steps run once per run
        # of consecutive twins, in group order: the run's first manager
        # steps the run (allocate_twins, release_twins, cache_twins: one
        # decision for the class), and a class whose run changed nothing
        # is passed over.
        # Equal runs share one tuple, whichever step walks them: a step that
        # grows (or admits) and keys a request records its tables once (see
        # SingleTypeManager.record_twins).
        shared: dict[tuple[int, ...], tuple[SingleTypeManager, ...]] = {}
        self._skip_runs, self._cache_runs, self._grow_runs, self._admit_runs = (
            tuple(
                (first, shared.setdefault(tuple(map(id, members)), members))
                for first, members in twin_runs(managers, flag)
            )
            for flag in ("skips_blocks", "caching", "position_indexed", None)
        )
        #: The classes whose manager class defines a step itself, by step:
        #: the kind's own code (checked, its tables recorded whole).
        self._kind_steps = steps = kind_steps(self._admit_runs)
        #: The first manager of each run of skipping twins and whether its
        #: answer is the kind's own (watched), when every skipping manager
        #: keeps the ``releases_by_count`` promise (a step may then ask them
        #: whether it releases anything), else None.
        self._release_leads: tuple[tuple[SingleTypeManager, bool], ...] | None = (
            tuple((m[0], f in steps["releases_nothing"]) for f, m in self._skip_runs)
            if all(m.releases_by_count for m in self.skipping)
            else None
        )
        #: Each class of growing twins (counted once per class): its first
        #: manager, its size and whether its count is the kind's own.
        sizes: dict[int, int] = {}
        for first, members in self._grow_runs:
            sizes[first] = sizes.get(first, 0) + len(members)
        #: The groups whose count is the kind's own code (run watched).
        self.kind_counts = own = self._kind_steps["get_num_blocks_to_allocate"]
        self._grow_classes = tuple((managers[f], n, f in own) for f, n in sizes.items())
        #: The token spans in which each request's cache_blocks keys
        #: nothing, when every caching group's manager keys by hash chunk
        #: ends (see :mod:`kvcore.coordinator.cache_spans`); else None.
        self.cache_spans: CacheSpans | None = (
            CacheSpans(self.block_pool)
            if self._cache_runs
            and all(m.caches_at_chunk_ends for m in managers if m.caching)
            else None
        )
        #: Whether a running request's step that no class grows (every
        #: count 0), releases in or keys in changes nothing, so the manager
        #: passes it over (every growing manager's ``grows_by_count``).
        self.idle_steps = all(m.grows_by_count for m in managers if m.position_indexed)

    def _init_grid(self, managers: tuple[SingleTypeManager, ...]) -> None:
        """What a checkpoint grid costs each planning group: the blocks one
        point of a request's grid costs over every group that keeps blocks
        there (each keeps the grid to its share), and the blocks a token of
        cached prefix takes in the groups that keep every block (what a
        grid point makes reachable)."""
        owners = self._owners
        cost = sum(grid_answer(m, "grid_point_blocks", owners) for m in self.planning)
        prefix_blocks = sum(
            1 / m.block_size
            for m in managers
            if m.caching and m.position_indexed and not m.skips_blocks
        )
        for m in self.planning:
            m.grid_point_cost = cost
            m.grid_share = grid_answer(m, "grid_pool_share", owners)
            m.grid_prefix_blocks = prefix_blocks

    def _init_hits(
        self, managers: tuple[SingleTypeManager, ...], policies: Sequence[HitPolicy]
    ) -> None:
        """Who blocks hits, who serves copy-on-write hits inside their
        blocks, and which state groups agree on one checkpoint path."""
        #: Groups whose kind declares ``HitPolicy.BLOCKS_HITS`` (a state that
        #: needs the whole prefix but keeps nothing to restore it from): no
        #: request of the model gets a hit.
        self.hit_blockers = tuple(
            gid
            for gid, policy in enumerate(policies)
            if self.enable_caching and policy is HitPolicy.BLOCKS_HITS
        )
        #: Classes of two or more twin state groups (see twin_key): they
        #: agree on one checkpoint path (see :meth:`plan_checkpoints`).
        self._path_twins = checkpoint_twins(self.planning)
        for twins in self._path_twins:
            share_evidence(twins)
        #: Group id -> copy-on-write hit unit, for groups that serve partial
        #: hits (empty when none does).
        self.partial_units: dict[int, int] = {
            gid: g.partial_unit
            for g in self.attention_groups
            if g.partial_unit
            for gid in g.group_ids
        }
        #: ``(group id, block size)`` of those groups.
        self.partial_groups: tuple[tuple[int, int], ...] = tuple(
            (gid, managers[gid].block_size) for gid in sorted(self.partial_units)
        )
        #: Their partial-key bookkeeping, or None when no group serves them.
        self.partial: PartialKeys | None = (
            PartialKeys(
                self.block_pool,
                [(managers[gid], unit) for gid, unit in self.partial_units.items()],
            )
            if self.partial_units
            else None
        )
        self.unwritten.watch_sources([managers[gid] for gid, _ in self.partial_groups])

    def __getstate__(self) -> dict[str, Any]:
        """The coordinator's state without the plugin manager, which holds
        modules (they do not copy): a copy keeps only what it names in
        errors, each plugin's distribution."""
        state = self.__dict__.copy()
        state["_plugin_manager"] = None
        state["_distributions"] = {
            plugin: self._distribution(plugin) for plugin in set(self._owners)
        }
        return state

    # -- lookup -----------------------------------------------------------------

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[tuple[list[int], ...], int]:
        """Every group's hit block ids and the common hit length in tokens.

        A fixed point: each group's search is bounded by the shortest hit so
        far, and groups whose hit is not monotone are searched again until no
        group shortens it.  Non-cacheable groups hold an empty hit; a group
        that needs its prefix but caches none (see :attr:`hit_blockers`)
        allows no hit.
        """
        # Set by the fixed point; a lookup that ends before it shares nothing.
        self.last_shared_prefix = 0
        alignment = self.cache_hit_alignment
        limit = max_length - max_length % alignment
        # A lookup shorter than one hit unit (a prompt under a plan's large
        # blocks) searches no group: none can serve it.
        if not self.attention_groups or limit <= 0 or self.hit_blockers:
            return tuple([] for _ in range(self.num_groups)), 0
        if self.use_eagle:
            bound = self._eagle_bound(block_hashes, max_length)
            limit = min(limit, bound - bound % alignment)
            if limit <= 0:
                return tuple([] for _ in range(self.num_groups)), 0
        hits, length = self._fixed_point(block_hashes, limit, alignment)
        return hits, length

    def _eagle_bound(self, block_hashes: Sequence[BlockHash], max_length: int) -> int:
        """The longest prefix EAGLE may take from the cache, before alignment.

        Each group's own longest hit (in its own blocks, up to
        ``max_length``) loses its last block, which the draft model
        recomputes.  A group whose dropped hit reaches ``n`` tokens shows the
        prefix was computed past ``n``; the longest such ``n`` bounds the hit,
        which the fixed point then cuts to what every group serves at the
        hit alignment.  Only one block of a group's size is dropped, never a
        whole alignment unit.
        """
        bound = 0
        for group in self.attention_groups:
            blocks = self.search(
                group,
                self._query(
                    group,
                    block_hashes,
                    self._hashes_of(group, block_hashes),
                    max_length,
                    group.block_size,
                ),
            )
            if not blocks[0]:
                continue
            dropped = (len(blocks[0]) - 1) * group.block_size
            bound = max(bound, dropped)
        return bound

    def search(self, group: SpecGroup, query: HitQuery) -> list[list[int]]:
        """``group``'s hit as its manager class finds it, checked where it
        enters the core unless the class's search returns only what the
        cache tables key at each position (see
        :mod:`kvcore.coordinator.found_hits`)."""
        try:
            if not group.checks_hits:
                return group.manager_type.find_longest_cache_hit(query)
            lead = self.single_type_managers[group.group_ids[0]]
            search = group.manager_type.find_longest_cache_hit
            read = (query.group_ids, query.chunk_hashes, query.block_pool)
            found = watched_query(lead, _SEARCH, search, query)
            if (query.group_ids, query.chunk_hashes, query.block_pool) != read:
                raise result_error(lead, _SEARCH, "changed the query it was given")
            return check_found_hit(found, query, self.single_type_managers)
        except Exception as exc:
            raise self.plugin_error(group.group_ids[0], _SEARCH, exc) from exc

    def _hashes_of(
        self, group: SpecGroup, block_hashes: Sequence[BlockHash]
    ) -> Sequence[BlockHash]:
        """The request's hashes at the group's block size (none when the
        block is finer than the hash block; its manager reads chunk hashes)."""
        if group.block_size % self.hash_block_size:
            return ()
        return hashes_at_block_size(
            block_hashes, self.hash_block_size, group.block_size
        )

    def _query(
        self,
        group: SpecGroup,
        chunk_hashes: Sequence[BlockHash],
        hashes: Sequence[BlockHash],
        max_length: int,
        alignment: int,
    ) -> HitQuery:
        if group.checks_hits:
            # A kind's own search reads copies: the request's hashes are not
            # its to change.
            chunk_hashes, hashes = tuple(chunk_hashes), tuple(hashes)
        return HitQuery(
            spec=group.spec,
            block_hashes=hashes,
            chunk_hashes=chunk_hashes,
            hash_block_size=self.hash_block_size,
            max_length=max_length,
            group_ids=group.group_ids,
            block_pool=self.block_pool,
            block_size=group.block_size,
            alignment=alignment,
        )

    def _fixed_point(
        self, block_hashes: Sequence[BlockHash], limit: int, alignment: int
    ) -> tuple[tuple[list[int], ...], int]:
        found: dict[int, list[list[int]]] = {}
        searched_at: dict[int, int] = {}
        views: dict[int, Sequence[BlockHash]] = {}
        length = limit
        changed = True
        first_pass = True
        while changed:
            changed = False
            for index, group in enumerate(self.attention_groups):
                if first_pass and not group.monotone:
                    first_pass = False
                    # The groups that keep every block, searched first,
                    # show how far an earlier request shared the prefix.
                    self.last_shared_prefix = length if index else 0
                if index in found:
                    if group.partial_unit:
                        # Serves every aligned length up to its hit: the
                        # block at the cut is a copy source.
                        continue
                    if group.monotone:
                        # Trimmed, not searched again, but only to whole
                        # blocks: a finer alignment (partial hits) can leave
                        # the length inside this group's block.
                        whole = length - length % group.block_size
                        if whole < length:
                            length = whole
                            changed = True
                        continue
                    if searched_at[index] == length:
                        continue
                hashes = views.get(index)
                if hashes is None:
                    hashes = views[index] = self._hashes_of(group, block_hashes)
                query = self._query(group, block_hashes, hashes, length, alignment)
                if group.partial_unit:
                    blocks, hit = partial_prefix_hit(query, group.partial_unit)
                else:
                    blocks = self.search(group, query)
                    hit = len(blocks[0]) * group.block_size
                found[index] = blocks
                searched_at[index] = length
                if hit < length:
                    length = hit
                    changed = True
                    if not hit:
                        # No group can extend an empty hit: the later
                        # groups are not searched.
                        break
            first_pass = False
            if length == 0:
                break
        out: list[list[int]] = [[] for _ in range(self.num_groups)]
        for index, group in enumerate(self.attention_groups):
            blocks_per_group = found.get(index)
            if blocks_per_group is None:
                continue
            keep = (
                -(-length // group.block_size)
                if group.partial_unit
                else length // group.block_size
            )
            for gid, group_hit in zip(group.group_ids, blocks_per_group, strict=True):
                out[gid] = group_hit if len(group_hit) == keep else group_hit[:keep]
        return tuple(out), length

    # -- allocation -------------------------------------------------------------
    #
    # Every call into a group's manager goes through a loop that knows the
    # group, so a manager that raises is reported as its plugin's failure
    # (:meth:`plugin_error`); KVCacheManager undoes the step around it.

    def _run_twins(
        self, runs: Runs, method: str, step: str, *args: Any
    ) -> tuple[list[list[int]] | None, bool]:
        """Call the class step ``method`` (``allocate_twins``,
        ``release_twins`` or ``cache_twins``) once per run of twins, in group
        order, on the run's first manager with the run; pass over a class
        once one of its runs changed nothing (returned no block and recorded
        nothing in the open transaction, which only a run not recorded
        earlier in it tells: see ``record_twins``).  What the calls returned that
        holds blocks, by group id; a manager that raises is reported as its
        plugin's failure in ``step``, the one-group step.  Only the new
        blocks ``allocate_twins`` returns are used (and checked where they
        cross in); what a release or a keying returns is not."""
        journal = self.block_pool.journal
        transaction = self.block_pool.transactions
        allocating = method == "allocate_twins"
        own = self._kind_steps[method] if journal is not None else ()
        idle: list[int] = []
        out: list[list[int]] | None = None
        changed = journal is None
        gid = -1
        try:
            for first, members in runs:
                if first in idle:
                    continue
                gid = first
                if first in own:
                    snapshot = step_snapshot(members, args)
                lead = members[0]
                mark = -1 if journal is None else len(journal)
                new = getattr(type(lead), method)(lead, members, *args)
                if first in own:
                    marks = (journal, mark, snapshot)
                    new = checked_step(method, members, args, new, marks)
                if new and allocating:
                    if out is None:
                        out = [[] for _ in range(self.num_groups)]
                    for manager, blocks in zip(members, new, strict=True):
                        out[manager.kv_cache_group_id] = blocks
                elif not new and mark == len(journal or ()):
                    recorded = lead._twins_recorded  # by this step, earlier?
                    if recorded[0] != transaction or recorded[2] is not members:
                        idle.append(first)
                        continue
                changed = True
        except Exception as exc:
            raise self.plugin_error(gid, step, exc) from exc
        return out, changed

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Release the blocks the request no longer reads, one call per
        class of twins (see :meth:`_run_twins`)."""
        _, changed = self._run_twins(
            self._skip_runs,
            "release_twins",
            "remove_skipped_blocks",
            request_id,
            num_computed_tokens,
        )
        if changed:
            self.forget_span(request_id)

    def releases_nothing(self, request_id: str, num_computed_tokens: int) -> bool:
        """Whether releasing the blocks the request no longer reads at
        ``num_computed_tokens`` would change nothing (False where a
        skipping manager makes no promise, or answers anything but True)."""
        leads = self._release_leads
        if leads is None:
            return False
        lead = None
        try:
            for lead, watched in leads:
                ask = type(lead).releases_nothing
                args = (lead, request_id, num_computed_tokens)
                answer = (
                    watched_query(lead, "releases_nothing", ask, *args)
                    if watched
                    else ask(*args)
                )
                if answer is not True:
                    return False
        except Exception as exc:
            # Asked on behalf of the release the step would run: reported as
            # that step's failure (nothing has changed yet).
            gid = 0 if lead is None else lead.kv_cache_group_id
            raise self.plugin_error(
                gid, "remove_skipped_blocks (releases_nothing)", exc
            ) from exc
        return True

    def count_freeable_skipped(self, request_id: str, num_computed_tokens: int) -> int:
        """Blocks that skipping would return to the free queue (each
        manager's count checked; see :mod:`kvcore.coordinator.counted_release`)."""
        return sum(freeable_counts(self, request_id, num_computed_tokens))

    def admission_blocks(
        self,
        new_computed_blocks: Sequence[Sequence[int]],
        num_computed_tokens: int,
    ) -> tuple[list[int], ...]:
        """Every group's admission blocks for a new request with
        ``num_computed_tokens`` computed (see
        :meth:`SingleTypeManager.admission_blocks`)."""
        out: list[list[int]] = []
        null = self.block_pool.null_block
        own = self._kind_steps["admission_blocks"]
        for manager, computed in zip(
            self.single_type_managers, new_computed_blocks, strict=True
        ):
            try:
                ask = type(manager).admission_blocks
                if manager.kv_cache_group_id in own:  # given a copy of the hit
                    args = (manager, list(computed), num_computed_tokens)
                    attach = watched_query(manager, "admission_blocks", ask, *args)
                else:
                    attach = ask(manager, computed, num_computed_tokens)
            except Exception as exc:
                gid = manager.kv_cache_group_id
                raise self.plugin_error(gid, "admission_blocks", exc) from exc
            if attach != computed and not (
                type(attach) is list
                and (not attach or within_hit(attach, computed, null))
            ):
                gid = manager.kv_cache_group_id
                error = admission_error(manager, computed, attach)
                raise self.plugin_error(gid, "admission_blocks", error)
            out.append(attach)
        return tuple(out)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Sequence[int]],
        num_encoder_tokens: int = 0,
        caps: Sequence[int | None] | None = None,
    ) -> int:
        """Blocks a new request needs to cover ``num_tokens`` with
        ``new_computed_blocks`` (its admission blocks) attached, and
        ``num_encoder_tokens`` in the groups that take them; ``caps``: the
        most table positions each group holds at once (None: no cap), the
        attached ones included (its free hit blocks still counted), for an
        engine's check of a whole sequence in groups that release blocks
        as the request runs."""
        total = 0
        gid = 0
        own = self._kind_steps["get_num_blocks_to_allocate"]
        try:
            for manager, computed in zip(
                self.single_type_managers, new_computed_blocks, strict=True
            ):
                gid = manager.kv_cache_group_id
                tokens = (
                    num_encoder_tokens if manager.takes_encoder_tokens else num_tokens
                )
                if gid in own:
                    need = count_of(manager, True, request_id, tokens, computed)
                else:
                    need = type(manager).get_num_blocks_to_allocate(
                        manager, request_id, tokens, computed
                    )
                if type(need) is not int or need < 0:
                    block_count(need)
                cap = None if caps is None else caps[gid]
                if cap is not None:  # the attached blocks count toward it
                    ref = self.block_pool.ref_cnt
                    free_hits = sum(1 for b in computed if b and not ref[b])
                    need = min(need, max(cap - len(computed), 0) + free_hits)
                total += need
        except Exception as exc:
            raise self.plugin_error(gid, "get_num_blocks_to_allocate", exc) from exc
        return total

    def add_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[Sequence[int]],
        block_hashes: Sequence[BlockHash] | None = None,
    ) -> None:
        """Phase one: touch every group's hit blocks before anything
        allocates (``block_hashes``: the request's, which a kind's shared
        state in place of a null admission block must be keyed by).  Phase
        two (:meth:`allocate_new_blocks`), in the same step, drops the
        request's cache span."""
        own = self._kind_steps["add_computed_blocks"]
        gid = 0
        try:
            for manager, computed in zip(
                self.single_type_managers, new_computed_blocks, strict=True
            ):
                gid = manager.kv_cache_group_id
                if computed:
                    journal = self.block_pool.journal
                    if gid not in own or journal is None:
                        type(manager).add_computed_blocks(manager, request_id, computed)
                        continue
                    before = record_whole((manager,), request_id)[0]
                    mark = len(journal)
                    type(manager).add_computed_blocks(
                        manager, request_id, list(computed)
                    )
                    touched = (journal, mark, block_hashes)
                    check_attached(manager, request_id, before, computed, touched)
        except Exception as exc:
            raise self.plugin_error(gid, "add_computed_blocks", exc) from exc

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_encoder_tokens: int = 0
    ) -> tuple[list[int], ...]:
        """Phase two: grow every group's table to cover ``num_tokens`` (the
        groups that take encoder tokens: ``num_encoder_tokens``), one
        ``allocate_twins`` call per run of twins, in group order."""
        self.forget_span(request_id)
        out: list[list[int]] = [[] for _ in range(self.num_groups)]
        journal = self.block_pool.journal
        own = self._kind_steps["allocate_twins"] if journal is not None else ()
        gid = 0
        try:
            for first, members in self._admit_runs:
                lead = members[0]
                gid = lead.kv_cache_group_id
                tokens = num_encoder_tokens if lead.takes_encoder_tokens else num_tokens
                if first in own:
                    snapshot = step_snapshot(members, (request_id,))
                mark = 0 if journal is None else len(journal)
                new = type(lead).allocate_twins(lead, members, request_id, tokens)
                if first in own:
                    marks = (journal, mark, snapshot)
                    step = (request_id, tokens)
                    new = checked_step("allocate_twins", members, step, new, marks)
                if new:
                    for manager, blocks in zip(members, new, strict=True):
                        out[manager.kv_cache_group_id] = blocks
        except Exception as exc:
            raise self.plugin_error(gid, "allocate_new_blocks", exc) from exc
        return tuple(out)

    def get_num_blocks_to_grow(
        self,
        request_id: str,
        num_tokens: int,
        caps: Sequence[int | None] | None = None,
    ) -> int:
        """Blocks a running request (no new hit) needs to cover ``num_tokens``:
        one count per class of growing twins (their tables have one length,
        so they need as many blocks each), times the class's size; ``caps``
        as :meth:`get_num_blocks_to_allocate` takes them."""
        total = 0
        manager = None
        try:
            for manager, size, kinds in self._grow_classes:
                if kinds:
                    need = count_of(manager, True, request_id, num_tokens, ())
                else:
                    need = type(manager).get_num_blocks_to_allocate(
                        manager, request_id, num_tokens, ()
                    )
                if type(need) is not int or need < 0:
                    block_count(need)
                if kinds and not need and caps is None:
                    check_count_covers(manager, request_id, num_tokens)
                if caps is not None:  # the table's positions count toward it
                    cap = caps[manager.kv_cache_group_id]
                    if cap is not None:
                        held = len(manager.req_to_blocks.get(request_id, ()))
                        need = min(need, max(cap - held, 0))
                total += need * size
        except Exception as exc:
            gid = 0 if manager is None else manager.kv_cache_group_id
            raise self.plugin_error(gid, "get_num_blocks_to_allocate", exc) from exc
        return total

    def grow(self, request_id: str, num_tokens: int) -> tuple[list[int], ...] | None:
        """Grow a running request's tables, in group order; ``None`` if no
        block was added."""
        out, changed = self._run_twins(
            self._grow_runs,
            "allocate_twins",
            "allocate_new_blocks",
            request_id,
            num_tokens,
        )
        if changed:
            self.forget_span(request_id)
        return None if out is None else tuple(out)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Key the request's blocks that ``num_tokens`` tokens fill, in every
        caching group; a call inside the request's cache span (see
        :attr:`cache_spans`) keys nothing and asks no manager."""
        spans = self.cache_spans
        if spans is None or not spans.covers(request.request_id, num_tokens):
            self._run_twins(
                self._cache_runs, "cache_twins", "cache_blocks", request, num_tokens
            )
            if spans is not None:
                spans.cached(request, num_tokens)
        if self.partial is not None:
            self.partial.register(request, num_tokens)

    def keys_nothing(self, request: Request, num_tokens: int) -> bool:
        """Whether :meth:`cache_blocks` at ``num_tokens`` keys nothing: inside
        the request's cache span, no partial key due (False where unknown)."""
        partial = self.partial
        if partial is not None and not partial.keys_nothing(request, num_tokens):
            return False
        spans = self.cache_spans
        if spans is None:
            return not self._cache_runs
        return spans.covers(request.request_id, num_tokens)

    def _each(
        self,
        managers: Sequence[SingleTypeManager],
        method: str,
        *args: Any,
        reads: bool = False,
    ) -> list[Any]:
        """Call ``method`` on each of ``managers``, in order, and return what
        each returned; a manager that raises is reported as a PluginError
        naming it.  ``reads``: the hook only answers (it may change its own
        manager's state, recorded for a rollback): where it is a kind's own
        code, a pool change it makes is undone and refused (see
        ``watched_query``)."""
        results = []
        gid = 0
        own = self._kind_steps[method] if reads else ()
        try:
            for manager in managers:
                gid = manager.kv_cache_group_id
                call = getattr(type(manager), method)
                results.append(
                    watched_query(manager, method, call, manager, *args)
                    if gid in own
                    else call(manager, *args)
                )
        except Exception as exc:
            raise self.plugin_error(gid, method, exc) from exc
        return results

    def forget_span(self, request_id: str) -> None:
        """Drop the request's cache span (its tables or checkpoints change)."""
        if self.cache_spans is not None:
            self.cache_spans.forget(request_id)

    def get_blocks(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(
            m.req_to_blocks.get(request_id, []) for m in self.single_type_managers
        )

    # -- transactions -------------------------------------------------------------

    def plugin_error(self, gid: int, method: str, exc: BaseException) -> PluginError:
        """The error for group ``gid``'s manager raising ``exc`` in ``method``
        (the caller has undone the step): names the kind, its plugin and,
        where known, the plugin's distribution.  A refused answer (see
        :func:`~kvcore.coordinator.plugin_results.result_error`, which knows
        only the manager's module) is given the group's plugin."""
        if not 0 <= gid < self.num_groups:
            gid = 0
        manager = self.single_type_managers[gid]
        if isinstance(exc, PluginError):
            # Raised by the group's manager or refused as its answer: the
            # group's plugin, whatever name the error carried.
            if exc.plugin_name != self._owners[gid]:
                exc.plugin_name = self._owners[gid]
                exc.distribution = self._distribution(exc.plugin_name)
            return exc
        kind = manager.kv_cache_spec.kind
        plugin = self._owners[gid]
        distribution = self._distribution(plugin)
        if isinstance(exc, BadCount):
            return count_error(manager, method, exc.value, plugin, distribution)
        where = f" (distribution {distribution!r})" if distribution else ""
        try:
            text = str(exc)
        except Exception:  # an exception whose message itself raises
            text = "(its message could not be formatted)"
        msg = (
            f"the {type(manager).__name__} of cache group {gid} (kind {kind!r}, "
            f"plugin {plugin!r}{where}) raised in {method}: "
            f"{type(exc).__name__}: {text}; the step was undone and the block pool "
            "is as it was before it. Report this to the plugin's authors, or block "
            f"the plugin with KVCORE_DISABLE_PLUGINS={plugin}"
        )
        return PluginError(msg, plugin_name=plugin, distribution=distribution)

    def _distribution(self, plugin: str) -> str | None:
        """The distribution that ships ``plugin``, where known (from the
        plugin manager, or as a copy recorded it)."""
        pm = self._plugin_manager
        if pm is None:
            return self._distributions.get(plugin)
        from kvcore.plugins import plugin_distribution

        try:
            shown = plugin_distribution(pm, plugin)
        except Exception:  # metadata lookups only decorate the message
            shown = None
        return shown.rsplit(" ", 1)[0] if shown else None
