"""KV storage schemes. A model only ever calls ``cache.attend(layer, q, k, v, scale)``
and reads ``cache.offsets``; how K/V are stored is the scheme's business."""

from .dense import DenseKVCache

__all__ = ["DenseKVCache"]
