"""Gemma 3 text models (HF ``gemma3_text``, GGUF ``gemma3``).

What differs from the Llama family (whose attention and layers it reuses):
interleaved sliding-window (local) and full (global) attention layers, each
kind with its own RoPE base; q/k RMSNorm; RMSNorm weights of the form
``1 + w`` (folded into the weights at load time: GGUF files already store
them folded); norms before *and after* attention and MLP; embeddings scaled
by sqrt(hidden); a GELU-tanh gated MLP; the attention scale from
``query_pre_attn_scalar``; optional final-logit soft-capping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from ..kv.layer_spec import LayerKV
from . import llama
from .layers import RMSNorm, RoPE

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass
class ModelArgs(llama.ModelArgs):
    rope_local_base_freq: float = 10000.0
    query_pre_attn_scalar: float = 256.0
    sliding_window: int = 512
    layer_types: list = field(default_factory=list)
    final_logit_softcapping: float | None = None
    embed_scale: float | None = None  # None: sqrt(hidden) rounded to bfloat16, as mlx-lm does
    norm_shifted: bool = False  # RMSNorm weights already hold 1 + w (GGUF)

    def __post_init__(self):
        super().__post_init__()
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"{len(self.layer_types)} layer types for {self.num_hidden_layers} layers")
        unknown = set(self.layer_types) - {SLIDING, FULL}
        if unknown:
            raise ValueError(f"unknown Gemma 3 layer types {sorted(unknown)}")
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")

    @classmethod
    def from_config(cls, config: dict) -> "ModelArgs":
        for key in ("attn_logit_softcapping",):
            if config.get(key) is not None:
                raise ValueError(f"Gemma 3 with {key}={config[key]} is not supported")
        act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_approx"):
            raise ValueError(f"Gemma 3 MLP activation {act!r} is not supported (gelu_pytorch_tanh)")
        kwargs = cls.known_fields(config)
        kwargs["qk_norm"] = True
        kwargs["attention_bias"] = bool(config.get("attention_bias", False))
        kwargs.setdefault("tie_word_embeddings", bool(config.get("tie_word_embeddings", True)))
        kwargs.setdefault("head_dim", 256)
        if not kwargs.get("layer_types"):
            n = int(config.get("num_hidden_layers", 0))
            pattern = int(config.get("sliding_window_pattern", 6))
            kwargs["layer_types"] = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n)]
        return cls.build(kwargs)


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__(args, layer)
        self.scale = args.query_pre_attn_scalar ** -0.5
        if args.layer_types[layer] == SLIDING:
            self.rope = RoPE(self.head_dim, args.rope_local_base_freq, None)


class MLP(llama.MLP):
    """``down(gelu_tanh(gate(x)) * up(x))`` (no residual: a norm follows it)."""

    def __call__(self, x: mx.array, *, norm=None, residual=None) -> mx.array:
        gate_up = self.get("gate_up_proj")
        if gate_up is not None:
            return self["down_proj"](gate_up(x, norm=norm), act="gelu_mul_halves")
        if norm is not None:
            x = norm(x)
        return self.down_proj(ops.gelu_mul(self.gate_proj(x), self.up_proj(x)))


def _add(x: mx.array, y: mx.array) -> mx.array:
    """x + y; in float16 computed in float32 and clipped to the finite range (as mlx-lm)."""
    if x.dtype != mx.float16:
        return x + y
    bound = float(mx.finfo(mx.float16).max)
    return mx.clip(x.astype(mx.float32) + y.astype(mx.float32), -bound, bound).astype(mx.float16)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)

    def __call__(self, x: mx.array, cache, positions: mx.array) -> mx.array:
        r = self["self_attn"](x, cache, positions, norm=self["input_layernorm"])
        h = _add(x, self["post_attention_layernorm"](r))
        r = self["mlp"](h, norm=self["pre_feedforward_layernorm"])
        return _add(h, self["post_feedforward_layernorm"](r))


class Model(llama.Model):
    """Causal LM with llama.Model's interface (``model(tokens, cache, logit_rows)``)."""

    block = Block

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        scale = args.embed_scale
        if scale is None:
            scale = mx.array(math.sqrt(args.hidden_size), mx.bfloat16).item()
        self.embed_scale = float(scale)
        self.logit_softcap = args.final_logit_softcapping or None

    @property
    def kv_layers(self) -> tuple[LayerKV, ...]:
        a = self.args
        return tuple(LayerKV(a.num_key_value_heads, a.head_dim,
                             a.sliding_window if kind == SLIDING else 0) for kind in a.layer_types)

    def sanitize(self, weights: dict) -> dict:
        weights = super().sanitize(weights)
        if not self.args.norm_shifted:  # HF stores w; the model computes with 1 + w
            weights = {k: (1.0 + v if k.endswith("norm.weight") else v) for k, v in weights.items()}
        return weights
