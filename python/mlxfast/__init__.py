"""mlxfast: a fast local LLM inference server and library on MLX.

Importing the package loads nothing of MLX: the pure parts (the scheduler,
the block allocator, the API types) import without it. ``mlxfast._ext`` needs
libmlx loaded first: the modules that use it import ``mlx.core`` before it,
and ``from mlxfast import _ext`` does so here.
"""

__version__ = "0.1.0"


def __getattr__(name):
    if name == "_ext":
        import importlib

        import mlx.core  # noqa: F401  (libmlx before the extension)

        return importlib.import_module("mlxfast._ext")
    raise AttributeError(f"module 'mlxfast' has no attribute {name!r}")


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
