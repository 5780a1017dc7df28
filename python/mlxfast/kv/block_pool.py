"""Paged KV storage in MLX arrays: ``KVPool``, in the format of its KV scheme
(``kv/schemes.py``), over the blocks ``kv/allocator.py`` hands out.

Dense K and V arrays ``[num_blocks * block_size, n_kv_heads, head_dim]`` per
storage slot, or one packed quantized K|V array per slot ``[num_blocks *
block_size, n_kv_heads, row_bytes]`` (block ``b`` owns slots ``b*bs ..
b*bs+bs-1``). ``write`` scatters new K/V into slots in place: MLX donates the
pool's buffer to the scatter when the pool array holds the only reference,
which ``KVPool`` guarantees by rebinding its own list entry and never handing
the array out past the step (tests/test_kv_pool.py measures it); slots shared
by KV groups are written in place explicitly (see ``kv/schemes.py``).
"""

from __future__ import annotations

import mlx.core as mx

_DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
           "bfloat16": "bfloat16", "bf16": "bfloat16"}


def kv_dtype(name_or_dtype):
    if isinstance(name_or_dtype, mx.Dtype):
        return name_or_dtype
    try:
        return getattr(mx, _DTYPES[str(name_or_dtype).lower()])
    except KeyError:
        raise ValueError(f"unsupported KV dtype {name_or_dtype!r} (float32, float16, bfloat16)") from None


def default_kv_dtype(model_dtype):
    """The dense KV dtype for ``auto`` (quantized schemes keep the model's
    dtype for their dequantized output): the model's activation dtype, but
    float16 for models computed in float32 (GGUF weights on the CPU). Two
    bytes per value is what llama.cpp's default f16 cache and a bf16/fp16
    model's own dtype give; decode attention reads every cached byte each
    step, so float32 KV halved 8-stream decode at long contexts for no
    change in greedy tokens on the default model (see the engine tests)."""
    return mx.float16 if model_dtype == mx.float32 else model_dtype


class KVPool:
    """Block storage in MLX arrays for a model's layers, in the format of a KV scheme.

    ``layers`` is the model's per-layer KV spec (``kv/layer_spec.py``); the
    pool stores them in KV groups (``groups``): one storage slot per layer of
    a group, shared by the same slot of every group, each group addressed by
    its own block tables. The scheme (``kv/schemes.py``: dense
    fp32/fp16/bf16, affine q8/q4, TurboQuant) owns the arrays, the writes and
    the attention. Every storage array has leading dimension ``num_blocks *
    block_size`` (slot-major) and ``arrays()`` lists them all in a fixed
    order, so a block's bytes are rows ``[b*bs, (b+1)*bs)`` of each array.
    ``scheme_id`` names the format (``f32``, ``q8g64``, ``turbo-k8v3-s0`` ...)
    for cache namespaces. ``release=False`` keeps one group of all layers.
    """

    def __init__(self, layers, num_blocks: int, block_size: int, dtype="float32", kv_quant="off",
                 group_size: int = 64, seed: int = 0, release: bool = True):
        from .layer_spec import KVGroups
        from .schemes import KVSchemeSpec, parse_kv_quant

        self.groups = KVGroups(layers, release=release)
        self.layers = self.groups.layers
        self.num_layers = len(self.layers)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = kv_dtype(dtype)
        self.spec = kv_quant if isinstance(kv_quant, KVSchemeSpec) else parse_kv_quant(
            kv_quant, head_dim=self.layers[0].head_dim, dtype=self.dtype, group_size=group_size,
            seed=seed)
        self.scheme = self.spec.create(self.groups.slot_layers(), num_blocks * block_size,
                                       shared=len(self.groups) > 1)

    @property
    def scheme_id(self) -> str:
        return self.spec.scheme_id

    @property
    def keys(self):  # dense schemes only
        return self.scheme.keys

    @property
    def values(self):  # dense schemes only
        return self.scheme.values

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block (``block_size`` tokens of one group's layers)."""
        return self.block_size * self.spec.bytes_per_token(self.groups.slot_layers())

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def write(self, slot: int, slots, k, v) -> None:
        """Store k/v ``[T, n_kv_heads, head_dim]`` of storage slot ``slot`` (a
        group's layer; the layer itself for one group) at flat ``slots [T]``."""
        self.scheme.write(slot, slots, k, v)

    def arrays(self):
        return self.scheme.arrays()

    def read_rows(self, rows: mx.array) -> list[mx.array]:
        """Every storage array's ``rows`` (flat slots), in ``arrays()`` order."""
        return [mx.take(a, rows, axis=0) for a in self.arrays()]

    def write_rows(self, rows: mx.array, data) -> None:
        """Store ``data`` (one array per storage array) at ``rows``, evaluated."""
        arrays = self.arrays()
        for a, src in zip(arrays, data):
            a[rows] = src
        mx.eval(arrays)
