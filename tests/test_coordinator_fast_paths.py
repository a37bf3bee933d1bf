"""The one-group fast paths agree with the general path they shadow.

A manager over one vetted group binds shortcuts as instance attributes
(``KVCacheManager.free``, a running request's ``allocate_slots``; the
coordinator's admission steps).  Each test runs
the same steps on a manager with the shortcut and on one with it removed, and
compares what an engine can observe: the free queue in eviction order, the
counts, the hits, the request statuses and the errors.
"""

from __future__ import annotations

import random
from typing import Any

import coordinator_setup as setup
import pytest
import torch

from kvcore.coordinator import KVCacheBlocks, KVCacheManager, Request, RequestStatus
from kvcore.errors import InvalidRequestError, KvcoreError, UnknownRequestError
from kvcore_circular_buffer import CircularBufferSpec

SHORTCUTS = ("free", "allocate_slots")


def pair(
    specs: list[Any], num_blocks: int = 64, **options: Any
) -> tuple[KVCacheManager, ...]:
    """A manager with its shortcuts and one with them removed."""
    options.setdefault("scheduler_block_size", 4)
    fast = setup.manager_for(specs, num_blocks, hash_block_size=4, **options)
    general = setup.manager_for(specs, num_blocks, hash_block_size=4, **options)
    for name in SHORTCUTS:
        general.__dict__.pop(name, None)
    general._one_prefix = None  # the coordinator's search
    return fast, general


def one_group_manager(cls: type[KVCacheManager]) -> KVCacheManager:
    """A ``cls`` over one full-attention group of 4-token blocks."""
    config = setup.KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[setup.KVCacheGroupSpec(["layer.0"], setup.fa(4))],
    )
    return cls(
        config, 4096, scheduler_block_size=4, hash_block_size=4, registry=setup.BUILT_IN
    )


def random_prompt(rng: random.Random, prefixes: list[list[int]]) -> list[int]:
    """One of ``prefixes`` (so requests share blocks) and a short tail."""
    return rng.choice(prefixes) + [
        rng.randrange(100) for _ in range(rng.randrange(1, 14))
    ]


def observed(mgr: KVCacheManager) -> tuple[Any, ...]:
    pool = mgr.block_pool
    return (
        [b.block_id for b in pool.free_queue.get_all_free_blocks()],
        [(b.block_id, b.ref_cnt) for b in pool.blocks],
        pool.num_cached_blocks,
        sorted(mgr._requests),
        [
            (
                sorted(m.req_to_blocks),
                sorted(m.num_cached_block),
                sorted(m.num_released),
            )
            for m in mgr._managers
        ],
        dict(getattr(mgr.coordinator.partial, "marks", {})),
    )


@pytest.mark.parametrize(
    "specs",
    [[setup.fa(4)], [setup.sw(4, 8)]],
    ids=["full-attention", "sliding-window"],
)
def test_one_group_free_takes_the_fast_path(specs: list[Any]) -> None:
    fast, _ = pair(specs)
    assert "free" in fast.__dict__


@pytest.mark.parametrize(
    ("specs", "grows_fast"),
    [
        ([setup.fa(4)], True),
        # Skipping and checkpoint planning take the general path.
        ([setup.sw(4, 8)], False),
        ([setup.mamba(4)], False),
        ([setup.fa(4), setup.sw(4, 8)], False),
    ],
    ids=["full-attention", "sliding-window", "state", "two-groups"],
)
def test_only_a_plain_growing_group_takes_the_one_frame_growth(
    specs: list[Any], grows_fast: bool
) -> None:
    mgr = setup.manager_for(specs, 64, scheduler_block_size=4, hash_block_size=4)
    assert ("allocate_slots" in mgr.__dict__) is grows_fast


def test_a_state_hybrid_frees_through_the_coordinator() -> None:
    mgr = setup.manager_for(
        [setup.fa(4), setup.mamba(4)],
        64,
        scheduler_block_size=4,
        hash_block_size=4,
    )
    assert "free" not in mgr.__dict__
    assert "allocate_slots" not in mgr.__dict__


def ring(block_size: int) -> Any:
    return CircularBufferSpec(
        block_size=block_size, num_kv_heads=1, head_size=4, dtype=torch.float16
    )


FREE_PLANS = {
    "full-attention": [setup.fa(4)],
    "sliding-window": [setup.sw(4, 8)],
    "two-groups": [setup.fa(4), setup.sw(4, 8)],
    # Twin groups, rings (fixed blocks) and a state that keeps no
    # checkpoints: the tables of many groups joined into one release.
    "twins-and-rings": [
        setup.fa(4),
        ring(4),
        setup.sw(4, 8),
        setup.fa(4),
        setup.mamba(4, mode="none"),
        setup.sw(4, 8),
        ring(4),
    ],
    # 8-token blocks hashed at 4: hits ending inside a block (partial keys).
    "partial-hits": [setup.fa(8), setup.fa(4)],
}


@pytest.mark.parametrize("plan", FREE_PLANS, ids=list(FREE_PLANS))
def test_a_vetted_plan_frees_in_one_frame(plan: str) -> None:
    fast, _ = pair(FREE_PLANS[plan], scheduler_block_size=8)
    assert "free" in fast.__dict__
    if plan == "partial-hits":
        assert fast.coordinator.partial is not None


@pytest.mark.parametrize("plan", FREE_PLANS, ids=list(FREE_PLANS))
@pytest.mark.parametrize("seed", range(4))
def test_fast_free_matches_the_general_path(plan: str, seed: int) -> None:
    """Random admissions, decodes and frees (by object and by id, with
    shared prefixes so frees drop references other requests keep)."""
    managers = pair(FREE_PLANS[plan], num_blocks=96, scheduler_block_size=8)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100) for _ in range(8)] for _ in range(3)]
    live: list[str] = []
    for step in range(120):
        action = rng.random()
        if action < 0.45 or not live:
            rid = f"r{step}"
            prompt = random_prompt(rng, prefixes)
            outs = []
            for mgr in managers:
                req = Request(rid, prompt, hash_block_size=4)
                blocks, hit = mgr.get_computed_blocks(req)
                out = mgr.allocate_slots(req, len(prompt) - hit, hit, blocks)
                if out is not None:
                    req.num_computed_tokens = len(prompt)
                outs.append((hit, out))
            assert outs[0][0] == outs[1][0]
            assert (outs[0][1] is None) == (outs[1][1] is None)
            if outs[0][1] is not None:
                live.append(rid)
        elif action < 0.7:
            rid = rng.choice(live)
            token = rng.randrange(100)
            grew = set()
            for mgr in managers:
                req = mgr._requests[rid]
                grew.add(mgr.allocate_slots(req, 1) is not None)
                if req.num_computed_tokens < req.num_tokens:
                    req.num_computed_tokens += 1
                    req.append_output_token_ids(token)
            assert len(grew) == 1
        else:
            rid = live.pop(rng.randrange(len(live)))
            by_id = rng.random() < 0.5
            held = [mgr._requests[rid] for mgr in managers]
            for mgr, req in zip(managers, held, strict=True):
                handed = mgr.get_blocks(rid).blocks
                ids = [[b.block_id for b in group] for group in handed]
                mgr.free(rid if by_id else req)
                assert req.status is RequestStatus.FINISHED
                # What get_blocks handed out is left as it was.
                assert [[b.block_id for b in group] for group in handed] == ids
        assert observed(managers[0]) == observed(managers[1])


def outcome(call: Any) -> tuple[Any, ...]:
    """What a step returned (block ids per group) or raised (type, message)."""
    try:
        out = call()
    except KvcoreError as exc:
        return ("raised", type(exc), str(exc))
    if out is None:
        return ("refused",)
    return ("blocks", [[b.block_id for b in group] for group in out.blocks])


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_one_frame_growth_matches_the_general_path(caching: bool, seed: int) -> None:
    """Random admissions, growth by one token (decode) or by a chunk,
    frees, and a small pool that runs dry, so steps are refused; the
    steps return the same blocks, refuse the same steps and leave the same
    pool, tables, hashes and statuses."""
    managers = pair(
        [setup.fa(4)],
        num_blocks=24,
        enable_caching=caching,
        enable_kv_cache_events=caching,
    )
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100) for _ in range(8)] for _ in range(3)]
    live: list[str] = []
    for step in range(300):
        action = rng.random()
        if action < 0.25 or not live:
            rid = f"r{step}"
            prompt = random_prompt(rng, prefixes)
            # A first chunk; the rest comes as later chunks.
            first = rng.randrange(1, len(prompt) + 1)
            outs = []
            for mgr in managers:
                req = Request(rid, prompt, hash_block_size=4)
                blocks, hit = mgr.get_computed_blocks(req)
                chunk = max(first - hit, 1) if hit < len(prompt) else 0
                outs.append(
                    outcome(
                        lambda mgr=mgr, req=req, blocks=blocks, hit=hit, chunk=chunk: (
                            mgr.allocate_slots(req, chunk, hit, blocks)
                            if chunk
                            else None
                        )
                    )
                )
                if outs[-1][0] == "blocks":
                    req.num_computed_tokens = hit + chunk
            assert outs[0] == outs[1]
            if outs[0][0] == "blocks":
                live.append(rid)
        elif action < 0.85:
            rid = rng.choice(live)
            reqs = [mgr._requests[rid] for mgr in managers]
            left = reqs[0].num_tokens - reqs[0].num_computed_tokens
            n = (
                rng.choice([1, 1, 1, 2, 5, 9])
                if left <= 0
                else rng.randrange(1, left + 1)
            )
            outs = [
                outcome(lambda mgr=mgr, req=req, n=n: mgr.allocate_slots(req, n))
                for mgr, req in zip(managers, reqs, strict=True)
            ]
            assert outs[0] == outs[1]
            if outs[0][0] == "blocks":
                sampled = [
                    rng.randrange(100)
                    for _ in range(
                        reqs[0].num_computed_tokens + n + 1 - reqs[0].num_tokens
                    )
                ]
                for req in reqs:
                    req.num_computed_tokens += n
                    if sampled:
                        req.append_output_token_ids(sampled)
        else:
            rid = live.pop(rng.randrange(len(live)))
            for mgr in managers:
                mgr.free(rid)
        assert observed(managers[0]) == observed(managers[1])
        assert [r.status for r in managers[0]._requests.values()] == [
            r.status for r in managers[1]._requests.values()
        ]
        for a, b in zip(managers[0]._managers, managers[1]._managers, strict=True):
            assert {
                rid: [blk.block_id for blk in blocks]
                for rid, blocks in a.req_to_blocks.items()
            } == {
                rid: [blk.block_id for blk in blocks]
                for rid, blocks in b.req_to_blocks.items()
            }
            assert a.num_cached_block == b.num_cached_block
        assert managers[0].take_events() == managers[1].take_events()


@pytest.mark.parametrize(
    "arguments",
    [
        {"num_new_tokens": 0},
        {"num_new_tokens": -1},
        {"num_new_tokens": True},
        {"num_new_tokens": 1.0},
        {"num_new_tokens": 1, "num_new_computed_tokens": False},
        {"num_new_tokens": 1, "num_new_computed_tokens": 0.0},
        {"num_new_tokens": 1, "num_new_computed_tokens": None},
        {"num_new_tokens": 1, "num_lookahead_tokens": -1},
        {"num_new_tokens": 1, "num_lookahead_tokens": None},
        {"num_new_tokens": 1, "num_lookahead_tokens": 3},
        {"num_new_tokens": 1, "delay_cache_blocks": True},
        {"num_new_tokens": 1, "num_encoder_tokens": 4},
        {"num_new_tokens": 1, "num_external_computed_tokens": 4},
        {"num_new_tokens": 1, "full_sequence_must_fit": True},
        {"num_new_tokens": 5000},
        {"num_new_tokens": 40},
    ],
    ids=repr,
)
def test_one_frame_growth_answers_every_argument_as_the_general_path(
    arguments: dict[str, Any],
) -> None:
    """Bad values, keywords the shortcut does not handle and steps past
    max_model_len or the pool: the same answer, the same state after."""
    results = []
    for mgr in pair([setup.fa(4)], num_blocks=16):
        req = Request("a", list(range(2, 12)), hash_block_size=4)
        assert mgr.allocate_slots(req, 10) is not None
        req.num_computed_tokens = 10
        req.append_output_token_ids(7)
        results.append(
            (
                outcome(lambda mgr=mgr, req=req: mgr.allocate_slots(req, **arguments)),
                observed(mgr),
                req.status,
            )
        )
    assert results[0] == results[1]


ADMISSIONS: dict[str, Any] = {
    "the-hit": lambda hit, tokens: {"num_new_computed_tokens": tokens},
    "no-hit": lambda hit, tokens: {
        "new_computed_blocks": None,
        "num_new_computed_tokens": 0,
    },
    "the-empty-hit": lambda hit, tokens: {"new_computed_blocks": "empty"},
    "hit-one-block-short": lambda hit, tokens: {"num_new_computed_tokens": tokens - 4},
    "hit-one-block-long": lambda hit, tokens: {"num_new_computed_tokens": tokens + 4},
    "hit-unaligned": lambda hit, tokens: {"num_new_computed_tokens": tokens - 1},
    "hit-with-no-tokens": lambda hit, tokens: {"num_new_computed_tokens": 0},
    "tokens-with-no-hit": lambda hit, tokens: {
        "new_computed_blocks": None,
        "num_new_computed_tokens": 4,
    },
    "tokens-with-the-empty-hit": lambda hit, tokens: {
        "new_computed_blocks": "empty",
        "num_new_computed_tokens": 4,
    },
    "bool-tokens": lambda hit, tokens: {
        "new_computed_blocks": None,
        "num_new_computed_tokens": False,
    },
    "float-tokens": lambda hit, tokens: {"num_new_computed_tokens": float(tokens)},
    "no-tokens-given": lambda hit, tokens: {
        "new_computed_blocks": None,
        "num_new_computed_tokens": None,
    },
    "lookahead": lambda hit, tokens: {"num_lookahead_tokens": 3},
    "delayed-caching": lambda hit, tokens: {"delay_cache_blocks": True},
    "external-tokens": lambda hit, tokens: {"num_external_computed_tokens": 4},
    "full-sequence": lambda hit, tokens: {"full_sequence_must_fit": True},
    "past-max-model-len": lambda hit, tokens: {"num_new_tokens": 9000},
    "past-the-pool": lambda hit, tokens: {"num_new_tokens": 200},
    "hit-of-another-request": lambda hit, tokens: {"new_computed_blocks": "other"},
    "hit-evicted-since": lambda hit, tokens: {"evict": True},
    "hit-of-another-manager": lambda hit, tokens: {"new_computed_blocks": "foreign"},
    "hashed-at-another-size": lambda hit, tokens: {"request_hash_block_size": 8},
}


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("case", list(ADMISSIONS))
def test_one_frame_admission_answers_every_argument_as_the_general_path(
    case: str, caching: bool
) -> None:
    """A new request admitted with its own lookup's hit, without one, with
    a hit that does not match it (short, long, unaligned, another
    request's, another manager's, evicted since), bad token counts, and
    the keywords and steps the shortcut leaves to the general path: the
    same answer, the same pool, tables and status after."""
    prompt = list(range(2, 22))
    # Another prompt, cached too: its hit is of another prefix.
    elsewhere = list(range(50, 70))
    results = []
    foreign_mgr = setup.manager_for(
        [setup.fa(4)], 32, scheduler_block_size=4, hash_block_size=4
    )
    assert foreign_mgr.allocate_slots(Request("x", prompt, hash_block_size=4), 20)
    for mgr in pair([setup.fa(4)], num_blocks=32, enable_caching=caching):
        for rid, tokens in (("first", prompt), ("second", elsewhere)):
            first = Request(rid, tokens, hash_block_size=4)
            assert mgr.allocate_slots(first, len(tokens)) is not None
            mgr.free(first)
        args = ADMISSIONS[case](None, 0)
        size = args.pop("request_hash_block_size", 4)
        req = Request("a", prompt, hash_block_size=size)
        blocks, hit = (
            mgr.get_computed_blocks(req)
            if size == 4
            else (mgr.empty_kv_cache_blocks, 0)
        )
        assert hit == (16 if caching and size == 4 else 0)
        args = ADMISSIONS[case](blocks, hit)
        args.pop("request_hash_block_size", None)
        if args.pop("evict", False):
            # Another request takes every free block: the hit's are evicted.
            hog = Request("hog", list(range(100, 200)), hash_block_size=4)
            assert mgr.allocate_slots(hog, mgr.block_pool.get_num_free_blocks() * 4)
            mgr.free(hog)
        given = args.pop("new_computed_blocks", blocks)
        if given == "empty":
            given = mgr.empty_kv_cache_blocks
        elif given == "other":
            other = Request("b", elsewhere, hash_block_size=4)
            given = mgr.get_computed_blocks(other)[0]
        elif given == "foreign":
            # The same request looked up in another manager.
            given = foreign_mgr.get_computed_blocks(req)[0]
        args.setdefault("num_new_computed_tokens", hit)
        args.setdefault(
            "num_new_tokens",
            len(prompt) - args["num_new_computed_tokens"]
            if isinstance(args["num_new_computed_tokens"], int)
            else 4,
        )
        results.append(
            (
                outcome(
                    lambda mgr=mgr, req=req, given=given, args=args: mgr.allocate_slots(
                        req, new_computed_blocks=given, **args
                    )
                ),
                observed(mgr),
                req.status,
                [
                    (
                        sorted(m.num_cached_block.items()),
                        {
                            r: [b.block_id for b in t]
                            for r, t in m.req_to_blocks.items()
                        },
                    )
                    for m in mgr._managers
                ],
            )
        )
    assert results[0] == results[1]


#: A 20-token prompt: five 4-token blocks, four of them a hit once cached.
PROMPT = list(range(2, 22))


def looked_up(mgr: KVCacheManager, prompt: list[int]) -> tuple[Request, Any, int]:
    """A new request "a" for ``prompt`` and its lookup, after another request
    with that prompt has cached its blocks and left."""
    first = Request("first", prompt, hash_block_size=4)
    assert mgr.allocate_slots(first, len(prompt)) is not None
    mgr.free(first)
    req = Request("a", prompt, hash_block_size=4)
    blocks, hit = mgr.get_computed_blocks(req)
    return req, blocks, hit


def test_one_frame_admission_takes_the_shortcut() -> None:
    """An admission with this manager's own hit, or with none, runs in
    the shortcut; the general path's admission steps are not called."""
    mgr = setup.manager_for(
        [setup.fa(4)], 32, scheduler_block_size=4, hash_block_size=4
    )
    calls: list[str] = []
    coordinator = mgr.coordinator
    count = coordinator.get_num_blocks_to_allocate

    def spy(*args: Any) -> int:
        calls.append("general")
        return count(*args)

    coordinator.get_num_blocks_to_allocate = spy  # type: ignore[method-assign]
    req, blocks, hit = looked_up(mgr, PROMPT)
    assert hit == 16
    out = mgr.allocate_slots(req, 4, hit, blocks)
    assert out is not None
    assert [b.block_id for b in mgr.get_blocks("a").blocks[0]][:4] == [
        b.block_id for b in blocks.blocks[0]
    ]
    assert all(b.ref_cnt == 1 for b in blocks.blocks[0])
    assert calls == []
    mgr.block_pool.begin()
    again = Request("b", PROMPT, hash_block_size=4)
    blocks, hit = mgr.get_computed_blocks(again)
    assert mgr.allocate_slots(again, 4, hit, blocks) is not None
    mgr.block_pool.commit()
    assert calls == ["general"]


def test_one_frame_admission_takes_blocks_of_any_shape_as_the_general_path() -> None:
    """Blocks that are not a lookup's (a duck-typed object with empty
    lists, a KVCacheBlocks subclass that never set its lookup, a bare
    tuple): the same answer as the general path, errors included."""
    import types

    class Bare(KVCacheBlocks):
        def __init__(self, blocks: Any) -> None:
            self.blocks = blocks
            self.copies = ()

    def step(mgr: KVCacheManager, req: Request, given: Any) -> tuple[Any, ...]:
        try:
            out = mgr.allocate_slots(req, 10, 0, given)
        except Exception as exc:  # a non-kvcore error counts too
            return (type(exc), str(exc))
        assert out is not None
        return ("blocks", [[b.block_id for b in group] for group in out.blocks])

    for make in (
        lambda: types.SimpleNamespace(blocks=([],)),
        lambda: Bare(([],)),
        lambda: ((),),
    ):
        results = []
        for mgr in pair([setup.fa(4)], num_blocks=16):
            req = Request("a", list(range(2, 12)), hash_block_size=4)
            results.append((step(mgr, req, make()), observed(mgr), req.status))
        assert results[0] == results[1]


def test_create_kv_cache_blocks_patched_later_sees_admissions_and_growth() -> None:
    from unittest import mock

    mgr = setup.manager_for(
        [setup.fa(4)], 16, scheduler_block_size=4, hash_block_size=4
    )
    req = Request("a", list(range(2, 12)), hash_block_size=4)
    original = KVCacheManager.create_kv_cache_blocks
    with mock.patch.object(
        KVCacheManager, "create_kv_cache_blocks", autospec=True, side_effect=original
    ) as spy:
        assert mgr.allocate_slots(req, 10) is not None
        req.num_computed_tokens = 10
        assert mgr.allocate_slots(req, 3) is not None
    assert spy.call_count == 2


@pytest.mark.parametrize("helper", ["_check_hashing", "_check_hit", "_step"])
def test_a_step_helper_patched_onto_the_class_later_sees_admissions(
    helper: str,
) -> None:
    """A spy on one of the general path's helpers, patched onto the class
    after the manager exists, is called as the general path calls it."""
    from unittest import mock

    mgr = setup.manager_for(
        [setup.fa(4)], 32, scheduler_block_size=4, hash_block_size=4
    )
    req, blocks, hit = looked_up(mgr, PROMPT)
    original = getattr(KVCacheManager, helper)
    with mock.patch.object(
        KVCacheManager, helper, autospec=True, side_effect=original
    ) as spy:
        assert mgr.allocate_slots(req, 4, hit, blocks) is not None
    assert spy.call_count == 1


def test_a_subclass_overriding_a_step_helper_takes_the_general_path() -> None:
    calls: list[str] = []

    class Logging(KVCacheManager):
        def _step(self, *args: Any) -> Any:
            calls.append("_step")
            return super()._step(*args)

    config = setup.KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[setup.KVCacheGroupSpec(["layer.0"], setup.fa(4))],
    )
    mgr = Logging(
        config, 4096, scheduler_block_size=4, hash_block_size=4, registry=setup.BUILT_IN
    )
    assert "allocate_slots" not in mgr.__dict__
    req = Request("a", list(range(2, 12)), hash_block_size=4)
    assert mgr.allocate_slots(req, 10) is not None
    req.num_computed_tokens = 10
    assert mgr.allocate_slots(req, 1) is not None
    assert calls == ["_step", "_step"]


def test_one_frame_growth_defers_to_the_general_path_when_it_must() -> None:
    """Another object with the live id (same tokens: it stands for the
    live one; other tokens: refused), a step inside a transaction, a plan
    marked unvetted: each takes the checked path."""
    mgr = setup.manager_for(
        [setup.fa(4)], 16, scheduler_block_size=4, hash_block_size=4
    )
    req = Request("a", list(range(2, 12)), hash_block_size=4)
    assert mgr.allocate_slots(req, 10) is not None
    req.num_computed_tokens = 10
    same = Request("a", list(range(2, 12)), hash_block_size=4)
    same.num_computed_tokens = 10
    assert mgr.allocate_slots(same, 2) is not None
    assert len(mgr.get_blocks("a").blocks[0]) == 3
    other = Request("a", list(range(3, 13)), hash_block_size=4)
    other.num_computed_tokens = 10
    with pytest.raises(InvalidRequestError, match="already holds blocks"):
        mgr.allocate_slots(other, 2)
    calls: list[str] = []
    coordinator = mgr.coordinator
    count = coordinator.get_num_blocks_to_grow

    def spy(request_id: str, num_tokens: int) -> int:
        calls.append("general")
        return count(request_id, num_tokens)

    coordinator.get_num_blocks_to_grow = spy  # type: ignore[method-assign]
    same.num_computed_tokens = 12  # the live object now
    mgr.allocate_slots(same, 1)
    assert calls == []  # the shortcut
    mgr.block_pool.begin()
    mgr.allocate_slots(same, 1)
    mgr.block_pool.commit()
    assert calls == ["general"]
    coordinator.vetted = False
    mgr.allocate_slots(same, 1)
    assert calls == ["general", "general"]
    coordinator.vetted = True
    mgr.allocate_slots(same, 1)
    assert calls == ["general", "general"]


def test_a_subclass_overriding_allocate_slots_keeps_its_override() -> None:
    calls: list[int] = []

    class Logging(KVCacheManager):
        def allocate_slots(  # type: ignore[override]
            self, request: Request, num_new_tokens: int, *args: Any, **kw: Any
        ) -> Any:
            calls.append(num_new_tokens)
            return super().allocate_slots(request, num_new_tokens, *args, **kw)

    mgr = one_group_manager(Logging)
    assert "allocate_slots" not in mgr.__dict__
    req = Request("a", list(range(2, 12)), hash_block_size=4)
    assert mgr.allocate_slots(req, 10) is not None
    req.num_computed_tokens = 10
    assert mgr.allocate_slots(req, 1) is not None
    assert calls == [10, 1]


def test_fast_free_errors_match_the_general_path() -> None:
    for mgr in pair([setup.fa(4)]):
        with pytest.raises(UnknownRequestError, match="holds no blocks"):
            mgr.free("never-seen")
        req = Request("a", list(range(10)), hash_block_size=4)
        assert mgr.allocate_slots(req, 10) is not None
        # A second object with the live id is marked finished with the first.
        twin = Request("a", list(range(10)), hash_block_size=4)
        mgr.free(twin)
        assert req.status is twin.status is RequestStatus.FINISHED
        with pytest.raises(UnknownRequestError):
            mgr.free(req)
        assert mgr.block_pool.get_num_free_blocks() == 63


def test_fast_free_reports_a_double_free_and_changes_nothing() -> None:
    """A table whose block lost its reference behind the manager's back:
    the release refuses it and leaves every count as it was."""
    results = []
    for mgr in pair([setup.fa(4)]):
        req = Request("a", list(range(10)), hash_block_size=4)
        assert mgr.allocate_slots(req, 10) is not None
        table = mgr._managers[0].req_to_blocks["a"]
        table[1].ref_cnt = 0
        before = [b.ref_cnt for b in mgr.block_pool.blocks]
        with pytest.raises(InvalidRequestError) as info:
            mgr.free(req)
        assert isinstance(info.value, KvcoreError)
        assert [b.ref_cnt for b in mgr.block_pool.blocks] == before
        results.append(
            (
                str(info.value),
                mgr.block_pool.get_num_free_blocks(),
                sorted(mgr._requests),
            )
        )
        # The request is still known: freeing it again finishes it.
        mgr.free("a")
        assert req.status is RequestStatus.FINISHED
    assert results[0] == results[1]


def test_thread_safe_manager_locks_the_fast_free() -> None:
    mgr = setup.manager_for(
        [setup.fa(4)], 16, scheduler_block_size=4, hash_block_size=4, thread_safe=True
    )
    req = Request("a", list(range(6)), hash_block_size=4)
    assert mgr.allocate_slots(req, 6) is not None
    assert mgr.lock is not None
    free = mgr.__dict__["free"]
    assert getattr(free, "__wrapped__", None) is not None
    mgr.free(req)
    assert mgr.block_pool.get_num_free_blocks() == 15


def test_a_prompt_shorter_than_the_hit_unit_searches_no_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Blocks of 16 and 64 tokens and whole-block hits: hits come in
    64-token units, so a 40-token prompt gets none without any group being
    searched; a 100-token prompt is searched and hits its first unit."""
    mgr = setup.manager_for(
        [setup.fa(16), setup.fa(64)],
        64,
        scheduler_block_size=64,
        hash_block_size=16,
        enable_partial_hits=False,
    )
    tokens = list(range(100))
    first = Request("first", tokens, hash_block_size=16)
    assert mgr.allocate_slots(first, 100) is not None
    mgr.free(first)
    searched: list[int] = []
    for manager in mgr._managers:
        original = type(manager).find_longest_cache_hit

        def spy(query: Any, original: Any = original) -> Any:
            searched.append(query.max_length)
            return original(query)

        monkeypatch.setattr(type(manager), "find_longest_cache_hit", spy)
    short = Request("short", tokens[:40], hash_block_size=16)
    assert mgr.get_computed_blocks(short)[1] == 0
    assert searched == []
    again = Request("again", tokens, hash_block_size=16)
    assert mgr.get_computed_blocks(again)[1] == 64
    assert searched


def test_a_subclass_overriding_free_keeps_its_override() -> None:
    calls: list[str] = []

    class Logging(KVCacheManager):
        def free(self, request: Request | str) -> None:
            calls.append(request if isinstance(request, str) else request.request_id)
            super().free(request)

    mgr = one_group_manager(Logging)
    assert "free" not in mgr.__dict__
    req = Request("a", list(range(2, 12)), hash_block_size=4)
    assert mgr.allocate_slots(req, 10) is not None
    mgr.free(req)
    assert calls == ["a"]
    assert req.status is RequestStatus.FINISHED
    assert mgr.block_pool.get_num_free_blocks() == 15


def test_a_plan_marked_unvetted_later_frees_through_the_checked_path() -> None:
    """A manager whose method is replaced on the instance is not kvcore's
    own any more (the coordinator's ``vetted`` cleared, as the partial-hit
    tests do): free runs its pop_blocks, reports its failure as the
    plugin's, and leaves the request holding its blocks."""
    mgr = setup.manager_for(
        [setup.fa(4)], 16, scheduler_block_size=4, hash_block_size=4
    )
    req = Request("a", list(range(2, 12)), hash_block_size=4)
    assert mgr.allocate_slots(req, 10) is not None
    manager = mgr._managers[0]

    def broken(request_id: str) -> None:
        raise RuntimeError("pop_blocks failed")

    manager.pop_blocks = broken  # type: ignore[method-assign]
    mgr.coordinator.vetted = False
    with pytest.raises(KvcoreError, match="pop_blocks failed"):
        mgr.free(req)
    assert req.status is RequestStatus.RUNNING
    assert mgr.block_pool.get_num_free_blocks() == 12
    assert "a" in manager.req_to_blocks


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_large_pool_loaded_through_plugins_copies_and_pickles(how: str) -> None:
    """A manager whose registry came from a plugin manager (as an engine's
    does), over 20,000 blocks, cached, free and in use, deep-copies and
    pickles: the free queue is copied as its order, not along its links
    (a walk that passed Python's recursion limit at a few hundred blocks),
    and the plugin manager, which holds modules, stays behind; the copy
    keeps the distributions its errors name.  Both sides then answer the
    same steps alike."""
    import copy
    import pickle

    mgr = setup.manager_for(
        [setup.fa(4), setup.sw(4, 8)],
        20_000,
        scheduler_block_size=4,
        hash_block_size=4,
        registry=setup.builtin_registry(),
    )
    shared = [7] * 8
    for i in range(30):
        req = Request(
            f"r{i}", shared + list(range(i * 100, i * 100 + 30)), hash_block_size=4
        )
        blocks, hit = mgr.get_computed_blocks(req)
        assert mgr.allocate_slots(req, 38 - hit, hit, blocks) is not None
        if i % 3:
            mgr.free(req)
    clone = copy.deepcopy(mgr) if how == "deepcopy" else pickle.loads(pickle.dumps(mgr))
    assert observed(clone) == observed(mgr)
    keys = [b.block_hash for b in mgr.block_pool.blocks]
    assert [b.block_hash for b in clone.block_pool.blocks] == keys
    assert mgr.block_pool.num_cached_blocks > 0
    hits = []
    for side in (mgr, clone):
        req = Request("x", shared + list(range(40)), hash_block_size=4)
        blocks, hit = side.get_computed_blocks(req)
        assert side.allocate_slots(req, 48 - hit, hit, blocks) is not None
        hits.append(hit)
        for i in range(0, 30, 3):
            side.free(f"r{i}")
    assert hits[0] == hits[1] > 0
    assert observed(clone) == observed(mgr)
    owners = set(mgr.coordinator._owners)
    assert {p: clone.coordinator._distribution(p) for p in owners} == {
        p: mgr.coordinator._distribution(p) for p in owners
    }


@pytest.mark.parametrize("thread_safe", [False, True])
@pytest.mark.parametrize(
    "specs",
    [[setup.fa(4)], [setup.fa(4), setup.sw(4, 8)], [setup.fa(4), setup.mamba(4)]],
    ids=["one-group", "two-groups", "state-hybrid"],
)
def test_a_copied_manager_runs_on_its_own(specs: list[Any], thread_safe: bool) -> None:
    """The shortcuts a manager binds close over its own state; a deep copy
    (a what-if fork) binds its own, so each side's steps leave the other
    alone and the two agree on the same steps."""
    import copy

    mgr = setup.manager_for(
        specs, 48, scheduler_block_size=4, hash_block_size=4, thread_safe=thread_safe
    )
    req = Request("a", list(range(2, 12)), hash_block_size=4)
    assert mgr.allocate_slots(req, 10) is not None
    fork = copy.deepcopy(mgr)
    before = observed(mgr)
    assert observed(fork) == before
    # A running step on the fork (the one-group growth, where bound).
    grown = fork._requests["a"]
    grown.num_computed_tokens = 10
    assert fork.allocate_slots(grown, 3) is not None
    assert observed(mgr) == before
    req.num_computed_tokens = 10
    assert mgr.allocate_slots(req, 3) is not None
    before = observed(mgr)
    assert observed(fork) == before
    fork.free("a")
    assert observed(mgr) == before
    assert req.status is RequestStatus.RUNNING
    mgr.free("a")
    assert req.status is RequestStatus.FINISHED
    assert observed(mgr) == observed(fork)
    hits = []
    for side in (mgr, fork):
        other = Request("b", list(range(2, 20)), hash_block_size=4)
        blocks, hit = side.get_computed_blocks(other)
        assert side.allocate_slots(other, 18 - hit, hit, blocks) is not None
        hits.append(hit)
    assert hits[0] == hits[1] > 0
    assert observed(mgr) == observed(fork)
    if thread_safe:
        assert fork.lock is not None
        assert fork.lock is not mgr.lock


@pytest.mark.parametrize("name", ["free", "allocate_slots"])
def test_a_method_patched_onto_the_class_runs_instead_of_a_shortcut(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wrapper an engine or a test patches onto ``KVCacheManager`` (as
    the hit-rate tests do) sees every call of a manager built after it."""
    calls: list[str] = []
    original = getattr(KVCacheManager, name)

    def wrapper(self: KVCacheManager, *args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(KVCacheManager, name, wrapper)
    mgr = setup.manager_for(
        [setup.fa(4)], 16, scheduler_block_size=4, hash_block_size=4
    )
    assert name not in mgr.__dict__
    req = Request("a", list(range(2, 12)), hash_block_size=4)
    assert mgr.allocate_slots(req, 10) is not None
    req.num_computed_tokens = 10
    assert mgr.allocate_slots(req, 1) is not None
    mgr.free(req)
    assert calls == ([name] * 2 if name == "allocate_slots" else [name])
    assert mgr.block_pool.get_num_free_blocks() == 15


@pytest.mark.parametrize("name", ["free", "allocate_slots"])
def test_a_method_patched_onto_the_class_later_sees_every_call(name: str) -> None:
    """A spy patched onto the class after the manager exists (mock.patch
    in an engine's tests) is called, shortcut bound or not."""
    from unittest import mock

    mgr = setup.manager_for(
        [setup.fa(4)], 16, scheduler_block_size=4, hash_block_size=4
    )
    assert name in mgr.__dict__
    req = Request("a", list(range(2, 12)), hash_block_size=4)
    assert mgr.allocate_slots(req, 10) is not None
    req.num_computed_tokens = 10
    original = getattr(KVCacheManager, name)
    with mock.patch.object(
        KVCacheManager, name, autospec=True, side_effect=original
    ) as spy:
        if name == "allocate_slots":
            assert mgr.allocate_slots(req, 3) is not None
        else:
            mgr.free(req)
    assert spy.call_count == 1
    assert mgr.block_pool.get_num_free_blocks() == (
        11 if name == "allocate_slots" else 15
    )


def test_one_frame_growth_reads_settings_and_methods_per_call() -> None:
    """Settings changed and group-manager methods patched after
    construction act as on the general path."""
    mgr = setup.manager_for(
        [setup.fa(4)], 32, scheduler_block_size=4, hash_block_size=4
    )
    req = Request("a", list(range(2, 10)), hash_block_size=4)
    assert mgr.allocate_slots(req, 8) is not None
    req.num_computed_tokens = 8
    req.append_output_token_ids([7, 8, 9, 10])
    mgr.max_model_len = 9
    with pytest.raises(InvalidRequestError, match="past max_model_len=9"):
        mgr.allocate_slots(req, 4)
    mgr.max_model_len = 4096
    mgr.enable_caching = False
    cached = mgr.block_pool.num_cached_blocks
    assert mgr.allocate_slots(req, 4) is not None
    assert mgr.block_pool.num_cached_blocks == cached
    req.num_computed_tokens = 12
    manager = mgr._managers[0]
    calls: list[int] = []
    grow = manager.allocate_new_blocks

    def spy(request_id: str, num_tokens: int) -> Any:
        calls.append(num_tokens)
        return grow(request_id, num_tokens)

    manager.allocate_new_blocks = spy  # type: ignore[method-assign]
    assert mgr.allocate_slots(req, 1) is not None
    assert calls == [13]


def test_a_subclass_overriding_create_kv_cache_blocks_sees_growth_steps() -> None:
    made: list[int] = []

    class Counting(KVCacheManager):
        def create_kv_cache_blocks(self, blocks: Any) -> Any:
            made.append(len(blocks[0]))
            return super().create_kv_cache_blocks(blocks)

    mgr = one_group_manager(Counting)
    assert "allocate_slots" not in mgr.__dict__
    req = Request("a", list(range(2, 10)), hash_block_size=4)
    assert mgr.allocate_slots(req, 8) is not None
    req.num_computed_tokens = 8
    assert mgr.allocate_slots(req, 5) is not None
    assert made == [2, 2]
