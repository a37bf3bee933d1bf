"""The ``vllm`` policy reproduces vLLM 0.33's plan and logged figures.

The numbers are vLLM 0.33's own (``/work/shared/baselines/capacity.json``,
64 GiB, and its log line for DeepSeek-V4-Flash), pinned here so the suite
needs no vLLM; ``benchmarks/vllm_agreement.py`` checks random models against
vLLM itself.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from kvcore.plugins import get_plugin_manager
from kvcore.registry import KindRegistry
from kvcore.serialize import load_model_file
from kvcore.tools import zoo
from kvcore_vllm import in_flight_tokens, vllm_estimate

GIB = 2**30
CONTEXTS = (4096, 32768, 131072)
#: vLLM 0.33's concurrency at 64 GiB with no in-flight reservation
#: (capacity.json, vllm_default then vllm_packed); None: vLLM refuses.
VLLM = {
    "deepseek-v3-2-exp": ((214.1875, 26.7734, 6.6934), (214.1875, 26.7734, 6.6934)),
    "deepseek-v3": ((238.7344, 29.8418, 7.4604), (238.7344, 29.8418, 7.4604)),
    "deepseek-v4-flash": (None, (1523.6667, 436.7197, 126.7375)),
    "gemma-3-27b": ((81.1579, 21.5045, 6.1091), (81.1579, 21.5045, 6.1091)),
    "gpt-oss-120b": ((439.6528, 56.6398, 14.2066), (439.6528, 56.6398, 14.2066)),
    "jamba-1-5-mini": ((888.6102, 125.7266, 31.8518), (888.6102, 125.7266, 31.8518)),
    "llama-3-1-8b": ((128.0, 16.0, 4.0), (128.0, 16.0, 4.0)),
    "llama-4-scout-17b-16e": ((85.333, 24.3809, 8.9824), (85.333, 24.3809, 8.9824)),
    "qwen3-next-80b-a3b": ((467.2727, 80.3125, 21.0656), (467.2727, 80.3125, 21.0656)),
}


#: kvcore's built-in kinds and hooks only (no entry point loaded), so the
#: figures do not depend on what else is installed.
REGISTRY = KindRegistry.from_plugin_manager(
    get_plugin_manager(load_entrypoints=False), override=()
)


def _layers(name: str) -> dict[str, object]:
    return dict(load_model_file(zoo.path(name), REGISTRY).layers)


@pytest.mark.parametrize("name", sorted(VLLM))
@pytest.mark.parametrize("packed", [False, True])
def test_figures_equal_vllm_on_the_shipped_models(name: str, packed: bool) -> None:
    want = VLLM[name][packed]
    estimate = vllm_estimate(
        _layers(name),
        64 * GIB,
        CONTEXTS,
        in_flight=0,
        mamba_cache_mode="none",
        block_outermost=packed,
    )
    if want is None:
        assert estimate.refused
        assert "default layout" in (estimate.refusal or "")
        return
    assert not estimate.refused, estimate.refusal
    got = tuple(round(f.concurrency, 4) for f in estimate.figures)
    assert got == want
    for figure in estimate.figures:
        assert figure.tokens == int(figure.concurrency * figure.context)


def test_in_flight_reservation_is_what_vllm_logs_for_deepseek_v4() -> None:
    # vLLM 0.33 logs 102.49x at 32k for DeepSeek-V4-Flash in BLNHC with
    # vllm serve's 8192-token batches and async scheduling (16,384 in flight).
    assert in_flight_tokens(8192) == 16_384
    assert in_flight_tokens(8192, pipeline_parallel_size=2) == 3 * 8192
    estimate = vllm_estimate(
        _layers("deepseek-v4-flash"), 64 * GIB, [32768], block_outermost=True
    )
    (figure,) = estimate.figures
    assert round(figure.concurrency, 2) == 102.49
    assert figure.tokens == 3_358_352


def test_gemma_window_layers_hold_the_in_flight_tokens() -> None:
    # 52 window layers in 6 groups each hold cdiv(1023 + 16384, 16) + 1 =
    # 1089 blocks, the 10 global layers 2048: 52428 / (6 * 1089 + 2048).
    (figure,) = vllm_estimate(_layers("gemma-3-27b"), 64 * GIB, [32768]).figures
    assert figure.concurrency == pytest.approx(52428 / (6 * 1089 + 2048))


def test_pool_too_small_for_one_request_is_refused_with_the_longest() -> None:
    estimate = vllm_estimate(_layers("llama-3-1-8b"), 2 * GIB, [131072])
    assert estimate.refused
    assert "the longest that fits is" in (estimate.refusal or "")


def test_policy_is_reachable_through_the_registry() -> None:
    from kvcore.config import CacheConfig, EngineConfig

    config = EngineConfig(cache_config=CacheConfig(enable_prefix_caching=False))
    estimate = REGISTRY.engine_estimate(
        "vllm", config, _layers("qwen3-next-80b-a3b"), 64 * GIB, [4096]
    )
    assert estimate is not None
    # 5140 blocks of 544-token pages; 8 + 3 state blocks per request.
    assert estimate.figures[0].concurrency == pytest.approx(5140 / 11)
    assert REGISTRY.engine_estimate("nope", config, {}, 1, [1]) is None


def test_compare_lists_vllm_first_with_the_gain() -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvcore.tools.cli",
            "compare",
            "gemma-3-27b",
            "--memory",
            "64GiB",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    first, *rest = doc["policies"]
    assert first["policy"] == "vllm"
    assert first["capacity"][0]["concurrency"] == pytest.approx(
        52428 / (6 * 1089 + 2048)
    )
    for row in rest:
        cap = row["capacity"][0]
        assert cap["gain_over_vllm"] == pytest.approx(
            cap["concurrency"] / first["capacity"][0]["concurrency"]
        )


#: vLLM 0.33's own log figures (its get_kv_cache_configs and
#: get_kv_cache_capacity, run by benchmarks/vllm_agreement.py --zoo) at
#: 64 GiB in its default layout as ``vllm serve`` runs it: 8,192-token
#: batches, async scheduling, Mamba states at the hybrid alignment.
SERVE = {
    ("gemma-3-27b", 4096): 119_435,
    ("gemma-3-27b", 32768): 200_181,
    ("gemma-3-27b", 131072): 466_646,
    ("gpt-oss-120b", 32768): 1_239_121,
    ("llama-4-scout-17b-16e", 32768): 430_183,
    ("llama-4-scout-17b-16e", 131072): 894_781,
    ("jamba-1-5-mini", 32768): 4_119_809,
    ("qwen3-next-80b-a3b", 4096): 1_913_949,
    ("deepseek-v3", 131072): 977_856,
}


@pytest.mark.parametrize(("name", "context"), sorted(SERVE))
def test_tokens_equal_vllm_serve_log(name: str, context: int) -> None:
    estimate = vllm_estimate(_layers(name), 64 * GIB, [context])
    (figure,) = estimate.figures
    assert figure.tokens == SERVE[name, context]


def _agreement_module() -> Any:
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "vllm_agreement.py"
    spec = importlib.util.spec_from_file_location("vllm_agreement", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: Random model files with the figures vLLM 0.33's own functions gave them
#: (written by ``benchmarks/vllm_agreement.py --write-cases``).
CASES = Path(__file__).resolve().parent / "fixtures" / "vllm_agreement_cases.json"


def test_policy_agrees_with_vllm_on_stored_random_models() -> None:
    bench = _agreement_module()
    cases = bench.expand(json.loads(CASES.read_text()))
    assert len(cases) >= 100
    refused = [c for c in cases if "refusal" in c["vllm"]]
    assert refused, "the stored cases include vLLM's refusals"
    bad = [
        c["name"] for c in cases if not bench.agree(c["vllm"], bench.policy_figures(c))
    ]
    assert bad == []


def test_agreement_check_notices_a_wrong_figure() -> None:
    bench = _agreement_module()
    right = {"tokens": 100, "concurrency": 1.5}
    assert bench.agree(right, dict(right))
    assert not bench.agree(right, {"tokens": 101, "concurrency": 1.5})
    assert not bench.agree(right, {"refusal": "no"})
