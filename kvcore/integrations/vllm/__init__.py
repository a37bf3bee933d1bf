"""vLLM's scheduler on kvcore (``pip install kvcore[vllm]``).

:class:`KVCacheManager` has vLLM's constructor and methods and takes vLLM's
types, so vLLM's ``Scheduler`` uses it as its own; :func:`install` points a
vLLM process's scheduler at it.  The ``vllm.general_plugins`` entry point
(:func:`register`) calls :func:`install` when ``KVCORE_VLLM=1``, so one
setting switches a vLLM process onto kvcore.  Only the vLLM release the
integration is tested against (:data:`VLLM_VERSION`) is accepted.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from kvcore.errors import KvcoreError

if TYPE_CHECKING:
    from kvcore.integrations.vllm.manager import KVCacheManager

__all__ = [
    "ENV_SWITCH",
    "VLLM_VERSION",
    "KVCacheManager",
    "VllmVersionError",
    "install",
    "register",
]

#: The vLLM release this integration supports.
VLLM_VERSION = "0.33.0"
#: The environment variable that switches a vLLM process onto kvcore.
ENV_SWITCH = "KVCORE_VLLM"


class VllmVersionError(KvcoreError, ImportError):
    """vLLM is missing or is a release the integration does not support."""


def check_vllm() -> None:
    """Refuse any vLLM but :data:`VLLM_VERSION`."""
    try:
        import vllm
    except ImportError as exc:
        msg = (
            f"kvcore.integrations.vllm needs vLLM {VLLM_VERSION}, which is not "
            "installed; pip install 'kvcore[vllm]'"
        )
        raise VllmVersionError(msg) from exc
    found = getattr(vllm, "__version__", "unknown")
    if found.split("+")[0] != VLLM_VERSION:
        msg = (
            f"kvcore.integrations.vllm supports vLLM {VLLM_VERSION} only, found "
            f"vLLM {found}; install vllm=={VLLM_VERSION} or unset {ENV_SWITCH}"
        )
        raise VllmVersionError(msg)


def install() -> None:
    """Point this process's vLLM scheduler at kvcore's :class:`KVCacheManager`
    (every ``Scheduler`` built afterwards manages its KV cache on kvcore),
    and vLLM's KV-cache planning at kvcore's planner
    (:mod:`kvcore.integrations.vllm.builder`; ``KVCORE_VLLM_PACKING=vllm``
    keeps vLLM's)."""
    check_vllm()
    from vllm.v1.core.sched import scheduler

    from kvcore.integrations.vllm.builder import install_builder
    from kvcore.integrations.vllm.manager import KVCacheManager

    scheduler.KVCacheManager = KVCacheManager
    install_builder()


def register() -> None:
    """The ``vllm.general_plugins`` entry point: :func:`install` when
    ``KVCORE_VLLM=1``, nothing otherwise."""
    if os.environ.get(ENV_SWITCH, "") == "1":
        install()


def __getattr__(name: str) -> Any:
    if name == "KVCacheManager":
        check_vllm()
        from kvcore.integrations.vllm.manager import KVCacheManager

        return KVCacheManager
    raise AttributeError(name)
