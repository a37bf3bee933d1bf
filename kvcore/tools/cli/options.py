"""The options every planning command shares, and the plan they describe.

``add_model_options`` adds them to a command's parser; ``plan_from_args``
reads them back into a :class:`Planned`: the model file, the serving
choices applied to its layers, the memory one rank gives its KV cache, and
the plan.  ``plan``, ``compare`` and ``simulate`` all start here, so they
answer the same question the same way.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any, Literal, overload

import attrs
import torch

from kvcore.config import (
    CacheConfig,
    EngineConfig,
    ParallelConfig,
)
from kvcore.errors import (
    KvcoreValueError,
    PluginError,
    SerializationError,
    escape_controls,
)
from kvcore.length_mix import LengthMix
from kvcore.plan import plan_kv_cache
from kvcore.plugins import get_plugin_manager
from kvcore.registry import KindRegistry
from kvcore.serialize import ModelFile, load_model_file
from kvcore.serving import (
    ServedLayers,
    ServingChoices,
    apply_serving_choices,
    parse_cache_dtype,
)
from kvcore.structs import KVCacheConfig
from kvcore.tools import zoo
from kvcore.tools.accelerators import Accelerator, find_accelerator
from kvcore.tools.cli.parsers import (
    DEFAULT_CONTEXT,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MEMORY,
    DEFAULT_MODEL,
    add_model_options,
)
from kvcore.tools.length_mixes import fixed_lengths, is_mix, parse_length_mix
from kvcore.tools.units import (
    format_size,
    format_sizes,
    parse_fraction,
    parse_size,
    parse_tokens,
)

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_MEMORY",
    "DEFAULT_GPU_MEMORY_UTILIZATION",
    "MemoryBudget",
    "Planned",
    "add_model_options",
    "plan_from_args",
    "resolve_model",
]


class CliUsageError(KvcoreValueError):
    """A command-line option or model source cannot be used as given."""


@attrs.frozen
class MemoryBudget:
    """The bytes one rank gives its KV cache, and where the figure came from."""

    kv_bytes: int
    gpu: Accelerator | None = None
    gpu_memory_utilization: float | None = None
    weights_bytes: int = 0
    weights_per_rank: int = 0
    #: where :attr:`weights_bytes` came from: ``"--weights"``, ``"model
    #: file"``, ``"estimated from config.json"``, ``"hub safetensors
    #: metadata"``, or ``""`` (none set aside).
    weights_source: str = ""
    #: the ranks the weights are split over (tensor x pipeline parallel).
    ranks: int = 1

    @property
    def headroom_bytes(self) -> int:
        """The device memory ``--gpu-memory-utilization`` leaves unused
        (activations, CUDA graphs, the runtime); 0 without ``--gpu``."""
        if self.gpu is None:
            return 0
        return self.gpu.memory_bytes - self.weights_per_rank - self.kv_bytes

    def describe(self) -> str:
        """``"H100 80GB x 0.90 - 13.7 GiB weights"`` or ``"8.0 GiB"``."""
        if self.gpu is None:
            return f"{format_size(self.kv_bytes)} of KV cache"
        text = f"{self.gpu.name} x {self.gpu_memory_utilization:.2f}"
        if self.weights_per_rank:
            text += f" - {format_size(self.weights_per_rank)} weights"
        return f"{text} = {format_size(self.kv_bytes)} of KV cache"

    def budget_line(self) -> str | None:
        """Where one device's memory goes: ``"memory: H200 141 GiB = 15.0
        GiB weights (model file) + 111 GiB KV cache + 14.1 GiB headroom
        (--gpu-memory-utilization 0.90)"``; None without ``--gpu``."""
        if self.gpu is None:
            return None
        who = "memory" if self.ranks == 1 else f"memory per rank ({self.ranks} ranks)"
        weights = f"{format_size(self.weights_per_rank)} weights"
        if self.weights_source:
            weights += f" ({self.weights_source})"
        return (
            f"{who}: {self.gpu.name} ({format_size(self.gpu.memory_bytes)}) = "
            f"{weights} + {format_size(self.kv_bytes)} KV cache + "
            f"{format_size(self.headroom_bytes)} headroom "
            f"(--gpu-memory-utilization {self.gpu_memory_utilization:.2f})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "kv_cache_bytes": self.kv_bytes,
            "gpu": self.gpu.name if self.gpu else None,
            "gpu_memory_bytes": self.gpu.memory_bytes if self.gpu else None,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "weights_bytes": self.weights_bytes,
            "weights_bytes_per_rank": self.weights_per_rank,
            "weights_source": self.weights_source or None,
            "headroom_bytes": self.headroom_bytes if self.gpu else None,
        }


@attrs.frozen
class Planned:
    """One model planned with the command line's settings."""

    model: ModelFile
    #: The model file, or the config.json (or hub id) it was mapped from.
    source: Path | str
    registry: KindRegistry
    choices: ServingChoices
    served: ServedLayers
    budget: MemoryBudget
    config: EngineConfig
    plan: KVCacheConfig
    contexts: tuple[int, ...]
    #: ``--context`` as a mix of lengths (``lognormal:8k,1.0``), planned for
    #: by ``min_waste``; ``contexts`` are then single lengths beside it.
    mix: LengthMix | None = None
    #: Requests of the mix dropped for passing ``--max-model-len``.
    mix_dropped: int = 0
    #: ``--max-num-seqs``: the most requests the engine runs at once.
    max_num_seqs: int | None = None
    #: ``(stage, stages)`` with ``--pipeline-parallel-size`` above 1: the
    #: plan is that stage's (the one that sets the block count).
    stage: tuple[int, int] | None = None
    #: The layers :attr:`plan` holds (one stage's with pipeline stages).
    stage_layers: dict[str, Any] | None = None

    @property
    def memory(self) -> int:
        return self.budget.kv_bytes

    @property
    def mapped(self) -> bool:
        """Whether the model was mapped from a ``config.json`` (or hub id)
        rather than read from a model file."""
        return not isinstance(self.source, Path)

    @property
    def specs(self) -> dict[str, Any]:
        """The layers as one rank serves them (the plan's input)."""
        if self.stage_layers is not None:
            return self.stage_layers
        return self.served.layers


def _tokens_list(text: str) -> tuple[int, ...]:
    parts = [part.strip() for part in str(text).split(",")]
    if not all(parts):
        msg = f"--context takes token counts separated by commas (e.g. 4K,32K,128K), got {text!r}"
        if any(parts):
            msg += ": an item between commas is empty"
        raise CliUsageError(msg)
    values = tuple(parse_tokens(part, what="--context") for part in parts)
    if len(set(values)) != len(values):
        msg = f"--context lists a length twice: {text!r}"
        raise CliUsageError(msg)
    return values


def _max_model_len(args: argparse.Namespace, model: ModelFile) -> int | None:
    """``--max-model-len`` in tokens (vLLM's units); ``auto`` or ``-1`` is
    the model's own longest context, as vLLM derives it."""
    text = getattr(args, "max_model_len", None)
    if text is None:
        return None
    if str(text).strip().lower() in ("auto", "-1"):
        if model.max_position_embeddings is None:
            msg = (
                f"--max-model-len {text}: the model file {model.name!r} does not "
                "say its longest context (max_position_embeddings); give a "
                "number of tokens such as 32K"
            )
            raise CliUsageError(msg)
        return model.max_position_embeddings
    return parse_tokens(text, what="--max-model-len")


def _mix(
    args: argparse.Namespace, max_model_len: int | None
) -> tuple[LengthMix | None, int]:
    """``--context`` as a mix of lengths (and the requests dropped for
    passing ``--max-model-len``), or ``None`` for a list of lengths."""
    text = getattr(args, "context", None)
    if text is None or not is_mix(text):
        return None, 0
    try:
        return parse_length_mix(text, max_model_len=max_model_len)
    except KvcoreValueError as exc:
        raise CliUsageError(str(exc)) from exc


def _contexts(args: argparse.Namespace, max_model_len: int | None) -> tuple[int, ...]:
    """The lengths planned: ``--context``, else ``--max-model-len``, else
    :data:`DEFAULT_CONTEXT`; none may pass ``--max-model-len``."""
    if args.context is None:
        if max_model_len is not None:
            return (max_model_len,)
        return _tokens_list(DEFAULT_CONTEXT)
    contexts = _tokens_list(args.context)
    if max_model_len is not None:
        longer = [c for c in contexts if c > max_model_len]
        if longer:
            msg = (
                f"--context {args.context} asks for {longer[0]:,} tokens, past "
                f"--max-model-len {max_model_len:,}; the engine refuses such "
                "requests: raise --max-model-len or drop that length"
            )
            raise CliUsageError(msg)
    return contexts


def _model_argument(args: argparse.Namespace) -> None:
    """Fold ``--model`` (vLLM's spelling) into the positional MODEL."""
    option = getattr(args, "model_option", None)
    if option is None:
        return
    if args.model not in (DEFAULT_MODEL, option):
        msg = (
            f"give the model once: MODEL is {escape_controls(args.model)!r} and "
            f"--model is {escape_controls(option)!r}"
        )
        raise CliUsageError(msg)
    args.model = option
    args.model_option = None


def resolve_model(name_or_path: str) -> Path:
    """A model file path, or the shipped file of that name.

    ``name_or_path`` is a path when it names an existing file, ends in
    ``.json`` or holds a path separator; anything else is the name of a
    shipped model, found only among :func:`kvcore.tools.zoo.names` (a name never
    reaches outside the package's model folder)."""
    if "\x00" in name_or_path:
        msg = "the model path holds a NUL byte; give a file path or a shipped name"
        raise CliUsageError(msg)
    path = Path(name_or_path)
    looks_like_path = (
        path.suffix == ".json" or "/" in name_or_path or "\\" in name_or_path
    )
    if path.exists() or looks_like_path:
        name_or_path = escape_controls(name_or_path)
        if path.is_dir():
            msg = (
                f"{name_or_path} is a directory; give a model file inside it "
                "(a .json file with a 'layers' object)"
            )
            raise CliUsageError(msg)
        if not path.exists():
            msg = (
                f"no model file {name_or_path}; give an existing file or one of "
                f"the shipped models: {', '.join(zoo.names())}"
            )
            raise CliUsageError(msg)
        # A FIFO or device is refused by the reader, which checks the file
        # it opened (no race between a check here and the read).
        return path
    return zoo.path(name_or_path)


def _model_source(
    args: argparse.Namespace, registry: KindRegistry, choices: ServingChoices
) -> tuple[Path | str, ModelFile, int | None]:
    """Where the model comes from and its layers: ``--hf-config``, a hub id
    (``ORG/NAME`` that names no file), or a model file / shipped name."""
    hf_config = getattr(args, "hf_config", None)
    if hf_config is not None and args.model != DEFAULT_MODEL:
        msg = "give a MODEL or --hf-config, not both"
        raise CliUsageError(msg)
    if hf_config is not None:
        mapped = read_plugin_model(hf_config, choices, registry, allow_hub=False)
        path = Path(hf_config)
        where = str(path / "config.json" if path.is_dir() else path)
        return where, mapped, mapped.weights_bytes
    if _may_be_hub_id(args.model):
        fetched = read_plugin_model(args.model, choices, registry, allow_hub=True)
        if fetched is not None:
            return f"{args.model} (config.json)", fetched, fetched.weights_bytes
    source = resolve_model(args.model)
    try:
        model, weights = _read_model(source, registry)
    except SerializationError as exc:
        hint = _hf_config_hint(source)
        if hint is None:
            raise
        msg = f"{exc}; {hint}"
        raise CliUsageError(msg) from None
    return source, model, weights


def _hf_config_hint(path: Path) -> str | None:
    """A hint to pass ``--hf-config`` when ``path`` (refused as a model file)
    is a Hugging Face ``config.json``."""
    if path.name == "config.json":
        looks = True
    else:
        try:
            if not path.is_file():  # never read a FIFO or a device
                return None
            with path.open("rb") as file:
                head = file.read(65536).decode("utf-8", errors="replace")
        except OSError:
            return None
        looks = '"model_type"' in head or '"architectures"' in head
    if not looks:
        return None
    shown = escape_controls(str(path))
    return (
        f"{shown} looks like a Hugging Face config.json: plan it with "
        f"`--hf-config {shown}` (a model file holds a 'layers' object)"
    )


def _may_be_hub_id(text: str) -> bool:
    """``ORG/NAME`` that names no local file: a plugin may fetch it."""
    return (
        text.count("/") == 1
        and not text.endswith(".json")
        and not text.startswith((".", "/", "~"))
        and not Path(text).exists()
    )


@overload
def read_plugin_model(
    source: str,
    choices: ServingChoices,
    registry: KindRegistry,
    *,
    allow_hub: Literal[False],
) -> ModelFile: ...
@overload
def read_plugin_model(
    source: str, choices: ServingChoices, registry: KindRegistry, *, allow_hub: bool
) -> ModelFile | None: ...
def read_plugin_model(
    source: str, choices: ServingChoices, registry: KindRegistry, *, allow_hub: bool
) -> ModelFile | None:
    """A model read by an installed plugin (``kvcore_read_model``): a
    Hugging Face ``config.json`` or hub id through ``kvcore_hf``.  None when
    no plugin takes a possible hub id; a path no plugin reads is an error."""
    model = get_plugin_manager().hook.kvcore_read_model(
        source=source, choices=choices, registry=registry, allow_hub=allow_hub
    )
    if model is None:
        if allow_hub:
            return None
        msg = (
            f"no installed plugin reads {escape_controls(source)}; the built-in "
            "kvcore_hf plugin reads config.json files (is it disabled?)"
        )
        raise CliUsageError(msg)
    if not isinstance(model, ModelFile):
        msg = (
            f"a plugin's kvcore_read_model returned {type(model).__name__} for "
            f"{escape_controls(source)}; it must return a kvcore.serialize.ModelFile"
        )
        raise PluginError(msg, plugin_name="kvcore_read_model")
    return model


def _read_model(path: Path, registry: KindRegistry) -> tuple[ModelFile, int | None]:
    """The model file and its optional ``weights_bytes``: read as
    :func:`~kvcore.serialize.load_model_file` reads every model file (a
    regular file, strict UTF-8 JSON, within kvcore's size and nesting
    limits)."""
    model = load_model_file(path, registry)
    return model, model.weights_bytes


def _positive(text: str, option: str) -> int:
    """A positive whole number (``--tp 2``, ``--block-size 32``)."""
    value = str(text).strip()
    if not re.fullmatch(r"[0-9]{1,9}", value) or int(value) < 1:
        msg = (
            f"{option} takes a positive whole number up to 999,999,999, such as "
            f"2, got {text!r}"
        )
        raise CliUsageError(msg)
    return int(value)


def _weights_source(source: Path | str, model: ModelFile) -> str:
    """Where a model's own ``weights_bytes`` came from, for the budget line."""
    if isinstance(source, Path):
        return "model file"
    if "from the hub's safetensors metadata" in model.notes:
        return "hub safetensors metadata"
    return "estimated from config.json"


def _budget(
    args: argparse.Namespace,
    tp: int,
    file_weights: int | None,
    weights_source: str = "model file",
) -> MemoryBudget:
    if args.gpu is None:
        if args.gpu_memory_utilization is not None:
            msg = (
                "--gpu-memory-utilization scales a device's memory; give --gpu with "
                "it (--memory is already the KV cache budget)"
            )
            raise CliUsageError(msg)
        if args.weights is not None:
            msg = (
                "--weights sets weights aside from a device's memory; give --gpu "
                "with it (--memory is already the KV cache budget)"
            )
            raise CliUsageError(msg)
        memory = args.memory if args.memory is not None else DEFAULT_MEMORY
        return MemoryBudget(kv_bytes=parse_size(memory, what="--memory"))
    gpu = find_accelerator(args.gpu)
    utilization = parse_fraction(
        args.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION,
        what="--gpu-memory-utilization",
    )
    if args.weights is not None:
        weights = parse_size(args.weights, what="--weights", allow_zero=True)
        source = "--weights"
    else:
        weights = file_weights or 0
        source = weights_source if weights else ""
    per_rank = -(-weights // tp)
    usable = int(gpu.memory_bytes * utilization)
    kv = usable - per_rank
    if kv <= 0:
        weights_text, usable_text = format_sizes(per_rank, usable)
        msg = (
            f"{weights_text} of weights per rank leave no KV cache in "
            f"{gpu.name} x {utilization:.2f} = {usable_text}; use more "
            "ranks (--tp), a larger device or a higher --gpu-memory-utilization"
        )
        raise CliUsageError(msg)
    return MemoryBudget(
        kv_bytes=kv,
        gpu=gpu,
        gpu_memory_utilization=utilization,
        weights_bytes=weights,
        weights_per_rank=per_rank,
        weights_source=source,
        ranks=tp,
    )


def registry_for_cli() -> KindRegistry:
    """The kinds of every installed plugin."""
    return KindRegistry.from_plugin_manager(get_plugin_manager())


def plan_from_args(
    args: argparse.Namespace,
    *,
    policy: str | None = None,
    registry: KindRegistry | None = None,
) -> Planned:
    """Plan ``args.model`` as the options say (``policy`` overrides
    ``--policy``)."""
    registry = registry or registry_for_cli()
    _model_argument(args)
    tp = _positive(args.tp, "--tp")
    pp = _positive(getattr(args, "pp", "1"), "--pipeline-parallel-size")
    ssm_dtype = getattr(args, "mamba_ssm_cache_dtype", "auto")
    choices = ServingChoices(
        kv_cache_dtype=parse_cache_dtype(args.kv_cache_dtype),
        tensor_parallel_size=tp,
        block_size=(
            None
            if args.block_size is None
            else _positive(args.block_size, "--block-size")
        ),
        mamba_cache_mode=args.mamba_cache_mode,
        checkpoint_policy=args.checkpoint_policy,
        mamba_ssm_cache_dtype=_ssm_dtype(ssm_dtype),
    )
    source, model, file_weights = _model_source(args, registry, choices)
    served = apply_serving_choices(model.layers, choices)
    budget = _budget(args, tp * pp, file_weights, _weights_source(source, model))
    max_model_len = _max_model_len(args, model)
    mix, mix_dropped = _mix(args, max_model_len)
    contexts = fixed_lengths(mix) if mix is not None else _contexts(args, max_model_len)
    max_num_seqs = getattr(args, "max_num_seqs", None)
    prefix_caching = getattr(args, "prefix_caching", None)
    config = EngineConfig(
        cache_config=CacheConfig(
            kv_cache_layout=args.layout,
            enable_prefix_caching=prefix_caching is not False,
            packing_policy=policy or args.policy,
            target_context=contexts[0],
            target_lengths=mix,
            max_block_growth=_positive(args.max_block_growth, "--max-block-growth"),
            mamba_cache_mode=args.mamba_cache_mode,
        ),
        parallel_config=ParallelConfig(
            tensor_parallel_size=tp, pipeline_parallel_size=pp
        ),
        max_model_len=max_model_len,
        max_num_batched_tokens=parse_tokens(
            args.max_num_batched_tokens, what="--max-num-batched-tokens"
        ),
    )
    layers = served.layers
    stage = None
    if pp > 1:
        stage, layers, plan = _fullest_stage(config, layers, budget.kv_bytes, registry)
    else:
        plan = plan_kv_cache(config, layers, budget.kv_bytes, registry=registry)
    return Planned(
        model=model,
        source=source,
        registry=registry,
        choices=choices,
        served=served,
        budget=budget,
        config=config,
        plan=plan,
        contexts=contexts,
        mix=mix,
        mix_dropped=mix_dropped,
        max_num_seqs=(
            None if max_num_seqs is None else _positive(max_num_seqs, "--max-num-seqs")
        ),
        stage=stage,
        stage_layers=layers,
    )


def _ssm_dtype(name: str) -> torch.dtype | None:
    """``--mamba-ssm-cache-dtype``: vLLM's names (auto, float32, bfloat16,
    float16) and kvcore's aliases of them."""
    dtype = parse_cache_dtype(name)
    if dtype is not None and (not dtype.is_floating_point or dtype in _FP8):
        msg = (
            f"--mamba-ssm-cache-dtype takes auto, float32, bfloat16 or float16 "
            f"(as vLLM), got {name!r}"
        )
        raise CliUsageError(msg)
    return dtype


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _fullest_stage(
    config: EngineConfig,
    layers: dict[str, Any],
    memory: int,
    registry: KindRegistry,
) -> tuple[tuple[int, int], dict[str, Any], KVCacheConfig]:
    """Plan ``layers`` over ``config``'s pipeline stages (each stage on ranks
    of ``memory`` bytes, one block count: the smallest stage's) and return
    the stage that sets the count: ``(stage, stages)``, its layers and its
    plan."""
    from kvcore.integrations.stages import plan_pipeline_stages

    pipeline = plan_pipeline_stages(config, layers, memory, registry=registry)
    # Every stage runs the smallest count; the stage with the widest block
    # stride is the one that filled its memory first.
    index = max(
        range(len(pipeline.stages)),
        key=lambda s: pipeline.stages[s].bytes_per_block,
    )
    names = pipeline.stage_layers[index]
    return (
        (index, len(pipeline.stages)),
        {name: layers[name] for name in names},
        pipeline.stages[index],
    )
