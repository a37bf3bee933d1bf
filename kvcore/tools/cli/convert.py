"""``kvcore convert``: a model file from a Hugging Face ``config.json``.

The mapper's answer, written out so a person can read and edit it before
planning with it (``kvcore plan model.json``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvcore.errors import escape_controls
from kvcore.plugins import get_plugin_manager
from kvcore.registry import KindRegistry
from kvcore.serialize import ModelFile, dump_model_file
from kvcore.serving import ServingChoices
from kvcore.tools.cli.options import CliUsageError, read_plugin_model

__all__ = ["source_model"]


def source_model(args: argparse.Namespace, registry: KindRegistry) -> ModelFile:
    """The model ``--hf-config`` or the positional source names, read by
    an installed plugin."""
    given = [s for s in (args.hf_config, args.source) if s]
    if len(given) != 1:
        msg = (
            "give one source: --hf-config PATH (a config.json or a directory "
            "holding one) or a hub id ORG/NAME"
        )
        raise CliUsageError(msg)
    model = read_plugin_model(
        given[0], ServingChoices(), registry, allow_hub=args.hf_config is None
    )
    if model is None:
        msg = (
            f"{escape_controls(given[0])} is neither a config.json nor a hub id an "
            "installed plugin reads"
        )
        raise CliUsageError(msg)
    return model


def _cmd_convert(args: argparse.Namespace) -> int:
    registry = KindRegistry.from_plugin_manager(get_plugin_manager())
    model = source_model(args, registry)
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
