"""Llama 3.x GGUFs: llama.cpp's converter stores the llama3 RoPE scaling as a
``rope_freqs.weight`` tensor (each frequency's divisor) and drops the
config's factors. A tiny llama file written that way loads with those
frequencies: it agrees with mlx-lm on the HF layout with the llama3 config,
with llama.cpp on the same file, and not with plain RoPE (the check that the
tensor is used)."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf_oracle import VOCAB, add_vocab, agreement, llama_cpp_logits, sequences
from mlx_lm.utils import load_model
from tiny_gguf import write_tiny_gguf
from tiny_models import make_tiny_model

from mlxfast.kv import DenseKVCache
from mlxfast.models import gguf
from mlxfast.models.loader import build_model

# Scaling strong enough to matter over ~100 positions of a 16-wide head.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


def llama3_divisors(head_dim: int, base: float, cfg: dict) -> np.ndarray:
    """HF's llama3 rule as a per-frequency divisor (what llama.cpp's converter writes)."""
    inv = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    old, low, high, factor = (cfg["original_max_position_embeddings"], cfg["low_freq_factor"],
                              cfg["high_freq_factor"], cfg["factor"])
    smooth = np.clip((old / wavelen - low) / (high - low), 0, 1)
    scaled = (1 - smooth) * inv / factor + smooth * inv
    return (inv / scaled).astype(np.float32)


def _files(tmp_path):
    src = make_tiny_model(tmp_path / "src", "llama", vocab_size=VOCAB, rope_theta=10000.0,
                          rope_scaling=LLAMA3)
    config = json.loads((src / "config.json").read_text())
    weights = {k: np.array(v) for k, v in mx.load(str(src / "model.safetensors")).items()}
    divisors = llama3_divisors(config["hidden_size"] // config["num_attention_heads"], config["rope_theta"], LLAMA3)
    assert divisors.min() == 1.0 and divisors.max() == LLAMA3["factor"]  # both regimes are present

    def meta(w):
        add_vocab(w)
        w.add_tensor("rope_freqs.weight", divisors)

    path = tmp_path / "llama3.gguf"
    write_tiny_gguf(path, config, weights, Q.F32, metadata=meta)
    return path, src


def _ours(path, drop_freqs=False):
    tensors, meta = gguf.read_gguf(path)
    if drop_freqs:
        tensors = {k: v for k, v in tensors.items() if k != "rope_freqs.weight"}
    config = gguf.gguf_config(meta)
    weights, quant = gguf.hf_weights(tensors, config)
    return build_model(config, weights, quant), config


def test_rope_freqs_tensor_gives_llama3_rope(tmp_path):
    path, src = _files(tmp_path)
    model, config = _ours(path)
    assert config["rope_scaling"]["rope_type"] == "freq_factors"
    ids = mx.array(sequences(3, n=2, length=100))
    ref, _ = load_model(src)
    want = ref(ids)
    got = model(ids, DenseKVCache(len(model.layers)))
    rel = (mx.abs(got - want).max() / mx.abs(want).max()).item()
    assert rel < 1e-4, rel
    plain, _ = _ours(path, drop_freqs=True)
    off = plain(ids, DenseKVCache(len(plain.layers)))
    assert (mx.abs(off - want).max() / mx.abs(want).max()).item() > 100 * max(rel, 1e-6)


def test_rope_freqs_file_agrees_with_llama_cpp(tmp_path):
    path, _ = _files(tmp_path)
    model, _ = _ours(path)
    seqs = sequences(5, n=3, length=100)
    ours = [np.array(model(mx.array([s]), DenseKVCache(2))[0].astype(mx.float32)) for s in seqs]
    top1, diff = agreement(ours, llama_cpp_logits(path, seqs, n_ctx=256))
    print(f"llama3 rope_freqs F32: top-1 agreement {top1:.3f}, max rel diff {diff:.2e}")
    assert top1 >= 0.98 and diff < 2e-2
