"""Tensor parallelism: a loaded model's weights split over the ranks of an
``mx.distributed`` group, along Megatron's lines.

``shard_model(model, group)`` replaces the weights in place:

* q/k/v and gate/up are column-sharded (output rows): rank r keeps the rows
  of its heads. A fused ``qkv_proj`` is sliced per segment (this rank's q
  rows, then its k rows, then its v rows) and a fused ``gate_up_proj`` per
  half, so ``qkv_rope`` and ``silu_mul_halves`` / ``gelu_mul_halves`` run on
  the shard unchanged;
* o and down are row-sharded (input columns) and wrapped in
  :class:`RowParallelLinear`: the partial product, one ``all_sum``, then the
  bias and the residual. The residual epilogue of the native matmul moves
  after the all-reduce (a residual added on every rank would be counted N
  times); the RMSNorm / activation prologue stays in the matmul;
* MLX-quantized weights are sliced along whole groups (an input-dim slice
  that would cut a group is refused);
* the attention modules and ``model.args`` then report the local head counts
  and intermediate size, so ``model.kv_layers`` (and with it the KV pool and
  the paged attention) hold only this rank's KV heads;
* the embedding is replicated (a lookup: no collective, every rank needs the
  hidden state); the output head is replicated and computed on rank 0 only:
  the other ranks end their step at the last hidden state
  (``model.compute_head = False``; an untied ``lm_head`` is dropped there).
  Measured (``bench/bench_tp.py``, 49152 x 576 4-bit head, 2 ranks on
  loopback, 1 thread each): half the head plus an ``all_gather`` of the
  logits takes 0.61 ms for 1 row and 6.8 ms for 8, the whole head on rank 0
  0.88 and 8.1 ms: 0.5-2% of a tp=2 step, not yet worth a second logits
  path (every rank computing and gathering logits, the logit rows sent).

Heads, KV heads and the intermediate size must divide by the group size (the
error says which does not): KV heads are not replicated, as vLLM does not
replicate them when they do not divide either. Mixture-of-experts models are
refused.
"""

from __future__ import annotations

import dataclasses
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .layers import Linear, QuantizedLinear, pack_rows16, unpack_rows16

# The ring backend's all_sum costs ~6 ms flat above ~1 MiB on loopback (0.3 ms
# at 512 KiB; bench/bench_tp.py), so larger reductions go in row chunks of at
# most this many bytes.
MAX_COLLECTIVE_BYTES = 512 << 10


def all_sum(x: mx.array, group) -> mx.array:
    """``mx.distributed.all_sum`` over ``group`` (CPU stream), in row chunks of
    at most ``MAX_COLLECTIVE_BYTES``."""
    if x.nbytes <= MAX_COLLECTIVE_BYTES:
        return mx.distributed.all_sum(x, group=group, stream=mx.cpu)
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    rows = max(1, MAX_COLLECTIVE_BYTES // (shape[-1] * x.itemsize))
    parts = [mx.distributed.all_sum(flat[i:i + rows], group=group, stream=mx.cpu)
             for i in range(0, flat.shape[0], rows)]
    return mx.concatenate(parts, axis=0).reshape(shape)


@dataclasses.dataclass(frozen=True)
class TPInfo:
    """Where a sharded model sits: its rank, the group size, the args of the
    whole model, and the parameter bytes of the whole model and of this shard."""

    rank: int
    size: int
    full_args: object
    full_param_bytes: int
    param_bytes: int


class RowParallelLinear(nn.Module):
    """A row-sharded projection: ``residual + (all_sum(x_r @ W_r.T) + bias)``.

    ``inner`` (a Linear / QuantizedLinear without bias) holds this rank's
    input columns; its matmul keeps the fused norm / activation prologue,
    while the bias and the residual are added once, after the all-reduce."""

    def __init__(self, inner, group, bias: mx.array | None = None):
        super().__init__()
        self.inner = inner
        if bias is not None:
            self.bias = bias
        self.group = group

    def __call__(self, x: mx.array, *, norm=None, act: str | None = None,
                 residual: mx.array | None = None) -> mx.array:
        y = all_sum(self["inner"](x, norm=norm, act=act), self.group)
        bias = self.get("bias")
        if bias is not None:
            y = y + bias
        return y if residual is None else residual + y


class ShardError(ValueError):
    """The model cannot be split over this many ranks (the message says why)."""


def _own(a: mx.array) -> mx.array:
    """A copy in a buffer of its own (a slice of a row-contiguous array would
    keep the whole weight alive)."""
    if a.dtype == mx.bfloat16:
        return mx.array(np.array(a.view(mx.uint16))).view(mx.bfloat16)
    return mx.array(np.array(a))


def _names(layer) -> list[str]:
    names = ["weight", "bias"] if isinstance(layer, Linear) else ["weight", "scales", "biases", "bias"]
    return [n for n in names if n in layer]


def _slice_rows(layer, segments: list[tuple[int, int]]):
    """A layer of the same kind computing output rows ``segments`` (concatenated)."""
    if not isinstance(layer, (Linear, QuantizedLinear)):
        raise ShardError(f"cannot shard a {type(layer).__name__} projection")
    out_dims = sum(b - a for a, b in segments)
    if isinstance(layer, Linear):
        new = Linear(layer.weight.shape[1], out_dims, "bias" in layer)
    else:
        new = QuantizedLinear(layer.weight.shape[1] * 32 // layer.bits, out_dims, "bias" in layer,
                              layer.group_size, layer.bits)
        new.activations = layer.activations
    upd = {}
    for n in _names(layer):
        parts = [layer[n][a:b] for a, b in segments]
        upd[n] = _own(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0))
    new.update(upd)
    _keep_symmetric(layer, new)
    return new


def _keep_symmetric(layer, new) -> None:
    """A slice of a layer without biases (a symmetric format) has none either."""
    if isinstance(layer, QuantizedLinear) and "biases" not in layer:
        new.pop("biases")


def _slice_cols(layer, a: int, b: int, what: str):
    """(layer computing ``x[..., a:b] @ W[:, a:b].T`` without bias, its bias or None)."""
    if isinstance(layer, Linear):
        new = Linear(b - a, layer.weight.shape[0], False)
        new.update({"weight": _own(layer.weight[:, a:b])})
    elif isinstance(layer, QuantizedLinear):
        gs, bits = layer.group_size, layer.bits
        if a % gs or b % gs:
            raise ShardError(f"{what}: this rank's input slice [{a}, {b}) cuts the quantization groups "
                             f"of {gs} weights; tensor parallelism needs each rank's share of the "
                             f"input ({b - a}) to be a multiple of the group size")
        new = QuantizedLinear(b - a, layer.weight.shape[0], False, gs, bits)
        new.activations = layer.activations
        w_per = 32 // math.gcd(32, bits)  # weights per whole number of uint32 words
        if a % w_per:
            raise ShardError(f"{what}: {bits}-bit words do not align at input {a}")
        new.update({"weight": _own(layer.weight[:, a * bits // 32:b * bits // 32]),
                    "scales": _own(layer.scales[:, a // gs:b // gs])})
        if "biases" in layer:
            new.update({"biases": _own(layer.biases[:, a // gs:b // gs])})
        _keep_symmetric(layer, new)
    else:
        raise ShardError(f"cannot shard a {type(layer).__name__} projection ({what})")
    return new, layer.get("bias")


def param_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(p.nbytes for _, p in tree_flatten(model.parameters()))


def check_shardable(args, size: int, model=None) -> None:
    """Raise ShardError unless a model with ``args`` splits over ``size`` ranks."""
    if size < 1:
        raise ShardError(f"tensor parallel size must be at least 1, got {size}")
    problems = []
    hq, hkv = args.num_attention_heads, args.num_key_value_heads
    if hq % size:
        problems.append(f"{hq} attention heads")
    if hkv % size:
        problems.append(f"{hkv} KV heads")
    if args.intermediate_size % size:
        problems.append(f"an MLP of {args.intermediate_size}")
    if problems:
        raise ShardError(
            f"this {args.model_type} model cannot be split over {size} ranks: "
            f"{' and '.join(problems)} do not divide by {size} (each rank takes an equal share of "
            f"the query heads, the KV heads and the MLP; KV heads are not replicated). "
            f"Sizes that divide: {', '.join(str(n) for n in _sizes(args)) or 'none but 1'}")
    if model is not None:
        from . import llama

        for layer in model.layers:
            attn, mlp = layer.get("self_attn"), layer.get("mlp")
            if not isinstance(attn, llama.Attention) or not isinstance(mlp, llama.MLP):
                raise ShardError(f"tensor parallelism supports the dense families (llama, mistral, "
                                 f"qwen2, qwen3, gemma3, phi3); {args.model_type} layers with "
                                 f"{type(attn).__name__} and {type(mlp).__name__} are not supported")


def _sizes(args) -> list[int]:
    g = math.gcd(args.num_attention_heads, args.num_key_value_heads, args.intermediate_size)
    return [n for n in range(2, g + 1) if g % n == 0][:8]


def shard_model(model, group, *, rank: int | None = None, size: int | None = None) -> TPInfo:
    """Split ``model``'s weights for ``rank`` of ``size`` (default: the group's)
    in place and return its :class:`TPInfo`; the row-parallel projections
    all-reduce over ``group``. Checks everything before changing anything
    (but the layout: the projections are sliced in MLX's layout and
    repacked after, see layers.pack_rows16)."""
    unpack_rows16(model)
    try:
        return _shard(model, group, rank, size)
    finally:
        pack_rows16(model)


def _shard(model, group, rank: int | None, size: int | None) -> TPInfo:
    rank = group.rank() if rank is None else rank
    size = group.size() if size is None else size
    args = model.args
    check_shardable(args, size, model)
    full_bytes = param_bytes(model)
    hq, hkv, m = args.num_attention_heads // size, args.num_key_value_heads // size, \
        args.intermediate_size // size
    # Every check first (quantization groups), so a refusal leaves the model whole.
    plan = []
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        D = attn.head_dim
        if attn.n_heads != args.num_attention_heads or attn.n_kv_heads != args.num_key_value_heads:
            raise ShardError("the model is already sharded")
        for name, lo, hi in (("o_proj", rank * hq * D, (rank + 1) * hq * D),
                             ("down_proj", rank * m, (rank + 1) * m)):
            proj = attn["o_proj"] if name == "o_proj" else mlp["down_proj"]
            if isinstance(proj, QuantizedLinear) and (lo % proj.group_size or hi % proj.group_size):
                _slice_cols(proj, lo, hi, f"layers.{i}.{name}")  # raises the ShardError
        plan.append((attn, mlp, D))
    for attn, mlp, D in plan:
        Hq, Hkv = attn.n_heads, attn.n_kv_heads
        q = (rank * hq * D, (rank + 1) * hq * D)
        k = ((Hq + rank * hkv) * D, (Hq + (rank + 1) * hkv) * D)
        v = ((Hq + Hkv + rank * hkv) * D, (Hq + Hkv + (rank + 1) * hkv) * D)
        if "qkv_proj" in attn:
            attn.qkv_proj = _slice_rows(attn.qkv_proj, [q, k, v])
        else:
            attn.q_proj = _slice_rows(attn.q_proj, [q])
            attn.k_proj = _slice_rows(attn.k_proj, [(k[0] - Hq * D, k[1] - Hq * D)])
            attn.v_proj = _slice_rows(attn.v_proj, [(v[0] - (Hq + Hkv) * D, v[1] - (Hq + Hkv) * D)])
        inner, bias = _slice_cols(attn.o_proj, *q, "o_proj")
        attn.o_proj = RowParallelLinear(inner, group, bias)
        attn.n_heads, attn.n_kv_heads = hq, hkv
        M = args.intermediate_size
        gate, up = (rank * m, (rank + 1) * m), (M + rank * m, M + (rank + 1) * m)
        if "gate_up_proj" in mlp:
            mlp.gate_up_proj = _slice_rows(mlp.gate_up_proj, [gate, up])
        else:
            mlp.gate_proj = _slice_rows(mlp.gate_proj, [gate])
            mlp.up_proj = _slice_rows(mlp.up_proj, [(up[0] - M, up[1] - M)])
        inner, bias = _slice_cols(mlp.down_proj, *gate, "down_proj")
        mlp.down_proj = RowParallelLinear(inner, group, bias)
    model.args = dataclasses.replace(args, num_attention_heads=hq, num_key_value_heads=hkv,
                                     intermediate_size=m)
    if rank != 0:
        model.compute_head = False  # rank 0 computes the logits and samples
        if "lm_head" in model:
            model.pop("lm_head")
    mx.eval(model.parameters())
    info = TPInfo(rank, size, args, full_bytes, param_bytes(model))
    model.tp = info
    return info
