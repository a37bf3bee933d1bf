"""The model-mapper protocol: what a plugin that reads model configurations
(a Hugging Face ``config.json``, say) hands the core.

The core only names the shape of a mapper; reading configurations, and the
mappers themselves, live in plugins (``kvcore_hf`` for Hugging Face).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kvcore.serving import ServingChoices
    from kvcore.spec import KVCacheSpec

__all__ = ["ModelMapper"]


@runtime_checkable
class ModelMapper(Protocol):
    """Maps the configurations of one architecture family to layer specs."""

    #: The mapper's name, shown in listings and errors.
    name: str

    def matches(self, config: Any) -> bool:
        """Whether this mapper is for ``config``."""
        ...

    def layer_specs(
        self, config: Any, choices: ServingChoices
    ) -> Mapping[str, KVCacheSpec] | None:
        """The whole model's cache layers, in model order, or None to let the
        next mapper answer."""
        ...
