"""KV cache bookkeeping: block hash chain, block pool with prefix caching, per-request tables, events.

Pure Python; a block is an index into KV tensors owned by the model runner.
"""

from kvmesh.engine.block_hash import ROOT_HASH, BlockHash, extra_key, hash_block, hash_blocks
from .block_pool import BlockPool, FreeBlockQueue, KVBlock, KVIntegrityError, NoFreeBlocksError
from .events import (
    TIER_CPU,
    TIER_GPU,
    TIER_REMOTE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventLog,
    KVEventRecord,
    KVSnapshot,
)
from .kv_manager import KVCacheManager, PrefixCacheStats, RequestKV

__all__ = [
    "ROOT_HASH", "BlockHash", "extra_key", "hash_block", "hash_blocks",
    "BlockPool", "FreeBlockQueue", "KVBlock", "KVIntegrityError", "NoFreeBlocksError",
    "TIER_CPU", "TIER_GPU", "TIER_REMOTE", "AllBlocksCleared", "BlockRemoved", "BlockStored",
    "KVEvent", "KVEventLog", "KVEventRecord", "KVSnapshot",
    "KVCacheManager", "PrefixCacheStats", "RequestKV",
]
