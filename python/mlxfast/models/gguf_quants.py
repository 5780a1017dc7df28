"""GGUF tensor data to MLX arrays.

Every block format whose values are ``scale * q + bias`` per run of 32
weights becomes MLX's affine format exactly, with no rounding beyond the
fp16 scales: Q4_0, Q4_1, Q4_K as 4-bit groups of 32; Q8_0, Q5_0, Q5_1, Q5_K
as 8-bit groups of 32 (5-bit codes fit an 8-bit grid unchanged). Q6_K, whose
scales change every 16 weights, is requantized to 8-bit groups of 32 (near
exact: half an 8-bit step at most). The bit layouts
follow llama.cpp's reference dequantizers (ggml-quants.c).

A quantized tensor becomes ``{"weight": uint32, "scales": fp16, "biases": fp16}``;
any other becomes ``{"weight": array}``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

GROUP = 32


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian fp16 from [n, 2] bytes, as fp32 [n, 1] (broadcasts per block)."""
    return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Codes [rows, K] (uint8, element order) -> MLX's packed uint32 [rows, K*bits/32]."""
    rows, k = q.shape
    if bits == 4:
        q = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(q).view("<u4").reshape(rows, k * bits // 32)


def _affine(codes: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, shape) -> dict:
    """MLX affine arrays with the tensor's leading axes (3-D for stacked experts)."""
    lead = tuple(int(d) for d in shape[:-1])
    rows = int(np.prod(lead))
    k = shape[-1]
    return {
        "weight": mx.array(_pack(codes.reshape(rows, k).astype(np.uint8), bits).reshape(*lead, -1)),
        "scales": mx.array(scales.reshape(*lead, k // GROUP).astype(np.float16)),
        "biases": mx.array(biases.reshape(*lead, k // GROUP).astype(np.float16)),
    }


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    return raw.reshape(-1, block_bytes)


def _q4_0(raw, shape):
    b = _blocks(raw, 18)
    d = _f16(b[:, 0:2])
    qs = b[:, 2:18]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=1)
    return _affine(codes, d, -8 * d, 4, shape)


def _q4_1(raw, shape):
    b = _blocks(raw, 20)
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    qs = b[:, 4:20]
    return _affine(np.concatenate([qs & 0xF, qs >> 4], axis=1), d, m, 4, shape)


def _q8_0(raw, shape):
    b = _blocks(raw, 34)
    d = _f16(b[:, 0:2])
    codes = (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return _affine(codes, d, -128 * d, 8, shape)


def _q5_codes(qh_bytes: np.ndarray, qs: np.ndarray) -> np.ndarray:
    qh = np.ascontiguousarray(qh_bytes).view("<u4")  # [n, 1]
    high = (qh >> np.arange(32, dtype=np.uint32)) & 1  # [n, 32]
    low = np.concatenate([qs & 0xF, qs >> 4], axis=1)
    return (low | (high.astype(np.uint8) << 4)).astype(np.uint8)


def _q5_0(raw, shape):
    b = _blocks(raw, 22)
    d = _f16(b[:, 0:2])
    codes = _q5_codes(b[:, 2:6], b[:, 6:22])
    # d * (q - 16) == d * ((q + 112) - 128): 8-bit codes with the symmetric
    # bias, which the loader drops (layers.drop_symmetric_biases).
    return _affine(codes + 112, d, -128 * d, 8, shape)


def _q5_1(raw, shape):
    b = _blocks(raw, 24)
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    return _affine(_q5_codes(b[:, 4:8], b[:, 8:24]), d, m, 8, shape)


def _k_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit (scale, min) pairs packed in 12 bytes (get_scale_min_k4)."""
    sc = sc.astype(np.uint8)
    s = np.empty((sc.shape[0], 8), np.uint8)
    m = np.empty((sc.shape[0], 8), np.uint8)
    s[:, :4] = sc[:, 0:4] & 63
    m[:, :4] = sc[:, 4:8] & 63
    s[:, 4:] = (sc[:, 8:12] & 0xF) | ((sc[:, 0:4] >> 6) << 4)
    m[:, 4:] = (sc[:, 8:12] >> 4) | ((sc[:, 4:8] >> 6) << 4)
    return s.astype(np.float32), m.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 256 four-bit codes: each 32-byte run gives a sub-block of
    low nibbles, then one of high nibbles."""
    q = qs.reshape(-1, 4, 32)
    return np.stack([q & 0xF, q >> 4], axis=2).reshape(-1, 256)


def _q4_k(raw, shape):
    b = _blocks(raw, 144)
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    s, m = _k_scales(b[:, 4:16])
    return _affine(_k_nibbles(b[:, 16:144]), d * s, -dmin * m, 4, shape)


def _q5_k(raw, shape):
    b = _blocks(raw, 176)
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    s, m = _k_scales(b[:, 4:16])
    qh = b[:, 16:48]  # bit 2c (low nibbles) and 2c+1 (high nibbles) of chunk c
    low = _k_nibbles(b[:, 48:176]).reshape(-1, 8, 32)
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    codes = (low | (high << 4)).reshape(-1, 256)
    return _affine(codes, d * s, -dmin * m, 8, shape)


def _q6_k_values(raw) -> np.ndarray:
    """Q6_K blocks -> float32 [n, 256] (llama.cpp's dequantize_row_q6_K)."""
    b = _blocks(raw, 210)
    ql, qh = b[:, 0:128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32).reshape(-1, 16)
    d = _f16(b[:, 208:210])
    lo = np.concatenate([ql[:, :, :32] & 0xF, ql[:, :, 32:] & 0xF, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], axis=2)
    hi = np.concatenate([(qh >> 0) & 3, (qh >> 2) & 3, (qh >> 4) & 3, (qh >> 6) & 3], axis=2)
    q = (lo | (hi << 4)).astype(np.float32).reshape(-1, 256) - 32
    return q * np.repeat(sc, 16, axis=1) * d


def _q6_k(raw, shape):
    """Q6_K's scales change every 16 weights, finer than MLX's groups: each
    group of 32 is requantized to 8 bits over its own range (codes found
    against the fp16-rounded scale and bias). The error is at most half an
    8-bit step, about 1/8 of Q6_K's own step where its two scales are alike
    (tests/test_gguf_quants.py measures it); the tensor stays quantized
    (8.5 bits a weight, half of fp16)."""
    v = _q6_k_values(raw).reshape(-1, GROUP)
    lo, hi = v.min(axis=1, keepdims=True), v.max(axis=1, keepdims=True)
    scale = ((hi - lo) / 255).astype(np.float16).astype(np.float32)
    bias = lo.astype(np.float16).astype(np.float32)
    safe = np.where(scale > 0, scale, 1)
    codes = np.clip(np.rint((v - bias) / safe), 0, 255).astype(np.uint8)
    return _affine(codes, scale, bias, 8, shape)


def _plain(dtype):
    def convert(raw, shape):
        return {"weight": mx.array(raw.view(dtype).reshape(shape))}
    return convert


def _bf16(raw, shape):
    return {"weight": mx.array(raw.view(np.uint16).reshape(shape)).view(mx.bfloat16)}


CONVERTERS = {
    "F32": _plain(np.float32), "F16": _plain(np.float16), "BF16": _bf16,
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}


def convert_tensor(type_name: str, raw: np.ndarray, shape: tuple[int, ...], name: str = "") -> dict:
    if type_name not in CONVERTERS:
        raise ValueError(
            f"tensor {name!r} is {type_name}, which cannot be loaded yet; supported GGUF "
            f"tensor types: {', '.join(CONVERTERS)}"
        )
    return CONVERTERS[type_name](raw, shape)
