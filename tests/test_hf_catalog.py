"""The built-in mappers' identities come from ``kvcore_hf/mappers.toml``."""

from __future__ import annotations

import tomllib
from importlib.resources import files

import pytest

import kvcore_hf
from kvcore.errors import PluginError
from kvcore_hf.catalog import CATALOG_FILE, catalog, declared
from kvcore_hf.deepseek import DeepseekMLA, DeepseekV32
from kvcore_hf.mapping import ModelMapper
from kvcore_hf.mistral import Mistral, Mixtral


def _raw() -> dict[str, dict[str, object]]:
    return tomllib.loads(files("kvcore_hf").joinpath(CATALOG_FILE).read_text("utf-8"))


def test_every_entry_is_one_built_in_mapper_in_order() -> None:
    assert list(catalog()) == [m.name for m in kvcore_hf.MAPPERS]
    for mapper in kvcore_hf.MAPPERS:
        entry = catalog()[mapper.name]
        assert mapper.architectures == entry.architectures
        assert mapper.model_types == entry.model_types
        assert mapper.sources == entry.sources
        assert mapper.sources, mapper.name


def test_shared_citations_are_cited_by_two_mappers_and_expanded() -> None:
    shared = _raw()["shared"]
    for key, text in shared.items():
        citing = [m.name for m in kvcore_hf.MAPPERS if text in m.sources]
        assert len(citing) >= 2, key
    assert not any(s.startswith("@") for m in kvcore_hf.MAPPERS for s in m.sources)
    assert DeepseekV32.sources[:2] == DeepseekMLA.sources[:2]
    assert DeepseekMLA.sources[1] == (
        "DeepSeek-V2 paper arXiv 2405.04434 section 2.1 (cached c_KV and k_R)"
    )


def test_a_subclass_takes_its_own_entry() -> None:
    assert (Mistral.name, Mistral.architectures) == ("mistral", ("MistralForCausalLM",))
    assert (Mixtral.name, Mixtral.model_types) == ("mixtral", ("mixtral",))
    assert Mixtral.sources != Mistral.sources


def test_a_name_without_an_entry_is_refused_with_the_fix() -> None:
    with pytest.raises(
        PluginError, match=r"no entry for mapper 'nope'.*\[mapper\.nope\]"
    ):

        @declared("nope")
        class Nope(ModelMapper):
            pass
