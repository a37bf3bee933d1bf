"""The views of kvcore's pool and managers that vLLM's scheduler and its
tests read: the block pool (``block_pool.blocks``, ``null_block``, the free
queue, deferred frees), and each group's manager with its request tables.
kvcore passes block ids; vLLM gets and gives block objects, the pool's
read-only views (:meth:`BlockPool.block`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, overload

from kvcore.coordinator.block_pool import BlockPool
from kvcore.coordinator.blocks import BlockId, KVCacheBlock

__all__ = [
    "BlockPoolView",
    "ManagerView",
    "PlannedRequest",
    "ids_of",
    "table_extensions",
    "view_type",
    "views_of",
]


class FreeQueueView:
    """vLLM's ``free_block_queue`` counters over kvcore's free queue."""

    __slots__ = ("_pool",)

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool

    @property
    def num_free_blocks(self) -> int:
        return self._pool.free_queue.num_free

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        view = self._pool.block
        return [view(b) for b in self._pool.eviction_order()]


class BlockViews(Sequence[KVCacheBlock]):
    """vLLM's ``block_pool.blocks``: every block of the pool as its view,
    made when read."""

    __slots__ = ("_pool",)

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool

    def __len__(self) -> int:
        return self._pool.num_blocks

    @overload
    def __getitem__(self, index: int) -> KVCacheBlock: ...
    @overload
    def __getitem__(self, index: slice) -> list[KVCacheBlock]: ...
    def __getitem__(self, index: int | slice) -> KVCacheBlock | list[KVCacheBlock]:
        pool = self._pool
        ids = range(pool.num_blocks)[index]  # raises IndexError as a list does
        return pool.block(ids) if isinstance(ids, int) else [pool.block(b) for b in ids]


class TableViews(Mapping[str, list[KVCacheBlock]]):
    """One group's request tables as vLLM reads them: each a list of block
    views, made when read, over kvcore's table of block ids."""

    __slots__ = ("_pool", "_tables")

    def __init__(self, tables: dict[str, list[BlockId]], pool: BlockPool) -> None:
        self._tables = tables
        self._pool = pool

    def __getitem__(self, request_id: str) -> list[KVCacheBlock]:
        view = self._pool.block
        return [view(b) for b in self._tables[request_id]]

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._tables

    def __iter__(self) -> Iterator[str]:
        return iter(self._tables)

    def __len__(self) -> int:
        return len(self._tables)


def views_of(pool: BlockPool, ids: Iterable[BlockId]) -> list[KVCacheBlock]:
    """Block ids as the pool's block views."""
    view = pool.block
    return [view(b) for b in ids]


def ids_of(blocks: Sequence[Sequence[KVCacheBlock]]) -> tuple[list[BlockId], ...]:
    """Per-group lists of block objects (views) as block ids."""
    return tuple([b.block_id for b in group] for group in blocks)


class BlockPoolView:
    """The block-pool calls vLLM's scheduler makes (deferred frees, counts,
    evictions), each one kvcore transaction."""

    def __init__(
        self, pool: BlockPool, free_popped: Callable[[list[int]], bool]
    ) -> None:
        self.pool = pool
        #: Finishes the free of a list ``pop_blocks_for_free`` handed out
        #: (the coordinator's ``free_popped``); False for other blocks.
        self.free_popped = free_popped
        self.hash_block_size = pool.hash_block_size
        self.null_block = pool.block(pool.null_block)
        self.num_gpu_blocks = pool.num_blocks
        self.free_block_queue = FreeQueueView(pool)
        self.blocks = BlockViews(pool)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block, tail first as given (vLLM's
        deferred frees, once the step that read them has completed).  A
        list ``pop_blocks_for_free`` handed out (in any order) is freed as
        ``free`` of its request would be now; it must come back whole, as
        vLLM's scheduler frees it (pieces are freed as plain blocks, and
        the request's held-back blocks and kept states stay where they
        are)."""
        pool = self.pool
        ids = [b.block_id for b in ordered_blocks]
        pool.begin()
        try:
            if not self.free_popped(ids):
                pool.free_blocks(ids)
        except BaseException:
            pool.rollback()
            raise
        pool.commit()

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """``num_blocks`` free blocks, each with one reference."""
        pool = self.pool
        pool.begin()
        try:
            blocks = pool.get_new_blocks(num_blocks)
        except BaseException:
            pool.rollback()
            raise
        pool.commit()
        return views_of(pool, blocks)

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drop the prefix-cache key of each block (a block in use stays with
        its holders; a free one is reused first)."""
        pool = self.pool
        pool.begin()
        try:
            pool.drop_from_cache_n(
                [
                    bid
                    for bid in sorted(block_ids)
                    if type(bid) is int and 0 <= bid < pool.num_blocks
                ]
            )
        except BaseException:
            pool.rollback()
            raise
        pool.commit()

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """One cached block per group for ``block_hash``, or None."""
        hit = self.pool.get_cached_block(block_hash, kv_cache_group_ids)
        return None if hit is None else views_of(self.pool, hit)

    def get_num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    def get_usage(self) -> float:
        return self.pool.get_usage()

    def take_events(self) -> list[Any]:
        return self.pool.take_events()

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()


class ManagerView:
    """What vLLM's scheduler (and its tests) read of one group's manager:
    its group, block size and vLLM spec, and the request tables, kvcore's
    own read as block views (the null block at positions a request no
    longer reads)."""

    def __init__(self, manager: Any, spec: Any, pool: BlockPoolView) -> None:
        self.kv_cache_group_id = manager.kv_cache_group_id
        self.block_size = manager.block_size
        self.kv_cache_spec = spec
        self.block_pool = pool
        self.req_to_blocks = TableViews(manager.req_to_blocks, pool.pool)
        self.num_cached_block = manager.num_cached_block
        self._null_block = pool.null_block


@functools.cache
def cross_attention_view() -> type[ManagerView]:
    """The view of a cross-attention group: also a vLLM
    ``CrossAttentionManager``, the class by which vLLM's code and tests tell
    the group (only the view's attributes are read; kvcore runs it)."""
    from vllm.v1.core.single_type_kv_cache_manager import CrossAttentionManager

    bases = (ManagerView, CrossAttentionManager)
    return type("CrossAttentionManagerView", bases, {})


def view_type(spec: Any) -> type[ManagerView]:
    from vllm.v1.kv_cache_interface import CrossAttentionSpec

    if isinstance(spec, CrossAttentionSpec):
        return cross_attention_view()
    return ManagerView


class PlannedRequest:
    """An engine's request as kvcore's checkpoint planning reads it at
    admission: the request's own attributes, and how far its lookup found
    the prompt shared (``shared_prefix_tokens``, which kvcore's own
    ``Request`` carries and an engine's does not)."""

    __slots__ = ("_request", "shared_prefix_tokens")

    def __init__(self, request: Any, shared_prefix_tokens: int) -> None:
        self._request = request
        self.shared_prefix_tokens = shared_prefix_tokens

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


def table_extensions(
    managers: Sequence[Any],
    rid: str,
    lengths: Sequence[int],
    new: tuple[list[BlockId], ...],
) -> tuple[list[BlockId], ...]:
    """A running request's new table positions per group, from the table
    lengths before the step.  vLLM's workers append a running request's new
    block ids to their tables, so a group that grows by more positions than
    new blocks (a state group keeps the null block where it holds no state)
    must hand out its whole extension, nulls included, else the worker's
    positions shift."""
    out: list[list[BlockId]] | None = None
    for gid, (manager, length) in enumerate(zip(managers, lengths, strict=True)):
        table = manager.req_to_blocks.get(rid, ())
        if len(table) - length != len(new[gid]):
            if out is None:
                out = list(new)
            out[gid] = list(table[length:])
    return new if out is None else tuple(out)
