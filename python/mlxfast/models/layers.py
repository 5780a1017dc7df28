"""Building blocks shared by the model families.

Linear layers route through ``mlxfast.ops`` so that the native CPU kernels
run on the CPU and MLX's own ops elsewhere. Parameter names follow MLX's
(``weight``, ``scales``, ``biases``, ``bias``) so mlx-lm checkpoints load as
they are.

Hot paths (every ``__call__`` of a decode step) read arrays and child modules
with ``self["name"]`` / ``self.get("name")``: an ``nn.Module`` keeps them in
its dict, so ``self.name`` first fails the normal attribute lookup and then
runs ``Module.__getattr__`` (~1.5 us each, ~25 per layer: about half of the
Python time of building a step).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import mlx.nn as nn

from .. import ops


class Linear(nn.Module):
    """Dense ``x @ weight.T (+ bias)``.

    Optional fused pieces (one primitive on the CPU, same numbers as the
    separate ops): ``norm`` (an :class:`RMSNorm`) applied to x first, or
    ``act="silu_mul_halves"`` / ``act="gelu_mul_halves"`` (x holds gate and
    up halves: ``silu(gate) * up``, Llama; ``gelu_approx(gate) * up``, Gemma),
    and ``residual`` (with the product's shape) added last:
    ``residual + (x @ weight.T + bias)``. A bias, or a residual of another
    dtype than the product (MLX's add promotes it), is added as a separate op.
    """

    def __init__(self, in_dims: int, out_dims: int, bias: bool = False):
        super().__init__()
        self.weight = mx.zeros((out_dims, in_dims))
        if bias:
            self.bias = mx.zeros((out_dims,))

    def __call__(self, x: mx.array, *, norm=None, act: str | None = None,
                 residual: mx.array | None = None) -> mx.array:
        w = self["weight"]
        norm = _norm_args(norm)
        bias = self.get("bias")
        if residual is not None and (
                bias is not None or residual.dtype != mx.result_type(_prologue_dtype(x, norm), w)):
            return residual + _add_bias(ops.dense_matmul(x, w, norm=norm, act=act), bias)
        return _add_bias(ops.dense_matmul(x, w, norm=norm, act=act, residual=residual), bias)

    def argmax(self, x: mx.array, *, norm=None) -> mx.array:
        """``mx.argmax(self(x, norm=norm), axis=-1)`` (an output head's greedy choice)."""
        return mx.argmax(self(x, norm=norm), axis=-1)


# How the quantized projections treat their activations: "fp32" (the
# default, exact: x as it is) or "int8" (opt-in: x quantized to int8 per 32
# values, ops.quantized_matmul(activations="int8")). A property of each
# layer, set for a whole model by set_matmul_activations (mlxfast.load's
# matmul_activations=).
MATMUL_ACTIVATIONS = ("fp32", "int8")
# The widths int8 activations apply to (the VNNI kernel's); layers of other
# widths keep fp32 activations.
INT8_ACTIVATION_BITS = (4, 8)


class QuantizedLinear(nn.Module):
    """Affine-quantized ``x @ dequantize(weight).T (+ bias)`` (MLX format).

    Takes the same fused pieces as :class:`Linear`. ``activations`` ("fp32"
    or "int8", see ``MATMUL_ACTIVATIONS``) is passed to the matmul."""

    def __init__(self, in_dims: int, out_dims: int, bias: bool, group_size: int, bits: int):
        super().__init__()
        if in_dims % group_size:
            raise ValueError(
                f"input size {in_dims} is not a multiple of the group size {group_size}"
            )
        self.group_size = group_size
        self.bits = bits
        self.activations = "fp32"
        self.weight = mx.zeros((out_dims, in_dims * bits // 32), dtype=mx.uint32)
        self.scales = mx.zeros((out_dims, in_dims // group_size))
        self.biases = mx.zeros((out_dims, in_dims // group_size))
        if bias:
            self.bias = mx.zeros((out_dims,))
        self.freeze()

    def __call__(self, x: mx.array, *, norm=None, act: str | None = None,
                 residual: mx.array | None = None) -> mx.array:
        norm = _norm_args(norm)
        w, scales, biases = self["weight"], self["scales"], self.get("biases")
        bias = self.get("bias")
        if residual is not None and (bias is not None or residual.dtype != _prologue_dtype(x, norm)):
            y = ops.quantized_matmul(x, w, scales, biases, group_size=self.group_size,
                                     bits=self.bits, norm=norm, act=act,
                                     activations=self.activations)
            return residual + _add_bias(y, bias)
        return _add_bias(ops.quantized_matmul(
            x, w, scales, biases, group_size=self.group_size, bits=self.bits, norm=norm, act=act,
            residual=residual, activations=self.activations), bias)

    def argmax(self, x: mx.array, *, norm=None) -> mx.array:
        """``mx.argmax(self(x, norm=norm), axis=-1)``, the same tokens (an
        output head's greedy choice; see :func:`quantized_head_argmax`)."""
        if "bias" in self or self.activations != "fp32":
            return mx.argmax(self(x, norm=norm), axis=-1)
        return quantized_head_argmax(self, x, norm)


def quantized_head_argmax(layer, x: mx.array, norm) -> mx.array:
    """The argmax over a quantized output head's logits of ``norm(x)``
    (``ops.quantized_argmax``: most logits never computed in fp32, for two
    or more rows where the CPU runs it natively; otherwise the full head's
    argmax). Its error bounds are built on first use and kept with the
    layer (rebuilt should its weights change)."""
    w, scales, biases = layer["weight"], layer["scales"], layer.get("biases")
    norm = _norm_args(norm)
    bounds = None
    # One row streams the head's weights either way, and the bounds add bytes
    # (session 36, Zen 4, one row from DRAM: the default model's head 0.97x,
    # a 1B's 0.85x); from two rows the int8 head's arithmetic wins (1B 1.17x
    # at 2 rows, 2.05x at 8; the default model's 1.4x and 2.1x).
    if x.size > x.shape[-1] and ops.has_native_quantized_argmax(x, w, layer.bits, norm):
        cached = layer.__dict__.get("_argmax_bounds")
        if cached is None or cached[0] is not w:
            # Not a parameter (it is derived, and saved models must not carry it).
            cached = (w, ops.argmax_bounds(w, scales, biases, group_size=layer.group_size,
                                           bits=layer.bits))
            object.__setattr__(layer, "_argmax_bounds", cached)
        bounds = cached[1]
    return ops.quantized_argmax(x, w, scales, biases, bounds, group_size=layer.group_size,
                                bits=layer.bits, norm=norm)


# The CPU paths with kernels for the row-interleaved layout (elsewhere the
# portable kernel reads it, slowly: it stays in MLX's layout there).
ROWS16_PATHS = ("avx512", "avx2")


def pack_rows16(model: nn.Module) -> int:
    """Repack the 4- and 8-bit projections of ``model`` (QuantizedLinear,
    QuantizedEmbedding, whose lookup reads it too, and the MoE experts'
    stacked ones; rows a multiple of 16) into the row-interleaved layout
    (``ops.pack_rows16``) where ops run on the CPU's AVX-512 or AVX2 path,
    whose kernels read it with rows in the lanes of a vector (csrc/cpu/qmm.h,
    ``Args::rows16``): the same bytes in another order, the layer's calls
    unchanged. Layers with int8 activations are packed where the int8
    kernels read this layout (``ops.int8_activations_layout()``: AVX-512
    VNNI and AVX2). Elsewhere nothing changes. Returns how many layers were
    packed.
    Code that slices a layer's weight (models/shard.py) calls
    :func:`unpack_rows16` first."""
    if not (ops.on_cpu(None) and ops.cpu_path() in ROWS16_PATHS):
        return 0
    int8_rows16 = ops.int8_activations_layout() == "rows16"
    n = 0
    for _, layer in model.named_modules():
        stacked = _packable(layer)
        if (stacked is not None
                and (layer.activations == "fp32" or int8_rows16)
                and layer["weight"].ndim == (3 if stacked else 2)
                and ops.can_pack_rows16(layer["weight"], layer.bits)):
            _set_weights(layer, ops.pack_rows16(layer["weight"], layer["scales"], layer.get("biases")))
            n += 1
    return n


def unpack_rows16(model: nn.Module) -> int:
    """Every row-interleaved layer of ``model`` back in MLX's layout (see
    :func:`pack_rows16`); returns how many."""
    n = 0
    for _, layer, stacked in _packed_layers(model):
        _set_weights(layer, ops.unpack_rows16(layer["weight"], layer["scales"],
                                              layer.get("biases"), stacked=stacked))
        n += 1
    return n


def rows16_params(model: nn.Module) -> set[str]:
    """The names (as ``tree_flatten(model.parameters())`` gives them) of the
    parameters held in the row-interleaved layout."""
    out = set()
    for path, layer, _ in _packed_layers(model):
        prefix = f"{path}." if path else ""
        out.update(prefix + k for k in ("weight", "scales", "biases") if k in layer)
    return out


def _packed_layers(model: nn.Module):
    """(path, layer, stacked) for each layer held in the row-interleaved layout."""
    for path, layer in model.named_modules():
        stacked = _packable(layer)
        if stacked is not None and layer["weight"].ndim == (4 if stacked else 3):
            yield path, layer, stacked


def _packable(layer) -> bool | None:
    """None: a layer pack_rows16 leaves alone; else whether its weights are
    stacked experts (moe.QuantizedSwitchLinear, which imports this module:
    known by its ``params``), not one projection."""
    if isinstance(layer, (QuantizedLinear, QuantizedEmbedding)):
        return False
    if hasattr(layer, "params") and hasattr(layer, "bits") and "scales" in layer:
        return True
    return None


def _set_weights(layer, arrays) -> None:
    w, scales, biases = arrays
    layer.update({"weight": w, "scales": scales} | ({} if biases is None else {"biases": biases}))
    mx.eval(layer.parameters())


def _prologue_dtype(x: mx.array, norm) -> mx.Dtype:
    """The dtype the matmul sees (rms_norm promotes x with its weight)."""
    return x.dtype if norm is None else mx.result_type(x, norm[0])


def _add_bias(y: mx.array, bias) -> mx.array:
    return y if bias is None else y + bias


def _norm_args(norm):
    """An RMSNorm module as the ops' ``norm=(weight, eps)``."""
    return None if norm is None else (norm["weight"], norm.eps)


def fuse_linears(layers: list) -> "Linear | QuantizedLinear | None":
    """One layer computing all of ``layers`` side by side (their outputs
    concatenated), or None when they differ in kind, quantization or dtype.
    One matmul streams the shared input once and costs one dispatch."""
    first = layers[0]
    if any(type(layer) is not type(first) for layer in layers):
        return None
    if any(("bias" in layer) != ("bias" in first) or ("biases" in layer) != ("biases" in first)
           for layer in layers):
        return None
    names = ["weight", "bias"] if isinstance(first, Linear) else ["weight", "scales", "biases", "bias"]
    names = [n for n in names if n in first]
    if any(layer[n].dtype != first[n].dtype for layer in layers for n in names):
        return None
    in_dims = first.weight.shape[1]
    out_dims = sum(layer.weight.shape[0] for layer in layers)
    if isinstance(first, QuantizedLinear):
        if any((layer.bits, layer.group_size) != (first.bits, first.group_size) for layer in layers):
            return None
        if any(layer.activations != first.activations for layer in layers):
            return None
        fused = QuantizedLinear(in_dims * 32 // first.bits, out_dims, "bias" in first,
                                first.group_size, first.bits)
        fused.activations = first.activations
    elif isinstance(first, Linear):
        fused = Linear(in_dims, out_dims, "bias" in first)
    else:
        return None
    fused.update({n: mx.concatenate([layer[n] for layer in layers], axis=0) for n in names})
    if isinstance(first, QuantizedLinear) and "biases" not in first:
        fused.pop("biases")
    return fused


def drop_symmetric_biases(model: nn.Module) -> int:
    """Drop the biases of every quantized layer (linear, embedding, stacked
    experts) whose format is symmetric: every bias exactly -2^(bits-1) *
    scale, as GGUF's Q4_0 and Q8_0 are read. The kernels compute those
    biases instead of streaming them: at 4 bits and group size 32 a tenth
    fewer bytes per token, and one parameter stream instead of two (see
    ops.quantized_matmul). Returns how many layers lost their biases."""
    dropped = 0
    for _, layer in model.named_modules():
        b = layer.get("biases") if hasattr(layer, "bits") and "scales" in layer else None
        if b is None:
            continue
        # In float32, as the kernels compute the bias: a stored bias that
        # overflowed its dtype is not the kernel's and stays.
        want = ops.symmetric_biases(layer["scales"].astype(mx.float32), layer.bits)
        if mx.array_equal(b.astype(mx.float32), want).item():
            layer.pop("biases")
            dropped += 1
    return dropped


class Embedding(nn.Module):
    def __init__(self, num: int, dims: int):
        super().__init__()
        self.weight = mx.zeros((num, dims))

    def __call__(self, ids: mx.array) -> mx.array:
        return self.weight[ids]

    def as_linear(self, x: mx.array, *, norm=None) -> mx.array:
        """``norm(x) @ weight.T`` (tied output head; ``norm`` an optional
        :class:`RMSNorm`, fused into the matmul)."""
        return ops.dense_matmul(x, self["weight"], norm=_norm_args(norm))

    def argmax(self, x: mx.array, *, norm=None) -> mx.array:
        """``mx.argmax(self.as_linear(x, norm=norm), axis=-1)``."""
        return mx.argmax(self.as_linear(x, norm=norm), axis=-1)


class QuantizedEmbedding(nn.Module):
    def __init__(self, num: int, dims: int, group_size: int, bits: int):
        super().__init__()
        self.group_size = group_size
        self.bits = bits
        self.activations = "fp32"  # of as_linear (a tied output head; set_matmul_activations keeps fp32)
        self.weight = mx.zeros((num, dims * bits // 32), dtype=mx.uint32)
        self.scales = mx.zeros((num, dims // group_size))
        self.biases = mx.zeros((num, dims // group_size))
        self.freeze()

    def __call__(self, ids: mx.array) -> mx.array:
        # Dequantize in float32: fp16 scales would round every element.
        return ops.dequantize_rows(self["weight"], self["scales"], self.get("biases"), ids,
                                   group_size=self.group_size, bits=self.bits, dtype=mx.float32)

    def as_linear(self, x: mx.array, *, norm=None) -> mx.array:
        """``norm(x) @ dequantize(weight).T`` (tied output head, as Embedding's)."""
        return ops.quantized_matmul(x, self["weight"], self["scales"], self.get("biases"),
                                    group_size=self.group_size, bits=self.bits,
                                    norm=_norm_args(norm), activations=self.activations)

    def argmax(self, x: mx.array, *, norm=None) -> mx.array:
        """``mx.argmax(self.as_linear(x, norm=norm), axis=-1)``, the same
        tokens (see :func:`quantized_head_argmax`)."""
        if self.activations != "fp32":
            return mx.argmax(self.as_linear(x, norm=norm), axis=-1)
        return quantized_head_argmax(self, x, norm)


def set_matmul_activations(model: nn.Module, mode: str) -> int:
    """Set every quantized projection inside ``model``'s blocks (of 4 or 8
    bits, see ``INT8_ACTIVATION_BITS``) to ``mode`` ("fp32" or "int8");
    returns how many layers now run int8 activations. The output head
    (``lm_head``, or the tied embedding's ``as_linear``) keeps fp32: its
    logits pick the token, and int8 there cost top-1 agreement with
    llama.cpp (default model, 7,424 positions: 95.65% with an int8 head,
    96.04% without, fp32 95.81%) for no decode or prefill gain (one row).
    The MoE experts' stacked projections (models.moe.QuantizedSwitchLinear)
    follow the same rule; dense layers and other widths keep fp32. Raises
    ValueError for an unknown mode, and for "int8" where ops run on a CPU
    without a native int8 kernel (the message names what the CPU lacks)."""
    if mode not in MATMUL_ACTIVATIONS:
        raise ValueError(f"matmul activations must be one of {', '.join(MATMUL_ACTIVATIONS)}, "
                         f"got {mode!r}")
    if mode == "int8" and ops.on_cpu(None):
        missing = ops.int8_activations_unsupported()
        if missing:
            raise ValueError(f"--matmul-activations int8: {missing}")
    n = 0
    unpack_rows16(model)  # repacked below, each layer as its kernel reads it
    for path, layer in model.named_modules():
        # The quantized projections: QuantizedLinear, QuantizedEmbedding and
        # moe.QuantizedSwitchLinear (which imports this module) carry both.
        if hasattr(layer, "activations") and hasattr(layer, "bits"):
            head = isinstance(layer, QuantizedEmbedding) or path.split(".")[-1] == "lm_head"
            on = mode == "int8" and layer.bits in INT8_ACTIVATION_BITS and not head
            layer.activations = "int8" if on else "fp32"
            n += on
    model.matmul_activations = mode
    pack_rows16(model)
    return n


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return ops.rms_norm(x, self["weight"], self.eps)


class RoPE(nn.Module):
    """Rotary embedding (HF "half" layout), with llama3 frequency scaling."""

    def __init__(self, dims: int, base: float, scaling: dict | None, traditional: bool = False):
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        self.base = base
        self.scale = 1.0
        self._freqs = None
        kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
        if kind in (None, "default"):
            pass
        elif kind == "linear":
            self.scale = 1.0 / float(scaling["factor"])
        elif kind == "llama3":
            self._freqs = _llama3_freqs(dims, base, scaling)
        elif kind == "freq_factors":  # a GGUF's rope_freqs tensor: each frequency's divisor
            factors = mx.array(scaling["factors"], dtype=mx.float32)
            if factors.shape != (dims // 2,):
                raise ValueError(f"rope freq factors: {factors.shape[0]} values for {dims // 2} frequencies")
            self._freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims) * factors
        else:
            raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")
        if self._freqs is not None:
            mx.eval(self._freqs)  # not a parameter: the loader's eval would leave it lazy

    def __call__(self, x: mx.array, positions: mx.array) -> mx.array:
        """x [..., H, D] with one int32 position per token (``positions`` = x.shape[:-2])."""
        return ops.rope(
            x, positions, self.dims, traditional=self.traditional,
            base=None if self._freqs is not None else self.base,
            scale=self.scale, freqs=self._freqs,
        )


def token_positions(offsets, batch: int, length: int) -> mx.array:
    """[batch, length] int32 positions from a cache's offsets (an int, or one per
    row: int32 [batch] or [batch, 1])."""
    if isinstance(offsets, int):  # a host constant, not graph nodes
        return mx.array(np.broadcast_to(np.arange(offsets, offsets + length, dtype=np.int32),
                                        (batch, length)))
    offsets = offsets.astype(mx.int32).reshape(batch, 1)
    return offsets if length == 1 else offsets + mx.arange(length, dtype=mx.int32)


def _llama3_freqs(dims: int, base: float, cfg: dict) -> mx.array:
    factor = float(cfg["factor"])
    low = float(cfg.get("low_freq_factor", 1.0))
    high = float(cfg.get("high_freq_factor", 4.0))
    old_len = float(cfg.get("original_max_position_embeddings", 8192))
    freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    wavelens = 2 * math.pi * freqs
    low_wl, high_wl = old_len / low, old_len / high
    freqs = mx.where(wavelens > low_wl, freqs * factor, freqs)
    medium = (wavelens > high_wl) & (wavelens < low_wl)
    smooth = (old_len / wavelens - low) / (high - low)
    smooth_freqs = freqs / ((1 - smooth) / factor + smooth)
    return mx.where(medium, smooth_freqs, freqs)
