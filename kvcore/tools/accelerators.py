"""Accelerators people plan for, with the memory each one carries.

``--gpu NAME`` looks a device up here.  Capacities are the vendors' nominal
figures in GiB (HBM stacks are sized in powers of two); a driver reports a
little less once it reserves its own share (an H100 80GB shows about 79.6
GiB), so pass ``--memory`` for an exact budget.  Names match loosely:
case, spaces, dashes and a trailing ``GB`` do not matter, and each entry
lists the aliases people type.
"""

from __future__ import annotations

import difflib
import re

import attrs

from kvcore.errors import KvcoreKeyError

__all__ = ["ACCELERATORS", "Accelerator", "UnknownAcceleratorError", "find_accelerator"]

GIB = 1024**3


@attrs.frozen
class Accelerator:
    """One device: its display name, vendor, memory and the names it goes by."""

    name: str
    vendor: str
    memory_gib: int
    aliases: tuple[str, ...] = ()

    @property
    def memory_bytes(self) -> int:
        return self.memory_gib * GIB


#: The table ``--gpu`` reads, documented in the CLI reference.
ACCELERATORS: tuple[Accelerator, ...] = (
    Accelerator("A10G 24GB", "NVIDIA", 24, ("a10g", "a10")),
    Accelerator("L4 24GB", "NVIDIA", 24, ("l4",)),
    Accelerator("RTX 4090 24GB", "NVIDIA", 24, ("rtx4090", "4090")),
    Accelerator("RTX 5090 32GB", "NVIDIA", 32, ("rtx5090", "5090")),
    Accelerator("A100 40GB", "NVIDIA", 40, ("a100-40gb", "a100-40")),
    Accelerator("A100 80GB", "NVIDIA", 80, ("a100", "a100-80gb", "a100-80")),
    Accelerator("L40S 48GB", "NVIDIA", 48, ("l40s", "l40")),
    Accelerator("RTX 6000 Ada 48GB", "NVIDIA", 48, ("rtx6000ada", "rtx6000-ada")),
    Accelerator(
        "RTX PRO 6000 Blackwell 96GB", "NVIDIA", 96, ("rtxpro6000", "rtx-pro-6000")
    ),
    Accelerator(
        "H100 80GB",
        "NVIDIA",
        80,
        ("h100", "h100-80gb", "h100-sxm", "h100-pcie", "h800"),
    ),
    Accelerator("H100 NVL 94GB", "NVIDIA", 94, ("h100nvl", "h100-nvl")),
    Accelerator("H20 96GB", "NVIDIA", 96, ("h20",)),
    Accelerator("GH200 96GB", "NVIDIA", 96, ("gh200",)),
    Accelerator("H200 141GB", "NVIDIA", 141, ("h200", "h200-nvl")),
    Accelerator("B200 180GB", "NVIDIA", 180, ("b200",)),
    Accelerator("GB200 186GB", "NVIDIA", 186, ("gb200",)),
    Accelerator("B300 288GB", "NVIDIA", 288, ("b300", "gb300")),
    Accelerator("MI250X 128GB", "AMD", 128, ("mi250x", "mi250")),
    Accelerator("MI300X 192GB", "AMD", 192, ("mi300x",)),
    Accelerator("MI300A 128GB", "AMD", 128, ("mi300a",)),
    Accelerator("MI325X 256GB", "AMD", 256, ("mi325x",)),
    Accelerator("MI355X 288GB", "AMD", 288, ("mi355x", "mi350x")),
    Accelerator("Gaudi 3 128GB", "Intel", 128, ("gaudi3", "gaudi-3")),
    Accelerator("TPU v5e 16GB", "Google", 16, ("tpuv5e", "v5e")),
    Accelerator("TPU v5p 95GB", "Google", 95, ("tpuv5p", "v5p")),
    Accelerator("TPU v6e 32GB", "Google", 32, ("tpuv6e", "v6e", "trillium")),
)


class UnknownAcceleratorError(KvcoreKeyError):
    """``--gpu`` names a device the table does not hold."""


def _key(name: str) -> str:
    return re.sub(r"[\s_\-]+", "", name.lower())


def _index() -> dict[str, Accelerator]:
    index: dict[str, Accelerator] = {}
    for acc in ACCELERATORS:
        for name in (acc.name, *acc.aliases):
            index[_key(name)] = acc
    return index


def find_accelerator(name: str) -> Accelerator:
    """The device called ``name`` (``"H100"``, ``"h100-80gb"``, ``"MI300X"``)."""
    index = _index()
    key = _key(name)
    if key in index:
        return index[key]
    if key.endswith("gb") and key[:-2] in index:
        return index[key[:-2]]
    if key.endswith("g") and key + "b" in index:  # A100-80G
        return index[key + "b"]
    known = ", ".join(acc.name for acc in ACCELERATORS)
    names = {n: acc.name for acc in ACCELERATORS for n in (acc.name, *acc.aliases)}
    close = difflib.get_close_matches(key, [_key(n) for n in names], n=6, cutoff=0.6)
    suggested = list(dict.fromkeys(index[k].name for k in close))[:3]
    hint = (
        f" (did you mean {' or '.join(repr(n) for n in suggested)}?)"
        if suggested
        else ""
    )
    msg = (
        f"unknown GPU {name!r}{hint}; known: {known} "
        "(or give the memory itself with --memory 80GiB)"
    )
    raise UnknownAcceleratorError(msg)
