"""MiniMax-Text-01 / MiniMax-M1 (lightning attention hybrids) and MiniMax-M2
(full attention).

**Text-01 and M1** (``MiniMaxText01ForCausalLM`` / ``MiniMaxM1ForCausalLM``,
``model_type`` ``minimax_text_01`` / ``minimax_m1``; transformers'
``MiniMaxForCausalLM``, ``model_type`` ``minimax``): layer ``i`` is a
lightning (linear) attention layer when ``attn_type_list[i]`` is 0 and a
softmax attention layer when it is 1 (transformers' files say
``layer_types[i]`` ``"linear_attention"`` / ``"full_attention"`` instead;
either field is read).  A lightning layer keeps, per request, one
``(num_attention_heads, head_dim, head_dim)`` state in the model's dtype
(vLLM's ``mamba_cache_dtype`` ``auto``), split by heads across ranks; a
softmax layer caches ``num_key_value_heads`` KV heads of ``head_dim``
(default ``hidden_size / num_attention_heads``) for every token: the
``sliding_window`` field is passed to no cache.  Sources: vLLM
``model_executor/models/minimax_text_01.py`` (``MiniMaxText01DecoderLayer``:
``attention_type`` 0 or 1 per layer; ``MiniMaxText01Attention`` builds a
plain ``Attention`` with ``num_key_value_heads``;
``get_mamba_state_shape_from_config``), ``model_executor/layers/mamba/
mamba_utils.py`` (``linear_attention_state_shape``: ``(heads / tp,
head_dim, head_dim)``; ``linear_attention_state_dtype``); the
MiniMax-Text-01 model card (a softmax layer after every 7 lightning ones).

**M2** (``MiniMaxM2ForCausalLM``, ``model_type`` ``minimax_m2``): every
layer is full attention with ``num_key_value_heads`` heads of ``head_dim``;
its ``attn_type_list`` is all ones and is not read, and its MTP modules
(``use_mtp`` / ``num_mtp_modules``) are a speculative-decoding draft outside
the ``num_hidden_layers`` decoder layers, left out as for DeepSeek.
Source: vLLM ``model_executor/models/minimax_m2.py`` (``MiniMaxM2Attention``
on every layer); kvcore/tools/zoo/SOURCES.md (MiniMax-M2).
"""

from __future__ import annotations

from kvcore.serving import ServingChoices
from kvcore.spec import KVCacheSpec
from kvcore_hf.catalog import declared
from kvcore_hf.common import SameEveryLayer, attention, head_dim, layer, num_layers
from kvcore_hf.kimi import STATE_BLOCK
from kvcore_hf.mapping import ModelConfig, ModelConfigError, ModelMapper
from kvcore_mamba import MambaSpec

__all__ = ["MAPPERS", "MiniMaxM2", "MiniMaxText01"]

_TYPE_NAMES = {"linear_attention": 0, "full_attention": 1}


@declared("minimax-text-01")
class MiniMaxText01(ModelMapper):
    def layer_specs(
        self, config: ModelConfig, choices: ServingChoices
    ) -> dict[str, KVCacheSpec]:
        n = num_layers(config)
        types = _attention_types(config, n)
        out: dict[str, KVCacheSpec] = {}
        state: KVCacheSpec | None = None
        full: KVCacheSpec | None = None
        for i, kind in enumerate(types):
            if kind == 0:
                if state is None:
                    heads = config.positive("num_attention_heads")
                    size = head_dim(config)
                    state = MambaSpec(
                        block_size=STATE_BLOCK,
                        shapes=((heads, size, size),),
                        dtypes=(config.model_dtype(),),
                    )
                out[layer(i)] = state
            else:
                full = full or attention(config)
                out[layer(i)] = full
        return out


def _attention_types(config: ModelConfig, n: int) -> list[int]:
    """Per layer, 0 (lightning) or 1 (softmax), from ``attn_type_list`` or,
    failing it, transformers' ``layer_types``."""
    if not config.has("attn_type_list") and config.has("layer_types"):
        names = config.layer_types("layer_types", n)
        bad = sorted({v for v in names if v not in _TYPE_NAMES})
        if bad:
            msg = (
                f"{config.where}: field {config.prefix}layer_types holds {bad}; "
                f"MiniMax layers are {' or '.join(_TYPE_NAMES)}"
            )
            raise ModelConfigError(msg)
        return [_TYPE_NAMES[v] for v in names]
    values = config.field("attn_type_list", list)
    if len(values) != n or any(type(v) is not int or v not in (0, 1) for v in values):
        msg = (
            f"{config.where}: field {config.prefix}attn_type_list must list {n} "
            "entries (one per layer), each 0 (lightning attention) or 1 (softmax "
            "attention)"
        )
        raise ModelConfigError(msg)
    return list(values)


@declared("minimax-m2")
class MiniMaxM2(SameEveryLayer):
    """MiniMax-M2: full attention on every layer."""


MAPPERS = (MiniMaxText01(), MiniMaxM2())
