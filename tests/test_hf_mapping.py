"""Model files from Hugging Face ``config.json`` files: the mapper registry,
its errors, nested configurations, cache dtypes from quantization settings,
and the shipped model files reproduced from their configurations.

Fixtures under ``tests/fixtures/hf/NAME/config.json`` are written from the
public configurations' documented fields; every fixture named like a
shipped model file must map to that file's specs, layer for layer.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch

import kvcore
import kvcore.tools.zoo
import kvcore_hf
from kvcore.serialize import load_model_file
from kvcore.serving import ServingChoices
from kvcore.spec import KVCacheSpec
from kvcore_full_attention import FullAttentionSpec
from kvcore_hf.mapping import (
    MapperRegistry,
    ModelConfig,
    ModelConfigError,
    ModelMapper,
    UnknownArchitectureError,
    load_hf_config,
    map_model_config,
)

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
MAPPERS = MapperRegistry.from_mappers(kvcore_hf.MAPPERS)
SHIPPED = sorted(
    p.name
    for p in FIXTURES.iterdir()
    if (p / "config.json").is_file() and p.name in kvcore.tools.zoo.names()
)


def test_every_fixture_named_like_a_shipped_file_is_checked() -> None:
    assert "llama-3-1-8b" in SHIPPED
    assert "llama-4-scout-17b-16e" in SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_the_mapper_reproduces_the_shipped_model_file(
    name: str, zoo_registry: kvcore.KindRegistry
) -> None:
    shipped = load_model_file(kvcore.tools.zoo.path(name), registry=zoo_registry)
    mapped = map_model_config(
        load_hf_config(FIXTURES / name), mappers=MAPPERS, registry=zoo_registry
    )
    assert list(mapped.layers) == list(shipped.layers)
    for layer, spec in shipped.layers.items():
        assert mapped.layers[layer] == spec, layer


def test_a_directory_is_read_through_its_config_json() -> None:
    config = load_hf_config(FIXTURES / "llama-3-1-8b")
    assert config.where.endswith("llama-3-1-8b/config.json")
    assert config.architectures == ("LlamaForCausalLM",)


def test_the_language_model_of_a_composite_config_is_found() -> None:
    config = load_hf_config(FIXTURES / "llama-4-scout-17b-16e")
    assert config.prefix == "text_config."
    assert config.field("num_hidden_layers") == 48
    assert config.model_types == ("llama4_text", "llama4")


LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 2,
    "torch_dtype": "float16",
}


def test_head_dim_defaults_to_hidden_over_heads_and_dtype_to_the_weights() -> None:
    model = map_model_config(LLAMA, mappers=MAPPERS)
    assert list(model.layers) == [
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
    ]
    assert model.layers["model.layers.0.self_attn"] == FullAttentionSpec(
        block_size=16, num_kv_heads=8, head_size=64, dtype=torch.float16
    )


def test_an_unknown_architecture_lists_the_known_ones() -> None:
    with pytest.raises(UnknownArchitectureError) as info:
        map_model_config(
            {"architectures": ["FooForCausalLM"], "model_type": "foo"},
            mappers=MAPPERS,
        )
    msg = str(info.value)
    assert "no model mapper knows architecture FooForCausalLM / model_type foo" in msg
    assert "LlamaForCausalLM" in msg
    assert "llama4_text" in msg
    assert isinstance(info.value, KeyError)


def test_a_missing_field_names_the_field_and_the_file(tmp_path: Path) -> None:
    data = {k: v for k, v in LLAMA.items() if k != "num_hidden_layers"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ModelConfigError) as info:
        map_model_config(load_hf_config(path), mappers=MAPPERS)
    assert str(info.value) == (
        f"{path}: field num_hidden_layers is missing; the mapper for "
        "LlamaForCausalLM needs it"
    )
    assert isinstance(info.value, ValueError)


def test_a_field_of_the_wrong_type_is_refused() -> None:
    with pytest.raises(ModelConfigError, match=r"num_key_value_heads must be int"):
        map_model_config({**LLAMA, "num_key_value_heads": "8"}, mappers=MAPPERS)
    with pytest.raises(ModelConfigError, match=r"num_hidden_layers must be int"):
        map_model_config({**LLAMA, "num_hidden_layers": True}, mappers=MAPPERS)


@pytest.mark.parametrize("kv", [3, 64])
def test_kv_heads_that_do_not_divide_the_query_heads_are_refused(kv: int) -> None:
    # 64 KV heads for 32 query heads, or 3 for 32, is no grouped-query
    # attention: planning it would size a cache no engine builds.
    with pytest.raises(ModelConfigError) as info:
        map_model_config({**LLAMA, "num_key_value_heads": kv}, mappers=MAPPERS)
    assert f"num_key_value_heads {kv} does not divide num_attention_heads 32" in str(
        info.value
    )
    assert "give a divisor of num_attention_heads" in str(info.value)
    assert isinstance(info.value, ValueError)
    assert map_model_config({**LLAMA, "num_key_value_heads": 32}, mappers=MAPPERS)


@pytest.mark.parametrize(
    ("settings", "dtype"),
    [
        (
            {
                "quantization_config": {
                    "kv_cache_scheme": {"num_bits": 8, "type": "float"}
                }
            },
            torch.float8_e4m3fn,
        ),
        ({"quantization_config": {"kv_cache_quant_algo": "FP8"}}, torch.float8_e4m3fn),
        ({"kv_cache_dtype": "fp8_e5m2"}, torch.float8_e5m2),
        ({}, torch.float16),
    ],
    ids=["compressed-tensors", "modelopt", "top-level", "none"],
)
def test_the_cache_dtype_comes_from_the_quantization_settings(
    settings: dict[str, Any], dtype: torch.dtype
) -> None:
    model = map_model_config({**LLAMA, **settings}, mappers=MAPPERS)
    assert {s.dtype for s in model.layers.values()} == {dtype}


def test_an_explicit_cache_dtype_overrides_the_file() -> None:
    data = {**LLAMA, "quantization_config": {"kv_cache_quant_algo": "FP8"}}
    model = map_model_config(data, mappers=MAPPERS)
    served = kvcore.serving.apply_serving_choices(
        model.layers, ServingChoices(kv_cache_dtype="bf16")
    )
    assert {s.dtype for s in served.layers.values()} == {torch.bfloat16}


def test_tensor_parallelism_applies_after_mapping() -> None:
    model = map_model_config(LLAMA, mappers=MAPPERS)
    for tp, heads in ((2, 4), (8, 1), (16, 1)):
        served = kvcore.serving.apply_serving_choices(
            model.layers, ServingChoices(tensor_parallel_size=tp)
        )
        spec = served.layers["model.layers.0.self_attn"]
        assert spec.num_kv_heads == heads, tp  # type: ignore[attr-defined]
        # 16 ranks over 8 KV heads: each head on two ranks.
        assert bool(served.replicated_layers) == (tp > 8)


def test_duplicate_keys_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "model_type": "qwen2"}')
    with pytest.raises(ModelConfigError, match="key 'model_type' appears twice"):
        load_hf_config(path)


def test_a_missing_file_says_what_to_give(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match=r"no such config\.json"):
        load_hf_config(tmp_path)


class FirstLayerOnly(ModelMapper):
    """A third party's mapper for Llama: it is asked before the built-in one
    and its answer wins."""

    name: ClassVar[str] = "first-layer-only"
    architectures: ClassVar[tuple[str, ...]] = ("LlamaForCausalLM",)

    def layer_specs(
        self, config: ModelConfig, choices: ServingChoices
    ) -> dict[str, KVCacheSpec]:
        return {
            "only": FullAttentionSpec(
                block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16
            )
        }


class Declines(ModelMapper):
    name: ClassVar[str] = "declines"
    architectures: ClassVar[tuple[str, ...]] = ("LlamaForCausalLM",)

    def layer_specs(self, config: ModelConfig, choices: ServingChoices) -> None:
        return None


class PluginFirst:
    @kvcore.hookimpl
    def kvcore_register_model_mappers(self) -> list[ModelMapper]:
        return [Declines(), FirstLayerOnly()]


def test_a_later_plugin_is_asked_first_and_none_defers() -> None:
    pm = kvcore.get_plugin_manager(load_entrypoints=False)
    pm.register(PluginFirst(), name="third-party")
    mappers = MapperRegistry.from_plugin_manager(pm)
    names = [m.name for m in mappers]
    assert names[:2] == ["declines", "first-layer-only"]
    assert "llama" in names
    model = map_model_config(LLAMA, mappers=mappers)
    assert list(model.layers) == ["only"]


class Broken:
    @kvcore.hookimpl
    def kvcore_register_model_mappers(self) -> Any:
        return FirstLayerOnly()


def test_a_registration_that_is_not_a_list_names_the_plugin() -> None:
    pm = kvcore.get_plugin_manager(load_entrypoints=False)
    pm.register(Broken(), name="broken-mappers")
    with pytest.raises(kvcore.PluginError, match="plugin 'broken-mappers'"):
        MapperRegistry.from_plugin_manager(pm)


class ReturnsGarbage(ModelMapper):
    name: ClassVar[str] = "garbage"
    architectures: ClassVar[tuple[str, ...]] = ("LlamaForCausalLM",)

    def layer_specs(self, config: ModelConfig, choices: ServingChoices) -> Any:
        return {"layer": "not a spec"}


def test_what_a_mapper_returns_is_checked() -> None:
    with pytest.raises(kvcore.PluginError, match="mapper 'garbage'"):
        map_model_config(LLAMA, mappers=MapperRegistry.from_mappers([ReturnsGarbage()]))


# ---------------------------------------------------------------------------
# kvcore convert, and hub ids through huggingface_hub
# ---------------------------------------------------------------------------


def _convert(*args: str, env: dict[str, str] | None = None) -> Any:
    import os
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "kvcore.tools.cli", "convert", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        check=False,
    )


def test_convert_writes_a_model_file_that_plans_like_the_mapping(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # In process; the hub test below runs ``python -m kvcore.tools.cli``.
    from kvcore.tools.cli import main

    out = tmp_path / "model.json"
    code = main(
        ["convert", "--hf-config", str(FIXTURES / "llama-3-1-8b"), "-o", str(out)]
    )
    stderr = capsys.readouterr().err
    assert code == 0, stderr
    assert "wrote" in stderr
    assert "32 cache layers" in stderr
    written = load_model_file(out)
    mapped = map_model_config(
        load_hf_config(FIXTURES / "llama-3-1-8b"), mappers=MAPPERS
    )
    assert written.layers == mapped.layers
    assert written.name == "meta-llama/Llama-3.1-8B"


def _hub_cache(root: Path, repo: str, config: Path) -> None:
    """A cache laid out as huggingface_hub lays it out: refs/main names the
    snapshot that holds config.json."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(config.read_text())


def _reads_the_local_cache_offline(root: Path, convert: Any) -> None:
    """``convert(hub_id)`` with ``root`` as the hub cache and the hub offline:
    a cached config converts, a missing one is a one-line error naming the
    cache."""
    _hub_cache(
        root, "meta-llama/Llama-3.1-8B", FIXTURES / "llama-3-1-8b" / "config.json"
    )
    proc = convert("meta-llama/Llama-3.1-8B")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert len(data["layers"]) == 32
    assert "meta-llama/Llama-3.1-8B (config.json)" in data["notes"]

    missing = convert("meta-llama/Llama-3.1-70B")
    assert missing.returncode == 2
    last = missing.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "kvcore: error: meta-llama/Llama-3.1-70B: config.json is not in the local hub cache"
    )
    assert str(root) in last


def test_a_hub_id_is_read_from_the_local_cache_offline(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    constants = pytest.importorskip("huggingface_hub.constants")
    from kvcore.tools.cli import main

    # In process: the settings HF_HUB_CACHE and HF_HUB_OFFLINE give
    # huggingface_hub as it is imported (the slow twin below sets the
    # variables for a new ``python -m kvcore.tools.cli``).
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def convert(*args: str) -> Any:
        code = main(["convert", *args])
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out, stderr=err)

    _reads_the_local_cache_offline(tmp_path, convert)


@pytest.mark.slow  # two new processes; the test above runs the same in process
def test_a_hub_id_is_read_from_the_local_cache_offline_by_a_new_process(
    tmp_path: Path,
) -> None:
    pytest.importorskip("huggingface_hub")
    env = {"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    _reads_the_local_cache_offline(tmp_path, lambda *args: _convert(*args, env=env))


def test_without_huggingface_hub_a_hub_id_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    from kvcore.errors import MissingExtraError
    from kvcore_hf.mapping import fetch_hub_config

    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'kvcore\[hf\]'"):
        fetch_hub_config("meta-llama/Llama-3.1-8B")


@pytest.mark.parametrize("text", ["llama", "../x/y", "a/b/c", "/abs/path", "org/"])
def test_only_org_slash_name_reads_as_a_hub_id(text: str) -> None:
    from kvcore_hf.mapping import is_hub_id

    assert not is_hub_id(text)
    assert is_hub_id("Qwen/Qwen3-8B")


def test_the_docs_list_every_built_in_mapper() -> None:
    text = (Path(__file__).parent.parent / "docs" / "hf-config.md").read_text()
    for mapper in kvcore_hf.MAPPERS:
        module = type(mapper).__module__
        row = f"| `{mapper.name}` | `{module}` | " + ", ".join(
            f"`{a}`" for a in mapper.architectures
        )
        assert row in text, mapper.name


def test_plan_from_a_config_json_matches_the_shipped_file(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The CLI planned from Gemma-3-27B's config.json gives the shipped
    file's answer (62 requests of 32k on two H100s at fp8, hand-worked in
    test_cli.py)."""
    from kvcore.tools.cli import main

    args = [
        "--gpu",
        "H100",
        "--tp",
        "2",
        "--kv-cache-dtype",
        "fp8",
        "--weights",
        "55GB",
        "--context",
        "32K",
    ]
    assert main(["plan", "--hf-config", str(FIXTURES / "gemma-3-27b"), *args]) == 0
    mapped = capsys.readouterr().out.splitlines()[0]
    assert main(["plan", "gemma-3-27b", *args]) == 0
    shipped = capsys.readouterr().out.splitlines()[0]
    assert mapped.endswith(": 62 requests of 32K tokens (limit 63, 1.00)")
    assert mapped.split(" on ", 1)[1] == shipped.split(" on ", 1)[1]


def test_plan_refuses_a_model_and_a_config_together(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvcore.tools.cli import main

    code = main(["plan", "llama-3-1-8b", "--hf-config", str(FIXTURES / "llama-3-1-8b")])
    assert code == 2
    assert "give a MODEL or --hf-config, not both" in capsys.readouterr().err


def test_a_hub_that_never_answers_is_an_error_within_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A trickling or retrying hub gives up at kvcore's own deadline."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    import threading

    from kvcore_hf import mapping

    release = threading.Event()
    monkeypatch.setattr(mapping, "_check_hub_reachable", lambda *args: None)
    monkeypatch.setattr(mapping, "HUB_FETCH_TIMEOUT_S", 0.2)
    monkeypatch.setattr(
        huggingface_hub, "hf_hub_download", lambda *a, **k: release.wait(30) or ""
    )
    try:
        with pytest.raises(
            ModelConfigError, match=r"did not deliver config.json within 0.2 s"
        ):
            mapping.fetch_hub_config("org/model")
    finally:
        release.set()


@pytest.mark.parametrize(
    ("raised", "shown"),
    [
        (ValueError("Repo id must be in the form 'repo_name'"), "ValueError"),
        (RuntimeError("Exceeded 30 redirects."), "RuntimeError"),
    ],
)
def test_any_hub_failure_is_a_model_config_error(
    monkeypatch: pytest.MonkeyPatch, raised: Exception, shown: str
) -> None:
    huggingface_hub = pytest.importorskip("huggingface_hub")
    from kvcore_hf import mapping

    def fail(*args: object, **kwargs: object) -> str:
        raise raised

    monkeypatch.setattr(mapping, "_check_hub_reachable", lambda *args: None)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fail)
    with pytest.raises(
        ModelConfigError, match=f"cannot fetch config.json \\({shown}: "
    ):
        mapping.fetch_hub_config("org/na--me")


def test_a_config_of_ten_million_layers_is_refused_before_building(
    tmp_path: Path,
) -> None:
    data = json.loads((FIXTURES / "llama-3-1-8b" / "config.json").read_text())
    data["num_hidden_layers"] = 10**7
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ModelConfigError, match="more than kvcore's limit of 100,000"):
        map_model_config(load_hf_config(path), mappers=MAPPERS)


def test_a_model_name_with_control_characters_is_escaped(tmp_path: Path) -> None:
    data = json.loads((FIXTURES / "llama-3-1-8b" / "config.json").read_text())
    data["_name_or_path"] = "evil\x1b[2J" + "x" * 1000
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    model = map_model_config(load_hf_config(path), mappers=MAPPERS)
    assert model.name.startswith("evil\\x1b[2J")
    assert model.name.isprintable()
    assert len(model.name) == 256
