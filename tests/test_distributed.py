"""Tensor- and pipeline-parallel plans, and agreement over torch.distributed.

The sharding and stage tests run in this process against hand-worked page
sizes.  The agreement tests start real gloo process groups of 2 and 4 ranks
(``torch.multiprocessing`` spawn, tcp on localhost, a free port each), and
the example runs under ``torchrun``; every child writes what it saw to a
file this process checks.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from coordinator_setup import builtin_registry

import kvcore
from kvcore.coordinator import KVCacheManager
from kvcore.errors import KvcoreError, PlanError, SerializationError, UnsafePlanError
from kvcore.integrations import distributed
from kvcore.integrations.distributed import (
    CollectiveError,
    PlanMismatchError,
    WorkerSpecMismatchError,
    agree_plan,
    bind_worker_cache,
    broadcast_text,
    check_agreement,
    check_plan_matches_specs,
    dump_pipeline_plan,
    fingerprint_parts,
    load_pipeline_plan,
    plan_fingerprint,
    plan_local,
)
from kvcore.integrations.stages import (
    PipelinePlan,
    combine_stage_plans,
    line_up_problem,
    plan_pipeline_stages,
    split_pipeline_stages,
    stage_sizes_for,
    with_num_blocks,
)
from kvcore.serialize import load_model_file, make_converter
from kvcore.serving import ServingChoices, apply_serving_choices
from kvcore.structs import KVCacheGroupSpec
from kvcore.tools import zoo
from kvcore_full_attention import FullAttentionSpec
from kvcore_mamba import MambaSpec
from kvcore_sliding_window import SlidingWindowSpec

REGISTRY = builtin_registry()

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
#: How long a whole multi-process scenario may take before it counts as a hang.
DEADLINE_S = 90


def _model(name: str) -> dict[str, kvcore.KVCacheSpec]:
    return dict(load_model_file(zoo.path(name), REGISTRY).layers)


def _served(name: str, tp: int, **choices: Any) -> dict[str, kvcore.KVCacheSpec]:
    choice = ServingChoices(tensor_parallel_size=tp, **choices)
    return dict(apply_serving_choices(_model(name), choice).layers)


def _config(
    tp: int = 1, pp: int = 1, max_model_len: int = 2048, **cache: Any
) -> kvcore.EngineConfig:
    """Short requests and prefill steps, so that small CPU pools admit one."""
    return kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(kv_cache_layout="BLHNC", **cache),
        parallel_config=kvcore.ParallelConfig(
            tensor_parallel_size=tp, pipeline_parallel_size=pp
        ),
        max_model_len=max_model_len,
        max_num_batched_tokens=min(512, max_model_len),
    )


def _short(tp: int) -> kvcore.EngineConfig:
    """Llama plans: requests of 256 tokens fit 33 blocks of 16 tokens."""
    return _config(tp=tp, max_model_len=256)


# -- tensor parallel: hand-worked page sizes ------------------------------------


# Llama-3.1-8B: 8 KV heads of 128, bf16, 16-token blocks; a page is
# heads * 16 tokens * (128 K + 128 V) * 2 bytes = heads * 8192.
# DeepSeek-V3 (MLA): one 576-wide bf16 latent per token, 64-token blocks:
# 64 * 576 * 2 = 73728 on every rank.
# Jamba-1.5-Mini Mamba: conv (3, 8192) + SSM (8192, 16) bf16, channels split:
# (3 * 8192 + 8192 * 16) * 2 = 311296 at TP 1; its attention is Llama's.
@pytest.mark.parametrize(
    ("tp", "gqa_page", "mamba_page", "mamba_shapes"),
    [
        (1, 65536, 311296, ((3, 8192), (8192, 16))),
        (2, 32768, 155648, ((3, 4096), (4096, 16))),
        (4, 16384, 77824, ((3, 2048), (2048, 16))),
    ],
)
def test_tp_sharding_against_hand_worked_pages(
    tp: int, gqa_page: int, mamba_page: int, mamba_shapes: tuple[tuple[int, ...], ...]
) -> None:
    llama = _served("llama-3-1-8b", tp)
    assert {s.page_size_bytes for s in llama.values()} == {gqa_page}
    assert {s.num_kv_heads for s in llama.values()} == {8 // tp}  # type: ignore[attr-defined]

    served = apply_serving_choices(
        _model("deepseek-v3"), ServingChoices(tensor_parallel_size=tp)
    )
    assert {s.page_size_bytes for s in served.layers.values()} == {73728}
    # The latent is whole on every rank, and the served layers say so.
    assert len(served.replicated_layers) == (61 if tp > 1 else 0)

    jamba = _served("jamba-1-5-mini", tp)
    mamba = jamba["model.layers.0.mamba"]
    assert isinstance(mamba, MambaSpec)
    assert mamba.shapes == mamba_shapes
    assert mamba.page_size_bytes == mamba_page
    assert jamba["model.layers.4.self_attn"].page_size_bytes == gqa_page

    # The planner sees one rank's pages: Llama's 32 layers share one block.
    plan = kvcore.plan_kv_cache(_short(tp), llama, 64 * MIB, registry=REGISTRY)
    assert plan.bytes_per_block == 32 * gqa_page
    assert plan.num_blocks == {1: 32, 2: 64, 4: 128}[tp]
    assert plan.tensor_parallel_size == tp


def test_tp_replication_is_recorded() -> None:
    # 2 KV heads over 4 ranks: each rank keeps one head, two ranks hold each.
    gqa = FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=128, dtype=torch.bfloat16
    )
    # A tp_replicated state (Gemma-3n's per-layer embedding) is never split.
    state = MambaSpec(
        block_size=16, shapes=((24,),), dtypes=(torch.bfloat16,), tp_replicated=True
    )
    served = apply_serving_choices(
        {"layers.0.attn": gqa, "layers.0.ple": state},
        ServingChoices(tensor_parallel_size=4),
    )
    assert served.layers["layers.0.attn"].page_size_bytes == 1 * 16 * 256 * 2
    assert served.layers["layers.0.ple"].page_size_bytes == 48
    assert served.replicated_layers == ("layers.0.attn", "layers.0.ple")
    assert gqa.sharded(4).replicas == 2
    assert state.sharded(4).replicas == 4


# -- pipeline stages ----------------------------------------------------------


def test_stage_split_rule() -> None:
    assert stage_sizes_for(32, 2) == [16, 16]
    assert stage_sizes_for(33, 2) == [17, 16]
    # The extra layers go to the stages just before the last.
    assert stage_sizes_for(62, 4) == [15, 16, 16, 15]
    assert stage_sizes_for(61, 4) == [15, 15, 16, 15]
    names = [f"model.layers.{i}.attn" for i in range(5)] + ["model.layers.2.attn.idx"]
    stages = split_pipeline_stages(names, 2)
    # A model layer's cache layers stay on one stage, in model order.
    assert stages == [[*names[:3], names[5]], names[3:5]]
    assert split_pipeline_stages(names, 2, stage_sizes=[1, 4])[0] == names[:1]
    with pytest.raises(PlanError, match=r"stage_sizes \[2, 2\] must give 2"):
        split_pipeline_stages(names, 2, stage_sizes=[2, 2])
    with pytest.raises(PlanError, match="names no model layer index"):
        split_pipeline_stages(["lm_head"], 1)


def test_two_stage_jamba_plans_line_up() -> None:
    specs = _model("jamba-1-5-mini")
    registry = REGISTRY
    whole = kvcore.get_kv_cache_groups(
        _config(packing_policy="seed"), specs, registry=registry
    )
    plans = plan_pipeline_stages(
        _config(pp=2, packing_policy="seed"),
        specs,
        [64 * MIB, 48 * MIB],
        registry=registry,
    )
    s0, s1 = plans.stages
    assert [s0.pipeline_stage, s1.pipeline_stage] == [0, 1]
    assert s0.pipeline_stages == s1.pipeline_stages == plans.stage_layers
    assert plans.stage_layers[0][-1] == "model.layers.15.mamba"
    assert plans.stage_layers[1][0] == "model.layers.16.mamba"
    # seed: 28 single-state Mamba groups and one attention group for the
    # whole model; each stage holds half, so 14 + 1 groups, lined up.
    assert len(whole) == 29
    assert len(s0.kv_cache_groups) == len(s1.kv_cache_groups) == 15
    assert s0.kv_cache_groups[0].layer_names == ["model.layers.0.mamba"]
    assert s1.kv_cache_groups[0].layer_names == ["model.layers.16.mamba"]
    assert s0.kv_cache_groups[14].layer_names == [
        "model.layers.4.self_attn",
        "model.layers.12.self_attn",
    ]
    assert s1.kv_cache_groups[14].layer_names == [
        "model.layers.20.self_attn",
        "model.layers.28.self_attn",
    ]
    # One Mamba state (311296 B) is each stage's widest group; both stages
    # take the smaller stage's count: 48 MiB // 311296 = 161.
    assert s0.bytes_per_block == s1.bytes_per_block == 311296
    assert plans.num_blocks == s0.num_blocks == s1.num_blocks == 161
    assert s0.kv_cache_tensors[0].size == 161 * 311296
    scheduler = plans.scheduler_config()
    assert len(scheduler.kv_cache_groups) == 15
    assert scheduler.kv_cache_groups[14].layer_names == [
        f"model.layers.{i}.self_attn" for i in (4, 12, 20, 28)
    ]
    assert scheduler.kv_cache_tensors == []
    manager = KVCacheManager.from_plan(scheduler, registry=registry)
    assert manager.num_kv_cache_groups == 15
    assert plans.stage_of("model.layers.20.self_attn") == 1


def test_two_stage_min_waste_and_groups_that_cannot_line_up() -> None:
    registry = REGISTRY
    plans = plan_pipeline_stages(
        _config(pp=2), _model("jamba-1-5-mini"), 64 * MIB, registry=registry
    )
    # Each stage: 7 groups of two Mamba states and one of its 2 attention
    # layers grown to 80-token blocks (min_waste), so stages line up in 8.
    for plan in plans.stages:
        assert [len(g.layer_names) for g in plan.kv_cache_groups] == [2] * 8
        assert plan.kv_cache_groups[7].kv_cache_spec.block_size == 80
    # Gemma-3 in 4 stages of 15/16/16/15 layers: the stages' own min_waste
    # plans have different group counts, and the whole model's groups leave
    # stage 0 without some, so kvcore refuses rather than pad.
    with pytest.raises(PlanError, match="do not line up: planned per stage, stage 0"):
        plan_pipeline_stages(
            _config(pp=4), _model("gemma-3-27b"), 64 * MIB, registry=registry
        )


def test_groups_that_do_not_line_up_are_named_in_a_few_words() -> None:
    full = FullAttentionSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
    )
    wide = attrs.evolve(full, head_size=256)
    window = SlidingWindowSpec(
        block_size=16,
        num_kv_heads=8,
        head_size=128,
        dtype=torch.bfloat16,
        sliding_window=1024,
    )

    def stages(*specs: Any) -> list[list[KVCacheGroupSpec]]:
        return [
            [KVCacheGroupSpec([f"model.layers.{i}.attn"], s)]
            for i, s in enumerate(specs)
        ]

    assert line_up_problem(stages(window, full)) == (
        "group 0 runs sliding_window (block 16) on stage 0 but full_attention "
        "(block 16) on stage 1"
    )
    assert line_up_problem(stages(full, wide)) == (
        "group 0 runs full_attention (block 16) with head_size=128 on stage 0 but "
        "full_attention (block 16) with head_size=256 on stage 1"
    )
    assert line_up_problem(stages(full, full)) is None


# -- the worker's check ----------------------------------------------------------


def test_worker_binds_from_json_and_refuses_other_specs() -> None:
    registry = REGISTRY
    specs = _served("llama-3-1-8b", 2)
    plan = plan_local(_short(2), specs, 40 * MIB, registry=registry)
    text = dump_pipeline_plan(PipelinePlan(stages=(plan,)), registry)
    assert load_pipeline_plan(text, registry).stages == (plan,)
    pool = bind_worker_cache(text, specs, registry=registry)
    view = pool.views["model.layers.31.self_attn"]
    assert isinstance(view, torch.Tensor)
    assert tuple(view.shape) == (40, 4, 16, 256)  # 40 MiB / 1 MiB blocks
    assert view.dtype == torch.bfloat16
    # A worker serving TP 1 (8 heads) must not bind a TP 2 plan.
    with pytest.raises(WorkerSpecMismatchError) as info:
        bind_worker_cache(text, _served("llama-3-1-8b", 1), registry=registry)
    assert info.value.layer == "model.layers.0.self_attn"
    assert info.value.field == "num_kv_heads"
    assert "num_kv_heads=4" in str(info.value)
    assert "num_kv_heads=8" in str(info.value)
    assert isinstance(info.value, KvcoreError)
    assert isinstance(info.value, ValueError)
    fewer = dict(list(specs.items())[:31])
    with pytest.raises(WorkerSpecMismatchError, match="not on this worker"):
        check_plan_matches_specs(plan, fewer)


# -- fingerprints and the shipped JSON ---------------------------------------------


def test_fingerprint_ignores_memory_and_names_what_differs() -> None:
    registry = REGISTRY
    specs = _served("llama-3-1-8b", 2)
    a = plan_local(_short(2), specs, 64 * MIB, registry=registry)
    b = plan_local(_short(2), specs, 40 * MIB, registry=registry)
    # Block counts and memory are reconciled, not compared.
    assert plan_fingerprint(a, registry) == plan_fingerprint(b, registry)
    assert len(plan_fingerprint(a, registry)) == 64
    fp8 = plan_local(
        _short(2),
        _served("llama-3-1-8b", 2, kv_cache_dtype="fp8"),
        64 * MIB,
        registry=registry,
    )
    assert plan_fingerprint(fp8, registry) != plan_fingerprint(a, registry)
    parts, other = fingerprint_parts(a, registry), fingerprint_parts(fp8, registry)
    assert [k for k in parts if parts[k] != other[k]] == [
        "groups",
        "page_sizes",
        "bytes_per_block",
    ]


def test_the_odd_rank_out_is_named() -> None:
    def record(fingerprint: str, page: int) -> dict[str, Any]:
        parts = {"page_sizes": {"l.0": page}, "max_model_len": 256}
        return {"stage": 0, "fingerprint": fingerprint, "parts": parts}

    # Ranks 0, 2 and 3 agree; rank 1 is named, against rank 0.
    gathered = [record("a", 8), record("b", 4), record("a", 8), record("a", 8)]
    with pytest.raises(PlanMismatchError) as info:
        check_agreement(gathered)
    assert info.value.ranks == (1,)
    assert info.value.fields == ("page_sizes",)
    assert "rank 1 planned stage 0 differently from rank 0" in str(info.value)
    assert "page_sizes of layer 'l.0': 8 vs 4" in str(info.value)
    # Rank 0 is the odd one out of three: it is the one named.
    with pytest.raises(PlanMismatchError) as info:
        check_agreement([record("b", 4), record("a", 8), record("a", 8)])
    assert info.value.ranks == (0,)


def _hostile_shipped_plans(good: dict[str, Any]) -> None:
    """Every way a shipped plan could bind aliasing or broken views is
    refused with a kvcore error naming the stage and the field."""
    registry = REGISTRY
    text = json.dumps(good)

    def edited(change: Any) -> str:
        data = json.loads(text)
        change(data["stages"][0])
        return json.dumps(data)

    def tensor(field: str, value: Any) -> Any:
        return lambda stage: stage["kv_cache_tensors"][0].__setitem__(field, value)

    def second_group_layer(stage: dict[str, Any]) -> None:
        groups = stage["kv_cache_groups"]
        groups[-1]["layer_names"].append(groups[0]["layer_names"][0])

    def tensor_twice(stage: dict[str, Any]) -> None:
        stage["kv_cache_tensors"].append(stage["kv_cache_tensors"][0])

    first = good["stages"][0]["kv_cache_tensors"][0]
    cases = {
        "layer stride 0": (tensor("layer_stride", 0), UnsafePlanError),
        "half-page layer stride": (
            tensor("layer_stride", first["layer_stride"] // 2),
            UnsafePlanError,
        ),
        "block stride 0": (tensor("block_stride", 0), UnsafePlanError),
        "a layer in two groups": (second_group_layer, SerializationError),
        "a tensor listed twice": (tensor_twice, UnsafePlanError),
        "bytes_per_block 0": (
            lambda stage: stage.__setitem__("bytes_per_block", 0),
            SerializationError,
        ),
        "bytes_per_block -1": (
            lambda stage: stage.__setitem__("bytes_per_block", -1),
            SerializationError,
        ),
    }
    for name, (change, error) in cases.items():
        with pytest.raises(error, match=r"^\$\.stages\[0\]: ") as info:
            load_pipeline_plan(edited(change), registry)
        assert isinstance(info.value, KvcoreError), name
    with pytest.raises(SerializationError, match="appears twice"):
        load_pipeline_plan(
            text.replace('"format"', '"format": 1, "format"', 1), registry
        )
    with pytest.raises(SerializationError, match="nest"):
        load_pipeline_plan("[" * 100_000, registry)
    with pytest.raises(KvcoreError, match="JSON text"):
        load_pipeline_plan(b"{}", registry)  # type: ignore[arg-type]


def test_shipped_json_is_checked() -> None:
    registry = REGISTRY
    with pytest.raises(SerializationError, match="is not valid JSON"):
        load_pipeline_plan("{", registry)
    with pytest.raises(SerializationError, match="a non-empty stages list"):
        load_pipeline_plan(json.dumps({"format": "x", "stages": []}), registry)
    plans = plan_pipeline_stages(
        _config(pp=2), _model("jamba-1-5-mini"), 64 * MIB, registry=registry
    )
    data = json.loads(dump_pipeline_plan(plans, registry))
    assert load_pipeline_plan(json.dumps(data), registry) == plans
    data["num_blocks"] = 7
    with pytest.raises(SerializationError, match="it says num_blocks=7"):
        load_pipeline_plan(json.dumps(data), registry)
    # A count that is not an int (a list cannot even be compared as one).
    for bad in ([], True, float(plans.num_blocks), str(plans.num_blocks)):
        data["num_blocks"] = bad
        with pytest.raises(SerializationError, match="it says num_blocks="):
            load_pipeline_plan(json.dumps(data), registry)
    _hostile_shipped_plans(json.loads(dump_pipeline_plan(plans, registry)))
    # Stages of different block counts cannot share one scheduler.
    shrunk = (plans.stages[0], with_num_blocks(plans.stages[1], 100))
    with pytest.raises(PlanError, match="stage 1 has 100 blocks but stage 0 has"):
        combine_stage_plans(shrunk)
    # Nor can stages (or workers) planned with different settings.
    longer = attrs.evolve(plans.stages[1], max_model_len=8192)
    with pytest.raises(PlanError) as info:
        combine_stage_plans((plans.stages[0], longer))
    assert str(info.value) == (
        f"stage 1 planned max_model_len=8192 but stage 0 planned "
        f"{plans.stages[0].max_model_len}; every stage must plan with the same "
        "settings"
    )
    with pytest.raises(PlanError, match="worker 1 planned max_model_len=8192 but"):
        kvcore.generate_scheduler_kv_cache_config([plans.stages[1], longer])
    with pytest.raises(PlanError, match="can only shrink to between 2 and"):
        with_num_blocks(plans.stages[0], plans.num_blocks + 1)


# -- real process groups -----------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _error(exc: BaseException) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "ranks": list(getattr(exc, "ranks", [])),
        "fields": list(getattr(exc, "fields", [])),
        "kvcore": isinstance(exc, KvcoreError),
    }


def _record(plan: kvcore.KVCacheConfig, fingerprint: str) -> bytes:
    """A rank's record as agree_plan sends it, under any fingerprint."""
    converter = make_converter(REGISTRY)
    record = {
        "stage": plan.pipeline_stage or 0,
        "num_blocks": plan.num_blocks,
        "fingerprint": fingerprint,
        "config": converter.unstructure(plan),
    }
    return json.dumps(record, sort_keys=True).encode()


def _lies(plan: kvcore.KVCacheConfig, registry: kvcore.KindRegistry) -> list[bytes]:
    """Garbage, then a plan that may alias and a valid plan of another cache
    dtype, each claiming the honest plan's fingerprint."""
    honest = plan_fingerprint(plan, registry)
    tensor = plan.kv_cache_tensors[0]
    aliasing = attrs.evolve(
        plan, kv_cache_tensors=[attrs.evolve(tensor, layer_stride=0)]
    )
    other = plan_local(
        _short(2),
        _served("llama-3-1-8b", 2, kv_cache_dtype="fp8"),
        64 * MIB,
        registry=registry,
    )
    return [b"\xff\xfe not json", _record(aliasing, honest), _record(other, honest)]


def test_checked_records_refuse_liars_and_garbage() -> None:
    registry = REGISTRY
    plan = plan_local(
        _short(2), _served("llama-3-1-8b", 2), 64 * MIB, registry=registry
    )
    honest = _record(plan, plan_fingerprint(plan, registry))
    (record,) = distributed.checked_records([honest], registry)
    assert record["fingerprint"] == plan_fingerprint(plan, registry)
    assert record["plan"] == plan
    garbage, aliasing, other = _lies(plan, registry)
    expected = {
        0: "UnicodeDecodeError",
        1: "overlap one another",
        2: "claims fingerprint, stage and blocks",
    }
    for i, lie in enumerate((garbage, aliasing, other)):
        with pytest.raises(PlanMismatchError, match=expected[i]) as info:
            distributed.checked_records([honest, lie], registry)
        assert (info.value.ranks, info.value.fields) == ((1,), ("record",))
    hostile = [
        b"",
        b"[]",
        b"{}",
        b'{"stage": 0}',
        b"[" * 10_000,
        b'{"stage":0,"num_blocks":1,"fingerprint":"x","config":{},"config":{}}',
        honest.replace(b'"num_blocks": ', b'"num_blocks": 1'),
        honest.replace(b'"stage": 0', b'"stage": 1'),
        honest + b"x",
    ]
    for data in hostile:
        with pytest.raises(PlanMismatchError, match="rank 0 sent a plan record"):
            distributed.checked_records([data], registry)


def _scenario_agree(
    rank: int, timeout: datetime.timedelta, out_file: str
) -> dict[str, Any]:
    """Two ranks: equal plans, a rank with less memory, shipping, a mismatch."""
    registry = REGISTRY
    specs = _served("llama-3-1-8b", 2)
    out: dict[str, Any] = {}
    equal = plan_local(_short(2), specs, 64 * MIB, registry=registry)
    agreed = agree_plan(equal, timeout=timeout, registry=registry)
    out["equal"] = [equal.num_blocks, agreed.num_blocks, plan_fingerprint(equal)]
    memory = 64 * MIB if rank == 0 else 40 * MIB
    local = plan_local(_short(2), specs, memory, registry=registry)
    agreed = agree_plan(local, timeout=timeout, registry=registry)
    text = broadcast_text(
        dump_pipeline_plan(agreed, registry) if rank == 0 else None, timeout=timeout
    )
    pool = bind_worker_cache(text, specs, registry=registry)
    out["less"] = [local.num_blocks, agreed.num_blocks, pool.buffer.numel()]
    out["shipped_is_local"] = text == dump_pipeline_plan(agreed, registry)
    other = _served("llama-3-1-8b", 2, kv_cache_dtype="fp8") if rank == 1 else specs
    mine = plan_local(_short(2), other, 64 * MIB, registry=registry)
    try:
        agree_plan(mine, timeout=timeout, registry=registry)
    except PlanMismatchError as exc:
        out["mismatch"] = _error(exc)
    # Rank 1 lies: garbage, then an aliasing plan and an fp8 plan, each
    # sent under the fingerprint of its honest plan. Rank 0 calls agree_plan.
    lies = _lies(equal, registry)
    out["lied"] = []
    for lie in lies:
        if rank == 1:
            distributed._all_gather_bytes(lie, None, timeout, "a liar's record")
            continue
        try:
            agree_plan(equal, timeout=timeout, registry=registry)
        except PlanMismatchError as exc:
            out["lied"].append(_error(exc))
    # Last, rank 1 is slower than rank 0's timeout: rank 0 raises.
    if rank == 1:
        time.sleep(3)
        return out
    try:
        agree_plan(equal, timeout=datetime.timedelta(seconds=1), registry=registry)
    except CollectiveError as exc:
        out["slow"] = _error(exc)
    return out


def _scenario_pipeline(
    rank: int, timeout: datetime.timedelta, out_file: str
) -> dict[str, Any]:
    """Four ranks, TP 2 x PP 2 of Jamba: ranks 0, 1 run stage 0."""
    registry = REGISTRY
    specs = _served("jamba-1-5-mini", 2)
    stage = rank // 2
    local = plan_local(
        _config(tp=2, pp=2), specs, (64 - rank) * MIB, stage=stage, registry=registry
    )
    agreed = agree_plan(local, timeout=timeout, registry=registry)
    scheduler = agreed.scheduler_config()
    out: dict[str, Any] = {
        "local": local.num_blocks,
        "agreed": agreed.num_blocks,
        "stage_layers": [len(s) for s in agreed.stage_layers],
        "groups": [len(s.kv_cache_groups) for s in agreed.stages],
        "scheduler_groups": [g.layer_names for g in scheduler.kv_cache_groups],
        "document": dump_pipeline_plan(agreed, registry),
    }
    # Rank 3 serves another max_model_len than its stage peer, rank 2.
    config = _config(tp=2, pp=2)
    if rank == 3:
        config.max_model_len = 1024
    mine = plan_local(config, specs, 64 * MIB, stage=stage, registry=registry)
    try:
        agree_plan(mine, timeout=timeout, registry=registry)
    except PlanMismatchError as exc:
        out["mismatch"] = _error(exc)
    # Stage 1 (ranks 2 and 3) serves another max_model_len than stage 0.
    config = _config(
        tp=2, pp=2, max_model_len=1024 if stage else 2048, target_context=2048
    )
    mine = plan_local(config, specs, 64 * MIB, stage=stage, registry=registry)
    try:
        agree_plan(mine, timeout=timeout, registry=registry)
    except PlanMismatchError as exc:
        out["stages_differ"] = _error(exc)
    # Last, rank 3 dies before the next collective; the others must raise.
    if rank == 3:
        Path(out_file).write_text(json.dumps(out))
        os._exit(0)  # a clean exit: the spawner leaves the others running
    try:
        agree_plan(local, timeout=timeout, registry=registry)
    except CollectiveError as exc:
        out["dead"] = _error(exc)
    return out


SCENARIOS = {"agree": _scenario_agree, "pipeline": _scenario_pipeline}


def _child(rank: int, world: int, port: int, scenario: str, out_dir: str) -> None:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=10)
    result: dict[str, Any]
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timeout,
        )
        result = SCENARIOS[scenario](rank, timeout, str(Path(out_dir, f"{rank}.json")))
    except BaseException as exc:  # the parent reports it
        result = {"crash": _error(exc), "traceback": traceback.format_exc()}
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    # Skip teardown: a dead peer can make a clean shutdown wait.
    os._exit(0)


def _run(scenario: str, world: int, tmp_path: Path) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``world`` spawned ranks; every rank's result."""
    import torch.multiprocessing as mp

    out = tmp_path / scenario
    out.mkdir()
    context = mp.start_processes(
        _child,
        args=(world, _free_port(), scenario, str(out)),
        nprocs=world,
        start_method="spawn",
        join=False,
    )
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"{scenario}: the ranks hung past {DEADLINE_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    results = []
    for rank in range(world):
        path = out / f"{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {})
    for rank, result in enumerate(results):
        assert "crash" not in result, f"rank {rank}: {result.get('traceback')}"
    return results


def test_two_ranks_agree(tmp_path: Path) -> None:
    r0, r1 = _run("agree", 2, tmp_path)
    # Equal plans: 64 MiB of 1 MiB blocks (32 layers x 32768 B) on each.
    assert r0["equal"] == r1["equal"]
    assert r0["equal"][:2] == [64, 64]
    # Rank 1 has 40 MiB: both run its 40 blocks, and bind 40 MiB pools.
    assert r0["less"] == [64, 40, 40 * MIB]
    assert r1["less"] == [40, 40, 40 * MIB]
    assert r0["shipped_is_local"]
    assert r1["shipped_is_local"]
    # Rank 1 serves an fp8 cache: both ranks raise the same error.
    assert r0["mismatch"] == r1["mismatch"]
    # Each lie gives the honest rank a PlanMismatchError naming rank 1.
    assert [(e["type"], e["ranks"], e["fields"]) for e in r0["lied"]] == [
        ("PlanMismatchError", [1], ["record"])
    ] * 3
    assert "overlap one another" in r0["lied"][1]["message"]
    assert "claims fingerprint" in r0["lied"][2]["message"]
    error = r0["mismatch"]
    assert error["kvcore"]
    assert error["ranks"] == [1]
    assert {"page_sizes", "groups", "bytes_per_block"} <= set(error["fields"])
    assert "rank 1 planned stage 0 differently from rank 0" in error["message"]
    assert (
        "page_sizes of layer 'model.layers.0.self_attn': 32768 vs 16384"
        in error["message"]
    )
    slow = r0["slow"]
    assert slow["type"] == "CollectiveError"
    assert "did not complete within 1 s" in slow["message"]


@pytest.fixture(scope="module")
def pipeline_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One run of four ranks (TP 2 x PP 2), read by the tests below."""
    return _run("pipeline", 4, tmp_path_factory.mktemp("ranks"))


@pytest.mark.slow  # four spawned ranks (the default run spawns two, above)
def test_four_ranks_tp2_pp2(pipeline_ranks: list[dict[str, Any]]) -> None:
    results = pipeline_ranks
    # Rank r has (64 - r) MiB; a stage of 16 Jamba layers at TP 2 is 7 pairs
    # of Mamba states (2 x 155648 B) and its attention pair grown to 80-token
    # blocks (2 x 5 x 32768 B), the widest: 327680 B a block, so rank 3's
    # 61 MiB hold 195 blocks, the fewest.
    assert [r["local"] for r in results] == [204, 201, 198, 195]
    assert {r["agreed"] for r in results} == {195}
    assert {r["document"] for r in results} == {results[0]["document"]}
    assert results[0]["stage_layers"] == [16, 16]
    assert results[0]["groups"] == [8, 8]
    groups = results[0]["scheduler_groups"]
    # A stage's 14 Mamba layers split strided into 7 pairs: the 1st and 8th
    # (layers 0 and 8 on stage 0, 16 and 24 on stage 1) share group 0.
    assert groups[0] == [
        "model.layers.0.mamba",
        "model.layers.8.mamba",
        "model.layers.16.mamba",
        "model.layers.24.mamba",
    ]
    assert groups[7] == [f"model.layers.{i}.self_attn" for i in (4, 12, 20, 28)]
    errors = [r["mismatch"] for r in results]
    assert all(e == errors[0] for e in errors)
    assert errors[0]["ranks"] == [3]
    assert "max_model_len" in errors[0]["fields"]
    assert "rank 3 planned stage 1 differently from rank 2" in errors[0]["message"]
    # A whole stage serving other settings: every rank names the stages' leaders.
    errors = [r["stages_differ"] for r in results]
    assert all(e == errors[0] for e in errors)
    assert errors[0]["ranks"] == [0, 2]
    assert errors[0]["fields"] == ["max_model_len"]
    assert "they differ in max_model_len" in errors[0]["message"]


@pytest.mark.slow  # the four ranks above, and a 10 s timeout
def test_a_dead_rank_gives_an_error_not_a_hang(
    pipeline_ranks: list[dict[str, Any]],
) -> None:
    # Rank 3 exited before the last agreement; each of the others raised
    # (its own peer's connection closed, or the timeout passed).
    for rank in range(3):
        error = pipeline_ranks[rank]["dead"]
        assert error["type"] == "CollectiveError"
        assert error["kvcore"]
        assert f"rank {rank}: the " in error["message"]
        assert "over 4 ranks did not complete within 10 s" in error["message"]
    assert "dead" not in pipeline_ranks[3]


def _run_engine_example(ranks: int, *args: str) -> str:
    """``examples/engine_integration.py`` under torchrun: its output."""
    env = dict(os.environ)
    paths = [str(ROOT), str(ROOT / "plugins")]
    env["PYTHONPATH"] = os.pathsep.join(
        paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env["OMP_NUM_THREADS"] = "1"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(ranks),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        str(ROOT / "examples" / "engine_integration.py"),
        *args,
    ]
    done = subprocess.run(
        command,
        env=env,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow  # torchrun and two more ranks
def test_engine_integration_example_under_torchrun() -> None:
    out = _run_engine_example(2)
    # 64 and 63 MiB of 655360-byte blocks: 102 and 100; both run 100.
    assert "rank 0 (stage 0, TP 2): planned 102 blocks, agreed 100" in out
    assert "rank 1 (stage 0, TP 2): planned 100 blocks, agreed 100" in out
    assert "prefix hit of the second request: 960 tokens" in out


@pytest.mark.slow  # torchrun
def test_engine_integration_example_keeps_its_prompt_within_max_model_len() -> None:
    """DeepSeek-V4's 2,048-token scheduler blocks: 12 of them would pass
    max_model_len=8192; the example shares 3 and the second request hits
    all 6,144 tokens."""
    out = _run_engine_example(
        1, "--model", "deepseek-v4-flash", "--memory-mib", "256",
        "--max-model-len", "8192",
    )  # fmt: skip
    assert "prefix hit of the second request: 6144 tokens" in out
