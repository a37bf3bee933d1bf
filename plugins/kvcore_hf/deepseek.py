"""DeepSeek V2 / V2-Lite / V3 / R1 (MLA), V3.2 (MLA plus indexer keys) and V4
(compressed sparse attention).

**V2, V3, R1** (``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM``,
``model_type`` ``deepseek_v2`` / ``deepseek_v3``): every layer caches one
multi-head latent of ``kv_lora_rank + qk_rope_head_dim`` values per token as
a single KV head (512 + 64 = 576 for V2, V2-Lite, V3 and R1), in the model's
dtype, in 64-token FlashMLA pages.  ``num_attention_heads``,
``num_key_value_heads``, ``q_lora_rank`` and ``v_head_dim`` do not change
the cache: the keys and values of every head are projected from the one
latent.  Sources: vLLM ``model_executor/models/deepseek_v2.py``
(``kv_a_proj_with_mqa`` projects ``kv_lora_rank + qk_rope_head_dim``; the
MLA layer registers ``MLAAttentionSpec`` with ``num_kv_heads=1``); the
DeepSeek-V2 paper (arXiv 2405.04434, section 2.1: the cached ``c_KV`` and
``k_R``); kvcore/tools/zoo/SOURCES.md (DeepSeek-V3 / R1).

**V3.2 / V3.2-Exp** (``DeepseekV32ForCausalLM``, ``model_type``
``deepseek_v32``): the MLA latent above plus, in every layer, the lightning
indexer's key cache ``<layer>.self_attn.indexer.k_cache``: one
``index_head_dim`` fp8 key and one fp32 scale per 128 elements, a
``index_head_dim + index_head_dim / 128 * 4`` byte record (132), as uint8
in 64-token pages.  ``index_n_heads`` and ``index_topk`` size the indexer's
queries and its selection, not the cache.  Under an 8-bit float cache
dtype (the engine's, given to the mapper in its serving choices, else one
the file fixes) vLLM stores V3.2's latent as FlashMLA's ``fp8_ds_mla``
record instead: ``kv_lora_rank`` fp8 values, an fp32 scale per 128 of them
and the RoPE part in bf16 (512 + 16 + 128 = 656 B): the mapper gives the
latent that record size (``fp8_record_size``), and an 8-bit float cache
dtype, applied to the mapped layers or to a model file written from them,
turns the latent into a uint8 cache of that size.  Sources: vLLM
``model_executor/models/deepseek_v2.py`` (``Indexer``:
``DeepseekV32IndexerCache`` of that head size, uint8),
``model_executor/models/config.py`` (``DeepseekV32ForCausalLM``: an fp8
cache dtype becomes ``fp8_ds_mla``); FlashMLA's README ("FP8 with scale":
656 bytes a token); DeepSeek's ``DeepSeek-V3.2-Exp/inference/model.py``
(``ModelArgs`` index fields).

**V4** (``DeepseekV4ForCausalLM``, ``model_type`` ``deepseek_v4``): layer
``i`` runs at ``compress_ratios[i]`` (0 or 1: sliding window only; 4: CSA
with the lightning indexer; 128: HCA).  Each layer keeps, under
``model.layers.{i}.attn``:

- ``.swa_cache``: the last ``sliding_window`` tokens' latents, one
  FlashMLA fp8 record per token: ``head_dim - qk_rope_head_dim`` fp8 NoPE
  values, ``qk_rope_head_dim`` bf16 RoPE values, one UE8M0 scale per 64
  NoPE values and a pad byte (448 + 128 + 7 + 1 = 584 B), 64-token pages
  padded to 576 B (the SWA and ratio-4 pages share one tensor, so 256 / 4
  rows);
- ratio > 1: the compressed latent (same record, one per ``ratio``
  tokens, 256-token blocks) and its compressor's partial state, a ring of
  ``coff * ratio`` fp32 rows of ``2 * coff * head_dim`` (kv and score
  halves; ``coff`` is 2 at ratio 4, whose windows overlap, else 1);
- ratio 4: the indexer's compressed keys (the V3.2 record of
  ``index_head_dim``, one per 4 tokens, 256-token blocks, 576-B pages) and
  the indexer compressor's ring (``2 * 4`` rows of ``2 * 2 *
  index_head_dim`` fp32).

Sources: vLLM ``model_executor/models/deepseek_v4.py`` (``compress_ratio =
max(1, compress_ratios[layer])``; indexer only at ratio 4),
``model_executor/layers/deepseek_v4_attention.py`` (the 584-B
``head_bytes``; compressed ``MLAAttentionSpec`` with ``alignment=576``;
``DeepseekV4IndexerCache`` head ``index_head_dim + index_head_dim // 128 *
4``), ``v1/attention/backends/mla/sparse_swa.py`` (``DeepseekV4SWACache``:
``SlidingWindowMLASpec``, 64-token blocks),
``model_executor/layers/deepseek_compressor.py`` (state ``2 * coff *
head_dim``, ``coff * ratio`` slots); kvcore/tools/zoo/SOURCES.md (DeepSeek-V4).

The compressor states follow kvcore's shipped DeepSeek-V4 file, which keeps
each as one ring of ``coff * ratio`` rows.  vLLM's ``CompressorStateCache``
instead pages them as a ``SlidingWindowMLASpec`` (window ``coff * ratio``,
blocks of 4 rows at ratio 4 and 8 at ratio 128, pages aligned to 576 B, so
they share one tensor with the compressed caches); the rows a request needs
are the same, the page sizes are not.

**MTP layers**: ``num_nextn_predict_layers`` counts multi-token-prediction
layers stored after the ``num_hidden_layers`` decoder layers (V4's
``compress_ratios`` lists them at its end).  Engines run them only as a
speculative-decoding draft, with caches of their own, so the mapper leaves
them out, as the shipped model files do; the field is not read.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from kvcore.serving import ServingChoices
from kvcore.spec import KVCacheSpec
from kvcore_circular_buffer import CircularBufferSpec
from kvcore_hf.catalog import declared
from kvcore_hf.common import SameEveryLayer, layer, num_layers
from kvcore_hf.mapping import ModelConfig, ModelConfigError, ModelMapper
from kvcore_mla import MLAAttentionSpec
from kvcore_sliding_window import SlidingWindowMLASpec

__all__ = ["MAPPERS", "DeepseekMLA", "DeepseekV32", "DeepseekV4", "mla_latent"]

#: Tokens per FlashMLA page, which vLLM's MLA backends require.
MLA_BLOCK = 64
#: One fp32 scale (4 bytes) per this many fp8 values (indexer keys, fp8_ds_mla).
FP8_SCALE_BLOCK = 128
#: DeepSeek-V4's blocks: the compressed caches' and the SWA window's.
V4_COMPRESSED_BLOCK = 256
V4_SWA_BLOCK = 64
#: FlashMLA's row alignment for DeepSeek-V4 pages, in bytes.
V4_PAGE_ALIGNMENT = 576
#: DeepSeek-V4's NoPE values per UE8M0 scale byte.
V4_SCALE_GROUP = 64
#: The compression ratios vLLM serves (0 and 1 mean no compressed cache).
V4_RATIOS = (0, 1, 4, 128)


def mla_latent(config: ModelConfig, *, block_size: int = MLA_BLOCK) -> MLAAttentionSpec:
    """One MLA layer: a ``kv_lora_rank + qk_rope_head_dim`` latent per token,
    a single KV head, in the model's dtype (a NoPE model may set the RoPE
    part to 0)."""
    rope: int = config.field("qk_rope_head_dim", int)
    if rope < 0:
        msg = (
            f"{config.where}: field {config.prefix}qk_rope_head_dim must be 0 or "
            f"more, got {rope}"
        )
        raise ModelConfigError(msg)
    return MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=config.positive("kv_lora_rank") + rope,
        dtype=config.model_dtype(),
    )


def indexer_key_bytes(config: ModelConfig) -> int:
    """Bytes of one indexer key: ``index_head_dim`` fp8 values and an fp32
    scale per 128 of them."""
    dim = config.positive("index_head_dim")
    if dim % FP8_SCALE_BLOCK:
        msg = (
            f"{config.where}: field {config.prefix}index_head_dim must be a "
            f"multiple of {FP8_SCALE_BLOCK} (one fp32 scale per "
            f"{FP8_SCALE_BLOCK} fp8 key values), got {dim}"
        )
        raise ModelConfigError(msg)
    return dim + dim // FP8_SCALE_BLOCK * 4


@declared("deepseek-mla")
class DeepseekMLA(SameEveryLayer):
    def layer_spec(self, config: ModelConfig, choices: ServingChoices) -> KVCacheSpec:
        return mla_latent(config)


@declared("deepseek-v3.2")
class DeepseekV32(ModelMapper):
    def layer_specs(
        self, config: ModelConfig, choices: ServingChoices
    ) -> dict[str, KVCacheSpec]:
        # The latent carries its fp8_ds_mla record, which an 8-bit float
        # cache dtype (the file's or the engine's) turns it into; an engine
        # dtype of another width keeps the plain latent.
        dtype = choices.kv_cache_dtype or config.kv_cache_dtype()
        latent = mla_latent(config)
        if dtype is None or (dtype.is_floating_point and dtype.itemsize == 1):
            rank = config.positive("kv_lora_rank")
            if dtype is not None or rank % FP8_SCALE_BLOCK == 0:
                latent = attrs.evolve(latent, fp8_record_size=_fp8_ds_mla(config))
        keys = MLAAttentionSpec(
            block_size=MLA_BLOCK,
            num_kv_heads=1,
            head_size=indexer_key_bytes(config),
            dtype=torch.uint8,
        )
        out: dict[str, KVCacheSpec] = {}
        for i in range(num_layers(config)):
            out[layer(i)] = latent
            out[layer(i, "self_attn.indexer.k_cache")] = keys
        return out


@declared("deepseek-v4")
class DeepseekV4(ModelMapper):
    def layer_specs(
        self, config: ModelConfig, choices: ServingChoices
    ) -> dict[str, KVCacheSpec]:
        n = num_layers(config)
        ratios = _compress_ratios(config, n)
        head_dim = config.positive("head_dim")
        rope = config.positive("qk_rope_head_dim")
        nope = head_dim - rope
        if nope <= 0 or nope % V4_SCALE_GROUP:
            msg = (
                f"{config.where}: head_dim {head_dim} minus qk_rope_head_dim {rope} "
                f"must be a positive multiple of {V4_SCALE_GROUP} (one scale per "
                f"{V4_SCALE_GROUP} fp8 NoPE values)"
            )
            raise ModelConfigError(msg)
        record = nope + 2 * rope + nope // V4_SCALE_GROUP + 1
        window = SlidingWindowMLASpec(
            block_size=V4_SWA_BLOCK,
            num_kv_heads=1,
            head_size=record,
            dtype=torch.uint8,
            sliding_window=config.positive("sliding_window"),
            alignment=V4_PAGE_ALIGNMENT,
        )
        indexer: dict[str, KVCacheSpec] = {}
        if 4 in ratios:  # the index fields matter only where an indexer runs
            indexer = {
                "indexer.k_cache": _compressed(indexer_key_bytes(config), 4),
                "indexer.compressor.state_cache": _ring(
                    4, config.positive("index_head_dim")
                ),
            }
        out: dict[str, KVCacheSpec] = {}
        for i, ratio in enumerate(ratios):
            attn = layer(i, "attn")
            out[f"{attn}.swa_cache"] = window
            if ratio <= 1:
                continue
            out[attn] = _compressed(record, ratio)
            out[f"{attn}.compressor.state_cache"] = _ring(ratio, head_dim)
            if ratio == 4:
                out.update({f"{attn}.{part}": spec for part, spec in indexer.items()})
        return out


def _fp8_ds_mla(config: ModelConfig) -> int:
    """Bytes of V3.2's fp8 latent record: fp8 NoPE values with an fp32
    scale per 128 of them, then the RoPE part in bf16."""
    rank = config.positive("kv_lora_rank")
    if rank % FP8_SCALE_BLOCK:
        msg = (
            f"{config.where}: field {config.prefix}kv_lora_rank must be a multiple "
            f"of {FP8_SCALE_BLOCK} for the fp8_ds_mla cache (one fp32 scale per "
            f"{FP8_SCALE_BLOCK} values), got {rank}"
        )
        raise ModelConfigError(msg)
    rope: int = config.field("qk_rope_head_dim", int)
    return rank + rank // FP8_SCALE_BLOCK * 4 + 2 * rope


def _compress_ratios(config: ModelConfig, n: int) -> list[int]:
    """The first ``n`` entries of ``compress_ratios`` (later ones are MTP
    layers), each a ratio vLLM serves."""
    values: list[Any] = config.field("compress_ratios", list)
    where = f"{config.where}: field {config.prefix}compress_ratios"
    if len(values) < n:
        msg = (
            f"{where} lists {len(values)} ratios for {n} layers "
            "(num_hidden_layers); it needs one per layer"
        )
        raise ModelConfigError(msg)
    ratios = values[:n]
    for i, ratio in enumerate(ratios):
        if type(ratio) is not int or ratio not in V4_RATIOS:
            msg = (
                f"{where}[{i}] is {ratio!r}; DeepSeek-V4 layers run at ratio "
                f"{', '.join(map(str, V4_RATIOS))}"
            )
            raise ModelConfigError(msg)
    return ratios


def _compressed(head_bytes: int, ratio: int) -> MLAAttentionSpec:
    """A compressed cache: one ``head_bytes`` record per ``ratio`` tokens."""
    return MLAAttentionSpec(
        block_size=V4_COMPRESSED_BLOCK,
        num_kv_heads=1,
        head_size=head_bytes,
        dtype=torch.uint8,
        tokens_per_state=ratio,
        alignment=V4_PAGE_ALIGNMENT,
    )


def _ring(ratio: int, head_dim: int) -> CircularBufferSpec:
    """A compressor's partial state: ``coff * ratio`` fp32 rows of kv and
    score halves, ``coff`` = 2 where ratio-4 windows overlap."""
    coff = 2 if ratio == 4 else 1
    return CircularBufferSpec(
        block_size=coff * ratio,
        num_kv_heads=1,
        head_size=2 * coff * head_dim,
        head_size_v=0,
        dtype=torch.float32,
    )


MAPPERS = (DeepseekMLA(), DeepseekV32(), DeepseekV4())
