"""What the coordinator's step mixins read of the coordinator itself."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcore.coordinator.block_pool import BlockPool
    from kvcore.coordinator.manager import SingleTypeManager
    from kvcore.errors import PluginError

__all__ = ["CoordinatorParts"]


class CoordinatorParts:
    """The pool, the managers, their error reports and cache spans, which
    :class:`~kvcore.coordinator.coordinator.KVCacheCoordinator` supplies to
    the step mixins it is built from."""

    block_pool: BlockPool
    single_type_managers: tuple[SingleTypeManager, ...]

    if TYPE_CHECKING:  # the coordinator's

        def plugin_error(
            self, gid: int, method: str, exc: BaseException
        ) -> PluginError: ...

        def forget_span(self, request_id: str) -> None: ...

        def _each(
            self,
            managers: Sequence[SingleTypeManager],
            method: str,
            *args: Any,
            reads: bool = False,
        ) -> list[Any]: ...
