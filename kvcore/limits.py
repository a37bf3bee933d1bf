"""Every limit kvcore puts on what it reads, in one place.

Input comes from files people download and configs that travel between
machines, so each reader refuses what no real model or plan needs before it
allocates anything: a file larger than :data:`MAX_JSON_FILE_BYTES`, JSON
nested deeper than :data:`MAX_JSON_DEPTH`, an integer literal longer than
:data:`MAX_JSON_INT_DIGITS` digits, a pool of more than
:data:`MAX_NUM_BLOCKS` blocks.  ``docs/bad-input.md`` lists the refusals.
"""

from __future__ import annotations

__all__ = [
    "MAX_ECHO_CHARS",
    "MAX_JSON_DEPTH",
    "MAX_JSON_FILE_BYTES",
    "MAX_JSON_INT_DIGITS",
    "MAX_NAME_CHARS",
    "MAX_NUM_BLOCKS",
    "MAX_BYTE_OFFSET",
    "BLOCK_STATE_BYTES",
    "TOKEN_ID_LIMIT",
    "MAX_NUM_LAYERS",
    "HUB_CONNECT_TIMEOUT_S",
    "HUB_FETCH_TIMEOUT_S",
    "available_memory_bytes",
]

#: The largest model file or plan kvcore reads (16 MiB; the largest shipped
#: model file is a few KiB, a plan of a thousand layers a few hundred KiB).
MAX_JSON_FILE_BYTES = 16 * 2**20

#: The deepest nesting of JSON objects and arrays kvcore reads (a plan
#: nests about eight levels).
MAX_JSON_DEPTH = 32

#: The most digits of one JSON integer literal (``2**64`` has 20).
MAX_JSON_INT_DIGITS = 20

#: The longest model or layer name (real ones are a few dozen characters).
MAX_NAME_CHARS = 256

#: The most blocks one pool may have (2**24, about 16.8 million).  Every
#: block costs the coordinator about 90 bytes of host memory (see
#: :data:`BLOCK_STATE_BYTES`), so a pool past this is a page size or memory
#: figure off by orders of magnitude.
MAX_NUM_BLOCKS = 2**24

#: The largest byte size, offset or stride a plan may carry (2**60, an
#: exbibyte): torch addresses memory with signed 64-bit ints, and no real
#: pool comes near it.
MAX_BYTE_OFFSET = 2**60

#: What one block's coordinator state costs in host memory, rounded up (its
#: reference count, keys and free-queue links in the pool's lists, and its
#: id; ``benchmarks/coordinator.py`` measures it at 10**6 blocks).  A pool is
#: refused before it is built when ``num_blocks * BLOCK_STATE_BYTES`` is
#: more than the memory the machine has available.
BLOCK_STATE_BYTES = 96

#: Token ids and token counts are ints in ``[0, TOKEN_ID_LIMIT)``: ids are
#: hashed as 4-byte unsigned ints.
TOKEN_ID_LIMIT = 2**32

#: The most layers a model configuration may declare (real models have a
#: few hundred; a config.json claiming ten million is refused before any
#: layer is built).
MAX_NUM_LAYERS = 100_000

#: The longest a model configuration may take to arrive from a hub, retries
#: included, before kvcore gives up with an error.
HUB_FETCH_TIMEOUT_S = 30.0

#: The longest kvcore waits to open a connection to the hub before it says
#: the hub cannot be reached (a machine with no network fails at once).
HUB_CONNECT_TIMEOUT_S = 3.0

#: The most characters of one value echoed in an error message.
MAX_ECHO_CHARS = 200


def available_memory_bytes() -> int | None:
    """The host memory available now (``SC_AVPHYS_PAGES``), or None where
    the system does not say."""
    import os

    try:
        pages = os.sysconf("SC_AVPHYS_PAGES")
        size = os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None
    if pages <= 0 or size <= 0:
        return None
    return int(pages) * int(size)
