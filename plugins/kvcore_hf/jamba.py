"""Jamba and Jamba 1.5 (``JambaForCausalLM``, ``model_type`` ``jamba``).

Layer ``i`` is attention when ``i % attn_layer_period == attn_layer_offset``
and a Mamba-1 mixer otherwise.  Source: transformers
``models/jamba/configuration_jamba.py`` (``layers_block_type``, and the
check that the offset is smaller than the period).

Attention layers: ``num_key_value_heads`` KV heads of
``hidden_size / num_attention_heads`` (Jamba sets no ``head_dim``).
Source: vLLM ``vllm/model_executor/models/jamba.py``
(``JambaAttentionDecoderLayer``).

Mamba layers: ``d_inner = mamba_expand * hidden_size``; conv state
``(mamba_d_conv - 1, d_inner)`` and SSM state ``(d_inner, mamba_d_state)``,
both in the model dtype (``torch_dtype``).  Source: vLLM ``jamba.py``
``get_mamba_state_shape_from_config`` (``mamba1_state_shape``) and
``get_mamba_state_dtype_from_config`` (``mamba1_state_dtype``, no
model-specific override), with ``mamba_utils.py`` at commit 02d7108.

Fields read: ``num_hidden_layers``, ``attn_layer_period``,
``attn_layer_offset``, ``hidden_size``, ``num_attention_heads``,
``num_key_value_heads``, ``head_dim`` (if set), ``mamba_expand``,
``mamba_d_state``, ``mamba_d_conv``, ``torch_dtype`` / ``dtype``.
"""

from __future__ import annotations

from kvcore.serving import ServingChoices
from kvcore.spec import KVCacheSpec
from kvcore_hf.catalog import declared
from kvcore_hf.common import attention, layer, num_layers
from kvcore_hf.mapping import ModelConfig, ModelConfigError, ModelMapper
from kvcore_hf.state import conv_kernel, mamba1

__all__ = ["MAPPERS", "Jamba"]


@declared("jamba")
class Jamba(ModelMapper):
    def layer_specs(
        self, config: ModelConfig, choices: ServingChoices
    ) -> dict[str, KVCacheSpec]:
        n = num_layers(config)
        period = config.positive("attn_layer_period")
        offset: int = config.field("attn_layer_offset")
        if not 0 <= offset < period:
            msg = (
                f"{config.where}: field {config.prefix}attn_layer_offset "
                f"({offset}) must be at least 0 and smaller than "
                f"attn_layer_period ({period})"
            )
            raise ModelConfigError(msg)
        state = mamba1(
            config,
            d_inner=config.positive("mamba_expand") * config.positive("hidden_size"),
            d_state=config.positive("mamba_d_state"),
            d_conv=conv_kernel(config, "mamba_d_conv"),
        )
        attn = attention(config)
        out: dict[str, KVCacheSpec] = {}
        for i in range(n):
            if i % period == offset:
                out[layer(i)] = attn
            else:
                out[layer(i, "mamba")] = state
        return out


MAPPERS = (Jamba(),)
