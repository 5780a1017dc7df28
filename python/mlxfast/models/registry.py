"""Model types mlxfast can run, and the class for each."""

from __future__ import annotations

from . import gemma3, llama, moe, phi3

MODEL_TYPES = {
    "llama": llama,
    "mistral": llama,
    "qwen2": llama,
    "qwen3": llama,
    "gemma3_text": gemma3,
    "phi3": phi3,
    "qwen3_moe": moe,
    "mixtral": moe,
}

GGUF_ARCHITECTURES = ("llama", "gemma3", "phi3", "qwen2", "qwen3", "qwen3moe")


def model_module(model_type: str | None):
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"unsupported model type {model_type!r}; supported: "
            + ", ".join(sorted(MODEL_TYPES))
        )
    return MODEL_TYPES[model_type]
