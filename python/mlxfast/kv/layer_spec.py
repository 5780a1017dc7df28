"""What each attention layer's KV needs, as the model declares it (pure Python).

A model lists one ``LayerKV`` per layer (``model.kv_layers``): KV heads, head
dim and attention kind (full, or a sliding window of ``window`` tokens). The
block pool sizes its storage from it, the attention kernels take each layer's
window, and the scheduler frees the blocks that fall out of every sliding
layer's window (``KVGroups``), while full-attention layers keep theirs.

Layers are stored in *KV groups* (vLLM's hybrid-allocator idea): layers of one
attention kind are split into groups of ``group_size`` layers, and every
group has its own block table per sequence over one shared block pool, so a
block holds ``block_size`` tokens of ``group_size`` layers whatever its group.
A model with one kind of attention has one group of all its layers: one
table per sequence, as before. Gemma 3 (15 sliding, 3 full layers) has six
groups of three: a long context keeps all its blocks in the full group but
only about a window's worth in each sliding group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerKV:
    n_kv_heads: int
    head_dim: int
    window: int = 0  # sliding window: a query attends the last `window` positions; 0 = full

    def __post_init__(self):
        if self.n_kv_heads < 1 or self.head_dim < 1 or self.window < 0:
            raise ValueError(f"invalid layer KV spec {self}")


def uniform_layers(num_layers: int, n_kv_heads: int, head_dim: int, window: int = 0) -> tuple[LayerKV, ...]:
    return (LayerKV(n_kv_heads, head_dim, window),) * num_layers


@dataclass(frozen=True)
class KVGroup:
    window: int  # 0: full attention
    layers: tuple[int, ...]  # model layer indices, in order


class KVGroups:
    """The layers' split into KV groups, and each layer's (group, slot in group).

    ``release=False`` keeps one group of all layers (every block kept for the
    whole context; windows still apply in attention): what a pool whose
    owner tracks one block table per sequence uses."""

    def __init__(self, layers, release: bool = True):
        self.layers = tuple(layers)
        if not self.layers:
            raise ValueError("a model needs at least one attention layer")
        windows = sorted({s.window for s in self.layers})
        if not release or len(windows) == 1:
            # One group of all layers; it releases blocks only when every
            # layer slides and releasing is wanted.
            window = windows[0] if release else 0
            groups = [KVGroup(window, tuple(range(len(self.layers))))]
        else:
            by_window = {w: [i for i, s in enumerate(self.layers) if s.window == w] for w in windows}
            size = math.gcd(*(len(ix) for ix in by_window.values()))
            groups = [KVGroup(w, tuple(ix[j:j + size]))
                      for w, ix in by_window.items() for j in range(0, len(ix), size)]
        for slot in zip(*(g.layers for g in groups)):  # layers sharing a storage slot
            if len({(self.layers[i].n_kv_heads, self.layers[i].head_dim) for i in slot}) > 1:
                raise ValueError("layers of different KV shapes in one storage slot are not supported")
        self.groups = tuple(groups)
        self.group_size = len(groups[0].layers)
        self.where = {}  # layer -> (group, slot)
        for g, group in enumerate(groups):
            for j, layer in enumerate(group.layers):
                self.where[layer] = (g, j)

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def windows(self) -> tuple[int, ...]:
        return tuple(g.window for g in self.groups)

    def slot_layers(self) -> list[LayerKV]:
        """The storage shape of each slot (slot j of every group stores alike)."""
        return [self.layers[layer] for layer in self.groups[0].layers]
