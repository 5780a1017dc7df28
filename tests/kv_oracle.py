"""Numpy oracles shared by the quantized-KV tests."""

import numpy as np


def rounded_query(q, scale, group):
    """scale * q rounded to 8 bits per block of ``group`` values of its last
    axis, in numpy float32: what quantized-KV attention scores keys against
    (ops/kvquant.py, "Scores")."""
    x = np.array(q, np.float32) * np.float32(scale)
    b = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return (np.round(b * inv) * (amax / np.float32(127))).reshape(x.shape)
