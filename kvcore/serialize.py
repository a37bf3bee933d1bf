"""JSON for specs, groups, tensors and whole configs.

The converter is built from a kind registry after plugins load, so a
third-party kind round-trips like a built-in one.  A spec is a JSON object
whose ``kind`` names its cache kind; every other key is a constructor
keyword; dtypes are torch dtype names (``"bfloat16"``), and on reading also
the cache dtype aliases engines take (``"fp8"``, ``"bf16"``).  This JSON is
what a scheduler ships to its workers, and what model files (``zoo/*.json``)
use.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import cattrs
import torch
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn

from kvcore.errors import KvcoreError, SerializationError, UnknownKindError
from kvcore.layout import KVCacheLayout
from kvcore.registry import KindRegistry, default_registry
from kvcore.serving import CACHE_DTYPE_ALIASES
from kvcore.spec import KVCacheSpec, UniformTypeKVCacheSpecs
from kvcore.structs import KVCacheConfig, KVCacheGroupSpec

__all__ = [
    "ModelFile",
    "SpecConverter",
    "dump_config",
    "dump_model_file",
    "load_config",
    "load_model_file",
    "make_converter",
]

UNIFORM_TAG = "uniform_type"


def _dtype_from_name(value: Any, _: Any) -> torch.dtype:
    """A torch dtype name (``"bfloat16"``, ``"torch.uint8"``) or a cache dtype
    alias engines use (``"fp8"``, ``"bf16"``); ``auto`` names no dtype."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        alias = CACHE_DTYPE_ALIASES.get(value.strip().lower())
        if alias is not None:
            return alias
        dtype = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(dtype, torch.dtype):
            return dtype
    aliases = ", ".join(k for k, v in CACHE_DTYPE_ALIASES.items() if v is not None)
    msg = (
        f"{value!r} is not a torch dtype name (e.g. 'bfloat16', 'uint8') or a "
        f"cache dtype alias ({aliases})"
    )
    raise ValueError(msg)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _strict(kind: type) -> Any:
    """A structure hook that takes values of exactly ``kind`` (cattrs would
    otherwise turn ``"false"`` into ``True`` and ``2.5`` into ``2``)."""

    def hook(value: Any, _: Any) -> Any:
        if type(value) is not kind:
            msg = f"expected {kind.__name__}, got {value!r} ({type(value).__name__})"
            raise ValueError(msg)
        return value

    return hook


def _format_exception(exc: BaseException, type_: Any) -> str:
    if isinstance(exc, KeyError):
        return f"required field missing ({exc})"
    if isinstance(exc, cattrs.ForbiddenExtraKeysError):
        return f"unknown field(s) {sorted(exc.extra_fields)}"
    if isinstance(exc, ValueError | TypeError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


class SpecConverter:
    """Structures and unstructures kvcore's plan objects for one registry."""

    def __init__(self, registry: KindRegistry) -> None:
        self.registry = registry
        c = cattrs.Converter(forbid_extra_keys=True)
        for kind in (int, bool, str):
            c.register_structure_hook(kind, _strict(kind))
        c.register_structure_hook(torch.dtype, _dtype_from_name)
        c.register_unstructure_hook(torch.dtype, _dtype_name)
        c.register_structure_hook(
            KVCacheLayout, lambda v, _: KVCacheLayout.from_name(v)
        )
        c.register_unstructure_hook(KVCacheLayout, lambda v: v.name)
        for spec_type in registry.spec_types:
            c.register_unstructure_hook(
                spec_type,
                make_dict_unstructure_fn(spec_type, c, _cattrs_omit_if_default=True),
            )
            c.register_structure_hook(
                spec_type,
                make_dict_structure_fn(spec_type, c, _cattrs_forbid_extra_keys=True),
            )
        c.register_structure_hook_func(
            lambda t: t is KVCacheSpec, lambda d, _: self.structure_spec(d)
        )
        c.register_unstructure_hook_func(
            lambda t: t is KVCacheSpec, self.unstructure_spec
        )
        group_spec = KVCacheSpec | UniformTypeKVCacheSpecs
        c.register_structure_hook(
            group_spec, lambda d, _: self._structure_group_spec(d)
        )
        c.register_structure_hook(
            UniformTypeKVCacheSpecs, lambda d, _: self._structure_group_spec(d)
        )
        c.register_unstructure_hook(UniformTypeKVCacheSpecs, self._unstructure_uniform)
        c.register_structure_hook(
            KVCacheGroupSpec,
            lambda d, _: KVCacheGroupSpec(
                d["layer_names"], self._structure_group_spec(d["kv_cache_spec"])
            ),
        )
        c.register_unstructure_hook(
            KVCacheGroupSpec,
            lambda g: {
                "layer_names": list(g.layer_names),
                "kv_cache_spec": self._unstructure_group_spec(g.kv_cache_spec),
            },
        )
        self._c = c

    # -- specs ----------------------------------------------------------------
    def structure_spec(self, data: Any, *, where: str = "$") -> KVCacheSpec:
        """A spec from its JSON object (``kind`` plus constructor keywords)."""
        if isinstance(data, KVCacheSpec):
            return data
        if not isinstance(data, Mapping) or "kind" not in data:
            msg = (
                f"a cache spec at {where} must be a JSON object with a 'kind' key "
                f"(one of {', '.join(sorted(self.registry))}), got {data!r}"
            )
            raise SerializationError(msg)
        fields = dict(data)
        name = fields.pop("kind")
        if not isinstance(name, str):
            msg = f"the 'kind' of the spec at {where} must be a string, got {name!r}"
            raise SerializationError(msg)
        try:
            spec_type = self.registry[name].spec_type
        except UnknownKindError as exc:
            msg = f"{exc} (at {where})"
            raise UnknownKindError(msg, kind=str(name)) from None
        try:
            return self._c.structure(fields, spec_type)
        except cattrs.BaseValidationError as exc:
            errors = cattrs.transform_error(
                exc, path=where, format_exception=_format_exception
            )
            msg = f"invalid {name!r} spec: " + "; ".join(errors)
            raise SerializationError(msg) from exc
        except (ValueError, TypeError) as exc:
            msg = f"invalid {name!r} spec at {where}: {exc}"
            raise SerializationError(msg) from exc

    def unstructure_spec(self, spec: KVCacheSpec) -> dict[str, Any]:
        """A spec's JSON object: ``kind`` first, then non-default fields."""
        self.registry.kind_for(spec)
        body = self._c.unstructure(spec, unstructure_as=type(spec))
        return {"kind": type(spec).kind, **body}

    def _structure_group_spec(self, data: Any) -> KVCacheSpec | UniformTypeKVCacheSpecs:
        if isinstance(data, Mapping) and data.get("kind") == UNIFORM_TAG:
            unknown = set(data) - {"kind", "block_size", "kv_cache_specs"}
            if unknown:
                msg = (
                    f"unknown field(s) {sorted(unknown)} in a {UNIFORM_TAG} group spec"
                )
                raise SerializationError(msg)
            members = {
                name: self.structure_spec(spec, where=f"$.kv_cache_specs.{name}")
                for name, spec in data["kv_cache_specs"].items()
            }
            return UniformTypeKVCacheSpecs(
                block_size=data["block_size"], kv_cache_specs=members
            )
        return self.structure_spec(data)

    def _unstructure_uniform(self, spec: UniformTypeKVCacheSpecs) -> dict[str, Any]:
        return {
            "kind": UNIFORM_TAG,
            "block_size": spec.block_size,
            "kv_cache_specs": {
                name: self.unstructure_spec(member)
                for name, member in spec.kv_cache_specs.items()
            },
        }

    def _unstructure_group_spec(
        self, spec: KVCacheSpec | UniformTypeKVCacheSpecs
    ) -> dict[str, Any]:
        if isinstance(spec, UniformTypeKVCacheSpecs):
            return self._unstructure_uniform(spec)
        return self.unstructure_spec(spec)

    # -- anything -------------------------------------------------------------
    def unstructure(self, obj: Any) -> Any:
        """JSON-ready data for a spec, group spec, group, tensor or config."""
        if isinstance(obj, KVCacheSpec):
            return self.unstructure_spec(obj)
        if isinstance(obj, UniformTypeKVCacheSpecs):
            return self._unstructure_uniform(obj)
        return self._c.unstructure(obj)

    def structure(self, data: Any, cls: type[Any]) -> Any:
        """The inverse of :meth:`unstructure` for ``cls``."""
        if issubclass(cls, KVCacheSpec):
            spec = self.structure_spec(data)
            if not isinstance(spec, cls):
                msg = f"expected a {cls.__name__}, the JSON describes a {type(spec).__name__}"
                raise SerializationError(msg)
            return spec
        try:
            return self._c.structure(data, cls)
        except cattrs.BaseValidationError as exc:
            errors = cattrs.transform_error(exc, format_exception=_format_exception)
            msg = f"invalid {getattr(cls, '__name__', cls)}: " + "; ".join(errors)
            raise SerializationError(msg) from exc
        except (KeyError, TypeError, KvcoreError) as exc:
            msg = f"invalid {getattr(cls, '__name__', cls)}: {exc}"
            raise SerializationError(msg) from exc


def make_converter(registry: KindRegistry | None = None) -> SpecConverter:
    """A converter for ``registry`` (default: :func:`kvcore.default_registry`)."""
    return SpecConverter(registry if registry is not None else default_registry())


def dump_config(config: KVCacheConfig, registry: KindRegistry | None = None) -> str:
    """A config as a JSON string, as a scheduler ships it to workers."""
    return json.dumps(make_converter(registry).unstructure(config), indent=1)


def load_config(text: str, registry: KindRegistry | None = None) -> KVCacheConfig:
    """The inverse of :func:`dump_config`."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        msg = f"a KV cache config must be JSON: {exc}"
        raise SerializationError(msg) from exc
    if not isinstance(data, dict):
        msg = f"a KV cache config must be a JSON object, got {type(data).__name__}"
        raise SerializationError(msg)
    config: KVCacheConfig = make_converter(registry).structure(data, KVCacheConfig)
    return config


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


def load_model_file(
    source: str | Path | Mapping[str, Any],
    registry: KindRegistry | None = None,
    *,
    where: str | None = None,
) -> ModelFile:
    """Read a model file: ``{"name": ..., "layers": {layer: spec, ...}}``.

    :param where: what errors call a mapping ``source`` (its file's path).
    """
    if isinstance(source, Mapping):
        data: Any = source
        where = where or "model file"
    else:
        path = Path(source)
        where = str(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            msg = f"cannot read model file {where}: {exc}"
            raise SerializationError(msg) from exc
    if not isinstance(data, Mapping) or not isinstance(data.get("layers"), Mapping):
        msg = (
            f"{where} must be a JSON object with a 'layers' object (layer name -> spec)"
        )
        raise SerializationError(msg)
    unknown = set(data) - {"name", "notes", "sources", "layers", "weights_bytes"}
    if unknown:
        msg = f"{where}: unknown top-level key(s) {sorted(unknown)}"
        raise SerializationError(msg)
    weights = data.get("weights_bytes")
    if weights is not None and (type(weights) is not int or weights < 0):
        msg = (
            f"{where}: weights_bytes must be a non-negative int of bytes, "
            f"got {weights!r}"
        )
        raise SerializationError(msg)
    sources = data.get("sources", [])
    if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
        msg = f"{where}: 'sources' must be a list of strings"
        raise SerializationError(msg)
    converter = make_converter(registry)
    layers = {
        name: converter.structure_spec(spec, where=f"{where}: layers.{name}")
        for name, spec in data["layers"].items()
    }
    if not layers:
        msg = f"{where} lists no layers"
        raise SerializationError(msg)
    return ModelFile(
        name=str(data.get("name", where)),
        layers=layers,
        notes=str(data.get("notes", "")),
        sources=tuple(sources),
        weights_bytes=weights,
    )


def dump_model_file(model: ModelFile, registry: KindRegistry | None = None) -> str:
    """A model file as JSON text, in the form :func:`load_model_file` reads
    (layers in model order, one spec object each)."""
    converter = make_converter(registry)
    data: dict[str, Any] = {"name": model.name}
    if model.notes:
        data["notes"] = model.notes
    if model.sources:
        data["sources"] = list(model.sources)
    if model.weights_bytes is not None:
        data["weights_bytes"] = model.weights_bytes
    data["layers"] = {
        name: converter.unstructure_spec(spec) for name, spec in model.layers.items()
    }
    return json.dumps(data, indent=1) + "\n"
