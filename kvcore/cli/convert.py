"""``kvcore convert``: a model file from a Hugging Face ``config.json``.

The mapper's answer, written out so a person can read and edit it before
planning with it (``kvcore plan model.json``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvcore.cli.options import CliUsageError
from kvcore.mapping import MapperRegistry, ModelConfig, read_model_config
from kvcore.plugins import get_plugin_manager
from kvcore.registry import KindRegistry
from kvcore.serialize import dump_model_file

__all__ = ["register"]


def source_config(args: argparse.Namespace) -> ModelConfig:
    """The configuration ``--hf-config`` or the positional source names."""
    given = [s for s in (args.hf_config, args.source) if s]
    if len(given) != 1:
        msg = (
            "give one source: --hf-config PATH (a config.json or a directory "
            "holding one) or a hub id ORG/NAME"
        )
        raise CliUsageError(msg)
    return read_model_config(given[0])


def _cmd_convert(args: argparse.Namespace) -> int:
    from kvcore.mapping import map_model_config

    config = source_config(args)
    pm = get_plugin_manager()
    registry = KindRegistry.from_plugin_manager(pm)
    model = map_model_config(
        config, mappers=MapperRegistry.from_plugin_manager(pm), registry=registry
    )
    text = dump_model_file(model, registry)
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text, encoding="utf-8")
        print(
            f"wrote {args.output}: {model.name}, {len(model.layers)} cache layers",
            file=sys.stderr,
        )
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    parser.set_defaults(func=_cmd_convert)
