"""gpt-oss (``GptOssForCausalLM``, ``model_type`` ``gpt_oss``): sliding-window
and full attention layers, alternating.

Layer ``i`` follows ``layer_types`` (the published configurations list it:
``sliding_attention`` then ``full_attention``, 18 times for gpt-oss-120b,
12 for gpt-oss-20b); without it, even layers slide and odd ones are full.
Sliding layers keep ``sliding_window`` tokens (128 in both releases;
required).  Every layer has ``num_key_value_heads`` KV heads of ``head_dim``
(both required: 2880 / 64 query heads is not the 64-wide head).  The
attention sinks are one learned logit per query head, a weight, not cache.
The released weights are MXFP4 experts (``quantization_config`` with
``quant_method`` ``mxfp4``), which does not touch the KV cache: it is kept
in the weights' default dtype (bfloat16 when the file names none).

Fields read: ``num_hidden_layers``, ``layer_types``, ``sliding_window``,
``num_key_value_heads``, ``head_dim``, ``torch_dtype`` / ``dtype``.

Sources: transformers ``models/gpt_oss/configuration_gpt_oss.py`` (default
``layer_types``: sliding when ``(i + 1) % 2``) and ``modeling_gpt_oss.py``
(window on ``sliding_attention`` layers, per-head ``sinks``); OpenAI's
reference ``gpt_oss/torch/model.py`` (``sliding_window`` on even layers).
"""

from __future__ import annotations

from kvcore.serving import ServingChoices
from kvcore.spec import KVCacheSpec
from kvcore_hf.catalog import declared
from kvcore_hf.common import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ClassDefaults,
    layer_types_or,
    num_layers,
)
from kvcore_hf.mapping import ModelConfig, ModelMapper

__all__ = ["MAPPERS", "GptOss"]

#: ``GptOssConfig``'s defaults for the fields a file leaves out.
DEFAULTS = ClassDefaults(
    "GptOssConfig", sliding_window=128, num_kv_heads=8, head_dim=64
)


@declared("gpt_oss")
class GptOss(ModelMapper):
    def layer_specs(
        self, config: ModelConfig, choices: ServingChoices
    ) -> dict[str, KVCacheSpec]:
        n = num_layers(config)
        types = layer_types_or(
            config, n, lambda i: SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION
        )
        return DEFAULTS.attention_by_type(config, types)


MAPPERS = (GptOss(),)
