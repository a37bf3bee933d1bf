"""Llama 3 and Llama 4.

Llama 3 (``LlamaForCausalLM``, ``model_type`` ``llama``): every layer is
full attention with ``num_key_value_heads`` KV heads of ``head_dim``.
Source: transformers ``models/llama/modeling_llama.py`` (``LlamaAttention``).

Llama 4 (``Llama4ForConditionalGeneration`` / ``Llama4ForCausalLM``,
``model_type`` ``llama4`` / ``llama4_text``; the language model sits under
``text_config``): layer ``i`` uses RoPE when ``no_rope_layers[i]`` is 1
(when the list is empty, every ``no_rope_layer_interval``-th layer, default
4, is a NoPE layer: layers 3, 7, ...); RoPE layers attend within chunks of
``attention_chunk_size`` tokens, NoPE layers attend globally.  Source:
transformers ``models/llama4/configuration_llama4.py`` (``no_rope_layers``
default) and ``modeling_llama4.py`` (``use_chunked_attention`` on RoPE
layers); the iRoPE design in Meta's Llama 4 model card.  Chunked local
attention is the built-in kind ``chunked_local_attention``
(``kvcore_chunked_local``).
"""

from __future__ import annotations

from kvcore.serving import ServingChoices
from kvcore.spec import KVCacheSpec
from kvcore_chunked_local import ChunkedLocalAttentionSpec
from kvcore_hf.catalog import declared
from kvcore_hf.common import (
    ATTENTION_BLOCK,
    SameEveryLayer,
    attention,
    head_dim,
    kv_heads,
    layer,
    num_layers,
)
from kvcore_hf.mapping import ModelConfig, ModelConfigError, ModelMapper

__all__ = ["MAPPERS", "Llama", "Llama4"]


@declared("llama")
class Llama(SameEveryLayer):
    """Llama 2 and 3: full attention on every layer."""


@declared("llama4")
class Llama4(ModelMapper):
    def layer_specs(
        self, config: ModelConfig, choices: ServingChoices
    ) -> dict[str, KVCacheSpec]:
        n = num_layers(config)
        rope = config.optional("no_rope_layers", list) or []
        if not rope:
            interval = config.positive("no_rope_layer_interval", default=4)
            rope = [int((i + 1) % interval != 0) for i in range(n)]
        if len(rope) != n or any(v not in (0, 1) for v in rope):
            msg = (
                f"{config.where}: field {config.prefix}no_rope_layers must list {n} "
                "zeros and ones (one per layer)"
            )
            raise ModelConfigError(msg)
        chunk = config.optional("attention_chunk_size")
        full = attention(config)
        local = _chunked(config, chunk) if chunk else full
        return {layer(i): local if rope[i] else full for i in range(n)}


def _chunked(config: ModelConfig, chunk: int) -> KVCacheSpec:
    return ChunkedLocalAttentionSpec(
        block_size=ATTENTION_BLOCK,
        num_kv_heads=kv_heads(config),
        head_size=head_dim(config),
        dtype=config.model_dtype(),
        attention_chunk_size=chunk,
    )


MAPPERS = (Llama(), Llama4())
