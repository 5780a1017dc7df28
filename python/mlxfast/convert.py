"""``mlxfast convert MODEL.gguf OUT_DIR``: a GGUF file to an HF/MLX directory
(safetensors + config.json + tokenizer files) that mlxfast and mlx-lm load."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from .models import gguf


def convert_gguf(src: str | Path, out_dir: str | Path, dequantize: bool = False) -> Path:
    """With ``dequantize``, every quantized tensor is written as float32 (a
    full-precision copy: e.g. the target for a draft model that is the GGUF)."""
    from .text.tokenizer import Tokenizer

    src, out = Path(src), Path(out_dir)
    if not src.is_file():
        raise FileNotFoundError(f"{src} does not exist" if not src.exists() else f"{src} is not a GGUF file")
    _check_output_dir(out)
    tensors, meta = gguf.read_gguf(src)
    config = gguf.gguf_config(meta)
    gguf.check_layer_count(config["num_hidden_layers"], tensors, str(src))
    weights, quantization = gguf.hf_weights(tensors, config)
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    if quantization and dequantize:
        weights = _dequantized(weights, quantization["group_size"])
    elif quantization:
        config["quantization"] = quantization
        config["quantization_config"] = quantization
    config["bos_token_id"] = tokenizer.bos_token_id
    config["eos_token_id"] = sorted(tokenizer.eos_token_ids)
    config["torch_dtype"] = "float32"

    out.mkdir(parents=True, exist_ok=True)
    if config["tie_word_embeddings"]:
        weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_hf(out)
    return out


def _check_output_dir(out: Path) -> None:
    """The output is a new or empty directory, as mlx-lm's convert asks: a
    user's config.json there was replaced, a stale shard left to break the
    load, and a link in it written through (a file outside it replaced)."""
    if out.is_symlink() and not out.exists():
        raise ValueError(f"{out} is a broken link")
    if out.exists():
        if not out.is_dir():
            raise ValueError(f"{out} exists and is not a directory")
        if any(out.iterdir()):
            raise ValueError(f"{out} is not empty: convert writes a new or empty directory")


def _dequantized(weights: dict, group_size: int) -> dict:
    """Affine-quantized ``x.weight`` / ``x.scales`` / ``x.biases`` triples as
    float32 ``x.weight`` (bits from the packed shape); the rest in float32."""
    out = {}
    for k, v in weights.items():
        base = k.rsplit(".", 1)[0]
        if (k.endswith(".scales") or k.endswith(".biases")) and base + ".weight" in weights \
                and base + ".scales" in weights:
            continue
        if k.endswith(".weight") and base + ".scales" in weights:
            scales = weights[base + ".scales"]
            bits = v.shape[-1] * 32 // (scales.shape[-1] * group_size)
            v = mx.dequantize(v, scales, weights[base + ".biases"], group_size=group_size, bits=bits)
        out[k] = v.astype(mx.float32)
    return out
