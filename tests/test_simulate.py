"""``kvcore simulate``: the scheduler loop over the real coordinator, its
workloads and trace files, and the command."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from coordinator_setup import one_layer_plan

import kvcore
from kvcore.errors import KvcoreValueError, PlanError
from kvcore.plan.capacity import ideal_bytes_per_request
from kvcore.serialize import load_model_file
from kvcore.tools import zoo
from kvcore.tools.cli import main
from kvcore.tools.simulate import (
    Distribution,
    DistributionError,
    Driver,
    SimulationError,
    TraceError,
    Workload,
    WorkloadError,
    WorkloadRequest,
    load_trace,
    parse_distribution,
    parse_trace,
    synthetic_workload,
    token_stream,
)

# -- a hand-built plan ------------------------------------------------------------


def _tiny_plan(num_blocks: int = 9, *, caching: bool = True) -> kvcore.KVCacheConfig:
    """One full-attention layer, 4-token blocks of 128 bytes, ``num_blocks``
    blocks (block 0 the null block), max_model_len 32, 8 tokens a step."""
    return one_layer_plan(
        4, num_blocks, max_model_len=32, step_tokens=8, caching=caching
    )


A = list(range(1, 13))
HAND_TRACE = [
    json.dumps({"id": "A", "prompt": A, "output_len": 6}),
    json.dumps(
        {"id": "B", "prompt": [*A[:8], 100, 101, 102, 103, 104], "output_len": 4}
    ),
    json.dumps({"id": "C", "prompt": list(range(200, 209)), "output_len": 1}),
]


def test_a_hand_worked_trace() -> None:
    # 8 usable blocks of 4 tokens, 8 tokens a step, one prefill at a time.
    # A: 12 prompt tokens, 6 out (computes 17).  B: A's first 8 tokens + 5
    # (13), 4 out.  C: 9 unique tokens, 1 out.  Blocks in use after each
    # step's allocation:
    # step 0: A prefills 8 (2 blocks).                                    2
    # step 1: A prefills 4 -> 12 (3 blocks), samples o1; A was still in
    #         prefill, so B waits.                                        3
    # step 2: A decodes -> 13 (4 blocks).  B looks up 13 tokens: A's two
    #         cached blocks hit 8; B computes 5 (2 new blocks).          6
    # step 3: A, B decode (14, no block).  C admitted with the 6 tokens
    #         left: 2 blocks.                                             8
    # step 4: A, B decode (15).  C's last 3 tokens need a third block: the
    #         pool is full, refused; the newest running request is C
    #         itself: preempted (1 refused step, 1 preemption).  A step
    #         that preempted admits nothing (as vLLM's scheduler), so C
    #         waits.                                                      6
    # step 5: A decodes (16), B decodes (16) and finishes; C looks up
    #         again: its first block is still cached (hit 4), but that
    #         free block plus 2 new ones are 3 > 2 free before B is freed:
    #         refused (A, B run, so it waits).                            6
    # step 6: A decodes -> 17 (5th block) and finishes; C hits 4, takes 2
    #         new blocks, computes 5 tokens and finishes.                 8
    # Lookups: A 12 + B 13 + C 9 + C 9 = 43 tokens, hits 8 + 4 = 12; C's
    # second lookup (9 tokens, hit 4) is a re-admission, so first
    # admissions looked up 34 and hit 8.
    # The token-level bound: B shares 8 tokens with A's 12 computed ones; C
    # shares none at first, and at its re-admission its own 6 tokens
    # computed at step 3: 0 + 8 + 0 + 6 = 14.
    # Blocks: peak 8, mean (2+3+6+8+6+6+8)/7 = 39/7.
    plan = _tiny_plan()
    driver = Driver(plan, validate=True)
    result = driver.run(parse_trace(HAND_TRACE))
    assert result.steps == 7
    assert result.completed == 3
    assert result.tokens_generated == 6 + 4 + 1
    assert result.computed_tokens == 17 + 8 + 11
    assert (result.prompt_tokens_looked_up, result.prefix_hit_tokens) == (43, 12)
    assert result.prefix_hit_rate == 12 / 43
    assert (result.readmitted_tokens_looked_up, result.readmitted_hit_tokens) == (9, 4)
    assert result.first_admission_hit_rate == 8 / 34
    assert result.token_bound_tokens == 14
    assert (result.checked_hits, result.invalid_hits) == (2, 0)
    assert (result.refused_steps, result.preemptions) == (1, 1)
    assert result.admission_refusals == 1
    assert result.peak_running == 3
    assert (result.num_blocks, result.peak_blocks_in_use) == (9, 8)
    assert result.mean_blocks_in_use == 39 / 7
    [group] = result.groups
    assert (group.kinds, group.block_size) == (("full_attention",), 4)
    assert (group.peak_blocks, group.mean_blocks) == (8, 39 / 7)
    assert result.unserved == ()
    assert result.unfinished == ()
    assert driver.manager is not None
    assert driver.manager.get_num_free_blocks() == plan.num_blocks - 1


def test_without_prefix_caching_nothing_hits() -> None:
    # The same trace: B recomputes A's 8 tokens, so it needs 4 blocks of its
    # own and nothing is shared.
    plan = _tiny_plan(caching=False)
    driver = Driver(plan)
    result = driver.run(parse_trace(HAND_TRACE))
    assert result.prefix_hit_tokens == 0
    assert result.completed == 3
    assert result.tokens_generated == 11
    assert driver.manager is not None
    assert driver.manager.get_num_free_blocks() == plan.num_blocks - 1


def test_a_turn_hits_its_parents_prompt_and_output() -> None:
    # The parent (10 prompt tokens, 3 out) computes 12 tokens: 3 cached
    # blocks.  The turn is those 10 + the 3 outputs + 5 new = 18 tokens; its
    # 13th token (output 3) was never computed, so it hits 12.  The turn
    # arrives at step 0 but waits for its parent (prefill of 8 then 2 at
    # steps 0 and 1, decodes at 2 and 3), then prefills 6 at step 4 and
    # decodes at step 5.
    lines = [
        json.dumps({"id": "p", "prompt": list(range(10)), "output_len": 3}),
        json.dumps({"id": "t", "parent": "p", "prompt_len": 5, "output_len": 2}),
    ]
    workload = parse_trace(lines)
    parent, turn = workload.requests
    assert turn.prompt == parent.prompt + parent.output + turn.prompt[13:]
    assert len(turn.prompt) == 18
    result = Driver(_tiny_plan(), validate=True).run(workload)
    assert (result.prompt_tokens_looked_up, result.prefix_hit_tokens) == (28, 12)
    # The bound: the parent's 12 computed tokens; the hit reaches it.
    assert result.token_bound_tokens == 12
    assert result.invalid_hits == 0
    assert result.steps == 6
    assert result.computed_tokens == 12 + 6 + 1


def test_a_request_that_never_fits_is_reported_not_looped_on() -> None:
    # 8 usable blocks hold 32 tokens: "big" (30 prompt + 6 out computes 35)
    # prefills, is refused while alone, and is dropped; "long" is past
    # max_model_len=32 at arrival; "ok" runs.
    lines = [
        json.dumps({"id": "big", "prompt_len": 30, "output_len": 6}),
        json.dumps({"id": "long", "prompt_len": 30, "output_len": 4}),
        json.dumps({"id": "ok", "prompt_len": 5, "output_len": 2}),
    ]
    plan = _tiny_plan()
    driver = Driver(plan, max_model_len=64)
    result = driver.run(parse_trace(lines))
    # With max_model_len 64 "long" (computes 33) is refused by the pool too.
    assert [u.id for u in result.unserved] == ["big", "long"]
    assert all("no other request to preempt" in u.reason for u in result.unserved)
    assert result.completed == 1
    strict = Driver(plan)
    result = strict.run(parse_trace(lines))
    assert {u.id: u.reason for u in result.unserved} == {
        "big": "it computes 35 tokens, past max_model_len=32",
        "long": "it computes 33 tokens, past max_model_len=32",
    }
    assert result.completed == 1
    assert strict.manager is not None
    assert strict.manager.get_num_free_blocks() == plan.num_blocks - 1


def test_max_steps_reports_what_is_left() -> None:
    plan = _tiny_plan()
    driver = Driver(plan, max_steps=3)
    result = driver.run(parse_trace(HAND_TRACE))
    assert result.steps == 3
    assert result.completed == 0
    assert result.unfinished == ("A", "B", "C")
    assert driver.manager is not None
    assert driver.manager.get_num_free_blocks() == plan.num_blocks - 1


def test_driver_settings_are_checked() -> None:
    plan = _tiny_plan()
    with pytest.raises(SimulationError, match="max_num_batched_tokens") as info:
        Driver(plan, max_num_batched_tokens=0)
    assert isinstance(info.value, ValueError)
    with pytest.raises(SimulationError, match="max_partial_prefills"):
        Driver(plan, max_partial_prefills=0)


# -- agreement with the capacity model ---------------------------------------------


@pytest.mark.parametrize(("context", "chunk"), [(1000, 4096), (4096, 2048)])
@pytest.mark.parametrize("name", zoo.names())
def test_keeping_finished_requests_fills_to_the_capacity_model(
    zoo_registry: kvcore.KindRegistry, name: str, context: int, chunk: int
) -> None:
    """Requests of ``context`` tokens (prompt ``context - 1``, 2 out: the
    decode computes the last token) that keep their blocks when finished
    are the capacity model's picture: exactly ``concurrency`` complete."""
    specs = load_model_file(zoo.path(name), zoo_registry).layers
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout="BLHNC", target_context=context, enable_prefix_caching=True
        ),
        max_model_len=context,
        max_num_batched_tokens=chunk,
    )
    # Memory for a handful of requests, so the run ends in a few steps.
    memory = 5 * ideal_bytes_per_request(specs, context) + 3 * 2**20
    while True:
        plan = kvcore.plan_kv_cache(config, specs, memory, registry=zoo_registry)
        capacity = kvcore.plan_capacity(plan, context, max_num_batched_tokens=chunk)
        if capacity.concurrency >= 3:
            break
        memory *= 2
    n = capacity.concurrency + 2
    workload = Workload.of(
        WorkloadRequest(f"r{i}", 0, tuple(token_stream(f"r{i}", context - 1)), (1, 2))
        for i in range(n)
    )
    driver = Driver(
        plan, registry=zoo_registry, max_num_batched_tokens=chunk, keep_finished=True
    )
    result = driver.run(workload)
    assert result.completed == capacity.concurrency
    assert len(result.unserved) == 2
    assert driver.manager is not None
    assert driver.manager.get_num_free_blocks() == plan.num_blocks - 1


@pytest.mark.parametrize("name", zoo.names())
def test_groups_add_up_to_the_pool_and_preemption_leaks_nothing(
    zoo_registry: kvcore.KindRegistry, name: str
) -> None:
    specs = load_model_file(zoo.path(name), zoo_registry).layers
    config = kvcore.EngineConfig(
        cache_config=kvcore.CacheConfig(
            kv_cache_layout="BLHNC", target_context=4096, enable_prefix_caching=True
        ),
        max_model_len=4096,
        max_num_batched_tokens=1024,
    )
    # About one request's memory (raised to what one 4096-token request
    # needs), so requests contend for blocks.
    memory = ideal_bytes_per_request(specs, 4096) + 3 * 2**20
    while True:
        try:
            plan = kvcore.plan_kv_cache(config, specs, memory, registry=zoo_registry)
            break
        except PlanError:
            memory = memory * 5 // 4
    # Turns of at most 300 + 2 * (800 + 400) tokens: all fit alone.
    workload = synthetic_workload(
        12,
        prompt_len="100-800",
        output_len="50-400",
        shared_prefixes=2,
        prefix_len=300,
        turns=2,
        seed=3,
    )
    driver = Driver(plan, registry=zoo_registry, validate=True)
    result = driver.run(workload)
    assert result.completed == 12
    # Every hit serves the request its own tokens, and none beats the
    # token-level bound.
    assert result.invalid_hits == 0, result.invalid_hit_reports
    assert result.token_bound_tokens >= result.prefix_hit_tokens
    # Every refused step preempted a request (none was dropped).
    assert result.refused_steps == result.preemptions
    assert result.tokens_generated == workload.output_tokens
    # Every block in use sits in exactly one group's tables.
    assert sum(g.mean_blocks for g in result.groups) == pytest.approx(
        result.mean_blocks_in_use
    )
    assert sum(g.peak_blocks for g in result.groups) >= result.peak_blocks_in_use
    assert driver.manager is not None
    assert driver.manager.get_num_free_blocks() == plan.num_blocks - 1
    # Unvalidated, the group listing the most blocks is counted by
    # difference (validated, every group is counted): the same figures.
    plain = Driver(plan, registry=zoo_registry).run(workload)
    assert plain.groups == result.groups
    assert plain.prefix_hit_tokens == result.prefix_hit_tokens


# -- workloads -----------------------------------------------------------------------


def test_distributions_parse_and_draw() -> None:
    rng = random.Random(0)
    assert parse_distribution("1024", what="x") == Distribution("fixed", 1024)
    uniform = parse_distribution("512-4096", what="x")
    assert all(512 <= uniform.sample(rng) <= 4096 for _ in range(200))
    normal = parse_distribution("normal:10,50", what="x")
    assert min(normal.sample(rng) for _ in range(200)) == 1  # clipped at 1
    lognormal = parse_distribution("lognormal:2000,800", what="x")
    draws = [lognormal.sample(rng) for _ in range(4000)]
    assert 1900 < sum(draws) / len(draws) < 2100
    assert str(lognormal) == "lognormal:2000,800"
    assert parse_distribution("0", what="gap", minimum=0).sample(rng) == 0


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("0", "at least 1"),
        ("9-3", "LO <= HI"),
        ("lognormal:0,5", "positive finite mean"),
        ("poisson:3", "must be written as"),
        ("1q", "must be written as"),
    ],
)
def test_bad_distributions_name_the_option(text: str, match: str) -> None:
    with pytest.raises(DistributionError, match=match) as info:
        parse_distribution(text, what="--prompt-len")
    assert "--prompt-len" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_synthetic_workloads_are_reproducible_and_shaped() -> None:
    a = synthetic_workload(
        7, prompt_len="5-50", output_len="3", shared_prefixes=2, prefix_len=16, turns=3
    )
    assert a == synthetic_workload(
        7, prompt_len="5-50", output_len="3", shared_prefixes=2, prefix_len=16, turns=3
    )
    other = synthetic_workload(
        7,
        prompt_len="5-50",
        output_len="3",
        shared_prefixes=2,
        prefix_len=16,
        turns=3,
        seed=1,
    )
    assert other != a
    ids = [r.id for r in a.requests]
    assert ids == ["c0.t0", "c0.t1", "c0.t2", "c1.t0", "c1.t1", "c1.t2", "c2.t0"]
    by_id = {r.id: r for r in a.requests}
    for r in a.requests:
        assert r.output_len == 3
        if r.parent is None:
            assert r.prefix_id in {"p0", "p1"}
            assert 16 + 5 <= len(r.prompt) <= 16 + 50
        else:
            parent = by_id[r.parent]
            text = parent.prompt + parent.output
            assert r.prompt[: len(text)] == text
            assert 5 <= len(r.prompt) - len(text) <= 50
    firsts = [r for r in a.requests if r.parent is None]
    same = [r for r in firsts if r.prefix_id == firsts[0].prefix_id]
    assert all(r.prompt[:16] == firsts[0].prompt[:16] for r in same)


def test_workload_rules() -> None:
    ok = WorkloadRequest("a", 0, (1, 2), (3,))
    with pytest.raises(WorkloadError, match="used twice"):
        Workload((ok, ok))
    with pytest.raises(WorkloadError, match="arrival order"):
        Workload(
            (WorkloadRequest("a", 3, (1,), (2,)), WorkloadRequest("b", 1, (1,), (2,)))
        )
    with pytest.raises(WorkloadError, match="output is empty"):
        Workload((WorkloadRequest("a", 0, (1,), ()),))
    with pytest.raises(WorkloadError, match="does not start with parent"):
        Workload((ok, WorkloadRequest("b", 0, (9, 9, 9), (1,), parent="a")))
    with pytest.raises(WorkloadError, match="prefix_len >= 1"):
        synthetic_workload(3, shared_prefixes=2)


# -- trace files ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "field", "match"),
    [
        ("not json", None, "not valid JSON"),
        ("[1, 2]", None, "must be a JSON object"),
        ('{"prompt_len": 3, "output_len": 1, "arival": 2}', "arival", "unknown field"),
        ('{"prompt_len": 3}', "output_len", "must be an int >= 1, got None"),
        ('{"prompt_len": 3, "output_len": 0}', "output_len", "must be an int >= 1"),
        ('{"prompt_len": 3, "output_len": 1.5}', "output_len", "got 1.5"),
        ('{"output_len": 1}', "prompt", "exactly one of"),
        (
            '{"prompt": [1], "prompt_len": 1, "output_len": 1}',
            "prompt",
            "exactly one of",
        ),
        ('{"prompt": [1, -2], "output_len": 1}', "prompt", "token 1 is -2"),
        ('{"prompt": "abc", "output_len": 1}', "prompt", "list of token ids"),
        ('{"prompt_len": 0, "output_len": 1}', "prompt_len", "must be an int >= 1"),
        ('{"prompt_len": 2, "output_len": 1, "arrival": -1}', "arrival", ">= 0"),
        (
            '{"prompt_len": 2, "output_len": 1, "prefix_id": "s"}',
            "prefix_len",
            "go together",
        ),
        (
            '{"prompt_len": 2, "output_len": 1, "prefix_len": 4}',
            "prefix_id",
            "go together",
        ),
        (
            '{"prompt_len": 2, "output_len": 1, "parent": "nope"}',
            "parent",
            "earlier line",
        ),
        (
            '{"id": "x", "prompt_len": 2, "output_len": 1}',
            "id",
            "used by an earlier line",
        ),
        ('{"id": "", "prompt_len": 2, "output_len": 1}', "id", "non-empty string"),
        (
            '{"prompt_len": 2, "output_len": 1, "parent": "x", "prefix_id": "s", "prefix_len": 2}',
            "prefix_id",
            "inherits the parent's prefix",
        ),
    ],
)
def test_trace_errors_name_the_line_and_field(
    line: str, field: str | None, match: str
) -> None:
    # Line 1 is valid, line 2 blank, the bad line is line 3.
    first = '{"id": "x", "prompt_len": 4, "output_len": 2}'
    with pytest.raises(TraceError, match=match) as info:
        parse_trace([first, "", line], source="t.jsonl")
    err = info.value
    assert (err.line, err.field) == (3, field)
    prefix = "t.jsonl line 3" + (f", field {field!r}" if field else "")
    assert str(err).startswith(prefix)
    assert isinstance(err, KvcoreValueError)
    assert isinstance(err, ValueError)


def test_trace_lines_come_in_arrival_order() -> None:
    lines = [
        '{"arrival": 5, "prompt_len": 2, "output_len": 1}',
        '{"arrival": 4, "prompt_len": 2, "output_len": 1}',
    ]
    with pytest.raises(TraceError, match="line 2, field 'arrival': step 4 is before"):
        parse_trace(lines)


def test_trace_prefixes_give_equal_tokens(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(
        '{"id": "a", "prefix_id": "sys", "prefix_len": 8, "prompt_len": 3, "output_len": 1}\n'
        '{"id": "b", "arrival": 2, "prefix_id": "sys", "prefix_len": 5, "prompt": [7], "output_len": 1}\n'
    )
    a, b = load_trace(path).requests
    assert a.prompt[:5] == b.prompt[:5]
    assert b.prompt[5:] == (7,)
    assert len(a.prompt) == 11
    assert b.arrival == 2


def test_unreadable_traces(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt_len": 1, "output_len": 1}\n\xff\n')
    with pytest.raises(TraceError, match="line 2: not UTF-8") as info:
        load_trace(bad)
    assert info.value.line == 2
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(TraceError, match="no requests"):
        load_trace(empty)


# -- the command -----------------------------------------------------------------------

SMALL = ["llama-3-1-8b", "--memory", "256MiB", "--max-num-batched-tokens", "512"]


def test_simulate_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", *SMALL, "--requests", "6", "--prompt-len", "300"]
    args += ["--output-len", "20", "--shared-prefixes", "1", "--prefix-len", "256"]
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"] == "Llama-3.1-8B"
    assert doc["workload"]["synthetic"]["prefix_len"] == 256
    assert doc["workload"]["requests"] == 6
    assert doc["workload"]["prompt_tokens"] == 6 * (256 + 300)
    result = doc["result"]
    assert result["completed"] == 6
    assert result["tokens_generated"] == 6 * 20
    assert result["num_blocks"] == doc["plan"]["num_blocks"]
    # Each request after the first hits the shared prefix's whole blocks
    # (256 tokens at 16 tokens a block).
    assert result["prefix_hit_tokens"] >= 5 * 256
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "requests completed" in text
    assert "blocks per cache group" in text


def test_simulate_a_trace_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(HAND_TRACE) + "\n")
    assert main(["simulate", *SMALL, "--trace", str(trace), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workload"]["trace"] == str(trace)
    assert doc["result"]["completed"] == 3
    assert doc["result"]["tokens_generated"] == 11
    # A and B share 8 tokens, less than one 16-token block: no hit.
    assert doc["result"]["prefix_hit_tokens"] == 0
    trace.write_text(HAND_TRACE[0] + '\n{"prompt_len": 3, "output_len": -1}\n')
    assert main(["simulate", *SMALL, "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcore: error: ")
    assert "line 2, field 'output_len'" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--trace", "x.jsonl", "--requests", "3"], "--requests shape a synthetic"),
        (["--shared-prefixes", "2"], "needs --prefix-len"),
        (["--prefix-len", "8"], "give --shared-prefixes"),
        (["--requests", "0"], "--requests takes an int >= 1"),
        (["--output-len", "lognormal:5"], "--output-len must be written as"),
        (["--max-steps", "x"], "--max-steps takes an int"),
    ],
)
def test_simulate_refuses_bad_options(
    extra: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", *SMALL, *extra]) == 2
    assert match in capsys.readouterr().err


def test_the_progress_bar_draws_on_stderr_only(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvcore.tools.cli import simulate as command

    quiet = command._ProgressBar(10)
    quiet(1, 0, 10)
    assert quiet.bar is None  # a short run draws nothing
    monkeypatch.setattr(command, "PROGRESS_DELAY_S", 0.0)
    bar = command._ProgressBar(10)
    bar(1, 3, 10)
    assert bar.bar is not None
    assert bar.bar.tasks[0].completed == 3
    bar.close()
    assert capsys.readouterr().out == ""


@pytest.mark.slow  # a new process; the tests above run the same main in process
def test_the_installed_script_simulates() -> None:
    script = Path(sys.executable).with_name("kvcore")
    out = subprocess.run(
        [
            str(script),
            "simulate",
            *SMALL,
            "--requests",
            "3",
            "--prompt-len",
            "100",
            "--output-len",
            "5",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    doc = json.loads(out.stdout)
    assert doc["result"]["completed"] == 3
    assert doc["result"]["tokens_generated"] == 15
    assert out.stderr == ""


def test_lengths_take_the_letters_as_context_does() -> None:
    from kvcore.tools.simulate.lengths import parse_distribution

    assert parse_distribution("4K", what="--prompt-len").a == 4096
    assert parse_distribution("4k", what="--prompt-len").a == 4000
    uniform = parse_distribution("1k-8K", what="--prompt-len")
    assert (uniform.kind, uniform.a, uniform.b) == ("uniform", 1000, 8192)
