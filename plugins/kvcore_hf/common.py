"""What the attention mappers share: head counts, head sizes, layer names.

Fields read (the transformers ``PretrainedConfig`` names, which every
architecture below follows): ``num_hidden_layers``, ``num_attention_heads``,
``num_key_value_heads`` (defaults to ``num_attention_heads``: multi-head
attention), ``head_dim`` (defaults to ``hidden_size // num_attention_heads``),
``hidden_size``, ``torch_dtype`` / ``dtype``.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from kvcore.limits import MAX_NUM_LAYERS
from kvcore.serving import ServingChoices
from kvcore.spec import KVCacheSpec
from kvcore_full_attention import FullAttentionSpec
from kvcore_hf.mapping import ModelConfig, ModelConfigError, ModelMapper
from kvcore_sliding_window import SlidingWindowSpec

__all__ = [
    "ATTENTION_BLOCK",
    "ClassDefaults",
    "SameEveryLayer",
    "attention",
    "head_dim",
    "kv_heads",
    "layer",
    "layer_types_or",
    "num_layers",
]

#: Tokens per block of a paged attention layer: the engines' default.
ATTENTION_BLOCK = 16


def num_layers(config: ModelConfig) -> int:
    """``num_hidden_layers``, at most :data:`kvcore.limits.MAX_NUM_LAYERS`
    (checked before any layer is built)."""
    count = config.positive("num_hidden_layers")
    if count > MAX_NUM_LAYERS:
        msg = (
            f"{config.where}: num_hidden_layers is {count:,}, more than kvcore's "
            f"limit of {MAX_NUM_LAYERS:,} layers (MAX_NUM_LAYERS); the file is not "
            "a real model's configuration"
        )
        raise ModelConfigError(msg)
    return count


def kv_heads(config: ModelConfig) -> int:
    """KV heads of the whole model (grouped-query attention shares them):
    a divisor of ``num_attention_heads`` when the file gives both, since
    each KV head serves ``num_attention_heads / num_key_value_heads``
    query heads."""
    if config.has("num_key_value_heads"):
        kv = config.positive("num_key_value_heads")
        heads = config.optional_positive("num_attention_heads")
        if heads is not None and heads % kv:
            msg = (
                f"{config.where}: field {config.prefix}num_key_value_heads {kv} "
                f"does not divide num_attention_heads {heads}; grouped-query "
                "attention shares each KV head among a whole number of query "
                "heads, so give a divisor of num_attention_heads"
            )
            raise ModelConfigError(msg)
        return kv
    heads = config.positive("num_attention_heads")
    config.note_default(
        f"{config.prefix}num_key_value_heads {heads} (num_attention_heads: "
        "multi-head attention, transformers' rule)"
    )
    return heads


def head_dim(config: ModelConfig) -> int:
    """``head_dim``, else ``hidden_size / num_attention_heads`` (the
    configuration classes' rule, e.g. ``LlamaConfig``, ``MistralConfig``;
    recorded in :attr:`ModelConfig.defaults`)."""
    if config.has("head_dim"):
        return config.positive("head_dim")
    hidden = config.positive("hidden_size")
    heads = config.positive("num_attention_heads")
    if hidden % heads:
        msg = (
            f"{config.where}: hidden_size {hidden} is not a multiple of "
            f"num_attention_heads {heads} and no head_dim is given"
        )
        raise ModelConfigError(msg)
    config.note_default(
        f"{config.prefix}head_dim {hidden // heads} (hidden_size {hidden} // "
        f"num_attention_heads {heads}, transformers' rule)"
    )
    return hidden // heads


def layer(index: int, part: str = "self_attn") -> str:
    """The layer's module name, as the checkpoints name it."""
    return f"model.layers.{index}.{part}"


def attention(
    config: ModelConfig,
    *,
    sliding_window: int | None = None,
    num_kv_heads: int | None = None,
    head_size: int | None = None,
    block_size: int = ATTENTION_BLOCK,
) -> KVCacheSpec:
    """A full-attention layer, or a sliding-window one when ``sliding_window``
    is given, in the model's dtype."""
    kv = num_kv_heads if num_kv_heads is not None else kv_heads(config)
    size = head_size if head_size is not None else head_dim(config)
    dtype = config.model_dtype()
    if sliding_window is not None:
        return SlidingWindowSpec(
            block_size=block_size,
            num_kv_heads=kv,
            head_size=size,
            dtype=dtype,
            sliding_window=sliding_window,
        )
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=kv, head_size=size, dtype=dtype
    )


class SameEveryLayer(ModelMapper):
    """A mapper whose every layer keeps the same cache: :meth:`layer_spec`'s,
    by default full attention with the model's KV heads and head size."""

    def layer_specs(
        self, config: ModelConfig, choices: ServingChoices
    ) -> dict[str, KVCacheSpec]:
        spec = self.layer_spec(config, choices)
        return {layer(i): spec for i in range(num_layers(config))}

    def layer_spec(self, config: ModelConfig, choices: ServingChoices) -> KVCacheSpec:
        """The cache of every layer."""
        return attention(config)


#: ``layer_types`` entries the attention mappers know (transformers' names).
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


def layer_types_or(
    config: ModelConfig, n: int, default: Callable[[int], str]
) -> list[str]:
    """The ``n`` layers' types: ``layer_types`` when the file gives it, else
    ``default(i)`` for layer ``i`` (the configuration class's rule)."""
    if config.has("layer_types"):
        return config.layer_types("layer_types", n)
    return [default(i) for i in range(n)]


def attention_by_type(
    config: ModelConfig,
    types: list[str],
    sliding_window: int | None,
    *,
    source: str = "layer_types",
    num_kv_heads: int | None = None,
    head_size: int | None = None,
) -> dict[str, KVCacheSpec]:
    """One attention layer per entry of ``types``, in model order.

    ``sliding_attention`` layers keep ``sliding_window`` tokens, or every
    token when it is None (transformers' rule when a model's window is
    switched off); ``full_attention`` layers keep every token.  ``source``
    is the field ``types`` came from, named in the error for an entry that
    is neither.
    """
    full = attention(config, num_kv_heads=num_kv_heads, head_size=head_size)
    local = full
    if sliding_window is not None:
        local = attention(
            config,
            sliding_window=sliding_window,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
        )
    out: dict[str, KVCacheSpec] = {}
    for index, kind in enumerate(types):
        if kind == FULL_ATTENTION:
            out[layer(index)] = full
        elif kind == SLIDING_ATTENTION:
            out[layer(index)] = local
        else:
            msg = (
                f"{config.where}: field {config.prefix}{source}[{index}] is "
                f"{kind!r}; this mapper knows {FULL_ATTENTION!r} and "
                f"{SLIDING_ATTENTION!r}"
            )
            raise ModelConfigError(msg)
    return out


@attrs.frozen
class ClassDefaults:
    """What a transformers configuration class (``owner``) gives the
    attention fields a file leaves out, for mappers that apply it."""

    owner: str
    sliding_window: int
    num_kv_heads: int
    head_dim: int

    def attention_by_type(
        self, config: ModelConfig, types: list[str]
    ) -> dict[str, KVCacheSpec]:
        """:func:`attention_by_type` with ``sliding_window``,
        ``num_key_value_heads`` and ``head_dim`` from the file, else these
        defaults (each recorded in :attr:`ModelConfig.defaults`)."""
        rule = f"{self.owner}'s default"
        return attention_by_type(
            config,
            types,
            config.default("sliding_window", self.sliding_window, rule),
            num_kv_heads=config.default("num_key_value_heads", self.num_kv_heads, rule),
            head_size=config.default("head_dim", self.head_dim, rule),
        )
