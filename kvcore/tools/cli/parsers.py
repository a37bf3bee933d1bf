"""The ``kvcore`` parser's commands and options, without torch.

Building the parser imports nothing heavy: the choice lists come from the
torch-free :mod:`kvcore.choices` and :mod:`kvcore.tools.choices`, and each
command's function is imported from its module (``plan``, ``simulate``,
``convert``, ``info``) only when the command runs.  ``kvcore --help``,
``--version`` and argument errors therefore never import torch.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any

from kvcore.checkpoints import CHECKPOINT_POLICIES
from kvcore.choices import CACHE_DTYPE_NAMES, PACKING_POLICIES, STATE_CACHE_MODES
from kvcore.layout import KVCacheLayout
from kvcore.tools import zoo
from kvcore.tools.choices import (
    DEFAULT_DECODE_RATE,
    DEFAULT_PREFILL_RATE,
    NAMED_WORKLOADS,
    TRACE_FORMATS,
)

__all__ = ["COMMANDS", "add_model_options", "lazy_command"]

#: JSON schema version of ``kvcore plan --json``.
PLAN_SCHEMA_VERSION = "kvcore-plan/1"
#: JSON schema version of ``kvcore compare --json``.
COMPARE_SCHEMA_VERSION = "kvcore-compare/1"
#: JSON schema version of ``kvcore simulate --json``.
SIMULATE_SCHEMA_VERSION = "kvcore-simulate/1"

#: The model ``kvcore plan`` plans when given none.
DEFAULT_MODEL = "deepseek-v4-flash"
#: The KV cache budget per rank when neither ``--memory`` nor ``--gpu`` is given.
DEFAULT_MEMORY = "8GiB"
#: The request length planned when neither ``--context`` nor
#: ``--max-model-len`` is given (32,768 tokens).
DEFAULT_CONTEXT = "32K"
#: The share of a device an engine takes (as vLLM's ``--gpu-memory-utilization``).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


Command = Callable[[argparse.Namespace], int]


def lazy_command(module: str, name: str) -> Command:
    """The command function ``name`` of ``kvcore.tools.cli.<module>``,
    imported when the command runs (with torch), not when the parser is
    built."""

    def command(args: argparse.Namespace) -> int:
        found: Command = getattr(
            importlib.import_module(f"kvcore.tools.cli.{module}"), name
        )
        return found(args)

    command.__qualname__ = command.__name__ = name
    return command


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """The model, memory, serving and planning options (shared by commands)."""
    parser.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        metavar="MODEL",
        help="a model file, the name of a shipped one "
        f"({', '.join(zoo.names())}; default {DEFAULT_MODEL}), or a Hugging Face "
        "hub id ORG/NAME (its config.json is mapped; needs kvcore[hf])",
    )
    parser.add_argument(
        "--model",
        dest="model_option",
        metavar="MODEL",
        help="the same as MODEL (vLLM's spelling)",
    )
    parser.add_argument(
        "--hf-config",
        metavar="PATH",
        help="plan from a Hugging Face config.json (a file, or a directory "
        "holding one) instead of a model file",
    )
    memory = parser.add_argument_group(
        "memory", "the KV cache budget of one rank (one device)"
    )
    which = memory.add_mutually_exclusive_group()
    which.add_argument(
        "--memory",
        "--kv-cache-memory-bytes",
        dest="memory",
        metavar="SIZE",
        help="bytes of KV cache per rank: 80GiB or 80G (powers of 1024), 64GB or "
        "64g (powers of 1000), or plain bytes (default "
        f"{DEFAULT_MEMORY} when --gpu is not given)",
    )
    which.add_argument(
        "--gpu",
        metavar="NAME",
        help="a device from the accelerator table (H100, H200, B200, A100-40GB, "
        "L40S, MI300X, ...): its memory x --gpu-memory-utilization - --weights",
    )
    memory.add_argument(
        "--gpu-memory-utilization",
        metavar="FRACTION",
        default=None,
        help="share of the device the engine takes, with --gpu (default "
        f"{DEFAULT_GPU_MEMORY_UTILIZATION}, as engines default)",
    )
    memory.add_argument(
        "--weights",
        metavar="SIZE",
        help="bytes of weights and activations for the whole model, split evenly "
        "over the --tp x --pipeline-parallel-size ranks and set aside from the --gpu memory (default: the "
        "model file's weights_bytes, else nothing)",
    )
    serving = parser.add_argument_group(
        "serving", "engine choices applied to every layer before planning"
    )
    serving.add_argument(
        "--tp",
        "--tensor-parallel-size",
        "-tp",
        dest="tp",
        type=str,
        default="1",
        metavar="N",
        help="tensor-parallel ranks: KV heads divided by N (replicated when a "
        "layer has fewer heads than ranks); states shard through their plugin",
    )
    serving.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        dest="pp",
        type=str,
        default="1",
        metavar="N",
        help="pipeline stages: the layers split into N contiguous stages, each "
        "on its own ranks with this memory; the capacity is the fullest "
        "stage's (default 1)",
    )
    serving.add_argument(
        "--kv-cache-dtype",
        default="auto",
        metavar="DTYPE",
        help="cache dtype of every attention layer: auto (the model file's), "
        f"{', '.join(sorted(set(CACHE_DTYPE_NAMES) - {'auto'}))}",
    )
    serving.add_argument(
        "--mamba-ssm-cache-dtype",
        default="auto",
        metavar="DTYPE",
        help="dtype of every Mamba / linear-attention layer's recurrent (SSM) "
        "state, the tensors after its conv state: auto (the model file's), "
        "float32, bfloat16, float16",
    )
    serving.add_argument(
        "--mamba-cache-mode",
        choices=STATE_CACHE_MODES,
        help="recurrent-state caching of every Mamba / linear-attention layer: "
        "none (the live state only: no prefix hits for the model), align (a "
        "state kept at block boundaries), all (a state every block) "
        "(default: the model file's)",
    )
    serving.add_argument(
        "--checkpoint-policy",
        choices=tuple(CHECKPOINT_POLICIES),
        help="which states every Mamba / linear-attention layer keeps for later "
        "requests with prefix caching on: turns (prompt ends, output ends, "
        "branch points), prompts (no output ends), steps (every step end on a "
        "hit boundary) (default: the model file's, else turns)",
    )
    serving.add_argument(
        "--block-size",
        metavar="TOKENS",
        help="tokens per block of every paged attention layer (states and rings "
        "keep theirs; default: the model file's)",
    )
    planning = parser.add_argument_group("planning")
    planning.add_argument(
        "--context",
        default=None,
        metavar="LENGTHS",
        help="request lengths in tokens, comma-separated (4K,32K,128K; K is "
        "1024 and k 1000, as vLLM reads them); the first is the policy's "
        f"target (default: --max-model-len, else {DEFAULT_CONTEXT}); or a "
        "workload's mix of lengths to plan for: lognormal:MEDIAN,SIGMA, "
        "uniform:LO-HI, mix:A,B*3,C or trace:FILE (docs: capacity)",
    )
    planning.add_argument(
        "--max-model-len",
        metavar="TOKENS",
        help="the longest request the engine takes: the first context when "
        "--context is not given; a context past it, or a pool that cannot "
        "hold one such request, is refused, as vLLM refuses them; auto: the "
        "model's own longest (max_position_embeddings)",
    )
    planning.add_argument(
        "--max-num-seqs",
        metavar="N",
        help="the most requests the engine runs at once; shown as a cap "
        "next to the requests that fit",
    )
    planning.add_argument(
        "--max-num-batched-tokens",
        default="8192",
        metavar="TOKENS",
        help="tokens one scheduler step prefills; the capacity model reserves "
        "one such step (default 8192)",
    )
    planning.add_argument(
        "--policy",
        choices=PACKING_POLICIES,
        default="min_waste",
        help="grouping policy (default min_waste)",
    )
    planning.add_argument(
        "--layout",
        default="BLHNC",
        help="KV cache layout, one of "
        f"{', '.join(layout.name for layout in KVCacheLayout)} (default BLHNC)",
    )
    planning.add_argument(
        "--max-block-growth",
        default="64",
        metavar="FACTOR",
        help="largest factor min_waste may grow a block size by; 1 keeps the "
        "model's block sizes (finer prefix hits) (default 64)",
    )
    planning.add_argument(
        "--enable-prefix-caching",
        dest="prefix_caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="plan with prefix caching (the default) or without it "
        "(--no-enable-prefix-caching, vLLM's spelling)",
    )
    planning.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="plan without prefix caching (no hash alignment between groups)",
    )


def _add_output_options(parser: argparse.ArgumentParser) -> None:
    out = parser.add_argument_group("output")
    out.add_argument(
        "--json",
        action="store_true",
        help=f"print the JSON document (schema {PLAN_SCHEMA_VERSION}, see the docs)",
    )


def register_plan(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    plan = sub.add_parser(
        "plan",
        help="how many requests of each length fit, with the plan behind it",
        description="Plan a model's KV cache for one device's memory and report "
        "the requests of each context length that fit, next to the physical limit.",
    )
    add_model_options(plan)
    _add_output_options(plan)
    drawing = plan.add_argument_group("pictures (needs the plot extra)")
    drawing.add_argument(
        "--svg", metavar="FILE", help="draw the block and capacity curve as SVG"
    )
    drawing.add_argument("--png", metavar="FILE", help="the same picture as PNG")
    plan.set_defaults(func=lazy_command("plan", "_cmd_plan"))
    compare = sub.add_parser(
        "compare",
        help="every packing policy side by side on the same model and memory",
        description="Plan the model with each packing policy and compare the "
        "requests each holds at every context.",
    )
    add_model_options(compare)
    _add_output_options(compare)
    compare.set_defaults(func=lazy_command("plan", "_cmd_compare"))


def register_simulate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``kvcore simulate``."""
    parser = sub.add_parser(
        "simulate",
        help="replay a workload through the real block coordinator",
        description="Plan the model as 'kvcore plan' does, then replay a trace "
        "file or a synthetic workload through the block coordinator with a small "
        "continuous-batching scheduler, and report prefix hits, blocks in use per "
        "group, refused steps and preemptions.",
    )
    add_model_options(parser)
    work = parser.add_argument_group(
        "workload", "a trace file, or a synthetic workload (docs: simulate)"
    )
    work.add_argument(
        "--trace",
        metavar="FILE",
        help="JSON lines, one request a line: a Mooncake or Qwen-Bailian trace "
        "(timestamp, input_length, output_length, hash_ids) or kvcore's own format "
        "(arrival step, prompt or prompt_len, prefix_id/prefix_len, parent, "
        "output_len); the format is detected from the first line",
    )
    work.add_argument(
        "--trace-format",
        choices=TRACE_FORMATS,
        help="the --trace file's format, instead of detecting it",
    )
    work.add_argument(
        "--trace-block-tokens",
        metavar="N",
        help="tokens per hash id of a Mooncake or Bailian trace (default 512 and 16)",
    )
    work.add_argument(
        "--no-timing",
        action="store_true",
        help="replay a timed trace in order, every request due at once, instead "
        "of at its timestamp on the simulated clock",
    )
    work.add_argument(
        "--workload",
        metavar="NAME",
        help=f"a named synthetic workload ({', '.join(NAMED_WORKLOADS)}): presets "
        "for the options below, which still override it",
    )
    work.add_argument("--requests", metavar="N", help="requests to draw (default 64)")
    work.add_argument(
        "--prompt-len",
        metavar="DIST",
        help="new prompt tokens of each request: N, LO-HI, normal:MEAN,STD or "
        "lognormal:MEAN,STD (default 1024)",
    )
    work.add_argument(
        "--output-len",
        metavar="DIST",
        help="tokens each request generates (default 128)",
    )
    work.add_argument(
        "--shared-prefixes",
        metavar="K",
        help="system prefixes the chats start with, one picked per chat (default 0)",
    )
    work.add_argument("--prefix-len", metavar="N", help="tokens of each shared prefix")
    work.add_argument(
        "--turns",
        metavar="N",
        help="turns per chat: a turn's prompt is the last turn's prompt and output "
        "plus --prompt-len new tokens (default 1)",
    )
    work.add_argument(
        "--arrival-gap",
        metavar="DIST",
        help="steps between chats' arrivals, 0 for all at once (default 0)",
    )
    work.add_argument(
        "--seed", metavar="N", help="seed of the synthetic draw (default 0)"
    )
    run = parser.add_argument_group("run")
    run.add_argument(
        "--prefill-rate",
        metavar="TOKENS",
        help="prefill tokens a second on the simulated clock of a timed trace "
        f"(default {DEFAULT_PREFILL_RATE:,.0f})",
    )
    run.add_argument(
        "--decode-rate",
        metavar="STEPS",
        help="decode steps a second on the simulated clock: a step that decodes "
        f"costs 1/STEPS s more (default {DEFAULT_DECODE_RATE:,.0f})",
    )
    run.add_argument(
        "--max-steps",
        metavar="N",
        help="stop after N steps; the rest are reported unfinished",
    )
    run.add_argument(
        "--keep-finished",
        action="store_true",
        help="finished requests keep their blocks until the run ends (measures "
        "how many fit together, as the capacity model counts)",
    )
    run.add_argument(
        "--validate",
        action="store_true",
        help="check every prefix hit against a model of what each block holds "
        "(reported as invalid hits; slower)",
    )
    out = parser.add_argument_group("output")
    out.add_argument(
        "--json",
        action="store_true",
        help=f"print the figures as JSON (its schema member is {SIMULATE_SCHEMA_VERSION!r}; fields in the docs)",
    )
    out.add_argument(
        "--svg",
        metavar="FILE",
        help="draw prefix-hit rate against --memory (a comma-separated list of "
        "sizes replays the workload at each) as SVG; needs matplotlib",
    )
    out.add_argument("--png", metavar="FILE", help="the same picture as PNG")
    parser.set_defaults(func=lazy_command("simulate", "_cmd_simulate"))


def register_convert(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``kvcore convert``."""
    parser = sub.add_parser(
        "convert",
        help="write a model file from a Hugging Face config.json",
        description="Map a model's config.json (a file, a directory holding one, "
        "or a hub id ORG/NAME read through huggingface_hub) to a kvcore model "
        "file, so it can be read, edited and planned.",
    )
    parser.add_argument(
        "source", nargs="?", metavar="ORG/NAME", help="a hub id (or a config.json path)"
    )
    parser.add_argument(
        "--hf-config", metavar="PATH", help="a config.json, or a directory holding one"
    )
    parser.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="where to write the model file (stdout if absent)",
    )
    parser.set_defaults(func=lazy_command("convert", "_cmd_convert"))


def register_info(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    kinds = sub.add_parser("kinds", help="list the registered cache kinds")
    kinds.add_argument("--json", action="store_true", help="print JSON")
    kinds.set_defaults(func=lazy_command("info", "_cmd_kinds"))
    plugins = sub.add_parser("plugins", help="list the loaded plugins")
    plugins.add_argument("--json", action="store_true", help="print JSON")
    plugins.add_argument(
        "--check",
        action="store_true",
        help="exit with status 1 if any plugin is broken (they are listed either way)",
    )
    plugins.set_defaults(func=lazy_command("info", "_cmd_plugins"))


#: The commands, in the order ``kvcore --help`` lists them.
#: (Each takes the subparsers action of any parser class.)
COMMANDS: tuple[Callable[[Any], None], ...] = (
    register_plan,
    register_simulate,
    register_convert,
    register_info,
)
