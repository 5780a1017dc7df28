"""Phi-3 models (HF ``phi3``, GGUF ``phi3``): Phi-3/3.5-mini, Phi-3-medium,
Phi-4-mini and fine-tunes.

The Llama family's layers with three differences:

- The checkpoint stores q/k/v as one ``qkv_proj`` (q heads, k heads, v heads)
  and gate/up as one ``gate_up_proj`` (gate half, then up): the very layout
  llama's fused projections use, so they load as they are (nothing split or
  regrouped) and run the same fused primitives (``qkv_rope``, the
  ``silu_mul_halves`` prologue of the down projection).
- Partial RoPE: ``partial_rotary_factor`` < 1 rotates only the first
  ``int(head_dim * factor)`` features of each head (Phi-4-mini: 0.75).
- LongRoPE (``rope_scaling`` type ``longrope`` or ``su``): per-frequency
  divisors (``long_factor``) and an attention factor
  ``sqrt(1 + ln(s) / ln(original))`` on cos/sin, ``s = max_position_embeddings /
  original_max_position_embeddings`` (1 when s <= 1; a config's or GGUF's
  ``attention_factor`` wins). The long factors are used at every length, as
  mlx-lm's SuScaledRoPE does and llama.cpp does whenever its context exceeds
  the original one (its default, the full trained context); HF transformers
  switches to ``short_factor`` for sequences within the original length.
  The divisors go to the fused RoPE primitive as per-frequency ``freqs``.
  The attention factor a scales the rotated features of q and k, hence their
  part of each score by a^2: with RoPE on every feature that is the attention
  scale times a^2 (exact, free); with partial RoPE, q's rotated features
  times a^2 after RoPE (one multiply per layer). Folding a into the qkv
  weights instead would round it into fp16 quantization scales (measured:
  0.6% of the logit range off on a Q8_0 file).

``sliding_window`` in the config (2047 in Phi-3-mini-4k, 262144 in others)
is read but not applied: mlx-lm ignores it and llama.cpp disables it for
Phi-3 ("Phi SWA is currently disabled"), so every layer attends fully, as
both references compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from . import llama
from .layers import Linear, RMSNorm, RoPE


@dataclass
class ModelArgs(llama.ModelArgs):
    partial_rotary_factor: float = 1.0
    original_max_position_embeddings: int | None = None
    sliding_window: int | None = None  # read, not applied (see the module docstring)

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if self.rope_dims % 2:
            raise ValueError(f"Phi-3 rotary dims {self.rope_dims} (head_dim {self.head_dim} x "
                             f"partial_rotary_factor {self.partial_rotary_factor}) must be even")
        if self.longrope is not None:
            n = len(self.longrope["long_factor"])
            if n != self.rope_dims // 2:
                raise ValueError(f"rope_scaling long_factor has {n} entries for "
                                 f"{self.rope_dims // 2} rotary frequencies")

    @property
    def rope_dims(self) -> int:
        """The features RoPE rotates in each head (HF's and mlx-lm's rounding)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def longrope(self) -> dict | None:
        """``rope_scaling`` when it is LongRoPE (``longrope``/``su``), else None."""
        s = self.rope_scaling or {}
        return s if (s.get("type") or s.get("rope_type")) in ("longrope", "su") else None

    @property
    def rope_attention_factor(self) -> float:
        """LongRoPE's factor on cos/sin (1.0 without LongRoPE)."""
        s = self.longrope
        if s is None:
            return 1.0
        if s.get("attention_factor") is not None:
            return float(s["attention_factor"])
        orig = self.original_max_position_embeddings or self.max_position_embeddings
        factor = self.max_position_embeddings / orig
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))

    @classmethod
    def from_config(cls, config: dict) -> "ModelArgs":
        act = config.get("hidden_act") or "silu"
        if act != "silu":
            raise ValueError(f"Phi-3 MLP activation {act!r} is not supported (silu)")
        kwargs = cls.known_fields(config)
        kwargs["attention_bias"] = kwargs["mlp_bias"] = False  # Phi-3 has no biases
        kwargs["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", False))
        scaling = config.get("rope_scaling") or None
        if scaling is not None and kwargs.get("original_max_position_embeddings") is None:
            orig = scaling.get("original_max_position_embeddings")
            if orig is not None:
                kwargs["original_max_position_embeddings"] = int(orig)
        if scaling is not None:
            kind = scaling.get("type") or scaling.get("rope_type")
            if kind in ("longrope", "su") and not scaling.get("long_factor"):
                raise ValueError(f"rope_scaling {kind!r} without long_factor")
        return cls.build(kwargs)


def _rope(args: ModelArgs) -> RoPE:
    dims = args.rope_dims
    s = args.longrope
    if s is None:  # none, linear or llama3, as llama's RoPE reads them
        return RoPE(dims, args.rope_theta, args.rope_scaling, args.rope_traditional)
    rope = RoPE(dims, args.rope_theta, None, args.rope_traditional)
    base = args.rope_theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    rope._freqs = mx.array(s["long_factor"], dtype=mx.float32) * base  # periods: angle = pos / freq
    # Evaluated here: it is no parameter (the loader's eval skips it), and a
    # graph built on this thread cannot run on the engine's.
    mx.eval(rope._freqs)
    return rope


class Attention(llama.Attention):
    """One ``qkv_proj`` from the checkpoint; llama's fused path runs it."""

    def __init__(self, args: ModelArgs, layer: int):
        nn.Module.__init__(self)
        self.layer = layer
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = hd = args.head_dim
        self.scale = hd**-0.5
        self.qkv_proj = Linear(args.hidden_size, (self.n_heads + 2 * self.n_kv_heads) * hd)
        self.o_proj = Linear(self.n_heads * hd, args.hidden_size)
        self.rope = _rope(args)
        # LongRoPE's factor a on cos/sin scales the rotated features of q and
        # k, so their scores by a^2: in the attention scale when RoPE rotates
        # every feature, else on q's rotated features (set by Model.fuse_projections,
        # in the activation dtype).
        self.rope_factor = args.rope_attention_factor
        if self.rope_factor != 1.0 and args.rope_dims == hd:
            self.scale *= self.rope_factor**2

    def fuse(self) -> None:
        """Already fused in the checkpoint."""

    def _fused_qkv(self, qkv: mx.array, positions: mx.array):
        q, k, v = super()._fused_qkv(qkv, positions)
        q_scale = self.get("_q_scale")
        return (q if q_scale is None else q * q_scale), k, v

    def set_q_scale(self, dtype: mx.Dtype) -> None:
        """Partial RoPE with an attention factor: q's rotated features times a^2."""
        dims = self["rope"].dims
        if self.rope_factor == 1.0 or dims == self.head_dim:
            return
        rotated = mx.arange(self.head_dim) < dims
        self._q_scale = mx.where(rotated, self.rope_factor**2, 1.0).astype(dtype)
        mx.eval(self._q_scale)


class MLP(llama.MLP):
    """One ``gate_up_proj`` (gate rows, then up rows) from the checkpoint."""

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        h, m = args.hidden_size, args.intermediate_size
        self.gate_up_proj = Linear(h, 2 * m)
        self.down_proj = Linear(m, h)

    def fuse(self) -> None:
        """Already fused in the checkpoint."""


class Block(llama.Block):
    def __init__(self, args: ModelArgs, layer: int):
        nn.Module.__init__(self)
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(llama.Model):
    """Causal LM with llama.Model's interface (``model(tokens, cache, logit_rows)``)."""

    block = Block

    def fuse_projections(self) -> None:
        """Nothing to fuse (the checkpoint is); the q scale of partial LongRoPE
        in the activation dtype, now that the weights are loaded."""
        for layer in self.model.layers:
            layer.self_attn.set_q_scale(self.dtype)
