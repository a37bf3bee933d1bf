"""Misuse of the coordinator's public API is refused before anything changes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from coordinator_setup import small_manager
from coordinator_setup import sw as setup_sw

import kvcore
from kvcore import KVCacheConfig, KVCacheGroupSpec
from kvcore.coordinator import KVCacheManager, Request
from kvcore_full_attention import FullAttentionSpec
from kvcore_mamba import MambaSpec


def fa_manager(num_blocks: int = 8) -> KVCacheManager:
    spec = FullAttentionSpec(
        block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["l"], spec)],
    )
    return KVCacheManager(
        config, max_model_len=64, scheduler_block_size=4, hash_block_size=4
    )


def req(rid: str, n: int) -> Request:
    return Request(rid, list(range(n)), hash_block_size=4)


def snapshot(mgr: KVCacheManager) -> tuple[object, ...]:
    pool = mgr.block_pool
    return (
        list(pool.ref_cnt),
        pool.free_queue.get_all_free_blocks(),
        pool.num_cached_blocks,
    )


def test_stale_hit_is_refused() -> None:
    # num_blocks 8 -> 7 usable.  r1 caches 3 full blocks (ids 1, 2, 3) and is
    # freed; r2's lookup hits all three (12 of 13 tokens: max is num_tokens - 1).
    mgr = fa_manager(8)
    r1 = req("r1", 12)
    mgr.allocate_slots(r1, 12)
    mgr.free(r1)
    r2 = req("r2", 13)
    hit, n = mgr.get_computed_blocks(r2)
    assert n == 12
    assert hit.get_block_ids() == ([1, 2, 3],)
    # r3 (different tokens) takes all 7 free blocks: the 4 never-hashed ones
    # first, then the LRU cached ones, evicting 1, 2 and 3.
    r3 = Request("r3", [9] * 28, hash_block_size=4)
    assert mgr.allocate_slots(r3, 28) is not None
    mgr.free(r3)
    before = snapshot(mgr)
    with pytest.raises(kvcore.InvalidRequestError, match=r"'r2'.*no longer holds"):
        mgr.allocate_slots(r2, 1, n, hit)
    assert snapshot(mgr) == before


def test_hit_tokens_without_blocks_are_refused() -> None:
    mgr = fa_manager()
    before = snapshot(mgr)
    with pytest.raises(
        kvcore.InvalidRequestError, match="hit of 8 tokens came with no blocks"
    ):
        mgr.allocate_slots(req("a", 12), 4, num_new_computed_tokens=8)
    assert snapshot(mgr) == before


def test_hit_blocks_for_a_running_request_are_refused() -> None:
    mgr = fa_manager()
    r1 = req("r1", 12)
    mgr.allocate_slots(r1, 12)
    mgr.free(r1)
    r2 = req("r2", 13)
    hit, _ = mgr.get_computed_blocks(r2)
    mgr.allocate_slots(r2, 4)  # scheduled without its hit
    r2.num_computed_tokens = 4
    with pytest.raises(kvcore.InvalidRequestError, match="'r2' already holds blocks"):
        mgr.allocate_slots(r2, 4, 0, hit)


def test_hit_length_must_match_the_blocks() -> None:
    mgr = fa_manager()
    r1 = req("r1", 12)
    mgr.allocate_slots(r1, 12)
    mgr.free(r1)
    r2 = req("r2", 13)
    hit, _ = mgr.get_computed_blocks(r2)  # 3 blocks = 12 tokens
    with pytest.raises(
        kvcore.InvalidRequestError, match="covers 8 tokens but group 0 holds 3"
    ):
        mgr.allocate_slots(r2, 5, 8, hit)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_new_tokens": 1.5}, "positive int"),
        ({"num_new_tokens": 0}, "positive int"),
        ({"num_new_tokens": 1, "num_lookahead_tokens": -100}, "num_lookahead_tokens"),
        (
            {"num_new_tokens": 1, "num_new_computed_tokens": -4},
            "num_new_computed_tokens",
        ),
    ],
    ids=["float", "zero", "negative-lookahead", "negative-computed"],
)
def test_bad_token_counts_are_refused(kwargs: dict[str, object], match: str) -> None:
    mgr = fa_manager()
    with pytest.raises(kvcore.InvalidRequestError, match=match):
        mgr.allocate_slots(req("a", 4), **kwargs)  # type: ignore[arg-type]


def test_a_request_id_is_not_a_request() -> None:
    with pytest.raises(
        kvcore.KvcoreTypeError, match=r"expected a kvcore\.coordinator\.Request"
    ):
        fa_manager().allocate_slots("a", 4)  # type: ignore[arg-type]


def test_single_group_schedules_in_its_own_block() -> None:
    # One MLA-like group of 64-token blocks: the engine default (16) must not
    # leak into the scheduler block, or the manager would refuse the plan.
    spec = FullAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=8, dtype=torch.uint8
    )
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout="BLHNC", enable_prefix_caching=True
        )
    )
    groups = kvcore.get_kv_cache_groups(config, {"a": spec, "b": spec})
    plan = kvcore.get_kv_cache_config_from_groups(config, groups, 10 * 2 * 64 * 16)
    assert kvcore.resolve_kv_cache_block_sizes(plan, config) == (64, 64)
    KVCacheManager(plan, max_model_len=256, scheduler_block_size=64, hash_block_size=64)


def test_speculative_mamba_states_in_align_mode_are_refused() -> None:
    spec = MambaSpec(
        block_size=4,
        shapes=((8,),),
        dtypes=(torch.float16,),
        mamba_cache_mode="align",
        num_speculative_blocks=2,
    )
    config = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["m"], spec)],
    )
    with pytest.raises(kvcore.InvalidSpecError, match="num_speculative_blocks=2"):
        KVCacheManager(config, max_model_len=64, scheduler_block_size=4)


def _sw_manager() -> KVCacheManager:
    from kvcore_sliding_window import SlidingWindowSpec

    fa4 = FullAttentionSpec(
        block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    sw = SlidingWindowSpec(
        block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16, sliding_window=8
    )
    config = KVCacheConfig(
        num_blocks=40,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["f"], fa4), KVCacheGroupSpec(["s"], sw)],
    )
    return KVCacheManager(
        config, max_model_len=64, scheduler_block_size=4, hash_block_size=4
    )


def test_a_truncated_window_hit_is_refused() -> None:
    # Window 8 over blocks of 4: a hit of n tokens needs positions n-7..n-1,
    # i.e. blocks from (n - 7) // 4 on.  A 20-token hit holds SW blocks
    # [0, 0, 0, x, y] (positions 13..19 in blocks 3 and 4).  Cut to 12 tokens
    # it is [0, 0, 0]: token 12 reads positions 5..11 (blocks 1 and 2), both
    # null, so the cut hit cannot be served.
    mgr = _sw_manager()
    toks = list(range(100, 120))
    a = Request("a", toks, hash_block_size=4)
    mgr.allocate_slots(a, 20)
    a.num_computed_tokens = 20
    b = Request("b", [*toks, 1], hash_block_size=4)
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 20
    assert blocks.get_block_ids()[1][:3] == [0, 0, 0]
    cut = mgr.truncate_computed_blocks(blocks, 12)
    before = snapshot(mgr)
    with pytest.raises(
        kvcore.InvalidRequestError, match="lack what the next token reads"
    ):
        mgr.allocate_slots(b, 9, 12, cut)
    assert snapshot(mgr) == before
    # The uncut hit attaches.
    assert mgr.allocate_slots(b, 1, hit, blocks) is not None


def test_steps_past_max_model_len_are_refused() -> None:
    mgr = fa_manager()  # max_model_len 64
    with pytest.raises(kvcore.InvalidRequestError, match="past max_model_len=64"):
        mgr.allocate_slots(req("a", 65), 65)


def test_lookahead_is_refused_for_align_mode_states() -> None:
    spec = MambaSpec(
        block_size=4, shapes=((8,),), dtypes=(torch.float16,), mamba_cache_mode="align"
    )
    config = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["m"], spec)],
    )
    mgr = KVCacheManager(config, max_model_len=64, scheduler_block_size=4)
    with pytest.raises(kvcore.InvalidRequestError, match="lookahead"):
        mgr.allocate_slots(req("a", 7), 7, num_lookahead_tokens=2)


def _entry_points() -> list[tuple[str, Any, type[Exception], str]]:
    """Wrong arguments at the scheduler's entry points: what each is
    refused as (the builtin class matters: TypeError for a wrong type,
    ValueError for a wrong value) and a fragment of the message."""
    import coordinator_setup as setup

    from kvcore.coordinator import Request

    def run(call: str) -> Any:
        def go() -> Any:
            mgr = setup.manager_for(
                [setup.fa(4)], 32, scheduler_block_size=4, hash_block_size=4
            )
            req = Request("a", list(range(2, 12)), hash_block_size=4)
            hit, _ = mgr.get_computed_blocks(req)
            return eval(call, {"mgr": mgr, "req": req, "hit": hit})

        return go

    return [
        (
            "mgr.free(5)",
            run("mgr.free(5)"),
            TypeError,
            "expected a kvcore.coordinator.Request",
        ),
        (
            "mgr.free(None)",
            run("mgr.free(None)"),
            TypeError,
            "expected a kvcore.coordinator.Request",
        ),
        (
            "mgr.cache_blocks('a', 4)",
            run("mgr.cache_blocks('a', 4)"),
            TypeError,
            "expected a kvcore.coordinator.Request",
        ),
        (
            "mgr.cache_blocks(req, -4)",
            run("mgr.cache_blocks(req, -4)"),
            ValueError,
            "num_computed_tokens must be a non-negative int",
        ),
        (
            "mgr.cache_blocks(req, '4')",
            run("mgr.cache_blocks(req, '4')"),
            TypeError,
            "num_computed_tokens must be a non-negative int",
        ),
        (
            "mgr.allocate_slots(req, 1.5)",
            run("mgr.allocate_slots(req, 1.5)"),
            TypeError,
            "asks for 1.5 new tokens",
        ),
        (
            "mgr.allocate_slots(req, True)",
            run("mgr.allocate_slots(req, True)"),
            TypeError,
            "asks for True new tokens",
        ),
        (
            "mgr.allocate_slots(req, -1)",
            run("mgr.allocate_slots(req, -1)"),
            ValueError,
            "asks for -1 new tokens",
        ),
        (
            "mgr.allocate_slots(req, 4, 0, 5)",
            run("mgr.allocate_slots(req, 4, 0, 5)"),
            TypeError,
            "new_computed_blocks must be the KVCacheBlocks",
        ),
        (
            "mgr.allocate_slots(req, 4, num_lookahead_tokens=2.0)",
            run("mgr.allocate_slots(req, 4, num_lookahead_tokens=2.0)"),
            TypeError,
            "num_lookahead_tokens must be a non-negative int",
        ),
        (
            "mgr.allocate_slots(req, 4, num_lookahead_tokens=-1)",
            run("mgr.allocate_slots(req, 4, num_lookahead_tokens=-1)"),
            ValueError,
            "num_lookahead_tokens must be a non-negative int",
        ),
        (
            "mgr.truncate_computed_blocks(hit, -4)",
            run("mgr.truncate_computed_blocks(hit, -4)"),
            ValueError,
            "num_computed_tokens must be a non-negative int",
        ),
        (
            "mgr.truncate_computed_blocks(hit, 4.0)",
            run("mgr.truncate_computed_blocks(hit, 4.0)"),
            TypeError,
            "num_computed_tokens must be a non-negative int",
        ),
        (
            "mgr.truncate_computed_blocks(5, 4)",
            run("mgr.truncate_computed_blocks(5, 4)"),
            TypeError,
            "blocks must be the KVCacheBlocks",
        ),
        (
            "mgr.get_computed_blocks('a')",
            run("mgr.get_computed_blocks('a')"),
            TypeError,
            "expected a kvcore.coordinator.Request",
        ),
    ]


@pytest.mark.parametrize(
    ("call", "run", "builtin", "fragment"),
    _entry_points(),
    ids=[case[0] for case in _entry_points()],
)
def test_wrong_arguments_are_refused_by_type_or_value(
    call: str, run: Any, builtin: type[Exception], fragment: str
) -> None:
    from kvcore.errors import KvcoreError

    with pytest.raises(KvcoreError) as info:
        run()
    assert isinstance(info.value, builtin), (call, type(info.value).__mro__)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (
            "kvcore.plan_kv_cache('x', {}, 1)",
            "plan_kv_cache: config must be of type EngineConfig",
        ),
        (
            "kvcore.get_kv_cache_groups('x', {})",
            "get_kv_cache_groups: config must be of type",
        ),
        ("dump_config('x')", "dump_config: config must be of type KVCacheConfig"),
        ("dump_model_file('x')", "dump_model_file: model must be of type ModelFile"),
        (
            "plan_fingerprint('x')",
            "plan_fingerprint: plan must be of type KVCacheConfig",
        ),
        (
            "encode_event_batch(5)",
            "encode_event_batch: events must be of type list or tuple",
        ),
        ("decode_event_batch('x')", "decode_event_batch: data must be of type bytes"),
        (
            "kvcore.plan_capacity('x', 4)",
            "plan_capacity: plan must be of type KVCacheConfig",
        ),
        (
            "kvcore.EngineConfig(cache_config=5)",
            "EngineConfig.cache_config must be of type CacheConfig",
        ),
        (
            "kvcore.EngineConfig(parallel_config={})",
            "EngineConfig.parallel_config must be of type",
        ),
    ],
)
def test_planning_and_wire_entry_points_refuse_wrong_types(
    call: str, fragment: str
) -> None:
    from kvcore.errors import KvcoreError
    from kvcore.integrations.distributed import plan_fingerprint
    from kvcore.integrations.events import decode_event_batch, encode_event_batch
    from kvcore.serialize import dump_config, dump_model_file

    names = {
        "kvcore": kvcore,
        "dump_config": dump_config,
        "dump_model_file": dump_model_file,
        "plan_fingerprint": plan_fingerprint,
        "encode_event_batch": encode_event_batch,
        "decode_event_batch": decode_event_batch,
    }
    with pytest.raises(KvcoreError) as info:
        eval(call, names)
    assert isinstance(info.value, TypeError)
    assert fragment in str(info.value)


def test_cache_blocks_past_the_scheduled_tokens_is_refused() -> None:
    """A step of 6 tokens with 4 lookahead slots: the table covers 10 slots,
    but only 6 tokens were scheduled, so keying 8 would key a block whose
    last two tokens no step computed."""
    mgr = fa_manager(12)
    r = req("r", 12)
    assert mgr.allocate_slots(r, 6, num_lookahead_tokens=4) is not None
    assert mgr.get_block_ids("r") == ([1, 2, 3],)
    before = snapshot(mgr)
    with pytest.raises(kvcore.errors.InvalidRequestError, match="past the 6 tokens"):
        mgr.cache_blocks(r, 8)
    assert snapshot(mgr) == before
    mgr.cache_blocks(r, 6)  # what was scheduled: fine
    r.num_computed_tokens = 6
    assert mgr.allocate_slots(r, 2) is not None
    mgr.cache_blocks(r, 8)
    assert mgr.block_pool.num_cached_blocks == 2


def test_a_step_past_the_scheduled_tokens_is_refused() -> None:
    """A step of 6 tokens with 4 lookahead slots, then the engine says 8
    tokens are computed: tokens 6 and 7 had slots but no step computed
    them, and a step from 8 would key the block holding them (tokens 4-7),
    so a later hit would read KV nobody wrote."""
    mgr = fa_manager(12)
    r = req("r", 12)
    assert mgr.allocate_slots(r, 6, num_lookahead_tokens=4) is not None
    assert mgr.block_pool.num_cached_blocks == 1
    r.num_computed_tokens = 8
    before = snapshot(mgr)
    with pytest.raises(
        kvcore.errors.InvalidRequestError,
        match="num_computed_tokens=8 is past the 6 tokens its steps have been given",
    ):
        mgr.allocate_slots(r, 2)
    assert snapshot(mgr) == before
    assert mgr.block_pool.num_cached_blocks == 1
    r.num_computed_tokens = 6  # what the step computed: its next step runs
    assert mgr.allocate_slots(r, 2) is not None
    assert mgr.block_pool.num_cached_blocks == 2


def test_a_step_below_the_released_window_is_refused() -> None:
    """After the window's old blocks are released at 40 tokens, a step that
    starts at 10 would read and write positions that are the null block."""
    mgr = small_manager([setup_sw(4, 8)], 32)
    r = req("r", 48)
    assert mgr.allocate_slots(r, 40) is not None
    r.num_computed_tokens = 40
    assert mgr.allocate_slots(r, 1) is not None  # releases below the window
    table = mgr.get_block_ids("r")[0]
    assert table[:8] == [0] * 8
    r.num_computed_tokens = 10
    before = snapshot(mgr)
    with pytest.raises(
        kvcore.errors.InvalidRequestError, match="starts at 10 computed tokens"
    ):
        mgr.allocate_slots(r, 1)
    assert snapshot(mgr) == before
    assert mgr.get_block_ids("r")[0] == table
    # Released by the engine's own call too.
    r.num_computed_tokens = 41
    assert mgr.allocate_slots(r, 3) is not None
    r.num_computed_tokens = 44
    mgr.remove_skipped_blocks(r, 44)
    r.num_computed_tokens = 41
    with pytest.raises(kvcore.errors.InvalidRequestError, match="at 44 processed"):
        mgr.allocate_slots(r, 1)
    # At or past the released tokens, steps run.
    r.num_computed_tokens = 44
    assert mgr.allocate_slots(r, 1) is not None


def test_a_refused_step_below_a_release_changes_nothing_in_state_notes() -> None:
    """The refusal comes before anything else the step would do: the
    states the request's last step took stay noted as unwritten."""
    import coordinator_setup as setup

    mgr = setup.state_hybrid(40, 4)
    a = req("a", 29)
    assert mgr.allocate_slots(a, 8) is not None
    a.num_computed_tokens = 8
    assert mgr.allocate_slots(a, 8) is not None
    noted = dict(mgr.coordinator.unwritten.by_writer)
    assert noted
    a.num_computed_tokens = 4
    with pytest.raises(kvcore.errors.InvalidRequestError, match="starts at 4"):
        mgr.allocate_slots(a, 4)
    assert mgr.coordinator.unwritten.by_writer == noted


def test_a_step_below_an_admission_that_took_no_blocks_is_refused() -> None:
    """Admitted at 32 tokens a connector loads, a window takes no block for
    the positions it does not read; a later step may not start there."""
    mgr = small_manager([setup_sw(4, 8)], 32)
    r = req("r", 48)
    assert mgr.allocate_slots(r, 4, num_external_computed_tokens=32) is not None
    assert mgr.get_block_ids("r")[0][:6] == [0] * 6
    r.num_computed_tokens = 10
    with pytest.raises(kvcore.errors.InvalidRequestError, match="starts at 10"):
        mgr.allocate_slots(r, 1)
    r.num_computed_tokens = 36
    assert mgr.allocate_slots(r, 1) is not None
