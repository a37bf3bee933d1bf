"""Hit-rate benchmark: how close each model's prefix hits come to the
token-level bound.

For every shipped model file (``kvcore.tools.zoo``), every named workload
(``kvcore.tools.simulate.NAMED_WORKLOADS``) and two pools, the model is planned as
``kvcore simulate MODEL --workload NAME`` plans it (kvcore's defaults: prefix
caching on, the model file's modes, 8192 tokens a step) and the workload is
replayed with the content oracle on (``Driver(validate=True)``):

- **ample**: enough blocks that nothing is ever evicted: every request's
  every block at once, with no sharing (per position-indexed group
  ``ceil(tokens / block size)`` blocks, per other group its fixed blocks),
  plus the null block;
- **tight**: the most blocks the ample run held in use at once (plus the
  null block): the live requests fit at their busiest step, and cached
  blocks live only in what they leave free; the same rule for every model
  (a model whose plan needs more blocks for one request of the planning
  context gets that many; the ``blocks`` column shows each pool).

Each row shows the hit rate (hit tokens over looked-up tokens), the
token-level bound (the longest common token prefix with anything computed
before, over the same admissions), their gap, the peak cached blocks (all
groups, and the recurrent-state groups alone), preemptions, prefix-cache
evictions and invalid hits (hits whose blocks did not hold the request's own
tokens; always 0 unless the coordinator is wrong).

    python benchmarks/hit_rate.py
    python benchmarks/hit_rate.py --model llama-3-1-8b --workload chat
    python benchmarks/hit_rate.py --write   # regenerate docs/hit-rate.md
    python benchmarks/hit_rate.py --policies   # every checkpoint policy

``--policies`` runs the models whose default plan checkpoints recurrent
states once per checkpoint policy (``kvcore.CHECKPOINT_POLICIES``): what
each policy costs in cached state blocks and gains in hits.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# A sibling script: ``python benchmarks/hit_rate.py`` has benchmarks/ on the path.
from capacity import benchmark_registry

import kvcore
import kvcore.tools.zoo
from kvcore.checkpoints import CHECKPOINT_POLICIES
from kvcore.errors import PlanError
from kvcore.registry import KindRegistry
from kvcore.spec import HitPolicy
from kvcore.tools.cli.options import Planned, add_model_options, plan_from_args
from kvcore.tools.simulate import Driver, SimulationResult, Workload, named_workload
from kvcore.tools.simulate import workload_names as _workload_names

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "hit-rate.md"

#: The tight pool over the ample run's peak blocks in use.
TIGHT_FACTOR = 1.0
#: The full-attention model the tight pools are compared against: simulated
#: in the same run on the same workload (hit rates are counts, not timings).
BASELINE_MODEL = "llama-3-1-8b"
#: Steps between counts of the cached blocks (see ``Driver``).
CACHE_SAMPLE_EVERY = 16
POOLS = ("ample", "tight")

#: Markdown table columns: (heading, row key, format).
COLUMNS = [
    ("model", "model", "{}"),
    ("workload", "workload", "{}"),
    ("pool", "pool", "{}"),
    ("blocks", "num_blocks", "{:,}"),
    ("hit rate", "hit_rate", "{:.1%}"),
    ("token bound", "bound_rate", "{:.1%}"),
    ("gap", "gap", "{:.1%}"),
    ("cached blocks (peak)", "peak_cached_blocks", "{:,}"),
    ("cached states (peak)", "peak_cached_state_blocks", "{:,}"),
    ("preemptions", "preemptions", "{:,}"),
    ("evictions", "evictions", "{:,}"),
    ("invalid hits", "invalid_hits", "{:,}"),
]


# -- planning ----------------------------------------------------------------------


def plan_model(
    model: str, registry: KindRegistry, memory: int, options: Sequence[str] = ()
) -> Planned:
    """``model`` planned as ``kvcore simulate MODEL --memory MEMORY`` plans it."""
    parser = argparse.ArgumentParser()
    add_model_options(parser)
    args = parser.parse_args([model, "--memory", str(memory), *options])
    return plan_from_args(args, registry=registry)


def plan_with_blocks(
    model: str,
    registry: KindRegistry,
    blocks: int,
    options: Sequence[str] = (),
    *,
    probe: Planned | None = None,
) -> Planned:
    """The default plan of ``model`` with at least ``blocks`` blocks (the
    fewest memory gives; more where the plan needs more for one request).
    ``probe``: the model already planned with the same options, if at hand."""
    if probe is None:
        probe = plan_model(model, registry, 2**30, options)
    stride = probe.plan.bytes_per_block
    memory = blocks * stride
    for _ in range(64):
        try:
            planned = plan_model(model, registry, memory, options)
        except PlanError:
            memory = memory * 5 // 4
            continue
        have = planned.plan.num_blocks
        if have >= blocks:
            return planned
        memory += (blocks - have) * planned.plan.bytes_per_block
    msg = f"{model}: no plan with {blocks} blocks"
    raise RuntimeError(msg)


def blocks_for_everything(driver: Driver, workload: Workload) -> int:
    """Blocks for every request's every block at once, with no sharing, plus
    the null block: a pool that never evicts."""
    manager, _ = driver._manager(Workload.of(workload.requests[:1]))
    total = 1
    for m in manager.coordinator.single_type_managers:
        if m.position_indexed:
            total += sum(
                math.ceil(r.max_tokens / m.block_size) for r in workload.requests
            )
        else:
            total += len(workload) * int(getattr(m, "fixed_blocks", 1))
    return total


# -- rows -------------------------------------------------------------------------


def _row(
    model: str, workload: str, pool: str, result: SimulationResult
) -> dict[str, Any]:
    return {
        "model": model,
        "workload": workload,
        "pool": pool,
        "num_blocks": result.num_blocks,
        "hit_rate": result.hit_rate,
        "first_admission_hit_rate": result.first_admission_hit_rate,
        "bound_rate": result.bound_rate,
        "gap": result.bound_rate - result.hit_rate,
        "prefix_hit_tokens": result.prefix_hit_tokens,
        "token_bound_tokens": result.token_bound_tokens,
        "prompt_tokens_looked_up": result.prompt_tokens_looked_up,
        "peak_cached_blocks": result.peak_cached_blocks,
        "peak_cached_state_blocks": result.peak_cached_state_blocks,
        "preemptions": result.preemptions,
        "evictions": result.evictions,
        "invalid_hits": result.invalid_hits,
        "invalid_hit_reports": list(result.invalid_hit_reports),
        "completed": result.completed,
        "requests": result.requests,
        "unserved": len(result.unserved),
    }


def replay(
    planned: Planned, workload: Workload, registry: KindRegistry
) -> SimulationResult:
    """``workload`` through ``planned``'s coordinator, the content oracle on."""
    driver = Driver(
        planned.plan,
        registry=registry,
        max_num_batched_tokens=planned.config.max_num_batched_tokens,
        validate=True,
        cache_sample_every=CACHE_SAMPLE_EVERY,
    )
    return driver.run(workload)


def model_rows(
    model: str,
    workload_name: str,
    registry: KindRegistry,
    *,
    seed: int = 0,
    options: Sequence[str] = (),
    pools: Sequence[str] = POOLS,
) -> list[dict[str, Any]]:
    """The rows of one model and one named workload (ample first: the tight
    pool is sized from its run)."""
    workload = named_workload(workload_name, seed=seed)
    probe = plan_model(model, registry, 2**30, options)
    probe_driver = Driver(probe.plan, registry=registry)
    ample = plan_with_blocks(
        model,
        registry,
        blocks_for_everything(probe_driver, workload),
        options,
        probe=probe,
    )
    result = replay(ample, workload, registry)
    rows = []
    if "ample" in pools:
        rows.append(_row(model, workload_name, "ample", result))
    if "tight" in pools:
        tight_blocks = math.ceil(TIGHT_FACTOR * result.peak_blocks_in_use) + 1
        tight = plan_with_blocks(model, registry, tight_blocks, options, probe=probe)
        result = replay(tight, workload, registry)
        row = _row(model, workload_name, "tight", result)
        row["pool_bytes"] = tight.plan.num_blocks * tight.plan.bytes_per_block
        rows.append(row)
    return rows


def same_memory_rows(
    rows: Sequence[dict[str, Any]],
    *,
    seed: int = 0,
    registry: KindRegistry | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Each tight row of a model other than :data:`BASELINE_MODEL` beside the
    baseline model's hit rate on the same workload in the same memory (its
    context the workload's longest request, so one fits), and in its own
    tight pool (the same pressure), compared on first admissions (a
    re-admission's hits on its own earlier blocks save only what its
    preemption cost)."""
    registry = registry or benchmark_registry()
    own = {
        r["workload"]: r
        for r in rows
        if r["model"] == BASELINE_MODEL and r["pool"] == "tight"
    }
    out = []
    for row in rows:
        if row["pool"] != "tight" or row["model"] == BASELINE_MODEL:
            continue
        start = time.monotonic()
        workload = named_workload(row["workload"], seed=seed)
        longest = max(r.max_tokens for r in workload.requests)
        baseline = plan_model(
            BASELINE_MODEL, registry, row["pool_bytes"], ("--context", str(longest))
        )
        result = replay(baseline, workload, registry)
        same = own.get(row["workload"])
        first = row["first_admission_hit_rate"]
        base = result.first_admission_hit_rate
        own_base = None if same is None else same["first_admission_hit_rate"]
        out.append(
            {
                "model": row["model"],
                "workload": row["workload"],
                "hit_rate": row["hit_rate"],
                "first_admission_hit_rate": first,
                "pool_gib": row["pool_bytes"] / 2**30,
                "baseline_blocks": result.num_blocks,
                "baseline_hit_rate": result.hit_rate,
                "baseline_preemptions": result.preemptions,
                "baseline_first_admission_hit_rate": base,
                "same_memory": first / base if base else None,
                "baseline_unserved": len(result.unserved),
                "baseline_own_hit_rate": own_base,
                "same_pressure": first / own_base if own_base else None,
                "invalid_hits": result.invalid_hits,
            }
        )
        if progress is not None:
            progress(
                f"{BASELINE_MODEL} in {row['model']}'s {row['workload']} pool: "
                f"{time.monotonic() - start:.1f} s"
            )
    return out


#: Columns of the same-memory table.
SAME_MEMORY_COLUMNS = [
    ("model", "model", "{}"),
    ("workload", "workload", "{}"),
    ("tight pool", "pool_gib", "{:.2f} GiB"),
    ("hit rate", "hit_rate", "{:.1%}"),
    ("at first admissions", "first_admission_hit_rate", "{:.1%}"),
    (f"{BASELINE_MODEL} there: blocks", "baseline_blocks", "{:,}"),
    ("its hit rate", "baseline_hit_rate", "{:.1%}"),
    ("its preemptions", "baseline_preemptions", "{:,}"),
    ("at first admissions", "baseline_first_admission_hit_rate", "{:.1%}"),
    ("requests it cannot serve", "baseline_unserved", "{:,}"),
    ("x same memory", "same_memory", "{:.2f}"),
    (
        f"{BASELINE_MODEL} in its own tight pool, at first admissions",
        "baseline_own_hit_rate",
        "{:.1%}",
    ),
    ("x same pressure", "same_pressure", "{:.2f}"),
]


def same_memory_markdown(rows: Sequence[dict[str, Any]]) -> str:
    columns = SAME_MEMORY_COLUMNS
    lines = [
        "| " + " | ".join(h for h, _, _ in columns) + " |",
        "|" + "|".join(" --- " for _ in columns) + "|",
    ]
    for row in rows:
        cells = [
            "-" if row[key] is None else fmt.format(row[key]) for _, key, fmt in columns
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown(rows: list[dict[str, Any]], *, policy: bool = False) -> str:
    columns = COLUMNS
    if policy:
        columns = [*COLUMNS[:1], ("checkpoint policy", "policy", "{}"), *COLUMNS[1:]]
    head = "| " + " | ".join(h for h, _, _ in columns) + " |"
    rule = "|" + "|".join(" --- " for _ in columns) + "|"
    lines = [head, rule]
    for row in rows:
        cells = [fmt.format(row[key]) for _, key, fmt in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


PAGE_HEAD = """\
# Hit rate

How close each shipped model's prefix hits come to the **token-level
bound**: at every admission, the longest common token prefix between the
tokens the request looks up and the tokens any request computed before it
(capped at one less than the tokens looked up: the last is always
recomputed).  A cache that kept every computed token at token granularity
would serve exactly the bound; the gap is what block granularity, hit
alignment, eviction and state kinds that keep no history cost.

The table is `python benchmarks/hit_rate.py --write` ({doc}`simulate`
describes the simulator and its figures).  Each model is planned as
`kvcore simulate MODEL --workload NAME` plans it: prefix caching on, the
model file's modes (so a Mamba hybrid whose states are kept only live gets
no hit), 8192 tokens a step, one prefill at a time.  Every run has the
content oracle on (`Driver(validate=True)`): *invalid hits* counts hits whose
blocks did not hold the request's own tokens, and is 0 unless the
coordinator is wrong.

- **Workloads** (`kvcore.tools.simulate.NAMED_WORKLOADS`, seed 0): `chat` (16
  conversations of 7 turns over one 1024-token system prompt; each turn adds
  300-2000 tokens and outputs 100-400), `shared-prefix` (128 single-turn
  requests over 4 system prompts of 1536 tokens), `agentic` (8 agents of 12
  short turns over 2 tool preambles of 6144 tokens).
- **ample**: every request's every block at once with no sharing, plus the
  null block, so nothing is ever evicted.
- **tight**: the most blocks the ample run held in use at once, plus the
  null block: the live requests fit at their busiest step, and cached
  blocks live only in what they leave free.  A plan that needs more blocks
  for one request of its planning context (32k tokens) gets that many: the
  *blocks* column gives every pool.
- **hit rate**, **token bound**: hit and bound tokens over the tokens looked
  up at every admission (re-admissions after preemption included, counted
  the same way in both).
- **cached blocks (peak)**: the most blocks holding a prefix-cache key at
  once (cached prefixes and states, in use or free), all groups together,
  counted every 16 steps; **cached states** is the same over the
  recurrent-state groups alone: what keeping states costs.  A hybrid whose
  states block every hit still caches its attention blocks.
- **evictions**: prefix-cache keys dropped: to reuse a block (its
  copy-on-write partial keys count too), or a checkpointed state a newer
  one replaced (so an ample pool shows some on the hybrids).

"""


POLICY_HEAD = """
## Checkpoint policies

The models above whose default plan checkpoints recurrent states, once per
checkpoint policy (`--checkpoint-policy`; `turns` is the default): what the
states each policy keeps cost (*cached states*) and what they gain (*hit
rate*).

"""


SAME_MEMORY_HEAD = f"""
## Tight pools against full attention

Every other model's tight pool beside {BASELINE_MODEL} (full attention only),
simulated in the same run on the same workload: in **the same memory** (the
baseline planned in the tight pool's bytes, its context the workload's
longest request), and in **its own tight pool** (the same pressure: each
pool is its own model's busiest step, the stricter comparison, since a model
whose requests take fewer bytes keeps more cached in the same memory).  *x* is the model's hit
rate over the baseline's at first admissions (none where the baseline serves no hit): in a
pool smaller than its busiest step the baseline preempts, and a re-admission's hits on its
own earlier blocks save only what the preemption cost.

"""


def page(
    rows: list[dict[str, Any]],
    policy_rows: list[dict[str, Any]],
    same_memory: Sequence[dict[str, Any]] = (),
) -> str:
    text = PAGE_HEAD + markdown(rows)
    if policy_rows:
        text += POLICY_HEAD + markdown(policy_rows, policy=True)
    if same_memory:
        text += SAME_MEMORY_HEAD + same_memory_markdown(same_memory)
    return text


def checkpointing_models(models: Sequence[str], registry: KindRegistry) -> list[str]:
    """The models whose default plan has a recurrent-state group that keeps
    checkpoints (``HitPolicy.CHECKPOINT``)."""
    out = []
    for model in models:
        plan = plan_model(model, registry, 2**30).plan
        if any(
            g.manager_spec.hit_policy is HitPolicy.CHECKPOINT
            for g in plan.kv_cache_groups
        ):
            out.append(model)
    return out


# -- command line ---------------------------------------------------------------


def _names(text: str, known: list[str], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        msg = (
            f"unknown {what} {', '.join(bad) or repr(text)}; known: {', '.join(known)}"
        )
        raise argparse.ArgumentTypeError(msg)
    return names


def build_parser() -> argparse.ArgumentParser:
    models = kvcore.tools.zoo.names()
    workloads = _workload_names()
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument(
        "--model",
        type=lambda t: _names(t, models, "model"),
        default=models,
        help="shipped models to run, comma-separated (default: all)",
    )
    parser.add_argument(
        "--workload",
        type=lambda t: _names(t, workloads, "workload"),
        default=workloads,
        help="named workloads to run, comma-separated (default: all)",
    )
    parser.add_argument(
        "--pool",
        type=lambda t: _names(t, list(POOLS), "pool"),
        default=list(POOLS),
        help="pools to run: ample, tight (default both)",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument(
        "--policies",
        action="store_true",
        help="also run every checkpoint policy on the models that checkpoint states",
    )
    parser.add_argument(
        "--write",
        action="store_true",
        help=f"regenerate {DOC.relative_to(REPO)} (every model, workload and pool)",
    )
    return parser


def run_rows(
    models: Sequence[str],
    workloads: Sequence[str],
    pools: Sequence[str],
    *,
    seed: int = 0,
    registry: KindRegistry | None = None,
    progress: Callable[[str], None] | None = None,
    policy: str | None = None,
) -> list[dict[str, Any]]:
    registry = registry or benchmark_registry()
    options = () if policy is None else ("--checkpoint-policy", policy)
    rows = []
    for model in models:
        for workload in workloads:
            start = time.monotonic()
            got = model_rows(
                model, workload, registry, seed=seed, pools=pools, options=options
            )
            for row in got:
                row["policy"] = policy or "default"
            rows.extend(got)
            if progress is not None:
                shown = f" ({policy})" if policy else ""
                progress(f"{model} {workload}{shown}: {time.monotonic() - start:.1f} s")
    return rows


def policy_rows(
    models: Sequence[str],
    workloads: Sequence[str],
    pools: Sequence[str],
    *,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    default_rows: Sequence[dict[str, Any]] = (),
) -> list[dict[str, Any]]:
    """Rows of every checkpoint policy on the models that checkpoint states
    (the policy of a model's default plan taken from ``default_rows`` where
    they hold the model's rows: the same runs)."""
    registry = benchmark_registry()
    chosen = checkpointing_models(models, registry)
    rows = []
    for model in chosen:
        planned = {
            g.manager_spec.checkpoint_policy_name
            for g in plan_model(model, registry, 2**30).plan.kv_cache_groups
        } - {None}
        for name in CHECKPOINT_POLICIES:
            same = [r for r in default_rows if r["model"] == model]
            if planned == {name} and same:
                rows.extend({**r, "policy": name} for r in same)
                continue
            rows.extend(
                run_rows(
                    [model],
                    workloads,
                    pools,
                    seed=seed,
                    registry=registry,
                    progress=progress,
                    policy=name,
                )
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.write and (
        args.model != kvcore.tools.zoo.names()
        or args.workload != _workload_names()
        or args.pool != list(POOLS)
        or args.seed != 0
    ):
        print("--write runs every model, workload and pool at seed 0", file=sys.stderr)
        return 2
    start = time.monotonic()
    rows = run_rows(
        args.model,
        args.workload,
        args.pool,
        seed=args.seed,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    extra: list[dict[str, Any]] = []
    if args.policies or args.write:
        extra = policy_rows(
            args.model,
            args.workload,
            args.pool,
            seed=args.seed,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
            default_rows=rows,
        )
    if args.json:
        print(json.dumps(rows + extra, indent=1))
    else:
        print(markdown(rows), end="")
        if extra:
            print()
            print(markdown(extra, policy=True), end="")
    compared: list[dict[str, Any]] = []
    if args.write:
        compared = same_memory_rows(
            rows,
            seed=args.seed,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    rows = rows + extra
    if args.write:
        DOC.write_text(page(rows[: len(rows) - len(extra)], extra, compared))
        print(f"wrote {DOC.relative_to(REPO)}", file=sys.stderr)
    print(f"{time.monotonic() - start:.0f} s in all", file=sys.stderr)
    bad = sum(row["invalid_hits"] for row in [*rows, *compared])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
