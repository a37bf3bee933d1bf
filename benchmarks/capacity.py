"""Capacity benchmark: how many requests of T tokens each plan holds.

For every model file (the shipped ``kvcore/tools/zoo/*.json`` by default), every
packing policy and every context length ``T``, the model is planned with
``kvcore.plan_kv_cache`` on ``--memory`` bytes (layout ``BLHNC``, the
policy's target context ``T``) and measured with ``kvcore.plan_capacity``:

- ``concurrency``: requests of exactly ``T`` tokens that fit together, with
  one prefill step of ``--max-num-batched-tokens`` tokens in flight and the
  null block taken;
- ``unreserved_concurrency``: memory over (block stride x blocks per
  request), unrounded and with nothing reserved;
- ``ideal_concurrency``: the physical limit, every layer keeping exactly its
  own pages at its model-file block size;
- ``ratio``: unreserved over ideal (1.0 is perfect);
- ``bound_ratio``: the best ratio any one-stride plan can reach (the
  ``min_waste`` search with no cap on the number of groups);
- ``block_sizes`` and ``hit_granularity``: the groups' block sizes in tokens
  and the tokens prefix hits are multiples of (prefix caching off: the
  scheduler block);
- ``vllm_concurrency`` / ``vllm_ratio``: vLLM 0.33's figures from the
  baseline file (the better of its default and packed paths), the ratio
  taken against the baseline's own ideal, which counts windows differently;
  empty when the baseline is missing or was measured on other memory;
- ``plan_ms``: median wall time of ``kvcore.plan_kv_cache`` over
  ``--repeat`` runs.

    python benchmarks/capacity.py
    python benchmarks/capacity.py gemma-3-27b --contexts 4k,128k --json
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import kvcore
import kvcore.tools.zoo
from kvcore.config import PACKING_POLICIES
from kvcore.errors import KvcoreError, KvcoreKeyError, UnknownKindError
from kvcore.plan.block_sizes import effective_block_size, plan_hit_granularity
from kvcore.plan.buckets import bucket_layers
from kvcore.plan.capacity import ideal_bytes_per_request
from kvcore.plan.declarations import layer_alignment
from kvcore.plan.policies.min_waste import search
from kvcore.registry import KindRegistry
from kvcore.serialize import load_model_file
from kvcore.spec import KVCacheSpec

REPO = Path(__file__).resolve().parent.parent
DEFAULT_BASELINE = "../shared/baselines/capacity.json"
LAYOUT = "BLHNC"

_MEMORY_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_CONTEXT_UNITS = {"": 1, "k": 2**10, "m": 2**20}

#: Markdown table columns: (heading, row key, format).
COLUMNS = [
    ("model", "model", "{}"),
    ("policy", "policy", "{}"),
    ("T", "context", "{}"),
    ("groups", "groups", "{}"),
    ("bytes/block", "bytes_per_block", "{}"),
    ("block sizes", "block_sizes", "{}"),
    ("hit gran.", "hit_granularity", "{}"),
    ("concurrency", "concurrency", "{}"),
    ("unreserved", "unreserved_concurrency", "{:.2f}"),
    ("ideal", "ideal_concurrency", "{:.2f}"),
    ("ratio", "ratio", "{:.4f}"),
    ("bound", "bound_ratio", "{:.4f}"),
    ("vLLM conc.", "vllm_concurrency", "{:.2f}"),
    ("vLLM ratio", "vllm_ratio", "{:.4f}"),
    ("plan ms", "plan_ms", "{:.2f}"),
]


# -- command line ---------------------------------------------------------------
def parse_memory(text: str) -> int:
    """Bytes from ``"68719476736"``, ``"64GiB"``, ``"64 GB"``, ``"512MiB"``..."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match and _MEMORY_UNITS.get(match.group(2).lower())
    if not match or unit is None:
        msg = f"not a memory size: {text!r} (bytes, or a number with GiB/GB/MiB/TiB...)"
        raise argparse.ArgumentTypeError(msg)
    return int(float(match.group(1)) * unit)


def parse_contexts(text: str) -> list[int]:
    """Token counts from ``"4096,32768"`` or ``"4k,32k,128k"`` (k = 1024)."""
    contexts = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", item)
        if not match or int(match.group(1)) == 0:
            msg = f"not a context length: {item!r} (e.g. 4096 or 4k)"
            raise argparse.ArgumentTypeError(msg)
        contexts.append(int(match.group(1)) * _CONTEXT_UNITS[match.group(2).lower()])
    return contexts


def parse_policies(text: str) -> list[str]:
    policies = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in policies if p not in PACKING_POLICIES]
    if unknown or not policies:
        msg = f"unknown policies {unknown}; known: {', '.join(PACKING_POLICIES)}"
        raise argparse.ArgumentTypeError(msg)
    return policies


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "models",
        nargs="*",
        help="model files (paths or shipped names); default: every shipped file",
    )
    parser.add_argument("--memory", type=parse_memory, default=parse_memory("64GiB"))
    parser.add_argument(
        "--contexts", type=parse_contexts, default=parse_contexts("4096,32768,131072")
    )
    parser.add_argument(
        "--policies", type=parse_policies, default=parse_policies("seed,min_waste")
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument(
        "--repeat", type=int, default=5, help="planning-time repetitions (median)"
    )
    parser.add_argument(
        "--baseline",
        default=DEFAULT_BASELINE,
        help="vLLM figures (relative paths are from the repository root)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows")
    return parser


def note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr)


# -- inputs ---------------------------------------------------------------------
def model_path(name: str) -> Path:
    """A path as given, else a shipped model file by name."""
    path = Path(name)
    if path.is_file():
        return path
    return kvcore.tools.zoo.path(name.removesuffix(".json"))


def load_specs(path: Path, registry: KindRegistry) -> dict[str, KVCacheSpec] | None:
    """The model's layer specs, or ``None`` (with a note) if a kind is missing."""
    try:
        return load_model_file(path, registry=registry).layers
    except UnknownKindError as exc:
        note(f"skipping {path.name}: {exc}")
        return None


def load_baseline(option: str, memory: int) -> dict[str, Any]:
    """The baseline's per-model figures, or ``{}`` when they do not apply."""
    path = Path(option)
    if not path.is_absolute():
        path = REPO / path
    if not path.is_file():
        note(f"no baseline at {path}: vLLM columns left empty")
        return {}
    data = json.loads(path.read_text())
    if data.get("memory_bytes") != memory:
        note(
            f"baseline measured at {data.get('memory_bytes')} bytes, not {memory}: "
            "vLLM columns left empty"
        )
        return {}
    models: dict[str, Any] = data.get("models", {})
    return models


# -- measurements ---------------------------------------------------------------
def engine_config(policy: str, context: int, max_batched: int) -> kvcore.EngineConfig:
    return kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout=LAYOUT, packing_policy=policy, target_context=context
        ),
        max_num_batched_tokens=max_batched,
    )


def timed_plan(
    config: kvcore.EngineConfig,
    specs: Mapping[str, KVCacheSpec],
    memory: int,
    registry: KindRegistry,
    repeat: int,
) -> tuple[kvcore.KVCacheConfig, float]:
    """The plan and the median milliseconds ``plan_kv_cache`` took."""
    times = []
    for _ in range(max(repeat, 1)):
        start = time.perf_counter()
        plan = kvcore.plan_kv_cache(config, specs, memory, registry=registry)
        times.append(time.perf_counter() - start)
    return plan, statistics.median(times) * 1e3


def stride_alignment(specs: Mapping[str, KVCacheSpec]) -> int:
    """The lcm of every spec's stride alignment and element size."""
    return math.lcm(*(layer_alignment(s) for s in specs.values()))


def bound_ratio(specs: Mapping[str, KVCacheSpec], context: int) -> float | None:
    """The best ratio to the physical limit any one-stride plan reaches
    (``None`` if the search cannot plan the model)."""
    try:
        choice = search(
            bucket_layers(specs),
            context=context,
            alignment=stride_alignment(specs),
            max_groups=10**9,
            dcp=1,
            max_growth=64,
            tie_tolerance=0.0,
        )
    except KvcoreError as exc:
        note(f"no one-stride bound at {context} tokens: {exc}")
        return None
    return ideal_bytes_per_request(specs, context) / choice.bytes_per_request


def vllm_figures(
    baseline: Mapping[str, Any], file: str, context: int
) -> tuple[float | None, float | None]:
    """vLLM's best concurrency at ``context`` and its ratio to the baseline's
    own ideal (``None`` where there is no figure or vLLM refuses)."""
    model = baseline.get(file)
    if model is None:
        return None, None
    key = str(context)
    figures = [model.get(path, {}).get(key) for path in ("vllm_default", "vllm_packed")]
    figures = [f for f in figures if f is not None]
    if not figures:
        return None, None
    best = max(figures)
    ideal = model.get("ideal", {}).get(key)
    return best, (best / ideal if ideal else None)


def hit_granularity(plan: kvcore.KVCacheConfig) -> int:
    """Tokens prefix hits are multiples of (the scheduler block when prefix
    caching is off)."""
    hits = plan_hit_granularity(plan)
    if hits is None:  # plan_kv_cache always resolves them
        msg = "the plan has no resolved block sizes"
        raise AssertionError(msg)
    return hits


def plan_row(
    config: kvcore.EngineConfig,
    specs: Mapping[str, KVCacheSpec],
    context: int,
    args: argparse.Namespace,
    registry: KindRegistry,
) -> dict[str, Any]:
    """The plan's own columns, or an ``error`` column if it cannot be planned."""
    try:
        plan, plan_ms = timed_plan(config, specs, args.memory, registry, args.repeat)
        cap = kvcore.plan_capacity(
            plan,
            context,
            specs=specs,
            memory=args.memory,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    except KvcoreError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    groups = plan.kv_cache_groups
    return {
        "groups": len(groups),
        "bytes_per_block": plan.bytes_per_block,
        "block_sizes": sorted({effective_block_size(g, 1) for g in groups}),
        "hit_granularity": hit_granularity(plan),
        "blocks_per_request": cap.blocks_per_request,
        "concurrency": cap.concurrency,
        "unreserved_concurrency": cap.unreserved_concurrency,
        "ideal_concurrency": cap.ideal_concurrency,
        "ratio": cap.ratio,
        "plan_ms": plan_ms,
    }


def model_rows(
    path: Path,
    specs: Mapping[str, KVCacheSpec],
    args: argparse.Namespace,
    registry: KindRegistry,
    baseline: Mapping[str, Any],
) -> list[dict[str, Any]]:
    rows = []
    for context in args.contexts:
        bound = bound_ratio(specs, context)
        vllm_concurrency, vllm_ratio = vllm_figures(baseline, path.name, context)
        for policy in args.policies:
            config = engine_config(policy, context, args.max_num_batched_tokens)
            row: dict[str, Any] = {
                "model": path.stem,
                "policy": policy,
                "context": context,
            }
            row.update(plan_row(config, specs, context, args, registry))
            row.update(
                bound_ratio=bound,
                vllm_concurrency=vllm_concurrency,
                vllm_ratio=vllm_ratio,
            )
            rows.append(row)
    return rows


# -- output ---------------------------------------------------------------------
def cell(value: Any, fmt: str) -> str:
    if value is None:
        return ""
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return fmt.format(value)


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| " + " | ".join(h for h, _, _ in COLUMNS) + " |",
        "|" + "|".join(" --- " for _ in COLUMNS) + "|",
    ]
    for row in rows:
        if "error" in row:
            cells = [cell(row.get(k), f) for _, k, f in COLUMNS[:3]]
            cells += ["error: " + row["error"]] + [""] * (len(COLUMNS) - 4)
        else:
            cells = [cell(row.get(k), f) for _, k, f in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def benchmark_registry() -> KindRegistry:
    """The installed kinds (every shipped model file needs only the built-in
    ones)."""
    return kvcore.KindRegistry.from_plugin_manager(kvcore.get_plugin_manager())


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        paths = [model_path(name) for name in args.models or kvcore.tools.zoo.names()]
    except KvcoreKeyError as exc:
        parser.error(str(exc))
    registry = benchmark_registry()
    baseline = load_baseline(args.baseline, args.memory)
    rows: list[dict[str, Any]] = []
    for path in paths:
        specs = load_specs(path, registry)
        if specs is not None:
            rows.extend(model_rows(path, specs, args, registry, baseline))
    print(json.dumps(rows, indent=1) if args.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
