"""The bytes of a model's weights, estimated from its ``config.json``.

The estimate lists every tensor a checkpoint of the architecture holds, from
the shapes the configuration fixes, and sizes each one in the format the
file's ``quantization_config`` stores it in:

- token embeddings and, unless ``tie_word_embeddings``, the output head;
- attention: query / key / value / output projections (grouped-query heads,
  biases, query-key norms, sinks, Qwen3-Next's gated query) or DeepSeek's
  multi-head latent attention (low-rank query and key-value projections,
  their norms, DeepSeek-V3.2's indexer);
- feed-forward: dense gated MLPs, mixture-of-experts layers (routed experts,
  shared experts, the router and its bias), placed by each family's rule;
- state mixers: Mamba-1 (Jamba), Mamba-2 (Falcon-H1 beside attention in
  every layer, Nemotron-H in the layers its pattern marks ``M``) and Gated
  DeltaNet (Qwen3-Next); Falcon-H1's muP multipliers scale activations and
  hold no tensor;
- Nemotron-H's one-mixer blocks: each layer a norm and one of Mamba-2,
  attention, a squared-ReLU MLP (up and down projections, no gate) or a
  mixture of such experts with a shared one and an optional latent
  projection;
- the norms, multi-token-prediction layers the checkpoint ships
  (``num_nextn_predict_layers``) and a vision tower under ``vision_config``;
- the formats: the weights' dtype (a float32 file counts as served, in
  bfloat16), ``fp8`` with block or per-tensor scales, ``mxfp4`` experts,
  4-bit ``awq`` / ``gptq`` with group scales and zeros, and
  ``compressed-tensors`` weight schemes, each keeping
  ``modules_to_not_convert`` / ``ignore`` modules unquantized.

Sources: transformers ``models/*/modeling_*.py`` (the tensors of Llama,
Qwen2/3, Qwen3-MoE, Qwen3-Next, Gemma 2/3, gpt-oss, Jamba, Llama 4,
DeepSeek-V3/V3.2; Falcon-H1's ``FalconH1Mixer`` and
``FalconH1DecoderLayer``, Nemotron-H's ``NemotronHMamba2Mixer``,
``NemotronHMoE`` and ``NemotronHBlock``); DeepSeek-V3's
``README_WEIGHTS.md`` (the MTP module holds a whole decoder layer, its own
embedding and head); vLLM ``model_executor/layers/quantization`` (fp8
``weight_scale_inv`` per 128 x 128 block, AWQ/GPTQ
``qweight``/``qzeros``/``scales``/``g_idx``, MXFP4 blocks of 32 values with
one uint8 scale).  Published checkpoint sizes it is checked against are in
``docs/capacity.md``.
"""

from __future__ import annotations

import fnmatch
import math
import re
import threading
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import attrs

from kvcore.limits import HUB_CONNECT_TIMEOUT_S, HUB_FETCH_TIMEOUT_S


class ModelConfig(Protocol):
    """What the estimate reads of a :class:`kvcore_hf.mapping.ModelConfig`."""

    @property
    def root(self) -> Mapping[str, Any]: ...
    @property
    def text(self) -> Mapping[str, Any]: ...
    @property
    def prefix(self) -> str: ...
    @property
    def model_types(self) -> tuple[str, ...]: ...


__all__ = [
    "Tensor",
    "WeightsEstimate",
    "estimate_weights",
    "hub_checkpoint_bytes",
    "tensors",
]


@attrs.frozen
class Tensor:
    """``count`` tensors of ``rows x cols`` values, named as a checkpoint
    names them (``model.layers.3.mlp.experts.down_proj``)."""

    name: str
    part: str
    rows: int
    cols: int = 1
    count: int = 1
    #: a linear layer's weight, which a quantization config may compress.
    linear: bool = False

    @property
    def numel(self) -> int:
        return self.rows * self.cols * self.count


@attrs.frozen
class WeightsEstimate:
    """The estimate: bytes, parameters and bytes by part of the model."""

    bytes: int
    params: int
    parts: dict[str, int]
    #: how the bytes were sized (dtype and quantization), for notes.
    format: str


# -- the tensors ---------------------------------------------------------------


def _get(part: Mapping[str, Any], name: str, default: Any = None) -> Any:
    value = part.get(name)
    return default if value is None else value


def _int(part: Mapping[str, Any], name: str, default: int | None = None) -> int:
    value = part.get(name)
    if type(value) is int and value >= 0:
        return value
    if default is None:
        msg = f"field {name} is missing or not a whole number"
        raise KeyError(msg)
    return default


def _linear(name: str, part: str, out: int, inp: int, *, count: int = 1) -> Tensor:
    return Tensor(name, part, out, inp, count, linear=True)


def _attention(t: Mapping[str, Any], p: str, family: str) -> Iterator[Tensor]:
    """One attention block's tensors (``p`` is ``model.layers.i.self_attn``)."""
    hidden = _int(t, "hidden_size")
    heads = _int(t, "num_attention_heads")
    if t.get("kv_lora_rank"):
        yield from _mla(t, p, hidden, heads)
        return
    kv = _int(t, "num_key_value_heads", heads)
    dim = _int(t, "head_dim", hidden // heads)
    gate = 2 if family == "qwen3_next" else 1  # the output gate rides on q
    yield _linear(f"{p}.q_proj", "attention", gate * heads * dim, hidden)
    yield _linear(f"{p}.k_proj", "attention", kv * dim, hidden)
    yield _linear(f"{p}.v_proj", "attention", kv * dim, hidden)
    yield _linear(f"{p}.o_proj", "attention", hidden, heads * dim)
    if _get(t, "attention_bias", False):
        yield Tensor(f"{p}.qkv_bias", "attention", (heads + 2 * kv) * dim)
        if family in ("gpt_oss", "falcon_h1"):
            yield Tensor(f"{p}.o_proj.bias", "attention", hidden)
    elif family in ("qwen2", "qwen2_moe"):
        yield Tensor(f"{p}.qkv_bias", "attention", (heads + 2 * kv) * dim)
    if family in ("qwen3", "qwen3_moe", "qwen3_next", "gemma3"):
        yield Tensor(f"{p}.qk_norm", "norms", 2 * dim)
    if family == "gpt_oss":
        yield Tensor(f"{p}.sinks", "attention", heads)


#: What the configuration classes give the shape fields a file may leave
#: out, where the class's default is a constant rather than derived from
#: other fields (transformers ``Gemma2Config``, ``Gemma3TextConfig``,
#: ``GptOssConfig``, ``Qwen3Config``): Gemma-3-4B's ``text_config``, for
#: one, gives neither its heads nor its head size nor its vocabulary.
_CLASS_DEFAULTS: dict[str, dict[str, int]] = {
    "gemma2": {
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "vocab_size": 256_000,
    },
    "gemma3": {
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "vocab_size": 262_208,
    },
    "gpt_oss": {"head_dim": 64},
    "qwen3": {"head_dim": 128},
}  # fmt: skip


def _mla(t: Mapping[str, Any], p: str, hidden: int, heads: int) -> Iterator[Tensor]:
    rope = _int(t, "qk_rope_head_dim")
    nope = _int(t, "qk_nope_head_dim")
    v = _int(t, "v_head_dim")
    rank = _int(t, "kv_lora_rank")
    q_rank = t.get("q_lora_rank")
    if q_rank:
        yield _linear(f"{p}.q_a_proj", "attention", q_rank, hidden)
        yield Tensor(f"{p}.q_a_layernorm", "norms", q_rank)
        yield _linear(f"{p}.q_b_proj", "attention", heads * (nope + rope), q_rank)
    else:
        yield _linear(f"{p}.q_proj", "attention", heads * (nope + rope), hidden)
    yield _linear(f"{p}.kv_a_proj_with_mqa", "attention", rank + rope, hidden)
    yield Tensor(f"{p}.kv_a_layernorm", "norms", rank)
    yield _linear(f"{p}.kv_b_proj", "attention", heads * (nope + v), rank)
    yield _linear(f"{p}.o_proj", "attention", hidden, heads * v)
    if t.get("index_n_heads") and q_rank:  # DeepSeek-V3.2's lightning indexer
        ih, idim = _int(t, "index_n_heads"), _int(t, "index_head_dim")
        yield _linear(f"{p}.indexer.wq_b", "attention", ih * idim, q_rank)
        yield _linear(f"{p}.indexer.wk", "attention", idim, hidden)
        yield Tensor(f"{p}.indexer.k_norm", "norms", 2 * idim)
        yield Tensor(f"{p}.indexer.weights_proj", "attention", ih, hidden)


def _mlp(p: str, hidden: int, inter: int, part: str = "mlp") -> Iterator[Tensor]:
    yield _linear(f"{p}.gate_proj", part, inter, hidden)
    yield _linear(f"{p}.up_proj", part, inter, hidden)
    yield _linear(f"{p}.down_proj", part, hidden, inter)


def _is_moe(t: Mapping[str, Any], i: int, family: str) -> bool:
    """Whether layer ``i`` holds experts (each family's placement rule)."""
    if family in ("deepseek_v3", "deepseek_v32", "deepseek_v2", "kimi_k2"):
        if not t.get("n_routed_experts"):
            return False
        freq = _int(t, "moe_layer_freq", 1)
        return i >= _int(t, "first_k_dense_replace", 0) and i % freq == 0
    if family == "jamba":
        period, offset = (
            _int(t, "expert_layer_period", 2),
            _int(t, "expert_layer_offset", 1),
        )
        return _int(t, "num_experts", 1) > 1 and i % period == offset
    if family == "llama4_text":
        step = _int(t, "interleave_moe_layer_step", 1)
        listed = t.get("moe_layers")
        if isinstance(listed, list):
            return i in listed
        return (i + 1) % step == 0
    if family in ("qwen2_moe", "qwen3_moe", "qwen3_next"):
        if i in (_get(t, "mlp_only_layers", []) or []):
            return False
        step = _int(t, "decoder_sparse_step", 1)
        return _int(t, "num_experts", 0) > 0 and (i + 1) % step == 0
    if family == "nemotron_h":
        return _pattern(t)[i] == "E"
    if family in ("gpt_oss", "mixtral", "glm4_moe"):
        if family == "glm4_moe":
            return i >= _int(t, "first_k_dense_replace", 1)
        return True
    return False


def _feed_forward(
    t: Mapping[str, Any], p: str, i: int, family: str
) -> Iterator[Tensor]:
    hidden = _int(t, "hidden_size")
    if family == "nemotron_h":
        yield from _relu2_feed_forward(t, p, _is_moe(t, i, family))
        return
    if not _is_moe(t, i, family):
        inter = _int(t, "intermediate_size")
        if family == "llama4_text":
            inter = _int(t, "intermediate_size_mlp", inter)
        yield from _mlp(p, hidden, inter)
        return
    experts = _int(
        t, "n_routed_experts", _int(t, "num_local_experts", _int(t, "num_experts", 0))
    )
    inter = _int(t, "moe_intermediate_size", _int(t, "intermediate_size", 0))
    e = f"{p}.experts"
    yield _linear(f"{e}.gate_proj", "experts", inter, hidden, count=experts)
    yield _linear(f"{e}.up_proj", "experts", inter, hidden, count=experts)
    yield _linear(f"{e}.down_proj", "experts", hidden, inter, count=experts)
    router = (
        f"{p}.router" if family in ("gpt_oss", "jamba", "llama4_text") else f"{p}.gate"
    )
    yield Tensor(router, "router", experts, hidden)
    if family == "gpt_oss":  # biased experts and router
        yield Tensor(f"{e}.biases", "experts", 3 * inter + hidden, count=experts)
        yield Tensor(f"{router}.bias", "router", experts)
    if family in ("deepseek_v3", "deepseek_v32", "kimi_k2", "glm4_moe"):
        yield Tensor(f"{p}.gate.e_score_correction_bias", "router", experts)
    shared = _int(t, "n_shared_experts", 0)
    if shared:
        yield from _mlp(f"{p}.shared_experts", hidden, shared * inter, "experts")
    elif family in ("qwen2_moe", "qwen3_next") and t.get(
        "shared_expert_intermediate_size"
    ):
        yield from _mlp(
            f"{p}.shared_expert",
            hidden,
            _int(t, "shared_expert_intermediate_size"),
            "experts",
        )
        yield Tensor(f"{p}.shared_expert_gate", "router", 1, hidden)
    elif family == "llama4_text":
        yield from _mlp(
            f"{p}.shared_expert", hidden, _int(t, "intermediate_size"), "experts"
        )


def _relu2_feed_forward(t: Mapping[str, Any], p: str, moe: bool) -> Iterator[Tensor]:
    """Nemotron-H's MLP (up and down projections) or its mixture of such
    experts: a sigmoid router with a score-correction bias, one shared
    expert, and inputs the ``moe_latent_size`` projections narrow."""
    hidden = _int(t, "hidden_size")
    if not moe:
        inter = _int(t, "intermediate_size")
        yield _linear(f"{p}.up_proj", "mlp", inter, hidden)
        yield _linear(f"{p}.down_proj", "mlp", hidden, inter)
        return
    experts = _int(t, "n_routed_experts")
    inter = _int(t, "moe_intermediate_size")
    width = _int(t, "moe_latent_size", hidden)
    if width != hidden:
        yield _linear(f"{p}.fc1_latent_proj", "experts", width, hidden)
        yield _linear(f"{p}.fc2_latent_proj", "experts", hidden, width)
    e = f"{p}.experts"
    yield _linear(f"{e}.up_proj", "experts", inter, width, count=experts)
    yield _linear(f"{e}.down_proj", "experts", width, inter, count=experts)
    yield Tensor(f"{p}.gate", "router", experts, hidden)
    yield Tensor(f"{p}.gate.e_score_correction_bias", "router", experts)
    shared = _int(t, "moe_shared_expert_intermediate_size", inter)
    yield _linear(f"{p}.shared_experts.up_proj", "experts", shared, hidden)
    yield _linear(f"{p}.shared_experts.down_proj", "experts", hidden, shared)


def _mamba1(t: Mapping[str, Any], p: str) -> Iterator[Tensor]:
    hidden = _int(t, "hidden_size")
    inner = _int(t, "mamba_expand", 2) * hidden
    state = _int(t, "mamba_d_state", 16)
    conv = _int(t, "mamba_d_conv", 4)
    rank = _int(t, "mamba_dt_rank", math.ceil(hidden / 16))
    yield _linear(f"{p}.in_proj", "mixer", 2 * inner, hidden)
    yield Tensor(
        f"{p}.conv1d",
        "mixer",
        inner,
        conv + (1 if _get(t, "mamba_conv_bias", True) else 0),
    )
    yield _linear(f"{p}.x_proj", "mixer", rank + 2 * state, inner)
    yield _linear(f"{p}.dt_proj", "mixer", inner, rank)
    yield Tensor(f"{p}.dt_proj.bias", "mixer", inner)
    yield Tensor(f"{p}.A_log", "mixer", inner, state)
    yield Tensor(f"{p}.D", "mixer", inner)
    yield _linear(f"{p}.out_proj", "mixer", hidden, inner)
    yield Tensor(f"{p}.bcdt_layernorms", "norms", rank + 2 * state)


def _mamba2(t: Mapping[str, Any], p: str, family: str) -> Iterator[Tensor]:
    """A Mamba-2 mixer: one input projection to the gate, x, B, C and a
    time step per head; a depthwise convolution over x, B and C; dt_bias,
    A_log and D per head; a gated norm; the output projection.  Falcon-H1
    names its width ``mamba_d_ssm`` (else ``mamba_expand * hidden_size``)
    and makes the norm optional; Nemotron-H's is ``mamba_num_heads *
    mamba_head_dim``."""
    hidden = _int(t, "hidden_size")
    if family == "nemotron_h":
        heads = _int(t, "mamba_num_heads")
        inner = heads * _int(t, "mamba_head_dim")
        groups = _int(t, "n_groups", _int(t, "mamba_n_groups", 8))
        state = _int(t, "ssm_state_size")
        conv = _int(t, "conv_kernel", _int(t, "mamba_d_conv", 4))
        conv_bias = _get(t, "use_conv_bias", True)
        in_bias = out_bias = _get(t, "use_bias", False)
        norm = True
    else:
        heads = _int(t, "mamba_n_heads")
        inner = _int(t, "mamba_d_ssm", _int(t, "mamba_expand", 2) * hidden)
        groups = _int(t, "mamba_n_groups", 1)
        state = _int(t, "mamba_d_state")
        conv = _int(t, "mamba_d_conv", 4)
        conv_bias = _get(t, "mamba_conv_bias", True)
        in_bias = _get(t, "mamba_proj_bias", False)
        out_bias = _get(t, "projectors_bias", False)
        norm = _get(t, "mamba_rms_norm", False)
    convolved = inner + 2 * groups * state  # x, B and C
    projected = inner + convolved + heads
    yield _linear(f"{p}.in_proj", "mixer", projected, hidden)
    if in_bias:
        yield Tensor(f"{p}.in_proj.bias", "mixer", projected)
    yield Tensor(f"{p}.conv1d", "mixer", convolved, conv + (1 if conv_bias else 0))
    yield Tensor(f"{p}.dt_bias_A_log_D", "mixer", 3 * heads)
    if norm:
        yield Tensor(f"{p}.norm", "norms", inner)
    yield _linear(f"{p}.out_proj", "mixer", hidden, inner)
    if out_bias:
        yield Tensor(f"{p}.out_proj.bias", "mixer", hidden)


def _gated_delta_net(t: Mapping[str, Any], p: str) -> Iterator[Tensor]:
    hidden = _int(t, "hidden_size")
    nk, dk = _int(t, "linear_num_key_heads"), _int(t, "linear_key_head_dim")
    nv, dv = _int(t, "linear_num_value_heads"), _int(t, "linear_value_head_dim")
    conv = _int(t, "linear_conv_kernel_dim", 4)
    yield _linear(f"{p}.in_proj_qkvz", "mixer", 2 * nk * dk + 2 * nv * dv, hidden)
    yield _linear(f"{p}.in_proj_ba", "mixer", 2 * nv, hidden)
    yield Tensor(f"{p}.conv1d", "mixer", 2 * nk * dk + nv * dv, conv)
    yield Tensor(f"{p}.dt_bias_A_log", "mixer", 2 * nv)
    yield Tensor(f"{p}.norm", "norms", dv)
    yield _linear(f"{p}.out_proj", "mixer", hidden, nv * dv)


#: Nemotron-H's ``layers_block_type`` names as pattern letters.
_BLOCK_LETTERS = {
    "mamba": "M", "linear_attention": "M", "attention": "*",
    "full_attention": "*", "mlp": "-", "moe": "E",
}  # fmt: skip


def _pattern(t: Mapping[str, Any]) -> str:
    """Nemotron-H's layers, a letter each (``M`` Mamba-2, ``*`` attention,
    ``-`` MLP, ``E`` experts): ``hybrid_override_pattern``, else
    ``layers_block_type``; the pattern sets the layer count."""
    pattern = t.get("hybrid_override_pattern")
    if not isinstance(pattern, str):
        types = t.get("layers_block_type")
        if not isinstance(types, list):
            msg = "hybrid_override_pattern"
            raise KeyError(msg)
        pattern = "".join(_BLOCK_LETTERS.get(str(kind), "?") for kind in types)
    if not pattern or set(pattern) - set("M*-E"):
        msg = f"layer pattern {pattern!r}"
        raise ValueError(msg)
    return pattern


def _mixer_kind(t: Mapping[str, Any], i: int, family: str) -> str:
    """``attention``, ``mamba``, ``linear_attention`` or, for Falcon-H1's
    layers, ``hybrid`` (attention and Mamba-2 side by side) for layer
    ``i``; Nemotron-H's are ``mamba2``, ``attention``, ``mlp`` or ``moe``."""
    if family == "falcon_h1":
        return "hybrid"
    if family == "nemotron_h":
        letter = _pattern(t)[i]
        return {"M": "mamba2", "*": "attention", "-": "mlp"}.get(letter, "moe")
    if family == "jamba":
        period, offset = (
            _int(t, "attn_layer_period", 8),
            _int(t, "attn_layer_offset", 4),
        )
        return "attention" if i % period == offset else "mamba"
    if family == "qwen3_next":
        types = t.get("layer_types")
        if isinstance(types, list) and i < len(types):
            return "attention" if types[i] == "full_attention" else "linear_attention"
        interval = _int(t, "full_attention_interval", 4)
        return "attention" if (i + 1) % interval == 0 else "linear_attention"
    return "attention"


def _v4_ratio(t: Mapping[str, Any], i: int) -> int:
    """DeepSeek-V4 layer ``i``'s compression ratio (0: sliding window only),
    from ``compress_ratios`` or ``layer_types`` (transformers' default: two
    heavily compressed layers, then compressed-sparse and heavily
    compressed in turn)."""
    ratios = t.get("compress_ratios")
    if isinstance(ratios, list) and i < len(ratios):
        return int(ratios[i])
    types = t.get("layer_types")
    by_type = {"sliding_attention": 0, "compressed_sparse_attention": 4}
    if isinstance(types, list) and i < len(types):
        return by_type.get(types[i], 128)
    return 128 if i < 2 or i % 2 == 0 else 4


def _deepseek_v4(t: Mapping[str, Any], i: int, p: str) -> Iterator[Tensor]:
    """A DeepSeek-V4 decoder layer: low-rank query, one shared key-value
    head, a grouped output projection, the layer's compressor (and indexer
    on ratio-4 layers), routed and shared experts, hyper-connections."""
    hidden = _int(t, "hidden_size")
    heads, dim = _int(t, "num_attention_heads"), _int(t, "head_dim")
    q_rank = _int(t, "q_lora_rank")
    groups, o_rank = _int(t, "o_groups", 8), _int(t, "o_lora_rank", 1024)
    a = f"{p}.attn"
    yield _linear(f"{a}.wq_a", "attention", q_rank, hidden)
    yield _linear(f"{a}.wq_b", "attention", heads * dim, q_rank)
    yield _linear(f"{a}.wkv", "attention", dim, hidden)
    yield _linear(f"{a}.wo_a", "attention", groups * o_rank, heads * dim // groups)
    yield _linear(f"{a}.wo_b", "attention", hidden, groups * o_rank)
    yield Tensor(f"{a}.norms_sinks", "norms", q_rank + dim + heads)
    ratio = _v4_ratio(t, i)
    if ratio:
        width = 2 * dim if ratio == 4 else dim
        yield _linear(f"{a}.compressor.wkv_wgate", "attention", 2 * width, hidden)
        yield Tensor(f"{a}.compressor.ape_norm", "attention", ratio * width + dim)
    if ratio == 4:
        ih, idim = _int(t, "index_n_heads"), _int(t, "index_head_dim")
        x = f"{a}.indexer"
        yield _linear(f"{x}.compressor.wkv_wgate", "attention", 4 * idim, hidden)
        yield Tensor(f"{x}.compressor.ape_norm", "attention", ratio * 2 * idim + idim)
        yield _linear(f"{x}.wq_b", "attention", ih * idim, q_rank)
        yield Tensor(f"{x}.weights_proj", "attention", ih, hidden)
    experts = _int(t, "n_routed_experts", 256)
    inter = _int(t, "moe_intermediate_size", 2048)
    m = f"{p}.ffn"
    yield _linear(f"{m}.experts.w1", "experts", inter, hidden, count=experts)
    yield _linear(f"{m}.experts.w3", "experts", inter, hidden, count=experts)
    yield _linear(f"{m}.experts.w2", "experts", hidden, inter, count=experts)
    yield Tensor(f"{m}.gate", "router", experts, hidden)
    yield Tensor(f"{m}.gate.bias", "router", experts)
    if i < _int(t, "num_hash_layers", 3):  # hash routing: a token-to-expert table
        top = _int(t, "num_experts_per_tok", 6)
        yield Tensor(f"{m}.gate.tid2eid", "router", _int(t, "vocab_size"), top)
    yield from _mlp(
        f"{m}.shared_experts", hidden, _int(t, "n_shared_experts", 1) * inter, "experts"
    )
    hc = _int(t, "hc_mult", 4)
    mix = (2 + hc) * hc
    yield Tensor(f"{p}.hc", "norms", 2 * (mix * hc * hidden + mix + 3))
    yield Tensor(f"{p}.layernorms", "norms", 2 * hidden)


def _layer(t: Mapping[str, Any], i: int, family: str, prefix: str) -> Iterator[Tensor]:
    hidden = _int(t, "hidden_size")
    p = f"{prefix}.layers.{i}"
    if family == "deepseek_v4":
        yield from _deepseek_v4(t, i, p)
        return
    kind = _mixer_kind(t, i, family)
    if family == "nemotron_h":  # a norm and one mixer a block
        if kind == "mamba2":
            yield from _mamba2(t, f"{p}.mixer", family)
        elif kind == "attention":
            yield from _attention(t, f"{p}.mixer", family)
        else:
            yield from _feed_forward(t, f"{p}.mixer", i, family)
        yield Tensor(f"{p}.norm", "norms", hidden)
        return
    if kind == "mamba":
        yield from _mamba1(t, f"{p}.mamba")
    elif kind == "linear_attention":
        yield from _gated_delta_net(t, f"{p}.linear_attn")
    else:
        yield from _attention(t, f"{p}.self_attn", family)
    if kind == "hybrid":
        yield from _mamba2(t, f"{p}.mamba", family)
    ff = "feed_forward" if family == "falcon_h1" else "mlp"
    yield from _feed_forward(t, f"{p}.{ff}", i, family)
    norms = 4 if family in ("gemma2", "gemma3") else 2
    yield Tensor(f"{p}.layernorms", "norms", norms * hidden)


def _vision(v: Mapping[str, Any], text_hidden: int, family: str) -> Iterator[Tensor]:
    """A ViT-style tower (SigLIP, Llama 4's encoder) and its projector."""
    h = _int(v, "hidden_size")
    layers = _int(v, "num_hidden_layers")
    inter = _int(v, "intermediate_size", 4304 if family == "gemma3" else 5632)
    patch = _int(v, "patch_size", 14)
    image = _int(v, "image_size", 896 if family == "gemma3" else 336)
    p = "vision_tower.layers"
    attn = 4 * (h * h + h)
    mlp = 2 * h * inter + inter + h
    yield Tensor(f"{p}.*", "vision", attn + mlp + 4 * h, count=layers)
    positions = (image // patch) ** 2 + 1
    yield Tensor(
        "vision_tower.embeddings", "vision", 3 * patch * patch * h + h + positions * h
    )
    yield Tensor("vision_tower.post_layernorm", "vision", 2 * h)
    if family == "gemma3":
        yield Tensor("multi_modal_projector", "vision", h * text_hidden + h)
    else:
        out = _int(v, "vision_output_dim", 4096)
        proj_in = _int(v, "projector_input_dim", 4096)
        yield Tensor(
            "vision_model.vision_adapter", "vision", inter * 4 * proj_in + proj_in * out
        )
        yield Tensor("multi_modal_projector", "vision", out * text_hidden)


def _mtp(
    t: Mapping[str, Any], family: str, layers: int, hidden: int, vocab: int
) -> Iterator[Tensor]:
    """The multi-token-prediction layers the checkpoint ships: DeepSeek's
    (``num_nextn_predict_layers``: a whole decoder layer with its own
    embedding and head) and Qwen3-Next's (one full-attention layer and a
    projection unless the file says otherwise, as vLLM's loader reads it)."""
    if family == "qwen3_next":
        count = _int(t, "num_nextn_predict_layers", 1)
        for i in range(count):
            p = f"mtp.layers.{i}"
            yield from _attention(t, f"{p}.self_attn", family)
            yield from _feed_forward(t, f"{p}.mlp", 0, family)
            yield Tensor(f"{p}.layernorms", "norms", 2 * hidden)
        if count:
            yield _linear("mtp.fc", "mtp", hidden, 2 * hidden)
            yield Tensor("mtp.norms", "norms", 3 * hidden)
        return
    if family == "nemotron_h":
        # the pattern has no letter for them: a checkpoint's mtp.* tensors
        # (transformers skips them on load) are not counted.
        return
    for i in range(layers, layers + _int(t, "num_nextn_predict_layers", 0)):
        yield from _layer(t, i, family, "model")
        p = f"model.layers.{i}"
        yield _linear(f"{p}.eh_proj", "mtp", hidden, 2 * hidden)
        yield Tensor(f"{p}.enorm_hnorm_norm", "norms", 3 * hidden)
        yield Tensor(f"{p}.embed_tokens", "mtp", vocab, hidden)
        yield Tensor(f"{p}.shared_head.head", "mtp", vocab, hidden)


#: families whose output head shares the embedding unless the file says.
_TIED_BY_DEFAULT = ("gemma", "gemma2", "gemma3", "gemma3_text")

#: the model types of each family (``model_type`` of the language model).
_FAMILIES = {
    "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen2_moe": "qwen2_moe",
    "qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "qwen3_next": "qwen3_next",
    "gemma2": "gemma2", "gemma3": "gemma3", "gemma3_text": "gemma3",
    "gpt_oss": "gpt_oss", "jamba": "jamba", "mixtral": "mixtral",
    "llama4": "llama4_text", "llama4_text": "llama4_text",
    "deepseek_v2": "deepseek_v3", "deepseek_v3": "deepseek_v3",
    "deepseek_v32": "deepseek_v32", "deepseek_v4": "deepseek_v4",
    "kimi_k2": "kimi_k2", "glm4_moe": "glm4_moe",
    "falcon_h1": "falcon_h1", "nemotron_h": "nemotron_h",
}  # fmt: skip


def family_of(config: ModelConfig) -> str | None:
    """The family whose tensors :func:`tensors` knows, or None."""
    for model_type in config.model_types:
        if model_type in _FAMILIES:
            return _FAMILIES[model_type]
    return None


def tensors(config: ModelConfig) -> list[Tensor]:
    """Every tensor of the checkpoint ``config`` describes.

    :raises KeyError: a shape field the family needs is missing.
    :raises ValueError: the family is not one this module knows.
    """
    family = family_of(config)
    if family is None:
        msg = f"no weight layout for model_type {', '.join(config.model_types) or '?'}"
        raise ValueError(msg)
    given = {k: v for k, v in config.text.items() if v is not None}
    t = {**_CLASS_DEFAULTS.get(family, {}), **given}
    if family == "nemotron_h" and "head_dim" not in t and "attention_head_dim" in t:
        t["head_dim"] = t["attention_head_dim"]  # older files' name for it
    hidden = _int(t, "hidden_size")
    vocab = _int(t, "vocab_size")
    out: list[Tensor] = [Tensor("model.embed_tokens", "embeddings", vocab, hidden)]
    tied = _get(
        t, "tie_word_embeddings", _get(config.root, "tie_word_embeddings", None)
    )
    if tied is None:
        tied = family in _TIED_BY_DEFAULT
    if not tied:
        out.append(_linear("lm_head", "embeddings", vocab, hidden))
    out.append(Tensor("model.norm", "norms", hidden))
    if family == "nemotron_h":
        layers = len(_pattern(t))
    else:
        layers = _int(t, "num_hidden_layers")
    for i in range(layers):
        out.extend(_layer(t, i, family, "model"))
    out.extend(_mtp(t, family, layers, hidden, vocab))
    vision = config.root.get("vision_config")
    if isinstance(vision, Mapping) and config.prefix:
        out.extend(_vision(vision, hidden, family))
    return out


# -- sizing --------------------------------------------------------------------

_DTYPE_BYTES = {
    "bfloat16": 2, "float16": 2, "half": 2, "float32": 2, "float": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}  # fmt: skip


def _dtype_bytes(config: ModelConfig) -> tuple[int, str]:
    """Bytes per unquantized value: the served dtype (float32 files are
    served in bfloat16, as vLLM's ``auto`` dtype does)."""
    for part in (config.text, config.root):
        for key in ("torch_dtype", "dtype"):
            value = part.get(key)
            if isinstance(value, str) and value.lower() in _DTYPE_BYTES:
                name = value.lower()
                served = "bfloat16" if name in ("float32", "float") else name
                return _DTYPE_BYTES[name], served
    return 2, "bfloat16"


def _skipped(name: str, patterns: list[str]) -> bool:
    """Whether ``name`` is one of ``modules_to_not_convert`` / ``ignore``:
    a glob (``model.layers.*.self_attn``), a ``re:`` regex, or a module
    name that names it or one of its parents (``lm_head``, ``gate``)."""
    dotted = f".{name}."
    for pattern in patterns:
        if pattern.startswith("re:"):
            found = re.match(pattern[3:], name) is not None
        else:
            found = (
                fnmatch.fnmatchcase(name, pattern)
                or fnmatch.fnmatchcase(name, pattern + ".*")
                or f".{pattern}." in dotted
            )
        if found:
            return True
    return False


#: The format a family's checkpoints are released in when the file names no
#: ``quantization_config``: DeepSeek-V4 ships routed experts in FP4 (e2m1
#: pairs, one ue8m0 scale per 32 values) and the other linear layers in FP8
#: with 128 x 128 block scales (the release's own format, as the native
#: FP4/FP8 conversions of deepseek-ai/DeepSeek-V4-Flash describe it).
_RELEASE_FORMATS: dict[str, Mapping[str, Any]] = {
    "deepseek_v4": {
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "experts": "fp4",
    },
}


class _Format:
    """How one quantization config stores a linear weight."""

    def __init__(self, quant: Mapping[str, Any] | None, dense: int, dtype: str) -> None:
        self.dense = dense
        self.method = str(quant.get("quant_method", "")).lower() if quant else ""
        self.quant = quant or {}
        skip = (
            self.quant.get("modules_to_not_convert") or self.quant.get("ignore") or []
        )
        self.skip = [s for s in skip if isinstance(s, str)]
        self.dtype = dtype
        self.bits, self.group, self.block = 16, 0, (0, 0)
        if self.method in ("awq", "gptq", "autoround", "auto-round"):
            self.bits = _int(self.quant, "bits", _int(self.quant, "w_bit", 4))
            self.group = _int(
                self.quant, "group_size", _int(self.quant, "q_group_size", 128)
            )
        elif self.method == "compressed-tensors":
            self._compressed_tensors()
        elif self.method == "fp8":
            self.bits = 8
            block = self.quant.get("weight_block_size")
            if isinstance(block, list) and len(block) == 2:
                self.block = (int(block[0]), int(block[1]))
        elif self.method == "mxfp4":
            self.bits, self.group = 4, 32
        #: routed experts in FP4 (4 bits, a one-byte scale per 32 values).
        self.fp4_experts = self.quant.get("experts") == "fp4"

    def _compressed_tensors(self) -> None:
        groups = self.quant.get("config_groups")
        weights = None
        if isinstance(groups, Mapping):
            for group in groups.values():
                if isinstance(group, Mapping) and isinstance(
                    group.get("weights"), Mapping
                ):
                    weights = group["weights"]
                    break
        if weights is None:
            return
        self.bits = _int(weights, "num_bits", 16)
        strategy = str(weights.get("strategy", "tensor"))
        if strategy == "group":
            self.group = _int(weights, "group_size", 128)
        elif strategy == "block":
            block = weights.get("block_structure") or [128, 128]
            self.block = (int(block[0]), int(block[1]))
        elif strategy == "channel":
            self.group = -1

    def describe(self) -> str:
        """``"fp8 with 128x128 block scales, the rest bfloat16"``."""
        if not self.method or self.bits >= 16:
            return self.dtype
        if self.method == "fp8":
            detail = "fp8"
            if self.block[0]:
                detail += f" with {self.block[0]}x{self.block[1]} block scales"
            if self.fp4_experts:
                detail += ", FP4 routed experts"
        elif self.method == "mxfp4":
            detail = "MXFP4 experts (4 bits + a scale per 32 values)"
        else:
            detail = f"{self.method} {self.bits}-bit"
            if self.group > 0:
                detail += f", group {self.group}"
        return f"{detail}, the rest {self.dtype}"

    def size(self, tensor: Tensor) -> int:
        if (
            not tensor.linear
            or not self.method
            or self.bits >= 16
            or _skipped(tensor.name, self.skip)
        ):
            return tensor.numel * self.dense
        if self.method == "mxfp4" and tensor.part != "experts":
            return tensor.numel * self.dense
        if self.fp4_experts and tensor.part == "experts" and ".experts." in tensor.name:
            return math.ceil(tensor.numel / 2) + math.ceil(tensor.numel / 32)
        rows, cols, count = tensor.rows, tensor.cols, tensor.count
        values = math.ceil(tensor.numel * self.bits / 8)
        if self.block[0]:
            blocks = math.ceil(rows / self.block[0]) * math.ceil(cols / self.block[1])
            return values + blocks * 4 * count
        if self.method == "fp8":
            return values + 4 * count  # one per-tensor scale
        if self.method == "mxfp4":
            return values + math.ceil(tensor.numel / 32)
        if self.group == -1:  # one scale per output channel
            return values + rows * 2 * count
        groups = math.ceil(cols / self.group) if self.group else 1
        scales = groups * rows * 2 * count
        zeros = math.ceil(groups * rows * self.bits / 8) * count
        g_idx = cols * 4 * count if self.method == "gptq" else 0
        return values + scales + zeros + g_idx


def estimate_weights(config: ModelConfig) -> WeightsEstimate | None:
    """The checkpoint's bytes as served (see the module's notes), or None
    for a family or a file whose shapes this module cannot read."""
    try:
        found = tensors(config)
    except (KeyError, ValueError, TypeError):
        return None
    dense, dtype = _dtype_bytes(config)
    quant = config.root.get("quantization_config")
    if not isinstance(quant, Mapping):
        quant = _RELEASE_FORMATS.get(family_of(config) or "")
    fmt = _Format(quant, dense, dtype)
    parts: dict[str, int] = {}
    total = 0
    for tensor in found:
        size = fmt.size(tensor)
        parts[tensor.part] = parts.get(tensor.part, 0) + size
        total += size
    return WeightsEstimate(
        bytes=total,
        params=sum(t.numel for t in found),
        parts=parts,
        format=fmt.describe(),
    )


# -- the hub's own figure ------------------------------------------------------

#: safetensors dtypes whose values a float32 checkpoint serves in bfloat16.
_F32 = "F32"


def hub_checkpoint_bytes(
    repo_id: str,
    *,
    revision: str | None = None,
    served_float32_halved: bool = False,
    fetch: Any = None,
) -> int | None:
    """The bytes of a hub repository's safetensors weights, from the
    headers the hub serves (``huggingface_hub.get_safetensors_metadata``:
    every tensor's byte range, no weights downloaded), or None when the hub
    cannot say (offline, no network, no safetensors, gated; each request
    waits at most :data:`~kvcore.limits.HUB_CONNECT_TIMEOUT_S`, the whole
    call :data:`~kvcore.limits.HUB_FETCH_TIMEOUT_S`): the caller keeps its
    estimate.

    :param served_float32_halved: count float32 tensors at half their bytes
        (a float32 checkpoint is served in bfloat16).
    :param fetch: the metadata call (tests pass a fake); defaults to
        ``huggingface_hub.get_safetensors_metadata``.
    """
    if fetch is None:
        try:
            import huggingface_hub
            from huggingface_hub import constants
        except ImportError:
            return None
        if constants.HF_HUB_OFFLINE:
            return None
        fetch = huggingface_hub.get_safetensors_metadata
    found: list[Any] = []

    def run() -> None:
        try:
            found.append(
                fetch(repo_id, revision=revision, timeout=HUB_CONNECT_TIMEOUT_S)
            )
        except Exception:  # any failure of the hub: keep the estimate
            return

    worker = threading.Thread(target=run, name="kvcore-hub-weights", daemon=True)
    worker.start()
    worker.join(HUB_FETCH_TIMEOUT_S)
    if not found:
        return None
    try:
        meta = found[0]
        total = 0
        for file in meta.files_metadata.values():
            for info in file.tensors.values():
                begin, end = info.data_offsets
                size = int(end) - int(begin)
                if served_float32_halved and info.dtype == _F32:
                    size //= 2
                total += size
    except (AttributeError, TypeError, ValueError):  # an answer of another shape
        return None
    return total if total > 0 else None
