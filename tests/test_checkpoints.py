"""State checkpoints placed where later requests resume.

Hand-worked traces on a hybrid of one full-attention group and one Mamba
group, both of 16-token blocks and 16-token hashes (hits are multiples of
16).  A scheduler loop here computes each step, caches its blocks, samples
output tokens and frees finished requests, as an engine does.
"""

from __future__ import annotations

from typing import Any

import coordinator_setup as setup
import pytest
import torch
from coordinator_setup import fa, state_hybrid, state_manager

import kvcore
from kvcore.checkpoints import grid_interval
from kvcore.coordinator import (
    CHECKPOINT_POLICIES,
    CheckpointPolicy,
    CheckpointPolicyError,
    KVCacheManager,
    Request,
)
from kvcore_mamba import MambaSpec

BS = 16


def mamba(mode: str = "align", policy: str = "turns") -> MambaSpec:
    return setup.mamba(BS, mode=mode, policy=policy)


def hybrid(num_blocks: int = 200, **kw: Any) -> KVCacheManager:
    return state_hybrid(num_blocks, BS, **kw)


def tokens(n: int, offset: int = 0) -> list[int]:
    return [offset + i for i in range(n)]


state = state_manager


def cached_state_ends(mgr: KVCacheManager, req: Request) -> list[int]:
    """Token positions (multiples of 16) whose state is in the cache for
    ``req``'s own prefix."""
    pool = mgr.block_pool
    return [
        (i + 1) * BS
        for i, h in enumerate(req.block_hashes)
        if pool.lookup(h, 1) is not None
    ]


def run(mgr: KVCacheManager, req: Request, output: list[int], chunk: int = 8192) -> int:
    """Admit ``req``, prefill in chunks of ``chunk`` tokens, decode
    ``output`` (each sampled token is computed by the next step, the last is
    not) and free it; the prefix hit it got."""
    blocks, hit = mgr.get_computed_blocks(req)
    n = min(req.num_tokens - hit, chunk)
    assert mgr.allocate_slots(req, n, hit, blocks) is not None
    req.num_computed_tokens = hit + n
    sampled = 0
    while True:
        if req.num_computed_tokens == req.num_tokens:
            if sampled == len(output):
                break
            req.append_output_token_ids(output[sampled])
            sampled += 1
            if sampled == len(output):
                break
        n = min(req.num_tokens - req.num_computed_tokens, chunk)
        assert mgr.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
    mgr.free(req)
    return hit


def test_a_chats_second_turn_hits_the_whole_first_turn() -> None:
    mgr = hybrid()
    prompt, output = tokens(100), tokens(40, 1000)
    first = Request("t1", prompt, hash_block_size=BS)
    assert run(mgr, first, output) == 0
    # Turn 1 computed its prompt and 39 sampled tokens: 139 tokens.  The
    # state at the last hit boundary below (128) is kept; so is the prompt's
    # (96); the decode boundary it passed (112) left the cache.
    assert cached_state_ends(mgr, first) == [96, 128]
    second = Request("t2", prompt + output + tokens(30, 2000), hash_block_size=BS)
    assert run(mgr, second, tokens(5, 3000)) == 128
    assert mgr.get_num_free_blocks() == 199


def test_the_same_prompt_again_resumes_from_the_prompt_end() -> None:
    mgr = hybrid()
    prompt = tokens(100)
    run(mgr, Request("a", prompt, hash_block_size=BS), tokens(40, 1000))
    again = Request("b", prompt, hash_block_size=BS)
    assert run(mgr, again, [7]) == 96


def test_a_shared_prefix_is_kept_where_the_second_request_branches() -> None:
    mgr = hybrid()
    shared = tokens(50)
    a = Request("a", shared + tokens(60, 1000), hash_block_size=BS)
    assert run(mgr, a, [1]) == 0
    # Only a's own prompt end (96) is kept: nobody knew 50 tokens are shared.
    b = Request("b", shared + tokens(70, 2000), hash_block_size=BS)
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 0
    assert b.shared_prefix_tokens == 48  # full-attention blocks 0..2 match a
    # b's one prefill step of 120 tokens takes the state blocks at 48 (the
    # branch point) and 112 (its prompt end) besides its last position.
    free = mgr.get_num_free_blocks()
    assert mgr.allocate_slots(b, 120, hit, blocks) is not None
    assert free - mgr.get_num_free_blocks() == 8 + 3
    table = mgr.get_blocks("b").ids[1]
    assert [i for i, blk in enumerate(table) if blk != 0] == [2, 6, 7]
    b.num_computed_tokens = 120
    mgr.cache_blocks(b, 120)
    mgr.free(b)
    c = Request("c", shared + tokens(80, 3000), hash_block_size=BS)
    assert run(mgr, c, [1]) == 48


def test_policy_steps_keeps_every_step_end_on_a_boundary() -> None:
    mgr = hybrid(policy="steps")
    req = Request("a", tokens(100), hash_block_size=BS)
    run(mgr, req, tokens(40, 1000))
    # Prefill ended at 100 (no boundary); decode ended on 112 and 128.
    assert cached_state_ends(mgr, req) == [112, 128]


@pytest.mark.parametrize("deferred", [False, True])
def test_policy_steps_states_a_request_released_leave_before_their_prefix(
    deferred: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beside full attention, the step-end states a request released rejoin
    its table when it is freed (at once, or popped and released later): each
    leaves the cache before the attention blocks its hit reads, never after
    them (cached, with nothing to serve)."""
    mgr = hybrid(policy="steps")
    if deferred:
        pop = mgr.pop_blocks_for_free
        monkeypatch.setattr(mgr, "free", lambda r: mgr.release_blocks(pop(r)))
    req = Request("a", tokens(100), hash_block_size=BS)
    run(mgr, req, tokens(40, 1000))
    # Both states were released by later steps; the last (139) is unkeyed.
    assert cached_state_ends(mgr, req) == [112, 128]
    pool = mgr.block_pool
    where = {b: i for i, b in enumerate(pool.eviction_order())}
    for end in (112, 128):
        state_block = pool.lookup(req.block_hashes[end // BS - 1], 1)
        prefix = [pool.lookup(h, 0) for h in req.block_hashes[: end // BS]]
        assert state_block is not None
        assert None not in prefix
        assert where[state_block] < min(where[b] for b in prefix if b is not None)


def test_mode_all_keys_every_state_on_a_hit_boundary() -> None:
    mgr = hybrid(mode="all")
    req = Request("a", tokens(100), hash_block_size=BS)
    run(mgr, req, tokens(40, 1000))
    assert cached_state_ends(mgr, req) == [16 * i for i in range(1, 9)]


def test_a_finished_requests_states_are_evicted_after_its_attention_blocks() -> None:
    mgr = hybrid()
    req = Request("a", tokens(100), hash_block_size=BS)
    run(mgr, req, tokens(40, 1000))
    queue = mgr.block_pool.free_queue.get_all_free_blocks()
    where = {b: i for i, b in enumerate(queue)}
    pool = mgr.block_pool
    states = [pool.lookup(req.block_hashes[i], 1) for i in (5, 7)]  # 96, 128
    attention = [pool.lookup(h, 0) for h in req.block_hashes[:8]]
    assert all(b is not None for b in states + attention)
    last_attention = max(where[b] for b in attention if b is not None)
    assert all(where[b] > last_attention for b in states if b is not None)


def test_a_refused_admission_forgets_its_checkpoints() -> None:
    """A first chunk of 50 tokens plans the prompt end (96) and needs 4
    attention blocks and a state: refused with 4 free, nothing planned
    stays behind (admitted, the target would wait for a later step)."""
    mgr = hybrid(num_blocks=5)
    req = Request("a", tokens(100), hash_block_size=BS)
    assert mgr.allocate_slots(req, 50) is None
    assert state(mgr).targets == {}
    assert mgr.get_num_free_blocks() == 4
    roomy = hybrid(num_blocks=6)
    assert roomy.allocate_slots(Request("a", tokens(100), hash_block_size=BS), 50)
    assert state(roomy).targets == {"a": [96]}


def test_hybrid_model_files_get_hits_by_default() -> None:
    """A Mamba spec left at its default (``auto``) plans in align mode with
    prefix caching on, and in ``none`` with it off."""
    spec = MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(torch.float16,))
    assert spec.mamba_cache_mode == "auto"
    specs = {"attn": fa(BS), "ssm": spec}
    for caching, mode in ((True, "align"), (False, "none")):
        config = kvcore.EngineConfig(
            cache_config=kvcore.CacheConfig(enable_prefix_caching=caching),
        )
        groups = kvcore.get_kv_cache_groups(config, specs)
        modes = {
            g.layer_spec(n).mamba_cache_mode  # type: ignore[attr-defined]
            for g in groups
            for n in g.layer_names
            if n == "ssm"
        }
        assert modes == {mode}


def test_policies_are_checked() -> None:
    with pytest.raises(CheckpointPolicyError, match="checkpoint_policy must be one of"):
        mamba(policy="often")
    with pytest.raises(CheckpointPolicyError, match="interval must be an int"):
        CheckpointPolicy(interval=-1)
    with pytest.raises(
        CheckpointPolicyError, match="interval_per_step must be an int >= 1"
    ):
        CheckpointPolicy(interval_per_step=0)
    with pytest.raises(CheckpointPolicyError, match="must be a bool"):
        CheckpointPolicy(prompt_end=1)  # type: ignore[arg-type]
    assert set(CHECKPOINT_POLICIES) == {"turns", "steps", "prompts"}


def test_a_step_that_fits_only_without_its_checkpoints_runs_without_them() -> None:
    """A 100-token prompt needs 7 attention blocks and the Mamba state at its
    last position, plus the prompt-end checkpoint at 96: 9 blocks.  With 8
    free the step runs without the checkpoint instead of being refused."""
    mgr = hybrid(num_blocks=9)
    req = Request("a", tokens(100), hash_block_size=BS)
    assert mgr.allocate_slots(req, 100) is not None
    assert mgr.get_num_free_blocks() == 0
    assert state(mgr).targets == {}
    table = mgr.get_blocks("a").ids[1]
    assert [i for i, b in enumerate(table) if b != 0] == [6]
    # With one block more the checkpoint is kept.
    roomy = hybrid(num_blocks=10)
    again = Request("a", tokens(100), hash_block_size=BS)
    assert roomy.allocate_slots(again, 100) is not None
    table = roomy.get_blocks("a").ids[1]
    assert [i for i, b in enumerate(table) if b != 0] == [5, 6]


def test_a_refused_step_keeps_its_checkpoints() -> None:
    """A running request at 50 tokens of a 100-token prompt: the step to
    100 takes 3 attention blocks and 2 states (at 100, and the prompt end
    at 96), 4 without the checkpoint, and releases the state at 50.  With
    2 free it is refused even without the checkpoint, and keeps it."""
    mgr = hybrid(num_blocks=20)
    req = Request("a", tokens(100), hash_block_size=BS)
    assert mgr.allocate_slots(req, 50) is not None
    req.num_computed_tokens = 50
    assert state(mgr).targets == {"a": [96]}
    mgr.block_pool.get_new_blocks(mgr.get_num_free_blocks() - 2)
    assert mgr.allocate_slots(req, 50) is None
    assert state(mgr).targets == {"a": [96]}
    assert mgr.get_num_free_blocks() == 2


def test_the_first_request_sharing_a_new_prefix_resumes_at_an_interval_state() -> None:
    """Under ``turns`` a prompt's new part keeps a state every 1024 tokens:
    a 2600-token prompt (one 8192-token step) keeps 1024 and 2048 besides
    its prompt end (2592).  The next request shares its first 1500 tokens:
    it resumes at 1024 (not 0) and keeps its branch point at 1488, from
    which the one after resumes."""
    mgr = hybrid(num_blocks=1000)
    shared = tokens(1500)
    a = Request("a", shared + tokens(1100, 10_000), hash_block_size=BS)
    assert run(mgr, a, [1]) == 0
    assert cached_state_ends(mgr, a) == [1024, 2048, 2592]
    b = Request("b", shared + tokens(300, 20_000), hash_block_size=BS)
    assert run(mgr, b, [1]) == 1024
    assert b.shared_prefix_tokens == 1488
    c = Request("c", shared + tokens(200, 30_000), hash_block_size=BS)
    assert run(mgr, c, [1]) == 1488


def test_interval_states_of_a_hybrid_follow_its_prompt_end_to_the_back() -> None:
    """On a hybrid (its state group holds back), a prefill in 1000-token
    chunks releases the interval states after the step that passed them;
    they are held back while the request runs (a request branching from
    its prompt resumes there) and, once it is freed, go to the back of the
    eviction order with the kept prompt end, after the request's attention
    blocks."""
    mgr = hybrid(num_blocks=1000)
    a = Request("a", tokens(2600), hash_block_size=BS)
    run(mgr, a, [1], chunk=1000)
    pool = mgr.block_pool
    where = {b: i for i, b in enumerate(pool.free_queue.get_all_free_blocks())}
    interval = [pool.lookup(a.block_hashes[i], 1) for i in (63, 127)]  # 1024, 2048
    prompt_end = pool.lookup(a.block_hashes[161], 1)  # 2592
    attention = [pool.lookup(h, 0) for h in a.block_hashes]
    assert all(b is not None for b in [*interval, prompt_end, *attention])
    first_attention = min(where[b] for b in attention if b is not None)
    last_attention = max(where[b] for b in attention if b is not None)
    at_1024, at_2048 = (where[b] for b in interval if b is not None)
    assert first_attention < last_attention
    assert prompt_end is not None
    assert last_attention < min(where[prompt_end], at_1024, at_2048)
    assert pool.free_queue.held_blocks() == []


def test_a_long_step_keeps_at_most_interval_per_step_interval_states() -> None:
    """A 6000-token prompt in one step has 5 interval marks (1024..5120);
    the default keeps at most 4 of them a step, every 2nd from the step's
    end (5120, 3072, 1024), plus its prompt end (in a pool whose share for
    one request's grid, 1/256, holds all 5)."""
    assert CHECKPOINT_POLICIES["turns"].interval_per_step == 4
    assert CHECKPOINT_POLICIES["turns"].interval_pool_share == 1 / 256
    mgr = hybrid(num_blocks=5 * 256)
    a = Request("a", tokens(6000), hash_block_size=BS)
    free = mgr.get_num_free_blocks()
    assert mgr.allocate_slots(a, 6000) is not None
    # 375 attention blocks, the state at the last position, the prompt end
    # (5984) and 3 interval states.
    assert free - mgr.get_num_free_blocks() == 375 + 1 + 1 + 3
    table = mgr.get_blocks("a").ids[1]
    kept = [(i + 1) * BS for i, b in enumerate(table) if b != 0]
    assert kept == [1024, 3072, 5120, 5984, 6000]


@pytest.mark.parametrize(
    ("num_blocks", "num_state_groups", "grid"),
    [
        (5 * 256, 1, [1024, 3072, 5120]),  # 5 points fit: every 1024, 3 a step
        (1100, 1, [2048, 4096]),  # 5 blocks > 4.3: every 2048
        (400, 2, [2048, 4096]),  # 1.6 blocks, but 4 points are always kept
    ],
)
def test_a_small_pool_doubles_the_interval_until_the_grid_fits_its_share(
    num_blocks: int, num_state_groups: int, grid: list[int]
) -> None:
    """One request's interval states, a block in every state group per
    point, take at most ``interval_pool_share`` (1/256) of the pool, or are
    at most 4 points: the interval doubles until they do.  The prompt ends
    stay."""
    mgr = setup.manager_for(
        [setup.fa(BS)] + [mamba() for _ in range(num_state_groups)],
        num_blocks,
        scheduler_block_size=BS,
        hash_block_size=BS,
    )
    a = Request("a", tokens(6000), hash_block_size=BS)
    assert mgr.allocate_slots(a, 6000) is not None
    for gid in range(1, num_state_groups + 1):
        table = mgr.get_blocks("a").ids[gid]
        kept = [(i + 1) * BS for i, b in enumerate(table) if b != 0]
        assert kept == [*grid, 5984, 6000]


@pytest.mark.parametrize(
    ("tokens", "point_blocks", "num_blocks", "share", "every"),
    [
        (40_000, 4, 3764, 1 / 256, 8192),  # 14.7 < 16 blocks: 4 points of 4
        (40_000, 7, 16843, 1 / 256, 4096),  # 65.8 blocks: 9 points of 7
        (40_000, 4, 10**6, 1 / 256, 1024),  # an ample pool keeps the grid
        (40_000, 4, 100, 0, 1024),  # no limit
        (40_000, 0, 100, 1 / 256, 1024),  # points that cost nothing
        (500, 4, 100, 1 / 256, 1024),  # a prompt inside one interval
    ],
)
def test_grid_interval_doubles_until_the_points_fit(
    tokens: int, point_blocks: int, num_blocks: int, share: float, every: int
) -> None:
    assert grid_interval(1024, tokens, point_blocks, num_blocks, share) == every


def test_an_interval_pool_share_outside_0_to_1_is_refused() -> None:
    for bad in (-0.1, 1.5, "1/256", None):
        with pytest.raises(CheckpointPolicyError, match="interval_pool_share"):
            CheckpointPolicy(interval_pool_share=bad)  # type: ignore[arg-type]


def test_a_lookup_that_finds_nothing_shares_nothing() -> None:
    """``shared_prefix_tokens`` is the request's own lookup's: a one-token
    prompt (nothing to look up) after a lookup that found 48 shared tokens
    shares none, so no branch point is planned for it."""
    mgr = hybrid()
    shared = tokens(50)
    run(mgr, Request("a", shared + tokens(60, 1000), hash_block_size=BS), [1])
    b = Request("b", shared + tokens(70, 2000), hash_block_size=BS)
    mgr.get_computed_blocks(b)
    assert b.shared_prefix_tokens == 48
    c = Request("c", [5], hash_block_size=BS)
    assert mgr.get_computed_blocks(c)[1] == 0
    assert c.shared_prefix_tokens == 0


def test_layers_of_different_checkpoint_policies_are_grouped_apart() -> None:
    """A group's manager keeps one policy, so Mamba layers that choose
    different ones never share a group."""
    specs = {"a": mamba(policy="turns"), "b": mamba(policy="steps")}
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(enable_prefix_caching=True)
    )
    groups = kvcore.get_kv_cache_groups(config, specs)
    assert sorted(sorted(g.layer_names) for g in groups) == [["a"], ["b"]]


def test_a_running_request_holds_the_shared_state_on_its_path() -> None:
    """A 160-token preamble: ``b`` branches from ``a`` there and keeps the
    state at 160 (a branch point: shared).  ``c`` resumes there; ``c``'s
    next turn ``d`` resumes at ``c``'s output end (208) and, while it runs,
    also holds the state at 160, as it holds the preamble's attention
    blocks: a request on the preamble whose own states were evicted still
    resumes at 160.  The hold takes one block from the free queue, and
    ``d``'s free returns it."""
    mgr = hybrid()
    preamble = tokens(160)
    assert (
        run(mgr, Request("a", preamble + tokens(40, 1000), hash_block_size=BS), [1])
        == 0
    )
    assert (
        run(mgr, Request("b", preamble + tokens(40, 2000), hash_block_size=BS), [1])
        == 0
    )
    c_prompt = preamble + tokens(40, 3000)
    c_output = tokens(20, 4000)
    c = Request("c", c_prompt, hash_block_size=BS)
    assert run(mgr, c, c_output) == 160
    d = Request("d", c_prompt + c_output + tokens(30, 5000), hash_block_size=BS)
    blocks, hit = mgr.get_computed_blocks(d)
    assert hit == 208
    pool = mgr.block_pool
    at_160 = pool.lookup(d.block_hashes[9], 1)
    assert at_160 is not None
    assert pool.ref_cnt[at_160] == 0
    free = mgr.get_num_free_blocks()
    assert mgr.allocate_slots(d, d.num_tokens - hit, hit, blocks) is not None
    # Attention: the 13 hit blocks leave the free queue and 3 are new
    # (208..250).  The state: the hit's (208) and 160 leave it, and the
    # prompt end (240) and the step's last position are new.
    assert free - mgr.get_num_free_blocks() == 13 + 3 + 2 + 2
    table = mgr.get_blocks("d").ids[1]
    assert table[9] == at_160
    assert pool.ref_cnt[at_160] == 1
    d.num_computed_tokens = d.num_tokens
    assert mgr.allocate_slots(d, 1) is not None  # a decode step keeps holding it
    assert mgr.get_blocks("d").ids[1][9] == at_160
    assert pool.ref_cnt[at_160] == 1
    mgr.free(d)
    assert pool.ref_cnt[at_160] == 0
    assert pool.lookup(d.block_hashes[9], 1) == at_160
    assert mgr.get_num_free_blocks() == 199


def test_a_second_resume_makes_a_state_shared() -> None:
    """A state two requests resumed from is shared even where no branch
    point was planned: ``a``'s prompt-end state at 96 serves ``b`` and
    ``c`` (the same prompt with other answers); ``c``'s next turn then
    holds it while it runs."""
    mgr = hybrid()
    prompt = tokens(100)
    run(mgr, Request("a", prompt, hash_block_size=BS), [1])
    assert (
        run(mgr, Request("b", prompt + tokens(10, 900), hash_block_size=BS), [1]) == 96
    )
    c_output = tokens(40, 2000)
    c = Request("c", prompt + tokens(10, 800), hash_block_size=BS)
    assert run(mgr, c, c_output) == 96
    d = Request(
        "d", prompt + tokens(10, 800) + c_output + tokens(5, 3000), hash_block_size=BS
    )
    blocks, hit = mgr.get_computed_blocks(d)
    assert hit == 144
    assert mgr.allocate_slots(d, d.num_tokens - hit, hit, blocks) is not None
    at_96 = mgr.block_pool.lookup(d.block_hashes[5], 1)
    assert at_96 is not None
    assert mgr.get_blocks("d").ids[1][5] == at_96
    assert mgr.block_pool.ref_cnt[at_96] == 1


def _queue_position(mgr: KVCacheManager, block: int) -> int:
    return mgr.block_pool.free_queue.get_all_free_blocks().index(block)


def test_twin_state_groups_hold_the_shared_state_at_one_position() -> None:
    """Two state groups of one spec (twins) keep equal tables: where one
    twin's shared state at 160 was evicted and the other's not, an
    admission on that prefix holds it in neither (each twin's own search
    would find a different one)."""
    mgr = setup.manager_for(
        [fa(BS), setup.mamba(BS), setup.mamba(BS)],
        80,
        scheduler_block_size=BS,
        hash_block_size=BS,
        enable_caching=True,
    )
    pool = mgr.block_pool
    twins = state(mgr, 1), state(mgr, 2)
    preamble = tokens(160)
    run(mgr, Request("a", [*preamble, 7], hash_block_size=BS), [1])
    c_prompt, c_output = preamble + tokens(40, 3000), tokens(20, 4000)
    assert run(mgr, Request("c", c_prompt, hash_block_size=BS), c_output) == 160
    # r, c's next turn, keeps running: it holds c's state at 208 and the
    # attention blocks before it.
    r = Request("r", c_prompt + c_output + tokens(30, 5000), hash_block_size=BS)
    blocks, hit = mgr.get_computed_blocks(r)
    assert hit == 208
    assert mgr.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
    e = Request("e", preamble + tokens(40, 6000), hash_block_size=BS)
    assert run(mgr, e, [1]) == 160  # the second resume: shared in both twins
    key = e.block_hashes[9]
    first, second = (t.shared_states[160][key] for t in twins)
    assert _queue_position(mgr, first) < _queue_position(mgr, second)
    # Take blocks from the front of the queue up to the first twin's state.
    pool.free_blocks(pool.get_new_blocks(_queue_position(mgr, first) + 1))
    # The first twin's state block was handed out again; the second's is
    # still cached as that twin's state under the key.
    first_key = (pool.key_hash[first], pool.key_group[first])
    second_key = (pool.key_hash[second], pool.key_group[second])
    assert first_key != (key, twins[0].kv_cache_group_id)
    assert second_key == (key, twins[1].kv_cache_group_id)
    d = Request("d", c_prompt + c_output + tokens(30, 8000), hash_block_size=BS)
    blocks, hit = mgr.get_computed_blocks(d)
    assert hit == 208
    free = mgr.get_num_free_blocks()
    assert mgr.allocate_slots(d, d.num_tokens - hit, hit, blocks) is not None
    # r holds the hit's blocks: d takes 3 new attention blocks and, in each
    # twin, the prompt end (240) and the last position, and no hold at 160.
    assert free - mgr.get_num_free_blocks() == 3 + 2 * 2
    tables = mgr.get_blocks("d").ids
    held = [[i for i, b in enumerate(tables[g]) if b != 0] for g in (1, 2)]
    assert held[0] == held[1] == [12, 14, 15]
    mgr.free(d)
    mgr.free(r)
    assert mgr.get_num_free_blocks() == pool.num_blocks - 1


def test_a_connector_admission_counts_no_hold_it_does_not_take() -> None:
    """A KV-connector admission (176 external tokens, no cached state to
    resume from) takes no shared state, and its count says so: it asks for
    exactly the blocks it takes, so one that just fits keeps its
    checkpoints."""
    mgr = hybrid()
    preamble = tokens(160)
    run(mgr, Request("a", preamble + tokens(40, 1000), hash_block_size=BS), [1])
    run(mgr, Request("b", preamble + tokens(40, 2000), hash_block_size=BS), [1])
    assert state(mgr).shared_states  # b's branch point at 160
    x = Request("x", preamble + tokens(60, 7000), hash_block_size=BS)
    coordinator = mgr.coordinator
    attach = coordinator.admission_blocks(mgr.empty_kv_cache_blocks.ids, 176)
    coordinator.plan_checkpoints(x, 176)
    planned = coordinator.get_num_blocks_to_allocate("x", x.num_tokens, attach)
    coordinator.forget_checkpoints("x")
    free = mgr.get_num_free_blocks()
    assert (
        mgr.allocate_slots(x, x.num_tokens - 176, num_external_computed_tokens=176)
        is not None
    )
    assert free - mgr.get_num_free_blocks() == planned
    assert "x" not in state(mgr).pinned


def test_a_running_hybrid_holds_its_interval_states_for_a_branching_request() -> None:
    """A (2600 tokens, prefilled in 1000-token chunks) keeps interval states
    at 1024 and 2048; released as its prefill moves on, they are held back
    while it runs (``kept_if_room``).  B shares A's first 1100 tokens only
    and arrives once every other free block is taken: it resumes at 1024,
    from A's attention prefix and the held interval state (its pool's
    1/256 share holds both interval states)."""
    # Fillers take every other free block: no boundary headroom.
    mgr = hybrid(num_blocks=2 * 256, boundary_headroom=False)
    a = Request("a", tokens(2600), hash_block_size=BS)
    for n in (1000, 1000, 600):
        assert mgr.allocate_slots(a, n) is not None
        a.num_computed_tokens += n
    a.append_output_token_ids(7)
    assert mgr.allocate_slots(a, 1) is not None
    a.num_computed_tokens += 1
    held = mgr.block_pool.free_queue.held_blocks()
    assert {mgr.block_pool.lookup(a.block_hashes[i], 1) for i in (63, 127)} <= set(held)
    i = 0
    while mgr.get_num_free_blocks() >= len(held) + 2:
        f = Request(f"f{i}", tokens(15, 10**6 + 16 * i), hash_block_size=BS)
        assert mgr.allocate_slots(f, 15) is not None
        i += 1
    b = Request("b", [*tokens(1100), *tokens(100, 5 * 10**6)], hash_block_size=BS)
    assert mgr.get_computed_blocks(b)[1] == 1024


def test_twin_state_groups_hold_their_interval_states_as_one_call_per_group() -> None:
    """Two twin state groups beside full attention: A's interval states at
    1024 and 2048, released as its prefill moves on, are held back in
    front of its other kept states in both groups at once, as one pool
    call per group leaves them (each step's in front of the earlier
    steps', the second group's in front of the first's); freed, they move
    to the back with the prompt end (the pool's 1/256 share holds both
    interval states in both groups)."""
    mgr = setup.manager_for(
        [setup.fa(BS), mamba(), mamba()],
        4 * 256,
        scheduler_block_size=BS,
        hash_block_size=BS,
    )
    twins = [state(mgr, 1), state(mgr, 2)]
    assert all(m.holds_back for m in twins)
    a = Request("a", tokens(2600), hash_block_size=BS)
    for n in (1000, 1000, 600):
        assert mgr.allocate_slots(a, n) is not None
        a.num_computed_tokens += n
    a.append_output_token_ids(7)
    assert mgr.allocate_slots(a, 1) is not None
    a.num_computed_tokens += 1
    spaced = [
        [mgr.block_pool.lookup(a.block_hashes[i], g) for i in (63, 127)] for g in (1, 2)
    ]
    assert all(b is not None for blocks in spaced for b in blocks)
    held = mgr.block_pool.free_queue.held_blocks()
    # Each step's in front of the steps' before: 2048's (released by the
    # third chunk) before 1024's (the second).
    (s1_1024, s1_2048), (s2_1024, s2_2048) = spaced
    assert held[:4] == [s2_2048, s1_2048, s2_1024, s1_1024]
    mgr.free(a)
    # Freed, they follow the prompt end to the back in both groups.
    assert mgr.block_pool.free_queue.held_blocks() == []
    back = mgr.block_pool.free_queue.get_all_free_blocks()[-12:]
    assert {s1_1024, s1_2048, s2_1024, s2_2048} <= set(back)
