"""The inference engine: continuous batching over a paged KV cache with chunked prefill.

Names are imported lazily, so light users (the telemetry store reads only `stats`) do not pay
for importing torch and transformers.
"""

from importlib import import_module

_EXPORTS = {
    "AsyncEngine": "async_engine", "EngineDeadError": "async_engine", "EngineDrainingError": "async_engine",
    "QueueFullError": "async_engine", "EngineConfig": "config", "parse_bytes": "config",
    "LLMEngine": "engine", "RequestOutput": "engine", "KnobError": "knobs", "Knobs": "knobs",
    "InvalidRequestError": "sampling", "SamplingParams": "sampling", "IterationStats": "stats",
    "KnobChange": "stats", "RequestStats": "stats", "StatsSink": "stats", "FinishReason": "stats",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
