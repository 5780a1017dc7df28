"""The engine: one thread that owns every MLX call and runs continuous batching."""

from .api import (  # noqa: F401
    EngineOverloaded,
    PromptTooLong,
    EngineDead,
    FinishEvent,
    Request,
    SamplingParams,
    TokenEvent,
)
