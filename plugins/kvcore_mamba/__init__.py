"""Mamba and linear-attention state: a fixed-size recurrent state per request.

A layer's state is one or more tensors (for example a convolution state and
an SSM state); a page holds all of them back to back.  With
``mamba_cache_mode="align"`` states are also cached at block boundaries so a
prefix hit can restore them.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any, ClassVar, Literal, Self

import attrs
import torch

from kvcore.checkpoints import (
    DEFAULT_CHECKPOINT_POLICY,
    checkpoint_policy,
)
from kvcore.coordinator.manager import SingleTypeManager
from kvcore.errors import InvalidSpecError, LayoutError
from kvcore.hookspecs import kinds_impl
from kvcore.kinds import CacheKind, LayerView, view_as_dtype
from kvcore.spec import (
    HitPolicy,
    KVCacheSpec,
    PackingRole,
    Sharded,
    cdiv,
    check_tp_size,
    dtype_size,
    is_bool,
    non_negative_int,
    optional_positive_int,
    replicate,
)
from kvcore_mamba.manager import MambaManager, MambaStateManager

__all__ = ["Mamba", "MambaManager", "MambaSpec", "MambaStateManager"]

_MODES = ("auto", "none", "align", "all")


def _shapes(value: Any) -> tuple[tuple[int, ...], ...]:
    ok = isinstance(value, list | tuple) and all(
        isinstance(shape, list | tuple) and all(type(d) is int for d in shape)
        for shape in value
    )
    if not ok:
        msg = (
            f"MambaSpec.shapes must be a sequence of int shapes such as ((3, 64), "
            f"(8, 16)), got {value!r}"
        )
        raise InvalidSpecError(msg)
    return tuple(tuple(shape) for shape in value)


def _dtypes(value: Any) -> tuple[torch.dtype, ...]:
    if not isinstance(value, list | tuple):
        msg = (
            f"MambaSpec.dtypes must be a sequence of torch dtypes, one per shape, "
            f"got {value!r}"
        )
        raise InvalidSpecError(msg)
    dtypes = tuple(value)
    for dtype in dtypes:
        if not isinstance(dtype, torch.dtype):
            msg = f"MambaSpec.dtypes must hold torch dtypes, got {dtype!r}"
            raise InvalidSpecError(msg)
    return dtypes


def _shard_dims(value: Any) -> tuple[int | None, ...] | None:
    if value is None:
        return None
    ok = isinstance(value, list | tuple) and all(
        d is None or type(d) is int for d in value
    )
    if not ok:
        msg = (
            "MambaSpec.shard_dims must be null or a sequence with one entry per "
            f"state shape (the dim the ranks split, or null), got {value!r}"
        )
        raise InvalidSpecError(msg)
    return tuple(value)


def _conv_groups(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    ok = (
        isinstance(value, list | tuple)
        and len(value) == 2
        and all(type(v) is int and v > 0 for v in value)
    )
    if not ok:
        msg = (
            "MambaSpec.conv_groups must be null or [n_groups, channels_per_group] "
            f"(two positive ints), got {value!r}"
        )
        raise InvalidSpecError(msg)
    return (value[0], value[1])


@attrs.frozen(kw_only=True)
class MambaSpec(KVCacheSpec):
    """A recurrent-state layer.

    :param shapes: the shape of each state tensor (per request, this rank).
    :param dtypes: the dtype of each state tensor, one per shape.
    :param tp_replicated: every tensor-parallel rank holds the whole state
        (it is not sharded); such a state never shares a group with sharded
        ones.
    :param mamba_cache_mode: ``auto`` (the default: ``align`` when the
        engine runs prefix caching, else ``none``; planning settles it),
        ``none`` (only the live state: no prefix hits for the model),
        ``align`` (states kept where ``checkpoint_policy`` says) or ``all``
        (a state every block, all kept).
    :param checkpoint_policy: which states ``align`` keeps for later
        requests, a name from ``kvcore.coordinator.CHECKPOINT_POLICIES``:
        ``turns`` (prompt ends, output ends, branch points), ``prompts``
        (no output ends) or ``steps`` (every step that ends on a hit
        boundary).
    :param num_speculative_blocks: extra state blocks for speculative decoding.
    :param page_size_padded: pad the page to this many bytes.
    :param shard_dims: per state shape, the dim tensor-parallel ranks split
        (``None``: every rank keeps that tensor whole); unset, the first of
        two or more shapes (the conv state, ``(kernel - 1, channels)``)
        splits its last dim and every other shape its dim 0 (heads or
        channels).
    :param conv_groups: ``(n_groups, channels_per_group)`` when the split
        dim of the first state shape (Mamba-2's conv state) ends with
        ``n_groups`` groups of ``channels_per_group`` channels (its B and C,
        ``2 * d_state`` a group).  Ranks split the groups evenly when they
        divide them; a single group is kept whole on every rank (engines
        pad the groups up to one a rank); any other count is refused, as
        the engines refuse it.
    """

    kind: ClassVar[str] = "mamba"
    packing_role: ClassVar[PackingRole] = PackingRole.STATE

    shapes: tuple[tuple[int, ...], ...] = attrs.field(converter=_shapes)
    dtypes: tuple[torch.dtype, ...] = attrs.field(converter=_dtypes)
    tp_replicated: bool = attrs.field(default=False, validator=is_bool)
    mamba_cache_mode: Literal["auto", "none", "align", "all"] = "auto"
    checkpoint_policy: str = DEFAULT_CHECKPOINT_POLICY
    num_speculative_blocks: int = attrs.field(default=0, validator=non_negative_int)
    page_size_padded: int | None = attrs.field(
        default=None, validator=optional_positive_int
    )
    shard_dims: tuple[int | None, ...] | None = attrs.field(
        default=None, converter=_shard_dims
    )
    conv_groups: tuple[int, int] | None = attrs.field(
        default=None, converter=_conv_groups
    )

    def __attrs_post_init__(self) -> None:
        name = type(self).__name__
        if self.shard_dims is not None:
            if len(self.shard_dims) != len(self.shapes):
                msg = (
                    f"{name}.shard_dims needs one entry per state shape, got "
                    f"{len(self.shard_dims)} for {len(self.shapes)} shapes"
                )
                raise InvalidSpecError(msg)
            for shape, dim in zip(self.shapes, self.shard_dims, strict=True):
                if dim is not None and not 0 <= dim < len(shape):
                    msg = (
                        f"{name}.shard_dims: dim {dim} is not a dim of state "
                        f"shape {shape}; use 0..{len(shape) - 1}, or null to "
                        "keep that tensor whole on every rank"
                    )
                    raise InvalidSpecError(msg)
        if not self.shapes or len(self.shapes) != len(self.dtypes):
            msg = (
                f"{name} needs one dtype per state shape, got {len(self.shapes)} "
                f"shapes and {len(self.dtypes)} dtypes"
            )
            raise InvalidSpecError(msg)
        for shape in self.shapes:
            if not shape or any(d <= 0 for d in shape):
                msg = f"{name}.shapes must hold non-empty positive shapes, got {shape}"
                raise InvalidSpecError(msg)
        if self.conv_groups is not None:
            groups, width = self.conv_groups
            dim = self.shard_dim(0)
            if dim is None or groups * width >= self.shapes[0][dim]:
                msg = (
                    f"{name}.conv_groups {groups} x {width} channels must lie "
                    f"inside the split dim of state shape 0 {self.shapes[0]}"
                    + (" (which shard_dims keeps whole)" if dim is None else "")
                )
                raise InvalidSpecError(msg)
        if self.mamba_cache_mode not in _MODES:
            msg = (
                f"{name}.mamba_cache_mode must be one of {', '.join(_MODES)}, got "
                f"{self.mamba_cache_mode!r}"
            )
            raise InvalidSpecError(msg)
        checkpoint_policy(self.checkpoint_policy, what=f"{name}.checkpoint_policy")
        offset = 0
        for i, (shape, dtype) in enumerate(zip(self.shapes, self.dtypes, strict=True)):
            if offset % dtype.itemsize:
                msg = (
                    f"{name}: state tensor {i} ({dtype}) would start at byte {offset} "
                    f"of the page, not a multiple of its {dtype.itemsize}-byte "
                    "elements, so no worker could bind it; order the state shapes "
                    "from the widest dtype down"
                )
                raise InvalidSpecError(msg)
            offset += math.prod(shape) * dtype.itemsize
        if (
            self.page_size_padded is not None
            and self.page_size_padded < self.state_bytes
        ):
            msg = (
                f"{name}: page_size_padded={self.page_size_padded} is smaller than "
                f"the state itself ({self.state_bytes} bytes)"
            )
            raise InvalidSpecError(msg)

    @property
    def state_bytes(self) -> int:
        """Bytes of all state tensors together."""
        return sum(
            math.prod(shape) * dtype_size(dtype)
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )

    @property
    def page_grid(self) -> tuple[int, int, int]:
        return (1, 1, self.state_bytes)

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded or self.state_bytes

    @property
    def tokens_per_state(self) -> int:
        return 1

    def resolve_defaults(
        self, *, prefix_caching: bool, state_cache_mode: str | None
    ) -> Self | None:
        """``auto`` becomes the engine's mode, else ``align`` with prefix
        caching on (checkpoints serve hits) and ``none`` without (one state
        block a request)."""
        if self.mamba_cache_mode != "auto":
            return None
        mode = state_cache_mode or ("align" if prefix_caching else "none")
        return attrs.evolve(self, mamba_cache_mode=mode)  # type: ignore[arg-type]

    def with_checkpoint_policy(self, name: str) -> Self | None:
        if name == self.checkpoint_policy:
            return self
        return attrs.evolve(self, checkpoint_policy=name)

    @property
    def checkpoint_policy_name(self) -> str | None:
        # Only align mode chooses which states to keep.
        return self.checkpoint_policy if self._checkpoints_on else None

    def with_state_dtype(self, dtype: torch.dtype) -> Self | None:
        """vLLM's ``--mamba-ssm-cache-dtype``: every state tensor after the
        first (the conv state, which keeps the model's dtype) becomes
        ``dtype``; a single-tensor state (a short convolution) has no SSM
        state and keeps its own."""
        if len(self.dtypes) < 2:
            return self
        dtypes = (self.dtypes[0], *([dtype] * (len(self.dtypes) - 1)))
        if dtypes == self.dtypes:
            return self
        return attrs.evolve(self, dtypes=dtypes)

    @property
    def state_cache_mode(self) -> str:
        return self.mamba_cache_mode

    def with_state_cache_mode(self, mode: str) -> Self | None:
        """The engine's Mamba cache mode applies to every Mamba layer."""
        if mode == self.mamba_cache_mode:
            return self
        return attrs.evolve(self, mamba_cache_mode=mode)  # type: ignore[arg-type]

    @property
    def hit_policy(self) -> HitPolicy:
        # Mode none keeps only the live state, so no prefix can be restored.
        if self.mamba_cache_mode == "none":
            return HitPolicy.BLOCKS_HITS
        return HitPolicy.CHECKPOINT

    @property
    def element_size(self) -> int:
        return max(dtype.itemsize for dtype in self.dtypes)

    @property
    def view_dtypes(self) -> tuple[torch.dtype, ...]:
        return self.dtypes

    def num_blocks_held(
        self, num_computed_tokens: int, num_tokens: int, block_size: int
    ) -> int:
        """``none``: one state (plus speculative ones).  ``all``: a state per
        block.  ``align``: the state the step reads and, when the step
        reaches a new block, the one it writes (checkpoints kept inside the
        step come on top: :attr:`checkpoint_blocks_per_step`)."""
        if self.mamba_cache_mode == "all":
            return cdiv(num_tokens, block_size)
        if self._checkpoints_on:
            reads = 1 if num_computed_tokens > 0 else 0
            writes = cdiv(num_tokens, block_size) > cdiv(
                num_computed_tokens, block_size
            )
            return max(reads + int(writes), 1)
        return 1 + self.num_speculative_blocks

    @property
    def _checkpoints_on(self) -> bool:
        """Whether the states are kept by a checkpoint policy (align mode,
        and auto, which planning resolves)."""
        return self.mamba_cache_mode in ("align", "auto")

    @property
    def checkpoint_blocks_per_step(self) -> int:
        """Checkpoints the policy may keep inside one step (prompt ends, a
        branch point, interval states), and the states a running request
        keeps holding (its hit's and its branch point)."""
        if self._checkpoints_on:
            return checkpoint_policy(self.checkpoint_policy).blocks_beyond_live
        return 0

    @property
    def allows_sub_block_hashing(self) -> bool:
        return self._checkpoints_on

    @property
    def caches_partial_block_hits(self) -> bool:
        return self._checkpoints_on

    def max_num_blocks_per_request(self, max_model_len: int) -> int:
        if self.mamba_cache_mode == "all":
            return cdiv(max_model_len, self.block_size) + self.num_speculative_blocks
        if self._checkpoints_on:
            # The state read, the one written and the checkpoints inside
            # one step.
            return 2 + self.checkpoint_blocks_per_step + self.num_speculative_blocks
        return 1 + self.num_speculative_blocks

    def shard_dim(self, index: int) -> int | None:
        """The dim ranks split of state shape ``index`` (``None``: kept whole)."""
        if self.shard_dims is not None:
            return self.shard_dims[index]
        if index == 0 and len(self.shapes) > 1:
            return len(self.shapes[0]) - 1
        return 0

    def sharded(self, tp_size: int) -> Sharded:
        """Each state tensor split along its :meth:`shard_dim`, as engines
        shard the channels and heads of a recurrent mixer; a
        ``tp_replicated`` state is kept whole on every rank.

        The shapes are whole-model shapes, so this holds where the engine
        divides each state dim evenly.  Mamba-2's conv state, whose single
        B/C group every rank keeps, says so through ``conv_groups``; where an
        engine replicates other parts before dividing, give per-rank shapes
        at size 1 instead.
        """
        tp = check_tp_size(tp_size)
        if self.tp_replicated:
            return replicate(self, tp, "recurrent state (tp_replicated)")
        if tp == 1:
            return Sharded(spec=self)
        shapes: list[tuple[int, ...]] = []
        for index, shape in enumerate(self.shapes):
            dim = self.shard_dim(index)
            if dim is None:
                shapes.append(shape)
                continue
            if index == 0 and self.conv_groups is not None:
                size = _conv_channels(shape[dim], tp, *self.conv_groups)
                shapes.append((*shape[:dim], size, *shape[dim + 1 :]))
                continue
            if shape[dim] % tp:
                msg = (
                    f"state shape {index} {shape} splits dim {dim} "
                    f"({shape[dim]}) across {tp} tensor-parallel ranks, which "
                    f"does not divide it; use a tensor-parallel size that "
                    f"divides {shape[dim]}, or set shard_dims (or tp_replicated)"
                    " in the model file if the engine splits another dim"
                )
                raise InvalidSpecError(msg)
            shapes.append((*shape[:dim], shape[dim] // tp, *shape[dim + 1 :]))
        if self.page_size_padded is not None:
            msg = (
                f"{type(self).__name__}: page_size_padded={self.page_size_padded} "
                f"was sized for the whole state, but {tp} ranks split it; give "
                "the per-rank padded size, or drop the padding"
            )
            raise InvalidSpecError(msg)
        groups = self.conv_groups
        if groups is not None:  # one rank's groups: its share, or the one
            groups = (max(groups[0] // tp, 1), groups[1])
        return Sharded(
            spec=attrs.evolve(self, shapes=tuple(shapes), conv_groups=groups)
        )

    def group_key(self) -> Hashable:
        return (
            self.kind,
            self.block_size,
            self.page_size_bytes,
            self.tp_replicated,
            self.num_speculative_blocks,
            self.mamba_cache_mode,
            # A group's manager keeps one policy.
            self.checkpoint_policy,
        )


def _conv_channels(channels: int, tp: int, groups: int, width: int) -> int:
    """One rank's conv channels: the heads' channels divided, the groups
    divided too, or a single group whole on every rank (vLLM's
    ``extra_groups_for_head_shards`` pads one group up to ``tp``)."""
    rest = channels - groups * width
    if groups % tp and groups != 1:
        msg = (
            f"the conv state's {groups} B/C groups cannot follow {tp} "
            f"tensor-parallel ranks: engines split the groups evenly or "
            f"keep a single group on every rank; use a tensor-parallel size "
            f"that divides {groups}"
        )
        raise InvalidSpecError(msg)
    if rest % tp:
        msg = (
            f"the conv state's {rest} head channels do not divide across "
            f"{tp} tensor-parallel ranks"
        )
        raise InvalidSpecError(msg)
    if groups % tp == 0:
        return channels // tp
    return rest // tp + width


class Mamba(CacheKind):
    """Binds each layer to a tuple of typed state tensors ``[num_blocks,
    *shape]``, one per state shape, back to back inside the page."""

    spec_type = MambaSpec
    manager_type = MambaManager

    def make_manager(
        self, spec: MambaSpec, block_pool: Any, **kwargs: Any
    ) -> SingleTypeManager:
        # One state block per request without caching modes; a subclass's
        # manager_type takes the checkpointing modes.
        if spec.mamba_cache_mode == "none":
            return MambaStateManager(spec, block_pool, **kwargs)
        return super().make_manager(spec, block_pool, **kwargs)

    def bind_view(self, spec: MambaSpec, raw: torch.Tensor) -> LayerView:
        flat = raw[:, 0, 0, :]
        views: list[torch.Tensor] = []
        offset = 0
        for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
            nbytes = math.prod(shape) * dtype_size(dtype)
            if offset % dtype_size(dtype):
                msg = (
                    f"mamba state tensor {len(views)} ({dtype}) starts at byte "
                    f"{offset} of its page, not a multiple of its element size; "
                    "order the state shapes from the widest dtype down"
                )
                raise LayoutError(msg)
            part = view_as_dtype(
                flat[:, offset : offset + nbytes], dtype, what="mamba state"
            )
            views.append(part.view(part.shape[0], *shape))
            offset += nbytes
        return tuple(views)


kvcore_register_kinds = kinds_impl(Mamba())
