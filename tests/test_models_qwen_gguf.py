"""Qwen2 / Qwen3 GGUF files (llama.cpp architectures ``qwen2``: q/k/v biases;
``qwen3``: per-head q/k RMSNorm and a head size apart from hidden / heads):
tiny random models written as llama.cpp's converter writes them (HF rows as
they are: no q/k permutation for these NEOX-RoPE models) load and agree with
mlx-lm on the HF layout and with llama.cpp on the same file."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf_oracle import VOCAB, add_tensors, add_vocab, agreement, finish, llama_cpp_logits, sequences
from mlx_lm.utils import load_model
from tiny_gguf import roundtrip
from tiny_models import make_tiny_model, rel_err

from mlxfast.kv import DenseKVCache
from mlxfast.models import gguf
from mlxfast.models.layers import QuantizedLinear
from mlxfast.models.loader import build_model, load

TOKENS = mx.array([[5, 17, 99, 3, 200, 42, 7, 150, 64, 11], [8, 8, 250, 31, 4, 77, 190, 12, 3, 9]])

_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    parts = hf.split(".")
    return f"blk.{parts[2]}.{_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"


def write_gguf(path, arch: str, config: dict, weights: dict, qtype):
    w = GGUFWriter(str(path), arch)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_theta"])
    if "head_dim" in config:  # qwen3: its own head size
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
    add_vocab(w)
    add_tensors(w, {_gguf_name(k): v for k, v in weights.items()}, qtype)
    finish(w)
    return path


# qwen3's tiny head is 32 wide over a 64 hidden (4 heads: 128 q features), as
# Qwen3-0.6B's 16 x 128 over 1024.
ARCHS = {"qwen2": {"tie_word_embeddings": True}, "qwen3": {"tie_word_embeddings": False}}


def _tiny(tmp_path, arch, qtype, **overrides):
    src = make_tiny_model(tmp_path / "src", arch, vocab_size=VOCAB, rope_theta=1e6,
                          **{**ARCHS[arch], **overrides})
    config = json.loads((src / "config.json").read_text())
    weights = {k: np.array(v) for k, v in mx.load(str(src / "model.safetensors")).items()}
    return write_gguf(tmp_path / f"{arch}.gguf", arch, config, weights, qtype), config, weights


def _gguf_model(path):
    tensors, meta = gguf.read_gguf(path)
    config = gguf.gguf_config(meta)
    weights, quant = gguf.hf_weights(tensors, config)
    return build_model(config, weights, quant), config


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.Q4_0])
def test_gguf_matches_mlx_lm_on_hf_layout(tmp_path, arch, qtype):
    path, config, weights = _tiny(tmp_path, arch, qtype)
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    kept = {k: mx.array(roundtrip(v, qtype) if v.ndim == 2 else v) for k, v in weights.items()}
    mx.save_safetensors(str(ref_dir / "model.safetensors"), kept)
    (ref_dir / "config.json").write_text(json.dumps(config))
    ref, _ = load_model(ref_dir)

    model, gcfg = _gguf_model(path)
    assert gcfg["model_type"] == arch and gcfg["tie_word_embeddings"] == config["tie_word_embeddings"]
    attn = model.model.layers[0].self_attn
    if arch == "qwen2":
        assert "bias" in attn.qkv_proj and "bias" not in attn.o_proj  # q/k/v biases only
    else:
        assert model.args.head_dim == 32 and "q_norm" in attn and "bias" not in attn.qkv_proj
    if qtype != Q.F32:
        assert isinstance(attn.qkv_proj, QuantizedLinear) and attn.qkv_proj.bits == (4 if qtype == Q.Q4_0 else 8)
    got, want = model(TOKENS, DenseKVCache(len(model.layers))), ref(TOKENS)
    assert rel_err(got, want) < 1e-4
    assert (mx.argmax(got, -1) == mx.argmax(want, -1)).all().item()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_gguf_agrees_with_llama_cpp(tmp_path, arch):
    """Teacher-forced top-1 over random sequences, llama.cpp on the same F32 file."""
    path, *_ = _tiny(tmp_path, arch, Q.F32)
    model, _ = _gguf_model(path)
    seqs = sequences(11)
    ours = [np.array(model(mx.array([ids]), DenseKVCache(2))[0].astype(mx.float32)) for ids in seqs]
    top1, diff = agreement(ours, llama_cpp_logits(path, seqs, n_ctx=256))
    print(f"{arch} F32: top-1 agreement {top1:.3f}, max rel diff {diff:.2e}")
    assert top1 >= 0.98
    assert diff < 2e-2  # llama.cpp keeps K/V in f16


def test_qwen_gguf_loads_through_the_public_loader(tmp_path):
    path, *_ = _tiny(tmp_path, "qwen2", Q.Q8_0)
    model, tok = load(path)
    assert model.model_type == "qwen2" and tok.vocab_size == VOCAB
    assert model(TOKENS, DenseKVCache(2)).shape == (2, 10, VOCAB)


def test_gguf_rope_scaling_it_cannot_apply_is_an_error(tmp_path):
    """A yarn file (Qwen2.5's 128k variants) rotates differently at every
    position: refused, never loaded with plain RoPE."""
    path, *_ = _tiny(tmp_path, "qwen2", Q.F32)
    _, meta = gguf.read_gguf(path)
    meta = dict(meta, **{"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0})
    with pytest.raises(ValueError, match="RoPE scaling 'yarn' is not supported"):
        gguf.gguf_config(meta)
