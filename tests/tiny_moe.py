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
