"""Replay a workload through the real block coordinator and report what
happened: prefix hits, blocks in use per group, refusals and preemptions.

Data flows one way: a :class:`Workload` (synthetic, or read from a trace
file) goes through a :class:`Driver` (a small continuous-batching
scheduler over :class:`~kvcore.coordinator.KVCacheManager`) into a
:class:`SimulationResult`.
"""

from __future__ import annotations

from kvcore.tools.simulate.bound import ComputedPrefixes
from kvcore.tools.simulate.driver import (
    Driver,
    ProgressCallback,
    SimulationError,
    simulate,
)
from kvcore.tools.simulate.lengths import (
    Distribution,
    DistributionError,
    parse_distribution,
)
from kvcore.tools.simulate.oracle import ContentOracle
from kvcore.tools.simulate.result import GroupUsage, SimulationResult, Unserved
from kvcore.tools.simulate.trace import TraceError, load_trace, parse_trace
from kvcore.tools.simulate.workload import (
    NAMED_WORKLOADS,
    Workload,
    WorkloadError,
    WorkloadRequest,
    named_workload,
    synthetic_workload,
    token_stream,
    workload_names,
)

__all__ = [
    "NAMED_WORKLOADS",
    "ComputedPrefixes",
    "ContentOracle",
    "Distribution",
    "DistributionError",
    "Driver",
    "GroupUsage",
    "ProgressCallback",
    "SimulationError",
    "SimulationResult",
    "TraceError",
    "Unserved",
    "Workload",
    "WorkloadError",
    "WorkloadRequest",
    "load_trace",
    "named_workload",
    "parse_distribution",
    "parse_trace",
    "simulate",
    "synthetic_workload",
    "token_stream",
    "workload_names",
]
