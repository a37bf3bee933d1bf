"""kvcore's built-in architecture mappers: Hugging Face ``config.json`` to
layer specs, one module per architecture family.

Each module documents the ``config.json`` fields it reads and the public
source of every rule it applies.  Mappers produce one unsharded model;
kvcore applies the serving choices (cache dtype, block size, tensor
parallelism) afterwards, the way ``kvcore plan --tp`` does for model files.
"""

from __future__ import annotations

from kvcore.hookspecs import hookimpl
from kvcore.mapping import ModelMapper
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
