"""The floor of a block manager written in CPython: what the benchmark trace's
calls cost when they do only their list and dict work.

:class:`FloorManager` serves one full-attention group of 16-token blocks the
way kvcore and vLLM do (a null block 0; an LRU free queue, freed blocks
queued tail first, those without a prefix-cache key before the keyed ones;
hits by chained block hash, capped one token short of the prompt; a block
taken from the queue loses its key) and nothing else: no argument checks,
no transaction, no events, no plugin, one group.  It answers the calls
``benchmarks/coordinator.py``'s trace loop makes, so the loop times it
exactly as it times kvcore, and the trace's hits and free and cached block
counts must come out equal (they are compared).

It is a measuring stick, not a manager: a figure of kvcore over the floor
is kvcore's overhead for what it checks and records; a target below the
floor cannot be met by any manager written in Python.
"""

from __future__ import annotations

from typing import Any

BLOCK = 16


class FloorPool:
    """Reference counts, keys and the free queue (links in two lists, the
    queue's ends on two sentinel ids past the blocks)."""

    def __init__(self, num_blocks: int) -> None:
        head, tail = num_blocks, num_blocks + 1
        self.head, self.tail = head, tail
        self.ref = [0] * num_blocks
        self.key: list[Any] = [None] * num_blocks
        # Block 0 is the null block, never queued: the queue is 1..n-1.
        self.next = [*range(1, num_blocks), tail, 1, -1]
        self.prev = [-1, head, *range(1, num_blocks - 1), -1, num_blocks - 1]
        self.num_free = num_blocks - 1
        #: Block hash -> the first block keyed by it; blocks with a key.
        self.cached: dict[Any, int] = {}
        self.num_cached_blocks = 0

    def get_num_free_blocks(self) -> int:
        return self.num_free

    def take(self, count: int) -> list[int]:
        nxt, prv, key, ref, cached = (
            self.next,
            self.prev,
            self.key,
            self.ref,
            self.cached,
        )
        out = []
        block = nxt[self.head]
        for _ in range(count):
            out.append(block)
            ref[block] = 1
            block_hash = key[block]
            if block_hash is not None:
                if cached[block_hash] == block:
                    del cached[block_hash]
                key[block] = None
                self.num_cached_blocks -= 1
            block = nxt[block]
        nxt[self.head] = block
        prv[block] = self.head
        self.num_free -= count
        return out

    def touch(self, blocks: list[int]) -> None:
        nxt, prv, ref = self.next, self.prev, self.ref
        for block in blocks:
            if not ref[block]:
                after, before = nxt[block], prv[block]
                nxt[before] = after
                prv[after] = before
                self.num_free -= 1
            ref[block] += 1

    def release(self, table: list[int]) -> None:
        """Drop one reference per block, tail first; a block at 0 joins the
        queue's front (no key) or back (keyed)."""
        nxt, prv, ref, key = self.next, self.prev, self.ref, self.key
        head, tail = self.head, self.tail
        for block in reversed(table):
            count = ref[block] - 1
            ref[block] = count
            if count:
                continue
            if key[block] is None:
                after = nxt[head]
                nxt[head] = block
                prv[block] = head
                nxt[block] = after
                prv[after] = block
            else:
                last = prv[tail]
                nxt[last] = block
                prv[block] = last
                nxt[block] = tail
                prv[tail] = block
            self.num_free += 1


class FloorManager:
    """The calls of the trace loop over one :class:`FloorPool`."""

    def __init__(self, num_blocks: int) -> None:
        self.block_pool = FloorPool(num_blocks)
        self.tables: dict[str, list[int]] = {}
        self.num_keyed: dict[str, int] = {}

    def get_computed_blocks(self, request: Any) -> tuple[list[int], int]:
        cached = self.block_pool.cached
        hits = []
        for block_hash in request.block_hashes[: (request.num_tokens - 1) // BLOCK]:
            block = cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * BLOCK

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[int] | None = None,
    ) -> list[int] | None:
        pool = self.block_pool
        rid = request.request_id
        table = self.tables.get(rid)
        held = 0 if table is None else len(table)
        end = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        hit = new_computed_blocks or ()
        need = -(-end // BLOCK) - held - len(hit)
        ref = pool.ref
        # A free hit block leaves the queue when it is attached.
        if need + sum(1 for block in hit if not ref[block]) > pool.num_free:
            return None
        if table is None:
            table = self.tables[rid] = []
        if new_computed_blocks:
            pool.touch(new_computed_blocks)
            table += new_computed_blocks
        new = pool.take(need) if need > 0 else []
        table += new
        hashes = request.block_hashes
        full = min(end, len(request.all_token_ids)) // BLOCK
        full = min(full, len(hashes))
        done = self.num_keyed.get(rid, 0)
        if full > done:
            key, cached = pool.key, pool.cached
            for i in range(done, full):
                block = table[i]
                if key[block] is None:
                    key[block] = hashes[i]
                    cached.setdefault(hashes[i], block)
                    pool.num_cached_blocks += 1
            self.num_keyed[rid] = full
        return new

    def free(self, request: Any) -> None:
        rid = request.request_id
        self.num_keyed.pop(rid, None)
        self.block_pool.release(self.tables.pop(rid))
