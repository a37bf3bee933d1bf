"""kvcore's built-in architecture mappers: Hugging Face ``config.json`` to
layer specs, one module per architecture family.

Each module documents the ``config.json`` fields it reads and the public
source of every rule it applies.  Mappers produce one unsharded model;
kvcore applies the serving choices (cache dtype, block size, tensor
parallelism) afterwards, the way ``kvcore plan --tp`` does for model files.
"""

from __future__ import annotations

from pathlib import Path

from kvcore.hookspecs import hookimpl
from kvcore.registry import KindRegistry
from kvcore.serialize import ModelFile
from kvcore.serving import ServingChoices
from kvcore_hf import (
    deepseek,
    falcon_h1,
    gemma,
    glm,
    gpt_oss,
    jamba,
    kimi,
    llama,
    minimax,
    mistral,
    nemotron_h,
    qwen,
    qwen3_next,
)
from kvcore_hf.mapping import (
    ModelMapper,
    default_mappers,
    is_hub_id,
    load_hf_config,
    map_model_config,
    read_model_config,
)

__all__ = ["MAPPERS"]

#: Every built-in mapper, in the order they are asked.
MAPPERS: tuple[ModelMapper, ...] = (
    *llama.MAPPERS,
    *qwen.MAPPERS,
    *mistral.MAPPERS,
    *gemma.MAPPERS,
    *gpt_oss.MAPPERS,
    *glm.MAPPERS,
    *jamba.MAPPERS,
    *nemotron_h.MAPPERS,
    *falcon_h1.MAPPERS,
    *qwen3_next.MAPPERS,
    *deepseek.MAPPERS,
    *kimi.MAPPERS,
    *minimax.MAPPERS,
)


@hookimpl
def kvcore_register_model_mappers() -> list[ModelMapper]:
    return list(MAPPERS)


@hookimpl
def kvcore_read_model(
    source: str, choices: ServingChoices, registry: KindRegistry, allow_hub: bool
) -> ModelFile | None:
    """A ``config.json`` (file or directory) or, where allowed, a hub id,
    mapped by the installed mappers; None for a source that is neither."""
    if allow_hub:
        if not Path(source).exists() and not is_hub_id(source):
            return None
        config = read_model_config(source)
    else:
        config = load_hf_config(source)
    return map_model_config(
        config, choices, mappers=default_mappers(), registry=registry
    )
