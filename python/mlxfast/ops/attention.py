"""Attention over the engine's paged KV: writing K/V rows into the pools and
paged attention (full causal or a sliding window). The quantized-KV kernels
are in :mod:`mlxfast.ops.kvquant`."""

from __future__ import annotations

import mlx.core as mx

from .. import _ext
from . import dispatch



def kv_write_reference(pool: mx.array, slots: mx.array, values: mx.array) -> mx.array:
    """Pure-MLX ``pool[slots] = values`` (returns the updated pool; values
    of another float dtype are cast to the pool's, as indexed assignment does)."""
    pool[slots] = values.reshape(slots.shape[0], *pool.shape[1:])
    return pool


def kv_write(pool: mx.array, slots: mx.array, values: mx.array, *, inplace: bool = False,
             stream=None) -> mx.array:
    """``pool`` with rows ``slots`` replaced by ``values``, as one primitive.

    pool [S, ...], slots [T] int32, values with pool's trailing shape and T
    rows in its leading axes (``[T, H, D]`` or ``[B, L, H, D]`` for a
    ``[S, H, D]`` pool), in pool's dtype or, for a float pool, another of
    float32/float16/bfloat16 (converted as ``astype`` would, in the write).
    Rebind the pool to the result and keep no other reference to the old
    one: then the write happens in place (MLX donates the buffer); otherwise
    the pool is copied. Out-of-range slots are ignored. ``inplace`` writes
    in place even when the old pool is still referenced: for a pool several layers write within one graph (see
    csrc/ops/kv_write.h for when that is safe: every pending reader of the old
    version must run before the write, on the CPU stream).
    """
    if dispatch.on_cpu(stream):
        return _ext.kv_write(pool, slots, values, inplace=inplace, stream=stream)
    return kv_write_reference(pool, slots, values)


def kv_write_pair_reference(k_pool, v_pool, slots, k, v):
    """Pure-MLX :func:`kv_write_pair`: two indexed assignments."""
    return kv_write_reference(k_pool, slots, k), kv_write_reference(v_pool, slots, v)


def kv_write_pair(k_pool: mx.array, v_pool: mx.array, slots: mx.array, k: mx.array,
                  v: mx.array, *, inplace: bool = False, stream=None) -> tuple[mx.array, mx.array]:
    """``(kv_write(k_pool, slots, k), kv_write(v_pool, slots, v))`` as one
    primitive with two outputs; both pools are written in place under the same
    rule as ``kv_write`` (rebind both, keep no other reference; or ``inplace``)."""
    if dispatch.on_cpu(stream):
        k_pool, v_pool = _ext.kv_write_pair(k_pool, v_pool, slots, k, v, inplace=inplace, stream=stream)
        return k_pool, v_pool
    return kv_write_pair_reference(k_pool, v_pool, slots, k, v)


def has_native_paged_attention(stream=None) -> bool:
    """Whether ``paged_attention`` runs a native kernel on this stream/device."""
    return dispatch.on_cpu(stream) and hasattr(_ext, "paged_attention")


def paged_gather_reference(pool: mx.array, block_tables: mx.array, block_size: int) -> mx.array:
    """Pure-MLX gather of whole blocks: pool [num_blocks*bs, Hkv, D], block_tables
    [S, B] int32 -> [S, B*bs, Hkv, D] (each sequence's KV, contiguous)."""
    nb = pool.shape[0] // block_size
    blocks = pool.reshape(nb, block_size, *pool.shape[1:])[block_tables]
    S, B = block_tables.shape
    return blocks.reshape(S, B * block_size, *pool.shape[1:])


def paged_attention_reference(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    seq_idx: mx.array,
    positions: mx.array,
    *,
    scale: float,
    block_size: int,
    merge_heads: bool = False,
    window: int = 0,
) -> mx.array:
    """Pure-MLX paged attention (the native kernel's oracle; memory ~T x context).

    q [..., Hq, D] (T tokens in its leading axes: [T, Hq, D], [B, L, Hq, D]);
    k_pool/v_pool [num_blocks*block_size, Hkv, D] (Hq % Hkv == 0, any float
    dtype); block_tables [S, B] int32 (block ids per sequence); seq_idx [T]
    int32 (the sequence of each query); positions [T] int32 (each query's
    position: it attends keys 0..position of its sequence).
    ``window`` 0 is full causal attention; ``window = W > 0`` is a sliding
    window: a query at position p attends keys k with ``p - W < k <= p`` (W
    keys including itself, as mlx-lm's ``create_causal_mask(window_size=W)``).
    Table entries of blocks wholly before a query's window start (block index
    < (p - W + 1) // block_size) are never read: they may hold any value.
    Returns [..., Hq, Dv] in q's dtype, or [..., Hq * Dv] with ``merge_heads``
    (the layout an output projection takes). Softmax in float32.
    """
    if window < 0:
        raise ValueError(f"[mlxfast.paged_attention] window must be >= 0 (0: full causal "
                         f"attention), got {window}.")
    lead, (Hq, D) = q.shape[:-2], q.shape[-2:]
    T = seq_idx.shape[0]
    Hkv = k_pool.shape[1]
    if window:
        # Entries of blocks before every window of their sequence point at
        # block 0 (masked below): their values are never used.
        S, B = block_tables.shape
        first = (mx.maximum(positions - (window - 1), 0) // block_size).astype(mx.int32)  # [T]
        seq_first = mx.full((S,), B, mx.int32).at[seq_idx].minimum(first)
        block_tables = mx.where(mx.arange(B)[None, :] >= seq_first[:, None], block_tables, 0)
    kg = paged_gather_reference(k_pool, block_tables, block_size)[seq_idx]  # [T, L, Hkv, D]
    vg = paged_gather_reference(v_pool, block_tables, block_size)[seq_idx]
    L = kg.shape[1]
    qf = q.astype(mx.float32).reshape(T, Hkv, Hq // Hkv, D)
    s = mx.einsum("tkgd,tlkd->tkgl", qf, kg.astype(mx.float32)) * scale
    keys = mx.arange(L)[None, :]
    allowed = keys <= positions[:, None]  # [T, L]
    if window:
        allowed = allowed & (keys > positions[:, None] - window)
    s = mx.where(allowed[:, None, None, :], s, -mx.inf)
    p = mx.softmax(s, axis=-1)
    out = mx.einsum("tkgl,tlkd->tkgd", p, vg.astype(mx.float32))
    shape = (*lead, -1) if merge_heads else (*lead, Hq, -1)
    return out.reshape(shape).astype(q.dtype)


def paged_attention(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    seq_idx: mx.array,
    positions: mx.array,
    *,
    scale: float,
    block_size: int,
    merge_heads: bool = False,
    window: int = 0,
    stream=None,
) -> mx.array:
    """Attention of each query token over its own sequence's paged KV.

    Same arguments and result as ``paged_attention_reference`` (``window``:
    0 full causal, W > 0 a sliding window of W keys; blocks wholly before a
    query's window are not read): one primitive on the CPU (online softmax,
    float32 accumulation, GQA, parallel over (token, kv head)); the reference
    elsewhere.
    """
    if has_native_paged_attention(stream):
        return _ext.paged_attention(q, k_pool, v_pool, block_tables, seq_idx, positions,
                                    scale, block_size, merge_heads=merge_heads, window=window,
                                    stream=stream)
    return paged_attention_reference(q, k_pool, v_pool, block_tables, seq_idx, positions,
                                     scale=scale, block_size=block_size, merge_heads=merge_heads,
                                     window=window)
