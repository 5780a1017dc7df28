"""KV storage schemes of the block pool: dense, affine q8/q4, TurboQuant.

Attention belongs to the scheme: a scheme owns its per-layer storage arrays,
writes new K/V into slots and runs attention over block tables; the
``PagedContext`` delegates to it and the model never branches.

* ``dense``  — per layer K and V ``[num_slots, Hkv, D]`` in fp32/fp16/bf16
  (the native ``paged_attention`` kernel).
* ``q8`` / ``q4`` — affine groups along head_dim for keys and values (fp16
  scale + bias per group of ``group_size``, default 64).
* ``turbo-k<kb>v<vb>`` — keys affine ``kb`` bits; values rotated by a seeded
  randomized Walsh-Hadamard transform (per layer), normalised, coded with a
  ``vb``-bit Lloyd-Max codebook, norm kept (norm-corrected).

Quantized schemes keep one ``uint8`` array per layer, ``[num_slots, Hkv,
row_bytes]`` (K part | V part, see :mod:`mlxfast.ops.kvquant`), written with
one encode + one scatter per layer and read by one fused attention kernel.

Contract (SSD tier): every storage array has leading dimension
``num_blocks * block_size`` (slot-major) and ``arrays()`` lists all of them
in a fixed order, so block ``b``'s bytes are rows ``[b*bs, (b+1)*bs)`` of each
array; ``scheme_id`` names the storage format for cache namespaces.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import mlx.core as mx

from ..ops import kvquant as kq
from ..ops.kvquant import KVQuantFormat

_DTYPE_IDS = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class KVSchemeSpec:
    """What a scheme stores (no arrays): sizing, ids, and ``create`` for storage."""

    kind: str  # "dense" | "affine" | "turbo"
    dtype: object  # mx.Dtype of dense storage / dequantized output
    head_dim: int
    fmt: KVQuantFormat | None = None
    seed: int = 0

    @property
    def scheme_id(self) -> str:
        if self.kind == "dense":
            return _DTYPE_IDS[str(self.dtype).split(".")[-1]]
        f = self.fmt
        g = "" if f.group_size == 64 else f"g{f.group_size}"
        if self.kind == "affine":
            return f"q{f.k_bits}g{f.group_size}"
        return f"turbo-k{f.k_bits}v{f.v_bits}{g}-s{self.seed}"

    def for_head_dim(self, head_dim: int) -> "KVSchemeSpec":
        """The same scheme for layers of another head dim."""
        if head_dim == self.head_dim:
            return self
        fmt = None if self.fmt is None else dataclasses.replace(self.fmt, head_dim=head_dim)
        return dataclasses.replace(self, head_dim=head_dim, fmt=fmt)

    def bytes_per_token(self, layers) -> int:
        """True bytes of K+V for one token over ``layers`` (``LayerKV``s; scales
        and norms included)."""
        total = 0
        for layer in layers:
            spec = self.for_head_dim(layer.head_dim)
            if spec.kind == "dense":
                total += 2 * layer.n_kv_heads * layer.head_dim * spec.dtype.size
            else:
                total += layer.n_kv_heads * spec.fmt.row_bytes
        return total

    def create(self, layers, num_slots: int, shared: bool = False) -> "KVScheme":
        """Storage of ``num_slots`` slots for each of ``layers`` (``LayerKV``s).
        ``shared``: several layers write each array within one step (KV
        groups), so writes go in place (``ops.kv_write(inplace=True)``)
        instead of copying an array an earlier layer's attention still reads."""
        return (DenseScheme if self.kind == "dense" else QuantScheme)(self, layers, num_slots, shared)


def parse_kv_quant(kv_quant: str | None, *, head_dim: int, dtype=mx.float32,
                   group_size: int = 64, seed: int = 0) -> KVSchemeSpec:
    """``off`` | ``8`` | ``4`` | ``turbo`` (= k8v3) | ``turbo:k<4|8>v<2|3|4>`` -> spec."""
    q = "off" if kv_quant in (None, "") else str(kv_quant).strip().lower()
    if q in ("off", "none", "dense", "fp", "0"):
        return KVSchemeSpec("dense", dtype, head_dim)
    if q in ("8", "4", "q8", "q4"):
        bits = int(q[-1])
        return KVSchemeSpec("affine", dtype, head_dim,
                            KVQuantFormat(head_dim, bits, bits, group_size, False))
    m = re.fullmatch(r"turbo(?::k(\d+)v(\d+))?", q)
    if m:
        kb, vb = (int(m.group(1)), int(m.group(2))) if m.group(1) else (8, 3)
        return KVSchemeSpec("turbo", dtype, head_dim,
                            KVQuantFormat(head_dim, kb, vb, group_size, True), seed)
    raise ValueError(f"unknown kv_quant {kv_quant!r} (off, 8, 4, turbo, turbo:k<4|8>v<2|3|4>)")


class KVScheme:
    spec: KVSchemeSpec
    inplace: bool  # writes in place even when the old array is referenced (see create)

    @property
    def scheme_id(self) -> str:
        return self.spec.scheme_id

    def arrays(self) -> list[mx.array]:
        raise NotImplementedError

    def write(self, layer: int, slots: mx.array, k: mx.array, v: mx.array) -> None:
        """Store k/v ``[..., Hkv, D]`` (T rows in the leading axes) at ``slots [T]``."""
        raise NotImplementedError

    def restore(self, arrays: list[mx.array]) -> None:
        """Rebind the storage to ``arrays`` (an earlier ``arrays()``): writes
        built since, not yet evaluated, are dropped."""
        raise NotImplementedError

    def paged_attention(self, layer, q, block_tables, seq_idx, positions, *, scale, block_size,
                        window=0):
        """q ``[..., Hq, D]`` -> ``[..., Hq * D]`` (heads merged); ``window`` > 0:
        each query attends only its last ``window`` positions."""
        raise NotImplementedError

    def gather(self, layer: int, idx: mx.array, dtype) -> tuple[mx.array, mx.array]:
        """Dense K, V of slots ``idx`` (any shape) -> [*idx.shape, Hkv, D] (reference path)."""
        raise NotImplementedError

    def score_query(self, layer: int, q: mx.array, scale: float) -> tuple[mx.array, float]:
        """The query and scale the reference path scores gathered keys of
        ``layer`` with: the scheme's own attention's (quantized schemes round
        the query)."""
        return q, scale


class DenseScheme(KVScheme):
    def __init__(self, spec: KVSchemeSpec, layers, num_slots: int, inplace: bool = False):
        from .. import ops

        self._ops = ops
        self.spec = spec
        self.inplace = inplace
        shapes = [(num_slots, layer.n_kv_heads, layer.head_dim) for layer in layers]
        self.keys = [mx.zeros(shape, spec.dtype) for shape in shapes]
        self.values = [mx.zeros(shape, spec.dtype) for shape in shapes]
        mx.eval(self.keys, self.values)

    def arrays(self):
        return self.keys + self.values

    def restore(self, arrays):
        n = len(self.keys)
        self.keys[:], self.values[:] = arrays[:n], arrays[n:]

    def write(self, layer, slots, k, v):
        # Rebinding the list entries to the results leaves the previous arrays
        # referenced only by the graph, so the write reuses their buffers. The
        # write converts k/v to the pool's dtype itself (no astype nodes).
        keys, values = self.keys, self.values
        keys[layer], values[layer] = self._ops.kv_write_pair(
            keys[layer], values[layer], slots, k, v, inplace=self.inplace)

    def paged_attention(self, layer, q, block_tables, seq_idx, positions, *, scale, block_size,
                        window=0):
        return self._ops.paged_attention(q, self.keys[layer], self.values[layer], block_tables,
                                         seq_idx, positions, scale=scale, block_size=block_size,
                                         merge_heads=True, window=window)

    def gather(self, layer, idx, dtype):
        k, v = self.keys[layer][idx], self.values[layer][idx]
        if k.dtype != dtype:
            k, v = k.astype(dtype), v.astype(dtype)
        return k, v


class QuantScheme(KVScheme):
    def __init__(self, spec: KVSchemeSpec, layers, num_slots: int, inplace: bool = False):
        self.spec = spec
        self.inplace = inplace
        self.fmts = [spec.for_head_dim(layer.head_dim).fmt for layer in layers]
        self.data = [mx.zeros((num_slots, layer.n_kv_heads, fmt.row_bytes), mx.uint8)
                     for layer, fmt in zip(layers, self.fmts)]
        self.signs = [mx.array(kq.rotation_signs(spec.seed, i, fmt.head_dim))
                      if fmt.v_turbo else None for i, fmt in enumerate(self.fmts)]
        mx.eval(self.data, [s for s in self.signs if s is not None])

    def arrays(self):
        return list(self.data)

    def restore(self, arrays):
        self.data[:] = arrays

    def write(self, layer, slots, k, v):
        from .. import ops

        packed = kq.kv_quant_encode(k, v, self.fmts[layer], self.signs[layer])
        self.data[layer] = ops.kv_write(self.data[layer], slots, packed, inplace=self.inplace)

    def paged_attention(self, layer, q, block_tables, seq_idx, positions, *, scale, block_size,
                        window=0):
        lead, (Hq, D) = q.shape[:-2], q.shape[-2:]
        out = kq.kv_quant_paged_attention(q.reshape(-1, Hq, D), self.data[layer], block_tables,
                                          seq_idx, positions, scale=scale, block_size=block_size,
                                          fmt=self.fmts[layer], signs=self.signs[layer],
                                          window=window)
        return out.reshape(*lead, -1)

    def score_query(self, layer, q, scale):
        # as the fused attention does (ops/kvquant.py, "Scores")
        return kq.round_query_int8(q, scale, self.fmts[layer].group_size).astype(q.dtype), 1.0

    def gather(self, layer, idx, dtype):
        return kq.kv_quant_dequant(self.data[layer][idx], self.fmts[layer], self.signs[layer], dtype)
