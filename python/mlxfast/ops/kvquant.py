"""Quantized-KV ops: packed rows, their encode / dequant, and fused paged attention.

Re-exported by :mod:`mlxfast.ops` (the public API). Every op runs its native
kernel on the CPU and its pure-MLX ``*_reference`` elsewhere; the references
are the native kernels' test oracles.

Packed row format (one row per (slot, kv head), ``uint8``, see
:class:`KVQuantFormat`)::

    K part: codes  D*k_bits/8 bytes | scales fp16 [D/g] | biases fp16 [D/g]
    V part (affine): same layout with v_bits
    V part (turbo):  codes  D*v_bits/8 bytes | w float32 (1 value)

Codes are a little-endian bit stream, LSB first (code ``i`` occupies bits
``[b*i, b*(i+1))``), i.e. MLX's packed ``uint32`` words viewed as bytes; every
8 codes fill exactly ``b`` bytes, so 3-bit codes are packed tightly too.

Affine (MLX's quantize scheme, per group of ``g`` coordinates):
``scale = (max - min) / (2^b - 1)`` and ``bias = min``, both rounded to
fp16 first; ``code = clip(round((x - bias) / scale), 0, 2^b - 1)`` with the
rounded values (round half to even); ``x^ = scale * code + bias``.

TurboQuant values (arXiv:2504.19874, "TurboQuant: Online Vector Quantization
with Near-optimal Distortion Rate", the MSE variant without the QJL stage):
``y = H (s * v) / sqrt(D)`` with ``H`` the Sylvester Walsh-Hadamard matrix and
``s`` random signs (per layer); the coordinates of ``y / |v|`` are close to
``N(0, 1/D)``, so ``x = y * sqrt(D) / |v|`` is quantized coordinate-wise with
the Lloyd-Max codebook ``c`` of ``N(0, 1)`` (code = number of decision
boundaries below ``x``, boundaries = midpoints). ``w = |v| / |c[codes]|``
(the norm correction: the reconstruction has exactly the norm of ``v``), and
``v^ = s * H (w * c[codes]) / sqrt(D)``. Attention accumulates
``sum_j p_j w_j c[codes_j]`` in the rotated domain and applies the inverse
rotation once per head at the end.

Scores: the fused attention scores keys against the scaled query rounded to
8 bits per block of the keys' group (``g`` values of a (token, head) row),
``q' = scale * q``, per block ``d = max|q'| / 127`` and
``q^ = d * round(q' * 127 / max|q'|)`` (half to even; llama.cpp rounds the
query to q8_0 blocks for its quantized K cache the same way). Then
``q^ . k^ = sum_g d_g * (scale_g * sum(xq * code) + bias_g * sum(xq))`` with
integer sums, which the CPU computes exactly with int8 dot products (VNNI
``vpdpbusd``) where it has them; elsewhere it multiplies the floats ``q^``.
Values and the softmax stay float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np

from .. import _ext
from . import dispatch
from .attention import paged_attention_reference, paged_gather_reference

# Lloyd-Max centroids of N(0, 1) for 1..4 bits (from ``lloyd_max_gaussian``;
# tests recompute them). MSE per coordinate: 0.3634, 0.1175, 0.03455, 0.009501
# -- the figures TurboQuant (arXiv:2504.19874, Thm. 1) quotes for b = 1..4.
LLOYD_MAX_GAUSSIAN = {
    1: (0.7978845608,),
    2: (0.4527800346, 1.5104176085),
    3: (0.2450941789, 0.7560052812, 1.3439092785, 2.1519457045),
    4: (0.1283950299, 0.3880482995, 0.6567591185, 0.9423404565, 1.2562311973,
        1.6180463860, 2.0690172265, 2.7325895710),
}


def lloyd_max_gaussian(bits: int, iters: int = 3000) -> tuple[list[float], float]:
    """Lloyd-Max quantizer of N(0, 1): (sorted centroids, MSE per coordinate)."""
    n = 1 << bits
    sq2 = math.sqrt(2.0)

    def phi(x):
        return math.exp(-x * x / 2) / math.sqrt(2 * math.pi) if math.isfinite(x) else 0.0

    def cdf(x):
        return 0.5 * (1 + math.erf(x / sq2)) if math.isfinite(x) else (1.0 if x > 0 else 0.0)

    c = [-3 + 6 * (i + 0.5) / n for i in range(n)]
    for _ in range(iters):
        b = [-math.inf] + [(c[i] + c[i + 1]) / 2 for i in range(n - 1)] + [math.inf]
        c = [(phi(b[i]) - phi(b[i + 1])) / (cdf(b[i + 1]) - cdf(b[i])) for i in range(n)]
    b = [-math.inf] + [(c[i] + c[i + 1]) / 2 for i in range(n - 1)] + [math.inf]

    def m2(x):  # integral of x^2 phi up to x
        return cdf(x) - (x * phi(x) if math.isfinite(x) else 0.0)

    mse = sum(m2(b[i + 1]) - m2(b[i]) - 2 * c[i] * (phi(b[i]) - phi(b[i + 1]))
              + c[i] ** 2 * (cdf(b[i + 1]) - cdf(b[i])) for i in range(n))
    return c, mse


def codebook(bits: int) -> np.ndarray:
    """Sorted Lloyd-Max centroids of N(0, 1) for ``bits`` (float32 [2^bits])."""
    half = LLOYD_MAX_GAUSSIAN[bits]
    return np.array([-x for x in reversed(half)] + list(half), np.float32)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def rotation_signs(seed: int, layer: int, head_dim: int) -> np.ndarray:
    """The random +-1 signs of layer ``layer``'s Walsh-Hadamard rotation (float32 [D])."""
    base = _splitmix64((seed & 0xFFFFFFFF) << 32 | (layer & 0xFFFFFFFF))
    return np.array([1.0 if _splitmix64(base + i) >> 63 else -1.0 for i in range(head_dim)],
                    np.float32)


@lru_cache(maxsize=None)
def _hadamard(d: int) -> np.ndarray:
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h


@dataclass(frozen=True)
class KVQuantFormat:
    """Layout of one packed K|V row per (slot, kv head)."""

    head_dim: int
    k_bits: int = 8
    v_bits: int = 8
    group_size: int = 64
    v_turbo: bool = False

    def __post_init__(self):
        D, g = self.head_dim, self.group_size
        if self.k_bits not in (4, 8):
            raise ValueError(f"key bits must be 4 or 8, got {self.k_bits}")
        if self.v_turbo and self.v_bits not in (2, 3, 4):
            raise ValueError(f"TurboQuant value bits must be 2, 3 or 4, got {self.v_bits}")
        if not self.v_turbo and self.v_bits not in (4, 8):
            raise ValueError(f"affine value bits must be 4 or 8, got {self.v_bits}")
        if D <= 0 or D % 8 or D > 512:
            raise ValueError(f"quantized KV needs head_dim a multiple of 8 (<= 512), got {D}")
        if g <= 0 or D % g or g % 8:
            raise ValueError(f"group size {g} must divide head_dim {D} (and be a multiple of 8)")
        if self.v_turbo and D & (D - 1):
            raise ValueError(f"TurboQuant needs a power-of-two head_dim, got {D}")

    @property
    def k_bytes(self) -> int:
        return self.head_dim * self.k_bits // 8 + 4 * (self.head_dim // self.group_size)

    @property
    def v_bytes(self) -> int:
        if self.v_turbo:
            return self.head_dim * self.v_bits // 8 + 4
        return self.head_dim * self.v_bits // 8 + 4 * (self.head_dim // self.group_size)

    @property
    def row_bytes(self) -> int:
        return self.k_bytes + self.v_bytes

    def codebook(self) -> mx.array:
        return _codebook_array(self.v_bits if self.v_turbo else 0)


@lru_cache(maxsize=None)
def _codebook_array(bits: int) -> mx.array:
    # One constant per width, not a new array per call (30 layers x 2 ops a step).
    return mx.array(codebook(bits) if bits else np.zeros(1, np.float32))


def has_native_kv_quant(stream=None) -> bool:
    """Whether the quantized-KV ops run native kernels on this stream/device."""
    return dispatch.on_cpu(stream) and hasattr(_ext, "kv_quant_paged_attention")


# --- pure-MLX references ------------------------------------------------------


def _pack(codes: mx.array, bits: int) -> mx.array:
    """uint8 codes [..., D] -> LSB-first bit stream [..., D*bits/8] uint8."""
    if bits == 8:
        return codes.astype(mx.uint8)
    lead, D = codes.shape[:-1], codes.shape[-1]
    c = codes.astype(mx.uint32).reshape(*lead, D // 8, 8)
    word = (c << (mx.arange(8, dtype=mx.uint32) * bits)).sum(-1).astype(mx.uint32)
    byts = (word[..., None] >> (mx.arange(bits, dtype=mx.uint32) * 8)) & 0xFF
    return byts.astype(mx.uint8).reshape(*lead, D * bits // 8)


def _unpack(byts: mx.array, bits: int, D: int) -> mx.array:
    """Inverse of ``_pack``: [..., D*bits/8] uint8 -> [..., D] uint32 codes."""
    if bits == 8:
        return byts.astype(mx.uint32)
    lead = byts.shape[:-1]
    b = byts.astype(mx.uint32).reshape(*lead, D // 8, bits)
    word = (b << (mx.arange(bits, dtype=mx.uint32) * 8)).sum(-1).astype(mx.uint32)
    codes = (word[..., None] >> (mx.arange(8, dtype=mx.uint32) * bits)) & ((1 << bits) - 1)
    return codes.reshape(*lead, D)


def _affine_encode(x: mx.array, bits: int, g: int) -> mx.array:
    lead, D = x.shape[:-1], x.shape[-1]
    xs = x.astype(mx.float32).reshape(*lead, D // g, g)
    lo, hi = xs.min(-1, keepdims=True), xs.max(-1, keepdims=True)
    scale = ((hi - lo) / ((1 << bits) - 1)).astype(mx.float16)
    bias = lo.astype(mx.float16)
    s32, b32 = scale.astype(mx.float32), bias.astype(mx.float32)
    ok = s32 > 0
    q = mx.where(ok, mx.round((xs - b32) / mx.where(ok, s32, 1.0)), 0.0)
    q = mx.clip(q, 0, (1 << bits) - 1).astype(mx.uint8).reshape(*lead, D)
    sb = mx.view(scale.reshape(*lead, D // g), mx.uint8)
    bb = mx.view(bias.reshape(*lead, D // g), mx.uint8)
    return mx.concatenate([_pack(q, bits), sb, bb], axis=-1)


def _affine_decode(part: mx.array, bits: int, g: int, D: int) -> mx.array:
    lead = part.shape[:-1]
    nc, ng = D * bits // 8, D // g
    codes = _unpack(part[..., :nc], bits, D).astype(mx.float32).reshape(*lead, ng, g)
    scale = mx.view(part[..., nc:nc + 2 * ng], mx.float16).astype(mx.float32)[..., None]
    bias = mx.view(part[..., nc + 2 * ng:nc + 4 * ng], mx.float16).astype(mx.float32)[..., None]
    return (codes * scale + bias).reshape(*lead, D)


def _turbo_encode(v: mx.array, bits: int, signs: mx.array) -> mx.array:
    D = v.shape[-1]
    H = mx.array(_hadamard(D))
    vf = v.astype(mx.float32)
    y = (vf * signs) @ H * (1.0 / math.sqrt(D))
    norm = mx.sqrt((vf * vf).sum(-1, keepdims=True))
    x = y * (math.sqrt(D) / mx.maximum(norm, 1e-30))
    cb = codebook(bits)
    bounds = mx.array((cb[1:] + cb[:-1]) / 2)
    codes = (x[..., None] > bounds).sum(-1).astype(mx.uint8)
    c = mx.array(cb)[codes]
    cn = mx.sqrt((c * c).sum(-1, keepdims=True))
    w = mx.where(cn > 0, norm / mx.where(cn > 0, cn, 1.0), 0.0).astype(mx.float32)
    return mx.concatenate([_pack(codes, bits), mx.view(w, mx.uint8)], axis=-1)


def _turbo_decode_rotated(part: mx.array, bits: int, D: int) -> mx.array:
    """w * c[codes]: the value in the rotated domain (before the inverse rotation)."""
    nc = D * bits // 8
    codes = _unpack(part[..., :nc], bits, D)
    w = mx.view(part[..., nc:nc + 4], mx.float32)
    return mx.array(codebook(bits))[codes] * w


def _inverse_rotation(y: mx.array, signs: mx.array) -> mx.array:
    D = y.shape[-1]
    return (y @ mx.array(_hadamard(D))) * (signs * (1.0 / math.sqrt(D)))


def _check_kv(fmt: KVQuantFormat, signs) -> None:
    if fmt.v_turbo and signs is None:
        raise ValueError("[mlxfast.kv_quant] TurboQuant values need the rotation signs.")


def kv_quant_encode_reference(k: mx.array, v: mx.array, fmt: KVQuantFormat,
                              signs: mx.array | None = None) -> mx.array:
    """Pure-MLX :func:`kv_quant_encode`."""
    _check_kv(fmt, signs)
    kp = _affine_encode(k, fmt.k_bits, fmt.group_size)
    if fmt.v_turbo:
        vp = _turbo_encode(v, fmt.v_bits, signs.astype(mx.float32))
    else:
        vp = _affine_encode(v, fmt.v_bits, fmt.group_size)
    return mx.concatenate([kp, vp], axis=-1)


def kv_quant_dequant_reference(packed: mx.array, fmt: KVQuantFormat, signs: mx.array | None = None,
                               dtype=mx.float32) -> tuple[mx.array, mx.array]:
    """Pure-MLX :func:`kv_quant_dequant`."""
    _check_kv(fmt, signs)
    D = fmt.head_dim
    k = _affine_decode(packed[..., :fmt.k_bytes], fmt.k_bits, fmt.group_size, D)
    vpart = packed[..., fmt.k_bytes:fmt.row_bytes]
    if fmt.v_turbo:
        v = _inverse_rotation(_turbo_decode_rotated(vpart, fmt.v_bits, D), signs.astype(mx.float32))
    else:
        v = _affine_decode(vpart, fmt.v_bits, fmt.group_size, D)
    return k.astype(dtype), v.astype(dtype)


def kv_quant_paged_attention_reference(q, packed, block_tables, seq_idx, positions, *,
                                       scale: float, block_size: int, fmt: KVQuantFormat,
                                       signs: mx.array | None = None,
                                       window: int = 0) -> mx.array:
    """Pure-MLX :func:`kv_quant_paged_attention`: gather the blocks, dequantize, attend."""
    if window < 0:
        raise ValueError(f"[mlxfast.kv_quant_paged_attention] window must be >= 0 (0: full "
                         f"causal attention), got {window}.")
    S, B = block_tables.shape
    if window:
        # Entries of blocks before every window of their sequence point at
        # block 0 (masked by the attention): their values are never used.
        first = (mx.maximum(positions - (window - 1), 0) // block_size).astype(mx.int32)  # [T]
        seq_first = mx.full((S,), B, mx.int32).at[seq_idx].minimum(first)
        block_tables = mx.where(mx.arange(B)[None, :] >= seq_first[:, None], block_tables, 0)
    rows = paged_gather_reference(packed, block_tables, block_size)  # [S, B*bs, Hkv, R]
    k, v = kv_quant_dequant_reference(rows.reshape(S * B * block_size, *packed.shape[1:]), fmt, signs)
    tables = mx.arange(S * B, dtype=mx.int32).reshape(S, B)
    out = paged_attention_reference(round_query_int8(q, scale, fmt.group_size), k, v, tables, seq_idx, positions,
                                    scale=1.0, block_size=block_size, window=window)
    return out.astype(q.dtype)


def round_query_int8(q: mx.array, scale: float, group: int) -> mx.array:
    """``scale * q`` rounded to 8 bits per block of ``group`` values of its last
    axis (float32): what the fused attention scores the keys against (module
    docstring)."""
    x = q.astype(mx.float32) * scale
    b = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    amax = mx.max(mx.abs(b), axis=-1, keepdims=True)
    nz = amax > 0
    inv = mx.where(nz, mx.array(127.0, mx.float32) / mx.where(nz, amax, 1.0), 0.0)
    return (mx.round(b * inv) * (amax / mx.array(127.0, mx.float32))).reshape(x.shape)


# --- public ops ------------------------------------------------------------------


def _fmt_args(fmt: KVQuantFormat):
    return dict(head_dim=fmt.head_dim, k_bits=fmt.k_bits, v_bits=fmt.v_bits,
                group_size=fmt.group_size, v_turbo=fmt.v_turbo)


def _signs_or_dummy(fmt, signs):
    # The affine schemes' placeholder is the constant zero codebook: an
    # mx.zeros here was one more primitive to schedule per op and layer.
    if fmt.v_turbo:
        return signs if signs.dtype == mx.float32 else signs.astype(mx.float32)
    return _codebook_array(0)


def kv_quant_encode(k: mx.array, v: mx.array, fmt: KVQuantFormat, signs: mx.array | None = None,
                    *, stream=None) -> mx.array:
    """Quantize K/V rows into packed rows.

    k, v: [..., D] float32/float16/bfloat16 (same leading shape, D = fmt.head_dim);
    signs: float32 [D] +-1 (the layer's rotation; required for TurboQuant values).
    Returns uint8 [..., fmt.row_bytes] (layout in the module docstring).
    """
    _check_kv(fmt, signs)
    if has_native_kv_quant(stream):
        return _ext.kv_quant_encode(k, v, _signs_or_dummy(fmt, signs), fmt.codebook(),
                                    **_fmt_args(fmt), stream=stream)
    return kv_quant_encode_reference(k, v, fmt, signs)


def kv_quant_dequant(packed: mx.array, fmt: KVQuantFormat, signs: mx.array | None = None,
                     dtype=mx.float32, *, stream=None) -> tuple[mx.array, mx.array]:
    """Packed rows uint8 [..., fmt.row_bytes] -> (k, v), each [..., D] in ``dtype``
    (float32/float16/bfloat16). TurboQuant values are rotated back."""
    _check_kv(fmt, signs)
    if has_native_kv_quant(stream):
        k, v = _ext.kv_quant_dequant(packed, _signs_or_dummy(fmt, signs), fmt.codebook(),
                                     dtype=dtype, **_fmt_args(fmt), stream=stream)
        return k, v
    return kv_quant_dequant_reference(packed, fmt, signs, dtype)


def kv_quant_paged_attention(q: mx.array, packed: mx.array, block_tables: mx.array,
                             seq_idx: mx.array, positions: mx.array, *, scale: float,
                             block_size: int, fmt: KVQuantFormat, signs: mx.array | None = None,
                             window: int = 0, stream=None) -> mx.array:
    """Paged attention over packed K|V rows (see ``paged_attention`` for the paging
    and ``window``: 0 full causal, W > 0 a sliding window of W keys whose earlier
    blocks' table entries are never read).

    q [T, Hq, D] float; packed uint8 [num_blocks*block_size, Hkv, fmt.row_bytes];
    block_tables [S, B], seq_idx [T], positions [T] int32. Returns [T, Hq, D] in
    q's dtype. On the CPU one fused primitive: scores on the packed keys (per
    group ``scale * (q . codes) + bias * sum(q)``), online softmax in float32,
    values accumulated from their codes (TurboQuant: in the rotated domain, one
    inverse rotation per (token, head) at the end).
    """
    _check_kv(fmt, signs)
    if has_native_kv_quant(stream):
        return _ext.kv_quant_paged_attention(q, packed, block_tables, seq_idx, positions,
                                             _signs_or_dummy(fmt, signs), fmt.codebook(),
                                             scale=scale, block_size=block_size,
                                             **_fmt_args(fmt), window=window, stream=stream)
    return kv_quant_paged_attention_reference(q, packed, block_tables, seq_idx, positions,
                                              scale=scale, block_size=block_size, fmt=fmt,
                                              signs=signs, window=window)
