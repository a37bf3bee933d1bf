"""Block coordinator runtime: chained hashing, requests and the block pool."""

from __future__ import annotations

from kvcore.coordinator.block_pool import (
    AllBlocksCleared,
    BlockHashWithGroupId,
    BlockPool,
    BlockRemoved,
    BlockStored,
    FreeBlockQueue,
    KVCacheBlock,
    KVCacheEvent,
)
from kvcore.coordinator.hashing import (
    NONE_HASH,
    BlockHash,
    BlockHasher,
    BlockHashView,
    HashFunction,
    MMFeature,
    get_hash_function,
    hash_block_tokens,
    hash_function_names,
    hashes_at_block_size,
)
from kvcore.coordinator.request import (
    Request,
    RequestStatus,
    create_requests,
    make_requests,
)

__all__ = [
    # hashing
    "NONE_HASH",
    "BlockHash",
    "BlockHasher",
    "BlockHashView",
    "HashFunction",
    "MMFeature",
    "get_hash_function",
    "hash_block_tokens",
    "hash_function_names",
    "hashes_at_block_size",
    # requests
    "Request",
    "RequestStatus",
    "create_requests",
    "make_requests",
    # block pool
    "AllBlocksCleared",
    "BlockHashWithGroupId",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheEvent",
]
