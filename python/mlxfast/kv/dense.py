"""Contiguous per-sequence KV: the simplest scheme, for one-shot generation.

All rows of a batch share one length (no padding). Storage grows in steps so
that appending a token is a slice write, not a concatenation.
"""

from __future__ import annotations

import mlx.core as mx


class DenseKVCache:
    step = 256

    def __init__(self, num_layers: int):
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers
        self.offset = 0  # tokens already stored (before the current forward)

    @property
    def offsets(self) -> int:
        return self.offset

    def attend(self, layer: int, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        """Store k/v [B, L, Hkv, D] after the cached tokens; attend q [B, L, Hq, D]
        -> [B, L, Hq, D]."""
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
        B, H, L, D = k.shape
        start, end = self.offset, self.offset + L
        keys, values = self.keys[layer], self.values[layer]
        if keys is None or end > keys.shape[2]:
            grow = ((end + self.step - 1) // self.step) * self.step
            new_k = mx.zeros((B, H, grow, D), k.dtype)
            new_v = mx.zeros((B, H, grow, v.shape[-1]), v.dtype)
            if keys is not None and start > 0:
                new_k[..., :start, :] = keys[..., :start, :]
                new_v[..., :start, :] = values[..., :start, :]
            keys, values = new_k, new_v
        keys[..., start:end, :] = k
        values[..., start:end, :] = v
        self.keys[layer], self.values[layer] = keys, values
        mask = "causal" if L > 1 else None
        out = mx.fast.scaled_dot_product_attention(
            q, keys[..., :end, :], values[..., :end, :], scale=scale, mask=mask
        )
        return out.transpose(0, 2, 1, 3)

    def advance(self, n: int) -> None:
        """Mark n more tokens as stored (call after each forward)."""
        self.offset += n

    def state_arrays(self) -> list[mx.array]:
        return [a for a in self.keys + self.values if a is not None]
