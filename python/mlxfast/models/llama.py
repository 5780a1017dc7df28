"""The Llama family: llama, mistral, qwen2 (q/k/v bias) and qwen3 (q/k norm).

The model never knows how KV is stored: each attention layer hands its
rotated q [B, L, Hq, D] and new k/v [B, L, Hkv, D] to
``cache.attend(layer, q, k, v, scale)`` and gets [B, L, Hq * D] back (heads
merged, what the output projection takes: no reshapes on the layer path). Positions
come from ``cache.offsets`` (an int, or an int32 array with one offset per
batch row), turned into one position per token once per forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from ..kv.layer_spec import LayerKV, uniform_layers
from .layers import Embedding, Linear, RMSNorm, RoPE, fuse_linears, token_positions


@dataclass
class ModelArgs:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_traditional: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )

    @classmethod
    def known_fields(cls, config: dict) -> dict:
        """The config entries that are fields of ``cls``."""
        known = {f.name for f in fields(cls)}
        return {k: v for k, v in config.items() if k in known and k != "extra"}

    @classmethod
    def build(cls, kwargs: dict) -> "ModelArgs":
        missing = [n for n in ("hidden_size", "num_hidden_layers", "intermediate_size",
                               "num_attention_heads", "vocab_size") if n not in kwargs]
        if missing:
            raise ValueError(f"config.json is missing {', '.join(missing)}")
        return cls(**kwargs)

    @classmethod
    def from_config(cls, config: dict) -> "ModelArgs":
        kind = config.get("model_type")
        kwargs = cls.known_fields(config)
        if kind == "qwen2":
            kwargs.setdefault("attention_bias", True)
            kwargs.setdefault("tie_word_embeddings", False)
        elif kind == "qwen3":
            kwargs["qk_norm"] = True
            kwargs["attention_bias"] = bool(config.get("attention_bias", False))
        kwargs.setdefault("tie_word_embeddings", bool(config.get("tie_word_embeddings", False)))
        return cls.build(kwargs)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = hd = args.head_dim
        self.scale = hd**-0.5
        bias = args.attention_bias
        o_bias = bias and args.model_type not in ("qwen2", "qwen3")
        self.q_proj = Linear(args.hidden_size, self.n_heads * hd, bias=bias)
        self.k_proj = Linear(args.hidden_size, self.n_kv_heads * hd, bias=bias)
        self.v_proj = Linear(args.hidden_size, self.n_kv_heads * hd, bias=bias)
        self.o_proj = Linear(self.n_heads * hd, args.hidden_size, bias=o_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(hd, args.rms_norm_eps)
            self.k_norm = RMSNorm(hd, args.rms_norm_eps)
        self.rope = RoPE(hd, args.rope_theta, args.rope_scaling, args.rope_traditional)

    def fuse(self) -> None:
        """Replace q/k/v projections by one (when they are alike)."""
        fused = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        if fused is not None:
            for name in ("q_proj", "k_proj", "v_proj"):
                self.pop(name)
            self.qkv_proj = fused

    # Hot paths read children and arrays with self["name"] (see models/layers.py).
    def __call__(self, x: mx.array, cache, positions: mx.array, *, norm=None,
                 residual: mx.array | None = None) -> mx.array:
        """``residual + o_proj(attention(norm(x)))``; ``norm`` (an RMSNorm)
        and ``residual`` ride in the projections' primitives where they can."""
        qkv_proj = self.get("qkv_proj")
        if qkv_proj is not None:
            q, k, v = self._fused_qkv(qkv_proj(x, norm=norm), positions)
        else:
            if norm is not None:
                x = norm(x)
            B, L, _ = x.shape
            q = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim)
            k = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
            v = self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
            if "q_norm" in self:
                q = self.q_norm(q)
                k = self.k_norm(k)
            q, k = self.rope(q, positions), self.rope(k, positions)
        return self["o_proj"](cache.attend(self.layer, q, k, v, self.scale), residual=residual)

    def _fused_qkv(self, qkv: mx.array, positions: mx.array):
        rope = self["rope"]
        norms = {}
        q_norm = self.get("q_norm")
        if q_norm is not None:
            norms = dict(q_norm=q_norm["weight"], k_norm=self["k_norm"]["weight"], eps=q_norm.eps)
        return ops.qkv_rope(
            qkv, positions, self.n_heads, self.n_kv_heads, self.head_dim, rope.dims,
            traditional=rope.traditional, base=rope.base, scale=rope.scale,
            freqs=rope.get("_freqs"),  # an array (in the dict) or None (not there)
            **norms,
        )


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        h, m = args.hidden_size, args.intermediate_size
        self.gate_proj = Linear(h, m, bias=args.mlp_bias)
        self.up_proj = Linear(h, m, bias=args.mlp_bias)
        self.down_proj = Linear(m, h, bias=args.mlp_bias)

    def fuse(self) -> None:
        """Replace gate/up projections by one (when they are alike)."""
        fused = fuse_linears([self.gate_proj, self.up_proj])
        if fused is not None:
            self.pop("gate_proj")
            self.pop("up_proj")
            self.gate_up_proj = fused

    def __call__(self, x: mx.array, *, norm=None, residual: mx.array | None = None) -> mx.array:
        """``residual + down(silu(gate(norm(x))) * up(norm(x)))``; the norm, the
        activation and the residual ride in the projections' primitives where
        they can."""
        gate_up = self.get("gate_up_proj")
        if gate_up is not None:
            return self["down_proj"](gate_up(x, norm=norm), act="silu_mul_halves",
                                     residual=residual)
        if norm is not None:
            x = norm(x)
        return self.down_proj(ops.silu_mul(self.gate_proj(x), self.up_proj(x)), residual=residual)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, x: mx.array, cache, positions: mx.array) -> mx.array:
        # h = x + attn(norm1(x)); out = h + mlp(norm2(h)), with each norm fused
        # into the projection after it and each residual add into the one before.
        h = self["self_attn"](x, cache, positions, norm=self["input_layernorm"], residual=x)
        return self["mlp"](h, norm=self["post_attention_layernorm"], residual=h)


class Body(nn.Module):
    def __init__(self, args: ModelArgs, block=Block):
        super().__init__()
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = [block(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(nn.Module):
    """Causal LM: ``model(tokens [B, L], cache) -> logits [B, L, vocab]``.

    ``logit_rows`` (an int32 array of flat row indices into B*L) restricts the
    output head to those positions, e.g. the last token of each prefill.
    ``argmax=True`` returns the greedy choice at those positions instead
    (uint32, ``mx.argmax`` of the logits: the same tokens, ties and all), which
    a quantized head computes without most of its fp32 logits
    (``layers.quantized_head_argmax``).
    """

    # What a family built on this one may change: its decoder layer, a scale
    # on the embeddings and a soft cap on the logits (c * tanh(z / c)).
    block = Block
    embed_scale: float | None = None
    logit_softcap: float | None = None
    # False on the ranks of a tensor-parallel group other than 0 (models/shard.py):
    # the forward ends at the last hidden state, rank 0 computes the logits.
    compute_head: bool = True

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Body(args, self.block)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def layers(self):
        return self.model.layers

    def __call__(self, tokens: mx.array, cache, logit_rows: mx.array | None = None,
                 argmax: bool = False) -> mx.array:
        body = self["model"]
        embed, norm = body["embed_tokens"], body["norm"]
        h = embed(tokens)
        dtype = norm["weight"].dtype
        if h.dtype != dtype:
            h = h.astype(dtype)
        if self.embed_scale is not None:
            h = h * mx.array(self.embed_scale, dtype)
        positions = token_positions(cache.offsets, *tokens.shape[:2])
        for layer in body["layers"]:
            h = layer(h, cache, positions)
        if not self.compute_head:
            return h
        if logit_rows is not None:
            h = h.reshape(-1, h.shape[-1])[logit_rows]
        # The final norm runs inside the head's matmul (after the row gather).
        head = self.output_head
        cap = self.logit_softcap
        if argmax and cap is None and hasattr(head, "argmax"):
            return head.argmax(h, norm=norm)
        logits = head.as_linear(h, norm=norm) if head is embed else head(h, norm=norm)
        if cap is not None:  # (the cap can round distinct logits to ties: the argmax comes after it)
            logits = mx.tanh(logits / cap) * cap
        return mx.argmax(logits, axis=-1) if argmax else logits

    @property
    def output_head(self):
        """The layer computing the logits: ``lm_head``, or the tied embedding."""
        return self["model"]["embed_tokens"] if self.args.tie_word_embeddings else self["lm_head"]

    def prepare_head_choice(self) -> None:
        """Build what the head's greedy choice (``argmax=True``) needs now: a
        quantized head's error bounds (``layers.quantized_head_argmax``), built
        otherwise inside the first step that asks, whose time then prices
        speculation's drafts (``engine/spec.py`` StepCost) as if every step of
        its size were that slow."""
        head = self.output_head
        if self.compute_head and self.logit_softcap is None and hasattr(head, "argmax"):
            x = mx.zeros((2, self.args.hidden_size), self.dtype)  # (one row takes the full head)
            mx.eval(head.argmax(x, norm=self["model"]["norm"]))

    def fuse_projections(self) -> None:
        """Fuse q/k/v and gate/up projections (after the weights are loaded)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    @property
    def kv_layers(self) -> tuple[LayerKV, ...]:
        """Every layer's KV needs (full attention throughout)."""
        a = self.args
        return uniform_layers(a.num_hidden_layers, a.num_key_value_heads, a.head_dim)

    @property
    def dtype(self) -> mx.Dtype:
        """The activation dtype: the norms' dtype (fp32 for GGUF models)."""
        return self.model.norm.weight.dtype

    def sanitize(self, weights: dict) -> dict:
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
            weights.pop("lm_head.scales", None)
            weights.pop("lm_head.biases", None)
        return weights
