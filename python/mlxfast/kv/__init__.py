"""KV storage. A model only ever calls ``cache.attend(layer, q, k, v, scale)``
(q [B, L, Hq, D] after RoPE, k/v [B, L, Hkv, D]; returns [B, L, Hq * D], heads
merged for the output projection) and
reads ``cache.offsets``; how K/V are stored is the cache's business."""

__all__ = ["DenseKVCache"]


def __getattr__(name):  # lazily: kv.allocator and kv.layer_spec import without MLX
    if name == "DenseKVCache":
        from .dense import DenseKVCache

        return DenseKVCache
    raise AttributeError(f"module 'mlxfast.kv' has no attribute {name!r}")
