"""mlxfast: a fast local LLM inference server and library on MLX."""

import mlx.core as _mx  # noqa: F401  (libmlx must be loaded before _ext)

from . import _ext  # noqa: F401

__version__ = "0.1.0"


def load(path=None, **kwargs):
    """Load a model and its tokenizer: ``(model, tokenizer)``.

    ``path`` is an HF/MLX directory or a GGUF file; ``None`` loads the
    built-in default model (SmolLM2-135M-Instruct, Q4_1 GGUF).
    """
    from .models.loader import load as _load

    return _load(path, **kwargs)


def generate(model, tokenizer, prompt, **kwargs):
    """Generate a completion and return it as one string (see stream_generate)."""
    from .generation import generate as _generate

    return _generate(model, tokenizer, prompt, **kwargs)


def stream_generate(model, tokenizer, prompt, **kwargs):
    """Yield text pieces as they are generated (never a broken UTF-8 character)."""
    from .generation import stream_generate as _stream_generate

    return _stream_generate(model, tokenizer, prompt, **kwargs)


__all__ = ["load", "generate", "stream_generate", "__version__"]
