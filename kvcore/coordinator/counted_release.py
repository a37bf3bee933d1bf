"""The release a step counts on.  A running request that skips blocks may
run a step the free queue cannot hold yet, when the blocks its release
returns make up the difference: each skipping manager says how many with
``count_freeable_skipped``.  The core checks those answers where they cross
in (an int of at least 0), and, for a step that fits only by them, that the
pool holds what the step needs once the release has run: an overstated
count would otherwise surface as the pool running dry in the allocation
that follows, blamed on a manager that did nothing wrong."""

from __future__ import annotations

from typing import Any

from kvcore.coordinator.plugin_results import BadCount
from kvcore.errors import PluginResultError

__all__ = ["freeable_counts", "overstated_release"]

METHOD = "count_freeable_skipped"

#: The coordinator (a :class:`~kvcore.coordinator.coordinator.KVCacheCoordinator`,
#: which imports this module).
Coordinator = Any


def freeable_counts(
    coordinator: Coordinator, request_id: str, num_computed_tokens: int
) -> list[int]:
    """Each skipping manager's ``count_freeable_skipped``, checked: an int
    of at least 0, else a :class:`PluginResultError` naming the manager."""
    managers = coordinator.skipping
    counts: list[int] = coordinator._each(
        managers, METHOD, request_id, num_computed_tokens, reads=True
    )
    for manager, count in zip(managers, counts, strict=True):
        if type(count) is not int or count < 0:
            gid = manager.kv_cache_group_id
            raise coordinator.plugin_error(gid, METHOD, BadCount(count))
    return counts


def overstated_release(
    coordinator: Coordinator, step: tuple[str, int], needed: int
) -> PluginResultError:
    """The error for a step that fitted only by the skipping managers'
    ``count_freeable_skipped`` answers (``step``: the request and its
    computed tokens), after whose release the pool holds fewer than the
    ``needed`` free blocks: the counts claimed blocks the release did not
    return.  Names the managers that still count blocks to free once their
    release has run (an honest count is then 0), else every skipping
    manager, and the first one's plugin."""
    request_id, num_computed_tokens = step
    free = coordinator.block_pool.free_queue.num_free
    skipping = coordinator.skipping
    left = freeable_counts(coordinator, request_id, num_computed_tokens)
    suspects = [m for m, n in zip(skipping, left, strict=True) if n] or skipping
    owners = []
    for manager in suspects:
        gid = manager.kv_cache_group_id
        owner = f"{type(manager).__module__}.{type(manager).__qualname__}"
        owners.append(
            f"{owner} of cache group {gid} (kind {manager.kv_cache_spec.kind!r}, "
            f"plugin {coordinator._owners[gid]!r})"
        )
    lead = suspects[0]
    plugin = coordinator._owners[lead.kv_cache_group_id]
    msg = (
        f"{METHOD} of {'; '.join(owners)} counted the blocks releasing request "
        f"{request_id!r} at {num_computed_tokens} computed tokens returns to the "
        f"pool as free, and the step fitted only by them, but after "
        f"remove_skipped_blocks the pool holds {free} free blocks where the step "
        f"needs {needed}: the count claimed blocks the release did not return. "
        f"{METHOD} must count the blocks remove_skipped_blocks frees (those it "
        "releases whose reference count is 1), never more. The step was undone "
        "and the block pool is as it was before it; fix the plugin or block it "
        f"with KVCORE_DISABLE_PLUGINS={plugin}"
    )
    return PluginResultError(msg, plugin_name=plugin)
