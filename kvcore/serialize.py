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
import math
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import cattrs
import torch
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn

from kvcore.errors import (
    KvcoreError,
    KvcoreTypeError,
    SerializationError,
    UnknownKindError,
    echo,
    escape_controls,
    require_instance,
)
from kvcore.layout import KVCacheLayout
from kvcore.limits import (
    MAX_JSON_DEPTH,
    MAX_JSON_FILE_BYTES,
    MAX_JSON_INT_DIGITS,
    MAX_NAME_CHARS,
)
from kvcore.plan.validate import _printable_name, check_config
from kvcore.registry import KindRegistry, default_registry
from kvcore.serving import CACHE_DTYPE_ALIASES
from kvcore.spec import CACHE_ELEMENT_DTYPES, KVCacheSpec, UniformTypeKVCacheSpecs
from kvcore.structs import KVCacheConfig, KVCacheGroupSpec, ModelFile

__all__ = [
    "ModelFile",
    "SpecConverter",
    "check_config",
    "config_from_data",
    "dump_config",
    "dump_model_file",
    "load_config",
    "load_model_file",
    "make_converter",
    "parse_json",
    "read_json_file",
]

UNIFORM_TAG = "uniform_type"


def _dtype_from_name(value: Any, _: Any) -> torch.dtype:
    """A torch dtype name (``"bfloat16"``, ``"torch.uint8"``) or a cache dtype
    alias engines use (``"fp8"``, ``"bf16"``); ``auto`` names no dtype.

    Names come from fixed tables (:data:`kvcore.spec.CACHE_ELEMENT_DTYPES`
    and :data:`kvcore.serving.CACHE_DTYPE_ALIASES`), never from attributes
    of the torch module: ``"_dynamo"`` must not import a compiler."""
    if isinstance(value, torch.dtype):
        return value
    aliases = ", ".join(k for k, v in CACHE_DTYPE_ALIASES.items() if v is not None)
    if isinstance(value, str):
        alias = CACHE_DTYPE_ALIASES.get(value.strip().lower())
        if alias is not None:
            return alias
        name = value.strip().removeprefix("torch.")
        dtype = CACHE_ELEMENT_DTYPES.get(name)
        if dtype is not None:
            return dtype
        if name == "bool" or name.startswith(("complex", "cfloat", "cdouble", "chalf")):
            msg = (
                f"{echo(value)} is not a cache element type (bool and complex dtypes "
                f"are refused); use one of {', '.join(CACHE_ELEMENT_DTYPES)} or a "
                f"cache dtype alias ({aliases})"
            )
            raise ValueError(msg)
    msg = (
        f"{echo(value)} is not a torch dtype name (e.g. 'bfloat16', 'uint8') or a "
        f"cache dtype alias ({aliases}); known dtype names: "
        f"{', '.join(CACHE_ELEMENT_DTYPES)}"
    )
    raise ValueError(msg)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _strict(kind: type) -> Any:
    """A structure hook that takes values of exactly ``kind`` (cattrs would
    otherwise turn ``"false"`` into ``True`` and ``2.5`` into ``2``).  An int
    obeys the JSON reader's digit limit, so a spec read from a mapping can
    only hold what its plan's JSON can be read back with."""

    def hook(value: Any, _: Any) -> Any:
        if type(value) is not kind:
            msg = (
                f"expected {kind.__name__}, got {echo(value)} ({type(value).__name__})"
            )
            raise ValueError(msg)
        if isinstance(value, int) and abs(value) >= 10**MAX_JSON_INT_DIGITS:
            msg = (
                f"an integer of more than {MAX_JSON_INT_DIGITS} digits is longer "
                "than kvcore reads; write the real value"
            )
            raise ValueError(msg)
        return value

    return hook


def _format_exception(exc: BaseException, type_: Any) -> str:
    if isinstance(exc, KeyError):
        return f"required field missing ({exc})"
    if isinstance(exc, cattrs.ForbiddenExtraKeysError):
        return f"unknown field(s) {echo(sorted(exc.extra_fields))}"
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
                f"(one of {', '.join(sorted(self.registry))}), got {echo(data)}"
            )
            raise SerializationError(msg)
        fields = dict(data)
        name = fields.pop("kind")
        if not isinstance(name, str):
            msg = (
                f"the 'kind' of the spec at {where} must be a string, got {echo(name)}"
            )
            raise SerializationError(msg)
        if len(name) > MAX_NAME_CHARS or not name.isprintable():
            msg = (
                f"no cache kind named {echo(name)} (at {where}); a kind name is "
                f"printable and at most {MAX_NAME_CHARS} characters, one of "
                f"{', '.join(sorted(self.registry))}"
            )
            raise UnknownKindError(msg, kind=name)
        try:
            spec_type = self.registry[name].spec_type
        except UnknownKindError as exc:
            msg = f"{exc} (at {where})"
            raise UnknownKindError(msg, kind=name) from None
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
    require_instance(config, KVCacheConfig, "dump_config: config")
    return json.dumps(make_converter(registry).unstructure(config), indent=1)


# -- strict JSON ------------------------------------------------------------


class _Refused(Exception):
    """Raised from a json hook; :func:`parse_json` adds where it was."""


class _Duplicated(dict[str, Any]):
    """A JSON object that named ``duplicate`` twice (always refused)."""

    duplicate: str


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    seen: set[str] = set()
    marked = _Duplicated(obj)
    for key, _ in pairs:
        if key in seen:
            marked.duplicate = key
            break
        seen.add(key)
    return marked


def _constant(name: str) -> Any:
    msg = f"{name} is not a JSON number (JSON has no NaN or Infinity); write a finite number"
    raise _Refused(msg)


def _int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_JSON_INT_DIGITS:
        msg = (
            f"an integer literal of {digits} digits ({echo(text, 40)}) is longer than "
            f"the {MAX_JSON_INT_DIGITS} digits kvcore reads; write the real value"
        )
        raise _Refused(msg)
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        msg = f"the number {echo(text, 40)} overflows a float; write a finite number"
        raise _Refused(msg)
    return value


def _member(path: str, key: object) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    text = str(key)
    if text.isidentifier():
        return f"{path}.{text}"
    return f"{path}[{escape_controls(json.dumps(text))}]"


def _check_tree(data: Any, where: str) -> None:
    """Refuse duplicate keys (naming the key and the JSON path of its object)
    and nesting deeper than :data:`~kvcore.limits.MAX_JSON_DEPTH`, walking
    without recursion."""
    stack: list[tuple[Any, str, int]] = [(data, "$", 1)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, dict):
            children: list[tuple[object, Any]] = list(node.items())
        elif isinstance(node, list):
            children = list(enumerate(node))
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            msg = (
                f"{where}: the JSON at {path} is nested deeper than "
                f"{MAX_JSON_DEPTH} levels (MAX_JSON_DEPTH); kvcore files nest a "
                "few levels, check the file"
            )
            raise SerializationError(msg)
        if isinstance(node, _Duplicated):
            msg = (
                f"{where}: key {echo(node.duplicate)} appears twice in the object "
                f"at {path}; JSON keys must be unique (kvcore does not pick one), "
                "remove or rename one"
            )
            raise SerializationError(msg)
        for key, child in reversed(children):
            if isinstance(child, dict | list):
                stack.append((child, _member(path, key), depth + 1))


def parse_json(text: str, *, where: str) -> Any:
    """``text`` as strict JSON: duplicate keys, NaN and Infinity, integer
    literals past :data:`~kvcore.limits.MAX_JSON_INT_DIGITS` digits, numbers
    that overflow a float and nesting past
    :data:`~kvcore.limits.MAX_JSON_DEPTH` are refused with a
    :class:`~kvcore.errors.SerializationError` naming ``where``."""
    try:
        data = json.loads(
            text,
            object_pairs_hook=_object,
            parse_constant=_constant,
            parse_int=_int,
            parse_float=_float,
        )
    except _Refused as exc:
        msg = f"{where} is not valid JSON: {exc}"
        raise SerializationError(msg) from None
    except RecursionError:
        msg = (
            f"{where}: the JSON is nested deeper than {MAX_JSON_DEPTH} levels "
            "(MAX_JSON_DEPTH); kvcore files nest a few levels, check the file"
        )
        raise SerializationError(msg) from None
    except (json.JSONDecodeError, ValueError) as exc:
        msg = f"{where} is not valid JSON: {escape_controls(str(exc))}"
        raise SerializationError(msg) from None
    _check_tree(data, where)
    return data


_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def read_json_file(source: object, *, what: str = "model file") -> Any:
    """Read a regular file of at most :data:`~kvcore.limits.MAX_JSON_FILE_BYTES`
    bytes of UTF-8 as strict JSON (see :func:`parse_json`).

    The file is opened without blocking and checked with ``fstat`` before a
    byte is read, so a FIFO, ``/dev/zero`` or a directory is refused at once
    rather than hanging or filling memory."""
    if not isinstance(source, str | os.PathLike):
        msg = (
            f"a {what} is read from a path (str or pathlib.Path), got "
            f"{type(source).__name__} {echo(source)}"
        )
        raise KvcoreTypeError(msg)
    path = os.fspath(source)
    if not isinstance(path, str):
        msg = f"a {what} path must be text, got {echo(path)}"
        raise KvcoreTypeError(msg)
    shown = escape_controls(path)
    if "\x00" in path:
        msg = f"the {what} path {echo(path)} holds a NUL byte; give a file path"
        raise SerializationError(msg)
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        msg = f"cannot read {what} {shown}: {exc.strerror or exc}"
        raise SerializationError(msg) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            msg = f"{shown} is a directory; give a {what} inside it (a .json file)"
        else:
            msg = (
                f"{shown} is not a regular file (a FIFO, device or socket); give a "
                f"{what} (a .json file)"
            )
        raise SerializationError(msg)
    with os.fdopen(fd, "rb") as file:
        raw = file.read(MAX_JSON_FILE_BYTES + 1)
    if len(raw) > MAX_JSON_FILE_BYTES:
        msg = (
            f"{shown} is larger than {MAX_JSON_FILE_BYTES // 2**20} MiB "
            f"(MAX_JSON_FILE_BYTES); a {what} is a few KiB, check the file"
        )
        raise SerializationError(msg)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        msg = (
            f"{shown} is not UTF-8 text (byte {exc.start} is {raw[exc.start]:#04x}); "
            f"a {what} is UTF-8 JSON: re-save it as UTF-8"
        )
        raise SerializationError(msg) from None
    nul = text.find("\x00")
    if nul >= 0:
        msg = (
            f"{shown} holds a NUL byte at byte {raw.index(0)} (a binary or UTF-16 "
            f"file); a {what} is UTF-8 JSON: re-save it as UTF-8"
        )
        raise SerializationError(msg)
    return parse_json(text, where=shown)


def load_config(text: str, registry: KindRegistry | None = None) -> KVCacheConfig:
    """The inverse of :func:`dump_config`: strict JSON, checked as strictly
    as the planner checks its own plans (see :func:`check_config`) before
    anything is allocated from it."""
    raw: object = text
    if not isinstance(raw, str):
        msg = f"load_config takes the config's JSON text, got {type(raw).__name__}"
        raise KvcoreTypeError(msg)
    data = parse_json(text, where="the KV cache config")
    return config_from_data(data, registry)


def config_from_data(
    data: object, registry: KindRegistry | None = None, *, where: str = ""
) -> KVCacheConfig:
    """A config from its parsed JSON, checked as :func:`load_config` checks
    one: every way a plan enters a process (a file, a shipped pipeline plan,
    another rank's record) comes through here.  ``where`` prefixes errors
    (``"stage 1: "``)."""
    if not isinstance(data, dict):
        msg = (
            f"{where}a KV cache config must be a JSON object, got {type(data).__name__}"
        )
        raise SerializationError(msg)
    try:
        config: KVCacheConfig = make_converter(registry).structure(data, KVCacheConfig)
        check_config(config)
    except SerializationError as exc:
        if not where:
            raise
        msg = f"{where}{exc}"
        raise type(exc)(msg) from exc
    return config


#: A model file's optional counts: key, least value, and what it must be.
_OPTIONAL_COUNTS = (
    ("weights_bytes", 0, "a non-negative int of bytes"),
    ("max_position_embeddings", 1, "a positive int of tokens"),
)


def load_model_file(
    source: str | os.PathLike[str] | Mapping[str, Any],
    registry: KindRegistry | None = None,
    *,
    where: str | None = None,
) -> ModelFile:
    """Read a model file: ``{"name": ..., "layers": {layer: spec, ...}}``.

    A path is read with :func:`read_json_file` (strict JSON, size and
    nesting limits); ``name`` defaults to the file's stem.

    :param where: what errors call a mapping ``source`` (its file's path).
    """
    if isinstance(source, Mapping):
        data: Any = source
        where = where or "model file"
        default_name = where
    else:
        data = read_json_file(source, what="model file")
        path = os.fspath(source)
        where = escape_controls(str(path))
        default_name = Path(path).stem
    if not isinstance(data, Mapping):
        msg = (
            f"{where} holds a JSON {type(data).__name__}; a model file is a JSON "
            "object with a 'layers' object (layer name -> spec)"
        )
        raise SerializationError(msg)
    if not isinstance(data.get("layers"), Mapping):
        msg = (
            f"{where} must be a JSON object with a 'layers' object (layer name -> spec)"
        )
        raise SerializationError(msg)
    unknown = set(data) - {
        "name",
        "notes",
        "sources",
        "layers",
        "weights_bytes",
        "max_position_embeddings",
    }
    if unknown:
        msg = f"{where}: unknown top-level key(s) {echo(sorted(unknown))}"
        raise SerializationError(msg)
    name = (
        _printable_name(data["name"], "the model 'name'", where)
        if "name" in data
        else default_name
    )
    for key, least, what in _OPTIONAL_COUNTS:
        value = data.get(key)
        if value is not None and (type(value) is not int or value < least):
            msg = f"{where}: {key} must be {what}, got {echo(value)}"
            raise SerializationError(msg)
    notes = data.get("notes", "")
    if type(notes) is not str:
        msg = f"{where}: 'notes' must be a string, got {echo(notes)}"
        raise SerializationError(msg)
    sources = data.get("sources", [])
    if not isinstance(sources, list) or not all(type(s) is str for s in sources):
        msg = f"{where}: 'sources' must be a list of strings"
        raise SerializationError(msg)
    converter = make_converter(registry)
    layers = {}
    for layer, spec in data["layers"].items():
        _printable_name(layer, "a layer name", f"{where}: layers")
        layers[layer] = converter.structure_spec(spec, where=f"{where}: layers.{layer}")
    if not layers:
        msg = f"{where} lists no layers"
        raise SerializationError(msg)
    return ModelFile(
        name=name,
        layers=layers,
        notes=notes,
        sources=tuple(sources),
        weights_bytes=data.get("weights_bytes"),
        max_position_embeddings=data.get("max_position_embeddings"),
    )


def dump_model_file(model: ModelFile, registry: KindRegistry | None = None) -> str:
    """A model file as JSON text, in the form :func:`load_model_file` reads
    (layers in model order, one spec object each)."""
    require_instance(model, ModelFile, "dump_model_file: model")
    converter = make_converter(registry)
    data: dict[str, Any] = {"name": model.name}
    if model.notes:
        data["notes"] = model.notes
    if model.sources:
        data["sources"] = list(model.sources)
    for key, _, _ in _OPTIONAL_COUNTS:
        if getattr(model, key) is not None:
            data[key] = getattr(model, key)
    data["layers"] = {
        name: converter.unstructure_spec(spec) for name, spec in model.layers.items()
    }
    return json.dumps(data, indent=1) + "\n"
