"""Model files from a Hugging Face ``config.json``: architecture mappers.

A mapper turns a model's configuration into kvcore layer specs, one per
cache-holding layer in model order, for the whole model (one rank's share is
taken afterwards by :func:`kvcore.serving.apply_serving_choices`, the same
code ``kvcore plan --tp`` runs).  Mappers are plugins: a distribution's
``kvcore`` entry point implements ``kvcore_register_model_mappers``, and the
built-in ones live in the ``kvcore_hf`` plugin package, one module per
architecture family.  The first mapper that recognises a configuration and
returns layers wins; later-registered plugins are asked first, so a third
party can replace a built-in mapper for one architecture.
"""

from __future__ import annotations

import math
import re
import socket
import threading
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pluggy
import torch

from kvcore.errors import (
    KvcoreKeyError,
    KvcoreTypeError,
    KvcoreValueError,
    MissingExtraError,
    PluginError,
    SerializationError,
    escape_controls,
)
from kvcore.limits import HUB_CONNECT_TIMEOUT_S, HUB_FETCH_TIMEOUT_S, MAX_NAME_CHARS
from kvcore.registry import KindRegistry
from kvcore.serialize import ModelFile, read_json_file
from kvcore.serving import CACHE_DTYPE_ALIASES, ServingChoices
from kvcore.spec import KVCacheSpec
from kvcore_hf.weights import estimate_weights, tensors

__all__ = [
    "LANGUAGE_MODEL_KEYS",
    "MapperRegistry",
    "ModelConfig",
    "ModelConfigError",
    "ModelMapper",
    "UnknownArchitectureError",
    "fetch_hub_config",
    "is_hub_id",
    "load_hf_config",
    "map_model_config",
    "read_model_config",
]

#: Keys under which composite (multimodal, speech, omni) configurations keep
#: their language model's configuration, tried in this order.
LANGUAGE_MODEL_KEYS = (
    "text_config",
    "llm_config",
    "language_config",
    "language_model_config",
    "thinker_config",
)


class ModelConfigError(KvcoreValueError):
    """A model configuration lacks a field a mapper needs, or holds a bad one."""


class UnknownArchitectureError(KvcoreKeyError):
    """No mapper knows the configuration's architecture."""


_MISSING: Any = object()


class ModelConfig:
    """A parsed ``config.json`` with its language model's part found.

    Mappers read fields through :meth:`field` and :meth:`optional`, so a
    missing or mistyped field is reported with its path in the file and the
    file's name, never as a ``KeyError`` deep in a mapper.

    :param data: the parsed JSON object.
    :param where: the file (or hub id) it came from, for messages.
    """

    def __init__(self, data: Mapping[str, Any], *, where: str = "config.json") -> None:
        given: object = data  # checked: callers pass parsed JSON of any shape
        if not isinstance(given, Mapping):
            msg = f"{where}: a model configuration is a JSON object, got {type(data).__name__}"
            raise ModelConfigError(msg)
        self.root: Mapping[str, Any] = data
        self.where = where
        text, prefix = data, ""
        for _ in range(3):  # composites nest at most a couple of levels
            if "num_hidden_layers" in text or "n_layer" in text:
                break
            inner = next(
                (k for k in LANGUAGE_MODEL_KEYS if isinstance(text.get(k), Mapping)),
                None,
            )
            if inner is None:
                break
            text, prefix = text[inner], f"{prefix}{inner}."
        #: The language model's configuration (the root for plain models).
        self.text: Mapping[str, Any] = text
        #: Where :attr:`text` sits in the file ("" or e.g. ``"text_config."``).
        self.prefix = prefix
        #: The defaults applied for fields the file leaves out, each as
        #: ``"head_dim 256 (Gemma3TextConfig's default)"``, in the order the
        #: mappers applied them; the model file's notes list them.
        self.defaults: list[str] = []

    @property
    def architectures(self) -> tuple[str, ...]:
        """The root's and the language model's ``architectures``."""
        found: list[str] = []
        for part in (self.root, self.text):
            names = part.get("architectures") or ()
            if isinstance(names, str):
                names = (names,)
            if isinstance(names, Sequence):
                found.extend(n for n in names if isinstance(n, str) and n not in found)
        return tuple(found)

    @property
    def model_types(self) -> tuple[str, ...]:
        """The language model's ``model_type``, then the root's."""
        out: list[str] = []
        for part in (self.text, self.root):
            value = part.get("model_type")
            if isinstance(value, str) and value not in out:
                out.append(value)
        return tuple(out)

    @property
    def name(self) -> str:
        """A display name: ``_name_or_path``, else the first architecture."""
        for part in (self.root, self.text):
            value = part.get("_name_or_path")
            if isinstance(value, str) and value:
                # It reaches terminals and file names: printable, bounded.
                return escape_controls(value)[:MAX_NAME_CHARS]
        return next(iter(self.architectures), self.where)

    def has(self, name: str) -> bool:
        """Whether the language model's configuration sets ``name`` (not null)."""
        return self.text.get(name) is not None

    def field(
        self, name: str, kind: type | tuple[type, ...] = int, *, default: Any = _MISSING
    ) -> Any:
        """The language model's field ``name``, checked to be a ``kind``.

        :raises ModelConfigError: naming the field's path and the file when
            it is missing (and no default is given) or of another type.
        """
        value = self.text.get(name)
        if value is None:
            if default is not _MISSING:
                return default
            msg = (
                f"{self.where}: field {self.prefix}{name} is missing; the mapper "
                f"for {self._arch()} needs it"
            )
            raise ModelConfigError(msg)
        return self._checked(name, value, kind)

    def default(self, name: str, value: int, rule: str) -> int:
        """The positive int field ``name``, or ``value`` when the file leaves
        it out: the configuration class's default, recorded with ``rule``
        (where the default comes from) in :attr:`defaults`."""
        if self.has(name):
            return self.positive(name)
        self.note_default(f"{self.prefix}{name} {value} ({rule})")
        return value

    def note_default(self, text: str) -> None:
        """Record one default applied (once)."""
        if text not in self.defaults:
            self.defaults.append(text)

    def optional(self, name: str, kind: type | tuple[type, ...] = int) -> Any:
        """Like :meth:`field`, but ``None`` when the field is absent."""
        return self.field(name, kind, default=None)

    def positive(self, name: str, *, default: Any = _MISSING) -> int:
        """An int field that must be > 0."""
        value: int = self.field(name, int, default=default)
        if value <= 0:
            msg = (
                f"{self.where}: field {self.prefix}{name} must be positive, got {value}"
            )
            raise ModelConfigError(msg)
        return value

    def optional_positive(self, name: str) -> int | None:
        """Like :meth:`positive`, but ``None`` when the field is absent."""
        return self.positive(name) if self.has(name) else None

    def layer_types(self, name: str, count: int) -> list[str]:
        """A per-layer list of strings (``layer_types`` and the like) of
        exactly ``count`` entries."""
        values: list[str] = self.field(name, list)
        if len(values) != count or not all(isinstance(v, str) for v in values):
            msg = (
                f"{self.where}: field {self.prefix}{name} must list {count} strings "
                f"(one per layer), got {len(values)} entries"
            )
            raise ModelConfigError(msg)
        return values

    def _checked(self, name: str, value: Any, kind: type | tuple[type, ...]) -> Any:
        kinds = kind if isinstance(kind, tuple) else (kind,)
        ok = isinstance(value, kinds) and not (
            isinstance(value, bool) and bool not in kinds
        )
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok or (isinstance(value, float) and not math.isfinite(value)):
            want = " or ".join(k.__name__ for k in kinds)
            msg = (
                f"{self.where}: field {self.prefix}{name} must be {want}, got {value!r}"
            )
            raise ModelConfigError(msg)
        return value

    def _arch(self) -> str:
        return ", ".join(self.architectures or self.model_types) or "this model"

    # -- dtypes ----------------------------------------------------------------

    def model_dtype(self) -> torch.dtype:
        """The dtype engines serve the weights in (``torch_dtype``, or
        ``dtype`` in newer files), which they use for the KV cache by
        default; bfloat16 if unset.

        A float32 checkpoint is served in bfloat16: vLLM's ``--dtype auto``
        downcasts float32 configs to the platform's first supported dtype,
        bfloat16 on every GPU that has it (vLLM ``config/model.py``
        ``_resolve_auto_dtype``; ``platforms/cuda.py`` ``supported_dtypes``).
        The default is listed in :attr:`defaults`."""
        for part in (self.text, self.root):
            for key in ("torch_dtype", "dtype"):
                value = part.get(key)
                if isinstance(value, str):
                    dtype = _DTYPES.get(value.lower())
                    if dtype is None:
                        msg = (
                            f"{self.where}: {key} {value!r} is not a dtype kvcore "
                            f"knows; known: {', '.join(sorted(_DTYPES))}"
                        )
                        raise ModelConfigError(msg)
                    if dtype == torch.float32:
                        self.note_default(
                            f"{key} {value} served as bfloat16 (vLLM's --dtype auto "
                            "downcasts float32 checkpoints)"
                        )
                        return torch.bfloat16
                    return dtype
        self.note_default("dtype bfloat16 (the file names none)")
        return torch.bfloat16

    def kv_cache_dtype(self) -> torch.dtype | None:
        """The KV cache dtype the file fixes through its quantization
        settings, or None: ``quantization_config.kv_cache_scheme`` (an 8-bit
        float scheme), ``kv_cache_quant_algo`` / ``kv_cache_dtype`` names."""
        quant = self.root.get("quantization_config")
        sources: list[Mapping[str, Any]] = [self.root]
        if isinstance(quant, Mapping):
            sources.insert(0, quant)
        for part in sources:
            scheme = part.get("kv_cache_scheme")
            if isinstance(scheme, Mapping):
                bits, kind = scheme.get("num_bits"), scheme.get("type")
                if bits == 8 and kind in ("float", None):
                    return torch.float8_e4m3fn
                msg = (
                    f"{self.where}: kv_cache_scheme {dict(scheme)!r} is not a cache "
                    "dtype kvcore knows (8-bit float); pass --kv-cache-dtype"
                )
                raise ModelConfigError(msg)
            for key in ("kv_cache_quant_algo", "kv_cache_dtype"):
                value = part.get(key)
                if isinstance(value, str):
                    dtype = CACHE_DTYPE_ALIASES.get(value.lower(), _MISSING)
                    if dtype is _MISSING:
                        msg = (
                            f"{self.where}: {key} {value!r} is not a cache dtype "
                            f"kvcore knows; known: {', '.join(CACHE_DTYPE_ALIASES)}"
                        )
                        raise ModelConfigError(msg)
                    return dtype  # type: ignore[no-any-return]
        return None


_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "float": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


class ModelMapper:
    """Maps the configurations of one architecture family to layer specs.

    Subclasses set :attr:`name`, the :attr:`architectures` and
    :attr:`model_types` they recognise, :attr:`sources` (the public
    reference of each rule they apply) and implement :meth:`layer_specs`.
    """

    #: The mapper's name, shown in listings and errors.
    name: ClassVar[str]
    #: ``architectures`` entries this mapper recognises.
    architectures: ClassVar[tuple[str, ...]] = ()
    #: ``model_type`` values this mapper recognises.
    model_types: ClassVar[tuple[str, ...]] = ()
    #: Where the rules the mapper applies come from (reference code, papers).
    sources: ClassVar[tuple[str, ...]] = ()
    #: The configuration class's ``max_position_embeddings`` when a file
    #: leaves it out, as ``(class name, tokens)``; None: no length is known.
    max_positions_default: ClassVar[tuple[str, int] | None] = None

    def matches(self, config: ModelConfig) -> bool:
        """Whether this mapper is for ``config`` (by architecture or type)."""
        return bool(
            set(config.architectures) & set(self.architectures)
            or set(config.model_types) & set(self.model_types)
        )

    def layer_specs(
        self, config: ModelConfig, choices: ServingChoices
    ) -> Mapping[str, KVCacheSpec] | None:
        """The whole model's cache layers, in model order, or None to let the
        next mapper answer.  Specs are for one unsharded model (kvcore
        applies tensor parallelism afterwards); ``choices`` is for decisions
        that depend on the engine's settings, such as a block size default.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<model mapper {self.name!r}>"


class MapperRegistry:
    """The model mappers of every plugin, in the order they are asked."""

    def __init__(self, mappers: Sequence[tuple[ModelMapper, str]]) -> None:
        self._mappers = list(mappers)

    @classmethod
    def from_plugin_manager(cls, pm: pluggy.PluginManager) -> MapperRegistry:
        """Collect ``kvcore_register_model_mappers`` from every plugin, later
        registered plugins first (they may replace a built-in mapper)."""
        found: list[tuple[ModelMapper, str]] = []
        hook = pm.hook.kvcore_register_model_mappers
        for impl in reversed(hook.get_hookimpls()):
            plugin = pm.get_name(impl.plugin) or repr(impl.plugin)
            try:
                result = impl.function()
            except Exception as exc:
                who = f"plugin {plugin!r}: kvcore_register_model_mappers"
                raise _raised(who, plugin, exc) from exc
            if result is None:
                continue
            if not isinstance(result, (list, tuple)):
                msg = (
                    f"plugin {plugin!r}: kvcore_register_model_mappers returned "
                    f"{type(result).__name__}; return a list of ModelMapper objects"
                )
                raise PluginError(msg, plugin_name=plugin)
            for mapper in result:
                if not isinstance(mapper, ModelMapper) or not getattr(
                    mapper, "name", None
                ):
                    msg = (
                        f"plugin {plugin!r}: kvcore_register_model_mappers returned "
                        f"{mapper!r}; each entry must be a kvcore_hf.mapping.ModelMapper "
                        "instance with a name"
                    )
                    raise PluginError(msg, plugin_name=plugin)
                found.append((mapper, plugin))
        return cls(found)

    @classmethod
    def from_mappers(cls, mappers: Sequence[ModelMapper]) -> MapperRegistry:
        return cls([(m, "<manual>") for m in mappers])

    def __iter__(self) -> Any:
        return (m for m, _ in self._mappers)

    def __len__(self) -> int:
        return len(self._mappers)

    def owner(self, mapper: ModelMapper) -> str:
        for m, plugin in self._mappers:
            if m is mapper:
                return plugin
        return "<unknown>"

    def known(self) -> str:
        """``architectures`` and ``model_type`` names, for messages."""
        archs = sorted({a for m in self for a in m.architectures})
        types = sorted({t for m in self for t in m.model_types})
        return f"architectures {', '.join(archs)}; model_type {', '.join(types)}"


def _raised(who: str, plugin: str, exc: Exception) -> PluginError:
    """The error for a plugin's code (``who``) that raised ``exc``."""
    msg = f"{who} raised {type(exc).__name__}: {exc}"
    return PluginError(msg, plugin_name=plugin)


def default_mappers() -> MapperRegistry:
    """The mappers of every installed plugin (built-in ones included)."""
    from kvcore.plugins import get_plugin_manager

    return MapperRegistry.from_plugin_manager(get_plugin_manager())


def load_hf_config(source: str | Path) -> ModelConfig:
    """Read a ``config.json`` file, or the one in a directory, as strict JSON
    (the reader model files use: a regular file, UTF-8, no duplicate keys,
    within kvcore's size and nesting limits)."""
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    where = str(path)
    if not path.is_file():
        msg = f"{where}: no such config.json (give a config.json file or a directory holding one)"
        raise ModelConfigError(msg)
    try:
        data = read_json_file(path, what="config.json")
    except SerializationError as exc:
        raise ModelConfigError(str(exc)) from exc
    return ModelConfig(data, where=where)


def map_model_config(
    config: ModelConfig | Mapping[str, Any],
    choices: ServingChoices | None = None,
    *,
    mappers: MapperRegistry | None = None,
    registry: KindRegistry | None = None,
) -> ModelFile:
    """The model file of ``config``: its layers in model order, unsharded,
    in the cache dtype the file fixes (else the weights' dtype).

    :param choices: the engine's settings, passed to the mapper; apply them
        to the result with :func:`kvcore.serving.apply_serving_choices`.
    :param mappers: defaults to every installed plugin's mappers.
    :param registry: the cache kinds the layers must belong to; defaults to
        every installed kind.
    :raises UnknownArchitectureError: no mapper knows the architecture.
    :raises ModelConfigError: a field a mapper needs is missing or wrong.
    """
    if not isinstance(config, ModelConfig):
        config = ModelConfig(config)
    choices = choices if choices is not None else ServingChoices()
    if mappers is None:
        mappers = default_mappers()
    if registry is None:
        from kvcore.registry import default_registry

        registry = default_registry()
    tried: list[str] = []
    for mapper in mappers:
        if not mapper.matches(config):
            continue
        tried.append(mapper.name)
        plugin = mappers.owner(mapper)
        try:
            layers = mapper.layer_specs(config, choices)
        except (KvcoreValueError, KvcoreTypeError):
            raise
        except Exception as exc:
            who = f"{config.where}: model mapper {mapper.name!r} (plugin {plugin!r})"
            raise _raised(who, plugin, exc) from exc
        if layers is None:
            continue
        checked = _checked_layers(layers, mapper, plugin, config, registry)
        return _model_file(config, checked, mapper)
    if tried:
        msg = (
            f"{config.where}: the mappers for {config._arch()} "
            f"({', '.join(tried)}) declined this configuration"
        )
        raise UnknownArchitectureError(msg)
    msg = (
        f"{config.where}: no model mapper knows architecture "
        f"{', '.join(config.architectures) or '(none given)'} / model_type "
        f"{', '.join(config.model_types) or '(none given)'}; known: "
        f"{mappers.known()}. Write a model file by hand (docs/model-files.md) or "
        "install a plugin with a mapper for it"
    )
    raise UnknownArchitectureError(msg)


def _checked_layers(
    layers: object,
    mapper: ModelMapper,
    plugin: str,
    config: ModelConfig,
    registry: KindRegistry,
) -> dict[str, KVCacheSpec]:
    who = f"model mapper {mapper.name!r} (plugin {plugin!r})"
    if not isinstance(layers, Mapping) or not layers:
        msg = (
            f"{who} returned {type(layers).__name__} for {config.where}; a mapper "
            "returns a non-empty mapping of layer name to spec, or None"
        )
        raise PluginError(msg, plugin_name=plugin)
    out: dict[str, KVCacheSpec] = {}
    for name, spec in layers.items():
        if not isinstance(name, str) or not name or not isinstance(spec, KVCacheSpec):
            msg = (
                f"{who} returned layer {name!r}: {spec!r}; layer names are "
                "non-empty strings and specs are KVCacheSpec instances"
            )
            raise PluginError(msg, plugin_name=plugin)
        registry.kind_for(spec, layer=name)
        out[name] = spec
    return out


def _model_file(
    config: ModelConfig, layers: dict[str, KVCacheSpec], mapper: ModelMapper
) -> ModelFile:
    notes = [f"mapped from {config.where} by the {mapper.name} mapper"]
    positions = _max_positions(config, mapper)
    dtype = config.kv_cache_dtype()
    if dtype is not None:
        kept = []
        for name, spec in list(layers.items()):
            new = spec.with_cache_dtype(dtype)
            if new is None:
                kept.append(name)
            else:
                layers[name] = new
        notes.append(
            f"KV cache dtype {str(dtype).removeprefix('torch.')} from the file's "
            "quantization settings"
            + (f" ({len(kept)} layers keep their own)" if kept else "")
        )
    if config.defaults:
        notes.append("defaults applied: " + ", ".join(config.defaults))
    weights = estimate_weights(config)
    if weights is not None:
        notes.append(
            f"weights estimated from the configuration: {weights.params:,} "
            f"parameters, {weights.format}"
        )
    else:
        notes.append(f"weights not estimated: {_no_estimate_reason(config)}")
    return ModelFile(
        name=config.name,
        layers=layers,
        notes="; ".join(notes),
        sources=tuple(mapper.sources),
        weights_bytes=None if weights is None else weights.bytes,
        max_position_embeddings=positions,
    )


def _no_estimate_reason(config: ModelConfig) -> str:
    """Why :func:`~kvcore_hf.weights.estimate_weights` gave no figure: the
    error listing the tensors stopped at (an unknown family, a missing
    shape field)."""
    try:
        tensors(config)
    except (KeyError, ValueError, TypeError) as exc:
        return str(exc.args[0]) if exc.args else type(exc).__name__
    return "unknown"


def _max_positions(config: ModelConfig, mapper: ModelMapper) -> int | None:
    """``max_position_embeddings`` (or a family's own name for it), when it
    is a positive int; when the file gives none, the mapper's class default
    (recorded in :attr:`ModelConfig.defaults`); else no length at all."""
    names = ("max_position_embeddings", "max_sequence_length", "seq_length")
    for name in names:
        value = config.text.get(name)
        if type(value) is int and value > 0:
            return value
    default = mapper.max_positions_default
    if default is None or any(config.has(name) for name in names):
        return None  # an odd value given is no length, not the default
    owner, value = default
    config.note_default(
        f"{config.prefix}max_position_embeddings {value} ({owner}'s default)"
    )
    return value


#: ``org/name`` as the Hugging Face hub spells repository ids.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")


def is_hub_id(text: str) -> bool:
    """Whether ``text`` reads as a hub repository id (``org/name``)."""
    return bool(_HUB_ID.match(text)) and ".." not in text


def _within_deadline(fetch: Callable[[], str], repo_id: str) -> str:
    """``fetch()``, or a :class:`ModelConfigError` once
    :data:`~kvcore.limits.HUB_FETCH_TIMEOUT_S` has passed (a hub that
    trickles or retries forever never holds the command)."""
    done: list[str] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            done.append(fetch())
        except BaseException as exc:  # handed to the caller's thread
            failed.append(exc)

    worker = threading.Thread(target=run, name="kvcore-hub-fetch", daemon=True)
    worker.start()
    worker.join(HUB_FETCH_TIMEOUT_S)
    if failed:
        raise failed[0]
    if not done:
        msg = (
            f"{repo_id}: the hub did not deliver config.json within "
            f"{HUB_FETCH_TIMEOUT_S:g} s; check the network or give --hf-config PATH"
        )
        raise ModelConfigError(msg)
    return done[0]


def _hub_address(endpoint: str) -> tuple[str, int]:
    """The host and port of the hub's endpoint URL."""
    parsed = urllib.parse.urlsplit(endpoint)
    port = parsed.port or (80 if parsed.scheme == "http" else 443)
    return parsed.hostname or "huggingface.co", port


def _check_hub_reachable(hub: Any, repo_id: str, revision: str | None) -> None:
    """Fail at once, with one line, when ``config.json`` is not cached and
    the hub's host cannot be reached within
    :data:`~kvcore.limits.HUB_CONNECT_TIMEOUT_S` (instead of the client's
    retries and warnings until the deadline)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return  # the client answers from its cache, without the network
    try:
        cached = hub.try_to_load_from_cache(repo_id, "config.json", revision=revision)
    except Exception:  # an odd cache is the download's to report
        cached = None
    if isinstance(cached, str):
        return
    host, port = _hub_address(str(constants.ENDPOINT))
    try:
        socket.create_connection((host, port), timeout=HUB_CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        msg = (
            f"{repo_id}: config.json is not in the local hub cache and the hub "
            f"({host}) cannot be reached within {HUB_CONNECT_TIMEOUT_S:g} s "
            f"({type(exc).__name__}: {escape_controls(str(exc))[:120]}); check the "
            "network, or give --hf-config PATH to a config.json"
        )
        raise ModelConfigError(msg) from None


def fetch_hub_config(repo_id: str, *, revision: str | None = None) -> ModelConfig:
    """The ``config.json`` of a hub repository, and nothing else: through
    ``huggingface_hub`` (the optional extra ``kvcore[hf]``), which uses its
    local cache and honours ``HF_HUB_OFFLINE`` and ``HF_TOKEN``."""
    if not is_hub_id(repo_id):
        msg = f"{repo_id!r} is not a hub repository id (org/name)"
        raise ModelConfigError(msg)
    try:
        import huggingface_hub
        from huggingface_hub import errors as hub_errors
    except ImportError:
        msg = (
            f"reading {repo_id} from the Hugging Face hub needs huggingface_hub: "
            "pip install 'kvcore[hf]' (or give --hf-config PATH to a config.json)"
        )
        raise MissingExtraError(msg) from None
    _check_hub_reachable(huggingface_hub, repo_id, revision)
    try:
        path = _within_deadline(
            lambda: huggingface_hub.hf_hub_download(
                repo_id,
                "config.json",
                revision=revision,
                etag_timeout=HUB_FETCH_TIMEOUT_S / 3,
            ),
            repo_id,
        )
    except hub_errors.LocalEntryNotFoundError as exc:
        cache = huggingface_hub.constants.HF_HUB_CACHE
        msg = (
            f"{repo_id}: config.json is not in the local hub cache ({cache}) and "
            "the hub cannot be reached (HF_HUB_OFFLINE is set, or no network); "
            "fetch it once online, or give --hf-config PATH"
        )
        raise ModelConfigError(msg) from exc
    except hub_errors.GatedRepoError as exc:
        msg = (
            f"{repo_id} is gated: accept its terms on the hub and set HF_TOKEN, "
            "or give --hf-config PATH"
        )
        raise ModelConfigError(msg) from exc
    except hub_errors.RepositoryNotFoundError as exc:
        msg = (
            f"{repo_id}: no such repository on the hub (or it is private; set HF_TOKEN)"
        )
        raise ModelConfigError(msg) from exc
    except hub_errors.RevisionNotFoundError as exc:
        msg = f"{repo_id}: no revision {revision!r}"
        raise ModelConfigError(msg) from exc
    except hub_errors.EntryNotFoundError as exc:
        msg = f"{repo_id} has no config.json; it is not a transformers model"
        raise ModelConfigError(msg) from exc
    except ModelConfigError:
        raise
    except Exception as exc:  # the hub's client raises many kinds; name it
        msg = (
            f"{repo_id}: cannot fetch config.json ({type(exc).__name__}: "
            f"{escape_controls(str(exc))[:300]})"
        )
        raise ModelConfigError(msg) from exc
    config = load_hf_config(path)
    config.where = f"{repo_id} (config.json)"
    return config


def read_model_config(source: str) -> ModelConfig:
    """A ``config.json`` file, a directory holding one, or a hub id."""
    path = Path(source)
    if path.exists() or not is_hub_id(source):
        return load_hf_config(path)
    return fetch_hub_config(source)
