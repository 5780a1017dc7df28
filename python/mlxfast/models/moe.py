"""Mixture-of-experts families: HF ``qwen3_moe`` (GGUF ``qwen3moe``) and
``mixtral`` (GGUF ``llama`` with ``llama.expert_count`` > 0).

Both are the Llama family (``llama.Model`` whole: its attention, body and
head) with the MLP of some or all layers replaced by a sparse MoE block: a
router (``gate``, a linear layer to one logit per expert), the top-k choice
(``ops.moe_route``: Qwen3-MoE takes the softmax over all experts first,
then the top k, renormalised with ``norm_topk_prob``; Mixtral takes the top k
logits, then their softmax) and the experts' gated MLPs, stacked ``[E, out,
in]`` per projection (``switch_mlp.{gate,up,down}_proj``, mlx-lm's names and
layout, so MLX checkpoints load as they are), applied by one
``ops.moe_experts`` call per layer.

HF checkpoints store one tensor per expert (``mlp.experts.N.gate_proj``,
Mixtral's ``block_sparse_moe.experts.N.w1/w2/w3``): ``sanitize`` stacks them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from . import llama
from .layers import Linear, RMSNorm


@dataclass
class ModelArgs(llama.ModelArgs):
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None  # None: intermediate_size (Mixtral)
    norm_topk_prob: bool = False
    router_softmax_first: bool = True  # Qwen3-MoE: softmax, then top-k; Mixtral: top-k, then softmax
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)

    def __post_init__(self):
        super().__post_init__()
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        if self.num_experts < 1:
            raise ValueError(f"a MoE model needs num_experts >= 1, got {self.num_experts}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                             f"[1, num_experts ({self.num_experts})]")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")

    def is_moe_layer(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_config(cls, config: dict) -> "ModelArgs":
        kind = config.get("model_type")
        kwargs = cls.known_fields(config)
        kwargs.setdefault("tie_word_embeddings", bool(config.get("tie_word_embeddings", False)))
        if kind == "qwen3_moe":
            kwargs["qk_norm"] = True
            kwargs["attention_bias"] = bool(config.get("attention_bias", False))
            kwargs["router_softmax_first"] = True
        elif kind == "mixtral":
            if "num_local_experts" in config:
                kwargs["num_experts"] = int(config["num_local_experts"])
            kwargs["router_softmax_first"] = False
            kwargs["norm_topk_prob"] = False  # the softmax over the k is already normalised
            kwargs["moe_intermediate_size"] = None
            kwargs.setdefault("rope_theta", 1e6)  # HF MixtralConfig's default
        else:
            raise ValueError(f"unknown MoE model type {kind!r}")
        return cls.build(kwargs)


class SwitchLinear(nn.Module):
    """Stacked dense expert weights ``[E, out, in]`` (applied by moe_experts)."""

    def __init__(self, in_dims: int, out_dims: int, num_experts: int):
        super().__init__()
        self.weight = mx.zeros((num_experts, out_dims, in_dims))

    def to_quantized(self, group_size: int, bits: int) -> "QuantizedSwitchLinear":
        e, out_dims, in_dims = self.weight.shape
        return QuantizedSwitchLinear(in_dims, out_dims, e, group_size, bits)

    def params(self):
        return self["weight"]


class QuantizedSwitchLinear(nn.Module):
    """Stacked MLX affine-quantized expert weights: weight ``[E, out, in * bits
    / 32]`` uint32, scales and biases ``[E, out, in / group_size]``.
    ``activations`` ("fp32" or "int8", set by layers.set_matmul_activations)
    is passed to ``ops.moe_experts``, as QuantizedLinear's to its matmul."""

    def __init__(self, in_dims: int, out_dims: int, num_experts: int, group_size: int, bits: int):
        super().__init__()
        if in_dims % group_size:
            raise ValueError(f"input size {in_dims} is not a multiple of the group size {group_size}")
        self.group_size = group_size
        self.bits = bits
        self.activations = "fp32"
        self.weight = mx.zeros((num_experts, out_dims, in_dims * bits // 32), dtype=mx.uint32)
        self.scales = mx.zeros((num_experts, out_dims, in_dims // group_size))
        self.biases = mx.zeros((num_experts, out_dims, in_dims // group_size))
        self.freeze()

    def params(self):
        """(weight, scales, biases); biases None once the loader dropped
        symmetric ones (layers.drop_symmetric_biases)."""
        return self["weight"], self["scales"], self.get("biases")


class SwitchGLU(nn.Module):
    """The experts' stacked gate, up and down projections (SparseMoE applies
    them with ``ops.moe_experts``)."""

    def __init__(self, dims: int, hidden: int, num_experts: int):
        super().__init__()
        self.gate_proj = SwitchLinear(dims, hidden, num_experts)
        self.up_proj = SwitchLinear(dims, hidden, num_experts)
        self.down_proj = SwitchLinear(hidden, dims, num_experts)

    def quantization(self) -> tuple[int, int]:
        """(group_size, bits) shared by the three projections (bits 0: dense)."""
        projs = (self.gate_proj, self.up_proj, self.down_proj)
        kinds = {(type(p), getattr(p, "group_size", 64), getattr(p, "bits", 0)) for p in projs}
        if len(kinds) != 1:
            raise ValueError("the experts' gate, up and down projections must share their "
                             "quantization (kind, bits, group size)")
        _, group_size, bits = kinds.pop()
        return group_size, bits


class SparseMoE(nn.Module):
    """Router + top-k + experts: ``residual + sum_j w_j expert_j(norm(x))``,
    three primitives on the CPU: the router's matmul (the norm fused), the
    top-k, and the experts (the norm and the residual fused)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.softmax_first = args.router_softmax_first
        self.normalize = args.norm_topk_prob
        self.gate = Linear(args.hidden_size, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts)
        self.group_size = self.bits = None  # read by fuse()

    def fuse(self) -> None:
        """After loading: read the quantization the experts share."""
        self.group_size, self.bits = self.switch_mlp.quantization()

    def __call__(self, x: mx.array, *, norm=None, residual: mx.array | None = None) -> mx.array:
        norm_args = None if norm is None else (norm["weight"], norm.eps)
        logits = self["gate"](x, norm=norm)
        inds, scores = ops.moe_route(logits, self.top_k, softmax_first=self.softmax_first,
                                     normalize=self.normalize)
        if self.bits is None:
            self.fuse()
        sw = self["switch_mlp"]
        return ops.moe_experts(x, inds, scores, sw["gate_proj"].params(), sw["up_proj"].params(),
                               sw["down_proj"].params(), group_size=self.group_size, bits=self.bits,
                               norm=norm_args, residual=residual,
                               # the three share their bits (quantization()), so their activations
                               activations=getattr(sw["gate_proj"], "activations", "fp32"))


class Block(nn.Module):
    """A Llama decoder layer whose MLP may be a sparse MoE block (under the
    checkpoint's name for it: ``mlp``, Mixtral's ``block_sparse_moe``)."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = llama.Attention(args, layer)
        self.mlp_name = "block_sparse_moe" if args.model_type == "mixtral" else "mlp"
        setattr(self, self.mlp_name, SparseMoE(args) if args.is_moe_layer(layer) else llama.MLP(args))
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, x: mx.array, cache, positions: mx.array) -> mx.array:
        h = self["self_attn"](x, cache, positions, norm=self["input_layernorm"], residual=x)
        return self[self.mlp_name](h, norm=self["post_attention_layernorm"], residual=h)


_EXPERT_NAMES = {  # checkpoint per-expert name -> stacked projection
    "qwen3_moe": ("mlp", {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}),
    "mixtral": ("block_sparse_moe", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}),
}


class Model(llama.Model):
    """Causal LM with llama.Model's interface; MoE blocks as its decoder layers."""

    block = Block

    def fuse_projections(self) -> None:
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer[layer.mlp_name].fuse()

    def sanitize(self, weights: dict) -> dict:
        weights = super().sanitize(weights)
        prefix_name, names = _EXPERT_NAMES[self.args.model_type]
        n = self.args.num_experts
        for i in range(self.args.num_hidden_layers):
            base = f"model.layers.{i}.{prefix_name}"
            for src, dst in names.items():
                for kind in ("weight", "scales", "biases"):
                    first = f"{base}.experts.0.{src}.{kind}"
                    if first not in weights:
                        continue
                    keys = [f"{base}.experts.{e}.{src}.{kind}" for e in range(n)]
                    missing = [k for k in keys if k not in weights]
                    if missing:
                        raise ValueError(f"expert weights missing: {', '.join(missing[:3])}")
                    weights[f"{base}.switch_mlp.{dst}.{kind}"] = mx.stack([weights.pop(k) for k in keys])
        return weights
