"""``mlxfast convert MODEL.gguf OUT_DIR``: a GGUF file to an HF/MLX directory
(safetensors + config.json + tokenizer files) that mlxfast and mlx-lm load."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from .models import gguf


def convert_gguf(src: str | Path, out_dir: str | Path) -> Path:
    from .text.tokenizer import Tokenizer

    src, out = Path(src), Path(out_dir)
    if not src.is_file():
        raise FileNotFoundError(f"{src} does not exist")
    tensors, meta = gguf.read_gguf(src)
    config = gguf.gguf_config(meta)
    weights, quantization = gguf.hf_weights(tensors, config)
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    if quantization:
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
