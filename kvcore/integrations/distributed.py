"""One plan for every worker of a ``torch.distributed`` process group.

Each rank plans its own stage from its own free memory (:func:`plan_local`),
then :func:`agree_plan` makes the ranks agree:

- every rank's plan is all-gathered and read as untrusted input
  (:func:`checked_records`): strict JSON, checked as a loaded config is, its
  fingerprint (a SHA-256 of the canonical JSON of its groups, page sizes,
  block sizes and settings, :func:`plan_fingerprint`) recomputed by every
  receiver; a rank sending garbage or a forged fingerprint is named;
- ``num_blocks`` becomes the minimum over the ranks' checked plans, since the
  scheduler runs one block pool whose ids every worker honours;
- the ranks of one pipeline stage must plan the same, and the stages' groups
  must line up.  On any difference every rank raises the same
  :class:`PlanMismatchError`, naming the ranks and the fields that differ;
- every rank then holds the same :class:`~kvcore.integrations.stages.PipelinePlan`,
  whose JSON (:func:`dump_pipeline_plan`) the scheduler ships to the workers.

Every collective waits at most ``timeout``: a rank that died or is slower
gives a :class:`CollectiveError` on the others instead of a hang.  Only
torch.distributed moves bytes (gloo on CPU, NCCL on GPUs).

A worker binds its tensors from that JSON alone (:func:`bind_worker_cache`),
after checking it against its own specs (:func:`check_plan_matches_specs`).
"""

from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from kvcore.config import EngineConfig
from kvcore.errors import (
    KvcoreError,
    KvcoreTypeError,
    PlanError,
    SerializationError,
    echo,
    require_instance,
)
from kvcore.integrations.stages import (
    PipelinePlan,
    line_up_problem,
    plan_pipeline_stages,
    with_num_blocks,
)
from kvcore.plan.block_sizes import _AGREED
from kvcore.plan.plan import plan_kv_cache
from kvcore.pool import KVCachePool
from kvcore.registry import KindRegistry
from kvcore.serialize import config_from_data, make_converter, parse_json
from kvcore.spec import KVCacheSpec
from kvcore.structs import KVCacheConfig

__all__ = [
    "DEFAULT_TIMEOUT",
    "CollectiveError",
    "PlanMismatchError",
    "WorkerSpecMismatchError",
    "agree_plan",
    "bind_worker_cache",
    "broadcast_text",
    "check_agreement",
    "check_plan_matches_specs",
    "dump_pipeline_plan",
    "fingerprint_parts",
    "load_pipeline_plan",
    "plan_fingerprint",
    "plan_local",
]

#: How long a collective waits for the other ranks by default.
DEFAULT_TIMEOUT = datetime.timedelta(seconds=60)
#: The ``format`` key of the JSON a scheduler ships to its workers.
PLAN_FORMAT = "kvcore.pipeline_plan/1"


class PlanMismatchError(PlanError):
    """Ranks planned different caches; raised identically on every rank.

    :param ranks: the ranks whose plan differs from rank 0's.
    :param fields: the plan fields that differ.
    """

    def __init__(
        self, message: str, *, ranks: Sequence[int], fields: Sequence[str]
    ) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.fields = tuple(fields)


class WorkerSpecMismatchError(PlanError):
    """A shipped plan does not match the worker's own layer specs."""

    def __init__(self, message: str, *, layer: str | None, field: str) -> None:
        super().__init__(message)
        self.layer = layer
        self.field = field


class CollectiveError(KvcoreError, RuntimeError):
    """A collective failed or timed out: another rank died, hung or is slow."""


# -- fingerprints -------------------------------------------------------------


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def fingerprint_parts(
    plan: KVCacheConfig, registry: KindRegistry | None = None
) -> dict[str, Any]:
    """The fields ranks must agree on, as JSON-ready values: the groups
    (layers and specs), every layer's page size, the block sizes, the bytes
    per block and each setting of the plan (not ``num_blocks`` or memory,
    which ranks reconcile)."""
    require_instance(plan, KVCacheConfig, "plan_fingerprint: plan")
    converter = make_converter(registry)
    parts: dict[str, Any] = {
        "groups": [
            {
                "layer_names": list(g.layer_names),
                "kv_cache_spec": converter.unstructure(g.kv_cache_spec),
            }
            for g in plan.kv_cache_groups
        ],
        "page_sizes": {
            n: g.layer_spec(n).page_size_bytes
            for g in plan.kv_cache_groups
            for n in g.layer_names
        },
        "block_sizes": [g.kv_cache_spec.block_size for g in plan.kv_cache_groups],
        "bytes_per_block": plan.bytes_per_block,
        "pipeline_stage": plan.pipeline_stage,
        "pipeline_stages": plan.pipeline_stages,
    }
    for name in _AGREED:
        value = getattr(plan, name)
        parts[name] = value.name if hasattr(value, "name") else value
    return parts


def plan_fingerprint(plan: KVCacheConfig, registry: KindRegistry | None = None) -> str:
    """A stable SHA-256 hex digest of :func:`fingerprint_parts`: equal on two
    machines exactly when their plans agree."""
    digest = hashlib.sha256(_canonical(fingerprint_parts(plan, registry)).encode())
    return digest.hexdigest()


# -- bounded collectives ------------------------------------------------------


def _dist() -> Any:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        msg = (
            "torch.distributed is not initialised; call "
            "torch.distributed.init_process_group(backend, timeout=...) on every "
            "rank first"
        )
        raise CollectiveError(msg)
    return dist


def _device(group: Any) -> torch.device:
    """Where collective tensors live: the current CUDA device under NCCL."""
    dist = _dist()
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _wait(work: Any, what: str, group: Any, timeout: datetime.timedelta) -> None:
    dist = _dist()
    try:
        work.wait(timeout=timeout)
    except RuntimeError as exc:
        rank = dist.get_rank()
        size = dist.get_world_size(group)
        msg = (
            f"rank {rank}: the {what} over {size} ranks did not complete within "
            f"{timeout.total_seconds():g} s ({exc}); another rank died, hung or "
            "is slower than the timeout: check the other ranks' logs, or raise "
            "the timeout"
        )
        raise CollectiveError(msg) from exc


def _all_gather_bytes(
    payload: bytes, group: Any, timeout: datetime.timedelta, what: str
) -> list[bytes]:
    """Every rank's ``payload``: sizes first, then the padded bytes."""
    dist = _dist()
    device = _device(group)
    size = dist.get_world_size(group)
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(size)]
    work = dist.all_gather(lengths, length, group=group, async_op=True)
    _wait(work, f"{what} (sizes)", group, timeout)
    longest = max(int(t.item()) for t in lengths)
    data = torch.zeros(longest, dtype=torch.uint8, device=device)
    data[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    gathered = [torch.zeros_like(data) for _ in range(size)]
    work = dist.all_gather(gathered, data, group=group, async_op=True)
    _wait(work, what, group, timeout)
    return [
        bytes(t[: int(n.item())].cpu().numpy().tobytes())
        for t, n in zip(gathered, lengths, strict=True)
    ]


def broadcast_text(
    text: str | None,
    *,
    src: int = 0,
    group: Any = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> str:
    """``text`` from rank ``src`` on every rank (others pass ``None``), as a
    scheduler ships its config; bounded by ``timeout``."""
    dist = _dist()
    device = _device(group)
    mine = (text or "").encode() if dist.get_rank() == src else b""
    length = torch.tensor([len(mine)], dtype=torch.int64, device=device)
    work = dist.broadcast(length, src=src, group=group, async_op=True)
    _wait(work, "broadcast of the plan (size)", group, timeout)
    data = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
    if mine:
        data[:] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    work = dist.broadcast(data, src=src, group=group, async_op=True)
    _wait(work, "broadcast of the plan", group, timeout)
    return bytes(data.cpu().numpy().tobytes()).decode()


# -- planning and agreeing ----------------------------------------------------


def plan_local(
    config: EngineConfig,
    specs: Mapping[str, KVCacheSpec],
    available_memory: int,
    *,
    stage: int = 0,
    stage_sizes: Sequence[int] | None = None,
    registry: KindRegistry | None = None,
) -> KVCacheConfig:
    """This rank's plan: its pipeline stage's layers of ``specs`` (one
    tensor-parallel rank's specs of the whole model) in ``available_memory``.

    Every rank splits the whole model the same way, so each finds the stage
    boundaries and groups the other stages use.
    """
    pp = config.parallel_config.pipeline_parallel_size
    if type(stage) is not int or not 0 <= stage < pp:
        msg = f"stage {stage!r} is not one of the {pp} pipeline stages (0..{pp - 1})"
        raise PlanError(msg)
    if pp == 1:
        return plan_kv_cache(config, specs, available_memory, registry=registry)
    plans = plan_pipeline_stages(
        config, specs, available_memory, stage_sizes=stage_sizes, registry=registry
    )
    return plans.stages[stage]


def _first_difference(field: str, ours: Any, theirs: Any) -> str:
    """A short account of how one field differs."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for key in list(ours) + [k for k in theirs if k not in ours]:
            if ours.get(key) != theirs.get(key):
                return (
                    f"{field} of layer {key!r}: {ours.get(key)!r} vs "
                    f"{theirs.get(key)!r}"
                )
    if isinstance(ours, list) and isinstance(theirs, list) and field == "groups":
        if len(ours) != len(theirs):
            return f"groups: {len(ours)} vs {len(theirs)} cache groups"
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            if a != b:
                return f"group {i}: {_canonical(a)[:160]} vs {_canonical(b)[:160]}"
    return f"{field}: {_canonical(ours)[:160]} vs {_canonical(theirs)[:160]}"


def check_agreement(gathered: Sequence[Mapping[str, Any]]) -> None:
    """Raise the same :class:`PlanMismatchError` on every rank unless each
    stage's ranks planned alike; ``gathered`` is every rank's record
    (``stage``, ``fingerprint`` and ``parts``, in group-rank order).  Within a stage the plan most ranks hold is the
    reference (ties: the lowest rank's), and the others are named."""
    by_stage: dict[int, list[int]] = {}
    for rank, record in enumerate(gathered):
        by_stage.setdefault(record["stage"], []).append(rank)
    problems: list[str] = []
    ranks: set[int] = set()
    fields: set[str] = set()
    for stage, members in sorted(by_stage.items()):
        held: dict[str, list[int]] = {}
        for rank in members:
            held.setdefault(gathered[rank]["fingerprint"], []).append(rank)
        ref = max(held.values(), key=lambda rs: (len(rs), -rs[0]))[0]
        ref_parts = gathered[ref]["parts"]
        for rank in members:
            if gathered[rank]["fingerprint"] == gathered[ref]["fingerprint"]:
                continue
            parts = gathered[rank]["parts"]
            differ = [k for k in ref_parts if ref_parts[k] != parts.get(k)]
            ranks.add(rank)
            fields.update(differ)
            details = "; ".join(
                _first_difference(k, ref_parts[k], parts.get(k)) for k in differ[:3]
            )
            problems.append(
                f"rank {rank} planned stage {stage} differently from rank {ref} "
                f"(fields {', '.join(differ)}: {details})"
            )
    if problems:
        msg = (
            "the ranks disagree on the KV cache plan: "
            + "; ".join(problems)
            + ". Every rank must plan the same model file with the same engine "
            "settings (cache dtype, block size, tensor- and pipeline-parallel "
            "sizes, layout, policy); fix the ranks named"
        )
        raise PlanMismatchError(msg, ranks=sorted(ranks), fields=sorted(fields))


#: The keys of the record each rank sends in :func:`agree_plan`.
_RECORD_KEYS = frozenset({"stage", "num_blocks", "fingerprint", "config"})


def checked_records(
    raw: Sequence[bytes], registry: KindRegistry | None = None
) -> list[dict[str, Any]]:
    """Every rank's record, read as untrusted input: strict JSON, a plan
    checked as :func:`~kvcore.serialize.load_config` checks one, and a
    fingerprint recomputed here (a rank's claim is compared, never used).

    Every rank reads the same gathered bytes, so every honest rank raises the
    same :class:`PlanMismatchError`, naming the first rank whose record is
    not a valid plan or whose fingerprint does not match what it sent.
    """
    records: list[dict[str, Any]] = []
    for rank, data in enumerate(raw):
        try:
            record = parse_json(
                data.decode("utf-8"), where=f"rank {rank}'s plan record"
            )
            if not isinstance(record, dict) or set(record) != _RECORD_KEYS:
                msg = (
                    f"rank {rank}'s plan record must be a JSON object with keys "
                    f"{sorted(_RECORD_KEYS)}"
                )
                raise SerializationError(msg)
            plan = config_from_data(
                record["config"], registry, where=f"rank {rank}'s plan: "
            )
            fingerprint = plan_fingerprint(plan, registry)
            claims = (record["fingerprint"], record["stage"], record["num_blocks"])
            if claims != (fingerprint, plan.pipeline_stage or 0, plan.num_blocks):
                msg = (
                    f"rank {rank}'s record claims fingerprint, stage and blocks "
                    f"{echo(claims)} but its plan has {fingerprint}, stage "
                    f"{plan.pipeline_stage or 0} and {plan.num_blocks} blocks"
                )
                raise SerializationError(msg)
        except (KvcoreError, UnicodeDecodeError) as exc:
            msg = (
                f"rank {rank} sent a plan record that is not a valid kvcore plan "
                f"({type(exc).__name__}: {exc}); every rank must run the same kvcore "
                "and send the plan it made"
            )
            raise PlanMismatchError(msg, ranks=[rank], fields=["record"]) from None
        records.append(
            {
                "stage": plan.pipeline_stage or 0,
                "num_blocks": plan.num_blocks,
                "fingerprint": fingerprint,
                "parts": json.loads(_canonical(fingerprint_parts(plan, registry))),
                "plan": plan,
            }
        )
    return records


def agree_plan(
    plan: KVCacheConfig,
    *,
    group: Any = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    registry: KindRegistry | None = None,
) -> PipelinePlan:
    """Make every rank of ``group`` agree on one plan (see the module doc).

    Every rank calls this with its own :func:`plan_local` plan and gets the
    same :class:`~kvcore.integrations.stages.PipelinePlan`: one plan per stage, all
    of the smallest rank's ``num_blocks``.

    Raises :class:`PlanMismatchError` (on every rank alike) when the plans
    differ, :class:`CollectiveError` when a collective fails or passes
    ``timeout``.
    """
    converter = make_converter(registry)
    record = {
        "stage": plan.pipeline_stage or 0,
        "num_blocks": plan.num_blocks,
        "fingerprint": plan_fingerprint(plan, registry),
        "config": converter.unstructure(plan),
    }
    raw = _all_gather_bytes(
        _canonical(record).encode(), group, timeout, "all-gather of plan fingerprints"
    )
    gathered = checked_records(raw, registry)
    num_blocks = min(rec["num_blocks"] for rec in gathered)
    # From here on every rank reads only the gathered records, so every rank
    # reaches the same answer, or the same error.
    check_agreement(gathered)
    first_rank: dict[int, int] = {}
    for rank, rec in enumerate(gathered):
        first_rank.setdefault(rec["stage"], rank)
    leaders = sorted(first_rank.values())
    settings = [
        name
        for name in (*_AGREED, "pipeline_stages")
        if len({_canonical(gathered[r]["parts"][name]) for r in leaders}) > 1
    ]
    if settings:
        msg = (
            f"the pipeline stages' plans (ranks {leaders}) do not fit one "
            f"scheduler: they differ in {', '.join(settings)}; every stage must "
            "split and plan the same model with the same settings"
        )
        raise PlanMismatchError(msg, ranks=leaders, fields=settings)
    stage_count = len(gathered[0]["parts"]["pipeline_stages"] or [[]])
    missing = [s for s in range(stage_count) if s not in first_rank]
    if missing:
        msg = (
            f"no rank planned pipeline stage(s) {missing} of {stage_count}; run "
            "at least one rank per stage, each planning its own stage"
        )
        raise PlanMismatchError(msg, ranks=[], fields=["pipeline_stage"])
    stages = [
        with_num_blocks(gathered[first_rank[s]]["plan"], num_blocks)
        for s in range(stage_count)
    ]
    problem = line_up_problem([p.kv_cache_groups for p in stages])
    if problem is not None:
        msg = (
            f"the pipeline stages' plans (ranks {leaders}) do not fit one "
            f"scheduler: {problem}; every stage must split and plan the same "
            "model with the same settings"
        )
        raise PlanMismatchError(msg, ranks=leaders, fields=["kv_cache_groups"])
    return PipelinePlan(stages=tuple(stages))


# -- the shipped JSON -------------------------------------------------------


def dump_pipeline_plan(plan: PipelinePlan, registry: KindRegistry | None = None) -> str:
    """The JSON a scheduler ships to its workers: every stage's plan."""
    converter = make_converter(registry)
    return json.dumps(
        {
            "format": PLAN_FORMAT,
            "num_blocks": plan.num_blocks,
            "stages": [converter.unstructure(s) for s in plan.stages],
        },
        indent=1,
    )


def load_pipeline_plan(text: str, registry: KindRegistry | None = None) -> PipelinePlan:
    """The inverse of :func:`dump_pipeline_plan`."""
    given: object = text
    if not isinstance(given, str):
        msg = f"a shipped KV cache plan is JSON text, got {type(given).__name__}"
        raise KvcoreTypeError(msg)
    data = parse_json(text, where="the shipped KV cache plan")
    if (
        not isinstance(data, dict)
        or set(data) != {"format", "num_blocks", "stages"}
        or data["format"] != PLAN_FORMAT
        or not isinstance(data["stages"], list)
        or not data["stages"]
    ):
        msg = (
            f"a shipped KV cache plan must be a JSON object with exactly the keys "
            f"format ({PLAN_FORMAT!r}), num_blocks and a non-empty stages list "
            "(made by kvcore.integrations.distributed.dump_pipeline_plan)"
        )
        raise SerializationError(msg)
    stages = tuple(
        config_from_data(s, registry, where=f"$.stages[{i}]: ")
        for i, s in enumerate(data["stages"])
    )
    counts = [s.num_blocks for s in stages]
    total = data["num_blocks"]
    if type(total) is not int or len({*counts, total}) != 1:
        msg = (
            f"the shipped plan's stages hold {counts} blocks and it says "
            f"num_blocks={echo(data['num_blocks'])}; every stage must hold the same"
        )
        raise SerializationError(msg)
    return PipelinePlan(stages=stages)


# -- the worker ---------------------------------------------------------------


def _spec_fields(spec: KVCacheSpec) -> dict[str, Any]:
    return {f.name: getattr(spec, f.name) for f in attrs.fields(type(spec))}


def check_plan_matches_specs(
    plan: KVCacheConfig, specs: Mapping[str, KVCacheSpec]
) -> None:
    """Refuse a plan that does not place exactly the worker's layers with
    its own specs (a block grown by the planner is the worker's spec's own
    :meth:`~kvcore.spec.KVCacheSpec.grown`)."""
    planned = {n: g.layer_spec(n) for g in plan.kv_cache_groups for n in g.layer_names}
    missing = [n for n in specs if n not in planned]
    extra = [n for n in planned if n not in specs]
    if missing or extra:
        layer = (missing or extra)[0]
        msg = (
            f"the shipped plan (stage {plan.pipeline_stage}) does not place this "
            f"worker's layers: missing {missing[:4]}, not on this worker "
            f"{extra[:4]}; ship the plan of this worker's pipeline stage, made "
            "from the same model file"
        )
        raise WorkerSpecMismatchError(msg, layer=layer, field="layers")
    for name, own in specs.items():
        spec = planned[name]
        if spec == own:
            continue
        factor, rest = divmod(spec.block_size, own.block_size)
        if type(spec) is type(own) and not rest and own.grown(factor) == spec:
            continue
        if type(spec) is not type(own):
            field, ours, theirs = "kind", own.kind, spec.kind
        else:
            mine, shipped = _spec_fields(own), _spec_fields(spec)
            field = next((k for k in mine if mine[k] != shipped[k]), "spec")
            ours, theirs = mine.get(field, own), shipped.get(field, spec)
        msg = (
            f"layer {name!r}: the shipped plan has {field}={theirs!r} but this "
            f"worker's spec has {field}={ours!r}; the scheduler planned another "
            "model or other serving choices (cache dtype, block size, "
            "tensor-parallel size): plan and serve with the same ones"
        )
        raise WorkerSpecMismatchError(msg, layer=name, field=field)


def bind_worker_cache(
    text: str,
    specs: Mapping[str, KVCacheSpec],
    *,
    device: torch.device | str = "cpu",
    registry: KindRegistry | None = None,
) -> KVCachePool:
    """A worker's pool, from the scheduler's shipped JSON alone: the stage
    holding ``specs``' layers is found, checked against ``specs`` and only
    then allocated on ``device``."""
    shipped = load_pipeline_plan(text, registry)
    names = next(iter(specs), None)
    if names is None:
        msg = "a worker with no layers has no KV cache to bind"
        raise WorkerSpecMismatchError(msg, layer=None, field="layers")
    stage = next(
        (s for s, layers in enumerate(shipped.stage_layers) if names in layers),
        0,
    )
    plan = shipped.stages[stage]
    check_plan_matches_specs(plan, specs)
    return KVCachePool(plan, device, registry=registry)
