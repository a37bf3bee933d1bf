"""vLLM's scheduler per step, on its own KV-cache manager and on kvcore's,
side by side in one process on one trace (run by ``run_vllm_suite.py
--bench`` from vLLM's unpacked source tree, whose test helpers build the
scheduler and the requests).

The trace: 512 requests of 512 prompt tokens, a quarter of them opening
with one of 8 shared 256-token prefixes, 64 output tokens each (no stop
token), prefix caching on, 16-token blocks, at most 64 running, 8192 tokens
per step.  Each round runs the whole trace once per manager, in alternating
order; the figure is the median over rounds of the mean time per step of
``schedule()`` plus ``update_from_output()``.  Timings vary between
machines, so only the ratio of the two, measured together, is meaningful.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

NUM_REQUESTS = 512
PROMPT = 512
SHARED = 256
PREFIXES = 8
OUTPUT = 64


def _trace(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(1, 50000) for _ in range(SHARED)] for _ in range(PREFIXES)
    ]
    prompts = []
    for i in range(NUM_REQUESTS):
        head = prefixes[i % PREFIXES] if i % 4 == 0 else []
        tail = [rng.randrange(1, 50000) for _ in range(PROMPT - len(head))]
        prompts.append(head + tail)
    return prompts


def _run(prompts: list[list[int]]) -> tuple[float, int]:
    """Seconds per step and steps, for one pass of the trace."""
    from tests.v1.core.utils import create_scheduler
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    scheduler = create_scheduler(
        enable_prefix_caching=True,
        max_num_seqs=64,
        max_num_batched_tokens=8192,
        num_blocks=20000,
        block_size=16,
        max_model_len=PROMPT + OUTPUT + 16,
    )
    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    params = SamplingParams(ignore_eos=True, max_tokens=OUTPUT)
    params.update_from_generation_config({}, 50256)
    for i, prompt in enumerate(prompts):
        request = Request(
            request_id=f"r{i}",
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            block_hasher=hasher,
        )
        scheduler.add_request(request)
    steps = 0
    elapsed = 0.0
    while scheduler.has_unfinished_requests():
        start = time.perf_counter()
        out = scheduler.schedule()
        ids = list(out.num_scheduled_tokens)
        result = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        )
        scheduler.update_from_output(out, result)
        elapsed += time.perf_counter() - start
        steps += 1
    return elapsed / steps, steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from vllm.v1.core.sched import scheduler as sched

    import kvcore.integrations.vllm as kvcore_vllm

    plain_cls = sched.KVCacheManager
    prompts = _trace(0)
    times: dict[str, list[float]] = {"vllm": [], "kvcore": []}
    steps: dict[str, int] = {}
    for r in range(args.rounds):
        order = ("vllm", "kvcore") if r % 2 == 0 else ("kvcore", "vllm")
        for side in order:
            if side == "kvcore":
                kvcore_vllm.install()
            else:
                sched.KVCacheManager = plain_cls
            per_step, n = _run(prompts)
            times[side].append(per_step)
            steps[side] = n
    sched.KVCacheManager = plain_cls
    result: dict[str, Any] = {
        side: {"us_per_step": statistics.median(t) * 1e6, "steps": steps[side]}
        for side, t in times.items()
    }
    result["ratio_kvcore_to_vllm"] = (
        result["kvcore"]["us_per_step"] / result["vllm"]["us_per_step"]
    )
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for side in ("vllm", "kvcore"):
            print(
                f"{side:>7}: {result[side]['us_per_step']:9.1f} us per step "
                f"({result[side]['steps']} steps)"
            )
        print(f"  ratio: {result['ratio_kvcore_to_vllm']:.3f} (kvcore / vLLM)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
