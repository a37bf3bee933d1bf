"""Serving choices: what an engine changes in a model file's layers.

A model file describes each layer as the model defines it, at tensor-parallel
size 1.  An engine then applies its own settings before planning: the KV
cache dtype (``--kv-cache-dtype``), the tensor-parallel size (``--tp``) and
the block size (``--block-size``).  :func:`apply_serving_choices` turns the
file's specs into one rank's specs and says, in notes a person reads, what
changed and what did not.  It names no kind: each spec answers for itself
through :meth:`~kvcore.spec.KVCacheSpec.with_cache_dtype`,
:meth:`~kvcore.spec.KVCacheSpec.with_block_size` and
:meth:`~kvcore.spec.KVCacheSpec.sharded`, each answer checked as it is
received (``None`` or a spec of the same class and the block size asked for,
or the one it had).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import attrs
import torch

from kvcore.checkpoints import CheckpointPolicyError, checkpoint_policy
from kvcore.choices import CACHE_DTYPE_NAMES, STATE_CACHE_MODES
from kvcore.errors import InvalidSpecError, KvcoreTypeError, KvcoreValueError, echo
from kvcore.owners import call_plugin, spec_plugin_error
from kvcore.plan.declarations import checked_variant
from kvcore.spec import KVCacheSpec, Sharded

__all__ = [
    "CACHE_DTYPE_ALIASES",
    "ServedLayers",
    "ServingChoices",
    "ServingError",
    "apply_serving_choices",
    "cache_dtype_name",
    "parse_cache_dtype",
]


class ServingError(KvcoreValueError):
    """A serving choice is unknown or cannot apply to one of the layers."""


#: Every ``--kv-cache-dtype`` name kvcore accepts (lower case) and its torch
#: dtype; ``auto`` (``None``) keeps the model file's dtypes (the names are
#: :data:`kvcore.choices.CACHE_DTYPE_NAMES`).
CACHE_DTYPE_ALIASES: Mapping[str, torch.dtype | None] = MappingProxyType(
    {
        name: None if dtype is None else getattr(torch, dtype)
        for name, dtype in CACHE_DTYPE_NAMES.items()
    }
)

_CACHE_DTYPES = frozenset(d for d in CACHE_DTYPE_ALIASES.values() if d is not None)

#: Names engines take that are a packed layout rather than a dtype.
_PACKED_FORMATS = {
    "fp8_ds_mla": (
        "DeepSeek's fp8_ds_mla is a packed record (fp8 values, fp32 scales and "
        "a bf16 RoPE part), not a dtype; describe it in the model file as a "
        "uint8 cache of its record size (656 bytes a token for V3.2)"
    ),
}


def parse_cache_dtype(name: str) -> torch.dtype | None:
    """The torch dtype an engine's ``--kv-cache-dtype`` name selects, or
    ``None`` for ``auto`` (keep the model file's dtypes); case-insensitive."""
    raw: object = name  # checked: the CLI and config mappers pass anything
    if not isinstance(raw, str):
        msg = f"a KV cache dtype name must be a string, got {raw!r}"
        raise ServingError(msg)
    key = raw.strip().lower()
    if key in CACHE_DTYPE_ALIASES:
        return CACHE_DTYPE_ALIASES[key]
    hint = _PACKED_FORMATS.get(key)
    msg = (
        f"unknown KV cache dtype {name!r}; "
        + (f"{hint}; " if hint else "")
        + f"use one of: {', '.join(CACHE_DTYPE_ALIASES)}"
    )
    raise ServingError(msg)


def cache_dtype_name(dtype: torch.dtype) -> str:
    """A dtype's canonical torch name (``"float8_e4m3fn"``)."""
    return str(dtype).removeprefix("torch.")


def _cache_dtype(value: Any) -> torch.dtype | None:
    if value is None:
        return None
    if isinstance(value, str):
        return parse_cache_dtype(value)
    if isinstance(value, torch.dtype) and value in _CACHE_DTYPES:
        return value
    names = sorted({cache_dtype_name(d) for d in _CACHE_DTYPES})
    msg = (
        f"ServingChoices.kv_cache_dtype must be None, a cache dtype name or one "
        f"of the torch dtypes {', '.join(names)}, got {value!r}"
    )
    raise ServingError(msg)


def _positive(
    optional: bool,
) -> Callable[[object, attrs.Attribute[Any], Any], None]:
    def check(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if optional and value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            msg = (
                f"ServingChoices.{attribute.name} must be a positive int"
                f"{' or None' if optional else ''}, got {value!r}"
            )
            raise ServingError(msg)

    return check


@attrs.frozen(kw_only=True)
class ServingChoices:
    """The settings an engine applies to a model file's layers.

    :param kv_cache_dtype: the cache dtype (a torch dtype or a name from
        :data:`CACHE_DTYPE_ALIASES`); ``None`` keeps the file's dtypes.
    :param tensor_parallel_size: ranks the model's heads and channels split
        across; the result is one rank's layers.
    :param block_size: tokens per block of every paged kind; ``None`` keeps
        the file's block sizes.
    :param mamba_cache_mode: the recurrent-state caching mode (``none``,
        ``align``, ``all``) of every state kind; ``None`` keeps the file's.
    :param checkpoint_policy: which states every state kind keeps for later
        requests (a name of ``kvcore.coordinator.CHECKPOINT_POLICIES``);
        ``None`` keeps the file's.
    :param mamba_ssm_cache_dtype: the dtype of every state kind's recurrent
        (SSM) state (vLLM's ``--mamba-ssm-cache-dtype``: a torch dtype or a
        name from :data:`CACHE_DTYPE_ALIASES`); ``None`` keeps the file's.
    """

    kv_cache_dtype: torch.dtype | None = attrs.field(
        default=None, converter=_cache_dtype
    )
    tensor_parallel_size: int = attrs.field(default=1, validator=_positive(False))
    block_size: int | None = attrs.field(default=None, validator=_positive(True))
    mamba_cache_mode: str | None = attrs.field(default=None)
    checkpoint_policy: str | None = attrs.field(default=None)
    mamba_ssm_cache_dtype: torch.dtype | None = attrs.field(
        default=None, converter=_cache_dtype
    )

    @checkpoint_policy.validator
    def _check_policy(self, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None:
            return
        try:
            checkpoint_policy(value)
        except CheckpointPolicyError as exc:
            msg = f"{exc} (or None to keep the model file's)"
            raise ServingError(msg) from None

    @mamba_cache_mode.validator
    def _check_mode(self, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and value not in STATE_CACHE_MODES:
            msg = (
                f"mamba_cache_mode must be one of {', '.join(STATE_CACHE_MODES)} "
                f"(or None to keep the model file's), got {value!r}"
            )
            raise ServingError(msg)


@attrs.frozen(kw_only=True)
class ServedLayers:
    """One rank's layers after the serving choices, and what changed.

    :param layers: layer name to its per-rank spec, in model order.
    :param notes: the facts a person must see, one short line each.
    :param choices: the choices applied.
    :param replicated_layers: layers whose cache more than one rank holds.
    :param dtype_kept_layers: layers that keep their own dtype under a
        ``kv_cache_dtype``.
    :param block_size_kept_layers: layers that keep their own block under a
        ``block_size``.
    """

    layers: dict[str, KVCacheSpec]
    notes: tuple[str, ...] = ()
    choices: ServingChoices = ServingChoices()
    replicated_layers: tuple[str, ...] = ()
    dtype_kept_layers: tuple[str, ...] = ()
    block_size_kept_layers: tuple[str, ...] = ()


def _by_kind(names: list[str], specs: Mapping[str, KVCacheSpec]) -> str:
    counts = Counter(type(specs[n]).kind or type(specs[n]).__name__ for n in names)
    return ", ".join(f"{count} {kind}" for kind, count in counts.items())


def _layers(n: int) -> str:
    return f"{n} layer{'' if n == 1 else 's'}"


def _call(name: str, spec: KVCacheSpec, method: str, arg: object) -> object:
    """``spec.method(arg)``: plugin code, whose refusal (``InvalidSpecError``)
    names the layer and whose other errors name the plugin."""
    try:
        return call_plugin(
            spec,
            f"{method}({arg!r}) for layer {name!r}",
            lambda: getattr(spec, method)(arg),
        )
    except InvalidSpecError as exc:
        msg = f"layer {name!r} ({type(spec).kind}): {exc}"
        raise ServingError(msg) from exc


def _variant(name: str, spec: KVCacheSpec, method: str, arg: Any) -> KVCacheSpec | None:
    """``spec.<method>(arg)`` (a ``with_*`` hook), checked where it crosses
    in: ``None`` (the kind keeps its own) or a spec of the same class, with
    the block size asked for (``with_block_size``) or, for any other choice,
    the one it had (a choice changes only what it names)."""
    answer = _call(name, spec, method, arg)
    if answer is None:
        return None
    if method == "with_block_size":
        block, why = arg, " (the one asked for)"
    else:
        block, why = (
            spec.block_size,
            " (its own: a serving choice changes only what it names)",
        )
    call = f"{method}({arg!r}) for layer {name!r}"
    return checked_variant(spec, call, answer, block, none_ok=True, why=why)


def _shard(name: str, spec: KVCacheSpec, tp: int) -> Sharded:
    """``spec.sharded(tp)``: a :class:`Sharded` whose spec is of the same
    class and block size (a rank splits heads or channels, not blocks)."""
    shard = _call(name, spec, "sharded", tp)
    call = f"sharded({tp}) for layer {name!r}"
    if not isinstance(shard, Sharded):
        raise spec_plugin_error(
            spec,
            f"{type(spec).__name__}.{call} returned {echo(shard)}; it must return "
            "a kvcore.spec.Sharded",
        )
    why = " in its Sharded (its own block: ranks split heads or channels, not blocks)"
    checked_variant(spec, call, shard.spec, spec.block_size, none_ok=False, why=why)
    return shard


def _apply_each(layers: dict[str, KVCacheSpec], method: str, value: Any) -> list[str]:
    """Call ``spec.<method>(value)`` on every layer in place; the layers whose
    kind answers ``None`` (keeps its own) are returned."""
    kept: list[str] = []
    for name, spec in layers.items():
        new = _variant(name, spec, method, value)
        if new is None:
            kept.append(name)
        else:
            layers[name] = new
    return kept


def _kept_note(
    what: str, kept: list[str], own: str, layers: Mapping[str, KVCacheSpec]
) -> str:
    """``"block size 32 on 4 layers; 28 layers keep their own block: ..."``."""
    note = f"{what} on {_layers(len(layers) - len(kept))}"
    if kept:
        note += f"; {_layers(len(kept))} keep their own {own}: {_by_kind(kept, layers)}"
    return note


def apply_serving_choices(
    specs: Mapping[str, KVCacheSpec], choices: ServingChoices
) -> ServedLayers:
    """One tensor-parallel rank's specs for ``specs`` (a model file's
    layers) under ``choices``: the cache dtype first, then the block size,
    then the split across ranks.

    Raises :class:`ServingError` naming the layer, the rule and the fix when
    a choice cannot apply to a layer (heads that do not divide across the
    ranks, a block that does not tile a chunk, a result its spec refuses).
    """
    given: object = choices  # checked: callers pass anything
    if not isinstance(given, ServingChoices):
        msg = f"choices must be a ServingChoices, got {given!r}"
        raise KvcoreTypeError(msg)
    source: object = specs
    if not isinstance(source, Mapping):
        msg = f"specs must map layer names to specs, got {type(source).__name__}"
        raise KvcoreTypeError(msg)
    layers: dict[str, KVCacheSpec] = {}
    for name, spec in source.items():
        if not isinstance(spec, KVCacheSpec):
            msg = f"layer {name!r} has spec {spec!r}, not a KVCacheSpec"
            raise KvcoreTypeError(msg)
        layers[name] = spec
    notes: list[str] = []

    dtype_kept: list[str] = []
    dtype = choices.kv_cache_dtype
    if dtype is not None:
        dtype_kept = _apply_each(layers, "with_cache_dtype", dtype)
        notes.append(
            _kept_note(
                f"cache dtype {cache_dtype_name(dtype)}", dtype_kept, "dtype", layers
            )
        )

    block_kept: list[str] = []
    block_size = choices.block_size
    if block_size is not None:
        block_kept = _apply_each(layers, "with_block_size", block_size)
        notes.append(
            _kept_note(f"block size {block_size}", block_kept, "block", layers)
        )

    # The state kinds' settings: noted only where some layer takes them.
    ssm_dtype = choices.mamba_ssm_cache_dtype
    for what, method, value in (
        ("state cache mode", "with_state_cache_mode", choices.mamba_cache_mode),
        ("checkpoint policy", "with_checkpoint_policy", choices.checkpoint_policy),
        ("SSM state dtype", "with_state_dtype", ssm_dtype),
    ):
        if value is not None:
            kept = _apply_each(layers, method, value)
            shown = cache_dtype_name(value) if isinstance(value, torch.dtype) else value
            if len(kept) < len(layers):
                notes.append(f"{what} {shown} on {_layers(len(layers) - len(kept))}")

    replicated: list[str] = []
    tp = choices.tensor_parallel_size
    if tp > 1:
        groups: Counter[str] = Counter()
        for name, spec in layers.items():
            shard = _shard(name, spec, tp)
            layers[name] = shard.spec
            if shard.replicated:
                replicated.append(name)
                groups[shard.note or f"replicated on {shard.replicas} ranks"] += 1
        split = len(layers) - len(replicated)
        if split:
            notes.append(f"tensor parallel {tp}: {_layers(split)} split across ranks")
        notes.extend(f"{note} ({_layers(n)})" for note, n in groups.items())

    return ServedLayers(
        layers=layers,
        notes=tuple(notes),
        choices=choices,
        replicated_layers=tuple(replicated),
        dtype_kept_layers=tuple(dtype_kept),
        block_size_kept_layers=tuple(block_kept),
    )
