"""What a cache kind's plugin declares to the coordinator, checked when
the coordinator builds the kind's manager: the spec's hit policy, and a
manager that serves it with the current hit-search signature and declares
a valid boundary overlap.  Each
failure is a :class:`~kvcore.errors.PluginError` naming the kind, its
plugin, the rule and the fix."""

from __future__ import annotations

import functools
import inspect
from typing import Any

from kvcore.coordinator.manager import SingleTypeManager
from kvcore.coordinator.twins import CLASS_STEPS
from kvcore.errors import PluginError, PluginResultError
from kvcore.spec import HitPolicy

__all__ = [
    "check_built",
    "check_class_steps",
    "check_manager",
    "declared_policy",
    "search_problem",
]


def declared_policy(spec: Any, kind: str, plugin: str) -> HitPolicy:
    """The group's hit policy, checked: a :class:`HitPolicy`, and the two
    properties derived from it left as the policy says (a spec that
    overrides ``prefix_cacheable`` or ``hashes_blocks`` instead would have
    the planner and the coordinator disagree)."""
    try:
        policy = spec.hit_policy
    except Exception as exc:
        msg = (
            f"cache kind {kind!r} (plugin {plugin!r}): reading spec.hit_policy "
            f"raised {type(exc).__name__}: {exc}"
        )
        raise PluginError(msg, plugin_name=plugin) from exc
    if not isinstance(policy, HitPolicy):
        msg = (
            f"cache kind {kind!r} (plugin {plugin!r}): spec.hit_policy is "
            f"{policy!r}; it must be a kvcore.HitPolicy member "
            f"({', '.join(p.name for p in HitPolicy)})"
        )
        raise PluginError(msg, plugin_name=plugin)
    if (spec.prefix_cacheable, spec.hashes_blocks) != (
        policy.prefix_cacheable,
        policy.hashes_blocks,
    ):
        msg = (
            f"cache kind {kind!r} (plugin {plugin!r}): the spec declares "
            f"hit_policy={policy.name} but overrides prefix_cacheable="
            f"{spec.prefix_cacheable} / hashes_blocks={spec.hashes_blocks}, "
            f"which {policy.name} makes {policy.prefix_cacheable} / "
            f"{policy.hashes_blocks}; override hit_policy alone"
        )
        raise PluginError(msg, plugin_name=plugin)
    return policy


def check_built(manager: object, given: dict[str, Any], kind: str, plugin: str) -> None:
    """What ``make_manager`` built is a :class:`SingleTypeManager` over what
    the core gave it (``given``: the pool, ``group_id``, ``block_size`` and
    ``hash_block_size``): a manager drawing from a pool of its own, or
    stepping another group's blocks or blocks of another size, would hand
    out ids other groups hold or pages it does not own."""
    if not isinstance(manager, SingleTypeManager):
        msg = (
            f"cache kind {kind!r} (plugin {plugin!r}): make_manager returned "
            f"{type(manager).__name__}; it must return a "
            "kvcore.coordinator.SingleTypeManager subclass instance"
        )
        raise PluginResultError(msg, plugin_name=plugin)
    found = {
        "block_pool": manager.block_pool,
        "group_id": manager.kv_cache_group_id,
        "block_size": manager.block_size,
        "hash_block_size": manager.hash_block_size,
    }
    for name, value in found.items():
        expected = given[name]
        if value is expected or (name != "block_pool" and value == expected):
            continue
        what = (
            "a block pool other than the coordinator's"
            if name == "block_pool"
            else f"{name}={value!r}, not the {expected!r} it was given"
        )
        msg = (
            f"cache kind {kind!r} (plugin {plugin!r}): make_manager built a "
            f"{type(manager).__name__} with {what}; build it over the "
            "arguments make_manager receives (the shared pool, the group's "
            "id and block sizes)"
        )
        raise PluginResultError(msg, plugin_name=plugin)


def check_manager(
    manager: SingleTypeManager, policy: HitPolicy, kind: str, plugin: str
) -> int:
    """A kind's manager serves its spec's policy, with the current hit-search
    signature (one :class:`HitQuery`); its checked ``boundary_overlap``,
    read once (see :mod:`kvcore.coordinator.headroom`)."""
    served: frozenset[HitPolicy] = getattr(manager, "hit_policies", frozenset())
    if policy not in served:
        names = ", ".join(sorted(p.name for p in served)) or "none"
        msg = (
            f"cache kind {kind!r} (plugin {plugin!r}): its spec declares "
            f"hit_policy={policy.name} but its manager {type(manager).__name__} "
            f"serves {names}; choose a manager for that policy "
            "(kvcore.coordinator.managers) or declare the policy it serves"
        )
        raise PluginError(msg, plugin_name=plugin)
    try:
        overlap: object = manager.boundary_overlap
    except Exception as exc:
        msg = (
            f"cache kind {kind!r} (plugin {plugin!r}): reading its manager "
            f"{type(manager).__name__}.boundary_overlap raised "
            f"{type(exc).__name__}: {exc}"
        )
        raise PluginError(msg, plugin_name=plugin) from exc
    if type(overlap) is not int or overlap < 0:
        msg = (
            f"cache kind {kind!r} (plugin {plugin!r}): its manager "
            f"{type(manager).__name__} declares boundary_overlap={overlap!r}; "
            "it must be a non-negative int (the blocks a step holds over a "
            "block boundary, 0 for none)"
        )
        raise PluginError(msg, plugin_name=plugin)
    check_class_steps(type(manager), kind, plugin)
    if manager.caching:
        problem = search_problem(type(manager))
        if problem:
            msg = (
                f"cache kind {kind!r} (plugin {plugin!r}): "
                f"{type(manager).__name__}.find_longest_cache_hit {problem}; a "
                f"manager serving {policy.name} implements it as a classmethod "
                "taking one kvcore.coordinator.HitQuery (find_longest_cache_hit(cls, "
                "query)), or subclasses a generic manager that does"
            )
            raise PluginError(msg, plugin_name=plugin)
    return overlap


def check_class_steps(manager_type: type, kind: str, plugin: str) -> None:
    """Every step the core calls through the class (:data:`CLASS_STEPS`) is
    a method there: a plain function, or a ``functools.partialmethod``.  A
    staticmethod, classmethod, property or callable object would not be
    given the manager as its first argument."""
    for name in CLASS_STEPS:
        step = inspect.getattr_static(manager_type, name, None)
        if step is None or inspect.isfunction(step):
            continue
        if isinstance(step, functools.partialmethod):
            continue
        msg = (
            f"cache kind {kind!r} (plugin {plugin!r}): its manager "
            f"{manager_type.__name__}.{name} is a {type(step).__name__}, not a "
            "method; the core calls a manager's steps through its class with the "
            f"manager first, so define it as a method (def {name}(self, ...))"
        )
        raise PluginError(msg, plugin_name=plugin)


def search_problem(manager_type: type[SingleTypeManager]) -> str | None:
    """What is wrong with a manager class's hit search, or None: it must be
    its own (not the base's, which only raises) and callable with one
    query argument."""
    if getattr(manager_type.find_longest_cache_hit, "__isabstractmethod__", False):
        return "is not implemented (only the base class's, which raises)"
    try:
        signature = inspect.signature(manager_type.find_longest_cache_hit)
    except (TypeError, ValueError):
        return None  # not introspectable (a C callable): trust it
    try:
        signature.bind(object())
    except TypeError:
        return (
            f"cannot be called with one query argument (its signature is {signature})"
        )
    return None
