"""Tiny llama-architecture GGUF files written the way llama.cpp's converter
writes them (q/k rows permuted, tensors renamed, 2-D weights quantized), with
the `gguf` package as an independent quantizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quants

NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")
    layer, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    return f"blk.{layer}.{NAMES[module]}.{kind}"


def roundtrip(w: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """What a weight becomes after quantizing to qtype (fp32 values)."""
    if qtype == GGMLQuantizationType.F32:
        return w
    if qtype == GGMLQuantizationType.F16:
        return w.astype(np.float16).astype(np.float32)
    return quants.dequantize(quants.quantize(w, qtype), qtype).reshape(w.shape)


# K-quant blocks: where their fp16 super-block scales sit (byte offsets).
_K_SCALE_OFFSETS = {
    GGMLQuantizationType.Q4_K: (0, 2),  # d, dmin, then scales and quants
    GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),  # quants and scales, then d
    GGMLQuantizationType.Q2_K: (80, 82),  # scales and quants, then d, dmin
}


def random_kquant(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """Random but well-formed K-quant data (gguf cannot quantize K types)."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for off in _K_SCALE_OFFSETS[qtype]:
        scale = rng.uniform(0.002, 0.01, size=(rows, cols // block)).astype(np.float16)
        data[:, :, off:off + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, -1)


def llama_cpp_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_kquant_gguf(path: Path, config: dict, weights: dict[str, np.ndarray], qtype,
                      seed: int = 0) -> dict[str, np.ndarray]:
    """Write every 2-D weight as random K-quant data; return the fp32 values
    each weight holds in HF layout (the oracle's weights), per gguf's own
    dequantizer."""
    rng = np.random.default_rng(seed)
    raw, oracle = {}, {}
    for name, arr in weights.items():
        if arr.ndim != 2:
            oracle[name] = raw[name] = np.asarray(arr, np.float32)
            continue
        data = random_kquant(*arr.shape, qtype, rng)
        values = quants.dequantize(data, qtype).reshape(arr.shape).astype(np.float32)
        if name.endswith("q_proj.weight"):
            values = llama_cpp_unpermute(values, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            values = llama_cpp_unpermute(values, config["num_key_value_heads"])
        raw[name], oracle[name] = data, values
    write_tiny_gguf(path, config, raw, qtype, raw=True)
    return oracle


def write_tiny_gguf(path: Path, config: dict, weights: dict[str, np.ndarray],
                    qtype: GGMLQuantizationType, arch: str = "llama", raw: bool = False,
                    metadata=None) -> None:
    """Write HF-named fp32 numpy weights as a llama.cpp-style GGUF file
    (``raw``: 2-D weights are already qtype data in GGUF layout;
    ``metadata(writer)`` adds more keys, e.g. a vocabulary)."""
    w = GGUFWriter(str(path), arch)
    if metadata is not None:
        metadata(w)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    w.add_vocab_size(config["vocab_size"])
    for name, arr in weights.items():
        if raw and arr.ndim == 2:
            w.add_tensor(gguf_name(name), arr, raw_dtype=qtype)
            continue
        arr = np.asarray(arr, dtype=np.float32)
        if name.endswith("q_proj.weight"):
            arr = llama_cpp_permute(arr, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            arr = llama_cpp_permute(arr, config["num_key_value_heads"])
        if arr.ndim == 2 and qtype not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w.add_tensor(gguf_name(name), quants.quantize(arr, qtype), raw_dtype=qtype)
        elif arr.ndim == 2 and qtype == GGMLQuantizationType.F16:
            w.add_tensor(gguf_name(name), arr.astype(np.float16))
        else:
            w.add_tensor(gguf_name(name), arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---------------------------------------------------------------- a chat model

# A byte-level BPE vocabulary with Gemma's control tokens, and a one-layer
# model whose next token is a fixed function of the current one (attention
# and MLP write nothing; the head maps each token's one-hot embedding to its
# successor): after a newline it writes "OK" and then <end_of_turn>, after
# <end_of_turn> a newline again, after anything else "OK".
CHAT_SPECIALS = ["<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
PAD, BOS, EOS, START_OF_TURN, END_OF_TURN = range(5)


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character map, in byte order."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def chat_vocab() -> list[str]:
    return CHAT_SPECIALS + _byte_chars() + ["Ġt"]


def write_chat_gguf(path: Path, chat_template: str | None = None) -> Path:
    """The chat model above as a GGUF file (F32), with ``chat_template`` in
    its metadata or none (as Gemma 3's GGUF files ship)."""
    tokens = chat_vocab()
    v = len(tokens)
    byte_id = {b: len(CHAT_SPECIALS) + b for b in range(256)}
    nl, o, k = byte_id[ord("\n")], byte_id[ord("O")], byte_id[ord("K")]
    nxt = np.full(v, o)
    nxt[nl], nxt[o], nxt[k], nxt[END_OF_TURN] = o, k, END_OF_TURN, nl
    hidden = 384
    config = {"num_hidden_layers": 1, "max_position_embeddings": 512, "hidden_size": hidden,
              "intermediate_size": 128, "num_attention_heads": 6, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": v}
    rng = np.random.default_rng(0)
    embed = np.zeros((v, hidden), np.float32)
    embed[np.arange(v), np.arange(v)] = 1.0
    head = np.zeros((v, hidden), np.float32)
    head[nxt, np.arange(v)] = 1.0
    p = "model.layers.0."
    kv = hidden // 6 * 2
    weights = {
        "model.embed_tokens.weight": embed,
        p + "input_layernorm.weight": np.ones(hidden, np.float32),
        p + "self_attn.q_proj.weight": rng.normal(0, 0.02, (hidden, hidden)).astype(np.float32),
        p + "self_attn.k_proj.weight": rng.normal(0, 0.02, (kv, hidden)).astype(np.float32),
        p + "self_attn.v_proj.weight": rng.normal(0, 0.02, (kv, hidden)).astype(np.float32),
        p + "self_attn.o_proj.weight": np.zeros((hidden, hidden), np.float32),
        p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
        p + "mlp.gate_proj.weight": rng.normal(0, 0.02, (128, hidden)).astype(np.float32),
        p + "mlp.up_proj.weight": rng.normal(0, 0.02, (128, hidden)).astype(np.float32),
        p + "mlp.down_proj.weight": np.zeros((hidden, 128), np.float32),
        "model.norm.weight": np.ones(hidden, np.float32),
        "lm_head.weight": head,
    }

    def vocab(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([3] * len(CHAT_SPECIALS) + [1] * (v - len(CHAT_SPECIALS)))
        w.add_token_merges(["Ġ t"])
        w.add_bos_token_id(BOS)
        w.add_eos_token_id(EOS)
        w.add_pad_token_id(PAD)
        w.add_add_bos_token(True)
        if chat_template is not None:
            w.add_chat_template(chat_template)

    write_tiny_gguf(path, config, weights, GGMLQuantizationType.F32, metadata=vocab)
    return path
