"""Start-time engine settings (fixed until restart) and KV cache sizing."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .knobs import Knobs

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1000, "KIB": 1 << 10, "M": 1 << 20, "MB": 1000**2,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1000**3, "GIB": 1 << 30}
DEFAULT_CPU_KV_MEMORY = "1GiB"


def parse_bytes(text: str) -> int:
    """'1GiB', '512MiB', '2GB', '1048576' -> bytes; ValueError naming the value otherwise."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"invalid memory size {text!r}: expected e.g. 1GiB, 512MiB, 2GB")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"invalid memory size {text!r}: must be positive")
    return value


@dataclass
class EngineConfig:
    """Settings fixed at start. Knobs inside may change later through the engine."""

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: str | None = None  # e.g. "1GiB"; default 1GiB on CPU
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    knobs: Knobs = field(default_factory=Knobs)
    seed: int = 0
    fast_forward: bool = True  # lean llama forward where supported (else transformers' classes)
    cpu_kernels: bool = True  # C kernels on the CPU where they build: decode attention, elementwise ops (else torch)

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be an integer in [1, 1024], got {self.block_size!r}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            raise ValueError(f"num_blocks must be a positive integer, got {self.num_blocks!r}")
        if self.num_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("give either num_blocks or kv_cache_memory, not both")
        if self.kv_cache_memory is not None:
            parse_bytes(self.kv_cache_memory)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
