"""Conformance checks for cache kinds, for kvcore's own tests and for third
parties that ship a kind.

    from kvcore.testing import check_kind

    def test_my_kind_conforms():
        check_kind(MyKind(), MySpec(block_size=16, ...))

Opt-in: nothing here is loaded unless imported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from kvcore.config import CacheConfig, EngineConfig
from kvcore.coordinator.block_pool import BlockPool
from kvcore.coordinator.kv_cache_manager import KVCacheManager
from kvcore.coordinator.manager import HitQuery
from kvcore.coordinator.request import Request
from kvcore.errors import KvcoreError, PluginError, PluginResultError
from kvcore.kinds import CacheKind
from kvcore.layout import KVCacheLayout
from kvcore.plan import get_kv_cache_config_from_groups
from kvcore.registry import KindRegistry
from kvcore.spec import KVCacheSpec, cdiv
from kvcore.structs import KVCacheGroupSpec
from kvcore.testing.conformance import (
    check_evolve_revalidates,
    check_json_round_trip,
    check_merge_of_one,
    check_sample,
    two_layer_pool,
)
from kvcore.testing.two_requests import check_two_requests

__all__ = ["ConformanceError", "check_kind"]


class ConformanceError(KvcoreError, AssertionError):
    """A kind breaks one of the rules every kind must follow."""


def _require(ok: bool, kind: CacheKind, rule: str) -> None:
    if not ok:
        msg = f"cache kind {getattr(kind, 'name', kind)!r}: {rule}"
        raise ConformanceError(msg)


@contextlib.contextmanager
def _suite_rules(kind: CacheKind) -> Iterator[None]:
    """The conformance suite's rules, broken, as a :class:`ConformanceError`
    naming the kind."""
    try:
        yield
    except ConformanceError:
        raise
    except AssertionError as exc:
        msg = f"cache kind {getattr(kind, 'name', kind)!r}: {exc}"
        raise ConformanceError(msg) from None


def check_kind(
    kind: CacheKind, spec: KVCacheSpec, *, registry: KindRegistry | None = None
) -> None:
    """Check that ``kind`` and a sample ``spec`` of it follow kvcore's rules.

    Raises :class:`ConformanceError` naming the first rule broken: the spec's
    tag matches the kind; its page is positive; its grouping key is hashable
    and stable; ``merge([spec])`` is the spec; validation runs again on
    ``attrs.evolve``; the spec round-trips through JSON; the binder returns
    views that share the pool's storage, one page per block; the manager (if
    any) builds, holds what ``num_blocks_held`` says through a chunked
    prefill, and runs a whole cycle (prefill, decode, a prefix hit exactly
    where the kind declares one, preemption, re-admission, free) within
    ``max_num_blocks_per_request`` and returning every block, and runs two
    requests at once (over two groups of the kind where it can be planned
    twice) whose blocks, reference counts and keys stay each one's own.
    """
    if registry is None:
        try:
            registry = KindRegistry.from_kinds([kind])
        except PluginError as exc:
            msg = f"cache kind {getattr(kind, 'name', kind)!r}: {exc}"
            raise ConformanceError(msg) from exc
    with _suite_rules(kind):
        check_sample(kind, spec, registry)
        h, n, c = spec.page_grid
        _require(h * n * c > 0, kind, "page_grid must be positive")
        _require(
            spec.page_size_bytes >= h * n * c, kind, "a padded page is never smaller"
        )
        key = spec.group_key()
        _require(hash(key) == hash(spec.group_key()), kind, "group_key must be stable")
        check_merge_of_one(spec)
        check_evolve_revalidates(spec)
        _check_planning_declarations(kind, spec)
        check_json_round_trip(kind, spec, registry)

    try:
        plan, pool = two_layer_pool(spec, registry)
    except PluginError as exc:
        msg = f"cache kind {kind.name!r}: binding its views failed: {exc}"
        raise ConformanceError(msg) from exc
    storage = pool.buffer.untyped_storage().data_ptr()
    for view in pool.views.values():
        for tensor in view if isinstance(view, tuple) else (view,):
            _require(
                tensor.untyped_storage().data_ptr() == storage,
                kind,
                "bind_view must return views of the pool's storage (no copy)",
            )
            _require(
                tensor.shape[0] == plan.num_blocks, kind, "views index blocks first"
            )

    if kind.manager_type is not None:
        block_pool = BlockPool(8, enable_caching=True, hash_block_size=spec.block_size)
        manager = kind.make_manager(
            spec,
            block_pool,
            group_id=0,
            block_size=spec.block_size,
            hash_block_size=spec.block_size,
            enable_caching=True,
            max_model_len=16 * spec.block_size,
        )
        if manager.caching:
            hits = type(manager).find_longest_cache_hit(
                HitQuery(
                    spec=spec,
                    block_hashes=[],
                    chunk_hashes=[],
                    hash_block_size=spec.block_size,
                    max_length=4 * spec.block_size,
                    group_ids=[0],
                    block_pool=block_pool,
                    block_size=spec.block_size,
                    alignment=spec.block_size,
                )
            )
            _require(hits == [[]], kind, "a search over no hashes finds no hit")

    if kind.manager_type is not None:
        with _answers_refused(kind):
            _check_blocks_held(kind, spec, registry)
            _check_hit_cycle(kind, spec, registry)
            check_two_requests(kind, spec, registry, _require)


@contextlib.contextmanager
def _answers_refused(kind: CacheKind) -> Iterator[None]:
    """A manager answer the core refused in a step (it checks what managers
    return where it crosses in), as a :class:`ConformanceError` naming the
    kind."""
    try:
        yield
    except PluginResultError as exc:
        msg = (
            f"cache kind {getattr(kind, 'name', kind)!r}: kvcore refused its "
            f"manager's answer in a step: {exc}"
        )
        raise ConformanceError(msg) from exc


def _check_planning_declarations(kind: CacheKind, spec: KVCacheSpec) -> None:
    """``element_size`` and ``grown`` follow their contracts."""
    element = spec.element_size
    _require(
        type(element) is int and element > 0,
        kind,
        f"element_size must be a positive int, got {element!r}",
    )
    same = spec.grown(1)
    _require(
        same is spec or same == spec,
        kind,
        f"grown(1) must return the spec itself, got {same!r}",
    )
    max_growth = type(spec).max_block_growth
    for factor in range(2, min(4, max_growth) + 1):
        grown = spec.grown(factor)
        if grown is None:
            continue
        _require(
            type(grown) is type(spec),
            kind,
            f"grown({factor}) must return None or a {type(spec).__name__}, got "
            f"a {type(grown).__name__}",
        )
        _require(
            grown.block_size == spec.block_size * factor,
            kind,
            f"grown({factor}) must multiply block_size by {factor} "
            f"({spec.block_size} -> {spec.block_size * factor}), got "
            f"block_size={grown.block_size}",
        )


def _prefill_steps(total: int, block_size: int) -> list[int]:
    """Uneven step sizes summing to ``total``: a part block, then runs that
    start and end inside blocks, then whole blocks, last a single token."""
    pattern = [max(1, block_size // 2), 3 * block_size, 2 * block_size + 1]
    steps: list[int] = []
    left = total - 1
    i = 0
    while left > 0:
        size = pattern[i] if i < len(pattern) else 4 * block_size
        size = min(size, left)
        steps.append(size)
        left -= size
        i += 1
    steps.append(1)
    return steps


def _check_blocks_held(
    kind: CacheKind, spec: KVCacheSpec, registry: KindRegistry
) -> None:
    """Run one request through the kind's manager and compare the blocks it
    holds with ``spec.num_blocks_held`` after every step."""
    bs = spec.block_size
    total = 16 * bs
    # Enough blocks for the whole request however the kind holds them.
    num_blocks = max(cdiv(total, bs), spec.max_num_blocks_per_request(total)) + 4
    manager = _one_layer_manager(spec, registry, num_blocks, total, caching=False)
    block_size = manager.coordinator.single_type_managers[0].block_size
    pool = manager.block_pool
    usable = pool.num_blocks - 1
    rid = "check_kind"
    fix = (
        "make the manager and num_blocks_held agree (the capacity model "
        "trusts num_blocks_held)"
    )

    def compare(step: str, computed: int, covered: int) -> None:
        in_table = _held(manager, rid)
        taken = usable - pool.free_queue.num_free
        _require(
            in_table == taken,
            kind,
            f"{step}: the manager's table holds {in_table} blocks but "
            f"{taken} are out of the pool; a manager must keep in its table "
            "every block it takes",
        )
        expected = spec.num_blocks_held(computed, covered, block_size)
        _require(
            in_table == expected,
            kind,
            f"{step}: the manager holds {in_table} blocks but "
            f"spec.num_blocks_held({computed}, {covered}, {block_size}) says "
            f"{expected}; {fix}",
        )

    request = Request(rid, list(range(total)), hash_block_size=None)
    computed = 0
    for n, size in enumerate(_prefill_steps(total, block_size), 1):
        step = f"step {n} (tokens {computed}..{computed + size})"
        blocks = manager.allocate_slots(request, size)
        _require(
            blocks is not None,
            kind,
            f"{step}: allocate_slots refused a step with {pool.free_queue.num_free} "
            f"of {usable} blocks free",
        )
        compare(step, computed, computed + size)
        computed += size
        request.num_computed_tokens = computed
    manager.coordinator.remove_skipped_blocks(rid, total)
    compare(f"after remove_skipped_blocks({total})", total, total)
    manager.free(request)
    _require(
        pool.free_queue.num_free == usable,
        kind,
        f"after free the pool has {pool.free_queue.num_free} of {usable} blocks "
        "free; free must give back every block the request held",
    )


def _one_layer_manager(
    spec: KVCacheSpec,
    registry: KindRegistry,
    num_blocks: int,
    max_model_len: int,
    *,
    caching: bool,
) -> KVCacheManager:
    """A manager for one layer of ``spec`` with ``num_blocks`` blocks."""
    cache = CacheConfig(
        kv_cache_layout=KVCacheLayout.BLHNC,
        num_gpu_blocks_override=num_blocks,
        enable_prefix_caching=caching,
    )
    config = EngineConfig(cache_config=cache, max_model_len=max_model_len)
    group = KVCacheGroupSpec(["layer.0"], spec)
    size = num_blocks * spec.page_size_bytes
    plan = get_kv_cache_config_from_groups(config, [group], size)
    return KVCacheManager.from_plan(plan, registry=registry)


def _held(manager: KVCacheManager, rid: str) -> int:
    """Distinct real blocks in the request's table of group 0."""
    table = manager.coordinator.get_blocks(rid)[0]
    return len({b for b in table if b})


def _check_hit_cycle(
    kind: CacheKind, spec: KVCacheSpec, registry: KindRegistry
) -> None:
    """A scheduler's whole cycle with prefix caching on: a request prefills in
    chunks and decodes; a second request with the same prompt takes the hit
    the kind declares (some tokens when ``prefix_cacheable``, none when not);
    it is preempted mid-decode and admitted again; every step stays within
    ``max_num_blocks_per_request``, and every block returns at the end."""
    bs = spec.block_size
    prompt = 12 * bs
    decode = 2 * bs
    total = prompt + decode
    bound = spec.max_num_blocks_per_request(total)
    num_blocks = 2 * max(cdiv(total, bs), bound) + 8
    manager = _one_layer_manager(spec, registry, num_blocks, total, caching=True)
    pool = manager.block_pool
    usable = pool.num_blocks - 1
    hash_size = manager.hash_block_size if manager.enable_caching else None
    tokens = [7 + i % 97 for i in range(prompt)]

    def run(request: Request, what: str) -> None:
        computed = request.num_computed_tokens
        # Whole-block chunks, so kinds that keep a state only where a step
        # ends (Mamba ``align``) have states a later request can hit.
        while computed < prompt:
            size = min(4 * bs, prompt - computed)
            blocks = manager.allocate_slots(request, size)
            _require(
                blocks is not None,
                kind,
                f"{what}: allocate_slots refused a prefill step of {size} tokens "
                f"with {pool.free_queue.num_free} of {usable} blocks free",
            )
            need = spec.num_blocks_held(computed, computed + size, bs)
            extra = spec.checkpoint_blocks_per_step
            _require(
                _held(manager, request.request_id) <= need + extra,
                kind,
                f"{what}: prefilling tokens {computed}..{computed + size} the "
                f"request holds {_held(manager, request.request_id)} blocks, more than "
                f"spec.num_blocks_held says ({need}) plus "
                f"spec.checkpoint_blocks_per_step ({extra})",
            )
            computed += size
            request.num_computed_tokens = computed
        for i in range(decode):
            if request.num_tokens <= request.num_computed_tokens:
                request.append_output_token_ids([3 + i])
            blocks = manager.allocate_slots(request, 1)
            _require(
                blocks is not None,
                kind,
                f"{what}: a decode step was refused with "
                f"{pool.free_queue.num_free} of {usable} blocks free",
            )
            request.num_computed_tokens += 1
            _require(
                _held(manager, request.request_id) <= bound,
                kind,
                f"{what}: decoding, the request holds {_held(manager, request.request_id)} "
                f"blocks, more than max_num_blocks_per_request({total}) = {bound}",
            )

    first = Request("cycle-1", tokens, hash_block_size=hash_size)
    run(first, "the first request")
    manager.free(first)
    second = Request("cycle-2", tokens, hash_block_size=hash_size)
    hit, length = manager.get_computed_blocks(second)
    policy = spec.hit_policy
    if policy.hashes_blocks and manager.enable_caching:
        _require(
            length > 0,
            kind,
            f"the kind declares hit_policy={policy.name}, but a request repeating "
            f"a {prompt}-token prompt got no hit; cache the blocks that can end a "
            "hit, or declare the policy the kind serves: HitPolicy.NOT_HASHED if "
            "it is rebuilt after another group's hit, HitPolicy.BLOCKS_HITS if it "
            "needs the whole prefix and keeps none of it (no hits for the model)",
        )
    else:
        _require(
            length == 0,
            kind,
            f"the kind declares hit_policy={policy.name}, which hashes nothing, "
            f"but a repeated prompt got a {length}-token hit",
        )
    if length:
        blocks = manager.allocate_slots(
            second, prompt - length, length, new_computed_blocks=hit
        )
        _require(
            blocks is not None,
            kind,
            "admitting the second request with its hit was refused",
        )
        second.num_computed_tokens = prompt
    run(second, "the second request")
    # Preempt it mid-flight, then admit it again from its prompt.
    manager.free(second)
    again = Request("cycle-3", tokens, hash_block_size=hash_size)
    hit, length = manager.get_computed_blocks(again)
    if length:
        blocks = manager.allocate_slots(
            again, prompt - length, length, new_computed_blocks=hit
        )
        _require(
            blocks is not None, kind, "re-admitting a preempted request was refused"
        )
        again.num_computed_tokens = prompt
    run(again, "the re-admitted request")
    manager.free(again)
    _require(
        pool.free_queue.num_free == usable,
        kind,
        f"after the cycle the pool has {pool.free_queue.num_free} of {usable} "
        "blocks free; free must give back every block a request held",
    )
