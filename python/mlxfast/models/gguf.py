"""GGUF (llama.cpp) files: metadata to an HF-style config, tensor names to
HF names, and undoing llama.cpp's q/k row permutation.

``gguf_file`` reads the file with every offset checked; ``gguf_quants``
turns block formats into MLX affine groups of 32 (exactly, where the format
is affine per 32 weights) or fp16. MLX's own GGUF reader is not used: it
crashes on damaged headers and its Q4_K conversion is wrong (both measured).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import mlx.core as mx

from .gguf_file import GGUFFile
from .gguf_quants import convert_tensor
from .registry import GGUF_ARCHITECTURES

GGUF_GROUP_SIZE = 32

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 norms around attention and MLP (llama.cpp names -> HF).
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3: q/k/v and gate/up fused, as in its HF checkpoint (ffn_up holds 2 x ff rows).
_PHI3_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
}
# Mixture of experts: the router and the experts' stacked [E, out, in]
# tensors -> the MoE block (models/moe.py; named mlp, Mixtral's block_sparse_moe).
_MOE_NAMES = {"ffn_gate_inp": "gate", "ffn_gate_exps": "switch_mlp.gate_proj",
              "ffn_up_exps": "switch_mlp.up_proj", "ffn_down_exps": "switch_mlp.down_proj"}
_QWEN3MOE_LAYER_NAMES = {**_LAYER_NAMES, **{k: f"mlp.{v}" for k, v in _MOE_NAMES.items()}}
_MIXTRAL_LAYER_NAMES = {**_LAYER_NAMES, **{k: f"block_sparse_moe.{v}" for k, v in _MOE_NAMES.items()}}
# Older Mixtral files: one tensor per expert, blk.N.ffn_{gate,down,up}.E (HF's w1, w2, w3).
_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|down|up)\.(\d+)\.(weight|scales|biases)$")
_MIXTRAL_EXPERT = {"gate": "w1", "down": "w2", "up": "w3"}
_LAYER_NAMES_OF = {"llama": _LAYER_NAMES, "gemma3": _GEMMA3_LAYER_NAMES, "phi3": _PHI3_LAYER_NAMES,
                   "qwen2": _LAYER_NAMES, "qwen3": _LAYER_NAMES, "qwen3moe": _QWEN3MOE_LAYER_NAMES}
# Architectures that are llama's layers with flags (qwen2: q/k/v biases; qwen3: q/k norms).
_LLAMA_LIKE = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias|scales|biases)$")
_TOP_RE = re.compile(r"^([a-z_]+)\.(weight|bias|scales|biases)$")


def read_gguf(path: str | Path) -> tuple[dict, dict]:
    """``(tensors, metadata)`` from a GGUF file, with a clear ValueError if it
    is damaged or holds a tensor type that cannot be loaded.

    Tensors are named as ``mx.load`` names them (``<name>.weight`` plus
    ``.scales``/``.biases`` for quantized ones)."""
    f = GGUFFile(path)
    tensors = {}
    for info in f.tensors.values():
        base, dot, kind = info.name.rpartition(".")
        converted = convert_tensor(info.type_name, f.tensor_bytes(info), info.shape, info.name)
        if kind != "weight" and "scales" in converted:
            raise ValueError(f"{path}: quantized tensor {info.name!r} is not a weight")
        if kind != "weight":
            tensors[info.name] = converted["weight"]
            continue
        for part, arr in converted.items():
            tensors[f"{base}{dot}{part}"] = arr
    return tensors, f.metadata


def _scalar(meta: dict, key: str, default=None):
    v = meta.get(key, default)
    return v.item() if hasattr(v, "item") and getattr(v, "size", 1) == 1 else v  # arrays stay arrays


def gguf_config(meta: dict) -> dict:
    """An HF ``config.json`` dict for a GGUF file's model."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )

    def get(name, default=None):
        return _scalar(meta, f"{arch}.{name}", default)

    def count(name, default=None, optional=False):
        """A size or count: a whole number from 1 to 2^24 (0 where ``optional``)."""
        v = get(name, default)
        if v is None:
            if optional:
                return None
            raise ValueError(f"{arch}.{name} is missing from the GGUF metadata")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) \
                or not (0 if optional else 1) <= v <= 1 << 24:
            raise ValueError(f"{arch}.{name} = {v!r} is not a plausible size")
        return int(v)

    n_heads = count("attention.head_count")
    hidden = count("embedding_length")
    vocab = count("vocab_size", optional=True)
    if vocab is None:
        vocab = len(meta.get("tokenizer.ggml.tokens", []))
    head_dim = (count("attention.key_length", optional=True) or count("rope.dimension_count", optional=True)
                or hidden // n_heads)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": count("block_count"),
        "intermediate_size": (count("feed_forward_length", optional=True)
                              or count("expert_feed_forward_length", optional=True) or 0),
        "num_attention_heads": n_heads,
        "num_key_value_heads": count("attention.head_count_kv", n_heads),
        "head_dim": int(head_dim),
        "vocab_size": int(vocab),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": True,  # fixed below once tensors are known
    }
    scale = get("rope.scaling.factor")
    kind = _scalar(meta, f"{arch}.rope.scaling.type")
    if kind == "linear" and scale:
        config["rope_scaling"] = {"type": "linear", "factor": float(scale)}
    elif kind not in (None, "none", "linear"):  # e.g. yarn: other angles at every position
        raise ValueError(f"GGUF RoPE scaling {kind!r} is not supported (linear only)")
    if arch in _LLAMA_LIKE:
        config.update(model_type=arch, architectures=[_LLAMA_LIKE[arch]])
    if arch == "gemma3":
        config.update(_gemma3_config(get, config))
    elif arch == "phi3":
        config.update(_phi3_config(get, config))
    elif arch == "qwen3moe" or (arch == "llama" and int(get("expert_count", 0) or 0) > 0):
        config.update(_moe_config(get, arch))
    config["gguf_architecture"] = arch
    return config


def _moe_config(get, arch: str) -> dict:
    """qwen3moe, and llama with experts (Mixtral). llama.cpp renormalises the
    top-k weights of both (Mixtral's softmax over its k is that already) and
    makes every layer of them a MoE layer."""
    experts, used = int(get("expert_count", 0) or 0), int(get("expert_used_count", 0) or 0)
    if experts < 1 or not 1 <= used <= experts:
        raise ValueError(f"{arch}: expert_count {experts} and expert_used_count {used} "
                         "must satisfy 1 <= used <= count")
    if arch == "llama":
        return {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                "num_local_experts": experts, "num_experts_per_tok": used}
    ff = get("expert_feed_forward_length")
    if ff is None:
        raise ValueError("qwen3moe: qwen3moe.expert_feed_forward_length is missing")
    return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
            "num_experts": experts, "num_experts_per_tok": used, "moe_intermediate_size": int(ff),
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}


def _gemma3_config(get, config: dict) -> dict:
    """What llama.cpp's gemma3 graph fixes or reads beyond the llama keys."""
    n = config["num_hidden_layers"]
    pattern = get("attention.sliding_window_pattern")
    if isinstance(pattern, (list, tuple)) or hasattr(pattern, "tolist"):
        sliding = [bool(x) for x in list(pattern)]  # per layer: true = sliding window
        if len(sliding) != n:
            raise ValueError(f"gemma3.attention.sliding_window_pattern has {len(sliding)} entries "
                             f"for {n} layers")
    else:
        every = int(pattern or 6)  # llama.cpp: every 6th layer is global
        sliding = [(i + 1) % every != 0 for i in range(n)]
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    # llama.cpp scales attention by 1/sqrt(head dim), except Gemma 3 27B
    # (62 layers): 1/sqrt(hidden / heads), as its query_pre_attn_scalar says.
    scalar = hidden / heads if n == 62 else config["head_dim"]
    out = {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "sliding_window": int(get("attention.sliding_window", 512)),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_local_base_freq": float(get("rope.freq_base_swa", 10000.0)),
        "query_pre_attn_scalar": float(scalar),
        "embed_scale": hidden ** 0.5,  # exact, as llama.cpp scales (HF rounds to bf16)
        "norm_shifted": True,  # llama.cpp's converter stores 1 + w
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
    }
    cap = get("final_logit_softcapping")
    if cap:
        out["final_logit_softcapping"] = float(cap)
    return out


def _phi3_config(get, config: dict) -> dict:
    """llama.cpp's phi3 keys: rope.dimension_count is the rotated part of a
    head (partial RoPE), not the head size; LongRoPE's original context and
    attention factor (its factors are tensors: see ``hf_weights``)."""
    head_dim = int(get("attention.key_length") or config["hidden_size"] // config["num_attention_heads"])
    rot = int(get("rope.dimension_count") or head_dim)
    partial = rot / head_dim
    while int(head_dim * partial) < rot:  # int() must give rot back (HF's rounding)
        partial = math.nextafter(partial, 2.0)
    out = {
        "model_type": "phi3",
        "architectures": ["Phi3ForCausalLM"],
        "head_dim": head_dim,
        "partial_rotary_factor": partial,
        # llama.cpp scales cos/sin by this key only (1 when absent).
        "rope_attn_factor": float(get("rope.scaling.attn_factor", 1.0)),
    }
    orig = get("rope.scaling.original_context_length")
    if orig:
        out["original_max_position_embeddings"] = int(orig)
    window = get("attention.sliding_window")
    if window:
        out["sliding_window"] = int(window)
    return out


def _phi3_rope_factors(tensors: dict, config: dict) -> None:
    """LongRoPE's factor tensors into the config's ``rope_scaling``, as HF writes it."""
    attn = config.pop("rope_attn_factor", 1.0)
    long = tensors.get("rope_factors_long.weight")
    if long is None:
        return
    short = tensors.get("rope_factors_short.weight", long)
    config["rope_scaling"] = {
        "type": "longrope",
        "long_factor": [float(x) for x in long.astype(mx.float32).tolist()],
        "short_factor": [float(x) for x in short.astype(mx.float32).tolist()],
        "attention_factor": attn,
    }


def _unpermute(w: mx.array, n_heads: int) -> mx.array:
    """Invert llama.cpp's convert-time row permutation of q/k projections."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *rest)
        .swapaxes(1, 2)
        .reshape(rows, *rest)
    )


def check_layer_count(n, names, source: str = "model") -> None:
    """The config's layer count against the layers the weights hold (GGUF
    ``blk.<i>.`` or HF ``layers.<i>.`` names): a count the file does not
    back (2^31 - 1 of them) made the load loop, or allocate, for ever."""
    present = {int(m.group(1)) for name in names if (m := _LAYER_INDEX.search(name))}
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(present):
        raise ValueError(f"{source}: the config says {n!r} layers, the weights hold {len(present)}")


_LAYER_INDEX = re.compile(r"(?:^|\.)(?:blk|layers)\.(\d+)\.")


def hf_weights(tensors: dict, config: dict) -> tuple[dict, dict]:
    """Rename GGUF tensors to HF/MLX names; return ``(weights, quantization)``.

    ``quantization`` is an mlx-lm style config: a default ``bits`` and
    ``group_size`` plus per-module overrides where a tensor differs.
    """
    out = {}
    arch = config.get("gguf_architecture", "llama")
    mixtral = config.get("model_type") == "mixtral"
    layer_names = _MIXTRAL_LAYER_NAMES if mixtral else _LAYER_NAMES_OF[arch]
    for name, arr in tensors.items():
        m = _EXPERT_RE.match(name) if mixtral else None
        if m:  # one tensor per expert: the model's sanitize stacks them
            layer, proj, e, kind = m.groups()
            out[f"model.layers.{layer}.block_sparse_moe.experts.{e}.{_MIXTRAL_EXPERT[proj]}.{kind}"] = arr
            continue
        m = _LAYER_RE.match(name)
        if m:
            layer, part, kind = m.groups()
            if part not in layer_names:
                raise ValueError(f"unexpected GGUF tensor {name!r}")
            out[f"model.layers.{layer}.{layer_names[part]}.{kind}"] = arr
            continue
        m = _TOP_RE.match(name)
        if m and m.group(1) in _TOP_NAMES:
            out[f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"] = arr
            continue
        if name.startswith("rope_freqs") or name.startswith("rope_factors"):
            continue
        raise ValueError(f"unexpected GGUF tensor {name!r}")

    # llama.cpp permutes llama's q/k rows for its rotary layout; gemma3 keeps HF's.
    for i in range(config["num_hidden_layers"] if arch == "llama" else 0):
        for proj, heads in (("q_proj", config["num_attention_heads"]),
                            ("k_proj", config["num_key_value_heads"])):
            for kind in ("weight", "scales", "biases", "bias"):
                key = f"model.layers.{i}.self_attn.{proj}.{kind}"
                if key in out:
                    out[key] = _unpermute(out[key], heads)

    if arch == "phi3":
        _phi3_rope_factors(tensors, config)
    elif "rope_freqs.weight" in tensors:
        # llama.cpp's converter stores Llama 3.x's llama3 RoPE scaling as the
        # per-frequency divisors it computed (the config's factors are gone).
        if config.get("rope_scaling"):
            raise ValueError("GGUF has both rope_freqs.weight and a RoPE scaling type")
        factors = tensors["rope_freqs.weight"].astype(mx.float32).tolist()
        config["rope_scaling"] = {"rope_type": "freq_factors", "factors": [float(f) for f in factors]}
    config["tie_word_embeddings"] = "lm_head.weight" not in out
    return out, _quantization_of(out)


def _quantization_of(weights: dict) -> dict:
    """Per-module bits for every quantized module (group size 32 in GGUF)."""
    bits_of = {}
    for key, scales in weights.items():
        if key.endswith(".scales"):
            module = key[: -len(".scales")]
            packed = weights[module + ".weight"].shape[-1]
            in_dims = scales.shape[-1] * GGUF_GROUP_SIZE
            bits_of[module] = packed * 32 // in_dims
    if not bits_of:
        return {}
    counts: dict[int, int] = {}
    for b in bits_of.values():
        counts[b] = counts.get(b, 0) + 1
    default_bits = max(counts, key=counts.get)
    quant = {"group_size": GGUF_GROUP_SIZE, "bits": default_bits}
    for module, b in bits_of.items():
        if b != default_bits:
            quant[module] = {"group_size": GGUF_GROUP_SIZE, "bits": b}
    return quant
