"""The block allocator and the prefix cache's hash chain: pure Python, no MLX.

The scheduler and its tests use it without a model (a test imports them with
``mlx`` absent). Blocks have refcounts; a block whose refcount drops to zero
goes onto a free queue but keeps its content hash, so a later request with the
same prefix can take it back (refcount++, no copy). The free queue is in LRU
order and allocation evicts from its front: uncached blocks first, then cached
blocks, least recently freed first, and within one freed sequence its tail
before its head (a shared prefix outlives the suffixes hanging off it).

Block hashes chain: ``H(parent_hash, block_tokens, namespace)`` where the
namespace is model fingerprint + KV scheme + block size + the request's
``cache_salt``; only full blocks are hashed.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import OrderedDict


def block_hash(parent: bytes, tokens, namespace: bytes) -> bytes:
    """Chained content hash of one full block of token ids."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent)
    h.update(namespace)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def chain_hashes(tokens, block_size: int, namespace: bytes, start: list[bytes] | None = None) -> list[bytes]:
    """Hashes of every full block of ``tokens``; ``start`` = hashes already known."""
    out = list(start or [])
    for b in range(len(out), len(tokens) // block_size):
        parent = out[-1] if out else b""
        out.append(block_hash(parent, tokens[b * block_size:(b + 1) * block_size], namespace))
    return out


class NoFreeBlocks(RuntimeError):
    pass


class BlockAllocator:
    """Refcounted blocks with a content-addressed prefix cache (pure Python)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.refcount = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id
        # Blocks with refcount 0, front = evicted first. Values unused.
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        # SSD-tier hooks (kv/ssd.py): on_evict(block, hash) runs when a cached
        # block is taken for new content (before anything overwrites it);
        # on_register(block, hash) when a block joins the prefix cache.
        self.on_evict = None
        self.on_register = None
        self.last_used = [0.0] * num_blocks  # monotonic time its refcount last fell to 0

    # -- queries -------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free, cached or not)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- allocation ----------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise NoFreeBlocks(f"need {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            h = self.hash_of[b]
            if h is not None:  # evict from the prefix cache
                if self.cached.get(h) == b:
                    del self.cached[h]
                    if self.on_evict is not None:
                        self.on_evict(b, h)
                self.hash_of[b] = None
            self.refcount[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; tail blocks are evicted first."""
        for b in reversed(blocks):
            rc = self.refcount[b] - 1
            if rc < 0:
                raise RuntimeError(f"block {b} freed more often than allocated")
            self.refcount[b] = rc
            if rc == 0:
                self.last_used[b] = time.monotonic()
                if self.hash_of[b] is None:
                    self.free_queue[b] = None
                    self.free_queue.move_to_end(b, last=False)  # worthless: evict first
                else:
                    self.free_queue[b] = None  # most recently used end

    # -- prefix cache --------------------------------------------------------
    def match_prefix(self, hashes: list[bytes]) -> list[int]:
        """Take a reference to the longest cached run of ``hashes``; return its blocks."""
        if not self.enable_prefix_cache:
            return []
        out = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            out.append(b)
        for b in out:
            if self.refcount[b] == 0:
                del self.free_queue[b]
            self.refcount[b] += 1
        return out

    def register(self, block: int, h: bytes) -> None:
        """Record that ``block`` (full, computed) holds the content hashed ``h``."""
        if not self.enable_prefix_cache or self.hash_of[block] is not None:
            return
        if h in self.cached:
            return  # an identical block is already cached; this one stays private
        self.hash_of[block] = h
        self.cached[h] = block
        if self.on_register is not None:
            self.on_register(block, h)

    def uncache(self, block: int) -> bool:
        """Drop a free block from the prefix cache (its content lives on elsewhere,
        e.g. on SSD): it becomes a plain free block, evicted first."""
        h = self.hash_of[block]
        if h is None or self.refcount[block] != 0:
            return False
        if self.cached.get(h) == block:
            del self.cached[h]
        self.hash_of[block] = None
        self.free_queue.move_to_end(block, last=False)
        return True

    def reset_prefix_cache(self) -> None:
        for h, b in list(self.cached.items()):
            self.hash_of[b] = None
        self.cached.clear()

    def check(self) -> None:
        """Internal consistency (tests): free queue == refcount-0 blocks."""
        zero = {b for b in range(self.num_blocks) if self.refcount[b] == 0}
        assert zero == set(self.free_queue), "free queue out of sync with refcounts"
        for h, b in self.cached.items():
            assert self.hash_of[b] == h
