"""HTTP server: OpenAI- and Anthropic-compatible routes over the engine."""

from .app import create_app
from .state import ServerSettings, ServerState

__all__ = ["create_app", "ServerSettings", "ServerState"]
