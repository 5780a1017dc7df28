"""KV storage. A model only ever calls ``cache.attend(layer, q, k, v, scale)``
(q [B, L, Hq, D] after RoPE, k/v [B, L, Hkv, D]; returns [B, L, Hq * D], heads
merged for the output projection) and
reads ``cache.offsets``; how K/V are stored is the cache's business."""

from .dense import DenseKVCache

__all__ = ["DenseKVCache"]
