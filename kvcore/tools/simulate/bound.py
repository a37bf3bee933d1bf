"""The token-level bound on prefix hits: the longest common token prefix
between a request and everything computed before it.

A perfect cache (every computed token kept, at token granularity) would
serve exactly that much of a request.  :class:`ComputedPrefixes` holds the
computed tokens of every sequence seen so far as a trie of fixed-size token
chunks: inserting or looking up ``n`` tokens walks ``n / chunk`` dict
lookups, and only the chunk where the sequences diverge is compared token
by token (against the chunks that continue the matched prefix).  The cost
is linear in the tokens inserted and looked up, never in tokens times
sequences.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["DEFAULT_CHUNK", "ComputedPrefixes"]

#: Tokens per trie edge.
DEFAULT_CHUNK = 32


class _Node:
    """The prefix of ``depth`` chunks shared by the sequences below it."""

    __slots__ = ("children", "partials")

    def __init__(self) -> None:
        #: The next full chunk of a sequence through here -> its node.
        self.children: dict[tuple[int, ...], _Node] = {}
        #: Sequences that end inside the next chunk: key -> their tokens of it.
        self.partials: dict[str, tuple[int, ...]] = {}


class ComputedPrefixes:
    """The computed tokens of many keyed sequences, for longest-prefix queries.

    A sequence only grows: :meth:`extend` records that its first ``length``
    tokens are computed (the tokens it was given before must be a prefix of
    the ones it is given now).
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

    def extend(self, key: str, tokens: Sequence[int], length: int) -> None:
        """Record ``tokens[:length]`` as computed for sequence ``key``."""
        node, depth, recorded = self._cursor.get(key, (self._root, 0, 0))
        if length <= recorded:
            return
        chunk = self._chunk
        while depth + chunk <= length:
            node.partials.pop(key, None)
            edge = tuple(tokens[depth : depth + chunk])
            child = node.children.get(edge)
            if child is None:
                child = node.children[edge] = _Node()
            node = child
            depth += chunk
        if length > depth:
            node.partials[key] = tuple(tokens[depth:length])
        self._cursor[key] = (node, depth, length)

    def longest_prefix(self, tokens: Sequence[int], limit: int | None = None) -> int:
        """The longest prefix of ``tokens`` (at most ``limit`` tokens) that
        some recorded sequence starts with."""
        n = len(tokens) if limit is None else min(len(tokens), limit)
        chunk = self._chunk
        node = self._root
        depth = 0
        while depth + chunk <= n:
            child = node.children.get(tuple(tokens[depth : depth + chunk]))
            if child is None:
                break
            node = child
            depth += chunk
        rest = tuple(tokens[depth : min(depth + chunk, n)])
        if not rest:
            return depth
        best = 0
        for seq in (*node.children, *node.partials.values()):
            same = _common(seq, rest)
            if same > best:
                best = same
                if best == len(rest):
                    break
        return depth + best


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the common prefix of ``a`` and ``b``."""
    if a[: len(b)] == b:
        return min(len(a), len(b))
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
