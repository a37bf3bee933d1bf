"""Building and checking cache groups: one value per group, whoever made it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvcore.errors import MergeError, PlanError
from kvcore.plan.buckets import Bucket
from kvcore.plan.declarations import checked_merge
from kvcore.spec import GroupSpec, KVCacheSpec, UniformTypeKVCacheSpecs
from kvcore.structs import KVCacheGroupSpec

__all__ = ["check_chosen", "group_spec", "make_group"]


def group_spec(members: dict[str, KVCacheSpec]) -> GroupSpec | None:
    """One spec for layers that may share a group: their merge if they merge,
    else a :class:`UniformTypeKVCacheSpecs` if they share a grouping key."""
    values = list(members.values())
    first_type = type(values[0])
    if all(type(s) is first_type for s in values):
        try:
            return checked_merge(first_type, values)
        except MergeError:
            pass
    return UniformTypeKVCacheSpecs.from_specs(members)


def make_group(bucket: Bucket, names: list[str], *, wrap: bool) -> KVCacheGroupSpec:
    """A group of some of a bucket's layers.

    :param wrap: always wrap the members in a :class:`UniformTypeKVCacheSpecs`
        (the packed path), rather than merging them when they merge.
    """
    members = {name: bucket.specs[name] for name in names}
    spec = UniformTypeKVCacheSpecs.from_specs(members) if wrap else group_spec(members)
    if spec is None:  # pragma: no cover - buckets share one key
        msg = f"layers {names[:4]} share a bucket but not a grouping key"
        raise PlanError(msg)
    return KVCacheGroupSpec(names, spec)


def check_chosen(chosen: object, specs: Mapping[str, KVCacheSpec]) -> None:
    """Check a plugin's grouping: groups covering every layer once, each with
    a spec that matches its layers."""
    if not isinstance(chosen, list) or not all(
        isinstance(g, KVCacheGroupSpec) for g in chosen
    ):
        msg = (
            "a kvcore_choose_grouping plugin returned "
            f"{type(chosen).__name__}; it must return a list of KVCacheGroupSpec "
            "(or None to defer)"
        )
        raise PlanError(msg)
    _check_covers(chosen, specs)
    for i, group in enumerate(chosen):
        members = {name: specs[name] for name in group.layer_names}
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            ok = spec.kv_cache_specs == members
        else:
            ok = spec == group_spec(members)
        if not ok:
            msg = (
                f"a kvcore_choose_grouping plugin gave group {i} (layers "
                f"{group.layer_names[:4]}) a spec that does not match its layers' "
                "specs; use their merged spec or a UniformTypeKVCacheSpecs of them"
            )
            raise PlanError(msg)


def _check_covers(groups: Sequence[KVCacheGroupSpec], specs: Mapping[str, Any]) -> None:
    seen: dict[str, int] = {}
    for i, group in enumerate(groups):
        for name in group.layer_names:
            if name in seen:
                msg = (
                    f"the grouping chosen by a kvcore_choose_grouping plugin puts "
                    f"layer {name!r} in groups {seen[name]} and {i}; every layer "
                    "belongs to exactly one group"
                )
                raise PlanError(msg)
            seen[name] = i
    missing = [n for n in specs if n not in seen]
    unknown = [n for n in seen if n not in specs]
    if missing or unknown:
        msg = (
            "the grouping chosen by a kvcore_choose_grouping plugin does not match "
            f"the model's layers (missing: {missing[:5]}, unknown: {unknown[:5]})"
        )
        raise PlanError(msg)
