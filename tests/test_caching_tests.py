"""A manager's caching test (``_caches_now``) answers False only when its
``cache_blocks`` would change nothing: twin groups and the coordinator skip
the call on that answer, so a wrong False would leave blocks unhashed."""

from __future__ import annotations

import random
from typing import Any

import coordinator_setup as setup
import pytest

from kvcore.coordinator import KVCacheManager, Request
from kvcore.coordinator.manager import SingleTypeManager


def snapshot(mgr: KVCacheManager) -> tuple[Any, ...]:
    pool = mgr.block_pool
    return (
        [(b.block_id, b.key_hash, b.key_group) for b in pool.blocks],
        pool.num_cached_blocks,
        [dict(m.num_cached_block) for m in mgr._managers],
    )


PLANS = {
    # A window beside 16-token blocks with whole-block hits: the window
    # decides whole 16-token units (4 of its blocks) at a time.
    "window-in-units": ([setup.sw(4, 8), setup.fa(16)], 16, False),
    "window-alone": ([setup.sw(4, 8)], 4, True),
    "full-attention": ([setup.fa(4), setup.fa(8)], 8, False),
    "state-hybrid": ([setup.fa(4), setup.mamba(4)], 4, True),
}


@pytest.mark.parametrize("plan", PLANS, ids=list(PLANS))
@pytest.mark.parametrize("seed", range(3))
def test_a_false_caching_test_means_caching_changes_nothing(
    plan: str, seed: int
) -> None:
    specs, scheduler_block, partial_hits = PLANS[plan]
    mgr = setup.manager_for(
        specs,
        200,
        scheduler_block_size=scheduler_block,
        hash_block_size=4,
        enable_partial_hits=partial_hits,
    )
    rng = random.Random(seed)
    prefix = [rng.randrange(2, 90) for _ in range(40)]
    live: list[Request] = []
    checked = skipped = 0
    for step in range(150):
        if not live or rng.random() < 0.3:
            prompt = prefix[: rng.randrange(0, 41)] + [
                rng.randrange(2, 90) for _ in range(rng.randrange(1, 30))
            ]
            req = Request(f"r{step}", prompt, hash_block_size=4)
            blocks, hit = mgr.get_computed_blocks(req)
            if mgr.allocate_slots(req, len(prompt) - hit, hit, blocks) is None:
                continue
            req.num_computed_tokens = len(prompt)
            live.append(req)
        elif rng.random() < 0.85:
            req = rng.choice(live)
            n = rng.choice([1, 1, 3, 7])
            if mgr.allocate_slots(req, n) is None:
                continue
            req.num_computed_tokens += n
            while req.num_tokens <= req.num_computed_tokens:
                req.append_output_token_ids(rng.randrange(2, 90))
        else:
            mgr.free(live.pop(rng.randrange(len(live))))
        for req in live:
            for manager in mgr._managers:
                assert isinstance(manager, SingleTypeManager)
                for n in {req.num_computed_tokens, rng.randrange(req.num_tokens + 1)}:
                    checked += 1
                    if manager._caches_now(req.request_id, n):
                        continue
                    skipped += 1
                    before = snapshot(mgr)
                    manager.cache_blocks(req, n)
                    assert snapshot(mgr) == before, (plan, type(manager), n)
    assert skipped
    assert checked > skipped
