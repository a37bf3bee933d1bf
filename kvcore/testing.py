"""Conformance checks for cache kinds, for kvcore's own tests and for third
parties that ship a kind.

    from kvcore.testing import check_kind

    def test_my_kind_conforms():
        check_kind(MyKind(), MySpec(block_size=16, ...))

Opt-in: nothing here is loaded unless imported.
"""

from __future__ import annotations

import json

import attrs

from kvcore.config import CacheConfig, EngineConfig
from kvcore.coordinator.block_pool import BlockPool
from kvcore.errors import InvalidSpecError, KvcoreError
from kvcore.kinds import CacheKind
from kvcore.layout import KVCacheLayout
from kvcore.plan import get_kv_cache_config_from_groups
from kvcore.pool import KVCachePool
from kvcore.registry import KindRegistry
from kvcore.serialize import make_converter
from kvcore.spec import KVCacheSpec
from kvcore.structs import KVCacheGroupSpec

__all__ = ["ConformanceError", "check_kind"]


class ConformanceError(KvcoreError, AssertionError):
    """A kind breaks one of the rules every kind must follow."""


def _require(ok: bool, kind: CacheKind, rule: str) -> None:
    if not ok:
        msg = f"cache kind {getattr(kind, 'name', kind)!r}: {rule}"
        raise ConformanceError(msg)


def check_kind(
    kind: CacheKind, spec: KVCacheSpec, *, registry: KindRegistry | None = None
) -> None:
    """Check that ``kind`` and a sample ``spec`` of it follow kvcore's rules.

    Raises :class:`ConformanceError` naming the first rule broken: the spec's
    tag matches the kind; its page is positive; its grouping key is hashable
    and stable; ``merge([spec])`` is the spec; validation runs again on
    ``attrs.evolve``; the spec round-trips through JSON; the binder returns
    views that share the pool's storage, one page per block; the manager (if
    any) builds, and a prefix-cacheable kind can search for hits.
    """
    registry = registry if registry is not None else KindRegistry.from_kinds([kind])
    _require(
        type(spec) is kind.spec_type, kind, "the sample spec must be its spec_type"
    )
    _require(kind.spec_type.kind == kind.name, kind, "spec_type.kind must equal name")
    _require(
        registry.kind_for(spec) is kind, kind, "the registry must map the spec to it"
    )
    h, n, c = spec.page_grid
    _require(h * n * c > 0, kind, "page_grid must be positive")
    _require(spec.page_size_bytes >= h * n * c, kind, "a padded page is never smaller")
    key = spec.group_key()
    _require(hash(key) == hash(spec.group_key()), kind, "group_key must be stable")
    _require(type(spec).merge([spec]) == spec, kind, "merge([spec]) must be spec")
    try:
        attrs.evolve(spec, block_size=0)
    except InvalidSpecError:
        pass
    else:
        _require(
            False, kind, "attrs.evolve(spec, block_size=0) must raise InvalidSpecError"
        )
    converter = make_converter(registry)
    data = json.loads(json.dumps(converter.unstructure(spec)))
    _require(data.get("kind") == kind.name, kind, "JSON carries the kind tag")
    _require(
        converter.structure_spec(data) == spec,
        kind,
        "the spec round-trips through JSON",
    )

    config = EngineConfig(cache_config=CacheConfig(kv_cache_layout=KVCacheLayout.BLHNC))
    group = KVCacheGroupSpec(["layer.0", "layer.1"], spec)
    plan = get_kv_cache_config_from_groups(
        config, [group], 3 * 2 * spec.page_size_bytes * 8
    )
    pool = KVCachePool(plan, "cpu", registry=registry)
    storage = pool.buffer.untyped_storage().data_ptr()
    for name in group.layer_names:
        view = pool.views[name]
        for tensor in view if isinstance(view, tuple) else (view,):
            _require(
                tensor.untyped_storage().data_ptr() == storage,
                kind,
                "bind_view must return views of the pool's storage (no copy)",
            )
            _require(
                tensor.shape[0] == plan.num_blocks, kind, "views index blocks first"
            )

    if kind.manager_type is not None:
        block_pool = BlockPool(8, enable_caching=True, hash_block_size=spec.block_size)
        manager = kind.make_manager(
            spec,
            block_pool,
            group_id=0,
            block_size=spec.block_size,
            hash_block_size=spec.block_size,
            enable_caching=True,
            max_model_len=16 * spec.block_size,
        )
        if manager.caching:
            hits = type(manager).find_longest_cache_hit(
                spec,
                [],
                4 * spec.block_size,
                [0],
                block_pool,
                spec.block_size,
                spec.block_size,
            )
            _require(hits == [[]], kind, "a search over no hashes finds no hit")
