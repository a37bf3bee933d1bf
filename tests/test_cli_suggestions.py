"""Bad guesses get help: close matches for GPUs, shipped models, kinds and
options, a hint for a config.json given as MODEL, a warning past the model's
trained length, and a hub id that fails at once with no network."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from kvcore.errors import UnknownKindError
from kvcore.registry import default_registry
from kvcore.tools import zoo
from kvcore.tools.accelerators import UnknownAcceleratorError, find_accelerator
from kvcore.tools.cli import main

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's own errors
        code = int(exc.code or 0)
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_gpu_spellings_resolve_or_are_suggested() -> None:
    assert find_accelerator("A100-80G").name == "A100 80GB"
    assert find_accelerator("h100-pcie").name == "H100 80GB"
    with pytest.raises(UnknownAcceleratorError) as info:
        find_accelerator("H10")
    assert "unknown GPU 'H10' (did you mean 'H100 80GB' or " in str(info.value)
    with pytest.raises(UnknownAcceleratorError) as info:
        find_accelerator("Z9")
    assert "did you mean" not in str(info.value)


def test_model_names_normalise_dots_case_and_the_display_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert zoo.normalize("Llama-3.1-8B") == "llama-3-1-8b"
    assert zoo.normalize("llama_3.1_8b") == "llama-3-1-8b"
    assert zoo.normalize("DeepSeek-V3.2-Exp") == "deepseek-v3-2-exp"
    # Every name kvcore prints finds its own file.
    for stem in zoo.names():
        shown = json.loads(zoo.path(stem).read_text())["name"]
        assert zoo.path(shown) == zoo.path(stem)
    for given in ("llama-3.1-8b", "Llama-3.1-8B"):
        assert main(["plan", given, "--memory", "40GiB", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["model"]["name"] == "Llama-3.1-8B"
    message = error(capsys, "plan", "lama-3-1-8b")
    assert "no shipped model file 'lama-3-1-8b' (did you mean 'llama-3-1-8b'?)" in (
        message
    )


def test_an_unknown_kind_is_matched_to_the_installed_ones() -> None:
    with pytest.raises(UnknownKindError) as info:
        default_registry()["full_atention"]
    assert "(did you mean 'full_attention'" in str(info.value)


def test_an_unknown_option_is_matched_to_the_commands_options(
    capsys: pytest.CaptureFixture[str],
) -> None:
    message = error(capsys, "plan", "llama-3-1-8b", "--tensor-paralel-size", "2")
    assert "(did you mean '--tensor-parallel-size'" in message
    message = error(capsys, "plan", "llama-3-1-8b", "--gpus", "H100")
    assert "--gpus (did you mean '--gpu'" in message
    # simulate's own options are not offered to plan.
    assert "--turns" not in message
    assert "did you mean" not in error(capsys, "plan", "--zzzzzz")


def test_a_config_json_as_model_gets_the_hf_config_hint(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = FIXTURES / "llama-3-1-8b" / "config.json"
    message = error(capsys, "plan", str(config))
    assert f"plan it with `--hf-config {config}`" in message
    # A file of another name is recognised by its fields.
    other = Path("tests") / "fixtures" / "hf" / "gemma-3-27b" / "config.json"
    assert "--hf-config" in error(capsys, "plan", str(other))


def test_a_context_past_max_position_embeddings_warns(
    capsys: pytest.CaptureFixture[str],
) -> None:
    source = str(FIXTURES / "llama-3-1-8b")
    args = ["plan", "--hf-config", source, "--memory", "40GiB"]
    assert main([*args, "--context", "32K,256K", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["notes"][0].startswith(
        "warning: 256K tokens is past the model's max_position_embeddings (131,072)"
    )
    assert main([*args, "--context", "32K", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert not any("max_position_embeddings" in n for n in doc["notes"])
    # --max-model-len auto is the model's own length, as vLLM derives it.
    assert main([*args, "--max-model-len", "auto", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["settings"]["contexts"] == [131072]


def test_a_hub_id_with_no_network_fails_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    huggingface_hub = pytest.importorskip("huggingface_hub")
    from huggingface_hub import constants

    from kvcore_hf import mapping

    downloads: list[object] = []
    attempts: list[tuple[object, ...]] = []

    def unreachable(address: object, timeout: float = 0.0) -> socket.socket:
        attempts.append((address, timeout))
        raise OSError("Network is unreachable")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(mapping.socket, "create_connection", unreachable)
    monkeypatch.setattr(
        huggingface_hub, "hf_hub_download", lambda *a, **k: downloads.append(a)
    )
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)
    with pytest.raises(mapping.ModelConfigError, match="cannot be reached within 3 s"):
        mapping.fetch_hub_config("org/not-cached")
    assert downloads == []
    assert attempts == [(("huggingface.co", 443), mapping.HUB_CONNECT_TIMEOUT_S)]
