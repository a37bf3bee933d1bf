"""Qwen3-Next (``Qwen3NextForCausalLM``, ``model_type`` ``qwen3_next``).

Layer ``i`` is ``layer_types[i]``: ``linear_attention`` (a gated DeltaNet)
or ``full_attention`` (gated full attention).  Without ``layer_types``,
layer ``i`` is full attention when ``(i + 1) % full_attention_interval == 0``
(the interval defaults to 4).
Source: transformers ``models/qwen3_next/configuration_qwen3_next.py``
(the ``layer_types`` default) and vLLM
``vllm/model_executor/models/qwen3_next.py`` (``config.layer_types[i]``
picks ``linear_attn`` or ``self_attn``).

Full attention: ``num_key_value_heads`` KV heads of ``head_dim``; the
output gate doubles the query projection, not the keys and values.  Source:
transformers ``modeling_qwen3_next.py`` (``Qwen3NextAttention``).

Gated DeltaNet state: conv ``(linear_conv_kernel_dim - 1,
2 * linear_num_key_heads * linear_key_head_dim + linear_num_value_heads *
linear_value_head_dim)`` and recurrent ``(linear_num_value_heads,
linear_value_head_dim, linear_key_head_dim)``, both in the model dtype.
Source: vLLM ``qwen3_next.py`` ``get_mamba_state_shape_from_config``
(``gated_delta_net_state_shape``) and ``get_mamba_state_dtype_from_config``
(``gated_delta_net_state_dtype``, no override), with ``mamba_utils.py`` at
commit 02d7108.

Fields read: ``num_hidden_layers``, ``layer_types`` or
``full_attention_interval``, ``num_attention_heads``,
``num_key_value_heads``, ``head_dim`` (else ``hidden_size /
num_attention_heads``), ``linear_num_key_heads``, ``linear_num_value_heads``,
``linear_key_head_dim``, ``linear_value_head_dim``,
``linear_conv_kernel_dim``, ``torch_dtype`` / ``dtype``.  The multi-token
prediction layers are not cache layers of the model and are not read.
"""

from __future__ import annotations

from kvcore.serving import ServingChoices
from kvcore.spec import KVCacheSpec
from kvcore_hf.catalog import declared
from kvcore_hf.common import attention, layer, layer_types_or, num_layers
from kvcore_hf.mapping import ModelConfig, ModelConfigError, ModelMapper
from kvcore_hf.state import conv_kernel, gated_delta_net

__all__ = ["MAPPERS", "Qwen3Next"]

_TYPES = ("linear_attention", "full_attention")


@declared("qwen3_next")
class Qwen3Next(ModelMapper):
    def layer_specs(
        self, config: ModelConfig, choices: ServingChoices
    ) -> dict[str, KVCacheSpec]:
        n = num_layers(config)
        types = layer_types_or(config, n, lambda i: _default(config, i))
        for i, kind in enumerate(types):
            if kind not in _TYPES:
                msg = (
                    f"{config.where}: field {config.prefix}layer_types[{i}] is "
                    f"{kind!r}; Qwen3-Next layers are {' or '.join(_TYPES)}"
                )
                raise ModelConfigError(msg)
        state = gated_delta_net(
            config,
            num_k_heads=config.positive("linear_num_key_heads"),
            num_v_heads=config.positive("linear_num_value_heads"),
            head_k_dim=config.positive("linear_key_head_dim"),
            head_v_dim=config.positive("linear_value_head_dim"),
            conv_kernel=conv_kernel(config, "linear_conv_kernel_dim"),
        )
        attn = attention(config)
        out: dict[str, KVCacheSpec] = {}
        for i, kind in enumerate(types):
            if kind == "full_attention":
                out[layer(i)] = attn
            else:
                out[layer(i, "linear_attn")] = state
        return out


def _default(config: ModelConfig, index: int) -> str:
    """Layer ``index``'s type when the file gives no ``layer_types``."""
    interval = config.positive("full_attention_interval", default=4)
    return _TYPES[(index + 1) % interval == 0]


MAPPERS = (Qwen3Next(),)
