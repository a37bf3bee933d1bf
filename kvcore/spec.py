"""Cache specs: what one layer's cache page looks like.

A spec is pure data: a frozen, keyword-only attrs class with a ``kind``
class variable naming the cache kind that owns it.  Everything a spec can
derive from its own fields lives here too (page size, merge rule, grouping
key, hashing behaviour), so the packer can plan from specs alone.  Kinds add
what needs context or torch (view binding, the block manager); see
:mod:`kvcore.kinds`.

The page model shared by every spec: one block of ``block_size`` tokens is a
byte array ``[H, N, C]`` of heads (or head slots), stored states and content
bytes per state.  ``page_size_bytes`` is ``H * N * C`` unless the spec pads it.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar, Self

import attrs
import torch

from kvcore.errors import InvalidSpecError, MergeError

__all__ = [
    "AttentionSpec",
    "HitPolicy",
    "KVCacheSpec",
    "PackingRole",
    "Sharded",
    "UniformTypeKVCacheSpecs",
    "CACHE_ELEMENT_DTYPES",
    "cdiv",
    "check_tp_size",
    "dtype_size",
    "iter_layer_specs",
    "positive_int",
    "is_bool",
    "one_latent",
    "optional_positive_int",
    "replicate",
    "round_up",
]


class HitPolicy(enum.Enum):
    """How a kind's blocks take part in prefix caching: the one declaration
    the coordinator reads to decide what is hashed, what serves a hit and
    what stops every hit (see the table in ``docs/plugins.md``)."""

    #: Never hashed, never hit; other groups' hits stand and the kind
    #: recomputes ``prefix_replay_tokens`` before a hit (bounded-replay
    #: windows, compressor rings, hot pages, chunked-local attention).
    NOT_HASHED = "not_hashed"
    #: Every block of the prefix is cached and read (full attention, MLA).
    PREFIX = "prefix"
    #: Only the window the next token reads must be cached (sliding window).
    WINDOW = "window"
    #: A saved state at the hit's end restores the whole prefix (Mamba and
    #: linear attention states kept at block boundaries).
    CHECKPOINT = "checkpoint"
    #: The kind needs the whole prefix but keeps nothing to restore it from:
    #: no request of the model gets a hit (a state never checkpointed).
    BLOCKS_HITS = "blocks_hits"

    @property
    def prefix_cacheable(self) -> bool:
        """Whether the kind's state depends on a prefix it can take part in
        (everything but :attr:`NOT_HASHED`)."""
        return self is not HitPolicy.NOT_HASHED

    @property
    def hashes_blocks(self) -> bool:
        """Whether groups of this policy hash their blocks."""
        return self in _HASHING_POLICIES


_HASHING_POLICIES = frozenset(
    {HitPolicy.PREFIX, HitPolicy.WINDOW, HitPolicy.CHECKPOINT}
)


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b``."""
    return -(-a // b)


def round_up(value: int, multiple: int) -> int:
    """Round ``value`` up to a multiple of ``multiple``."""
    return cdiv(value, multiple) * multiple


def dtype_size(dtype: torch.dtype) -> int:
    """Bytes per element of a torch dtype."""
    return dtype.itemsize


def positive_int(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """attrs validator: an ``int`` (not a ``bool``) greater than zero."""
    if isinstance(value, bool) or not isinstance(value, int):
        msg = (
            f"{type(instance).__name__}.{attribute.name} must be an int, "
            f"got {value!r} ({type(value).__name__})"
        )
        raise InvalidSpecError(msg)
    if value <= 0:
        msg = (
            f"{type(instance).__name__}.{attribute.name} must be positive, got {value}"
        )
        raise InvalidSpecError(msg)


def one_latent(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """attrs validator: exactly 1, the one latent an MLA layer stores per
    state (all its query heads read it, on every rank)."""
    positive_int(instance, attribute, value)
    if value != 1:
        msg = (
            f"{type(instance).__name__}.{attribute.name} must be 1, got {value}: "
            "an MLA layer stores one latent vector per state, read by all its "
            "query heads, so a page holds one head of head_size elements "
            "(head_size is the latent width, e.g. kv_lora_rank + "
            "qk_rope_head_dim = 576 for DeepSeek-V3); a layer with per-head "
            "keys and values is full_attention"
        )
        raise InvalidSpecError(msg)


def optional_positive_int(
    instance: object, attribute: attrs.Attribute[Any], value: Any
) -> None:
    """attrs validator: ``None`` or a positive ``int``."""
    if value is not None:
        positive_int(instance, attribute, value)


def non_negative_int(
    instance: object, attribute: attrs.Attribute[Any], value: Any
) -> None:
    """attrs validator: an ``int`` that is zero or more."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        msg = (
            f"{type(instance).__name__}.{attribute.name} must be a "
            f"non-negative int, got {value!r}"
        )
        raise InvalidSpecError(msg)


def is_bool(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """attrs validator: a real ``bool`` (a string such as ``"false"`` is not)."""
    if type(value) is not bool:
        msg = (
            f"{type(instance).__name__}.{attribute.name} must be True or False, "
            f"got {value!r} ({type(value).__name__})"
        )
        raise InvalidSpecError(msg)


#: Every torch dtype a cache element may have, by torch name, with torch's
#: own aliases (``half``, ``float``, ...).  A fixed table, so a name from a
#: file is never looked up as an attribute of the torch module.  Bool and
#: complex dtypes are not cache element types.
CACHE_ELEMENT_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {
        "float64": torch.float64,
        "double": torch.float64,
        "float32": torch.float32,
        "float": torch.float32,
        "float16": torch.float16,
        "half": torch.float16,
        "bfloat16": torch.bfloat16,
        "float8_e4m3fn": torch.float8_e4m3fn,
        "float8_e4m3fnuz": torch.float8_e4m3fnuz,
        "float8_e5m2": torch.float8_e5m2,
        "float8_e5m2fnuz": torch.float8_e5m2fnuz,
        "int64": torch.int64,
        "long": torch.int64,
        "int32": torch.int32,
        "int": torch.int32,
        "int16": torch.int16,
        "short": torch.int16,
        "int8": torch.int8,
        "uint64": torch.uint64,
        "uint32": torch.uint32,
        "uint16": torch.uint16,
        "uint8": torch.uint8,
    }
)


def is_dtype(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    """attrs validator: a ``torch.dtype`` a cache can hold (not bool or
    complex: no kernel stores its cache as those)."""
    if not isinstance(value, torch.dtype):
        msg = (
            f"{type(instance).__name__}.{attribute.name} must be a torch.dtype "
            f"(e.g. torch.bfloat16), got {value!r}"
        )
        raise InvalidSpecError(msg)
    if value == torch.bool or value.is_complex:
        msg = (
            f"{type(instance).__name__}.{attribute.name} is {value}, which is not a "
            "cache element type (bool and complex dtypes are refused); use a "
            "float or integer dtype such as torch.bfloat16 or torch.uint8"
        )
        raise InvalidSpecError(msg)


def check_tp_size(tp_size: object) -> int:
    """``tp_size`` if it is a positive int, else an :class:`InvalidSpecError`."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size <= 0:
        msg = f"a tensor-parallel size must be a positive int, got {tp_size!r}"
        raise InvalidSpecError(msg)
    return tp_size


@attrs.frozen(kw_only=True)
class Sharded:
    """What one tensor-parallel rank keeps of a layer's cache.

    :param spec: the layer's spec on one rank.
    :param replicas: ranks holding each copy of that per-rank cache: 1 when
        the ranks split the layer, the tensor-parallel size when every rank
        keeps all of it.
    :param note: for a replicated layer, what is replicated and how, worded
        so that equal layers give equal notes (the served notes group them).
    """

    spec: KVCacheSpec
    replicas: int = attrs.field(default=1, validator=positive_int)
    note: str = ""

    @property
    def replicated(self) -> bool:
        """Whether more than one rank holds the same cache."""
        return self.replicas > 1


def replicate(spec: KVCacheSpec, tp_size: int, what: str) -> Sharded:
    """``spec`` kept whole on each of ``tp_size`` ranks; ``what`` names the
    cache in the note (``"MLA latent"``)."""
    tp = check_tp_size(tp_size)
    return Sharded(spec=spec, replicas=tp, note=f"{what} replicated on all {tp} ranks")


class HitPolicyDerived:
    """What a layer spec (or a group's) derives from its :attr:`hit_policy`."""

    __slots__ = ()

    @property
    def hit_policy(self) -> HitPolicy:
        raise NotImplementedError

    @property
    def prefix_cacheable(self) -> bool:
        """Whether the state depends on the prefix and is shared through
        prefix caching."""
        return self.hit_policy.prefix_cacheable

    @property
    def hashes_blocks(self) -> bool:
        """Whether the kind's manager hashes the blocks when prefix caching
        is on, so its block must be a multiple of the hash block."""
        return self.hit_policy.hashes_blocks


class PackingRole(enum.Enum):
    """How the packer may split a bucket of equal-keyed layers into groups.

    ``PAGED`` layers hold tokens in pages and split by the model's repeat
    pattern.  ``STATE`` layers hold a fixed per-request state; their bucket is
    split only as far as the block the other buckets already force.
    ``WINDOW`` layers are paged, but act as ``STATE`` when the model has no
    balanced multi-page repeat pattern to split them by.
    """

    PAGED = "paged"
    STATE = "state"
    WINDOW = "window"


@attrs.frozen(kw_only=True)
class KVCacheSpec(HitPolicyDerived):
    """Base of every layer spec.

    :param block_size: tokens per block (for a ring, its capacity).
    :param block_stride_alignment: required byte alignment of the distance
        between consecutive blocks; the packer rounds the block up to it.
    """

    #: Registry name of the kind that owns this spec; subclasses set it.
    kind: ClassVar[str] = ""
    #: How the packer may split a bucket of these layers.
    packing_role: ClassVar[PackingRole] = PackingRole.PAGED
    #: Whether the block size is multiplied by decode context parallelism.
    scales_with_context_parallel: ClassVar[bool] = False
    #: Whether the layout must keep the block dimension outermost.
    requires_block_outer_layout: ClassVar[bool] = False
    #: The largest factor :meth:`grown` may multiply the block size by.
    max_block_growth: ClassVar[int] = 1

    block_size: int = attrs.field(validator=positive_int)
    block_stride_alignment: int | None = attrs.field(
        default=None, validator=optional_positive_int
    )

    # -- page model -----------------------------------------------------
    @property
    def page_grid(self) -> tuple[int, int, int]:
        """``(H, N, C)``: heads, states per block and content bytes per state."""
        raise NotImplementedError

    @property
    def real_page_size_bytes(self) -> int:
        """Bytes of one page before any padding."""
        h, n, c = self.page_grid
        return h * n * c

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one page of this layer, padding included."""
        return self.real_page_size_bytes

    def stride_alignment(self) -> int:
        """The byte alignment this layer imposes on the shared block stride."""
        return self.block_stride_alignment or 1

    @property
    def element_size(self) -> int:
        """Bytes per element of the typed view; the page and every stride are
        multiples of it (see docs/plugins.md)."""
        return 1

    @property
    def view_dtypes(self) -> tuple[torch.dtype, ...] | None:
        """The dtype of each tensor the binder returns (one entry stands for
        all), checked by the pool; ``None``: none checked (docs/plugins.md)."""
        return None

    # -- planning ---------------------------------------------------------
    def grown(self, factor: int) -> Self | None:
        """This spec with ``factor`` times the block size, or ``None`` if its
        block may not grow by ``factor``; see :attr:`max_block_growth` and
        "Planning declarations" in docs/plugins.md."""
        return self if factor == 1 else None

    # -- serving choices ------------------------------------------------
    def with_cache_dtype(self, dtype: torch.dtype) -> Self | None:
        """This spec stored as ``dtype`` (the engine's ``--kv-cache-dtype``), or
        ``None`` if the kind keeps its own dtype (the default)."""
        return None

    def with_state_dtype(self, dtype: torch.dtype) -> Self | None:
        """This spec with its recurrent (SSM) state stored as ``dtype`` (an
        engine's ``--mamba-ssm-cache-dtype``), or ``None`` if the kind keeps
        no such state.  Default ``None``."""
        return None

    def with_block_size(self, block_size: int) -> Self | None:
        """This spec with ``block_size`` tokens per block (the engine's
        ``--block-size``), or ``None`` if the kind keeps its own block (the
        default); :class:`InvalidSpecError` if it pages tokens but cannot."""
        return None

    def resolve_defaults(
        self, *, prefix_caching: bool, state_cache_mode: str | None
    ) -> Self | None:
        """This spec as an engine with these settings runs it, or ``None``
        when they change nothing (the default).

        Planning applies it to every layer before anything else, so a
        kind's default that follows the engine (a state kind whose ``auto``
        caching mode keeps checkpoints only with prefix caching on) is
        settled once and every later stage sees one concrete spec.
        """
        return None

    def with_checkpoint_policy(self, name: str) -> Self | None:
        """This spec keeping the states the named checkpoint policy says
        (see :mod:`kvcore.checkpoints`), or ``None`` if the kind keeps no
        recurrent state.  Default ``None``."""
        return None

    @property
    def checkpoint_policy_name(self) -> str | None:
        """The named checkpoint policy the states are kept under, or ``None``."""
        return None

    def with_state_cache_mode(self, mode: str) -> Self | None:
        """This spec under the engine's recurrent-state caching ``mode``
        (``none``, ``align`` or ``all``), or ``None`` if the kind keeps no
        recurrent state.  Default ``None``."""
        return None

    @property
    def state_cache_mode(self) -> str | None:
        """The recurrent-state caching mode (``none``, ``align`` or ``all``)
        once defaults are resolved, or ``None`` for a kind with no such state;
        planning checks it against ``CacheConfig.mamba_cache_mode``."""
        return None

    def sharded(self, tp_size: int) -> Sharded:
        """What one of ``tp_size`` tensor-parallel ranks keeps of this layer.
        Default: the spec itself at size 1; :class:`InvalidSpecError` at any
        other, since only the kind knows what its ranks split."""
        if check_tp_size(tp_size) == 1:
            return Sharded(spec=self)
        msg = (
            f"kind {self.kind!r} ({type(self).__name__}) does not say how its "
            f"cache splits across {tp_size} tensor-parallel ranks; its spec "
            "class must override KVCacheSpec.sharded (see docs/plugins.md)"
        )
        raise InvalidSpecError(msg)

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens a request with ``num_computed_tokens`` computed
        tokens never reads again (their blocks go back to the pool)."""
        return 0

    def num_blocks_held(
        self, num_computed_tokens: int, num_tokens: int, block_size: int
    ) -> int:
        """Blocks a request holds while it covers ``num_tokens`` tokens, the
        first ``num_computed_tokens`` computed, at ``block_size`` tokens per
        block; the manager must hold exactly this many (docs/plugins.md)."""
        return cdiv(num_tokens, block_size) - (
            self.skipped_tokens(num_computed_tokens) // block_size
        )

    # -- hashing behaviour ------------------------------------------------
    @property
    def hit_policy(self) -> HitPolicy:
        """How this layer takes part in prefix caching; kinds override this
        one declaration (:attr:`prefix_cacheable` and :attr:`hashes_blocks`
        derive from it)."""
        return HitPolicy.PREFIX

    @property
    def prefix_replay_tokens(self) -> int:
        """Tokens the scheduler must recompute after a prefix hit."""
        return 0

    @property
    def event_window(self) -> int | None:
        """The window in tokens this layer's KV-cache events tell a router
        (:attr:`BlockStored.sliding_window
        <kvcore.coordinator.BlockStored.sliding_window>`); ``None`` (the
        default): a hit counts over the whole prefix."""
        return None

    @property
    def tokens_per_state(self) -> int:
        """Tokens compressed into one stored state; hits must align to it."""
        return 1

    @property
    def allows_sub_block_hashing(self) -> bool:
        """Whether hashes may be finer than this layer's block."""
        return True

    @property
    def caches_partial_block_hits(self) -> bool:
        """Whether this layer's own hit search serves a hit that ends inside
        its block, at a hash boundary (an align-mode recurrent state keyed at
        every hash chunk); hits then align to the hash block."""
        return False

    @property
    def copies_partial_block_hits(self) -> bool:
        """Whether a hit may end inside this layer's block by copy-on-write
        (:class:`kvcore.coordinator.BlockCopy`): only for append-only,
        position-indexed caches (docs/plugins.md).  Default False."""
        return False

    @property
    def checkpoint_blocks_per_step(self) -> int:
        """Blocks a request may hold on top of :meth:`num_blocks_held` for the
        states its kind keeps (see :mod:`kvcore.checkpoints`).  Default 0."""
        return 0

    def max_num_blocks_per_request(self, max_model_len: int) -> int:
        """Blocks one request may hold at most."""
        return cdiv(max_model_len, self.block_size)

    # -- grouping ---------------------------------------------------------
    def group_key(self) -> Hashable:
        """Layers whose keys are equal may share a cache group."""
        return (self.kind, self.block_size)

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec]) -> Self:
        """Merge the specs of layers that share one group into one spec: of
        this class and the members' block size, with a page at least every
        member's (the group's layers are placed at it; the planner checks).

        The default rule: every spec is of this exact type and equal to the
        first.  Raises :class:`~kvcore.errors.MergeError` naming the first
        field that differs.
        """
        if not specs:
            msg = f"{cls.__name__}.merge() needs at least one spec"
            raise MergeError(msg)
        first = specs[0]
        for spec in specs:
            if type(spec) is not cls:
                msg = (
                    f"{cls.__name__}.merge() got a {type(spec).__name__}; layers "
                    f"of one cache group must all be {cls.__name__}"
                )
                raise MergeError(msg)
            if spec != first:
                diff = _first_difference(first, spec)
                msg = (
                    f"all layers in one {cls.__name__} cache group must be the "
                    f"same, but {diff}; give them equal specs or let them land "
                    "in separate groups"
                )
                raise MergeError(msg)
        return first  # type: ignore[return-value]

    @classmethod
    def merge_group(cls, specs: Sequence[KVCacheSpec]) -> KVCacheSpec:
        """The spec a group's manager runs on, from the group's members:
        their :meth:`merge` when they merge, else the first member's spec once
        every member is checked to share its grouping key.  A kind whose
        manager reads more (a flag to OR, sizes to combine) overrides this."""
        try:
            return cls.merge(specs)
        except MergeError:
            pass
        key = specs[0].group_key()
        for spec in specs:
            if spec.group_key() != key:
                msg = (
                    f"layers of one cache group have grouping keys {key!r} and "
                    f"{spec.group_key()!r}; a group's layers must share one key"
                )
                raise MergeError(msg)
        return specs[0]


def _first_difference(a: KVCacheSpec, b: KVCacheSpec) -> str:
    for field in attrs.fields(type(a)):
        va, vb = getattr(a, field.name), getattr(b, field.name)
        if va != vb:
            return f"{field.name} differs ({va!r} vs {vb!r})"
    return "they differ"


@attrs.frozen(kw_only=True)
class AttentionSpec(KVCacheSpec):
    """The attention page model: ``[num_kv_heads, block_size / tokens_per_state,
    (head_size + head_size_v) * dtype size]``.

    :param num_kv_heads: KV heads stored per layer (on this rank).
    :param head_size: key (or latent) elements per state.
    :param dtype: element type of the cache.
    :param head_size_v: value elements per state; defaults to ``head_size``.
    :param tokens_per_state: tokens compressed into one stored state.
    :param alignment: pad the page up to a multiple of this many bytes.
    :param page_size_padded: an explicit padded page size in bytes.
    """

    scales_with_context_parallel: ClassVar[bool] = True
    max_block_growth: ClassVar[int] = 64

    num_kv_heads: int = attrs.field(validator=positive_int)
    head_size: int = attrs.field(validator=positive_int)
    dtype: torch.dtype = attrs.field(validator=is_dtype)
    head_size_v: int = attrs.field(
        default=attrs.Factory(lambda self: self.head_size, takes_self=True),
        validator=non_negative_int,
    )
    tokens_per_state: int = attrs.field(default=1, validator=positive_int)
    alignment: int | None = attrs.field(default=None, validator=optional_positive_int)
    page_size_padded: int | None = attrs.field(
        default=None, validator=optional_positive_int
    )

    def __attrs_post_init__(self) -> None:
        if self.block_size % self.tokens_per_state:
            msg = (
                f"{type(self).__name__}: block_size={self.block_size} must be a "
                f"multiple of tokens_per_state={self.tokens_per_state}, so each "
                "block holds whole compressed states"
            )
            raise InvalidSpecError(msg)
        if (
            self.page_size_padded is not None
            and self.page_size_padded < self.real_page_size_bytes
        ):
            msg = (
                f"{type(self).__name__}: page_size_padded={self.page_size_padded} "
                f"is smaller than the page itself ({self.real_page_size_bytes} "
                "bytes); pad up, never down"
            )
            raise InvalidSpecError(msg)

    @property
    def page_grid(self) -> tuple[int, int, int]:
        content = (self.head_size + self.head_size_v) * dtype_size(self.dtype)
        return (self.num_kv_heads, self.block_size // self.tokens_per_state, content)

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        page = self.real_page_size_bytes
        if self.alignment is not None:
            return round_up(page, self.alignment)
        return page

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def view_dtypes(self) -> tuple[torch.dtype, ...]:
        return (self.dtype,)

    def grown(self, factor: int) -> Self | None:
        """A paged attention block grows by any factor up to
        :attr:`max_block_growth`, unless its page is explicitly padded (the
        padding was sized for the file's block)."""
        if (
            type(factor) is not int
            or not 1 <= factor <= self.max_block_growth
            or self.page_size_padded is not None
        ):
            return None
        if factor == 1:
            return self
        return attrs.evolve(self, block_size=self.block_size * factor)

    def with_cache_dtype(self, dtype: torch.dtype) -> Self | None:
        """A floating-point cache takes ``dtype``.  A packed byte format (a
        non-float dtype, such as DeepSeek's uint8 fp8 records with their
        scales inline) or a page padded to an explicit size keeps its own:
        the kernel defines that format, not the engine's cache dtype."""
        if not self.dtype.is_floating_point or self.page_size_padded is not None:
            return None
        if dtype == self.dtype:
            return self
        return attrs.evolve(self, dtype=dtype)

    def with_block_size(self, block_size: int) -> Self | None:
        """A paged cache takes the block size.  Two keep their own block: a
        page padded to an explicit size (the padding was sized for the
        block), and a compressed cache (``tokens_per_state > 1``), whose block
        the model's compression ratio and kernel fix rather than the
        engine's block size."""
        if self.page_size_padded is not None or self.tokens_per_state > 1:
            return None
        if block_size == self.block_size:
            return self
        return attrs.evolve(self, block_size=block_size)

    def sharded(self, tp_size: int) -> Sharded:
        """KV heads split across ranks as engines split the K/V projections:
        ``num_kv_heads // tp`` heads a rank when ``tp`` divides the heads;
        with fewer heads than ranks and ``tp`` a multiple of them, each rank
        keeps one head and ``tp // num_kv_heads`` ranks hold each.  Any other
        pair cannot be served."""
        tp = check_tp_size(tp_size)
        heads = self.num_kv_heads
        if heads % tp == 0:
            per_rank, replicas = heads // tp, 1
        elif tp % heads == 0:
            per_rank, replicas = 1, tp // heads
        else:
            divisors = [d for d in range(1, heads + 1) if heads % d == 0]
            msg = (
                f"{heads} KV heads do not divide across {tp} tensor-parallel "
                f"ranks; engines need heads % tp == 0 (each rank keeps heads / "
                f"tp) or tp % heads == 0 (heads replicated); use a "
                f"tensor-parallel size in {divisors} or a multiple of {heads}"
            )
            raise InvalidSpecError(msg)
        if per_rank == heads:
            spec = self
        elif self.page_size_padded is not None:
            msg = (
                f"{type(self).__name__}: page_size_padded={self.page_size_padded} "
                f"was sized for {heads} KV heads, but each of {tp} ranks keeps "
                f"{per_rank}; give the per-rank padded size, or drop the padding"
            )
            raise InvalidSpecError(msg)
        else:
            spec = attrs.evolve(self, num_kv_heads=per_rank)
        if replicas == 1:
            return Sharded(spec=spec)
        if heads == 1:
            note = f"single KV head replicated on all {tp} ranks"
        else:
            note = (
                f"KV heads replicated across {tp} ranks: {heads} heads, "
                "each rank keeps 1"
            )
        return Sharded(spec=spec, replicas=replicas, note=note)


@attrs.frozen(kw_only=True, eq=True, hash=False)
class UniformTypeKVCacheSpecs(HitPolicyDerived):
    """The spec of one cache group whose layers share a grouping key (and so
    the same block size and token-slot needs) but may differ in page size.

    :param block_size: the members' common block size.
    :param kv_cache_specs: layer name to that layer's spec, in packing order.
    """

    block_size: int = attrs.field(validator=positive_int)
    kv_cache_specs: dict[str, KVCacheSpec]

    def __attrs_post_init__(self) -> None:
        members: object = self.kv_cache_specs  # checked: callers pass anything
        if not isinstance(members, dict) or not members:
            msg = (
                "UniformTypeKVCacheSpecs.kv_cache_specs must be a non-empty dict of "
                f"layer name to spec, got {self.kv_cache_specs!r}"
            )
            raise InvalidSpecError(msg)
        for name, member in members.items():
            if not isinstance(member, KVCacheSpec):
                msg = f"layer {name!r} has member spec {member!r}, not a KVCacheSpec"
                raise InvalidSpecError(msg)
        for name, spec in self.kv_cache_specs.items():
            if spec.block_size != self.block_size:
                msg = (
                    f"layer {name!r} has block_size={spec.block_size} but its "
                    f"group's block_size is {self.block_size}; members of one "
                    "group share one block size"
                )
                raise InvalidSpecError(msg)

    @property
    def page_size_bytes(self) -> int:
        """Packed bytes of one block of this group: the sum of member pages."""
        return sum(s.page_size_bytes for s in self.kv_cache_specs.values())

    @property
    def hit_policy(self) -> HitPolicy:
        """The members' policy (they share a grouping key, so normally one);
        a mix is as strict as its most restrictive member."""
        policies = {s.hit_policy for s in self.kv_cache_specs.values()}
        if len(policies) == 1:
            return policies.pop()
        if HitPolicy.NOT_HASHED in policies:
            return HitPolicy.NOT_HASHED
        if HitPolicy.BLOCKS_HITS in policies:
            return HitPolicy.BLOCKS_HITS
        return HitPolicy.PREFIX

    @property
    def prefix_replay_tokens(self) -> int:
        return max(s.prefix_replay_tokens for s in self.kv_cache_specs.values())

    @classmethod
    def from_specs(
        cls, specs: dict[str, KVCacheSpec]
    ) -> UniformTypeKVCacheSpecs | None:
        """Wrap ``specs`` if they share one grouping key, else return None."""
        keys = {s.group_key() for s in specs.values()}
        keys_with_role = {
            (s.prefix_cacheable, s.prefix_replay_tokens) for s in specs.values()
        }
        if not specs or len(keys) != 1 or len(keys_with_role) != 1:
            return None
        return cls(
            block_size=next(iter(specs.values())).block_size, kv_cache_specs=dict(specs)
        )


GroupSpec = KVCacheSpec | UniformTypeKVCacheSpecs


def iter_layer_specs(spec: GroupSpec) -> Iterator[KVCacheSpec]:
    """The per-layer specs behind a group spec (the spec itself if plain)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        yield from spec.kv_cache_specs.values()
    else:
        yield spec
