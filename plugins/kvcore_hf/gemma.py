"""Gemma 2 and Gemma 3: local (sliding-window) and global attention layers.

Every layer has ``num_key_value_heads`` KV heads of ``head_dim``; a file
that leaves them out gets the configuration classes' defaults (4 heads of
256 in ``Gemma2Config`` and ``Gemma3TextConfig``: Gemma's heads are not
``hidden_size / num_attention_heads``, e.g. Gemma-3-27B: 5376 / 32 = 168,
heads of 128).  Local layers keep ``sliding_window`` tokens (the classes'
default 4096 when the file leaves it out; Gemma 3 ships 512 or 1024);
global layers keep every token.  Each default applied is listed in the
model file's notes.  Which layers are local:

- Gemma 2 (``Gemma2ForCausalLM``, ``model_type`` ``gemma2``):
  ``layer_types`` when given, else even layers local and odd ones global.
  Source: transformers ``models/gemma2/configuration_gemma2.py`` (default
  ``layer_types``: sliding when ``(i + 1) % 2``) and ``modeling_gemma2.py``;
  Google's ``gemma_pytorch`` ``gemma/config.py`` (``attn_types``
  ``[LOCAL, GLOBAL]``).
- Gemma 3 (``Gemma3ForCausalLM`` for the 1B text model,
  ``Gemma3ForConditionalGeneration`` for the multimodal ones, whose language
  model is under ``text_config``; ``model_type`` ``gemma3_text`` /
  ``gemma3``): ``layer_types`` when given, else layer ``i`` is global when
  ``(i + 1) % sliding_window_pattern == 0`` (pattern default 6: five local
  then one global).  Source: transformers
  ``models/gemma3/configuration_gemma3.py`` (``sliding_window_pattern``
  default 6, the default ``layer_types``) and ``modeling_gemma3.py``;
  ``gemma_pytorch`` ``gemma/config.py`` and ``gemma3_model.py``
  (``attn_types[i % len(attn_types)]``, five local to one global); vLLM
  ``model_executor/models/gemma3.py`` (a sliding-window cache on local
  layers).

Fields read: ``num_hidden_layers``, ``num_key_value_heads``, ``head_dim``,
``sliding_window``, ``sliding_window_pattern`` (Gemma 3), ``layer_types``,
``torch_dtype`` / ``dtype`` (the language model's, else the root's).
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvcore.serving import ServingChoices
from kvcore.spec import KVCacheSpec
from kvcore_hf.catalog import declared
from kvcore_hf.common import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ClassDefaults,
    num_layers,
)
from kvcore_hf.mapping import ModelConfig, ModelMapper

__all__ = ["MAPPERS", "Gemma2", "Gemma3"]


@declared("gemma2")
class Gemma2(ModelMapper):
    #: The transformers class's defaults for the fields a file leaves out.
    defaults: ClassVar[ClassDefaults] = ClassDefaults(
        "Gemma2Config", sliding_window=4096, num_kv_heads=4, head_dim=256
    )
    max_positions_default: ClassVar[tuple[str, int] | None] = ("Gemma2Config", 8192)

    def layer_specs(
        self, config: ModelConfig, choices: ServingChoices
    ) -> dict[str, KVCacheSpec]:
        n = num_layers(config)
        if config.optional("layer_types", list):
            types = config.layer_types("layer_types", n)
        else:
            types = [self._default(config, i) for i in range(n)]
        return self.defaults.attention_by_type(config, types)

    def _default(self, config: ModelConfig, index: int) -> str:
        """Layer ``index``'s type when the file gives no ``layer_types``."""
        return SLIDING_ATTENTION if index % 2 == 0 else FULL_ATTENTION


@declared("gemma3")
class Gemma3(Gemma2):
    defaults: ClassVar[ClassDefaults] = attrs.evolve(
        Gemma2.defaults, owner="Gemma3TextConfig"
    )
    max_positions_default: ClassVar[tuple[str, int] | None] = (
        "Gemma3TextConfig",
        131_072,
    )

    def _default(self, config: ModelConfig, index: int) -> str:
        pattern = config.positive("sliding_window_pattern", default=6)
        return FULL_ATTENTION if (index + 1) % pattern == 0 else SLIDING_ATTENTION


MAPPERS = (Gemma2(), Gemma3())
