"""The paged attention context for one flattened engine step.

A step's tokens (decode rows: one token; prefill chunks: many) are laid out
as T batch rows of length 1, so the model's projections and MLP run once over
all of them and RoPE takes one position per row (``offsets`` is an int32
array [T, 1]). ``attend`` writes each token's K/V into its slot and attends each
token over its own sequence's KV up to and including its own position, which
makes causality fall out of the positions.

Every index array is built once per step on the host (numpy) and reused by
all layers. The pool's KV scheme (``kv/schemes.py``) stores K/V and attends,
along one of two paths:

* native (CPU): the scheme's paged kernel (``ops.paged_attention`` for dense
  KV, ``ops.kv_quant_paged_attention`` for packed KV) — one primitive per
  layer walking the block tables directly.
* reference (any backend): gather each sequence's blocks into contiguous K/V
  (dequantized by the scheme) and run
  ``mx.fast.scaled_dot_product_attention`` with a boolean mask,
  batching sequences of the same kind together (all decode rows in one
  call, all prefill chunks in another) so the op count per layer is fixed,
  not per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .. import ops
from .block_pool import KVPool


@dataclass
class SeqSlice:
    """One sequence's part of a step: ``n`` tokens starting at position ``start``,
    with its block table in each of the pool's KV groups (entries of blocks
    released by a sliding group are negative: never read)."""

    block_tables: list[list[int]]
    start: int
    n: int


class _Group:
    """Sequences attended together by the reference path (padded to one shape)."""

    __slots__ = ("q_idx", "kv_idx", "masks", "S", "Q", "L", "keys", "pos", "valid")


def _seq_slots(table: list[int], length: int, bs: int) -> np.ndarray:
    nb = -(-length // bs)
    t = np.maximum(np.asarray(table[:nb], dtype=np.int64), 0)
    return (t[:, None] * bs + np.arange(bs)).reshape(-1)[:length]


class PagedContext:
    """Implements the model's cache protocol (``offsets``, ``attend``) for one step."""

    def __init__(self, pool: KVPool, seqs: list[SeqSlice], native: bool | None = None):
        self.pool = pool
        bs = pool.block_size
        self.T = T = sum(s.n for s in seqs)
        if T == 0:
            raise ValueError("empty step")
        kv_groups = pool.groups
        self._where = kv_groups.where
        self._windows = [layer.window for layer in kv_groups.layers]
        # A few whole-array numpy calls per step, whatever the number of rows
        # (per-row numpy calls cost ~20 us each).
        S = len(seqs)
        nbs = [-(-(s.start + s.n) // bs) for s in seqs]
        max_blocks = max(nbs)
        if any(len(t) < nb for s, nb in zip(seqs, nbs) for t in s.block_tables):
            raise ValueError("a block table does not cover its sequence's positions")
        if T == S:  # decode rows only: one token each
            positions = np.array([s.start for s in seqs], np.int32)
            seq_idx = np.arange(S, dtype=np.int32)
        else:
            ns = np.array([s.n for s in seqs])
            seq_idx = np.repeat(np.arange(S, dtype=np.int32), ns)
            first = np.array([s.start for s in seqs]) - (np.cumsum(ns) - ns)  # position - token index
            positions = (np.repeat(first, ns) + np.arange(T)).astype(np.int32)
        tables = [np.maximum(np.array([s.block_tables[g][:nb] + [0] * (max_blocks - nb)
                                       for s, nb in zip(seqs, nbs)], np.int32), 0)
                  for g in range(len(kv_groups))]
        self.positions_np = positions
        self.positions = mx.array(positions)
        self.offsets = mx.array(positions[:, None])  # [T, 1]: the model's positions as they are
        self.slots = [mx.array(t[seq_idx, positions // bs] * bs + positions % bs) for t in tables]
        if native is None:
            native = ops.has_native_paged_attention()
        self.native = native
        if native:
            self.block_tables = [mx.array(t) for t in tables]
            self.seq_idx = mx.array(seq_idx)
        else:
            self._build_groups(seqs, bs, len(kv_groups))

    # -- reference path metadata ----------------------------------------------
    def _build_groups(self, seqs: list[SeqSlice], bs: int, num_kv_groups: int) -> None:
        starts = np.cumsum([0] + [s.n for s in seqs])
        kinds = [[i for i, s in enumerate(seqs) if s.n == 1], [i for i, s in enumerate(seqs) if s.n > 1]]
        groups, out_pos = [], np.empty(self.T, np.int64)
        base = 0
        for members in kinds:
            if not members:
                continue
            g = _Group()
            g.S, g.Q = len(members), max(seqs[i].n for i in members)
            g.L = max(seqs[i].start + seqs[i].n for i in members)
            q_idx = np.zeros((g.S, g.Q), np.int32)
            kv_idx = np.zeros((num_kv_groups, g.S, g.L), np.int32)
            pos = np.zeros((g.S, g.Q), np.int64)
            valid = np.zeros((g.S, g.Q), bool)
            for r, i in enumerate(members):
                s = seqs[i]
                length = s.start + s.n
                q_idx[r, :s.n] = np.arange(starts[i], starts[i] + s.n)
                for k, table in enumerate(s.block_tables):
                    kv_idx[k, r, :length] = _seq_slots(table, length, bs)
                pos[r, :s.n] = np.arange(s.start, s.start + s.n)
                valid[r, :s.n] = True
                out_pos[starts[i]:starts[i] + s.n] = base + r * g.Q + np.arange(s.n)
            base += g.S * g.Q
            g.q_idx, g.kv_idx = mx.array(q_idx), [mx.array(t) for t in kv_idx]
            g.keys, g.pos, g.valid, g.masks = np.arange(g.L), pos, valid, {}
            groups.append(g)
        self.groups = groups
        identity = base == self.T and np.array_equal(out_pos, np.arange(self.T))
        self.out_idx = None if identity else mx.array(out_pos.astype(np.int32))

    @staticmethod
    def _mask(g: _Group, window: int) -> mx.array:
        m = g.masks.get(window)
        if m is None:
            keys, pos = g.keys[None, None, :], g.pos[:, :, None]
            allowed = keys <= pos
            if window:
                allowed &= keys > pos - window
            allowed &= g.valid[:, :, None]
            allowed[..., 0] |= ~g.valid  # padded query rows: attend something, discarded
            m = g.masks[window] = mx.array(allowed[:, None])
        return m

    # -- the model's protocol ------------------------------------------------
    def attend(self, layer: int, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        """q [T, 1, Hq, D], k/v [T, 1, Hkv, D] -> [T, 1, Hq * D] (heads merged)."""
        T, L, Hq, D = q.shape
        if L != 1 or T != self.T:
            raise ValueError(f"paged attention expects [{self.T}, 1, H, D] rows, got {q.shape}")
        pool = self.pool
        scheme = pool.scheme
        g, slot = self._where[layer]
        window = self._windows[layer]
        scheme.write(slot, self.slots[g], k, v)
        if self.native:
            return scheme.paged_attention(slot, q, self.block_tables[g], self.seq_idx, self.positions,
                                          scale=scale, block_size=pool.block_size, window=window)
        return self._reference(q.reshape(T, Hq, D), scheme, slot, g, window, scale).reshape(T, 1, -1)

    def _reference(self, q, scheme, slot, kv_group, window, scale):
        T, Hq, D = q.shape
        q, scale = scheme.score_query(slot, q, scale)
        outs = []
        for g in self.groups:
            qg = q[g.q_idx].transpose(0, 2, 1, 3)  # [S, Hq, Q, D]
            kg, vg = scheme.gather(slot, g.kv_idx[kv_group], q.dtype)  # [S, L, Hkv, D]
            kg, vg = kg.transpose(0, 2, 1, 3), vg.transpose(0, 2, 1, 3)
            o = mx.fast.scaled_dot_product_attention(qg, kg, vg, scale=scale, mask=self._mask(g, window))
            outs.append(o.transpose(0, 2, 1, 3).reshape(g.S * g.Q, Hq, -1))
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
        return out if self.out_idx is None else out[self.out_idx]
