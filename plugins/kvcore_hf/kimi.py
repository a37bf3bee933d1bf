"""Kimi-Linear (``KimiLinearForCausalLM``, ``model_type`` ``kimi_linear``):
Kimi Delta Attention (KDA) layers with a recurrent state, and MLA layers.

Layer ``i`` is a KDA layer when ``i + 1`` is in
``linear_attn_config.kda_layers`` (1-based), else an MLA layer, as vLLM
decides; ``full_attn_layers``, which lists the others, is not read (vLLM
does not read it either).  Source: vLLM
``transformers_utils/configs/kimi_linear.py``
(``KimiLinearConfig.is_kda_layer``) and
``model_executor/models/kimi_linear.py`` (``KimiDecoderLayer``:
``KimiDeltaAttention`` or ``KimiMLAAttention`` as
``model.layers.{i}.self_attn``).

A KDA layer's state is, per request, a short-convolution state over q, k
and v, ``(short_conv_kernel_size - 1, 3 * num_heads * head_dim)`` in the
model's dtype, and a recurrent state ``(num_heads, head_dim, head_dim)``
in float32 (``linear_attn_config.num_heads`` / ``head_dim``); tensor
parallelism splits the conv channels and the heads.  Source: vLLM
``model_executor/layers/mamba/mamba_utils.py`` (``kda_state_shape`` with
the key heads equal to the value heads; ``kda_state_dtype``: the conv
state in the model dtype, the recurrent state float32) and
``KimiLinearForCausalLM.get_mamba_state_shape_from_config``.

An MLA layer caches the ``kv_lora_rank + qk_rope_head_dim`` latent as one
KV head (576 values for Kimi-Linear-48B-A3B), as DeepSeek's does: vLLM's
``KimiMLAAttention`` projects that latent (``kv_a_proj_with_mqa``) even
with ``mla_use_nope``.  ``num_nextn_predict_layers`` (MTP draft layers
after the decoder layers) is not read: the draft's cache is the engine's
speculative-decoding business, as for DeepSeek.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvcore.serving import ServingChoices
from kvcore.spec import KVCacheSpec
from kvcore_hf.catalog import declared
from kvcore_hf.common import layer, num_layers
from kvcore_hf.deepseek import mla_latent
from kvcore_hf.mapping import ModelConfig, ModelConfigError, ModelMapper
from kvcore_mamba import MambaSpec

__all__ = ["MAPPERS", "KimiLinear", "STATE_BLOCK", "nested_positive"]

#: Block size of a recurrent-state layer (the model files' convention).
STATE_BLOCK = 16


def nested_positive(config: ModelConfig, parent: str, name: str) -> int:
    """``config.<parent>.<name>``, a positive int: ``ModelConfig.field`` reads
    top-level fields only, and a nested one needs its path in the message."""
    section: Mapping[str, Any] = config.field(parent, dict)
    value = section.get(name)
    path = f"{config.prefix}{parent}.{name}"
    if value is None:
        msg = f"{config.where}: field {path} is missing; {_needed(config)}"
        raise ModelConfigError(msg)
    if type(value) is not int or value <= 0:
        msg = f"{config.where}: field {path} must be a positive int, got {value!r}"
        raise ModelConfigError(msg)
    return value


def _needed(config: ModelConfig) -> str:
    names = ", ".join(config.architectures or config.model_types)
    return f"the mapper for {names} needs it"


@declared("kimi-linear")
class KimiLinear(ModelMapper):
    def layer_specs(
        self, config: ModelConfig, choices: ServingChoices
    ) -> dict[str, KVCacheSpec]:
        n = num_layers(config)
        kda = _kda_layers(config, n)
        heads = nested_positive(config, "linear_attn_config", "num_heads")
        dim = nested_positive(config, "linear_attn_config", "head_dim")
        kernel = nested_positive(config, "linear_attn_config", "short_conv_kernel_size")
        if kernel < 2:
            msg = (
                f"{config.where}: field {config.prefix}linear_attn_config."
                f"short_conv_kernel_size must be at least 2, got {kernel}"
            )
            raise ModelConfigError(msg)
        state = MambaSpec(
            block_size=STATE_BLOCK,
            shapes=((kernel - 1, 3 * heads * dim), (heads, dim, dim)),
            dtypes=(config.model_dtype(), torch.float32),
        )
        out: dict[str, KVCacheSpec] = {}
        latent: KVCacheSpec | None = None
        for i in range(n):
            if i in kda:
                out[layer(i)] = state
                continue
            if latent is None:  # the MLA fields are read only where MLA runs
                latent = mla_latent(config)
            out[layer(i)] = latent
        return out


def _kda_layers(config: ModelConfig, n: int) -> set[int]:
    """0-based indices of the KDA layers: ``kda_layers`` lists them 1-based."""
    section: Mapping[str, Any] = config.field("linear_attn_config", dict)
    values = section.get("kda_layers")
    path = f"{config.where}: field {config.prefix}linear_attn_config.kda_layers"
    if values is None:
        msg = f"{path} is missing; {_needed(config)}"
        raise ModelConfigError(msg)
    if not isinstance(values, list) or not all(
        type(v) is int and 1 <= v <= n for v in values
    ):
        msg = f"{path} must list 1-based layer numbers from 1 to {n}, got {values!r}"
        raise ModelConfigError(msg)
    return {v - 1 for v in values}


MAPPERS = (KimiLinear(),)
