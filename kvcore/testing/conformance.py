"""The conformance suite: the rules every cache kind follows, as pytest tests
parametrized over a registry's kinds.

Subclass :class:`KindConformance` in a test module that loads the pytest
plugin ``kvcore.testing.pytest_plugin``; every test runs once per sample spec
of every kind under test::

    pytest_plugins = ["kvcore.testing.pytest_plugin"]

    class TestMyKind(KindConformance):
        registry = KindRegistry.from_kinds([MyKind()])
        samples = {"my_kind": [MySpec(block_size=16, ...)]}
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar

import attrs
import torch

from kvcore.config import CacheConfig, EngineConfig
from kvcore.errors import InvalidSpecError, MergeError
from kvcore.kinds import CacheKind, LayerView
from kvcore.layout import KVCacheLayout
from kvcore.plan import get_kv_cache_config_from_groups
from kvcore.pool import ByteRegion, KVCachePool
from kvcore.registry import KindRegistry
from kvcore.serialize import make_converter
from kvcore.spec import KVCacheSpec
from kvcore.structs import KVCacheConfig, KVCacheGroupSpec

__all__ = ["ConformanceCase", "KindConformance"]

#: Hash seeds of the two processes the grouping key is compared across.
HASH_SEEDS = (1, 2)

_CHILD = """
import json, pickle, sys
with open(sys.argv[1], "rb") as f:
    specs = pickle.load(f)
print(json.dumps([repr(spec.group_key()) for spec in specs]))
"""


@attrs.frozen
class ConformanceCase:
    """One kind and one of its sample specs (``None`` when the suite gives
    the kind no sample, which every test then reports)."""

    name: str
    kind: CacheKind
    spec: KVCacheSpec | None
    registry: KindRegistry
    index: int = 0

    @property
    def id(self) -> str:
        return f"{self.name}-{self.index}"

    def sample(self) -> KVCacheSpec:
        if self.spec is None:
            msg = (
                f"kind {self.name!r} is in the registry under test but the suite "
                "has no sample spec for it; add one to samples"
            )
            raise AssertionError(msg)
        return self.spec


class KindConformance:
    """Base class of a conformance suite; see the module docstring.

    :cvar registry: the registry the kinds under test come from (or a
        zero-argument callable returning it).
    :cvar samples: kind name to a sample spec, or a list of them.
    :cvar kinds: the kind names under test; default every kind of
        :attr:`registry`.
    :cvar unequal: kind name to a spec that must not merge with the sample
        (default: the sample with twice its block size).
    """

    registry: ClassVar[KindRegistry | Callable[[], KindRegistry]]
    samples: ClassVar[Mapping[str, KVCacheSpec | Sequence[KVCacheSpec]]] = {}
    kinds: ClassVar[Sequence[str] | None] = None
    unequal: ClassVar[Mapping[str, KVCacheSpec]] = {}

    _group_keys: ClassVar[dict[int, dict[int, list[str]]]] = {}

    @classmethod
    def conformance_registry(cls) -> KindRegistry:
        registry = cls.registry
        return registry if isinstance(registry, KindRegistry) else registry()

    @classmethod
    def conformance_cases(cls) -> list[ConformanceCase]:
        """Every (kind, sample) pair under test, in registry order."""
        registry = cls.conformance_registry()
        names = list(cls.kinds) if cls.kinds is not None else list(registry)
        cases = []
        for name in names:
            given = cls.samples.get(name)
            specs: list[KVCacheSpec | None] = [None]
            if isinstance(given, KVCacheSpec):
                specs = [given]
            elif given:
                specs = list(given)
            for i, spec in enumerate(specs):
                cases.append(ConformanceCase(name, registry[name], spec, registry, i))
        return cases

    # -- the tests ----------------------------------------------------------
    def test_sample_is_the_kinds_spec(self, kvcore_case: ConformanceCase) -> None:
        check_sample(kvcore_case.kind, kvcore_case.sample(), kvcore_case.registry)

    def test_json_round_trip(self, kvcore_case: ConformanceCase) -> None:
        spec = kvcore_case.sample()
        check_json_round_trip(kvcore_case.kind, spec, kvcore_case.registry)

    def test_evolve_revalidates(self, kvcore_case: ConformanceCase) -> None:
        check_evolve_revalidates(kvcore_case.sample())

    def test_merge_of_one_is_itself(self, kvcore_case: ConformanceCase) -> None:
        check_merge_of_one(kvcore_case.sample())

    def test_merging_unequal_specs_raises(self, kvcore_case: ConformanceCase) -> None:
        spec = kvcore_case.sample()
        other = self.unequal.get(kvcore_case.name)
        if other is None:
            other = attrs.evolve(spec, block_size=2 * spec.block_size)
        _check(other != spec, "the unequal spec equals the sample")
        try:
            merged = type(spec).merge([spec, other])
        except MergeError:
            return
        _check(
            False,
            f"merge() of two unequal specs returned {merged!r}; it must raise "
            "kvcore.MergeError",
        )

    def test_group_key_stable_across_processes(
        self, kvcore_case: ConformanceCase
    ) -> None:
        spec = kvcore_case.sample()
        key = spec.group_key()
        _check(
            hash(key) == hash(attrs.evolve(spec).group_key()), "hash differs on a copy"
        )
        here = repr(key)
        for seed, keys in self._keys_in_other_processes().items():
            there = keys[self._case_index(kvcore_case)]
            _check(
                there == here,
                f"group_key() is {here} here but {there} in a process with "
                f"PYTHONHASHSEED={seed}; build it from ordered values (tuples, "
                "not sets) so every process plans the same groups",
            )

    def test_page_size_is_what_the_binder_addresses(
        self, kvcore_case: ConformanceCase
    ) -> None:
        spec = kvcore_case.sample()
        plan, pool = two_layer_pool(spec, kvcore_case.registry)
        pool.buffer.fill_(0xFF)
        block = 1
        for tensor in _tensors(pool.views["layer.0"]):
            _check(
                tensor.shape[0] == plan.num_blocks,
                f"the view's first dim is {tensor.shape[0]}, not the "
                f"{plan.num_blocks} blocks",
            )
            tensor[block].zero_()
        written = (pool.buffer == 0).nonzero().flatten()
        page = spec.real_page_size_bytes
        _check(
            written.numel() == page,
            f"writing one block through the views changes {written.numel()} "
            f"bytes, but the page is {page} bytes (page_grid {spec.page_grid}); "
            "page_size_bytes must be what the binder addresses",
        )
        start = block * plan.bytes_per_block
        _check(
            bool(((written >= start) & (written < start + plan.bytes_per_block)).all()),
            f"writing block {block} through the views changes bytes outside that block",
        )

    def test_views_inside_region_sharing_storage(
        self, kvcore_case: ConformanceCase
    ) -> None:
        spec = kvcore_case.sample()
        plan, pool = two_layer_pool(spec, kvcore_case.registry)
        storage = pool.buffer.untyped_storage().data_ptr()
        tensor = plan.kv_cache_tensors[0]
        raws = pool._raw_views(pool.buffer, tensor, spec, plan.num_blocks, None)
        for layer, raw in zip(tensor.layers, raws, strict=True):
            region = ByteRegion(raw)
            for view in _tensors(pool.views[layer]):
                _check(
                    view.untyped_storage().data_ptr() == storage,
                    f"the view of {layer!r} does not share the pool's storage",
                )
                _check(
                    region.contains(view),
                    f"the view of {layer!r} reaches outside its region",
                )
        # Behaviour, not arithmetic: a write through one layer leaves every
        # byte outside that layer's region as it was.
        mask = torch.zeros_like(pool.buffer, dtype=torch.bool)
        torch.as_strided(
            mask, raws[0].shape, raws[0].stride(), raws[0].storage_offset()
        ).fill_(True)
        pool.buffer.fill_(0xFF)
        for view in _tensors(pool.views["layer.0"]):
            view.zero_()
        changed = pool.buffer != 0xFF
        _check(
            not bool((changed & ~mask).any()),
            "writing through layer.0's views changed bytes outside its region",
        )
        _check(bool(changed.any()), "writing through layer.0's views changed nothing")

    # -- helpers ------------------------------------------------------------
    @classmethod
    def _case_index(cls, case: ConformanceCase) -> int:
        return [c.id for c in cls.conformance_cases()].index(case.id)

    @classmethod
    def _keys_in_other_processes(cls) -> dict[int, list[str]]:
        """``repr(group_key())`` of every sample, computed once per suite in
        fresh interpreters with other hash seeds."""
        cached = KindConformance._group_keys.get(id(cls))
        if cached is not None:
            return cached
        specs = [c.sample() for c in cls.conformance_cases() if c.spec is not None]
        results: dict[int, list[str]]
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "specs.pickle")
            with open(path, "wb") as f:
                pickle.dump(specs, f)
            env = dict(os.environ)
            paths = [_import_root(type(spec)) for spec in specs]
            paths += [p for p in sys.path if p]
            env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)

            def keys(seed: int) -> list[str]:
                proc = subprocess.run(
                    [sys.executable, "-c", _CHILD, path],
                    capture_output=True,
                    text=True,
                    env={**env, "PYTHONHASHSEED": str(seed)},
                    check=False,
                    timeout=300,
                )
                if proc.returncode != 0:
                    msg = f"the grouping-key subprocess failed: {proc.stderr[-2000:]}"
                    raise AssertionError(msg)
                out: list[str] = json.loads(proc.stdout.strip().splitlines()[-1])
                return out

            # Every seed's interpreter at once: each spends most of its time
            # starting up (importing torch), not computing.
            with concurrent.futures.ThreadPoolExecutor(len(HASH_SEEDS)) as pool:
                results = dict(zip(HASH_SEEDS, pool.map(keys, HASH_SEEDS), strict=True))
        KindConformance._group_keys[id(cls)] = results
        return results


# -- the rules check_kind shares -----------------------------------------------
def check_sample(kind: CacheKind, spec: KVCacheSpec, registry: KindRegistry) -> None:
    """The sample is the kind's spec class, and the registry maps it there."""
    _check(
        type(spec) is kind.spec_type,
        f"the sample spec must be its spec_type (it is a {type(spec).__name__}, "
        f"not {kind.spec_type.__name__})",
    )
    _check(kind.spec_type.kind == kind.name, "spec_type.kind must equal name")
    _check(
        registry.kind_for(spec) is kind,
        "the registry does not map the sample to its kind",
    )


def check_json_round_trip(
    kind: CacheKind, spec: KVCacheSpec, registry: KindRegistry
) -> None:
    """The spec's JSON carries the kind's tag and reads back as the spec."""
    converter = make_converter(registry)
    data = json.loads(json.dumps(converter.unstructure(spec)))
    _check(
        data.get("kind") == kind.name,
        f"the spec's JSON carries kind {data.get('kind')!r}, not {kind.name!r}",
    )
    back = converter.structure_spec(data)
    _check(back == spec, f"the JSON round trip gives {back!r}, not {spec!r}")


def check_evolve_revalidates(spec: KVCacheSpec) -> None:
    """``attrs.evolve`` runs the spec's validators again."""
    try:
        attrs.evolve(spec, block_size=0)
    except InvalidSpecError:
        return
    _check(False, "attrs.evolve(spec, block_size=0) must raise InvalidSpecError")


def check_merge_of_one(spec: KVCacheSpec) -> None:
    """``merge([spec])`` and ``merge_group([spec])`` are the spec."""
    merged = type(spec).merge([spec])
    _check(merged == spec, f"merge([spec]) is {merged!r}, not the spec")
    _check(
        type(spec).merge_group([spec]) == spec,
        "merge_group([spec]) is not the spec (the spec a one-layer group's "
        "manager runs on)",
    )


def _import_root(cls: type) -> str | None:
    """The folder to put on ``sys.path`` so ``cls``'s module imports (a plugin
    imported from a path that is no longer on ``sys.path``)."""
    module = sys.modules.get(cls.__module__)
    where: object = getattr(module, "__file__", None)
    if not isinstance(where, str):
        return None
    root = os.path.dirname(os.path.abspath(where))
    depth = cls.__module__.count(".") + int(where.endswith("__init__.py"))
    for _ in range(depth):
        root = os.path.dirname(root)
    return root


def _check(ok: bool, rule: str) -> None:
    if not ok:
        raise AssertionError(rule)


def _tensors(view: LayerView) -> tuple[torch.Tensor, ...]:
    return view if isinstance(view, tuple) else (view,)


def two_layer_pool(
    spec: KVCacheSpec, registry: KindRegistry
) -> tuple[KVCacheConfig, KVCachePool]:
    """Two layers of ``spec`` in one group, in a block-outermost layout, four
    blocks."""
    config = EngineConfig(
        cache_config=CacheConfig(
            kv_cache_layout=KVCacheLayout.BLHNC, num_gpu_blocks_override=4
        )
    )
    group = KVCacheGroupSpec(["layer.0", "layer.1"], spec)
    plan = get_kv_cache_config_from_groups(config, [group], 0)
    return plan, KVCachePool(plan, "cpu", registry=registry)
