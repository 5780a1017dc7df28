"""Paged KV storage: fixed-size blocks, a refcounting allocator and the prefix cache.

Two halves with one job each:

* ``BlockAllocator`` — pure Python, no MLX, so the scheduler and its tests can
  use it without a model. Blocks have refcounts; a block whose refcount drops
  to zero goes onto a free queue but keeps its content hash, so a later
  request with the same prefix can take it back (refcount++, no copy). The
  free queue is in LRU order and allocation evicts from its front: uncached
  blocks first, then cached blocks, least recently freed first, and within one
  freed sequence its tail before its head (a shared prefix outlives the
  suffixes hanging off it).
* ``KVPool`` — the MLX storage, in the format of its KV scheme
  (``kv/schemes.py``): dense K and V arrays ``[num_blocks * block_size,
  n_kv_heads, head_dim]``, or one packed quantized K|V array per layer
  ``[num_blocks * block_size, n_kv_heads, row_bytes]`` (block ``b`` owns slots
  ``b*bs .. b*bs+bs-1``). ``write`` scatters new K/V into slots in place: MLX
  donates the pool's buffer to the scatter when the pool array holds the only
  reference, which ``KVPool`` guarantees by rebinding its own list entry and
  never handing the array out past the step (tests/test_kv_pool.py measures it).

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


_DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
           "bfloat16": "bfloat16", "bf16": "bfloat16"}


def kv_dtype(name_or_dtype):
    import mlx.core as mx

    if isinstance(name_or_dtype, mx.Dtype):
        return name_or_dtype
    try:
        return getattr(mx, _DTYPES[str(name_or_dtype).lower()])
    except KeyError:
        raise ValueError(f"unsupported KV dtype {name_or_dtype!r} (float32, float16, bfloat16)") from None


def default_kv_dtype(model_dtype):
    """The dense KV dtype for ``auto`` (quantized schemes keep the model's
    dtype for their dequantized output): the model's activation dtype, but
    float16 for models computed in float32 (GGUF weights on the CPU). Two
    bytes per value is what llama.cpp's default f16 cache and a bf16/fp16
    model's own dtype give; decode attention reads every cached byte each
    step, so float32 KV halved 8-stream decode at long contexts for no
    change in greedy tokens on the default model (see the engine tests)."""
    import mlx.core as mx

    return mx.float16 if model_dtype == mx.float32 else model_dtype


class KVPool:
    """Block storage in MLX arrays for a model's layers, in the format of a KV scheme.

    ``layers`` is the model's per-layer KV spec (``kv/layer_spec.py``); the
    pool stores them in KV groups (``groups``): one storage slot per layer of
    a group, shared by the same slot of every group, each group addressed by
    its own block tables. The scheme (``kv/schemes.py``: dense
    fp32/fp16/bf16, affine q8/q4, TurboQuant) owns the arrays, the writes and
    the attention. Every storage array has leading dimension ``num_blocks *
    block_size`` (slot-major) and ``arrays()`` lists them all in a fixed
    order, so a block's bytes are rows ``[b*bs, (b+1)*bs)`` of each array.
    ``scheme_id`` names the format (``f32``, ``q8g64``, ``turbo-k8v3-s0`` ...)
    for cache namespaces. ``release=False`` keeps one group of all layers.
    """

    def __init__(self, layers, num_blocks: int, block_size: int, dtype="float32", kv_quant="off",
                 group_size: int = 64, seed: int = 0, release: bool = True):
        from .layer_spec import KVGroups
        from .schemes import KVSchemeSpec, parse_kv_quant

        self.groups = KVGroups(layers, release=release)
        self.layers = self.groups.layers
        self.num_layers = len(self.layers)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = kv_dtype(dtype)
        self.spec = kv_quant if isinstance(kv_quant, KVSchemeSpec) else parse_kv_quant(
            kv_quant, head_dim=self.layers[0].head_dim, dtype=self.dtype, group_size=group_size,
            seed=seed)
        self.scheme = self.spec.create(self.groups.slot_layers(), num_blocks * block_size,
                                       shared=len(self.groups) > 1)

    @property
    def scheme_id(self) -> str:
        return self.spec.scheme_id

    @property
    def keys(self):  # dense schemes only
        return self.scheme.keys

    @property
    def values(self):  # dense schemes only
        return self.scheme.values

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block (``block_size`` tokens of one group's layers)."""
        return self.block_size * self.spec.bytes_per_token(self.groups.slot_layers())

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def write(self, slot: int, slots, k, v) -> None:
        """Store k/v ``[T, n_kv_heads, head_dim]`` of storage slot ``slot`` (a
        group's layer; the layer itself for one group) at flat ``slots [T]``."""
        self.scheme.write(slot, slots, k, v)

    def arrays(self):
        return self.scheme.arrays()
