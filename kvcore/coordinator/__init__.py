"""The block coordinator: block pool, chained hashing, requests, one manager
per cache group, and the ``KVCacheManager`` a scheduler calls every step."""

from __future__ import annotations

from kvcore.checkpoints import (
    CHECKPOINT_POLICIES,
    DEFAULT_CHECKPOINT_POLICY,
    CheckpointPolicy,
    CheckpointPolicyError,
    checkpoint_policy,
)
from kvcore.coordinator.block_pool import (
    BlockHashWithGroupId,
    BlockPool,
    FreeBlockQueue,
    KVCacheBlock,
)
from kvcore.coordinator.blocks import BlockId
from kvcore.coordinator.coordinator import KVCacheCoordinator, SpecGroup
from kvcore.coordinator.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventPublisher,
    GroupEventInfo,
    KVCacheEvent,
    NullEventPublisher,
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
from kvcore.coordinator.kv_cache_manager import (
    EngineStepKeywords,
    GroupPrefixCacheStats,
    KVCacheBlocks,
    KVCacheManager,
    ManagerOptions,
    PrefixCacheStats,
)
from kvcore.coordinator.manager import HitQuery, SingleTypeManager
from kvcore.coordinator.managers import (
    CheckpointManager,
    FixedBlocksManager,
    PrefixManager,
    WindowManager,
)
from kvcore.coordinator.partial import BlockCopy
from kvcore.coordinator.request import (
    Request,
    RequestStatus,
    create_requests,
    make_requests,
)

__all__ = [
    # coordinator
    "CHECKPOINT_POLICIES",
    "DEFAULT_CHECKPOINT_POLICY",
    "BlockCopy",
    "CheckpointManager",
    "CheckpointPolicy",
    "CheckpointPolicyError",
    "checkpoint_policy",
    "EngineStepKeywords",
    "ManagerOptions",
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
    "BlockId",
    "BlockHashWithGroupId",
    "BlockPool",
    "FreeBlockQueue",
    "KVCacheBlock",
    # KV-cache events
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventPublisher",
    "GroupEventInfo",
    "KVCacheEvent",
    "NullEventPublisher",
]
