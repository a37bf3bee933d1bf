"""The measurement side of prefix hits: the token-level bound, cached-block
counts, the content oracle, the named workloads and benchmarks/hit_rate.py."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
import pytest
from benchmark_scripts import load_benchmark
from coordinator_setup import one_layer_plan

import kvcore
from kvcore.coordinator import HitQuery, KVCacheManager
from kvcore.tools.cli import main
from kvcore.tools.simulate import (
    NAMED_WORKLOADS,
    ComputedPrefixes,
    ContentOracle,
    Driver,
    Workload,
    WorkloadError,
    WorkloadRequest,
    named_workload,
    workload_names,
)
from kvcore.tools.simulate.bound import DEFAULT_CHUNK
from kvcore.tools.simulate.workload import pack_words
from kvcore_full_attention import FullAttention
from kvcore_full_attention.manager import FullAttentionManager

REPO = Path(__file__).resolve().parent.parent

# -- the bound's trie --------------------------------------------------------------


def _brute_force(seqs: dict[str, list[int]], tokens: list[int], limit: int) -> int:
    best = 0
    for seq in seqs.values():
        n = 0
        for a, b in zip(seq, tokens[:limit], strict=False):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return best


@pytest.mark.parametrize("chunk", [1, 3, 32, DEFAULT_CHUNK])
def test_the_trie_agrees_with_a_brute_force_search(chunk: int) -> None:
    # Sequences over a 3-token vocabulary that share prefixes of every
    # length, grown a random number of tokens at a time and queried between.
    # A second trie is given the same sequences packed as 4-byte words (as
    # the driver gives a trace's requests) and must answer alike.
    rng = random.Random(chunk)
    trie = ComputedPrefixes(chunk)
    packed = ComputedPrefixes(chunk)
    full: dict[str, list[int]] = {}
    computed: dict[str, list[int]] = {}
    for i in range(60):
        if full and rng.random() < 0.6:
            base = rng.choice(list(full.values()))
            seq = base[: rng.randrange(len(base) + 1)]
        else:
            seq = []
        seq += [rng.randrange(3) for _ in range(rng.randrange(1, 90))]
        full[f"s{i}"] = seq
        computed[f"s{i}"] = []
    for _ in range(400):
        key = rng.choice(list(full))
        seq = full[key]
        length = min(len(seq), len(computed[key]) + rng.randrange(0, 40))
        trie.extend(key, seq, length)
        packed.extend(key, pack_words(seq), length)
        computed[key] = seq[:length]
        probe = rng.choice(list(full.values()))
        probe = [*probe[: rng.randrange(len(probe) + 1)], rng.randrange(3)]
        limit = rng.randrange(len(probe) + 1)
        expected = _brute_force(computed, probe, limit)
        assert trie.longest_prefix(probe, limit) == expected
        assert packed.longest_prefix(pack_words(probe), limit) == expected
        expected = _brute_force(computed, probe, len(probe))
        assert trie.longest_prefix(probe) == expected
        assert packed.longest_prefix(pack_words(probe)) == expected


def test_the_trie_refuses_a_bad_chunk() -> None:
    with pytest.raises(ValueError, match="chunk must be a positive int"):
        ComputedPrefixes(0)


# -- a hand-worked trace at 16 tokens a block ---------------------------------------


def _plan16(num_blocks: int = 64) -> kvcore.KVCacheConfig:
    """One full-attention layer (Llama-like) at 16-token blocks, 256 tokens
    a step, max_model_len 128."""
    plan = one_layer_plan(16, num_blocks, max_model_len=128, step_tokens=256)
    assert plan.hash_block_size == 16
    return plan


X = list(range(1000, 1040))  # A's 40 prompt tokens
OA = (1, 2, 3, 4, 5)  # A's output
Y = [2000 + i for i in range(6)]
Z = [3000 + i for i in range(10)]


def _hand_workload() -> Workload:
    return Workload.of(
        [
            WorkloadRequest("A", 0, tuple(X), OA),
            WorkloadRequest("C", 0, (*X, *OA, *Y), (6, 7, 8), parent="A"),
            WorkloadRequest("B", 10, (*X[:37], *Z), (9, 10)),
            WorkloadRequest("D", 20, tuple(X), (11,)),
        ]
    )


def test_the_bound_and_the_hits_of_a_hand_worked_trace() -> None:
    # A (40 prompt tokens, 5 out) prefills at step 0 and decodes at steps
    # 1-4: it computes 44 tokens (its prompt and o1..o4; o5 is sampled, never
    # computed), 2 full blocks.
    # C, A's next turn (X + A's 5 outputs + 6 new = 51 tokens, 3 out), waits
    # for A and is admitted at step 5: A computed 44 of its tokens, so the
    # bound is 44; A's 2 full blocks hit 32.  C computes 53 tokens by step 7.
    # B (X[:37] + 10 new = 47 tokens) arrives at step 10: it shares 37
    # tokens with A and with C (bound 37), and hits their first 2 blocks
    # (32): block 2 differs at token 37.
    # D (X again, 40 tokens) at step 20: A computed all of X, but the last
    # token is always recomputed: bound 39; hit 32 (block 2 is not full).
    # Looked up 40 + 51 + 47 + 40 = 178; hits 0 + 32 + 32 + 32 = 96; bound
    # 0 + 44 + 37 + 39 = 120.
    # Cached blocks, counted at every step that did work: 2 at steps 0-4
    # (A's full blocks), 3 at steps 5-7 (C's block 2, tokens 32-47, is
    # full) and at step 10 (B's 47 tokens leave its block 2 one short), 4 at
    # step 11 (B's decode fills it) and at step 20.
    driver = Driver(_plan16(), validate=True, cache_sample_every=1)
    result = driver.run(_hand_workload())
    assert result.completed == 4
    assert result.steps == 21
    assert result.prompt_tokens_looked_up == 178
    assert result.prefix_hit_tokens == 96
    assert result.token_bound_tokens == 120
    assert result.hit_rate == result.prefix_hit_rate == 96 / 178
    assert result.bound_rate == 120 / 178
    [group] = result.groups
    assert group.peak_cached_blocks == 4
    assert (result.peak_cached_blocks, result.peak_cached_state_blocks) == (4, 0)
    assert group.mean_cached_blocks == (5 * 2 + 4 * 3 + 2 * 4) / 11
    assert result.validated
    assert (result.checked_hits, result.invalid_hits) == (3, 0)
    assert result.invalid_hit_reports == ()
    assert result.evictions == 0
    doc = result.to_dict()
    assert doc["token_bound_tokens"] == 120
    assert doc["bound_rate"] == 120 / 178
    assert doc["groups"][0]["peak_cached_blocks"] == 4
    assert doc["invalid_hits"] == 0


def test_a_readmission_counts_in_the_hits_and_the_bound_alike() -> None:
    # Two 30-token prompts that grow to 49 computed tokens (4 blocks each)
    # in a pool of 6 usable 16-token blocks, 16 tokens a step: both run
    # until the pool is short and the newer one is preempted.  Its
    # re-admission looks up its prompt and generated tokens again, and its
    # own computation before the preemption counts towards its bound.
    plan = one_layer_plan(16, 7, max_model_len=64, step_tokens=16)
    workload = Workload.of(
        [
            WorkloadRequest("p", 0, tuple(range(100, 130)), tuple(range(20))),
            WorkloadRequest("q", 0, tuple(range(200, 230)), tuple(range(20))),
        ]
    )
    result = Driver(plan, max_partial_prefills=2, validate=True).run(workload)
    assert result.completed == 2
    assert result.preemptions >= 1
    # Every admission is looked up: 2 first admissions and the re-admissions.
    assert result.prompt_tokens_looked_up > 60
    assert result.token_bound_tokens >= result.prefix_hit_tokens > 0
    assert result.invalid_hits == 0


class CorruptingManager(FullAttentionManager):
    """A faulty third-party manager: it keys a request's first two full
    blocks crosswise (the first under the second's hash, the second under
    the first's).  Every key names the right prefix length; hits on them
    would read the two blocks in the wrong order."""

    def cache_blocks(self, request: Any, num_tokens: int) -> None:
        rid = request.request_id
        table = self.req_to_blocks[rid]
        crosswise = (
            self.num_cached_block.get(rid, 0) == 0
            and num_tokens // self.block_size >= 2
            and len(table) >= 2
        )
        if crosswise:
            self.record_request_state(rid, whole=True)
            table[0], table[1] = table[1], table[0]
        super().cache_blocks(request, num_tokens)
        if crosswise:
            table[0], table[1] = table[1], table[0]


class HitSwappingManager(FullAttentionManager):
    """A faulty third-party manager: each non-empty hit's last block is
    swapped for another cached block (another request's), when there is
    one."""

    @classmethod
    def find_longest_cache_hit(cls, query: HitQuery) -> list[list[int]]:
        hits = super().find_longest_cache_hit(query)
        if hits and hits[0]:
            blocks = hits[0]
            key_hash = query.block_pool.key_hash
            others = [
                b
                for b in range(query.block_pool.num_blocks)
                if key_hash[b] is not None and b not in blocks
            ]
            if others:
                hits = [[*blocks[:-1], others[0]], *hits[1:]]
        return hits


class HitSwappingFullAttention(FullAttention):
    """The built-in full-attention kind with the hit-swapping manager."""

    manager_type = HitSwappingManager


class CorruptingFullAttention(FullAttention):
    """The built-in full-attention kind with the faulty manager above."""

    manager_type = CorruptingManager


def test_blocks_keyed_crosswise_are_refused_when_they_are_keyed() -> None:
    # A keys its two full blocks crosswise: each key names the right prefix
    # length, so only the block's position in A's table shows the fault.
    # The core checks a kind's own keying step against the table, so the
    # run stops at A's keying, before any request could hit those blocks
    # (the content oracle would report each such hit; see
    # test_partial_block_content_and_copies_in_the_model).
    faulty = kvcore.KindRegistry.from_kinds([CorruptingFullAttention()])
    with pytest.raises(kvcore.errors.PluginResultError) as info:
        Driver(_plan16(), registry=faulty, validate=True).run(_hand_workload())
    assert "CorruptingManager.cache_twins keyed block" in str(info.value)
    assert "for request 'A'" in str(info.value)
    # The built-in manager's hits are all valid.
    honest = Driver(_plan16(), validate=True).run(_hand_workload())
    assert (honest.checked_hits, honest.invalid_hits) == (3, 0)
    plain = Driver(_plan16()).run(_hand_workload())
    assert (plain.validated, plain.checked_hits, plain.invalid_hits) == (False, 0, 0)


def test_a_hit_naming_another_prefixs_block_is_refused_at_lookup() -> None:
    """A manager whose hit names a block keyed by another prefix is
    refused where the hit enters the core, before anything reads it,
    naming the manager, the block and its position."""
    faulty = kvcore.KindRegistry.from_kinds([HitSwappingFullAttention()])
    with pytest.raises(kvcore.errors.PluginResultError) as info:
        Driver(_plan16(), registry=faulty).run(_hand_workload())
    message = str(info.value)
    assert message.startswith("test_hit_rate.HitSwappingManager.find_longest_cache_hit")
    assert "at position 1 of group 0, which is not keyed there" in message


def test_the_oracle_applies_the_copies_a_step_asks_for() -> None:
    """Hashes of 4 tokens in 16-token blocks: B's hit ends inside A's third
    block (36 tokens), so B's step copies those 4 tokens into B's own new
    block, which B fills and keys; D's hit on that block holds its tokens
    only once the oracle applied the copy."""
    plan = attrs.evolve(_plan16(), hash_block_size=4)
    b = (*X[:38], *Z, *Z)
    workload = Workload.of(
        [
            WorkloadRequest("A", 0, tuple(X), OA),
            WorkloadRequest("B", 10, b, (9,)),
            WorkloadRequest("D", 20, (*b[:50], 7, 7), (11,)),
        ]
    )
    result = Driver(plan, validate=True).run(workload)
    assert result.completed == 3
    # B hits 36 tokens (a partial block), D 48 (B's copied block included).
    assert result.prefix_hit_tokens == 36 + 48
    assert (result.checked_hits, result.invalid_hits) == (2, 0)


def test_partial_block_content_and_copies_in_the_model() -> None:
    manager = KVCacheManager.from_plan(_plan16())
    oracle = ContentOracle(manager)
    b1, b2, b3 = range(1, 4)  # block ids
    tokens = list(range(500, 540))
    oracle.write("r", tokens, 0, 20, [[b1, b2]])
    assert oracle.check_hit("s", tokens, [[b1]], 16)
    # A hit of 20 tokens: block 1 holds tokens 16-19 in its first 4 slots.
    assert oracle.check_hit("s", tokens, [[b1, b2]], 20)
    assert not oracle.check_hit("s", tokens, [[b1, b2]], 24)
    assert not oracle.check_hit("s", tokens, [[b1]], 20)  # too few blocks
    assert not oracle.check_hit("s", [0, *tokens[1:]], [[b1]], 16)
    oracle.apply_copies(
        [SimpleNamespace(group_id=0, src_block_id=2, dst_block_id=3, num_tokens=4)]
    )
    assert oracle.check_hit("s", tokens, [[b1, b3]], 20)
    assert oracle.invalid_hits == 3
    assert oracle.checked_hits == 6
    assert "fewer than 20 tokens" in oracle.reports[1]


@pytest.mark.parametrize("mode", ["align", "all"])
def test_checkpointed_states_are_validated(
    zoo_registry: kvcore.KindRegistry, mode: str
) -> None:
    # Jamba with its Mamba states kept at block boundaries: every hit ends
    # on a state the oracle saw written after exactly those tokens.
    from kvcore.coordinator import CheckpointManager
    from kvcore.tools.cli.options import add_model_options, plan_from_args

    parser = argparse.ArgumentParser()
    add_model_options(parser)
    args = parser.parse_args(
        ["jamba-1-5-mini", "--memory", "4GiB", "--mamba-cache-mode", mode]
    )
    plan = plan_from_args(args, registry=zoo_registry).plan
    workload = named_workload("agentic")
    workload = Workload.of(workload.requests[:24])
    driver = Driver(plan, registry=zoo_registry, validate=True)
    result = driver.run(workload)
    assert driver.manager is not None
    managers = driver.manager.coordinator.single_type_managers
    assert any(isinstance(m, CheckpointManager) for m in managers)
    assert result.prefix_hit_tokens > 0
    assert result.checked_hits > 0
    assert result.invalid_hits == 0, result.invalid_hit_reports
    assert result.token_bound_tokens >= result.prefix_hit_tokens
    assert any(g.peak_cached_blocks for g in result.groups if "mamba" in g.kinds)
    assert 0 < result.peak_cached_state_blocks < result.peak_cached_blocks


# -- named workloads -----------------------------------------------------------------


def test_named_workloads_are_deterministic_and_well_formed() -> None:
    assert workload_names() == ["chat", "shared-prefix", "agentic"]
    for name in workload_names():
        a = named_workload(name)
        assert a == named_workload(name)
        assert a != named_workload(name, seed=1)
        assert len(a) == int(NAMED_WORKLOADS[name]["requests"])
    chat = named_workload("chat")
    roots = [r for r in chat.requests if r.parent is None]
    assert len(roots) == 16
    assert {r.prefix_id for r in roots} == {"p0"}
    assert all(r.prompt[:1024] == roots[0].prompt[:1024] for r in chat.requests)
    by_id = {r.id: r for r in chat.requests}
    for r in chat.requests:
        assert 100 <= r.output_len <= 400
        if r.parent is not None:
            parent = by_id[r.parent]
            grown = len(r.prompt) - len(parent.prompt) - parent.output_len
            assert 300 <= grown <= 2000
    assert all(r.id.endswith(".t0") for r in roots)
    assert {r.id.split(".")[1] for r in chat.requests} == {f"t{t}" for t in range(7)}
    shared = named_workload("shared-prefix")
    assert all(r.parent is None for r in shared.requests)
    assert {r.prefix_id for r in shared.requests} == {"p0", "p1", "p2", "p3"}
    agentic = named_workload("agentic")
    assert all(len(r.prompt) > 6144 for r in agentic.requests)
    assert all(r.output_len <= 80 for r in agentic.requests)
    with pytest.raises(WorkloadError, match="no workload named 'chats'"):
        named_workload("chats")


# -- the command -----------------------------------------------------------------------

SMALL = ["llama-3-1-8b", "--memory", "4GiB"]


def test_simulate_a_named_workload(capsys: pytest.CaptureFixture[str]) -> None:
    # The preset's options, with --requests overriding its number: one chat.
    args = ["simulate", *SMALL, "--workload", "chat", "--requests", "7"]
    assert main([*args, "--validate", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    options = doc["workload"]["synthetic"]
    assert options["workload"] == "chat"
    assert (options["requests"], options["turns"]) == (7, 7)
    assert (options["prompt_len"], options["prefix_len"]) == ("300-2000", 1024)
    assert doc["workload"]["requests"] == 7
    assert doc["validate"] is True
    result = doc["result"]
    assert result["completed"] == 7
    assert result["validated"]
    assert result["invalid_hits"] == 0
    # Every later turn hits its parent's prompt and output (less the last
    # partial block): most of what is looked up.
    assert 0.5 < result["prefix_hit_rate"] <= result["bound_rate"] < 1
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "token-level bound" in text
    assert "cached peak" in text
    # --shared-prefixes 0 turns the preset's prefixes off, its length too.
    args = ["simulate", *SMALL, "--workload", "shared-prefix", "--requests", "3"]
    assert main([*args, "--shared-prefixes", "0", "--json"]) == 0
    options = json.loads(capsys.readouterr().out)["workload"]["synthetic"]
    assert (options["shared_prefixes"], options["prefix_len"]) == (0, 0)
    assert options["output_len"] == "50-300"


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--workload", "nope"], "--workload takes one of chat, shared-prefix"),
        (["--workload", "chat", "--trace", "x.jsonl"], "give one of them"),
    ],
)
def test_simulate_refuses_a_bad_workload(
    extra: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", *SMALL, *extra]) == 2
    assert match in capsys.readouterr().err


# -- benchmarks/hit_rate.py and its docs page ---------------------------------------


def _benchmark() -> Any:
    # hit_rate.py imports its sibling capacity.py, as running it as a
    # script allows.
    return load_benchmark("hit_rate")


def test_the_hit_rate_page_is_the_benchmarks_table(
    zoo_registry: kvcore.KindRegistry,
) -> None:
    # One model and workload run afresh gives the page's rows exactly; the
    # page lists every shipped model, named workload and pool, in order, and
    # no invalid hit.
    from kvcore.tools import zoo

    bench = _benchmark()
    rows = bench.model_rows("llama-3-1-8b", "shared-prefix", zoo_registry)
    assert [r["pool"] for r in rows] == ["ample", "tight"]
    ample, tight = rows
    assert ample["evictions"] == 0
    assert tight["num_blocks"] < ample["num_blocks"]
    for row in rows:
        assert row["invalid_hits"] == 0
        assert row["token_bound_tokens"] >= row["prefix_hit_tokens"] > 0
        assert row["completed"] == row["requests"]
    page = (REPO / "docs" / "hit-rate.md").read_text()
    assert page.startswith(bench.PAGE_HEAD)
    main_table, _, rest = page[len(bench.PAGE_HEAD) :].partition(bench.POLICY_HEAD)
    policies, _, same_memory = rest.partition(bench.SAME_MEMORY_HEAD)
    table = main_table.splitlines()
    # Every model but the reference, on every workload, beside the reference
    # in the same memory and at the same pressure.
    compared = [line.strip("|").split("|") for line in same_memory.splitlines()[2:]]
    assert [tuple(c.strip() for c in cell[:2]) for cell in compared] == [
        (m, w)
        for m in zoo.names()
        if m != bench.BASELINE_MODEL
        for w in workload_names()
    ]
    for cell in compared:
        # The stricter rule: at least 0.8 of the reference at the same pressure.
        assert float(cell[-1]) >= 0.8, cell
    # Every checkpoint policy's rows are valid too.
    policy_cells = [line.strip("|").split("|") for line in policies.splitlines()[2:]]
    assert policy_cells
    assert {c[-1].strip() for c in policy_cells} == {"0"}
    assert table[:2] == bench.markdown([]).splitlines()
    for line in bench.markdown(rows).splitlines()[2:]:
        assert line in table
    cells = [line.strip("|").split("|") for line in table[2:]]
    keys = [tuple(c.strip() for c in cell[:3]) for cell in cells]
    assert keys == [
        (m, w, p) for m in zoo.names() for w in workload_names() for p in bench.POOLS
    ]
    invalid = [cell[-1].strip() for cell in cells]
    assert set(invalid) == {"0"}


def test_a_tight_pool_on_a_state_hybrid_with_copied_partial_hits(
    zoo_registry: kvcore.KindRegistry,
) -> None:
    """Qwen3-Next's agentic turns in a tight pool: admissions with
    copy-on-write sources that fit only without their checkpoints run
    without them (the sources still counted), every hit valid, every
    request served.  Seed 3 is one whose tight pool evicts hits the ample
    one keeps."""
    bench = _benchmark()
    ample, tight = bench.model_rows(
        "qwen3-next-80b-a3b", "agentic", zoo_registry, seed=3
    )
    for row in (ample, tight):
        assert row["invalid_hits"] == 0
        assert row["completed"] == row["requests"]
        assert row["unserved"] == 0
    assert ample["bound_rate"] - ample["hit_rate"] < 0.02
    assert tight["evictions"] > ample["evictions"]
    assert tight["hit_rate"] < ample["hit_rate"] - 0.05
