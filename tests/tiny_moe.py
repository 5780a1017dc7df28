"""Tiny random-weight mixture-of-experts models (qwen3_moe, mixtral), written
by the tests: HF directories (one tensor per expert, as HF checkpoints store
them, or MLX-quantized with the experts stacked, as mlx-lm writes them) and
GGUF files (llama.cpp's names and stacked ``*_exps`` tensors).

Weights come from mlx-lm's own model classes (random init), so the files are
what mlx-lm expects.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map

from tiny_models import BASE, _write_tokenizer

TYPES = {
    # 8 experts, top 2 of them renormalised; layer 1 of 3 is a dense MLP.
    "qwen3_moe": {"num_hidden_layers": 3, "head_dim": 32, "tie_word_embeddings": False,
                  "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                  "intermediate_size": 128, "decoder_sparse_step": 1, "mlp_only_layers": [1],
                  "norm_topk_prob": True, "rope_theta": 10000.0},
    "mixtral": {"tie_word_embeddings": False, "num_local_experts": 8, "num_experts_per_tok": 2,
                "intermediate_size": 64, "rope_theta": 10000.0},
}

# HF per-expert names: (the MoE block's name, {stacked projection: per-expert name})
_PER_EXPERT = {
    "qwen3_moe": ("mlp", {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}),
    "mixtral": ("block_sparse_moe", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}),
}


def moe_config(model_type: str, **overrides) -> dict:
    return {"model_type": model_type, **BASE, **TYPES[model_type], **overrides}


def _mlx_lm_model(config: dict, seed: int):
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    # Larger-than-init weights so that logits and routings are far from ties.
    model.update(tree_map(lambda p: p * 4 if p.ndim >= 2 else p, model.parameters()))
    return model


def unstack_experts(weights: dict, model_type: str) -> dict:
    """mlx-lm's stacked ``switch_mlp.<proj>.<kind>`` [E, ...] tensors as one
    tensor per expert, under the HF checkpoint's names."""
    block, names = _PER_EXPERT[model_type]
    out = {}
    for key, value in weights.items():
        marker = f".{block}.switch_mlp."
        if marker not in key:
            out[key] = value
            continue
        prefix, rest = key.split(marker)
        proj, kind = rest.split(".")
        for e in range(value.shape[0]):
            out[f"{prefix}.{block}.experts.{e}.{names[proj]}.{kind}"] = value[e]
    return out


def make_tiny_moe(out: Path, model_type: str, *, dtype=mx.float32, quantize: dict | None = None,
                  per_expert: bool = True, seed: int = 0, **overrides) -> Path:
    """Write a tiny random ``model_type`` model directory; returns it.

    ``per_expert``: one tensor per expert (HF layout); otherwise stacked
    (mlx-lm's layout). ``quantize`` ({group_size, bits, plus per-module
    overrides}) quantizes every linear layer and the stacked experts as
    mlx-lm does."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = moe_config(model_type, **overrides)
    model = _mlx_lm_model(config, seed)
    model.set_dtype(dtype)
    if quantize:
        default = {k: v for k, v in quantize.items() if k in ("group_size", "bits")}
        per_module = {k: v for k, v in quantize.items() if k not in ("group_size", "bits")}

        def predicate(path, module):
            if not hasattr(module, "to_quantized"):
                return False
            return per_module.get(path, True)

        nn.quantize(model, class_predicate=predicate, **default)
        config["quantization"] = quantize
    weights = dict(tree_flatten(model.parameters()))
    if per_expert:
        weights = unstack_experts(weights, model_type)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config))
    _write_tokenizer(out)
    return out


def hf_weights_np(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(config, fp32 numpy weights with experts stacked) of an unquantized tiny model."""
    config = json.loads((path / "config.json").read_text())
    weights = {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(path / "model.safetensors")).items()}
    block, names = _PER_EXPERT[config["model_type"]]
    n = config.get("num_experts") or config.get("num_local_experts")
    stacked = {}
    for key in list(weights):
        marker = f".{block}.experts.0."
        if marker not in key:
            continue
        prefix, rest = key.split(marker)
        name, kind = rest.split(".")
        proj = {v: k for k, v in names.items()}[name]
        stacked[f"{prefix}.{block}.switch_mlp.{proj}.{kind}"] = np.stack(
            [weights.pop(f"{prefix}.{block}.experts.{e}.{name}.{kind}") for e in range(n)])
    weights.update(stacked)
    return config, weights


# ---------------------------------------------------------------- GGUF files

_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "gate": "ffn_gate_inp",
    "switch_mlp.gate_proj": "ffn_gate_exps", "switch_mlp.up_proj": "ffn_up_exps",
    "switch_mlp.down_proj": "ffn_down_exps",
}
_GGUF_PER_EXPERT = {"switch_mlp.gate_proj": "ffn_gate", "switch_mlp.up_proj": "ffn_up",
                    "switch_mlp.down_proj": "ffn_down"}


def gguf_arch(config: dict) -> str:
    return "qwen3moe" if config["model_type"] == "qwen3_moe" else "llama"


def write_moe_gguf(path: Path, config: dict, weights: dict[str, np.ndarray], qtype, *,
                   per_expert: bool = False, vocab=None) -> dict[str, np.ndarray]:
    """Write a tiny MoE model as llama.cpp's converter would: arch qwen3moe,
    or llama with experts (Mixtral; q/k rows permuted); the experts as
    stacked ``ffn_*_exps`` tensors [E, out, in] (``per_expert``: Mixtral's
    older ``ffn_*.E`` tensors); every 2-D and 3-D weight but the router in
    ``qtype`` (the gguf package quantizes). ``vocab(writer)`` adds a
    vocabulary. Returns the fp32 values each weight holds, in HF layout."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter
    from tiny_gguf import llama_cpp_permute, roundtrip

    arch = gguf_arch(config)
    block = "mlp" if arch == "qwen3moe" else "block_sparse_moe"
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_heads
    experts = config.get("num_experts") or config["num_local_experts"]
    w = GGUFWriter(str(path), arch)
    if vocab is not None:
        vocab(w)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_expert_count(experts)
    w.add_expert_used_count(config["num_experts_per_tok"])
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    w.add_vocab_size(config["vocab_size"])
    kept = {}

    def add(name, arr, quantize):
        if quantize and qtype not in (Q.F32, Q.F16):
            from gguf import quants
            w.add_tensor(name, quants.quantize(arr, qtype), raw_dtype=qtype)
        elif quantize and qtype == Q.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, arr.astype(np.float32))

    for hf, arr in weights.items():
        arr = np.asarray(arr, np.float32)
        quantize = arr.ndim >= 2 and not hf.endswith(f"{block}.gate.weight")
        kept[hf] = roundtrip(arr.reshape(-1, arr.shape[-1]), qtype).reshape(arr.shape) if quantize else arr
        if hf == "model.embed_tokens.weight":
            add("token_embd.weight", arr, quantize)
            continue
        if hf == "model.norm.weight":
            add("output_norm.weight", arr, False)
            continue
        if hf == "lm_head.weight":
            add("output.weight", arr, quantize)
            continue
        parts = hf.split(".")
        layer, module = parts[2], ".".join(parts[3:-1])
        module = module[len(block) + 1:] if module.startswith(block + ".") else module
        if arch == "llama" and module == "self_attn.q_proj":
            arr = llama_cpp_permute(arr, n_heads)
        elif arch == "llama" and module == "self_attn.k_proj":
            arr = llama_cpp_permute(arr, n_kv)
        if per_expert and module in _GGUF_PER_EXPERT:
            for e in range(arr.shape[0]):
                add(f"blk.{layer}.{_GGUF_PER_EXPERT[module]}.{e}.weight", arr[e], quantize)
            continue
        add(f"blk.{layer}.{_GGUF_LAYER[module]}.weight", arr, quantize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return kept
