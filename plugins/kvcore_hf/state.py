"""What the recurrent-state mappers share: the state shapes and dtypes vLLM
allocates, for one unsharded model (tensor parallelism is applied later by
``MambaSpec.sharded``).

Shapes follow vLLM's ``MambaStateShapeCalculator``
(``vllm/model_executor/layers/mamba/mamba_utils.py``, commit 02d7108) at
tensor-parallel size 1 with no speculative tokens, conv states in the
default ``SD`` layout ``(kernel - 1, channels)``:

- Mamba-1: conv ``(d_conv - 1, d_inner)``, SSM ``(d_inner, d_state)``.
- Mamba-2: conv ``(d_conv - 1, d_inner + 2 * n_groups * d_state)``, SSM
  ``(n_heads, head_dim, d_state)``; the conv state's B/C groups are split
  with the heads, or a single group kept on every rank
  (``extra_groups_for_head_shards``), which ``conv_groups`` records.
- Gated DeltaNet: conv ``(kernel - 1, 2 * nk * dk + nv * dv)``, recurrent
  ``(nv, dv, dk)``.

Dtypes follow ``MambaStateDtypeCalculator`` with the engine defaults
(``--mamba-cache-dtype auto``: the conv state in the model dtype;
``--mamba-ssm-cache-dtype auto``: the SSM state like the conv state) unless
the model's own hook overrides them.
"""

from __future__ import annotations

import torch

from kvcore_hf.common import ATTENTION_BLOCK
from kvcore_hf.mapping import ModelConfig, ModelConfigError
from kvcore_mamba import MambaSpec

__all__ = ["conv_kernel", "gated_delta_net", "mamba1", "mamba2"]


def mamba1(
    config: ModelConfig, *, d_inner: int, d_state: int, d_conv: int
) -> MambaSpec:
    """A Mamba-1 mixer's state, both tensors in the model dtype; ``d_conv``
    comes from :func:`conv_kernel`."""
    dtype = config.model_dtype()
    return MambaSpec(
        block_size=ATTENTION_BLOCK,
        shapes=((d_conv - 1, d_inner), (d_inner, d_state)),
        dtypes=(dtype, dtype),
    )


def mamba2(
    config: ModelConfig,
    *,
    d_inner: int,
    n_groups: int,
    n_heads: int,
    head_dim: int,
    d_state: int,
    d_conv: int,
    ssm_dtype: torch.dtype | None = None,
) -> MambaSpec:
    """A Mamba-2 mixer's state: the conv state in the model dtype, the SSM
    state in ``ssm_dtype`` (default: the conv state's)."""
    conv_dtype = config.model_dtype()
    return MambaSpec(
        block_size=ATTENTION_BLOCK,
        shapes=(
            (d_conv - 1, d_inner + 2 * n_groups * d_state),
            (n_heads, head_dim, d_state),
        ),
        dtypes=(conv_dtype, ssm_dtype or conv_dtype),
        conv_groups=(n_groups, 2 * d_state),
    )


def gated_delta_net(
    config: ModelConfig,
    *,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    conv_kernel: int,
) -> MambaSpec:
    """A gated DeltaNet layer's conv and recurrent state, in the model dtype."""
    dtype = config.model_dtype()
    conv = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
    return MambaSpec(
        block_size=ATTENTION_BLOCK,
        shapes=(
            (conv_kernel - 1, conv),
            (num_v_heads, head_v_dim, head_k_dim),
        ),
        dtypes=(dtype, dtype),
    )


def conv_kernel(config: ModelConfig, name: str) -> int:
    """The conv kernel field ``name``: its state keeps ``kernel - 1`` rows
    (the current token is not kept), so a kernel under 2 is refused."""
    kernel = config.positive(name)
    if kernel < 2:
        msg = (
            f"{config.where}: field {config.prefix}{name} is {kernel}; a conv "
            "kernel under 2 keeps no state, which no Mamba mixer has"
        )
        raise ModelConfigError(msg)
    return kernel
