"""Replay a workload through the real block coordinator and report what
happened: prefix hits, blocks in use per group, refusals and preemptions.

Data flows one way: a :class:`Workload` (synthetic, or read from a trace
file) goes through a :class:`Driver` (a small continuous-batching
scheduler over :class:`~kvcore.coordinator.KVCacheManager`) into a
:class:`SimulationResult`.
"""

from __future__ import annotations

from kvcore.simulate.bound import ComputedPrefixes
from kvcore.simulate.driver import Driver, ProgressCallback, SimulationError, simulate
from kvcore.simulate.lengths import Distribution, DistributionError, parse_distribution
from kvcore.simulate.oracle import ContentOracle
from kvcore.simulate.result import GroupUsage, SimulationResult, Unserved
from kvcore.simulate.trace import TraceError, load_trace, parse_trace
from kvcore.simulate.workload import (
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
