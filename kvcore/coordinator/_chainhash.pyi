"""kvcore's compiled prompt hashing (``_chainhash.c``; optional)."""

def chain_sha256(
    tokens: list[int] | tuple[int, ...], block_size: int, /
) -> list[bytes] | None: ...
