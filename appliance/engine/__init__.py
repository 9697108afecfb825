"""The inference engine: continuous batching over a paged KV cache with chunked prefill."""

from .async_engine import AsyncEngine, EngineDeadError, EngineDrainingError, QueueFullError
from .config import EngineConfig, parse_bytes
from .engine import LLMEngine, RequestOutput
from .knobs import KnobError, Knobs
from .sampling import InvalidRequestError, SamplingParams
from .stats import IterationStats, KnobChange, RequestStats, StatsSink

__all__ = [
    "AsyncEngine", "EngineDeadError", "EngineDrainingError", "QueueFullError",
    "EngineConfig", "parse_bytes", "LLMEngine", "RequestOutput", "KnobError", "Knobs",
    "InvalidRequestError", "SamplingParams", "IterationStats", "KnobChange", "RequestStats", "StatsSink",
]
