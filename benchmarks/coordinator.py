"""Benchmark of the block coordinator, side by side with vLLM's KV-cache manager.

Trace (the one ``../shared/baselines/vllm_blockpool_bench.py`` runs, built by
the same seeded draws): 2,000 requests of 512 prompt tokens, the first 256 of
each one of 8 shared prefixes (chosen at random) and the rest random; 128
decode steps.  Plan: one full-attention group of 16-token blocks, 100,000
blocks, prefix caching on, sha256.  ``--batch B`` requests are live at once:
all B are created and prefilled, then 128 decode rounds run over the B, then
all B are freed.

Timed, exactly as the vLLM instrument times them (``perf_counter_ns`` around
each call):

- ``request_construct``: building the ``Request`` (hashes the prompt's blocks);
- ``get_computed_blocks``: the prefix-cache lookup;
- ``allocate_slots`` for the prompt (``prefill``: ``512 - hit`` tokens with the
  hit attached; it also caches the full blocks) and for each decode token;
- ``append_token``: ``append_output_token_ids`` (hashes a block when it fills);
- ``free``.

Figures are mean microseconds per call, the median repetition by wall time of
``--repeat`` (fresh manager each), plus requests per second over the whole
loop (``requests_per_s``) and over the manager's calls only
(``requests_per_s_manager_only``: lookup + allocate + free).

A speed ratio needs both managers timed in the same run on the same machine:
when vLLM is importable here, or ``--vllm-python`` names an interpreter that
has it, the instrument runs (as a subprocess) on the same trace and the table
shows ``kvcore / vLLM`` time per figure and how many times faster kvcore is.
Figures stored from another run or machine are never divided.

Also measured:

- ``deepseek_v4``: the same trace on ``kvcore/tools/zoo/deepseek-v4-flash.json``
  planned by ``kvcore.plan_kv_cache`` (layout BLHNC, ``--dsv4-memory``).
  Side by side, vLLM's manager is built in its interpreter from the same
  groups (each group's spec class by name and fields, :func:`vllm_plan`;
  the instrument's ``build_manager`` is wrapped, its trace loop unchanged)
  and kvcore runs with whole-block hits, vLLM's rule, so both serve the
  same hits; kvcore's default (copy-on-write hits inside a block) is timed
  alone beside them;
- ``groups``: cost per call with 1, 4, 16, 64 full-attention groups (kvcore
  only);
- ``memory``: the pool's bytes per block at 10^6 blocks (tracemalloc), for
  vLLM's too when it runs;
- ``python_floor``: the full-attention trace on ``python_floor.py``'s bare
  manager of the same semantics, timed by the same loop: kvcore's cost per
  manager call over the floor's, and vLLM's over the floor's (the most times
  faster than vLLM a Python manager can be).

``--gc``, applied to both sides: ``freeze`` (the default) runs
``gc.collect(); gc.freeze()`` after building each manager, as an engine does
after start-up, so a full collection over the pool's long-lived blocks does
not land in a timed call (the instrument's ``build_manager`` is wrapped, not
edited); ``on`` leaves the collector as it is (what the instrument does on
its own); ``off`` disables it in the loop (the instrument's ``--no-gc``).

    python benchmarks/coordinator.py
    python benchmarks/coordinator.py --vllm-python ~/.cache/vllm-baseline/bin/python
    python benchmarks/coordinator.py --json
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import random
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
from python_floor import FloorManager

import kvcore
import kvcore.tools.zoo
from kvcore.coordinator import BlockPool, KVCacheManager, Request
from kvcore.serialize import load_model_file
from kvcore_full_attention import FullAttention, FullAttentionSpec
from kvcore_full_attention.manager import FullAttentionManager

REPO = Path(__file__).resolve().parent.parent
DEFAULT_INSTRUMENT = REPO.parent / "shared" / "baselines" / "vllm_blockpool_bench.py"

#: Per-call figures (microseconds; lower is better), kvcore key -> the
#: instrument's key.
TIME_FIGURES = {
    "allocate_slots_us": "allocate_slots_mean_us",
    "allocate_slots_prefill_us": "allocate_slots_prefill_mean_us",
    "allocate_slots_decode_us": "allocate_slots_decode_mean_us",
    "get_computed_blocks_us": "get_computed_blocks_mean_us",
    "free_us": "free_mean_us",
    "request_construct_us": "request_construct_mean_us",
    "append_token_us": "append_token_mean_us",
    "wall_s": "wall_s",
}
#: Rates (higher is better).
RATE_FIGURES = {
    "requests_per_s": "requests_per_s",
    "requests_per_s_manager_only": "requests_per_s_manager_only",
}
#: Workload counters that must agree between the two managers (same trace,
#: same hits, same blocks).
#: The manager calls the CPython floor (``python_floor.py``) times; the
#: request's own calls are kvcore's on both sides.
FLOOR_FIGURES = (
    "allocate_slots_prefill_us",
    "allocate_slots_decode_us",
    "get_computed_blocks_us",
    "free_us",
)
WORKLOAD = {
    "prefix_hit_tokens": "prefix_hit_tokens",
    "peak_blocks_in_use": "peak_blocks_in_use",
    "cached_blocks_end": "cached_blocks_end",
    "free_blocks_end": "free_blocks_end",
    "allocation_failures": "allocation_failures",
}

VOCAB = 32000
GROUP_COUNTS = (1, 4, 16, 64)


# -- the trace ------------------------------------------------------------------
def make_trace(args: argparse.Namespace) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and per-request decode tokens, drawn as the instrument draws
    them (``random.Random(seed)`` for prompts, ``seed + 1`` for decode)."""
    rng = random.Random(args.seed)
    prefixes = [
        [rng.randrange(VOCAB) for _ in range(args.shared_prefix_len)]
        for _ in range(args.num_prefixes)
    ]
    prompts = []
    for _ in range(args.requests):
        pre = prefixes[rng.randrange(args.num_prefixes)] if args.num_prefixes else []
        tail = [rng.randrange(VOCAB) for _ in range(args.prompt_len - len(pre))]
        prompts.append(pre + tail)
    rng = random.Random(args.seed + 1)
    decode = [
        [rng.randrange(VOCAB) for _ in range(args.decode_steps + 1)]
        for _ in range(args.requests)
    ]
    return prompts, decode


# -- plans ----------------------------------------------------------------------
def full_attention_config(num_blocks: int, num_groups: int = 1) -> kvcore.KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    return kvcore.KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            kvcore.KVCacheGroupSpec([f"layer.{g}"], spec) for g in range(num_groups)
        ],
    )


class ThirdPartyManager(FullAttentionManager):
    """A manager class defined outside kvcore's packages, configured like
    the built-in full attention's: it runs the same code."""


class ThirdPartyFullAttention(FullAttention):
    """The built-in full-attention kind with a manager defined here."""

    manager_type = ThirdPartyManager


def full_attention_manager(
    num_blocks: int,
    max_model_len: int,
    num_groups: int = 1,
    *,
    third_party: bool = False,
) -> tuple[Callable[[], KVCacheManager], int]:
    config = full_attention_config(num_blocks, num_groups)
    registry = (
        kvcore.KindRegistry.from_kinds([ThirdPartyFullAttention()])
        if third_party
        else None
    )
    return (
        lambda: KVCacheManager(
            config,
            max_model_len=max_model_len,
            scheduler_block_size=16,
            hash_block_size=16,
            enable_caching=True,
            registry=registry,
        ),
        16,
    )


def third_party_ratio(
    third: dict[str, Any], built_in: dict[str, Any]
) -> dict[str, float]:
    """Each per-call figure of the third-party kind over the built-in one's
    (times: above 1 is slower; rates: above 1 is faster)."""
    out = {k: third[k] / built_in[k] for k in TIME_FIGURES if built_in.get(k)}
    out.update({k: third[k] / built_in[k] for k in RATE_FIGURES if built_in.get(k)})
    return out


def vllm_plan(manager: KVCacheManager) -> dict[str, Any]:
    """A kvcore manager's groups (the scheduler's view of its plan) as the
    vLLM worker builds them: each group's spec class by name (kvcore's
    built-in kinds carry vLLM's class names) and its fields, the dtype by
    name; fields vLLM's classes lack are dropped there and listed in its
    result."""
    groups = []
    for group in manager.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        fields = attrs.asdict(spec, recurse=False)
        fields["dtype"] = str(fields["dtype"]).removeprefix("torch.")
        groups.append(
            {
                "kind": type(spec).__name__,
                "layers": list(group.layer_names),
                "fields": fields,
            }
        )
    return {
        "num_blocks": manager.kv_cache_config.num_blocks,
        "max_model_len": manager.max_model_len,
        "scheduler_block_size": manager.scheduler_block_size,
        "hash_block_size": manager.hash_block_size,
        "groups": groups,
    }


def deepseek_v4_manager(
    memory: int, max_model_len: int, *, partial_hits: bool = True
) -> tuple[Callable[[], KVCacheManager], int, dict[str, Any]]:
    """The shipped DeepSeek-V4-Flash model file, planned by kvcore;
    ``partial_hits`` off: hits are whole blocks of every group, vLLM's rule."""
    registry = kvcore.default_registry()
    specs = load_model_file(
        kvcore.tools.zoo.path("deepseek-v4-flash"), registry=registry
    ).layers
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout="BLHNC", enable_prefix_caching=True
        ),
        max_model_len=max_model_len,
    )
    plan = kvcore.plan_kv_cache(config, specs, memory, registry=registry)
    assert plan.hash_block_size is not None
    info = {
        "layers": len(specs),
        "groups": len(plan.kv_cache_groups),
        "num_blocks": plan.num_blocks,
        "scheduler_block_size": plan.scheduler_block_size,
        "hash_block_size": plan.hash_block_size,
        "memory_bytes": memory,
    }
    return (
        lambda: KVCacheManager.from_plan(
            plan, registry=registry, enable_partial_hits=partial_hits
        ),
        plan.hash_block_size,
        info,
    )


# -- kvcore's side of the trace ---------------------------------------------------
def run_trace(
    make_manager: Callable[[], KVCacheManager | FloorManager],
    prompts: list[list[int]],
    decode_tokens: list[list[int]],
    *,
    hash_block_size: int,
    hash_function: str,
    batch: int,
    decode_steps: int,
    gc_mode: str,
) -> dict[str, float]:
    """One repetition; the loop and the timed calls are the instrument's."""
    manager = make_manager()
    pool = manager.block_pool
    free0 = pool.get_num_free_blocks()
    if gc_mode == "freeze":
        gc.collect()
        gc.freeze()
    pc = time.perf_counter_ns
    t_req = t_lookup = t_prefill = t_decode = t_append = t_free = 0
    n_prefill = n_decode = n_lookup = n_free = 0
    hit_tokens = prompt_tokens = failures = peak_used = 0
    gc_was_enabled = gc.isenabled()
    if gc_mode == "off":
        gc.disable()
    wall0 = pc()
    for start in range(0, len(prompts), batch):
        live: list[tuple[int, Request]] = []
        for i in range(start, min(start + batch, len(prompts))):
            prompt = prompts[i]
            t0 = pc()
            req = Request(
                f"req-{i}",
                prompt,
                hash_block_size=hash_block_size,
                hash_function=hash_function,
            )
            t1 = pc()
            blocks, hit = manager.get_computed_blocks(req)
            t2 = pc()
            out = manager.allocate_slots(req, len(prompt) - hit, hit, blocks)
            t3 = pc()
            if out is None:
                failures += 1
                continue
            req.num_computed_tokens = len(prompt)
            t4 = pc()
            req.append_output_token_ids(decode_tokens[i][0])
            t5 = pc()
            t_req += t1 - t0
            t_lookup += t2 - t1
            t_prefill += t3 - t2
            t_append += t5 - t4
            n_lookup += 1
            n_prefill += 1
            hit_tokens += hit
            prompt_tokens += len(prompt)
            live.append((i, req))
        for step in range(1, decode_steps + 1):
            for i, req in live:
                t0 = pc()
                out = manager.allocate_slots(req, 1)
                t1 = pc()
                if out is None:
                    failures += 1
                req.num_computed_tokens += 1
                t2 = pc()
                req.append_output_token_ids(decode_tokens[i][step])
                t3 = pc()
                t_decode += t1 - t0
                t_append += t3 - t2
                n_decode += 1
        peak_used = max(peak_used, free0 - pool.get_num_free_blocks())
        for _, req in live:
            t0 = pc()
            manager.free(req)
            t_free += pc() - t0
            n_free += 1
    wall = (pc() - wall0) / 1e9
    if gc_mode == "off" and gc_was_enabled:
        gc.enable()
    if gc_mode == "freeze":
        gc.unfreeze()
    n_alloc = n_prefill + n_decode
    manager_s = (t_lookup + t_prefill + t_decode + t_free) / 1e9
    return {
        "wall_s": wall,
        "requests_per_s": len(prompts) / wall,
        "requests_per_s_manager_only": len(prompts) / manager_s,
        "allocate_slots_us": (t_prefill + t_decode) / n_alloc / 1e3,
        "allocate_slots_prefill_us": t_prefill / max(n_prefill, 1) / 1e3,
        "allocate_slots_decode_us": t_decode / max(n_decode, 1) / 1e3,
        "get_computed_blocks_us": t_lookup / max(n_lookup, 1) / 1e3,
        "free_us": t_free / max(n_free, 1) / 1e3,
        "request_construct_us": t_req / max(n_prefill, 1) / 1e3,
        "append_token_us": t_append / max(n_decode + n_prefill, 1) / 1e3,
        "prefix_hit_tokens": hit_tokens,
        "prefix_hit_rate": hit_tokens / max(prompt_tokens, 1),
        "allocation_failures": failures,
        "peak_blocks_in_use": peak_used,
        "free_blocks_end": pool.get_num_free_blocks(),
        "cached_blocks_end": pool.num_cached_blocks,
    }


def median_run(runs: list[dict[str, float]]) -> dict[str, Any]:
    """The median repetition by wall time (as the instrument reports)."""
    ordered = sorted(runs, key=lambda r: r["wall_s"])
    result: dict[str, Any] = dict(ordered[len(ordered) // 2])
    result["per_repeat_wall_s"] = [round(r["wall_s"], 4) for r in runs]
    return result


Side = Callable[[int], dict[str, Any]]
"""One repetition of the trace at a batch size, on a fresh manager."""


def interleaved(
    sides: dict[str, Side], batches: list[int], repeat: int
) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """``repeat`` repetitions of every side at every batch size, the sides
    alternating (and which goes first), so a change in the machine's load
    falls on all of them."""
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {
        (side, b): [] for side in sides for b in batches
    }
    names = list(sides)
    for rep in range(repeat):
        for batch in batches:
            for side in names if rep % 2 == 0 else names[::-1]:
                runs[side, batch].append(sides[side](batch))
    return runs


def kvcore_side(
    make: Callable[[], KVCacheManager | FloorManager],
    prompts: list[list[int]],
    decode: list[list[int]],
    hash_block_size: int,
    args: argparse.Namespace,
) -> Side:
    def run(batch: int) -> dict[str, Any]:
        return run_trace(
            make,
            prompts,
            decode,
            hash_block_size=hash_block_size,
            hash_function=args.hash,
            batch=batch,
            decode_steps=args.decode_steps,
            gc_mode=args.gc,
        )

    return run


def kvcore_figures(
    make: Callable[[], KVCacheManager],
    prompts: list[list[int]],
    decode: list[list[int]],
    hash_block_size: int,
    batch: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """kvcore alone: the median of ``--repeat`` repetitions at ``batch``."""
    run = kvcore_side(make, prompts, decode, hash_block_size, args)
    return median_run([run(batch) for _ in range(args.repeat)])


# -- memory -------------------------------------------------------------------------
def traced_bytes(build: Callable[[], object]) -> int:
    """Bytes ``build()`` leaves allocated (tracemalloc), its result kept alive."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = build()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del kept
    gc.collect()
    return after - before


def kvcore_memory(num_blocks: int) -> dict[str, float]:
    pool = traced_bytes(
        lambda: BlockPool(num_blocks, enable_caching=True, hash_block_size=16)
    )
    make, _ = full_attention_manager(num_blocks, 32768)
    manager = traced_bytes(make)
    return {
        "num_blocks": num_blocks,
        "pool_bytes_per_block": pool / num_blocks,
        "manager_bytes_per_block": manager / num_blocks,
    }


# -- vLLM's side (a subprocess running the instrument) ---------------------------------
#: Runs inside the vLLM interpreter: loads the instrument, then answers one
#: JSON command per stdin line with one JSON line: ``{"argv": [...]}`` runs
#: its ``main`` (``--json``) and returns the result; ``{"memory": N}`` returns
#: the bytes per block (tracemalloc) of a manager its ``build_manager``
#: builds with N blocks.  With ``freeze``, its ``build_manager`` is wrapped to
#: collect and freeze the heap after building (and ``run`` to unfreeze after),
#: as kvcore's side does; the instrument itself is not edited.
VLLM_WORKER = r"""
import contextlib, dataclasses, gc, importlib.util, io, json, sys, tracemalloc
path, gc_mode = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location("vllm_blockpool_bench", path)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
build, run = mod.build_manager, mod.run
plan = None  # a group description to build instead of the one-group plan
dropped = set()  # its fields vLLM's spec classes do not have

def build_plan(desc):
    import torch
    from vllm.v1 import kv_cache_interface as kvi
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    groups = []
    for g in desc["groups"]:
        cls = getattr(kvi, g["kind"])
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in g["fields"].items() if k in known}
        for k, v in g["fields"].items():
            if k not in known:
                dropped.add(f"{g['kind']}.{k}={v}")
        fields["dtype"] = getattr(torch, fields["dtype"])
        groups.append(kvi.KVCacheGroupSpec(g["layers"], cls(**fields)))
    config = kvi.KVCacheConfig(
        num_blocks=desc["num_blocks"], kv_cache_tensors=[], kv_cache_groups=groups
    )
    return KVCacheManager(
        config,
        max_model_len=desc["max_model_len"],
        scheduler_block_size=desc["scheduler_block_size"],
        hash_block_size=desc["hash_block_size"],
        enable_caching=True,
        log_stats=False,
    )

def build_any(*a, **k):
    m = build(*a, **k) if plan is None else build_plan(plan)
    if gc_mode == "freeze":
        gc.collect()
        gc.freeze()
    return m

def run_unfreeze(*a, **k):
    try:
        return run(*a, **k)
    finally:
        if gc_mode == "freeze":
            gc.unfreeze()

mod.build_manager, mod.run = build_any, run_unfreeze
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    buf = io.StringIO()
    if "argv" in cmd:
        plan = cmd.get("plan")
        dropped = set()
        with contextlib.redirect_stdout(buf):
            mod.main(cmd["argv"])
        out = json.loads(buf.getvalue())
        if plan is not None:
            out["plan_fields_not_in_vllm"] = sorted(dropped)
    else:
        plan = None  # the instrument's one-group plan
        n = cmd["memory"]
        with contextlib.redirect_stdout(buf):
            gc.collect()
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            mgr = mod.build_manager(n, 16, 32768)
            after = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
        del mgr
        gc.collect()
        out = {"num_blocks": n, "manager_bytes_per_block": (after - before) / n}
    print(json.dumps(out), flush=True)
"""


def kvcore_source() -> dict[str, Any]:
    """Where the kvcore measured here comes from: its checkout's commit and
    whether ``kvcore/`` or ``plugins/`` differ from it."""
    root = Path(kvcore.__file__).resolve().parent.parent

    def git(*cmd: str) -> str:
        proc = subprocess.run(
            ["git", "-C", str(root), *cmd],
            capture_output=True,
            text=True,
            check=False,
        )
        return proc.stdout.strip() if proc.returncode == 0 else ""

    return {
        "path": str(root),
        "commit": git("rev-parse", "--short", "HEAD") or None,
        "modified": git("status", "--porcelain", "--", "kvcore", "plugins").split("\n")
        if git("status", "--porcelain", "--", "kvcore", "plugins")
        else [],
    }


def vllm_importable() -> bool:
    return importlib.util.find_spec("vllm") is not None


class VllmWorker:
    """The instrument, loaded once in a vLLM interpreter, run on demand (so
    its repetitions can alternate with kvcore's in one run)."""

    def __init__(self, python: str, instrument: Path, args: argparse.Namespace):
        env = dict(os.environ, PYTHONHASHSEED="0")
        self.proc = subprocess.Popen(
            [python, "-c", VLLM_WORKER, str(instrument), args.gc],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.python = python
        self.common = [
            "--num-requests", str(args.requests),
            "--prompt-len", str(args.prompt_len),
            "--decode-steps", str(args.decode_steps),
            "--shared-prefix-len", str(args.shared_prefix_len),
            "--num-prefixes", str(args.num_prefixes),
            "--num-blocks", str(args.num_blocks),
            "--block-size", "16",
            "--max-model-len", str(args.max_model_len),
            "--hash", "sha256",
            "--seed", str(args.seed),
            "--repeat", "1",
            "--json",
        ]  # fmt: skip
        if args.gc == "off":
            self.common.append("--no-gc")
        self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            assert self.proc.stderr is not None
            err = self.proc.stderr.read().strip().splitlines()[-1:] or ["(no output)"]
            raise SystemExit(
                f"the vLLM instrument failed under {self.python} "
                f"(exit {self.proc.wait()}): {err[0]}"
            )
        result: dict[str, Any] = json.loads(line)
        return result

    def _ask(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def run(self, batch: int, plan: dict[str, Any] | None = None) -> dict[str, Any]:
        """One repetition at ``batch`` on a fresh manager: the instrument's
        one-group plan, or the groups ``plan`` describes (see
        :func:`vllm_plan`), hashed at its hash block size."""
        argv = [*self.common, "--batch", str(batch)]
        if plan is None:
            return self._ask({"argv": argv})
        at = argv.index("--block-size") + 1
        argv[at] = str(plan["hash_block_size"])
        at = argv.index("--max-model-len") + 1
        argv[at] = str(plan["max_model_len"])
        return self._ask({"argv": argv, "plan": plan})

    def memory(self, num_blocks: int) -> dict[str, Any]:
        return self._ask({"memory": num_blocks})

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()


# -- output -----------------------------------------------------------------------------
def compare(kv: dict[str, Any], vl: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per figure: kvcore, vLLM, kvcore/vLLM time, and x faster (vLLM/kvcore
    time); rates are turned into times before dividing."""
    rows: dict[str, dict[str, float]] = {}
    for key, vkey in TIME_FIGURES.items():
        a, b = kv[key], vl[vkey]
        rows[key] = {"kvcore": a, "vllm": b, "time_ratio": a / b, "x_faster": b / a}
    for key, vkey in RATE_FIGURES.items():
        a, b = kv[key], vl[vkey]
        rows[key] = {"kvcore": a, "vllm": b, "time_ratio": b / a, "x_faster": a / b}
    return rows


def workload_mismatch(
    kv: dict[str, Any], vl: dict[str, Any], other: str = "vLLM"
) -> list[str]:
    """The workload counters on which kvcore and ``other`` disagree."""
    return [
        f"{key}: kvcore {kv[key]} vs {other} {vl[vkey]}"
        for key, vkey in WORKLOAD.items()
        if kv[key] != vl[vkey]
    ]


def over_floor(
    kv: dict[str, Any], floor: dict[str, Any], vl: dict[str, Any] | None
) -> dict[str, dict[str, float]]:
    """Per manager call: kvcore's and the floor's time, kvcore over the
    floor, and (with vLLM) vLLM's time over the floor: how many times faster
    than vLLM a manager at the floor would be, the most any Python manager
    can reach."""
    rows: dict[str, dict[str, float]] = {}
    for key in FLOOR_FIGURES:
        row = {
            "kvcore": kv[key],
            "floor": floor[key],
            "kv_over_floor": kv[key] / floor[key],
        }
        if vl is not None:
            row["vllm_over_floor"] = vl[TIME_FIGURES[key]] / floor[key]
        rows[key] = row
    return rows


def print_floor(title: str, rows: dict[str, dict[str, float]]) -> None:
    print(
        f"{title}: kvcore beside the CPython floor (python_floor.py; vLLM/floor: "
        "the most times faster than vLLM a Python manager can be)",
        file=sys.stderr,
    )
    for key, row in rows.items():
        vl = row.get("vllm_over_floor")
        print(
            f"  {key:28} {row['kvcore']:9.3f} {row['floor']:9.3f} "
            f"{row['kv_over_floor']:7.2f}x"
            + ("" if vl is None else f"  vLLM/floor {vl:5.2f}x"),
            file=sys.stderr,
        )


def print_table(title: str, rows: dict[str, dict[str, float]]) -> None:
    print(title, file=sys.stderr)
    print(
        f"  {'figure':28} {'kvcore':>11} {'vLLM':>11} {'kv/vLLM':>8} {'x faster':>9}",
        file=sys.stderr,
    )
    for key, row in rows.items():
        print(
            f"  {key:28} {row['kvcore']:11.3f} {row['vllm']:11.3f} "
            f"{row['time_ratio']:8.3f} {row['x_faster']:8.2f}x",
            file=sys.stderr,
        )


def print_figures(title: str, figures: dict[str, Any]) -> None:
    print(title, file=sys.stderr)
    for key, value in figures.items():
        if isinstance(value, float):
            print(f"  {key:>28} {value:12.3f}", file=sys.stderr)
        else:
            print(f"  {key:>28} {value!s:>12}", file=sys.stderr)


def parse_memory(text: str) -> int:
    units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--shared-prefix-len", type=int, default=256)
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--decode-steps", type=int, default=128)
    parser.add_argument("--num-blocks", type=int, default=100_000)
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument(
        "--batch",
        type=int,
        action="append",
        help="requests live at once (repeatable; default 1 and 64)",
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--hash",
        default="sha256",
        choices=("sha256",),
        help="block hash (the instrument's sha256; the only one both sides share)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gc", default="freeze", choices=("on", "freeze", "off"))
    parser.add_argument(
        "--vllm-python",
        metavar="PATH",
        help="an interpreter with vLLM to run the instrument in (default: this "
        "one, when vLLM is importable here)",
    )
    parser.add_argument(
        "--vllm-instrument",
        metavar="PATH",
        default=str(DEFAULT_INSTRUMENT),
        help="the vLLM measuring script (default %(default)s)",
    )
    parser.add_argument("--no-vllm", action="store_true", help="kvcore figures only")
    parser.add_argument(
        "--dsv4-memory",
        default="64GiB",
        help="KV cache budget the DeepSeek-V4 plan is made for (default 64GiB)",
    )
    parser.add_argument(
        "--group-requests",
        type=int,
        default=500,
        help="requests of the group-scaling runs (batch 1; default 500)",
    )
    parser.add_argument("--memory-blocks", type=int, default=1_000_000)
    parser.add_argument("--no-dsv4", action="store_true")
    parser.add_argument("--no-groups", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    return parser


def find_vllm(args: argparse.Namespace) -> tuple[str | None, Path]:
    """The interpreter to run vLLM's manager under (None: kvcore figures
    only) and the measuring script it runs."""
    vllm_python: str | None = None
    if not args.no_vllm:
        if args.vllm_python:
            vllm_python = args.vllm_python
            if not Path(vllm_python).exists():
                raise SystemExit(f"--vllm-python {vllm_python}: no such interpreter")
        elif vllm_importable():
            vllm_python = sys.executable
    instrument = Path(args.vllm_instrument).expanduser()
    if vllm_python is not None and not instrument.is_file():
        raise SystemExit(
            f"vLLM instrument not found at {instrument}; pass --vllm-instrument PATH "
            "or --no-vllm"
        )
    return vllm_python, instrument


def run_full_attention(
    args: argparse.Namespace,
    batches: list[int],
    trace: tuple[list[list[int]], list[list[int]]],
    worker: VllmWorker | None,
    results: dict[str, Any],
) -> None:
    """One full-attention group, kvcore beside vLLM when there is a worker."""
    prompts, decode = trace
    make, hash_bs = full_attention_manager(args.num_blocks, args.max_model_len)
    make_third, _ = full_attention_manager(
        args.num_blocks, args.max_model_len, third_party=True
    )

    def make_floor() -> FloorManager:
        return FloorManager(args.num_blocks)

    sides = {
        "kvcore": kvcore_side(make, prompts, decode, hash_bs, args),
        "kvcore_third_party": kvcore_side(make_third, prompts, decode, hash_bs, args),
        "python_floor": kvcore_side(make_floor, prompts, decode, hash_bs, args),
    }
    if worker is not None:
        sides = {"vllm": worker.run, **sides}
    runs = interleaved(sides, batches, args.repeat)
    kv_runs = {b: runs["kvcore", b] for b in batches}
    vl_runs = {b: runs.get(("vllm", b), []) for b in batches}
    for batch in batches:
        figures = median_run(kv_runs[batch])
        third = median_run(runs["kvcore_third_party", batch])
        entry: dict[str, Any] = {
            "kvcore": figures,
            "kvcore_third_party": third,
            "third_party_over_built_in": third_party_ratio(third, figures),
        }
        if not args.json:
            print_figures(
                f"full_attention batch {batch}: a third-party kind configured like "
                "the built-in one, its figures over the built-in one's",
                entry["third_party_over_built_in"],
            )
        floor = median_run(runs["python_floor", batch])
        vl = median_run(vl_runs[batch]) if worker is not None else None
        entry["python_floor"] = floor
        entry["over_floor"] = over_floor(figures, floor, vl)
        entry["floor_workload_mismatch"] = workload_mismatch(figures, floor, "floor")
        if not args.json:
            print_floor(f"full_attention batch {batch}", entry["over_floor"])
            for line in entry["floor_workload_mismatch"]:
                print(f"  WORKLOAD DIFFERS: {line}", file=sys.stderr)
        if vl is not None:
            entry["vllm"] = vl
            entry["compare"] = compare(figures, vl)
            entry["workload_mismatch"] = workload_mismatch(figures, vl)
            if not args.json:
                print_table(
                    f"full_attention batch {batch} (gc {args.gc})", entry["compare"]
                )
                for line in entry["workload_mismatch"]:
                    print(f"  WORKLOAD DIFFERS: {line}", file=sys.stderr)
        elif not args.json:
            print_figures(f"full_attention batch {batch} (gc {args.gc})", figures)
        results[f"full_attention/batch{batch}"] = entry
    if worker is not None:
        first = vl_runs[batches[0]][0]
        results["vllm"] = {
            key: first[key] for key in ("vllm_version", "torch_version", "python")
        }


def run_deepseek_v4(
    args: argparse.Namespace,
    batches: list[int],
    trace: tuple[list[list[int]], list[list[int]]],
    worker: VllmWorker | None,
    results: dict[str, Any],
) -> None:
    """The DeepSeek-V4 plan's groups, kvcore's partial hits and whole-block
    hits, beside vLLM when there is a worker."""
    prompts, decode = trace
    # Side by side, both managers serve the same hits: whole blocks of
    # every group (vLLM's rule; a 512-token prompt gets none under the
    # plan's 2048-token blocks).  kvcore's default, copy-on-write hits
    # inside a block, is timed alone.
    budget = parse_memory(args.dsv4_memory)
    make_v4, hash_v4, info = deepseek_v4_manager(budget, args.max_model_len)
    make_whole, _, _ = deepseek_v4_manager(
        budget, args.max_model_len, partial_hits=False
    )
    v4_plan = vllm_plan(make_v4())
    results["deepseek_v4/plan"] = info
    if not args.json:
        print(f"deepseek_v4 plan: {json.dumps(info)}", file=sys.stderr)
    v4_sides = {
        "kvcore": kvcore_side(make_v4, prompts, decode, hash_v4, args),
        "kvcore_whole_block_hits": kvcore_side(
            make_whole, prompts, decode, hash_v4, args
        ),
    }
    if worker is not None:
        v4_worker = worker

        def vllm_v4(batch: int) -> dict[str, Any]:
            return v4_worker.run(batch, v4_plan)

        v4_sides["vllm"] = vllm_v4
    v4_runs = interleaved(v4_sides, batches, args.repeat)
    for batch in batches:
        figures = median_run(v4_runs["kvcore", batch])
        whole = median_run(v4_runs["kvcore_whole_block_hits", batch])
        entry: dict[str, Any] = {"kvcore": figures, "kvcore_whole_block_hits": whole}
        if not args.json:
            print_figures(f"deepseek_v4 batch {batch} (kvcore)", figures)
        if worker is not None:
            vl = median_run(v4_runs["vllm", batch])
            entry["vllm"] = vl
            entry["compare"] = compare(whole, vl)
            entry["workload_mismatch"] = workload_mismatch(whole, vl)
            if not args.json:
                print_table(
                    f"deepseek_v4 batch {batch}, whole-block hits on both sides",
                    entry["compare"],
                )
                for line in entry["workload_mismatch"]:
                    print(f"  WORKLOAD DIFFERS: {line}", file=sys.stderr)
        results[f"deepseek_v4/batch{batch}"] = entry


def run_group_scaling(
    args: argparse.Namespace,
    trace: tuple[list[list[int]], list[list[int]]],
    results: dict[str, Any],
) -> None:
    """kvcore's calls at batch 1 as the number of full-attention groups grows."""
    prompts, decode = trace
    sub = prompts[: args.group_requests]
    scaling = {}
    for n in GROUP_COUNTS:
        make_n, hash_n = full_attention_manager(args.num_blocks, args.max_model_len, n)
        scaling[n] = kvcore_figures(make_n, sub, decode, hash_n, 1, args)
    results["groups/batch1"] = scaling
    if not args.json:
        print(f"groups of full attention, batch 1, {len(sub)} requests "
              "(us per call):", file=sys.stderr)  # fmt: skip
        keys = ("allocate_slots_prefill_us", "allocate_slots_decode_us",
                "get_computed_blocks_us", "free_us", "request_construct_us")  # fmt: skip
        print("  groups " + " ".join(f"{k[:-3]:>26}" for k in keys), file=sys.stderr)
        for n, fig in scaling.items():
            print(f"  {n:6d} " + " ".join(f"{fig[k]:26.3f}" for k in keys),
                  file=sys.stderr)  # fmt: skip


def run_memory(
    args: argparse.Namespace, worker: VllmWorker | None, results: dict[str, Any]
) -> None:
    """The bytes each manager holds for ``--memory-blocks`` blocks."""
    memory = {"kvcore": kvcore_memory(args.memory_blocks)}
    if worker is not None:
        memory["vllm"] = worker.memory(args.memory_blocks)
    results["memory"] = memory
    if not args.json:
        print(f"memory at {args.memory_blocks} blocks: {json.dumps(memory)}",
              file=sys.stderr)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    batches: list[int] = args.batch or [1, 64]
    if args.shared_prefix_len > args.prompt_len:
        parser.error("--shared-prefix-len exceeds --prompt-len")
    vllm_python, instrument = find_vllm(args)

    trace = make_trace(args)
    results: dict[str, Any] = {
        "config": {
            k: v for k, v in vars(args).items() if k not in ("json", "vllm_python")
        },
        "python": sys.version.split()[0],
        "kvcore_version": getattr(kvcore, "__version__", None),
        "kvcore_source": kvcore_source(),
        "load_average_start": os.getloadavg(),
    }

    worker: VllmWorker | None = None
    if vllm_python is not None:
        print(f"loading vLLM's manager under {vllm_python} ...", file=sys.stderr)
        worker = VllmWorker(vllm_python, instrument, args)
    else:
        results["vllm"] = None
        print(
            "vLLM not importable here and no --vllm-python: kvcore figures only",
            file=sys.stderr,
        )

    run_full_attention(args, batches, trace, worker, results)
    if not args.no_dsv4:
        run_deepseek_v4(args, batches, trace, worker, results)
    if not args.no_groups:
        run_group_scaling(args, trace, results)
    if not args.no_memory:
        run_memory(args, worker, results)

    if worker is not None:
        worker.close()
    results["load_average_end"] = os.getloadavg()
    print(json.dumps(results, indent=None if args.json else 1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
