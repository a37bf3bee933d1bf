"""The names of kvcore's choices, without torch.

The command-line parser builds its choice lists from this module, so
``kvcore --help`` never imports torch; :mod:`kvcore.config` and
:mod:`kvcore.serving` import these same names (one list each).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["CACHE_DTYPE_NAMES", "PACKING_POLICIES", "STATE_CACHE_MODES"]

#: The packing policies kvcore ships (see :mod:`kvcore.plan.policies`).
PACKING_POLICIES = ("min_waste", "seed")

#: The recurrent-state caching modes an engine runs (``--mamba-cache-mode``).
STATE_CACHE_MODES = ("none", "align", "all")

#: Every ``--kv-cache-dtype`` name kvcore accepts (lower case) and the name of
#: its torch dtype; ``auto`` (``None``) keeps the model file's dtypes.
#: ``fp8`` means e4m3, as in vLLM and SGLang; ``fp8_inc`` is the e4m3 cache of
#: Intel Gaudi (Intel Neural Compressor), the same bytes per element.
#: :data:`kvcore.serving.CACHE_DTYPE_ALIASES` maps them to torch dtypes.
CACHE_DTYPE_NAMES: Mapping[str, str | None] = MappingProxyType(
    {
        "auto": None,
        "fp8": "float8_e4m3fn",
        "fp8_e4m3": "float8_e4m3fn",
        "fp8_inc": "float8_e4m3fn",
        "fp8_e5m2": "float8_e5m2",
        "bfloat16": "bfloat16",
        "bf16": "bfloat16",
        "float16": "float16",
        "fp16": "float16",
        "half": "float16",
        "float32": "float32",
        "fp32": "float32",
        "float": "float32",
    }
)
