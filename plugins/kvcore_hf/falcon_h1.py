"""Falcon-H1 (``FalconH1ForCausalLM``, ``model_type`` ``falcon_h1``).

Every layer runs attention and a Mamba-2 mixer side by side on the same
input, so every layer keeps both caches: ``model.layers.{i}.self_attn``
then ``model.layers.{i}.mamba``.  Source: vLLM
``vllm/model_executor/models/falcon_h1.py`` (``FalconH1ParallelHybrid``
builds ``self_attn`` and ``mamba`` in every layer; vLLM registers the
Mamba cache under a layer index shifted by ``num_hidden_layers``, kvcore
names it after its module instead).

Attention: ``num_key_value_heads`` KV heads of ``head_dim`` (else
``hidden_size / num_attention_heads``).  Source: vLLM ``falcon_h1.py``
(``FalconH1AttentionDecoderLayer``).

Mamba-2 state: ``d_ssm = mamba_d_ssm``, or ``mamba_expand * hidden_size``
when it is null; ``mamba_d_head`` is ``d_ssm / mamba_n_heads`` when
``"auto"`` or absent (the transformers default).  Conv ``(mamba_d_conv - 1, d_ssm + 2 * mamba_n_groups *
mamba_d_state)``, SSM ``(mamba_n_heads, mamba_d_head, mamba_d_state)``,
both in the model dtype (no model-specific override).  Source: vLLM
``falcon_h1.py`` ``get_mamba_state_shape_from_config``
(``mamba2_state_shape``) and ``get_mamba_state_dtype_from_config``
(``mamba2_state_dtype``); transformers
``models/falcon_h1/configuration_falcon_h1.py`` (``mamba_d_head`` ``auto``,
``mamba_d_head * mamba_n_heads == d_ssm``); ``mamba_utils.py`` at commit
02d7108.

Fields read: ``num_hidden_layers``, ``num_attention_heads``,
``num_key_value_heads``, ``head_dim``, ``hidden_size``, ``mamba_d_ssm``
(present, possibly null), ``mamba_expand`` (when it is null),
``mamba_n_heads``, ``mamba_d_head``, ``mamba_n_groups``, ``mamba_d_state``,
``mamba_d_conv``, ``torch_dtype`` / ``dtype``.
"""

from __future__ import annotations

from kvcore.serving import ServingChoices
from kvcore.spec import KVCacheSpec
from kvcore_hf.catalog import declared
from kvcore_hf.common import attention, layer, num_layers
from kvcore_hf.mapping import ModelConfig, ModelConfigError, ModelMapper
from kvcore_hf.state import conv_kernel, mamba2

__all__ = ["MAPPERS", "FalconH1"]


@declared("falcon_h1")
class FalconH1(ModelMapper):
    def layer_specs(
        self, config: ModelConfig, choices: ServingChoices
    ) -> dict[str, KVCacheSpec]:
        n = num_layers(config)
        attn = attention(config)
        state = _state(config)
        out: dict[str, KVCacheSpec] = {}
        for i in range(n):
            out[layer(i)] = attn
            out[layer(i, "mamba")] = state
        return out


def _state(config: ModelConfig) -> KVCacheSpec:
    if "mamba_d_ssm" not in config.text:
        # transformers would fall back to a class default (1024), which is
        # no model's width; every released file sets the field.
        msg = (
            f"{config.where}: field {config.prefix}mamba_d_ssm is missing; the "
            "mapper for Falcon-H1 needs it (null means mamba_expand * hidden_size)"
        )
        raise ModelConfigError(msg)
    if config.has("mamba_d_ssm"):
        d_ssm = config.positive("mamba_d_ssm")
    else:
        d_ssm = config.positive("mamba_expand") * config.positive("hidden_size")
    heads = config.positive("mamba_n_heads")
    raw = config.field("mamba_d_head", (int, str), default="auto")
    if raw == "auto":
        size = d_ssm // heads
    elif isinstance(raw, int):
        size = config.positive("mamba_d_head")
    else:
        msg = (
            f"{config.where}: field {config.prefix}mamba_d_head must be an int "
            f'or "auto", got {raw!r}'
        )
        raise ModelConfigError(msg)
    if heads * size != d_ssm:
        msg = (
            f"{config.where}: mamba_n_heads ({heads}) x mamba_d_head ({size}) "
            f"must equal the Mamba width d_ssm ({d_ssm})"
        )
        raise ModelConfigError(msg)
    return mamba2(
        config,
        d_inner=d_ssm,
        n_groups=config.positive("mamba_n_groups"),
        n_heads=heads,
        head_dim=size,
        d_state=config.positive("mamba_d_state"),
        d_conv=conv_kernel(config, "mamba_d_conv"),
    )


MAPPERS = (FalconH1(),)
