"""Copy-on-write partial-block hits.

A group whose kind allows it (every layer's spec declares
:attr:`~kvcore.KVCacheSpec.copies_partial_block_hits` and the manager class
sets :attr:`~kvcore.coordinator.manager.SingleTypeManager.partial_copy_hits`)
may serve a prefix hit that ends inside one of its blocks, at a multiple of
its *hit unit* ``lcm(hash block, each layer's tokens_per_state)``.  That last
block is not shared: the new request gets a fresh block at its position and
the engine copies the cached block into it before the step's forward pass
(a :class:`BlockCopy`).  The copied slots are the prefix; the request
overwrites the rest as it computes.

How the pieces fit:

- **keys**: once a request's tokens up to a chunk end ``c`` (a multiple of
  the unit, not a block end) are computed, the block holding ``c`` is
  registered under that chunk's hash as a *partial key* of its group
  (:func:`register_partial_keys`, :meth:`BlockPool.add_partial_key`).  Only
  computed tokens are keyed (``request.num_computed_tokens``), never the
  slots a step is about to write, because a copy runs before the forward.
- **search**: the run of full-block hits is extended by at most one block
  found by partial key at the deepest unit boundary below the next block end
  (:func:`partial_prefix_hit`); a group's hit list then holds
  ``ceil(P / block)`` entries, the last being the copy source.
- **admission**: :func:`split_copy_sources` takes the source out of the
  blocks attached; a fresh block takes its position and a copy is recorded.
  A source whose copied tokens a step in flight writes (a full key is given
  when a step is scheduled) holds the admission back a step
  (:mod:`kvcore.coordinator.unwritten`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvcore.coordinator.block_pool import BlockPool
from kvcore.coordinator.blocks import BlockCopy
from kvcore.coordinator.manager import HitQuery
from kvcore.coordinator.managers import prefix_hit
from kvcore.coordinator.request import Request
from kvcore.plan import effective_block_size
from kvcore.plan.block_sizes import group_hit_unit
from kvcore.spec import HitPolicy

if TYPE_CHECKING:
    from kvcore.coordinator.manager import SingleTypeManager
    from kvcore.registry import KindRegistry

__all__ = [
    "BlockCopy",
    "PartialKeys",
    "copy_hit_units",
    "partial_prefix_hit",
    "split_copy_sources",
]


def partial_prefix_hit(query: HitQuery, unit: int) -> tuple[list[list[int]], int]:
    """A prefix search that may end inside a block: the run of cached full
    blocks, then at most one block holding a partial key at the deepest
    boundary below the next block end that is a multiple of ``unit`` and of
    ``query.alignment``, within ``query.max_length`` and the hashed chunks.
    Returns the block lists (one per group id) and the hit in tokens."""
    block_size = query.block_size
    hash_size = query.hash_block_size
    pool = query.block_pool
    group_ids = query.group_ids
    hits = prefix_hit(
        query.block_hashes,
        query.max_blocks,
        group_ids,
        pool,
        block_size,
        block_size,
    )
    full = len(hits[0]) * block_size
    step = math.lcm(unit, query.alignment, hash_size)
    chunks = query.chunk_hashes
    end = min(query.max_length, full + block_size - 1, len(chunks) * hash_size)
    end -= end % step
    while end > full:
        found = pool.lookup_partial(chunks[end // hash_size - 1], group_ids)
        if found is not None:
            for blocks, block in zip(hits, found, strict=True):
                blocks.append(block)
            return hits, end
        end -= step
    return hits, full


def copy_source_valid(
    pool: BlockPool,
    block: int,
    group_id: int,
    full_key: object,
    chunk_key: object,
) -> bool:
    """Whether ``block`` still holds a prefix a copy may read: its full key
    (the whole block is the prefix) or the partial key of the hit's end."""
    key = pool.key_hash[block]
    if key is not None and pool.key_group[block] == group_id and key == full_key:
        return True
    return chunk_key is not None and pool.has_partial_key(
        block,
        chunk_key,  # type: ignore[arg-type]
        group_id,
    )


class PartialKeys:
    """The coordinator's partial-key bookkeeping: for each group that serves
    copy-on-write hits, how far each live request's partial keys are
    registered (so a step keys only its new chunk ends)."""

    __slots__ = ("groups", "marks", "pool", "steps")

    def __init__(
        self, pool: BlockPool, groups: Sequence[tuple[SingleTypeManager, int]]
    ):
        self.pool = pool
        #: ``(manager, unit)`` of every partial-hit group.
        self.groups = tuple(groups)
        #: The groups' spacings of partial-key ends, in tokens (each once).
        self.steps = tuple(
            sorted({math.lcm(unit, m.hash_block_size) for m, unit in self.groups})
        )
        #: request id -> tokens up to which its partial keys are registered.
        self.marks: dict[str, int] = {}

    def _span(self, request: Request, num_tokens: int) -> tuple[int, int]:
        """Where registering at ``num_tokens`` starts (the request's mark)
        and ends: its computed, hashed tokens up to ``num_tokens``."""
        top = min(
            num_tokens,
            request.num_computed_tokens,
            len(request.block_hashes) * self.pool.hash_block_size,
        )
        return self.marks.get(request.request_id, 0), top

    def keys_nothing(self, request: Request, num_tokens: int) -> bool:
        """Whether :meth:`register` at ``num_tokens`` would key nothing: no
        group's partial-key end lies past the request's mark and up to
        ``num_tokens``.  Such a call may be passed over: a later one scans
        from the same mark."""
        mark, top = self._span(request, num_tokens)
        return all(mark - mark % step + step > top for step in self.steps)

    def register(self, request: Request, num_tokens: int) -> None:
        """Register the partial keys of ``request``'s computed chunk ends
        below ``num_tokens`` (see :func:`register_partial_keys`)."""
        rid = request.request_id
        mark, top = self._span(request, num_tokens)
        if top <= mark:
            return
        marks = self.marks
        for manager, unit in self.groups:
            register_partial_keys(manager, unit, request, mark, top)
        marks[rid] = top
        self.pool.record(_restore, marks, rid, mark)

    def forget(self, request_id: str) -> None:
        self.marks.pop(request_id, None)


def _restore(marks: dict[str, int], rid: str, mark: int) -> None:
    if mark:
        marks[rid] = mark
    else:
        marks.pop(rid, None)


def register_partial_keys(
    manager: SingleTypeManager, unit: int, request: Request, low: int, top: int
) -> None:
    """Key the blocks of ``request`` in ``manager``'s group at every chunk
    end in ``(low, top]`` that is a multiple of ``unit`` but not a block end."""
    blocks = manager.req_to_blocks.get(request.request_id)
    if not blocks:
        return
    block_size = manager.block_size
    hash_size = manager.hash_block_size
    step = math.lcm(unit, hash_size)
    chunks = request.block_hashes
    gid = manager.kv_cache_group_id
    add = manager.block_pool.add_partial_keys
    top = min(top, len(blocks) * block_size)
    end = low - low % step + step
    # Block by block: the ends inside each block (a block's own end is
    # its full key's), keyed in one call.
    while end <= top:
        index = end // block_size
        stop = min((index + 1) * block_size, top + 1)
        first = end if end % block_size else end + step
        if first < stop and (block := blocks[index]):
            hashes = [chunks[e // hash_size - 1] for e in range(first, stop, step)]
            add(block, hashes, gid)
        end = -(-stop // step) * step


def split_copy_sources(
    computed: tuple[Sequence[int], ...],
    partial_groups: Sequence[tuple[int, int]],
    hit_end: int,
) -> tuple[tuple[Sequence[int], ...], list[tuple[int, int, int]]]:
    """The hit without its copy sources, and the sources ``(group id, block,
    tokens to copy)``: for each partial-hit group ``(group id, block size)``
    whose hit ends inside a block, the hit's last block."""
    sources: list[tuple[int, int, int]] = []
    out: list[Sequence[int]] | None = None
    for gid, block_size in partial_groups:
        rest = hit_end % block_size
        blocks = computed[gid]
        if not rest or len(blocks) != -(-hit_end // block_size):
            continue
        if out is None:
            out = list(computed)
        sources.append((gid, blocks[-1], rest))
        out[gid] = list(blocks[:-1])
    if out is None:
        return computed, sources
    return tuple(out), sources


def copy_hit_units(
    groups: Sequence[Any], registry: KindRegistry, hash_block_size: int, dcp: int
) -> dict[int, int]:
    """Group id -> copy-on-write hit unit, for the prefix-cacheable groups
    whose layers all declare ``copies_partial_block_hits`` and whose kind's
    manager takes such hits with PrefixManager's own search."""
    out: dict[int, int] = {}
    for gid, group in enumerate(groups):
        spec = group.manager_spec
        if not spec.hashes_blocks or spec.hit_policy is not HitPolicy.PREFIX:
            continue
        kind = registry.kind_for(spec, layer=group.layer_names[0])
        # A class that replaces PrefixManager's search (which the partial
        # search extends) says no.
        if kind.manager_type is None or kind.manager_type.partial_copy_hits is not True:
            continue
        unit = group_hit_unit(group, effective_block_size(group, dcp), hash_block_size)
        if unit is not None:
            out[gid] = unit
    return out
