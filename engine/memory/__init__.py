"""KV memory of one replica.

    KVPool (kv_pool.py)                      the physical K/V tensors, one pair per layer
    TokenToKVPoolAllocator (allocator.py)    free list of pages of slots in that pool
    ReqToTokenPool (req_to_token.py)         running request → the slot of each of its positions
    RadixCache (radix_cache.py)              token prefixes → slots, shared between requests, LRU-evicted
    KVCacheManager (kv_cache_manager.py)     every hand-over of slots between requests and the cache

Only KVCacheManager moves ownership; the scheduler calls it, never the pieces directly.
"""
