"""Single-type managers: the block tables of one cache group.

The coordinator runs one manager per cache group.  Each cache kind's plugin
contributes its manager class (``CacheKind.manager_type``); this module holds
the base class and two generic strategies kinds build on:

- :class:`SingleTypeManager` (the base): a block per ``block_size`` tokens,
  indexed by position, hashed left to right, hit search from the left.
- :class:`FixedBlocksManager`: a fixed number of blocks per request for its
  whole life (a ring, a recurrent state, hot pages), never hashed, no hits.

Everything here is on the scheduler's per-step path: no hook calls, no
per-block allocations beyond the block lists themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from kvcore.coordinator.block_pool import BlockPool, KVCacheBlock
from kvcore.coordinator.hashing import BlockHash, hashes_at_block_size
from kvcore.coordinator.request import Request

__all__ = ["FixedBlocksManager", "SingleTypeManager", "runs_vetted"]

#: Modules of the managers shipped with kvcore.  Their step methods raise
#: nothing once the coordinator has validated a step (counts checked against
#: the free queue, hits checked against the pool), so a step that runs only
#: their code needs no undo record.
_VETTED_MANAGER_MODULES = frozenset(
    {
        "kvcore.coordinator.manager",
        "kvcore_circular_buffer.manager",
        "kvcore_full_attention.manager",
        "kvcore_hisparse.manager",
        "kvcore_mamba.manager",
        "kvcore_sliding_window.manager",
    }
)
#: Modules of the shipped specs whose release rule (``skipped_tokens``) a
#: skipping manager consults in the middle of a step.
_VETTED_SPEC_MODULES = frozenset(
    {"kvcore.spec", "kvcore_mamba", "kvcore_mla", "kvcore_sliding_window"}
)
#: Methods a step may call on a manager.
_STEP_METHODS = (
    "add_computed_blocks",
    "admission_blocks",
    "allocate_new_blocks",
    "cache_blocks",
    "count_freeable_skipped",
    "free",
    "get_num_blocks_to_allocate",
    "num_skipped_blocks",
    "pop_blocks",
    "remove_skipped_blocks",
    "_skip",
    "_skipped",
)


def runs_vetted(manager: SingleTypeManager) -> bool:
    """Whether every step method of ``manager`` is kvcore's own code (its
    class and every base shipped with kvcore, nothing replaced on the
    instance, and for a skipping manager a shipped release rule).  The
    coordinator undoes nothing around such a manager; any other manager's
    steps run inside a transaction (see :meth:`BlockPool.begin`)."""
    for cls in type(manager).__mro__[:-1]:
        if cls.__module__ not in _VETTED_MANAGER_MODULES:
            return False
    state = getattr(manager, "__dict__", {})
    if any(name in state for name in _STEP_METHODS):
        return False
    if manager.skips_blocks:
        rule = getattr(type(manager.kv_cache_spec), "skipped_tokens", None)
        if getattr(rule, "__module__", None) not in _VETTED_SPEC_MODULES:
            return False
    return True


class SingleTypeManager:
    """Block tables of one cache group.

    :param spec: the group's (representative) layer spec.
    :param block_pool: the pool every group draws from.
    :param group_id: this group's index in the plan.
    :param block_size: tokens per block (the spec's, times context parallelism
        where it applies).
    :param hash_block_size: tokens per hashed chunk.
    :param enable_caching: whether prefix caching is on for the engine.
    :param max_model_len: the longest request, in tokens.
    """

    #: A hit found under a bound stays a hit under any smaller aligned bound
    #: (true for left-to-right search), so the coordinator may trim it instead
    #: of searching again.
    monotone_hits: ClassVar[bool] = True
    #: Whether the manager may free blocks a request no longer reads.
    skips_blocks: ClassVar[bool] = False
    #: Whether block lists are indexed by token position (``len * block_size``
    #: covers the request).  False for fixed per-request blocks.
    position_indexed: ClassVar[bool] = True
    #: Whether the table may grow for speculative lookahead tokens.
    supports_lookahead: ClassVar[bool] = True

    def __init__(
        self,
        spec: Any,
        block_pool: BlockPool,
        *,
        group_id: int,
        block_size: int,
        hash_block_size: int,
        enable_caching: bool,
        max_model_len: int,
    ) -> None:
        self.kv_cache_spec = spec
        self.block_pool = block_pool
        self.kv_cache_group_id = group_id
        self.block_size = block_size
        self.hash_block_size = hash_block_size
        self.max_model_len = max_model_len
        #: Whether this group's blocks are hashed and looked up.
        self.caching = enable_caching and spec.prefix_cacheable
        self.null_block = block_pool.null_block
        #: request id -> the request's blocks (null blocks where skipped).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        #: request id -> how many of its blocks are already hashed.
        self.num_cached_block: dict[str, int] = {}

    # -- the release rule -----------------------------------------------------

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading table positions a request with ``num_computed_tokens``
        computed tokens never reads again.

        This is the one rule of what a kind releases, and kvcore applies it
        everywhere: at admission those positions get the null block (hit
        blocks there are not taken, and no block is allocated for them),
        and before every later step the blocks still held there go back to
        the pool.  It is only consulted when :attr:`skips_blocks` is set.
        Default: the spec's ``skipped_tokens`` in whole blocks, which agrees
        with the default ``num_blocks_held``.
        """
        skipped: int = self.kv_cache_spec.skipped_tokens(num_computed_tokens)
        return skipped // self.block_size

    def _skip(self, num_computed_tokens: int) -> int:
        if not self.skips_blocks or num_computed_tokens <= 0:
            return 0
        return self.num_skipped_blocks(num_computed_tokens)

    # -- allocation -----------------------------------------------------------

    def admission_blocks(
        self, hit: Sequence[KVCacheBlock], num_computed_tokens: int
    ) -> list[KVCacheBlock]:
        """What a new request attaches at admission with ``num_computed_tokens``
        computed (its hit included): the hit with the null block at every
        position the kind skips, padded with the null block up to the first
        position it reads.  No block is taken or allocated for a skipped
        position, so a group without a hit (a bounded-replay window or a
        chunked-local group beside a prefix-cached one) asks only for the
        blocks the step reads or writes."""
        skip = self._skip(num_computed_tokens)
        if skip <= 0:
            return hit if type(hit) is list else list(hit)
        null = self.null_block
        out = [null if i < skip else block for i, block in enumerate(hit)]
        if len(out) < skip:
            out.extend([null] * (skip - len(out)))
        return out

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
    ) -> int:
        """Free blocks this group needs so the request covers ``num_tokens``:
        new blocks plus hit blocks that must leave the free queue (null
        blocks stand for skipped positions and take nothing)."""
        held = self.req_to_blocks.get(request_id)
        need = -(-num_tokens // self.block_size)
        if held is not None:
            need -= len(held)
        if not new_computed_blocks:
            return need if need > 0 else 0
        need -= len(new_computed_blocks)
        if need < 0:
            need = 0
        for block in new_computed_blocks:
            if block.ref_cnt == 0 and not block.is_null:
                need += 1
        return need

    def add_computed_blocks(
        self, request_id: str, blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Attach admission blocks (see :meth:`admission_blocks`) to a
        request, taking a reference on each that is not the null block."""
        if not blocks:
            return
        self.block_pool.touch(blocks)
        held = self.req_to_blocks.get(request_id)
        if held is None:
            self.req_to_blocks[request_id] = list(blocks)
        else:
            held.extend(blocks)
        self.num_cached_block[request_id] = len(self.req_to_blocks[request_id])

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int
    ) -> list[KVCacheBlock]:
        """Grow the request's table to cover ``num_tokens``; return new blocks."""
        held = self.req_to_blocks.get(request_id)
        if held is None:
            held = self.req_to_blocks[request_id] = []
        need = -(-num_tokens // self.block_size) - len(held)
        if need <= 0:
            return []
        new = self.block_pool.get_new_blocks(need)
        held.extend(new)
        return new

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Hash the request's blocks that ``num_tokens`` tokens fill."""
        if not self.caching:
            return
        rid = request.request_id
        num_full = num_tokens // self.block_size
        cached = self.num_cached_block.get(rid, 0)
        if num_full <= cached:
            return
        blocks = self.req_to_blocks[rid]
        hashes = hashes_at_block_size(
            request.block_hashes, self.hash_block_size, self.block_size
        )
        num_full = min(num_full, len(hashes), len(blocks))
        if num_full <= cached:
            return
        self.block_pool.cache_full_blocks(
            block_hashes=hashes,
            blocks=blocks,
            num_cached_blocks=cached,
            num_full_blocks=num_full,
            group_id=self.kv_cache_group_id,
            token_ids=request.all_token_ids,
        )
        self.num_cached_block[rid] = num_full

    def free(self, request_id: str) -> None:
        """Release all of a request's blocks, tail first (evicted first)."""
        blocks = self.pop_blocks(request_id)
        if blocks:
            self.block_pool.free_blocks(blocks[::-1])

    def pop_blocks(self, request_id: str) -> list[KVCacheBlock] | None:
        """Forget the request and hand back its table (the caller frees it;
        the list is not changed afterwards)."""
        self.num_cached_block.pop(request_id, None)
        return self.req_to_blocks.pop(request_id, None)

    # -- transactions -----------------------------------------------------------

    def request_state(self, request_id: str) -> Any:
        """What :meth:`restore_request_state` needs to put the request's
        per-request state back as it is now.  A manager that keeps more
        per-request state than the table and the hashed count extends both."""
        blocks = self.req_to_blocks.get(request_id)
        table = None if blocks is None else (blocks, list(blocks))
        return table, self.num_cached_block.get(request_id)

    def restore_request_state(self, request_id: str, state: Any) -> None:
        """Put back what :meth:`request_state` recorded (the table list is
        the same object, so views of it handed out stay valid)."""
        table, cached = state
        if table is None:
            self.req_to_blocks.pop(request_id, None)
        else:
            blocks, items = table
            blocks[:] = items
            self.req_to_blocks[request_id] = blocks
        if cached is None:
            self.num_cached_block.pop(request_id, None)
        else:
            self.num_cached_block[request_id] = cached

    # -- releasing ------------------------------------------------------------

    def _skipped(self, request_id: str, num_computed_tokens: int) -> list[int]:
        """Positions of the still-held blocks that skipping would release,
        newest first."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return []
        last = min(self._skip(num_computed_tokens), len(blocks))
        null = self.null_block
        out = []
        for i in range(last - 1, -1, -1):
            if blocks[i] is null:
                break
            out.append(i)
        return out

    def count_freeable_skipped(self, request_id: str, num_computed_tokens: int) -> int:
        """Blocks :meth:`remove_skipped_blocks` would return to the free queue."""
        if not self.skips_blocks:
            return 0
        blocks = self.req_to_blocks.get(request_id)
        return sum(
            1
            for i in self._skipped(request_id, num_computed_tokens)
            if blocks is not None and blocks[i].ref_cnt == 1
        )

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks the request will never read again and put the null
        block in their place."""
        positions = self._skipped(request_id, num_computed_tokens)
        if not positions:
            return
        blocks = self.req_to_blocks[request_id]
        removed = [blocks[i] for i in positions]
        for i in positions:
            blocks[i] = self.null_block
        self.block_pool.free_blocks(removed)

    def hit_serves(self, blocks: Sequence[KVCacheBlock]) -> bool:
        """Whether a hit of ``blocks`` holds what the next token reads.  The
        base rule: every block of the prefix is present."""
        return not any(block.is_null for block in blocks)

    def truncate_hit(
        self, blocks: list[KVCacheBlock], num_tokens: int
    ) -> list[KVCacheBlock]:
        """The first blocks of a hit that cover ``num_tokens`` tokens."""
        return blocks[: num_tokens // self.block_size]

    # -- prefix-cache lookup ----------------------------------------------------

    @classmethod
    def find_longest_cache_hit(
        cls,
        spec: Any,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_ids: Sequence[int],
        block_pool: BlockPool,
        block_size: int,
        alignment: int,
    ) -> list[list[KVCacheBlock]]:
        """The longest cached prefix of at most ``max_length`` tokens, as one
        block list per group id, a multiple of ``alignment`` tokens long.

        Kinds whose groups are prefix-cacheable implement this.
        """
        msg = (
            f"{cls.__name__} does not implement find_longest_cache_hit; a "
            "prefix-cacheable kind's manager must"
        )
        raise NotImplementedError(msg)


class FixedBlocksManager(SingleTypeManager):
    """A fixed number of blocks per request for its whole life.

    The blocks cover no token range: they are never hashed, never hit, and
    the request keeps them until it is freed.  Subclasses say how many with
    :meth:`blocks_per_request`.
    """

    position_indexed: ClassVar[bool] = False

    def __init__(self, spec: Any, block_pool: BlockPool, **kwargs: Any) -> None:
        super().__init__(spec, block_pool, **kwargs)
        self.caching = False
        self.fixed_blocks = self.blocks_per_request(spec)

    def blocks_per_request(self, spec: Any) -> int:
        """Blocks each request holds; one by default."""
        return 1

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
    ) -> int:
        if request_id in self.req_to_blocks:
            return 0
        return self.fixed_blocks

    def add_computed_blocks(
        self, request_id: str, blocks: Sequence[KVCacheBlock]
    ) -> None:
        return

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int
    ) -> list[KVCacheBlock]:
        if request_id in self.req_to_blocks:
            return []
        new = self.block_pool.get_new_blocks(self.fixed_blocks)
        self.req_to_blocks[request_id] = list(new)
        return new

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        return

    @classmethod
    def find_longest_cache_hit(
        cls,
        spec: Any,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_ids: Sequence[int],
        block_pool: BlockPool,
        block_size: int,
        alignment: int,
    ) -> list[list[KVCacheBlock]]:
        return [[] for _ in group_ids]
