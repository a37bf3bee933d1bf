"""The limits the tools put on what they read: workloads, traces, messages.

The core's own limits (files, plans, pools, names) are in
:mod:`kvcore.limits`; ``docs/bad-input.md`` lists both.
"""

from __future__ import annotations

__all__ = [
    "MAX_MESSAGE_CHARS",
    "MAX_TRACE_BLOCK_TOKENS",
    "MAX_TRACE_BYTES",
    "MAX_TRACE_HASH_ID",
    "MAX_TRACE_LINE_CHARS",
    "MAX_TRACE_REQUEST_TOKENS",
    "MAX_TRACE_TOTAL_TOKENS",
    "MAX_WORKLOAD_PREFIX_TOKENS",
    "MAX_WORKLOAD_REQUESTS",
]

#: The most requests one simulated workload draws (a million requests is
#: hours of replay on one core; a larger count is a typo).
MAX_WORKLOAD_REQUESTS = 10**6

#: The most tokens of shared system prefixes a synthetic workload builds
#: (``shared_prefixes * prefix_len``; 2**26 tokens hold half a GiB).
MAX_WORKLOAD_PREFIX_TOKENS = 2**26

#: The longest prompt, prefix or output one line of a trace (kvcore's own,
#: Mooncake, Qwen-Bailian) may give (2**24 tokens, 16 times the longest context any
#: shipped model serves).
MAX_TRACE_REQUEST_TOKENS = 2**24

#: The most tokens, prompts and outputs together, a replayed public trace
#: may hold (2**31; the tokens of its distinct blocks are kept at 4 bytes
#: each, so a typo'd length cannot take the machine's memory).
MAX_TRACE_TOTAL_TOKENS = 2**31

#: The longest line of a trace file (2**24 characters: the hash ids of a
#: request of MAX_TRACE_REQUEST_TOKENS tokens in 16-token blocks fit).
MAX_TRACE_LINE_CHARS = 2**24

#: The most bytes a trace file may hold once decompressed (4 GiB: a trace
#: of a million requests is a few hundred MiB, and a small compressed file
#: that expands without end is refused before it takes the memory).
MAX_TRACE_BYTES = 2**32

#: Hash ids of a public trace are ints in ``[0, MAX_TRACE_HASH_ID)``.
MAX_TRACE_HASH_ID = 2**63

#: The most tokens one hash id of a public trace may stand for.
MAX_TRACE_BLOCK_TOKENS = 2**16

#: The most characters of one error line the command line prints.
MAX_MESSAGE_CHARS = 2000
