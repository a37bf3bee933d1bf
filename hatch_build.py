"""Build hook: compile kvcore's optional prompt hashing
(``kvcore/coordinator/_chainhash.c``) when a C compiler and OpenSSL's
headers are there; otherwise warn and build kvcore without it (every code
path has a Python twin).  ``KVCORE_NO_EXTENSION=1`` skips the compile."""

from __future__ import annotations

import os
import shlex
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCE = Path("kvcore") / "coordinator" / "_chainhash.c"


class ChainHashBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        root = Path(self.root)
        source = root / SOURCE
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        target = source.with_name("_chainhash" + suffix)
        # A module left by an earlier build never outlives its source.
        target.unlink(missing_ok=True)
        linker = sysconfig.get_config_var("LDSHARED")
        if os.environ.get("KVCORE_NO_EXTENSION") or not (source.exists() and linker):
            return
        command = [
            *shlex.split(linker),
            *shlex.split(sysconfig.get_config_var("CCSHARED") or ""),
            "-O2",
            f"-I{sysconfig.get_paths()['include']}",
            str(source),
            "-o",
            str(target),
            "-lcrypto",
        ]
        try:
            subprocess.run(command, check=True, capture_output=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            self.app.display_warning(
                "kvcore: the compiled prompt hashing was not built "
                f"({exc}; {detail.decode(errors='replace').strip()[:300]}); "
                "kvcore runs without it, hashing in Python"
            )
            return
        if version != "editable":
            build_data["pure_python"] = False
            build_data["infer_tag"] = True
            build_data["force_include"][str(target)] = str(target.relative_to(root))
