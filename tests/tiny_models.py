"""Tiny random-weight HF/MLX model directories, written by the tests.

Weights come from mlx-lm's own model classes (random init), so the files are
exactly what mlx-lm expects; a small word-level tokenizer.json goes with them.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

VOCAB = 256

BASE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
}

TYPES = {
    "llama": {"tie_word_embeddings": True},
    "mistral": {"tie_word_embeddings": False},
    "qwen2": {"tie_word_embeddings": True},
    "qwen3": {"tie_word_embeddings": False, "head_dim": 32},
    # Layers 0, 2 slide over 4 tokens (their own RoPE base), 1, 3 attend fully.
    "gemma3_text": {"tie_word_embeddings": False, "num_hidden_layers": 4, "head_dim": 32, "sliding_window": 4,
                    "sliding_window_pattern": 2, "query_pre_attn_scalar": 24,
                    "rope_local_base_freq": 500.0, "rms_norm_eps": 1e-6},
    # Phi-3's own keys; a window shorter than the test prompts, which mlx-lm and
    # llama.cpp ignore (so does mlxfast: every layer attends fully).
    "phi3": {"tie_word_embeddings": False, "original_max_position_embeddings": 512, "sliding_window": 4},
}


def _write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, VOCAB):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}",
    }))


def make_tiny_model(out: Path, model_type: str, *, dtype=mx.float32, quantize: dict | None = None,
                    seed: int = 0, **overrides) -> Path:
    """Write a tiny random model of ``model_type``; returns its directory."""
    import importlib

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = {"model_type": model_type, **BASE, **TYPES[model_type], **overrides}
    from mlx_lm.utils import MODEL_REMAPPING

    arch = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    # Larger-than-init weights so the logits are not all near zero.
    model.update(tree_map(lambda p: p * 4 if p.ndim == 2 else p, model.parameters()))
    model.set_dtype(dtype)
    if quantize:
        default = {k: v for k, v in quantize.items() if k in ("group_size", "bits")}
        overrides_q = {k: v for k, v in quantize.items() if k not in ("group_size", "bits")}

        def predicate(path, module):
            if not hasattr(module, "to_quantized"):
                return False
            return overrides_q.get(path, True)

        nn.quantize(model, class_predicate=predicate, **default)
        config["quantization"] = quantize
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config))
    _write_tokenizer(out)
    return out


# ------------------------------------------------ parity helpers of the model tests

TOKENS = [[5, 17, 99, 3, 200, 42, 7, 150, 64, 11], [8, 8, 250, 31, 4, 77, 190, 12, 3, 9]]


def build_from_dir(path):
    """The model half of ``mlxfast.load`` on an HF directory (the tokenizer is tested elsewhere)."""
    from mlxfast.models.loader import build_model, read_hf_config

    config = read_hf_config(path)
    weights = mx.load(str(Path(path) / "model.safetensors"))
    return build_model(config, weights, config.get("quantization") or {})


def rel_err(a, b) -> float:
    """The largest difference relative to the largest magnitude of ``b``."""
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


def rms_err(a, b) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.sqrt(mx.mean((a - b) ** 2)) / mx.sqrt(mx.mean(b**2))).item()
