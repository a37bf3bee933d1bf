"""A content oracle: what every block holds, and whether each prefix hit
serves the request exactly its own tokens.

The oracle follows the real writes: after every ``allocate_slots`` the
driver reads the request's tables (``manager.get_blocks``) and, when the
step's tokens are computed, writes them into the blocks at the positions
the step covers.  A block released and handed to another request is
overwritten the same way, so a hit on stale content is caught.

- A position-indexed group (``manager.position_indexed``) of block size
  ``B``: table position ``i`` covers tokens ``[iB, (i+1)B)``; a real block
  there holds the token ids at those offsets.
- A :class:`~kvcore.coordinator.CheckpointManager` group (a recurrent
  state): a real block at position ``i`` holds the state after the first
  ``t = min((i+1)B, step end)`` tokens, recorded as ``t`` and a hash of
  those tokens.
- Other groups (fixed blocks per request, ``position_indexed`` False) hold
  no token range and are skipped, as are groups that cache nothing
  (``manager.caching`` False: a hit holds no blocks for them).

A hit of ``P`` tokens is valid when every real block at position ``i`` of a
token group holds the request's tokens ``[iB, min((i+1)B, P))`` (the blocks
cover ``P`` tokens), and the last block of each checkpoint group holds the
state after exactly the request's first ``P`` tokens.  Copies a step asks
for (``KVCacheBlocks.copies``: ``group_id, src_block_id, dst_block_id,
num_tokens``) are applied before the step's tokens are written.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvcore.coordinator import BlockId, CheckpointManager, KVCacheManager

__all__ = ["MAX_REPORTS", "ContentOracle"]

#: Violations described in full; the rest are only counted.
MAX_REPORTS = 5

_SKIP, _TOKENS, _STATE = 0, 1, 2

# Prefix identities: a polynomial hash of the tokens modulo a Mersenne prime.
_MOD = (1 << 61) - 1
_BASE = 1_000_003


class _Prefixes:
    """``hash(tokens[:t])`` for every ``t`` of one sequence, grown on demand."""

    __slots__ = ("hashes",)

    def __init__(self) -> None:
        self.hashes = [0]

    def at(self, tokens: Sequence[int], t: int) -> int:
        hashes = self.hashes
        if t >= len(hashes):
            h = hashes[-1]
            for tok in tokens[len(hashes) - 1 : t]:
                h = (h * _BASE + tok + 1) % _MOD
                hashes.append(h)
        return hashes[t]


class ContentOracle:
    """The content model of one manager's blocks (see the module docs)."""

    def __init__(self, manager: KVCacheManager, max_reports: int = MAX_REPORTS) -> None:
        managers = manager.coordinator.single_type_managers
        self.kinds = [
            _STATE
            if m.caching and isinstance(m, CheckpointManager)
            else _TOKENS
            if m.caching and m.position_indexed
            else _SKIP
            for m in managers
        ]
        self.block_sizes = [m.block_size for m in managers]
        #: block id -> token slots (token groups) or (t, prefix hash) (states).
        self.content: dict[int, list[int | None] | tuple[int, int]] = {}
        self._prefixes: dict[str, _Prefixes] = {}
        self.max_reports = max_reports
        self.checked_hits = 0
        self.invalid_hits = 0
        self.reports: list[str] = []
        self.copies = 0

    # -- writes -----------------------------------------------------------------

    def _prefix(self, rid: str, tokens: Sequence[int], t: int) -> int:
        prefixes = self._prefixes.get(rid)
        if prefixes is None:
            prefixes = self._prefixes[rid] = _Prefixes()
        return prefixes.at(tokens, t)

    def forget(self, rid: str) -> None:
        """Drop a finished request's prefix hashes (blocks keep their content)."""
        self._prefixes.pop(rid, None)

    def apply_copies(self, copies: Iterable[Any]) -> None:
        """Apply a step's block copies: ``dst``'s first ``num_tokens`` slots
        (or its state) become ``src``'s."""
        content = self.content
        for copy in copies:
            self.copies += 1
            group = int(copy.group_id)
            src = content.get(int(copy.src_block_id))
            dst_id = int(copy.dst_block_id)
            if self.kinds[group] == _STATE or not isinstance(src, list):
                if src is None:
                    content.pop(dst_id, None)
                else:
                    content[dst_id] = src
                continue
            size = self.block_sizes[group]
            dst = content.get(dst_id)
            if not isinstance(dst, list) or len(dst) != size:
                dst = content[dst_id] = [None] * size
            n = min(int(copy.num_tokens), size)
            dst[:n] = src[:n]

    def write(
        self,
        rid: str,
        tokens: Sequence[int],
        start: int,
        end: int,
        tables: Sequence[Sequence[BlockId]],
    ) -> None:
        """A step computed ``tokens[start:end]`` of ``rid``, whose tables are
        ``tables`` (one block id list per group)."""
        if end <= start:
            return
        content = self.content
        for kind, size, blocks in zip(
            self.kinds, self.block_sizes, tables, strict=True
        ):
            if kind == _SKIP:
                continue
            last = min((end - 1) // size, len(blocks) - 1)
            for i in range(start // size, last + 1):
                bid = blocks[i]
                if not bid:
                    continue
                base = i * size
                if kind == _TOKENS:
                    slots = content.get(bid)
                    if not isinstance(slots, list) or len(slots) != size:
                        slots = content[bid] = [None] * size
                    lo = max(start, base)
                    hi = min(end, base + size)
                    slots[lo - base : hi - base] = tokens[lo:hi]
                else:
                    t = min(base + size, end)
                    content[bid] = (t, self._prefix(rid, tokens, t))

    # -- checks -----------------------------------------------------------------

    def check_hit(
        self,
        rid: str,
        tokens: Sequence[int],
        tables: Sequence[Sequence[BlockId]],
        length: int,
    ) -> bool:
        """Whether a hit of ``length`` tokens on ``tables`` serves ``rid``
        its own tokens; a violation is counted and, for the first few,
        described."""
        if length <= 0:
            return True
        self.checked_hits += 1
        problem = self._problem(rid, tokens, tables, length)
        if problem is None:
            return True
        self.invalid_hits += 1
        if len(self.reports) < self.max_reports:
            self.reports.append(f"request {rid!r}, hit of {length} tokens: {problem}")
        return False

    def _problem(
        self,
        rid: str,
        tokens: Sequence[int],
        tables: Sequence[Sequence[BlockId]],
        length: int,
    ) -> str | None:
        content = self.content
        for group, (kind, size, blocks) in enumerate(
            zip(self.kinds, self.block_sizes, tables, strict=True)
        ):
            if kind == _SKIP:
                continue
            if kind == _STATE:
                last = blocks[-1] if blocks else None
                if not last:
                    return f"group {group} gives no state block for it"
                held = content.get(last)
                want = (length, self._prefix(rid, tokens, length))
                if held != want:
                    what = (
                        "nothing"
                        if held is None
                        else f"{len(held)} token slots"
                        if isinstance(held, list)
                        else f"the state after {held[0]} tokens"
                        + ("" if held[0] != length else " of other tokens")
                    )
                    return (
                        f"group {group}'s block {last} holds {what}, not "
                        f"the state after its first {length} tokens"
                    )
                continue
            if len(blocks) * size < length:
                return (
                    f"group {group}'s {len(blocks)} blocks of {size} tokens cover "
                    f"fewer than {length} tokens"
                )
            for i, block in enumerate(blocks):
                lo = i * size
                hi = min(lo + size, length)
                if hi <= lo:
                    break
                if not block:
                    continue
                held = content.get(block)
                if not isinstance(held, list) or len(held) != size:
                    return (
                        f"group {group}'s block {block} at position {i} holds no tokens"
                    )
                if held[: hi - lo] != list(tokens[lo:hi]):
                    return (
                        f"group {group}'s block {block} at position {i} "
                        f"does not hold its tokens [{lo}, {hi})"
                    )
        return None
