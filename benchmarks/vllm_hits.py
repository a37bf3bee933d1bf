"""Prefix hits under vLLM's scheduler: vLLM 0.33's own KV-cache manager
against kvcore's, side by side on the same seeded workloads.

Each side runs in vLLM's interpreter (``--vllm-python``), once plain and
once with ``KVCORE_VLLM=1`` (the setting that puts vLLM's scheduler on
kvcore).  For every plan (a sliding window alone, full attention beside
one or five windows, full attention beside Mamba) and seed, vLLM's
synchronous ``Scheduler`` is built through vLLM's public configs over a
small pool and driven for ``--steps`` steps: requests arrive at random,
most of them prompts that share one of a few prefixes up to a random
point, some the next turn of an earlier request (its prompt and output
and more), some fresh.  The workload is open-loop: arrivals and prompts
are drawn from the seed alone, and each output token is a function of
the seed, the request and its position, so both sides serve the same
requests at the same steps however differently they schedule them.  It
prints, per plan, the prompt tokens each side took
from its prefix cache at admission (hit tokens), the tokens it scheduled
(what the model computes), the requests it finished and preempted, and
kvcore's figures over vLLM's::

    python benchmarks/vllm_hits.py --vllm-python /path/to/vllm-venv/bin/python

More hit tokens and fewer scheduled tokens are better; the pool is the
same on both sides, so the ratios are what kvcore's cache policy buys on
vLLM's memory.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BS = 16
MODEL = "facebook/opt-125m"  # its config.json only: the scheduler reads no weights
EOS = 2
#: Plan name -> its groups: None for full attention, a window's tokens, or
#: "mamba" for an align-mode Mamba state.
PLANS: dict[str, list[Any]] = {
    "window": [32],
    "full+window": [None, 32],
    "full+5 windows": [None, 32, 32, 32, 32, 32],
    "full+mamba": [None, "mamba"],
}
FIGURES = ("hit_tokens", "scheduled_tokens", "finished", "preempted")


# -- one side, inside vLLM's interpreter -------------------------------------------


def _specs(groups: list[Any]) -> list[Any]:
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    common: dict[str, Any] = {
        "block_size": BS,
        "num_kv_heads": 1,
        "head_size": 1,
        "dtype": torch.float32,
    }
    specs: list[Any] = []
    for group in groups:
        if group is None:
            specs.append(FullAttentionSpec(**common))
        elif group == "mamba":
            specs.append(
                MambaSpec(
                    block_size=BS,
                    shapes=((1, 1),),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                )
            )
        else:
            specs.append(SlidingWindowSpec(**common, sliding_window=group))
    return specs


def _scheduler(groups: list[Any], num_blocks: int, rng: random.Random) -> Any:
    """vLLM's synchronous Scheduler over ``groups``, built through vLLM's
    public configs, prefix caching on; its batch shape drawn from ``rng``."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    specs = _specs(groups)
    max_model_len = 1024
    vllm_config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=rng.choice([4, 8, 16]),
            max_num_batched_tokens=rng.choice([128, 256, 2048]),
            max_model_len=max_model_len,
            long_prefill_token_threshold=rng.choice([0, 24, 48]),
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        model_config=ModelConfig(
            model=MODEL,
            dtype="float16",
            seed=42,
            skip_tokenizer_init=True,
            max_model_len=max_model_len,
        ),
        cache_config=CacheConfig(
            block_size=BS,
            enable_prefix_caching=True,
            **({"mamba_cache_mode": "align"} if "mamba" in groups else {}),
        ),
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)
        ],
    )
    register_all_kvcache_specs(vllm_config)
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BS,
        hash_block_size=BS,
        log_stats=False,
    )


def _request(rid: str, tokens: list[int], max_tokens: int) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    params = SamplingParams(ignore_eos=True, max_tokens=max_tokens)
    params.update_from_generation_config({}, EOS)
    return Request(
        request_id=rid,
        prompt_token_ids=tokens,
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BS, sha256),
    )


def _output_token(seed: int, index: int, position: int) -> int:
    """The token request ``index`` samples at output ``position``: drawn
    from the seed, the request and the position alone, so it is the same
    on both sides whenever each schedules the request."""
    return random.Random(f"{seed}/{index}/{position}").randrange(3, 1000)


def _prompt(
    rng: random.Random,
    seed: int,
    prefixes: list[list[int]],
    earlier: list[tuple[list[int], int]],
) -> list[int]:
    """A prompt: most share a prefix up to a random point, some are the
    next turn of an earlier request (of ``earlier``: each one's prompt and
    output length), some are fresh."""
    kind = rng.random()
    if kind < 0.2 and earlier:
        index = rng.randrange(len(earlier))
        prompt, max_tokens = earlier[index]
        output = [_output_token(seed, index, i) for i in range(max_tokens)]
        turn = (prompt + output)[:512]
        return turn + [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 40))]
    if kind < 0.85:
        prefix = rng.choice(prefixes)
        cut = rng.choice([len(prefix), len(prefix), rng.randrange(1, len(prefix) + 1)])
        tail = rng.choice([1, 5, 16, 17, 40, 90])
        return prefix[:cut] + [rng.randrange(3, 1000) for _ in range(tail)]
    return [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 200))]


def run_seed(groups: list[Any], seed: int, steps: int) -> dict[str, int]:
    """One seeded workload through vLLM's scheduler: the figures."""
    from vllm.v1.outputs import ModelRunnerOutput

    rng = random.Random(seed)
    num_blocks = rng.choice([24, 40, 64, 120]) * len(groups)
    scheduler = _scheduler(groups, num_blocks, rng)
    on_kvcore = type(scheduler.kv_cache_manager).__module__.startswith("kvcore")
    if on_kvcore != (os.environ.get("KVCORE_VLLM") == "1"):
        sys.exit("vLLM's scheduler is not on the side asked for (KVCORE_VLLM)")
    prefixes = [
        [rng.randrange(3, 1000) for _ in range(rng.choice([32, 48, 64, 100, 160]))]
        for _ in range(4)
    ]
    figures = dict.fromkeys(FIGURES, 0)
    earlier: list[tuple[list[int], int]] = []
    index: dict[str, int] = {}
    for step in range(steps):
        if step < steps * 7 // 10 and rng.random() < 0.5:
            rid = f"r{len(earlier)}"
            prompt = _prompt(rng, seed, prefixes, earlier)
            max_tokens = rng.choice([1, 3, 8, 17, 40])
            index[rid] = len(earlier)
            earlier.append((prompt, max_tokens))
            scheduler.add_request(_request(rid, prompt, max_tokens))
        out = scheduler.schedule()
        figures["preempted"] += len(out.preempted_req_ids or ())
        figures["hit_tokens"] += sum(
            new.num_computed_tokens for new in out.scheduled_new_reqs
        )
        figures["scheduled_tokens"] += out.total_num_scheduled_tokens
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            request = scheduler.requests[rid]
            sampled.append(
                []
                if request.is_prefill_chunk
                else [_output_token(seed, index[rid], len(request.output_token_ids))]
            )
        output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        )
        scheduler.update_from_output(out, output)
        figures["finished"] += len(out.finished_req_ids)
    return figures


def run_side(seeds: int, steps: int) -> dict[str, dict[str, int]]:
    """Every plan's figures summed over the seeds, on the side this
    interpreter runs (kvcore where ``KVCORE_VLLM=1``)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    if os.environ.get("KVCORE_VLLM") == "1":
        # What vLLM's plugin loader does in an engine: this checkout's kvcore.
        from kvcore.integrations.vllm import install

        install()
    init_none_hash(sha256)
    result: dict[str, dict[str, int]] = {}
    for name, groups in PLANS.items():
        total = dict.fromkeys(FIGURES, 0)
        for seed in range(seeds):
            for key, value in run_seed(groups, seed, steps).items():
                total[key] += value
        result[name] = total
    return result


# -- the comparison ------------------------------------------------------------------


def _side(python: str, hf_home: Path, kvcore: bool, args: argparse.Namespace) -> Any:
    from run_vllm_suite import _env  # type: ignore[import-not-found]

    env = _env(hf_home)
    # vLLM seeds its root block hash from it: both sides hash alike.
    env["PYTHONHASHSEED"] = "0"
    if kvcore:
        env["KVCORE_VLLM"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO), str(REPO / "plugins"), env.get("PYTHONPATH", "")]
        )
    cmd = [
        python,
        __file__,
        "--side",
        "--seeds",
        str(args.seeds),
        "--steps",
        str(args.steps),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(
            f"the {'kvcore' if kvcore else 'vLLM'} side failed:\n{done.stderr[-3000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", help="an interpreter with vLLM 0.33")
    parser.add_argument("--seeds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(run_side(args.seeds, args.steps)))
        return 0
    if not args.vllm_python:
        parser.error("--vllm-python is required (an interpreter with vLLM 0.33)")
    sys.path.insert(0, str(REPO / "tests" / "peer"))
    from run_vllm_suite import write_model_files

    with tempfile.TemporaryDirectory() as work:
        hf_home = write_model_files(Path(work))
        sides = {
            "vllm": _side(args.vllm_python, hf_home, False, args),
            "kvcore": _side(args.vllm_python, hf_home, True, args),
        }
    if args.json:
        print(json.dumps(sides, indent=1))
        return 0
    print(f"{args.seeds} seeds x {args.steps} steps per plan; kvcore / vLLM")
    print(f"  {'plan':<16}" + "".join(f"{f:>28}" for f in FIGURES))
    for name in PLANS:
        v, k = sides["vllm"][name], sides["kvcore"][name]
        cells = [
            f"{k[f]:>8,} / {v[f]:>8,} " + (f"{k[f] / v[f]:5.3f}x" if v[f] else "     -")
            for f in FIGURES
        ]
        print(f"  {name:<16}" + "".join(f"{c:>28}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
