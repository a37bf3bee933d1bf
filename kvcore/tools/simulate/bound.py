"""The token-level bound on prefix hits: the longest common token prefix
between a request and everything computed before it.

A perfect cache (every computed token kept, at token granularity) would
serve exactly that much of a request.  :class:`ComputedPrefixes` holds the
computed tokens of every sequence seen so far as a trie of fixed-size token
chunks, each chunk packed as 4-byte words (token ids are below ``2**32``):
inserting or looking up ``n`` tokens walks ``n / chunk`` dict lookups, and
only the chunk where the sequences diverge is compared.  Each node keeps
the chunks that continue it (full ones, and the partial last chunks of
sequences that end there) in sorted order; the longest common prefix of a
chunk with any of them is its longest with one of its two neighbours in
that order, so a lookup takes a binary search there, never a scan of the
node's continuations.  The cost is linear in the tokens inserted and looked
up, never in tokens times sequences.

A sequence that grows inside its last chunk (a decode, a token a step)
only has its new tail noted at its node; the tails noted there are sorted
in when a lookup first ends at that node, so recording a decode costs no
sorted insert.  Sequences given already packed (a replayed trace's
requests) are sliced, never packed again.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence

from kvcore.tools.simulate.workload import pack_words

__all__ = ["DEFAULT_CHUNK", "ComputedPrefixes"]

#: Tokens per trie edge.  The answers do not depend on it; longer edges
#: make fewer nodes (a replayed trace's prompts run to many thousands of
#: tokens), while a divergence is still found by one binary search of a
#: node's continuations and one of the bytes of two of them.
DEFAULT_CHUNK = 128

#: Bytes per packed token id.
_WORD = 4


class _Node:
    """The prefix of ``depth`` chunks shared by the sequences below it."""

    __slots__ = ("children", "order", "partials", "pending")

    def __init__(self) -> None:
        #: The next full chunk (packed) of a sequence through here -> its node.
        self.children: dict[bytes, _Node] = {}
        #: Sequences that end inside the next chunk: key -> their packed
        #: tokens of it (``None`` until one does).
        self.partials: dict[str, bytes] | None = None
        #: The keys of ``children`` and the values of ``partials`` (with
        #: repeats), sorted.
        self.order: list[bytes] = []
        #: Tails noted since the last lookup that ended here, not yet in
        #: ``partials`` or ``order``: key -> its packed tokens of the next
        #: chunk (``None`` until one is noted).
        self.pending: dict[str, bytes] | None = None

    def drop_partial(self, key: str) -> None:
        pending = self.pending
        if pending:
            pending.pop(key, None)
        partials = self.partials
        if partials:
            old = partials.pop(key, None)
            if old is not None:
                order = self.order
                del order[bisect_left(order, old)]

    def add_partial(self, key: str, part: bytes) -> None:
        if self.partials is None:
            self.partials = {}
        self.partials[key] = part
        insort(self.order, part)

    def note_tail(self, key: str, tail: bytes) -> None:
        """Note ``key``'s packed tokens of the next chunk (replacing the ones
        noted or sorted in before); sorted in at the next lookup that ends
        here."""
        pending = self.pending
        if pending is None:
            pending = self.pending = {}
        if key not in pending:
            partials = self.partials
            if partials and key in partials:
                self.drop_partial(key)
        pending[key] = tail

    def sort_in_tails(self) -> None:
        """Move the noted tails into ``partials`` and ``order``."""
        pending = self.pending
        assert pending is not None
        self.pending = None
        for key, tail in pending.items():
            self.drop_partial(key)
            self.add_partial(key, tail)


class ComputedPrefixes:
    """The computed tokens of many keyed sequences, for longest-prefix queries.

    A sequence only grows: :meth:`extend` records that its first ``length``
    tokens are computed (the tokens it was given before must be a prefix of
    the ones it is given now).  Token ids are ints in ``[0, 2**32)``, given
    as a sequence of ints or already packed as little-endian 4-byte words
    (``bytes``, as :class:`~kvcore.tools.simulate.workload.TokenRun` keeps
    them), which the trie then slices without packing anything.
    """

    __slots__ = ("_chunk", "_cursor", "_root")

    def __init__(self, chunk: int = DEFAULT_CHUNK) -> None:
        if type(chunk) is not int or chunk < 1:
            msg = f"chunk must be a positive int, got {chunk!r}"
            raise ValueError(msg)
        self._chunk = chunk
        self._root = _Node()
        #: key -> (the node its last full chunk ends at, that depth in tokens,
        #: its length recorded so far).
        self._cursor: dict[str, tuple[_Node, int, int]] = {}

    def extend(self, key: str, tokens: Sequence[int] | bytes, length: int) -> None:
        """Record ``tokens[:length]`` as computed for sequence ``key``
        (``length`` counts tokens, packed or not)."""
        node, depth, recorded = self._cursor.get(key, (self._root, 0, 0))
        if length <= recorded:
            return
        # data[at:] packs tokens depth.. (at == 0 when they came as ints).
        if isinstance(tokens, bytes):
            data, at = tokens, _WORD * depth
        else:
            data, at = pack_words(tokens[depth:length]), 0
        end = at + _WORD * (length - depth)
        step = self._chunk * _WORD
        if end - at >= step:
            node.drop_partial(key)
            children = node.children
            while at + step <= end:
                edge = data[at : at + step]
                child = children.get(edge)
                if child is None:
                    child = children[edge] = _Node()
                    insort(node.order, edge)
                node = child
                children = node.children
                at += step
                depth += self._chunk
        if at < end:
            # Inside a chunk: only the tail changes.
            node.note_tail(key, data[at:end])
        self._cursor[key] = (node, depth, length)

    def longest_prefix(
        self, tokens: Sequence[int] | bytes, limit: int | None = None
    ) -> int:
        """The longest prefix of ``tokens`` (at most ``limit`` tokens) that
        some recorded sequence starts with."""
        size = len(tokens) // _WORD if isinstance(tokens, bytes) else len(tokens)
        n = size if limit is None else min(size, limit)
        if n <= 0:
            return 0
        data = tokens if isinstance(tokens, bytes) else pack_words(tokens[:n])
        step = self._chunk * _WORD
        end = _WORD * n
        node = self._root
        at = 0
        while at + step <= end:
            child = node.children.get(data[at : at + step])
            if child is None:
                break
            node = child
            at += step
        rest = data[at : min(at + step, end)]
        if node.pending:
            node.sort_in_tails()
        order = node.order
        if not rest or not order:
            return at // _WORD
        i = bisect_left(order, rest)
        best = _common(order[i], rest) if i < len(order) else 0
        if i and best < len(rest):
            best = max(best, _common(order[i - 1], rest))
        return (at + best) // _WORD


def _common(a: bytes, b: bytes) -> int:
    """Length in bytes of the common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
