"""Contiguous per-sequence KV: the simplest cache, for one-shot generation.

All rows of a batch share one length (no padding). Each layer's K and V live
in one array of ``batch * capacity`` slots, row b owning the contiguous slots
``[b*capacity, (b+1)*capacity)``: attention is the paged kernel over blocks
laid out in order, and writes are in-place ``kv_write``s. Capacity grows in
whole blocks.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import ops


class DenseKVCache:
    block = 256  # growth step, and the attention kernel's block size

    def __init__(self, num_layers: int, windows=None):
        # Per layer: a sliding window (a query attends its last `window`
        # positions) or 0 for full attention.
        self.windows = list(windows) if windows is not None else [0] * num_layers
        if len(self.windows) != num_layers:
            raise ValueError(f"{len(self.windows)} windows for {num_layers} layers")
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers
        self.offset = 0  # tokens already stored (before the current forward)
        self._meta: dict = {}

    @classmethod
    def for_model(cls, model) -> "DenseKVCache":
        """A cache for ``model``'s layers (its ``kv_layers`` windows)."""
        layers = model.kv_layers
        return cls(len(layers), [layer.window for layer in layers])

    @property
    def offsets(self) -> int:
        return self.offset

    def _step_meta(self, B: int, L: int, cap: int):
        """Slots, block tables, query rows and positions for this forward (shared by
        layers), built on the host: constants, not graph nodes."""
        key = (B, L, self.offset, cap)
        if key not in self._meta:
            rows = np.arange(B, dtype=np.int32)
            pos = np.arange(self.offset, self.offset + L, dtype=np.int32)
            nb = cap // self.block
            self._meta = {key: (
                mx.array((rows[:, None] * cap + pos[None, :]).reshape(-1)),
                mx.array(rows[:, None] * nb + np.arange(nb, dtype=np.int32)[None, :]),
                mx.array(np.repeat(rows, L)),
                mx.array(np.tile(pos, B)),
            )}
        return self._meta[key]

    def _grow(self, layer: int, B: int, k: mx.array, v: mx.array, need: int) -> None:
        cap = -(-need // self.block) * self.block
        H = k.shape[2]
        new_k = mx.zeros((B, cap, H, k.shape[-1]), k.dtype)
        new_v = mx.zeros((B, cap, H, v.shape[-1]), v.dtype)
        old_k, old_v = self.keys[layer], self.values[layer]
        if old_k is not None:
            old = old_k.shape[0] // B
            new_k[:, :old] = old_k.reshape(B, old, H, -1)
            new_v[:, :old] = old_v.reshape(B, old, H, -1)
        self.keys[layer] = new_k.reshape(B * cap, H, -1)
        self.values[layer] = new_v.reshape(B * cap, H, -1)

    def attend(self, layer: int, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        """Store k/v [B, L, Hkv, D] after the cached tokens; attend q [B, L, Hq, D]
        -> [B, L, Hq * D] (heads merged, as the output projection takes them)."""
        B, L = k.shape[:2]
        end = self.offset + L
        keys = self.keys[layer]
        if keys is None or end > keys.shape[0] // B:
            self._grow(layer, B, k, v, end)
            keys = self.keys[layer]
        slots, tables, seq_idx, positions = self._step_meta(B, L, keys.shape[0] // B)
        # No other reference to the old pools may live past this call (donation).
        keys, values = ops.kv_write_pair(keys, self.values[layer], slots, k, v)
        self.keys[layer], self.values[layer] = keys, values
        return ops.paged_attention(q, keys, values, tables, seq_idx, positions, scale=scale,
                                   block_size=self.block, merge_heads=True,
                                   window=self.windows[layer])

    def advance(self, n: int) -> None:
        """Mark n more tokens as stored (call after each forward)."""
        self.offset += n

    def state_arrays(self) -> list[mx.array]:
        return [a for a in self.keys + self.values if a is not None]
