"""The HTTP server: OpenAI-compatible API, live knobs, metrics and health over the engine."""

from .app import build_app
from .state import AppState, ServerConfig

__all__ = ["build_app", "AppState", "ServerConfig"]
