"""The plan: cache groups, tensors and the whole KV-cache config."""

from __future__ import annotations

import attrs

from kvcore.errors import (
    KvcoreError,
    KvcoreTypeError,
    PlanError,
    PluginError,
    PluginResultError,
)
from kvcore.layout import KVCacheLayout
from kvcore.spec import GroupSpec, KVCacheSpec, UniformTypeKVCacheSpecs

__all__ = ["KVCacheConfig", "KVCacheGroupSpec", "KVCacheTensor", "ModelFile"]


@attrs.define(kw_only=False)
class KVCacheGroupSpec:
    """Layers that share one block table (one manager in the coordinator).

    :param layer_names: the group's layers, in packing order.
    :param kv_cache_spec: a merged spec, or a :class:`UniformTypeKVCacheSpecs`.
    """

    layer_names: list[str]
    kv_cache_spec: GroupSpec

    def __attrs_post_init__(self) -> None:
        names: list[str] = self.layer_names
        raw: object = names  # checked: callers pass anything
        if (
            not isinstance(raw, list)
            or not raw
            or not all(isinstance(n, str) for n in raw)
        ):
            msg = (
                f"KVCacheGroupSpec.layer_names must be a non-empty list of layer "
                f"names, got {names!r}"
            )
            raise PlanError(msg)
        if len(set(names)) != len(names):
            dupes = sorted({n for n in names if names.count(n) > 1})
            msg = f"KVCacheGroupSpec lists layers {dupes} more than once"
            raise PlanError(msg)
        spec: object = self.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            if set(spec.kv_cache_specs) != set(names):
                msg = (
                    f"the group's layer_names {names[:4]}... and its "
                    f"UniformTypeKVCacheSpecs members {list(spec.kv_cache_specs)[:4]}... "
                    "name different layers; give every layer exactly one member spec"
                )
                raise PlanError(msg)
        elif not isinstance(spec, KVCacheSpec):
            msg = (
                f"the group of layers {names[:4]} has kv_cache_spec {spec!r}; it must "
                "be a KVCacheSpec or a UniformTypeKVCacheSpecs"
            )
            raise KvcoreTypeError(msg)

    def layer_spec(self, name: str) -> KVCacheSpec:
        """The spec of one layer of this group."""
        spec = self.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            return spec.kv_cache_specs[name]
        return spec

    def layer_specs(self) -> list[KVCacheSpec]:
        """The spec of every layer, in ``layer_names`` order."""
        return [self.layer_spec(name) for name in self.layer_names]

    @property
    def packed_bytes(self) -> int:
        """Bytes of one block of this group: the sum of its layers' pages."""
        return sum(self.layer_spec(n).page_size_bytes for n in self.layer_names)

    @property
    def manager_spec(self) -> KVCacheSpec:
        """The spec the group's manager runs on: the kind's
        :meth:`~kvcore.spec.KVCacheSpec.merge_group` over the members."""
        spec = self.kv_cache_spec
        if not isinstance(spec, UniformTypeKVCacheSpecs):
            return spec
        members = list(spec.kv_cache_specs.values())
        cls = type(members[0])
        kind = members[0].kind
        where = f"{cls.__name__}.merge_group (kind {kind!r})"
        try:
            merged: object = cls.merge_group(members)
        except KvcoreError:
            raise  # a MergeError: the layers do not share a group
        except Exception as exc:
            msg = (
                f"{where} raised {type(exc).__name__}: {exc} for layers "
                f"{self.layer_names[:3]}; it must return the spec the group's "
                "manager runs on, or raise kvcore.MergeError"
            )
            raise PluginError(msg, plugin_name=kind) from exc
        if not isinstance(merged, cls) or merged.block_size != members[0].block_size:
            msg = (
                f"{where} returned {merged!r} for layers {self.layer_names[:3]}; it "
                f"must return the {cls.__name__} the group's manager runs on, of "
                f"the members' block size {members[0].block_size} (another kind's "
                "spec or block size would run the group under another manager)"
            )
            raise PluginResultError(msg, plugin_name=kind)
        return merged


@attrs.define(kw_only=False)
class KVCacheTensor:
    """A run of layers with one spec inside the shared allocation.

    The page of ``layers[l]`` in block ``b`` starts at byte
    ``offset + l * layer_stride + b * block_stride``.  Tensors of different
    groups may overlap (alias): a block id is owned by one group at a time.
    """

    size: int
    layers: list[str]
    layer_stride: int
    block_stride: int
    offset: int = 0
    host_resident: bool = False
    #: Byte strides of a page's ``[H, N, C]`` axes, as placed by the planner
    #: (``None`` for a hand-built tensor: the pool derives them).
    page_strides: tuple[int, int, int] | None = None

    def __attrs_post_init__(self) -> None:
        layers: object = self.layers
        if not isinstance(layers, list) or not layers:
            msg = f"KVCacheTensor.layers must be a non-empty list, got {self.layers!r}"
            raise PlanError(msg)
        for name in ("size", "layer_stride", "block_stride", "offset"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                msg = (
                    f"KVCacheTensor.{name} of layers {self.layers[:3]} must be a "
                    f"non-negative int, got {value!r}"
                )
                raise PlanError(msg)


@attrs.define(kw_only=True)
class KVCacheConfig:
    """The full plan: how many blocks, where every layer lives, the groups,
    and the settings the scheduler and the workers need to run it.

    :param scheduler_block_size: the token alignment of scheduling.
    :param hash_block_size: tokens per hashed chunk.
    :param max_model_len: the longest request the plan admits.
    :param enable_prefix_caching: whether blocks are shared by hash.
    :param packing_policy: the grouping policy that made the groups.
    :param target_context: the context the policy planned for.
    :param decode_context_parallel_size: the factor on attention block sizes.
    :param tensor_parallel_size: ranks each layer's heads were split over
        (the specs are one rank's).
    :param pipeline_parallel_size: stages the model's layers were split over.
    :param max_num_batched_tokens: tokens one scheduler step may prefill
        (the capacity model reserves one such step).
    :param available_memory: the bytes the plan was sized for.
    :param pipeline_stage: the pipeline stage whose layers this plan places
        (``None``: the whole model, or the scheduler's view of every stage).
    :param pipeline_stages: the cache layers each pipeline stage holds, in
        stage order (``None``: one stage).
    """

    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec]
    kv_cache_layout: KVCacheLayout | None = None
    bytes_per_block: int = 0
    scheduler_block_size: int | None = None
    hash_block_size: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = False
    packing_policy: str | None = None
    target_context: int | None = None
    decode_context_parallel_size: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_num_batched_tokens: int | None = None
    available_memory: int | None = None
    pipeline_stage: int | None = None
    pipeline_stages: list[list[str]] | None = None

    def __attrs_post_init__(self) -> None:
        if type(self.num_blocks) is not int or self.num_blocks < 1:
            msg = (
                f"KVCacheConfig.num_blocks must be a positive int (block 0 is the null "
                f"block), got {self.num_blocks!r}"
            )
            raise PlanError(msg)
        for name in (
            "decode_context_parallel_size",
            "tensor_parallel_size",
            "pipeline_parallel_size",
        ):
            _check_int(name, getattr(self, name), optional=False)
        for name in (
            "scheduler_block_size",
            "hash_block_size",
            "max_model_len",
            "target_context",
            "max_num_batched_tokens",
        ):
            _check_int(name, getattr(self, name), optional=True)
        _check_int("available_memory", self.available_memory, optional=True, minimum=0)
        _check_stages(self.pipeline_stage, self.pipeline_stages)
        caching: object = self.enable_prefix_caching
        if type(caching) is not bool:
            msg = (
                "KVCacheConfig.enable_prefix_caching must be True or False, got "
                f"{self.enable_prefix_caching!r}"
            )
            raise KvcoreTypeError(msg)
        policy: object = self.packing_policy
        if policy is not None and type(policy) is not str:
            msg = (
                "KVCacheConfig.packing_policy must be a policy name or None, got "
                f"{self.packing_policy!r}"
            )
            raise KvcoreTypeError(msg)
        groups: list[object] = list(self.kv_cache_groups)
        tensors: list[object] = list(self.kv_cache_tensors)
        for group in groups:
            if not isinstance(group, KVCacheGroupSpec):
                msg = f"KVCacheConfig.kv_cache_groups holds {group!r}, not a KVCacheGroupSpec"
                raise KvcoreTypeError(msg)
        for tensor in tensors:
            if not isinstance(tensor, KVCacheTensor):
                msg = f"KVCacheConfig.kv_cache_tensors holds {tensor!r}, not a KVCacheTensor"
                raise KvcoreTypeError(msg)

    def group_of(self, layer: str) -> int:
        """Index of the group holding ``layer``."""
        for i, group in enumerate(self.kv_cache_groups):
            if layer in group.layer_names:
                return i
        from kvcore.errors import KvcoreKeyError

        msg = f"layer {layer!r} is in no cache group of this config"
        raise KvcoreKeyError(msg)


def _check_stages(stage: object, stages: object) -> None:
    """A stage index needs the stages it indexes."""
    if stages is not None and (
        not isinstance(stages, list)
        or not all(isinstance(s, list) and s for s in stages)
        or not all(isinstance(n, str) for s in stages for n in s)
    ):
        msg = (
            "KVCacheConfig.pipeline_stages must be a list of non-empty lists of "
            f"layer names, one per stage, got {stages!r}"
        )
        raise PlanError(msg)
    if stage is None:
        return
    count = len(stages) if isinstance(stages, list) else 0
    if type(stage) is not int or not 0 <= stage < count:
        msg = (
            f"KVCacheConfig.pipeline_stage={stage!r} must index one of the "
            f"{count} pipeline_stages; record the stages with the stage"
        )
        raise PlanError(msg)


def _check_int(name: str, value: object, *, optional: bool, minimum: int = 1) -> None:
    if optional and value is None:
        return
    if type(value) is not int or value < minimum:
        allowed = f"an int of at least {minimum}" + (" or None" if optional else "")
        msg = f"KVCacheConfig.{name} must be {allowed}, got {value!r}"
        raise PlanError(msg)


@attrs.frozen(kw_only=True)
class ModelFile:
    """A model's cache layers, as in ``zoo/*.json``."""

    name: str
    layers: dict[str, KVCacheSpec]
    notes: str = ""
    sources: tuple[str, ...] = ()
    #: bytes of the whole model's weights (and activations) a device sets
    #: aside before its KV cache, when the file says.
    weights_bytes: int | None = None
    #: the longest context the model was trained for (Hugging Face's
    #: ``max_position_embeddings``), when the file says.
    max_position_embeddings: int | None = None
