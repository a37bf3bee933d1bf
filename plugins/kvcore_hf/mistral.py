"""Mistral and Mixtral: one attention kind on every layer, sliding-window
when the configuration sets a window.

Every layer has ``num_key_value_heads`` KV heads (required: Mistral's
configuration class defaults it to 8, not to the query heads) of
``head_dim`` (else ``hidden_size / num_attention_heads``, the classes'
fallback; Mistral-Nemo's 128-wide heads need ``head_dim``).  A layer keeps
``sliding_window`` tokens when it is set and every token when it is null:
Mistral-7B-v0.1 sets 4096, v0.2 / v0.3, Nemo and Mixtral set null.  An
absent ``sliding_window`` takes the classes' default, as transformers (and
the engines that load configurations through it) do: 4096 for Mistral,
null for Mixtral.  Mistral's configuration ignores ``layer_types`` (it
warns and points to Ministral), so this mapper does too.

Fields read: ``num_hidden_layers``, ``num_key_value_heads``, ``head_dim``
(``hidden_size``, ``num_attention_heads``), ``sliding_window``,
``torch_dtype`` / ``dtype``.

Sources: transformers ``models/mistral/configuration_mistral.py``
(``sliding_window`` default 4096, ``head_dim`` fallback,
``num_key_value_heads`` default 8) and ``modeling_mistral.py`` (one window
for every layer); ``models/mixtral/configuration_mixtral.py``
(``sliding_window`` default None).
"""

from __future__ import annotations

from typing import ClassVar

from kvcore.serving import ServingChoices
from kvcore.spec import KVCacheSpec
from kvcore_hf.catalog import declared
from kvcore_hf.common import SameEveryLayer, attention, head_dim
from kvcore_hf.mapping import ModelConfig

__all__ = ["MAPPERS", "Mistral", "Mixtral"]


@declared("mistral")
class Mistral(SameEveryLayer):
    #: The window an absent ``sliding_window`` means (the class default).
    default_window: ClassVar[int | None] = 4096

    def layer_spec(self, config: ModelConfig, choices: ServingChoices) -> KVCacheSpec:
        window = self.default_window
        if "sliding_window" in config.text:
            window = config.optional_positive("sliding_window")
        return attention(
            config,
            sliding_window=window,
            num_kv_heads=config.positive("num_key_value_heads"),
            head_size=head_dim(config),
        )


@declared("mixtral")
class Mixtral(Mistral):
    default_window: ClassVar[int | None] = None


MAPPERS = (Mistral(), Mixtral())
