"""``check_kind``'s two-request cycle: the corruptions a manager can hide
while it serves one request alone (a block taken from another request's
table, blocks handed into another request's table, blocks freed from under
another request, blocks keyed under another group) show only with two live
requests, and, where the kind can be planned twice, two groups of it.

Everything is read through the public API: the tables
(:meth:`KVCacheManager.get_block_ids`), the blocks each step hands out, and
the pool's reference counts, free count and keys (``ref_cnt``,
``free_queue.num_free``, ``key_hash``, ``key_group``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcore.config import CacheConfig, EngineConfig
from kvcore.coordinator.kv_cache_manager import KVCacheManager
from kvcore.coordinator.request import Request
from kvcore.errors import KvcoreError
from kvcore.kinds import CacheKind
from kvcore.layout import KVCacheLayout
from kvcore.plan import get_kv_cache_config_from_groups
from kvcore.registry import KindRegistry
from kvcore.spec import KVCacheSpec, cdiv
from kvcore.structs import KVCacheGroupSpec

__all__ = ["check_two_requests"]

Require = Callable[[bool, CacheKind, str], None]

OWN = (
    "a manager keeps in a request's table only blocks that request took (or "
    "a hit it shares; these two requests share no prefix)"
)


def _manager(
    spec: KVCacheSpec, registry: KindRegistry, num_blocks: int, max_model_len: int
) -> KVCacheManager:
    """A manager over two groups of ``spec`` (one layer each), or one group
    where the kind cannot be planned twice."""
    cache = CacheConfig(
        kv_cache_layout=KVCacheLayout.BLHNC,
        num_gpu_blocks_override=num_blocks,
        enable_prefix_caching=True,
    )
    config = EngineConfig(cache_config=cache, max_model_len=max_model_len)
    size = 2 * num_blocks * spec.page_size_bytes
    try:
        groups = [KVCacheGroupSpec([f"layer.{i}"], spec) for i in range(2)]
        plan = get_kv_cache_config_from_groups(config, groups, size)
        return KVCacheManager.from_plan(plan, registry=registry)
    except KvcoreError:
        group = KVCacheGroupSpec(["layer.0"], spec)
        plan = get_kv_cache_config_from_groups(config, [group], size)
        return KVCacheManager.from_plan(plan, registry=registry)


class _Run:
    """The two requests' run, with the checks made after every step."""

    def __init__(
        self,
        kind: CacheKind,
        spec: KVCacheSpec,
        manager: KVCacheManager,
        require: Require,
    ) -> None:
        self.kind = kind
        self.spec = spec
        self.manager = manager
        self.require = require
        self.usable = manager.block_pool.num_blocks - 1
        self.live: dict[str, Request] = {}

    def check(self, what: str) -> None:
        """Every live table's blocks are its own, each block's reference
        count is the number of tables holding it, the blocks out of the pool
        are the blocks the tables hold, and every keyed block is keyed under
        its table's group."""
        kind, require = self.kind, self.require
        pool = self.manager.block_pool
        managers = self.manager.coordinator.single_type_managers
        for gid, single in enumerate(managers):
            require(
                single.kv_cache_group_id == gid,
                kind,
                f"{what}: the manager of cache group {gid} says it is group "
                f"{single.kv_cache_group_id}; a manager keeps the group id it "
                "was built with",
            )
        holders: dict[int, list[tuple[str, int]]] = {}
        for rid in self.live:
            for gid, table in enumerate(self.manager.get_block_ids(rid)):
                for block in table:
                    if block:
                        where = holders.setdefault(block, [])
                        if (rid, gid) not in where:
                            where.append((rid, gid))
        for block, where in holders.items():
            shown = ", ".join(f"request {r!r} in group {g}" for r, g in where)
            require(
                len({r for r, _ in where}) == 1,
                kind,
                f"{what}: block {block} is in the tables of {shown}; {OWN}",
            )
            require(
                len(where) == 1,
                kind,
                f"{what}: block {block} is in the tables of {shown}; each "
                "group's blocks are its own (a manager takes blocks for its "
                "group only)",
            )
            ref = pool.ref_cnt[block]
            require(
                ref == 1,
                kind,
                f"{what}: block {block}, held by {shown}, has reference count "
                f"{ref}, not 1; a manager takes a reference on every block it "
                "puts in a table and frees only blocks of the request it frees",
            )
            gid = where[0][1]
            if pool.key_hash[block] is not None:
                require(
                    pool.key_group[block] == gid,
                    kind,
                    f"{what}: block {block} of cache group {gid}'s table is "
                    f"keyed under group {pool.key_group[block]}; a manager "
                    "keys its blocks under its own kv_cache_group_id",
                )
        out = self.usable - pool.free_queue.num_free
        require(
            out == len(holders),
            kind,
            f"{what}: {out} blocks are out of the pool but the live requests' "
            f"tables hold {len(holders)}; a manager keeps every block it takes "
            "in the table of the request that took it",
        )

    def step(self, request: Request, num_new: int, what: str) -> None:
        """One ``allocate_slots`` step of ``request``: it fits, and every
        block it hands out is in the request's own table of that group."""
        kind, pool = self.kind, self.manager.block_pool
        blocks = self.manager.allocate_slots(request, num_new)
        self.require(
            blocks is not None,
            kind,
            f"{what}: allocate_slots refused a step of {num_new} tokens with "
            f"{pool.free_queue.num_free} of {self.usable} blocks free",
        )
        if blocks is None:  # refused above
            return
        self.live[request.request_id] = request
        tables = self.manager.get_block_ids(request.request_id)
        for gid, new in enumerate(blocks.get_block_ids()):
            stray = sorted(set(new) - set(tables[gid]) - {0})
            self.require(
                not stray,
                kind,
                f"{what}: allocate_slots handed request "
                f"{request.request_id!r} blocks {stray} of cache group {gid} "
                f"that its table does not hold; {OWN}",
            )
        request.num_computed_tokens += num_new
        self.check(what)


def _sizes(prompt: int, block_size: int) -> list[int]:
    """Uneven prefill steps summing to ``prompt``, each ending inside a block."""
    out, left, size = [], prompt, 3 * block_size + 1
    while left > 0:
        out.append(min(size, left))
        left -= out[-1]
    return out


def check_two_requests(
    kind: CacheKind, spec: KVCacheSpec, registry: KindRegistry, require: Require
) -> None:
    """Two requests of different prompts prefill in turn and decode in turn
    through the kind's manager (two groups of it where the kind can be
    planned twice), then each is freed; after every step the checks of
    :meth:`_Run.check` hold, and at the end the pool has every block free
    again."""
    bs = spec.block_size
    prompt = 8 * bs
    total = prompt + bs
    per_request = max(cdiv(total, bs), spec.max_num_blocks_per_request(total))
    manager = _manager(spec, registry, 4 * per_request + 8, total)
    run = _Run(kind, spec, manager, require)
    hash_size = manager.hash_block_size if manager.enable_caching else None
    requests = [
        Request(
            "two-a", [7 + i % 97 for i in range(prompt)], hash_block_size=hash_size
        ),
        Request(
            "two-b", [1009 + i % 89 for i in range(prompt)], hash_block_size=hash_size
        ),
    ]
    sizes = _sizes(prompt, bs)
    for n, size in enumerate(sizes, 1):
        for request in requests:
            run.step(request, size, f"{request.request_id!r} prefill step {n}")
    for i in range(bs):
        for request in requests:
            request.append_output_token_ids([3 + i])
            run.step(request, 1, f"{request.request_id!r} decode step {i + 1}")
    _free(run, requests)


def _free(run: _Run, requests: Sequence[Request]) -> None:
    """Free the requests one at a time, checking the other's table after
    each, then the pool's free count."""
    pool = run.manager.block_pool
    for request in requests:
        run.manager.free(request)
        del run.live[request.request_id]
        run.check(f"after freeing {request.request_id!r}")
    run.require(
        pool.free_queue.num_free == run.usable,
        run.kind,
        f"after freeing both requests the pool has {pool.free_queue.num_free} "
        f"of {run.usable} blocks free; free must give back every block a "
        "request held, and no other",
    )
