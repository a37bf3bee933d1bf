"""vLLM's spellings of the planning options, and its unit rules, on
``kvcore plan`` / ``compare`` (run in process through ``main``).

Numbers are worked by hand: Llama-3.1-8B is 32 full-attention layers of 8 KV
heads x 128 dims in bf16, so one 16-token block of all layers is
32 * 2 * 8 * 128 * 2 * 16 = 2 MiB, and 40 GiB hold 20,480 blocks.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from kvcore.tools.cli import main
from kvcore.tools.cli.document import load_schema

GIB = 2**30


def plan(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["plan", *args, "--json"]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    jsonschema.validate(doc, load_schema())
    return doc


def error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    try:
        code = main(["plan", *args])
    except SystemExit as exc:  # argparse's own errors
        code = int(exc.code or 0)
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_kv_cache_memory_bytes_is_memory_with_vllms_units(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # vLLM reads 40G as 40 GiB and 40g as 40e9 bytes.
    doc = plan(capsys, "llama-3-1-8b", "--kv-cache-memory-bytes", "40G")
    assert doc["settings"]["memory"]["kv_cache_bytes"] == 40 * GIB
    assert doc["summary"]["num_blocks"] == 20480
    doc = plan(capsys, "llama-3-1-8b", "--memory", "40G")
    assert doc["settings"]["memory"]["kv_cache_bytes"] == 40 * GIB
    doc = plan(capsys, "llama-3-1-8b", "--memory", "40g")
    assert doc["settings"]["memory"]["kv_cache_bytes"] == 40 * 10**9
    # The spelled-out units keep their meaning in any case.
    doc = plan(capsys, "llama-3-1-8b", "--memory", "40gb")
    assert doc["settings"]["memory"]["kv_cache_bytes"] == 40 * 10**9
    doc = plan(capsys, "llama-3-1-8b", "--memory", "40gib")
    assert doc["settings"]["memory"]["kv_cache_bytes"] == 40 * GIB
    assert "not allowed with argument --gpu" in error(
        capsys, "llama-3-1-8b", "--gpu", "H100", "--kv-cache-memory-bytes", "8G"
    )


def test_token_counts_read_k_as_1000_and_K_as_1024(
    capsys: pytest.CaptureFixture[str],
) -> None:
    doc = plan(capsys, "llama-3-1-8b", "--memory", "40GiB", "--context", "32k,32K")
    assert doc["settings"]["contexts"] == [32000, 32768]
    # 32,000 tokens are 2,000 blocks (+1 in flight); 32,768 are 2,048 (+1):
    # 20,479 usable blocks hold 10 and 9 of them.
    assert [r["concurrency"] for r in doc["capacity"]] == [10, 9]
    doc = plan(
        capsys, "llama-3-1-8b", "--memory", "40GiB", "--max-num-batched-tokens", "8k"
    )
    assert doc["settings"]["max_num_batched_tokens"] == 8000


def test_the_default_context_stays_32768(capsys: pytest.CaptureFixture[str]) -> None:
    doc = plan(capsys, "llama-3-1-8b", "--memory", "40GiB")
    assert doc["settings"]["contexts"] == [32768]
    assert "9 requests of 32K tokens" in doc["verdict"]


def test_tensor_parallel_aliases(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--tp", "--tensor-parallel-size", "-tp"):
        doc = plan(capsys, "llama-3-1-8b", "--memory", "40GiB", flag, "2")
        assert doc["settings"]["tensor_parallel_size"] == 2
        # 4 KV heads a rank: the block halves to 1 MiB, 40,960 blocks.
        assert doc["summary"]["num_blocks"] == 40960


def test_model_option_is_the_positional_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    doc = plan(capsys, "--model", "llama-3-1-8b", "--memory", "40GiB")
    assert doc["model"]["name"] == "Llama-3.1-8B"
    doc = plan(capsys, "llama-3-1-8b", "--model", "llama-3-1-8b", "--memory", "4G")
    assert doc["model"]["name"] == "Llama-3.1-8B"
    assert "give the model once" in error(
        capsys, "gemma-3-27b", "--model", "llama-3-1-8b"
    )


def test_prefix_caching_flags(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["llama-3-1-8b", "--memory", "40GiB"]
    assert plan(capsys, *base)["settings"]["enable_prefix_caching"] is True
    on = plan(capsys, *base, "--enable-prefix-caching")
    assert on["settings"]["enable_prefix_caching"] is True
    off = plan(capsys, *base, "--no-enable-prefix-caching")
    assert off["settings"]["enable_prefix_caching"] is False
    old = plan(capsys, *base, "--no-prefix-caching")
    assert old["settings"]["enable_prefix_caching"] is False


def test_max_model_len_is_the_target_and_a_bound(
    capsys: pytest.CaptureFixture[str],
) -> None:
    doc = plan(capsys, "llama-3-1-8b", "--memory", "40GiB", "--max-model-len", "16k")
    assert doc["settings"]["contexts"] == [16000]
    assert doc["settings"]["max_model_len"] == 16000
    # 16,000 tokens: 1,000 blocks + 1; 20,479 // 1,001 = 20.
    assert doc["capacity"][0]["concurrency"] == 20
    message = error(
        capsys,
        "llama-3-1-8b",
        "--memory",
        "40GiB",
        "--max-model-len",
        "16K",
        "--context",
        "4K,32K",
    )
    assert "--context 4K,32K asks for 32,768 tokens, past --max-model-len" in message
    # One request of the longest length must fit, as vLLM checks at start-up.
    message = error(
        capsys, "llama-3-1-8b", "--memory", "1GiB", "--max-model-len", "128K"
    )
    assert message.startswith("kvcore: error:")
    assert "131072" in message.replace(",", "")
    # auto needs the model's longest context, which a shipped file lacks.
    assert "max_position_embeddings" in error(
        capsys, "llama-3-1-8b", "--max-model-len", "auto"
    )


def test_max_num_seqs_caps_beside_the_verdict(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["plan", "llama-3-1-8b", "--memory", "40GiB", "--max-num-seqs", "4"]
    assert main(args) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0].startswith("Llama-3.1-8B in 40.0 GiB of KV cache: 9 requests")
    assert "9 requests fit; vLLM would run at most --max-num-seqs 4 at once" in text[1]
    doc = plan(capsys, *args[1:])
    assert doc["settings"]["max_num_seqs"] == 4
    assert doc["notes"][0].startswith("9 requests fit; vLLM would run at most")
    doc = plan(capsys, "llama-3-1-8b", "--memory", "40GiB", "--max-num-seqs", "256")
    assert doc["notes"][0] == "9 requests fit, within --max-num-seqs 256"
    assert "--max-num-seqs takes a positive whole number" in error(
        capsys, "llama-3-1-8b", "--max-num-seqs", "0"
    )


def test_mamba_ssm_cache_dtype_sets_the_recurrent_state(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = ["jamba-1-5-mini", "--memory", "8GiB"]
    auto = plan(capsys, *base)
    half = plan(capsys, *base, "--mamba-ssm-cache-dtype", "float16")
    wide = plan(capsys, *base, "--mamba-ssm-cache-dtype", "float32")
    assert half["settings"]["mamba_ssm_cache_dtype"] == "float16"
    assert auto["settings"]["mamba_ssm_cache_dtype"] is None
    assert any(n.startswith("SSM state dtype float16 on ") for n in half["notes"])

    def state_bytes(doc: dict[str, Any]) -> int:
        return int(doc["capacity"][0]["bytes_per_request"])

    # A wider SSM state costs every request more bytes.
    assert state_bytes(half) <= state_bytes(auto) <= state_bytes(wide)
    assert state_bytes(half) < state_bytes(wide)
    assert "--mamba-ssm-cache-dtype takes auto, float32" in error(
        capsys, *base, "--mamba-ssm-cache-dtype", "fp8"
    )


def test_pipeline_parallel_plans_the_fullest_stage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Two stages of 16 layers: a block of one stage is 1 MiB, 40,960 blocks.
    for flag in ("--pipeline-parallel-size", "-pp"):
        doc = plan(capsys, "llama-3-1-8b", "--memory", "40GiB", flag, "2")
        assert doc["settings"]["pipeline_parallel_size"] == 2
        assert doc["settings"]["pipeline_stage"] in (0, 1)
        assert doc["summary"]["num_blocks"] == 40960
        assert "pipeline stage" in doc["verdict"]


def test_compare_takes_the_same_flags(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "compare",
        "--model",
        "llama-3-1-8b",
        "--kv-cache-memory-bytes",
        "40G",
        "-tp",
        "2",
        "--max-model-len",
        "32K",
        "--json",
    ]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"] == "Llama-3.1-8B"
    assert {p["num_blocks"] for p in doc["policies"]} == {40960}
