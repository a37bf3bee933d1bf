"""Build hook: compile kvcore's optional prompt hashing
(``kvcore/coordinator/_chainhash.c``) when a C compiler and OpenSSL's
headers are there; otherwise warn and build kvcore without it (every code
path has a Python twin).  ``KVCORE_NO_EXTENSION`` set to anything but
``0`` or empty skips the compile.
Nothing here can fail a build."""

from __future__ import annotations

import contextlib
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
        try:
            target = self._compile()
        except Exception as exc:  # a build never fails for want of the module
            self.app.display_warning(
                f"kvcore: the compiled prompt hashing was not built ({exc}); "
                "kvcore runs without it, hashing in Python"
            )
            return
        if target is not None and version != "editable":
            build_data["pure_python"] = False
            build_data["infer_tag"] = True
            build_data["force_include"][str(target)] = str(
                target.relative_to(self.root)
            )

    def _compile(self) -> Path | None:
        """The compiled module's path, or None where it is not built."""
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        if not suffix:
            return None  # no name the interpreter imports a module by
        source = Path(self.root) / SOURCE
        target = source.with_name("_chainhash" + suffix)
        # A module left by an earlier build never outlives its source (a
        # read-only tree holds none to remove).
        with contextlib.suppress(OSError):
            target.unlink(missing_ok=True)
        linker = sysconfig.get_config_var("LDSHARED")
        if os.environ.get("KVCORE_NO_EXTENSION", "0") not in ("", "0"):
            return None
        if not (source.exists() and linker):
            return None
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
        done = subprocess.run(command, capture_output=True, timeout=300, check=False)
        if done.returncode:
            detail = done.stderr.decode(errors="replace").strip()[-300:]
            msg = f"{command[0]} exited {done.returncode}: {detail}"
            raise RuntimeError(msg)
        return target
