"""The engine's sampling step: one token per row, greedy or
temperature/top-k/top-p/min-p with Gumbel-max noise keyed per row."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import _ext
from . import dispatch



def _sample_params(R: int, V: int, temperature, top_k, top_p, min_p):
    """Per-row sampling parameters as float32/int32 numpy arrays; off = neutral."""
    temps = np.broadcast_to(np.asarray(temperature, np.float32), (R,))
    ks = np.broadcast_to(np.asarray(top_k, np.int64), (R,))
    ks = np.where((ks > 0) & (ks < V), ks, V).astype(np.int32)
    tps = np.broadcast_to(np.asarray(top_p, np.float32), (R,))
    tps = np.where((tps > 0) & (tps < 1), tps, 1.0).astype(np.float32)
    mps = np.broadcast_to(np.asarray(min_p, np.float32), (R,))
    logmin = np.where(mps > 0, np.log(np.maximum(mps, 1e-30)), -np.inf).astype(np.float32)
    return temps, ks, tps, logmin


def sample_tokens_reference(logits: mx.array, keys: mx.array, temperature, top_k=0, top_p=1.0,
                            min_p=0.0) -> mx.array:
    """Pure-MLX ``sample_tokens``: sorts the vocabulary for top-k/top-p."""
    R, V = logits.shape
    temps, ks, tps, logmin = _sample_params(R, V, temperature, top_k, top_p, min_p)
    x = logits.astype(mx.float32)
    greedy = temps <= 0
    if greedy.all():
        return mx.argmax(x, axis=-1)
    y = x / mx.array(np.where(greedy, 1.0, temps)[:, None])
    if (ks < V).any() or (tps < 1).any():
        s = -mx.sort(-y, axis=-1)  # descending
        thr = mx.take_along_axis(s, mx.array(ks - 1)[:, None], axis=-1)  # k-th largest
        if (tps < 1).any():
            s = mx.where(mx.arange(V)[None, :] < mx.array(ks)[:, None], s, -mx.inf)
            probs = mx.softmax(s, axis=-1)
            keep = (mx.cumsum(probs, axis=-1) - probs) < mx.array(tps)[:, None]
            n_keep = mx.maximum(keep.sum(axis=-1, keepdims=True), 1)
            thr = mx.maximum(thr, mx.take_along_axis(s, (n_keep - 1).astype(mx.int32), axis=-1))
        y = mx.where(y >= thr, y, -mx.inf)
    if (logmin > -np.inf).any():
        thr = y.max(axis=-1, keepdims=True) + mx.array(logmin)[:, None]
        y = mx.where(y >= thr, y, -mx.inf)
    u = mx.vmap(lambda k: mx.random.uniform(shape=(V,), key=k))(keys)
    y = y + -mx.log(-mx.log(u))  # Gumbel noise: row r from keys[r] only
    return mx.argmax(mx.where(mx.array(greedy[:, None]), x, y), axis=-1)


def sample_tokens(logits: mx.array, keys: mx.array, temperature, top_k=0, top_p=1.0, min_p=0.0,
                  *, stream=None) -> mx.array:
    """One token per row of ``logits [R, V]`` (the engine's sampling step).

    Per row (the parameters are host-side scalars or length-R sequences):
    ``temperature <= 0`` takes the argmax; otherwise the logits are divided by
    the temperature, truncated by top-k (``0`` = off; ties with the k-th value
    are kept), then top-p on the top-k renormalised distribution (``1`` =
    off), then min-p (``0`` = off), and a token is drawn by Gumbel-max with
    the noise ``-log(-log(u))``, ``u = mx.random.uniform(shape=(V,),
    key=keys[r])`` — so a row's draw depends on its own key only. ``keys`` is
    ``[R, 2]`` uint32. Returns ``[R]`` uint32.

    The native kernel sorts only the head of the distribution and draws the
    noise (MLX's threefry, bit for bit) only for tokens that can still win.
    It picks the reference's token except where top-p's cut falls within
    float rounding of a token boundary: the softmax normaliser is summed in
    another order (the reference sums the whole sorted row in float32).
    """
    if not dispatch.on_cpu(stream):
        return sample_tokens_reference(logits, keys, temperature, top_k, top_p, min_p)
    R, V = logits.shape[0] if logits.ndim else 0, logits.shape[-1] if logits.ndim else 1
    temps, ks, tps, logmin = _sample_params(R, V, temperature, top_k, top_p, min_p)
    return _ext.sample_tokens(logits, keys, mx.array(temps), mx.array(ks), mx.array(tps),
                              mx.array(logmin), stream=stream)
