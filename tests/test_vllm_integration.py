"""kvcore.integrations.vllm without vLLM installed: the spec conversion (on
stand-ins with vLLM's class names and fields), the version check and the
entry point's switch.  vLLM's own scheduler tests run against the
integration in the peer suite (tests/peer/run_vllm_suite.py)."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import kvcore.integrations.vllm as kvcore_vllm
from kvcore.errors import InvalidSpecError, KvcoreError
from kvcore.integrations.vllm.specs import to_kvcore_config, to_kvcore_spec


def _spec(name: str, **fields: Any) -> Any:
    """An object of a class called ``name`` with vLLM's spec fields."""
    base = {
        "block_size": 16,
        "num_kv_heads": 2,
        "head_size": 64,
        "head_size_v": 64,
        "dtype": torch.float16,
    }
    base.update(fields)
    return type(name, (), base)()


def test_full_attention_and_window_specs_convert() -> None:
    full = to_kvcore_spec(_spec("FullAttentionSpec"))
    assert (full.kind, full.block_size, full.num_kv_heads, full.head_size) == (
        "full_attention",
        16,
        2,
        64,
    )
    window = to_kvcore_spec(
        _spec("SlidingWindowSpec", sliding_window=128, extra_retained_tokens=4)
    )
    assert (window.kind, window.sliding_window, window.extra_retained_tokens) == (
        "sliding_window",
        128,
        4,
    )
    local = to_kvcore_spec(_spec("ChunkedLocalAttentionSpec", attention_chunk_size=64))
    assert (local.kind, local.attention_chunk_size) == ("chunked_local_attention", 64)


def test_cross_attention_spec_converts() -> None:
    # Its blocks are sized by each request's encoder tokens at admission,
    # so the spec carries no encoder bound (vLLM's is a scheduler setting).
    cross = to_kvcore_spec(_spec("CrossAttentionSpec"))
    assert (cross.kind, cross.block_size, cross.num_kv_heads, cross.head_size) == (
        "cross_attention",
        16,
        2,
        64,
    )
    assert cross.max_encoder_tokens is None
    assert cross.num_blocks_held(0, 1000, 16) == 0


def test_config_converts_groups_and_block_count() -> None:
    config = SimpleNamespace(
        num_blocks=100,
        kv_cache_groups=[
            SimpleNamespace(
                layer_names=["l0", "l2"], kv_cache_spec=_spec("FullAttentionSpec")
            ),
            SimpleNamespace(
                layer_names=["l1"],
                kv_cache_spec=_spec(
                    "SlidingWindowSpec", sliding_window=32, extra_retained_tokens=0
                ),
            ),
        ],
    )
    out = to_kvcore_config(
        config,
        scheduler_block_size=16,
        hash_block_size=16,
        max_model_len=4096,
        enable_caching=True,
    )
    assert out.num_blocks == 100
    assert [g.layer_names for g in out.kv_cache_groups] == [["l0", "l2"], ["l1"]]
    assert [g.manager_spec.kind for g in out.kv_cache_groups] == [
        "full_attention",
        "sliding_window",
    ]
    assert (out.max_model_len, out.enable_prefix_caching) == (4096, True)


def test_unsupported_specs_are_refused_by_name() -> None:
    with pytest.raises(InvalidSpecError, match="group 3 has a vLLM ShortConvSpec"):
        to_kvcore_spec(_spec("ShortConvSpec"), group=3)
    with pytest.raises(InvalidSpecError, match="chunked-local or non-causal"):
        to_kvcore_spec(_spec("FullAttentionSpec", non_causal=True))
    with pytest.raises(InvalidSpecError, match="sparse-attention cache"):
        to_kvcore_spec(_spec("MLAAttentionSpec", model_version="deepseek_v4"))


def _mamba(**fields: Any) -> Any:
    base = {
        "block_size": 16,
        "shapes": ((3, 64), (8, 16)),
        "dtypes": (torch.float16, torch.float16),
        "page_size_padded": None,
        "mamba_cache_mode": "align",
        "num_speculative_blocks": 0,
        "num_prefill_checkpoint_blocks": 0,
        "tp_replicated": False,
    }
    base.update(fields)
    return type("MambaSpec", (), base)()


def test_mamba_specs_convert_with_step_end_checkpoints() -> None:
    """Align mode keeps only step-end states (vLLM's kernels write none
    inside a step); none mode only the live state."""
    align = to_kvcore_spec(_mamba(page_size_padded=4096))
    assert (align.kind, align.mamba_cache_mode, align.checkpoint_policy) == (
        "mamba",
        "align",
        "steps",
    )
    assert (align.shapes, align.page_size_bytes) == (((3, 64), (8, 16)), 4096)
    none = to_kvcore_spec(_mamba(mamba_cache_mode="none", num_speculative_blocks=2))
    assert (none.mamba_cache_mode, none.num_speculative_blocks) == ("none", 2)
    with pytest.raises(InvalidSpecError, match="group 2's MambaSpec asks for 1"):
        to_kvcore_spec(_mamba(num_speculative_blocks=1), group=2)
    with pytest.raises(InvalidSpecError, match="mamba_cache_mode='all'"):
        to_kvcore_spec(_mamba(mamba_cache_mode="all"))


def _fake_vllm(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    module = types.ModuleType("vllm")
    module.__version__ = version  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", module)


def test_other_vllm_releases_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_vllm(monkeypatch, "0.32.1")
    with pytest.raises(kvcore_vllm.VllmVersionError, match=r"found vLLM 0\.32\.1") as e:
        kvcore_vllm.install()
    assert isinstance(e.value, KvcoreError)
    assert isinstance(e.value, ImportError)
    with pytest.raises(kvcore_vllm.VllmVersionError, match=r"supports vLLM 0\.33\.0"):
        kvcore_vllm.KVCacheManager  # noqa: B018


def test_missing_vllm_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(
        kvcore_vllm.VllmVersionError, match=r"pip install 'kvcore\[vllm\]'"
    ):
        kvcore_vllm.check_vllm()


def test_entry_point_installs_only_when_switched_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Without vLLM, installing refuses: the refusal shows install() ran.
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.delenv("KVCORE_VLLM", raising=False)
    kvcore_vllm.register()
    monkeypatch.setenv("KVCORE_VLLM", "0")
    kvcore_vllm.register()
    monkeypatch.setenv("KVCORE_VLLM", "1")
    with pytest.raises(kvcore_vllm.VllmVersionError, match="kvcore\\[vllm\\]"):
        kvcore_vllm.register()
