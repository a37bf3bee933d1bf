"""GLM-4.5, GLM-4.5-Air and GLM-4.6 (``Glm4MoeForCausalLM``, ``model_type``
``glm4_moe``): grouped-query full attention on every layer.

Each of the ``num_hidden_layers`` layers (92 for GLM-4.5 and GLM-4.6, 46 for
GLM-4.5-Air) keeps ``num_key_value_heads`` KV heads (8) of ``head_dim``
(128; required: 5120 / 96 query heads is not a whole head).  Partial RoPE
(``partial_rotary_factor``) and QK norms change no cache shape.

Multi-token prediction: the checkpoints add ``num_nextn_predict_layers`` (1)
MTP layers after the main stack (``model.layers.92`` for GLM-4.5).  They are
not mapped.  transformers builds ``num_hidden_layers`` layers only and
ignores the MTP weights; vLLM's ``glm4_moe.py`` skips them when loading the
model and builds them only as the draft model of MTP speculative decoding
(``glm4_moe_mtp.py``, ``--speculative-config`` method ``mtp``), and SGLang
likewise runs them only as the speculative draft (``glm4_moe_nextn.py``).
So a plain deployment holds no cache for them.  With MTP speculation on,
each MTP layer adds one more full-attention layer of the same shape (its
decoder layer is a regular ``Glm4MoeDecoderLayer``), which kvcore's serving
choices do not model yet: add ``model.layers.{num_hidden_layers + k}`` to
the model file by hand (``kvcore convert``) to plan for it.

Fields read: ``num_hidden_layers``, ``num_key_value_heads``, ``head_dim``,
``torch_dtype`` / ``dtype``.

Sources: transformers ``models/glm4_moe/configuration_glm4_moe.py`` and
``modeling_glm4_moe.py`` (``Glm4MoeAttention``: ``num_key_value_heads`` x
``head_dim``; ``num_hidden_layers`` decoder layers, MTP weights ignored);
vLLM ``model_executor/models/glm4_moe.py`` (spec-layer weights skipped) and
``glm4_moe_mtp.py`` (MTP layers from ``num_hidden_layers`` on, built as the
speculative draft).
"""

from __future__ import annotations

from kvcore.serving import ServingChoices
from kvcore.spec import KVCacheSpec
from kvcore_hf.catalog import declared
from kvcore_hf.common import SameEveryLayer, attention, head_dim, kv_heads
from kvcore_hf.mapping import ModelConfig

__all__ = ["MAPPERS", "Glm4Moe"]


@declared("glm4_moe")
class Glm4Moe(SameEveryLayer):
    def layer_spec(self, config: ModelConfig, choices: ServingChoices) -> KVCacheSpec:
        # Glm4MoeConfig has no head_dim default: the model reads
        # hidden_size // num_attention_heads when the file leaves it out.
        return attention(
            config, num_kv_heads=kv_heads(config), head_size=head_dim(config)
        )


MAPPERS = (Glm4Moe(),)
