"""Hook specifications of kvcore's plugin system.

Every hook is prefixed ``kvcore_``.  Plugins implement them with the
:data:`hookimpl` marker; kvcore calls them only while building a registry or
planning, never per block.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from kvcore.config import EngineConfig
    from kvcore.engines import EngineEstimate
    from kvcore.kinds import CacheKind, KindLookup
    from kvcore.mappers import ModelMapper
    from kvcore.serving import ServingChoices
    from kvcore.spec import KVCacheSpec
    from kvcore.structs import KVCacheGroupSpec, ModelFile

__all__ = ["hookimpl", "hookspec", "kinds_impl"]

PROJECT = "kvcore"

hookspec = pluggy.HookspecMarker(PROJECT)
#: Marker to be imported and used in plugins.
hookimpl = pluggy.HookimplMarker(PROJECT)


def kinds_impl(*kinds: CacheKind) -> Callable[[], list[CacheKind]]:
    """A :func:`kvcore_register_kinds` implementation returning ``kinds``, for
    a plugin whose kinds are fixed: ``kvcore_register_kinds = kinds_impl(K())``."""

    @hookimpl
    def kvcore_register_kinds() -> list[CacheKind]:
        return list(kinds)

    return kvcore_register_kinds


# ---------------------------------------------------------------------------
# Registration hooks: called once when a registry is built
# ---------------------------------------------------------------------------


@hookspec
def kvcore_register_kinds() -> Sequence[CacheKind]:
    """Return the cache kinds this plugin provides.

    Collects every plugin's list (kvcore's built-ins first); a kind name
    registered by two plugins is an error that names both, unless the user
    lets the later one replace it (``KVCORE_OVERRIDE_KINDS``).  kvcore checks
    the answer and each kind's classes as it registers them.

    :returns: a list (or tuple) of kind objects (instances of
        :class:`kvcore.kinds.CacheKind`); ``[]`` for none, never ``None`` or
        a single kind.

    .. versionadded:: 0.1
    """
    raise NotImplementedError


@hookspec
def kvcore_register_model_mappers() -> Sequence[ModelMapper]:
    """Return the architecture mappers this plugin provides.

    A mapper turns a Hugging Face ``config.json`` into layer specs
    (:class:`kvcore.mappers.ModelMapper`).  Mappers of plugins registered
    later are asked first; the first that recognises a configuration and
    returns layers wins.

    :returns: mapper objects (each satisfying :class:`kvcore.mappers.ModelMapper`).

    .. versionadded:: 0.2
    """
    raise NotImplementedError


@hookspec(firstresult=True)
def kvcore_read_model(
    source: str, choices: ServingChoices, registry: KindLookup, allow_hub: bool
) -> ModelFile | None:
    """Read a model from a configuration this plugin understands.

    Stops at first non-None result.  Tools call it for a source that is not
    a kvcore model file: the built-in ``kvcore_hf`` plugin reads a
    Hugging Face ``config.json`` (a file, or a directory holding one) and,
    where ``allow_hub`` is true, a hub id ``ORG/NAME``.

    :param source: what the user named.
    :param choices: the engine's settings, passed on to the mapper.
    :param registry: the cache kinds the model's layers must belong to.
    :param allow_hub: whether ``source`` may be fetched from a network hub;
        false for a source the user gave as a path.
    :returns: the model file, or ``None`` when this plugin does not read
        ``source``.

    .. versionadded:: 0.2
    """
    raise NotImplementedError


# ---------------------------------------------------------------------------
# Planning hooks: called once per plan
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def kvcore_choose_grouping(
    config: EngineConfig, specs: Mapping[str, KVCacheSpec]
) -> list[KVCacheGroupSpec] | None:
    """Choose how the model's layers are grouped, replacing kvcore's policy.

    Stops at first non-None result.  The returned groups must cover every
    layer exactly once; kvcore checks them before using them.  The context
    the plan is for is ``config.resolved_target_context()``; kvcore's own
    policies are importable (``kvcore.plan.policies.POLICIES``) for a plugin
    that adjusts their answer.

    :param config: the engine settings (layout, block size, parallelism,
        packing policy and target context).
    :param specs: layer name to spec, in model order.
    :returns: the groups, or ``None`` to defer to the next plugin or to
        kvcore's own grouping.

    .. versionadded:: 0.1
    """
    raise NotImplementedError


@hookspec(firstresult=True)
def kvcore_engine_estimate(
    policy: str,
    config: EngineConfig,
    specs: Mapping[str, KVCacheSpec],
    available_memory: int,
    contexts: Sequence[int],
) -> EngineEstimate | None:
    """Say what another engine's own planner does with this model.

    Stops at first non-None result.  A plugin that models an engine's
    planner answers for its policy name (the built-in ``kvcore_vllm``
    answers ``vllm``) with that engine's figures at each context, as the
    engine itself would compute them for ``available_memory`` bytes of KV
    cache, or with the engine's reason for refusing the model.

    :param policy: the policy asked for (``vllm``).
    :param config: the engine settings kvcore plans with (prefix caching,
        state caching mode, parallelism, ``max_num_batched_tokens``).
    :param specs: layer name to spec, in model order, on one rank.
    :param available_memory: bytes of KV cache on that rank.
    :param contexts: the request lengths (the engine's ``max_model_len``).
    :returns: an :class:`kvcore.engines.EngineEstimate`, or ``None`` when
        this plugin does not model ``policy``.

    .. versionadded:: 0.3
    """
    raise NotImplementedError
