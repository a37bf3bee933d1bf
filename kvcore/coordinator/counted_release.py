"""The release a step counts on.  A running request that skips blocks may
run a step the free queue cannot hold yet, when the blocks its release
returns make up the difference: each skipping manager says how many with
``count_freeable_skipped``.  The core checks those answers where they cross
in (an int of at least 0), and, for a step that fits only by them, that the
release returned what was counted: an overstated count would otherwise
surface as the pool running dry in the allocation that follows, blamed on
a manager that did nothing wrong."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcore.coordinator.manager import SingleTypeManager
from kvcore.coordinator.plugin_results import BadCount
from kvcore.errors import PluginResultError

__all__ = ["freeable_counts", "release_as_counted"]

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
        managers, METHOD, request_id, num_computed_tokens
    )
    for manager, count in zip(managers, counts, strict=True):
        if type(count) is not int or count < 0:
            gid = manager.kv_cache_group_id
            raise coordinator.plugin_error(gid, METHOD, BadCount(count))
    return counts


def release_as_counted(
    coordinator: Coordinator, request_id: str, num_computed_tokens: int
) -> None:
    """``remove_skipped_blocks`` for a step that fits only because the blocks
    its release returns were counted as free: one run of twins at a time,
    each checked to return at least the blocks its managers counted.  A run
    that returns fewer is refused, naming ``count_freeable_skipped`` (the
    step is then undone)."""
    counts = dict(
        zip(
            (m.kv_cache_group_id for m in coordinator.skipping),
            freeable_counts(coordinator, request_id, num_computed_tokens),
            strict=True,
        )
    )
    queue = coordinator.block_pool.free_queue
    journal = coordinator.block_pool.journal
    mark = -1 if journal is None else len(journal)
    for run in coordinator._skip_runs:
        before = queue.num_free
        coordinator._run_twins(
            (run,),
            "release_twins",
            "remove_skipped_blocks",
            request_id,
            num_computed_tokens,
        )
        freed = queue.num_free - before
        members = run[1]
        counted = sum(counts.get(m.kv_cache_group_id, 0) for m in members)
        if freed < counted:
            raise _overstated(
                coordinator, members, (request_id, num_computed_tokens), counted, freed
            )
    coordinator._changed(request_id, journal, mark)


def _overstated(
    coordinator: Coordinator,
    members: Sequence[SingleTypeManager],
    step: tuple[str, int],
    counted: int,
    freed: int,
) -> PluginResultError:
    """The error for a run of twins whose release returned ``freed`` blocks
    where their ``count_freeable_skipped`` answers summed to ``counted``."""
    request_id, num_computed_tokens = step
    manager = members[0]
    gid = manager.kv_cache_group_id
    groups = ", ".join(str(m.kv_cache_group_id) for m in members)
    plugin = coordinator._owners[gid]
    distribution = coordinator._distribution(plugin)
    where = f" (distribution {distribution!r})" if distribution else ""
    owner = f"{type(manager).__module__}.{type(manager).__qualname__}"
    msg = (
        f"{owner}.{METHOD} of cache group{'s' if len(members) > 1 else ''} "
        f"{groups} (kind {manager.kv_cache_spec.kind!r}, plugin {plugin!r}"
        f"{where}) counted {counted} blocks that releasing request "
        f"{request_id!r} at {num_computed_tokens} computed tokens returns to "
        f"the pool, but remove_skipped_blocks returned {freed}; the step "
        "counted them as free and would take blocks the pool does not hold. "
        f"{METHOD} must count the blocks remove_skipped_blocks frees (those "
        "it releases whose reference count is 1), never more. The step was "
        "undone and the block pool is as it was before it; fix the plugin or "
        f"block it with KVCORE_DISABLE_PLUGINS={plugin}"
    )
    return PluginResultError(msg, plugin_name=plugin, distribution=distribution)
