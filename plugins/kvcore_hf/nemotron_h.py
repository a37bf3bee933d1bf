"""Nemotron-H (``NemotronHForCausalLM``, ``model_type`` ``nemotron_h``).

Layer ``i`` is ``hybrid_override_pattern[i]``: ``M`` a Mamba-2 mixer, ``*``
attention, ``-`` an MLP and ``E`` a mixture of experts (the last two hold no
cache).  Newer files give ``layers_block_type`` instead, a list of
``mamba`` / ``linear_attention``, ``attention`` / ``full_attention``,
``mlp`` and ``moe``.  The pattern sets the layer count (vLLM builds
``len(hybrid_override_pattern)`` layers).  Source: transformers
``models/nemotron_h/configuration_nemotron_h.py`` (``_pattern_to_list``) and
vLLM ``vllm/model_executor/models/nemotron_h.py``
(``ALL_DECODER_LAYER_TYPES``; every layer's cache module is
``model.layers.{i}.mixer``).

Attention layers: ``num_key_value_heads`` KV heads of ``head_dim`` (older
files name it ``attention_head_dim``; else ``hidden_size /
num_attention_heads``, vLLM's ``NemotronHAttention`` fallback), sliding
when ``sliding_window`` is set (vLLM passes it as the layer's window).

Mamba layers: ``d_inner = mamba_num_heads * mamba_head_dim``; conv state
``(conv_kernel - 1, d_inner + 2 * n_groups * ssm_state_size)`` in the model
dtype, SSM state ``(mamba_num_heads, mamba_head_dim, ssm_state_size)`` in
``mamba_ssm_cache_dtype``, which defaults to float32.  Source: vLLM
``nemotron_h.py`` ``get_mamba_state_shape_from_config``
(``mamba2_state_shape``) and ``vllm/model_executor/models/config.py``
``NemotronHForCausalLMConfig.update_mamba_ssm_cache_dtype`` (``auto``
becomes the file's ``mamba_ssm_cache_dtype``, else
``DEFAULT_MAMBA_SSM_CACHE_DTYPE = "float32"``), with ``mamba_utils.py`` at
commit 02d7108.  The B/C groups follow the heads across ranks, or a single
group stays on every rank (``MambaMixer2`` accepts nothing else).

Fields read: ``hybrid_override_pattern`` or ``layers_block_type``,
``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` /
``attention_head_dim``, ``hidden_size`` (without either), ``sliding_window``,
``mamba_num_heads``, ``mamba_head_dim``, ``ssm_state_size``, ``n_groups``
(or ``mamba_n_groups``), ``conv_kernel`` (or ``mamba_d_conv``),
``mamba_ssm_cache_dtype``, ``torch_dtype`` / ``dtype``.
"""

from __future__ import annotations

import torch

from kvcore.serving import CACHE_DTYPE_ALIASES, ServingChoices
from kvcore.spec import KVCacheSpec
from kvcore_hf.catalog import declared
from kvcore_hf.common import attention, head_dim, layer
from kvcore_hf.mapping import ModelConfig, ModelConfigError, ModelMapper
from kvcore_hf.state import conv_kernel, mamba2

__all__ = ["MAPPERS", "NemotronH"]

#: ``layers_block_type`` names (current and legacy) as pattern characters.
_BLOCK_TYPES = {
    "mamba": "M",
    "linear_attention": "M",
    "attention": "*",
    "full_attention": "*",
    "mlp": "-",
    "moe": "E",
}
#: The SSM state dtype when the file names none (vLLM's NemotronH default).
DEFAULT_SSM_DTYPE = torch.float32


@declared("nemotron_h")
class NemotronH(ModelMapper):
    def layer_specs(
        self, config: ModelConfig, choices: ServingChoices
    ) -> dict[str, KVCacheSpec]:
        pattern = _pattern(config)
        out: dict[str, KVCacheSpec] = {}
        state = _state(config) if "M" in pattern else None
        attn = _attention(config) if "*" in pattern else None
        for i, char in enumerate(pattern):
            if char == "M" and state is not None:
                out[layer(i, "mixer")] = state
            elif char == "*" and attn is not None:
                out[layer(i, "mixer")] = attn
        if not out:
            msg = (
                f"{config.where}: the layer pattern {pattern!r} has no Mamba (M) "
                "or attention (*) layer, so the model keeps no cache"
            )
            raise ModelConfigError(msg)
        return out


def _pattern(config: ModelConfig) -> str:
    if config.has("hybrid_override_pattern") or not config.has("layers_block_type"):
        pattern: str = config.field("hybrid_override_pattern", str)
        bad = sorted(set(pattern) - set("M*-E"))
        if bad or not pattern:
            msg = (
                f"{config.where}: field {config.prefix}hybrid_override_pattern "
                f"{pattern!r} must be a non-empty string of M (Mamba), * "
                "(attention), - (MLP) and E (MoE)"
                + (f"; found {', '.join(map(repr, bad))}" if bad else "")
            )
            raise ModelConfigError(msg)
        return pattern
    types: list[object] = config.field("layers_block_type", list)
    chars = [_BLOCK_TYPES.get(t) if isinstance(t, str) else None for t in types]
    if not chars or None in chars:
        msg = (
            f"{config.where}: field {config.prefix}layers_block_type must list "
            f"one of {', '.join(_BLOCK_TYPES)} per layer, got {types!r}"
        )
        raise ModelConfigError(msg)
    return "".join(c for c in chars if c is not None)


def _attention(config: ModelConfig) -> KVCacheSpec:
    size = (
        head_dim(config)
        if config.has("head_dim") or not config.has("attention_head_dim")
        else config.positive("attention_head_dim")
    )
    window = config.optional_positive("sliding_window")
    return attention(config, head_size=size, sliding_window=window)


def _state(config: ModelConfig) -> KVCacheSpec:
    heads = config.positive("mamba_num_heads")
    size = config.positive("mamba_head_dim")
    groups = config.positive(
        "n_groups"
        if config.has("n_groups") or not config.has("mamba_n_groups")
        else "mamba_n_groups"
    )
    kernel = conv_kernel(
        config,
        "conv_kernel"
        if config.has("conv_kernel") or not config.has("mamba_d_conv")
        else "mamba_d_conv",
    )
    return mamba2(
        config,
        d_inner=heads * size,
        n_groups=groups,
        n_heads=heads,
        head_dim=size,
        d_state=config.positive("ssm_state_size"),
        d_conv=kernel,
        ssm_dtype=_ssm_dtype(config),
    )


def _ssm_dtype(config: ModelConfig) -> torch.dtype | None:
    """The file's ``mamba_ssm_cache_dtype`` (``auto``: like the conv state,
    None here), else float32."""
    name = config.optional("mamba_ssm_cache_dtype", str)
    if name is None:
        return DEFAULT_SSM_DTYPE
    key = name.strip().lower()
    if key not in CACHE_DTYPE_ALIASES or key.startswith("fp8"):
        known = [k for k in CACHE_DTYPE_ALIASES if not k.startswith("fp8")]
        msg = (
            f"{config.where}: field {config.prefix}mamba_ssm_cache_dtype "
            f"{name!r} is not a state dtype kvcore knows; known: {', '.join(known)}"
        )
        raise ModelConfigError(msg)
    return CACHE_DTYPE_ALIASES[key]


MAPPERS = (NemotronH(),)
