"""pytest plugin for the kvcore side of the vLLM peer suite
(``run_vllm_suite.py``): loads vLLM's general plugins with ``KVCORE_VLLM=1``,
as a vLLM process does, and refuses to run unless vLLM's scheduler then
builds kvcore's manager."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("KVCORE_VLLM") != "1":
        raise pytest.UsageError("kvcore_vllm_peer runs with KVCORE_VLLM=1 only")
    from vllm.plugins import load_general_plugins
    from vllm.v1.core.sched import scheduler

    load_general_plugins()
    import kvcore.integrations.vllm as kvcore_vllm

    if scheduler.KVCacheManager is not kvcore_vllm.KVCacheManager:
        raise pytest.UsageError(
            "KVCORE_VLLM=1 but vLLM's scheduler is not on kvcore: is kvcore "
            "installed in this environment (its vllm.general_plugins entry point)?"
        )
