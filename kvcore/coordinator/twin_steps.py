"""What :class:`~kvcore.coordinator.manager.SingleTypeManager` derives when
a subclass is defined: the twin step of a class that overrides only a
one-group step, and the promise flags an override drops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["PROMISES", "TWIN_STEPS"]


def _each_twin(single: str, *, returns: str = "blocks", zipped: bool = False) -> Any:
    """The twin step of a class that overrides only the one-group step
    ``single``: each twin asked in turn (``zipped``: the last argument is
    one list per twin, each twin given its own).  ``returns``: ``blocks``,
    what the twins returned, or None when no twin took a block;
    ``answers``, the list of answers, one per twin; ``nothing``, None."""

    def step(self: Any, twins: Sequence[Any], *args: Any) -> Any:
        if zipped:
            *shared, lists = args
            out = [
                getattr(type(twin), single)(twin, *shared, own)
                for twin, own in zip(twins, lists, strict=True)
            ]
        else:
            out = [getattr(type(twin), single)(twin, *args) for twin in twins]
        if returns == "answers":
            return out
        return out if returns == "blocks" and any(out) else None

    step.__name__ = f"{single}_each"
    return step


#: (flag, the methods whose override drops its promise): see
#: :meth:`SingleTypeManager.__init_subclass__`.
PROMISES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("caches_at_chunk_ends", ("cache_blocks", "cache_twins")),
    (
        "grows_by_count",
        ("get_num_blocks_to_allocate", "allocate_new_blocks", "allocate_twins"),
    ),
    ("releases_by_count", ("remove_skipped_blocks", "release_twins")),
)

#: (one-group step, twin step, the twin step through the one-group one).
TWIN_STEPS: tuple[tuple[str, str, Any], ...] = tuple(
    (single, twins, _each_twin(single, **how))
    for single, twins, how in (
        ("allocate_new_blocks", "allocate_twins", {}),
        ("remove_skipped_blocks", "release_twins", {"returns": "nothing"}),
        ("cache_blocks", "cache_twins", {"returns": "nothing"}),
        ("pop_blocks", "pop_twins", {"returns": "answers"}),
        ("kept_for_later", "kept_twins", {"returns": "answers", "zipped": True}),
        (
            "kept_if_room",
            "kept_if_room_twins",
            {"returns": "answers", "zipped": True},
        ),
    )
)
