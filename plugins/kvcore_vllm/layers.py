"""kvcore's layer specs as vLLM 0.33 sees them.

Each kvcore spec becomes a :class:`Layer`: vLLM's spec type, its page
arithmetic and what one request of ``max_model_len`` tokens holds of it
(``max_memory_usage_bytes`` of vLLM's spec types).  Two layers are one
vLLM spec when their :class:`Layer` values are equal.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from kvcore.errors import PlanError
from kvcore.spec import KVCacheSpec, cdiv, dtype_size, round_up

__all__ = ["ATTENTION", "Layer", "Settings", "to_layers"]

#: vLLM's spec types modelled here, by kvcore kind.
_TYPES = {
    "full_attention": "full",
    "mla": "mla",
    "sliding_window": "sliding",
    "sliding_window_mla": "sliding_mla",
    "chunked_local_attention": "chunked",
    "mamba": "mamba",
    "circular_buffer": "circular",
}
#: The attention types (their page scales with the block size).
ATTENTION = frozenset({"full", "mla", "sliding", "sliding_mla", "chunked", "circular"})
#: vLLM's grouping families (``uniform_type_base_spec`` of its registry).
_FAMILY = {
    "full": "full",
    "mla": "full",
    "sliding": "sliding",
    "sliding_mla": "sliding_mla",
    "chunked": "chunked",
    "mamba": "mamba",
    "circular": "circular",
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """The engine settings vLLM's arithmetic reads."""

    max_model_len: int
    #: Tokens scheduled but not yet freed: concurrent batches times
    #: ``max_num_batched_tokens`` (``VllmConfig.max_in_flight_tokens``).
    in_flight_tokens: int
    #: ``none`` or ``align`` (``all`` counts as ``none``, as in vLLM).
    mamba_cache_mode: str = "none"
    dcp: int = 1


@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer as a vLLM spec; equal values are equal vLLM specs."""

    type: str
    block_size: int
    #: Attention: KV heads, tokens per stored state, bytes per (head, state).
    heads: int = 0
    tokens_per_state: int = 1
    content: int = 0
    #: MLA page alignment (its ``alignment``), and an explicit padded page.
    alignment: int | None = None
    page_size_padded: int | None = None
    block_stride_alignment: int | None = None
    window: int = 0
    extra_retained_tokens: int = 0
    chunk: int = 0
    #: Mamba: the state bytes, its speculative and checkpoint blocks.
    state_bytes: int = 0
    speculative_blocks: int = 0
    checkpoint_blocks: int = 0

    @property
    def family(self) -> str:
        return _FAMILY[self.type]

    @property
    def unpadded_page(self) -> int:
        if self.type == "mamba":
            return self.state_bytes
        return self.heads * (self.block_size // self.tokens_per_state) * self.content

    @property
    def page(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.unpadded_page

    @property
    def stride(self) -> int:
        """The page rounded to the block stride alignment."""
        return round_up(self.page, self.block_stride_alignment or 1)

    def with_block_size(self, block_size: int) -> Layer:
        """vLLM's ``replace(spec, block_size=...)``: an explicit padding
        stays, unless an MLA alignment pads the new page again."""
        return self._realigned(dataclasses.replace(self, block_size=block_size))

    def with_padding(self, page: int) -> Layer:
        """vLLM's ``replace(spec, page_size_padded=...)``."""
        return self._realigned(dataclasses.replace(self, page_size_padded=page))

    def _realigned(self, new: Layer) -> Layer:
        if self.alignment is None:
            return new
        padded = round_up(new.unpadded_page, self.alignment)
        if padded != new.unpadded_page:
            return dataclasses.replace(new, page_size_padded=padded)
        return new

    def pages_per_request(self, s: Settings) -> int:
        """``cdiv(max_memory_usage_bytes, page_size_bytes)`` of vLLM's spec."""
        bs = self.block_size
        if self.type in ("full", "mla"):
            length = s.max_model_len
            if s.dcp > 1:
                length = cdiv(length, s.dcp)
            return cdiv(length, bs)
        if self.type in ("sliding", "sliding_mla"):
            if s.dcp > 1:
                msg = (
                    "vLLM 0.33 refuses sliding-window layers under decode context "
                    "parallelism (DCP does not support sliding window)"
                )
                raise PlanError(msg)
            live = self.window - 1 + self.extra_retained_tokens + s.in_flight_tokens
            return cdiv(min(live, s.max_model_len), bs) + 1
        if self.type == "chunked":
            return cdiv(min(self.chunk + s.in_flight_tokens, s.max_model_len), bs)
        if self.type == "circular":
            return 1
        if s.mamba_cache_mode == "align":
            return 2 + self.speculative_blocks + self.checkpoint_blocks
        return 1 + self.speculative_blocks


def _attention(spec: KVCacheSpec, kind: str) -> dict[str, Any]:
    get = getattr
    fields: dict[str, Any] = {
        "heads": get(spec, "num_kv_heads"),
        "tokens_per_state": get(spec, "tokens_per_state", 1),
        "content": (get(spec, "head_size") + get(spec, "head_size_v"))
        * dtype_size(get(spec, "dtype")),
        "alignment": get(spec, "alignment", None),
        "page_size_padded": get(spec, "page_size_padded", None),
    }
    if kind in ("sliding", "sliding_mla"):
        fields["window"] = get(spec, "sliding_window")
        fields["extra_retained_tokens"] = get(spec, "extra_retained_tokens", 0)
    if kind == "chunked":
        fields["chunk"] = get(spec, "attention_chunk_size")
    if fields["alignment"] is not None and fields["page_size_padded"] is None:
        real = fields["heads"] * (spec.block_size // fields["tokens_per_state"])
        real *= fields["content"]
        padded = round_up(real, fields["alignment"])
        if padded != real:
            fields["page_size_padded"] = padded
    return fields


def _mamba(spec: KVCacheSpec) -> dict[str, Any]:
    state_spec: Any = spec
    shapes, dtypes = state_spec.shapes, state_spec.dtypes
    state = sum(
        math.prod(shape) * dtype_size(dtype)
        for shape, dtype in zip(shapes, dtypes, strict=True)
    )
    return {
        "state_bytes": state,
        "page_size_padded": getattr(spec, "page_size_padded", None),
        "speculative_blocks": getattr(spec, "num_speculative_blocks", 0),
    }


def to_layers(specs: Mapping[str, KVCacheSpec]) -> dict[str, Layer]:
    """Each layer as vLLM's spec; a kind vLLM has no spec for is refused."""
    out: dict[str, Layer] = {}
    for name, spec in specs.items():
        kind = _TYPES.get(spec.kind)
        if kind is None:
            msg = (
                f"layer {name!r} is a {spec.kind!r} cache, which the vllm policy "
                f"does not model (it models {', '.join(sorted(_TYPES))}); compare "
                "with the min_waste and seed policies instead"
            )
            raise PlanError(msg)
        fields = _mamba(spec) if kind == "mamba" else _attention(spec, kind)
        out[name] = Layer(
            type=kind,
            block_size=spec.block_size,
            block_stride_alignment=spec.block_stride_alignment,
            **fields,
        )
    return out
