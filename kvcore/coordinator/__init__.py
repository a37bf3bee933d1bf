"""The block coordinator: block pool, chained hashing, requests, one manager
per cache group, and the ``KVCacheManager`` a scheduler calls every step."""

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
from kvcore.coordinator.coordinator import KVCacheCoordinator, SpecGroup
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
from kvcore.coordinator.kv_cache_manager import (
    EngineStepKeywords,
    GroupPrefixCacheStats,
    KVCacheBlocks,
    KVCacheManager,
    PrefixCacheStats,
)
from kvcore.coordinator.manager import HitQuery, SingleTypeManager
from kvcore.coordinator.managers import (
    CheckpointManager,
    FixedBlocksManager,
    PrefixManager,
    WindowManager,
)
from kvcore.coordinator.request import (
    Request,
    RequestStatus,
    create_requests,
    make_requests,
)

__all__ = [
    # coordinator
    "CheckpointManager",
    "EngineStepKeywords",
    "FixedBlocksManager",
    "HitQuery",
    "PrefixManager",
    "WindowManager",
    "KVCacheBlocks",
    "KVCacheCoordinator",
    "KVCacheManager",
    "GroupPrefixCacheStats",
    "PrefixCacheStats",
    "SingleTypeManager",
    "SpecGroup",
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
