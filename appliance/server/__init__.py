"""The HTTP server: OpenAI-compatible API, live knobs, metrics and health over the engine.

Exports load lazily so `appliance --help` and the CLI parser do not import torch.
"""

from importlib import import_module

_EXPORTS = {"build_app": "app", "AppState": "state", "ServerConfig": "state"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
