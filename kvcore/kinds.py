"""Cache kinds: the behaviour a plugin contributes for its spec class.

A kind bundles its spec class (page sizing, merge rule, grouping key and
hashing behaviour live on the spec, since they derive from its fields), the
view binder that turns a raw byte region into the layer's typed tensor, and
the block manager the coordinator runs for groups of this kind.  Kinds are
collected once into a :class:`~kvcore.registry.KindRegistry`; nothing calls a
hook per block or per layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from kvcore.errors import LayoutError
from kvcore.spec import AttentionSpec, KVCacheSpec

if TYPE_CHECKING:
    from kvcore.coordinator.manager import SingleTypeManager

__all__ = ["AttentionKind", "CacheKind", "LayerView"]

#: What a binder returns: one typed tensor, or several for multi-tensor states.
LayerView = torch.Tensor | tuple[torch.Tensor, ...]


class CacheKind:
    """Base class of a cache kind.

    Subclasses set :attr:`spec_type` and, for the coordinator,
    :attr:`manager_type`, and may override :meth:`bind_view`.
    """

    #: Registry name, also the ``kind`` tag of the spec in JSON; by default
    #: the spec class's ``kind``, which the registry requires it to equal.
    name: ClassVar[str]
    #: The spec class this kind owns.
    spec_type: ClassVar[type[KVCacheSpec]]
    #: The block manager class for groups of this kind.
    manager_type: ClassVar[type[SingleTypeManager] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        tag = getattr(cls.__dict__.get("spec_type"), "kind", None)
        if "name" not in cls.__dict__ and isinstance(tag, str) and tag:
            cls.name = tag

    def bind_view(self, spec: Any, raw: torch.Tensor) -> LayerView:
        """Turn one layer's raw bytes into its typed view.

        :param spec: the layer's spec (an instance of :attr:`spec_type`).
        :param raw: a uint8 view ``[num_blocks, H, N, C_bytes]`` of the layer's
            pages inside the pool's single allocation, ``C`` contiguous.
        :returns: a tensor (or tuple of tensors) sharing ``raw``'s storage.
        """
        return raw

    def make_manager(
        self, spec: Any, block_pool: Any, **kwargs: Any
    ) -> SingleTypeManager:
        """Build the block manager for one group of this kind.

        :param spec: the group's representative layer spec.
        :param block_pool: the shared :class:`~kvcore.coordinator.BlockPool`.
        :param kwargs: ``group_id``, ``block_size``, ``hash_block_size``,
            ``enable_caching`` and ``max_model_len``.
        """
        if self.manager_type is None:
            from kvcore.errors import PluginError

            msg = (
                f"cache kind {self.name!r} has no block manager; its plugin must "
                "set manager_type (a kvcore.coordinator.SingleTypeManager subclass)"
            )
            raise PluginError(msg, plugin_name=self.name)
        return self.manager_type(spec, block_pool, **kwargs)

    def __repr__(self) -> str:
        return f"<cache kind {self.name!r} ({self.spec_type.__name__})>"


class AttentionKind(CacheKind):
    """A kind whose pages follow the attention page model: the view is
    ``[num_blocks, num_kv_heads, block_size // tokens_per_state,
    head_size + head_size_v]`` in the spec's dtype."""

    def bind_view(self, spec: AttentionSpec, raw: torch.Tensor) -> LayerView:
        return view_as_dtype(raw, spec.dtype, what=f"{spec.kind} page")


def view_as_dtype(raw: torch.Tensor, dtype: torch.dtype, *, what: str) -> torch.Tensor:
    """Reinterpret the last (contiguous) byte axis of ``raw`` as ``dtype``."""
    try:
        return raw.view(dtype)
    except RuntimeError as exc:
        msg = (
            f"cannot view a {what} as {dtype}: its byte offset or strides are not "
            f"multiples of the element size ({exc}); align the page "
            "(alignment=...) so every page starts on an element boundary"
        )
        raise LayoutError(msg) from exc


class KindLookup(Protocol):
    """What finds the kind owning a spec: a :class:`kvcore.registry.KindRegistry`."""

    def kind_for(self, spec: object, *, layer: str | None = None) -> CacheKind:
        """The kind owning ``spec``'s class; an error naming ``layer`` if none."""
        ...
