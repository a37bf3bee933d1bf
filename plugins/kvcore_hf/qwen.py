"""Qwen2, Qwen2-MoE, Qwen3 and Qwen3-MoE: grouped-query attention, with
sliding windows only where the configuration switches them on.

Every layer is attention with ``num_key_value_heads`` KV heads (required:
the families' configuration classes default it differently).  Head size:
``head_dim``, else ``hidden_size / num_attention_heads`` for Qwen2,
Qwen2-MoE and Qwen3-MoE (their attention's fallback); Qwen3 falls back to
``Qwen3Config``'s default of 128, since its heads are not
``hidden_size / num_attention_heads``.  Each default applied is listed in the
model file's notes.

Fields read: ``num_hidden_layers``, ``num_key_value_heads``, ``head_dim``
(``hidden_size``, ``num_attention_heads``), ``use_sliding_window`` (default
false), ``sliding_window``, ``max_window_layers``, ``layer_types``,
``torch_dtype`` / ``dtype``.

Windows, per transformers' configuration and modeling files:

- Qwen2 and Qwen3 (``configuration_qwen2.py``, ``configuration_qwen3.py``):
  the window is ``sliding_window`` when ``use_sliding_window`` is true,
  else none; a layer is windowed when its ``layer_types`` entry is
  ``sliding_attention`` and a window is set.  Without ``layer_types``,
  layers ``i >= max_window_layers`` are sliding.
- Qwen2-MoE (``configuration_qwen2_moe.py``, ``modular_qwen2_moe.py``): the
  same, but the default ``layer_types`` makes layer ``i`` sliding when it is
  even and ``i < max_window_layers``.
- Qwen3-MoE (``modular_qwen3_moe.py``: the attention takes
  ``config.sliding_window`` on every layer, the configuration has no
  ``layer_types``): every layer is windowed when ``use_sliding_window`` is
  true.

``max_window_layers`` is required when windows are on and no
``layer_types`` is given: the classes' default (28) is a size of one
checkpoint, not a rule.  Every released Qwen2, Qwen2.5 and Qwen3 checkpoint
sets ``use_sliding_window`` false, so all their layers are full attention;
engines have disagreed on partial windows (vLLM's ``qwen2.py`` once took
``i < max_window_layers``, later refused partial windows outright), which
only matters for edited configurations.
"""

from __future__ import annotations

from typing import ClassVar

from kvcore.serving import ServingChoices
from kvcore.spec import KVCacheSpec
from kvcore_hf.catalog import declared
from kvcore_hf.common import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    attention_by_type,
    head_dim,
    layer_types_or,
    num_layers,
)
from kvcore_hf.mapping import ModelConfig, ModelMapper

__all__ = ["MAPPERS", "Qwen2", "Qwen2Moe", "Qwen3", "Qwen3Moe"]


class _Qwen(ModelMapper):
    """What the four families share; subclasses say where windows fall."""

    #: The configuration class's ``head_dim`` default, when it has one;
    #: otherwise the attention falls back to hidden_size // heads.
    head_dim_default: ClassVar[tuple[str, int] | None] = None

    def layer_specs(
        self, config: ModelConfig, choices: ServingChoices
    ) -> dict[str, KVCacheSpec]:
        n = num_layers(config)
        window = None
        if config.field("use_sliding_window", bool, default=False):
            window = config.optional_positive("sliding_window")
        types = self._types(config, n) if window is not None else [FULL_ATTENTION] * n
        if self.head_dim_default is not None:
            owner, value = self.head_dim_default
            size = config.default("head_dim", value, f"{owner}'s default")
        else:
            size = head_dim(config)
        return attention_by_type(
            config,
            types,
            window,
            num_kv_heads=config.positive("num_key_value_heads"),
            head_size=size,
        )

    def _types(self, config: ModelConfig, n: int) -> list[str]:
        """Each layer's type when the window is on."""
        return layer_types_or(config, n, lambda i: self._default(config, i))

    def _default(self, config: ModelConfig, index: int) -> str:
        """Layer ``index``'s type when the file gives no ``layer_types``."""
        first = config.field("max_window_layers", int)
        return SLIDING_ATTENTION if index >= first else FULL_ATTENTION


@declared("qwen2")
class Qwen2(_Qwen):
    """Qwen2 and Qwen2.5: windows from ``max_window_layers`` on."""


@declared("qwen3")
class Qwen3(_Qwen):
    head_dim_default: ClassVar[tuple[str, int] | None] = ("Qwen3Config", 128)


@declared("qwen2_moe")
class Qwen2Moe(_Qwen):
    def _default(self, config: ModelConfig, index: int) -> str:
        below = config.field("max_window_layers", int)
        return SLIDING_ATTENTION if index % 2 == 0 and index < below else FULL_ATTENTION


@declared("qwen3_moe")
class Qwen3Moe(_Qwen):
    def _types(self, config: ModelConfig, n: int) -> list[str]:
        return [SLIDING_ATTENTION] * n


MAPPERS = (Qwen2(), Qwen2Moe(), Qwen3(), Qwen3Moe())
