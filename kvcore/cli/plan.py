"""``kvcore plan``: how many requests of each length fit."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvcore import zoo
from kvcore.config import PACKING_POLICIES, CacheConfig, EngineConfig
from kvcore.errors import KvcoreValueError
from kvcore.plan import plan_capacity, plan_kv_cache
from kvcore.plugins import get_plugin_manager
from kvcore.registry import KindRegistry
from kvcore.report import format_plan
from kvcore.serialize import load_model_file, make_converter

__all__ = ["register"]


def _contexts(text: str) -> list[int]:
    """``"4096,32768"`` -> ``[4096, 32768]``; a clear error otherwise."""
    parts = [part.strip() for part in str(text).split(",") if part.strip()]
    if not parts or not all(part.isdigit() and int(part) > 0 for part in parts):
        msg = (
            f"--context takes positive token counts separated by commas "
            f"(e.g. 4096,32768), got {text!r}"
        )
        raise KvcoreValueError(msg)
    return [int(part) for part in parts]


def _cmd_plan(args: argparse.Namespace) -> int:
    registry = KindRegistry.from_plugin_manager(get_plugin_manager())
    source = Path(args.model)
    path = (
        source if source.suffix == ".json" or source.exists() else zoo.path(args.model)
    )
    model = load_model_file(path, registry)
    contexts = _contexts(args.context)
    config = EngineConfig(
        cache_config=CacheConfig(
            kv_cache_layout=args.layout,
            enable_prefix_caching=not args.no_prefix_caching,
            packing_policy=args.policy,
            target_context=contexts[0],
            max_block_growth=args.max_block_growth,
        )
    )
    memory = int(args.memory_gib * 2**30)
    plan = plan_kv_cache(config, model.layers, memory, registry=registry)
    reports = [
        plan_capacity(plan, c, specs=model.layers, memory=memory) for c in contexts
    ]
    if args.json:
        out = make_converter(registry).unstructure(plan)
        out["capacity"] = [
            {
                "context": r.context,
                "concurrency": r.concurrency,
                "unreserved_concurrency": r.unreserved_concurrency,
                "ideal_concurrency": r.ideal_concurrency,
                "ratio": r.ratio,
                "blocks_per_request": r.blocks_per_request,
            }
            for r in reports
        ]
        print(json.dumps(out, indent=1))
    else:
        print(
            format_plan(plan, title=f"{model.name}: {len(model.layers)} cache layers")
        )
        print()
        for r in reports:
            print(
                f"  {r.context:>7} tokens: {r.concurrency} "
                f"{'request' if r.concurrency == 1 else 'requests'} "
                f"({r.ratio:.3f} of the physical limit, {r.ideal_concurrency:.1f})"
            )
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    plan = sub.add_parser("plan", help="plan a model file's KV cache")
    plan.add_argument(
        "model", help=f"a model file, or one of: {', '.join(zoo.names())}"
    )
    plan.add_argument(
        "--memory-gib", type=float, default=8.0, help="KV cache memory (default 8)"
    )
    plan.add_argument(
        "--layout", default="BLHNC", help="KV cache layout (default BLHNC)"
    )
    plan.add_argument(
        "--policy",
        choices=PACKING_POLICIES,
        default="min_waste",
        help="grouping policy (default min_waste)",
    )
    plan.add_argument(
        "--context",
        default="32768",
        help="request length(s) in tokens, comma-separated; the first is the "
        "policy's target (default 32768)",
    )
    plan.add_argument(
        "--max-block-growth",
        type=int,
        default=64,
        help="largest factor min_waste may grow a block size by; 1 keeps the "
        "model's block sizes (finer prefix hits)",
    )
    plan.add_argument("--no-prefix-caching", action="store_true")
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(func=_cmd_plan)
