"""kvcore's built-in architecture mappers: Hugging Face ``config.json`` to
layer specs, one module per architecture family.

Each module documents the ``config.json`` fields it reads and the public
source of every rule it applies; each mapper's name, architectures, model
types and sources are its entry of ``mappers.toml`` (:mod:`kvcore_hf.catalog`).  Mappers produce one unsharded model;
kvcore applies the serving choices (cache dtype, block size, tensor
parallelism) afterwards, the way ``kvcore plan --tp`` does for model files.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import attrs
import torch

from kvcore.hookspecs import hookimpl
from kvcore.limits import HUB_CONNECT_TIMEOUT_S
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
    ModelConfig,
    ModelMapper,
    _hub_address,
    default_mappers,
    is_hub_id,
    load_hf_config,
    map_model_config,
    read_model_config,
)
from kvcore_hf.weights import hub_checkpoint_bytes

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
    hub = False
    if allow_hub:
        if not Path(source).exists() and not is_hub_id(source):
            return None
        hub = not Path(source).exists()
        config = read_model_config(source)
    else:
        config = load_hf_config(source)
    model = map_model_config(
        config, choices, mappers=default_mappers(), registry=registry
    )
    return with_hub_weights(model, source, config) if hub else model


def with_hub_weights(
    model: ModelFile, repo_id: str, config: ModelConfig, *, fetch: Any = None
) -> ModelFile:
    """``model`` with the weights its hub repository's safetensors headers
    add up to, when the hub answers; else unchanged (the estimate from the
    configuration stays).  ``fetch`` replaces the hub call in tests; without
    it the hub's host must answer a connection within
    :data:`~kvcore.limits.HUB_CONNECT_TIMEOUT_S` first (a cached
    ``config.json`` with no network costs one short wait, not retries)."""
    if fetch is None and not _hub_reachable():
        return model
    found = hub_checkpoint_bytes(
        repo_id,
        served_float32_halved=config.model_dtype() == torch.bfloat16
        and _declares_float32(config),
        fetch=fetch,
    )
    if found is None:
        return model
    notes = [
        n
        for n in model.notes.split("; ")
        if not n.startswith(("weights estimated", "weights not estimated"))
    ]
    notes.append(f"weights {found:,} bytes from the hub's safetensors metadata")
    return attrs.evolve(model, weights_bytes=found, notes="; ".join(notes))


def _hub_reachable() -> bool:
    """Whether the hub's host takes a connection (never when offline)."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    if constants.HF_HUB_OFFLINE:
        return False
    host, port = _hub_address(str(constants.ENDPOINT))
    try:
        socket.create_connection((host, port), timeout=HUB_CONNECT_TIMEOUT_S).close()
    except OSError:
        return False
    return True


def _declares_float32(config: ModelConfig) -> bool:
    for part in (config.text, config.root):
        for key in ("torch_dtype", "dtype"):
            value = part.get(key)
            if isinstance(value, str):
                return value.lower() in ("float32", "float")
    return False
