"""Settings from configs/*.toml and command-line flags (flags override the file)."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any

from .engine import EngineConfig, Knobs

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
ENGINE_KEYS = ("model", "dtype", "device", "block_size", "num_blocks", "kv_cache_memory",
               "gpu_memory_utilization", "max_model_len", "seed", "cpu_kernels")
SERVER_KEYS = ("host", "port", "api_key", "max_waiting", "db", "replica_id", "drain_grace_s",
               "telemetry_retention", "max_body_bytes", "served_model_name", "autopilot")
KNOB_KEYS = Knobs.names()


def config_path(name: str) -> Path:
    """A config given as a path, or as a preset name found in configs/ (e.g. `cpu`)."""
    path = Path(name)
    if path.is_file():
        return path
    preset = CONFIG_DIR / f"{name}.toml"
    if preset.is_file():
        return preset
    presets = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.toml")))
    raise FileNotFoundError(f"--config {name!r}: no such file and no preset of that name (presets: {presets})")


def load_config(name: str | None) -> dict[str, Any]:
    """configs/default.toml overlaid with the given file; unknown keys are an error."""
    values: dict[str, Any] = {}
    files = [CONFIG_DIR / "default.toml"] + ([config_path(name)] if name else [])
    for path in files:
        if not path.is_file():
            continue
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
        unknown = sorted(set(data) - set(ENGINE_KEYS + SERVER_KEYS + KNOB_KEYS))
        if unknown:
            raise ValueError(f"{path}: unknown setting(s) {', '.join(unknown)}")
        values.update(data)
    return values


def merged_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The config file's values with every flag that was given on the command line on top."""
    values = load_config(getattr(args, "config", None))
    for key in ENGINE_KEYS + SERVER_KEYS + KNOB_KEYS:
        flag = getattr(args, key, None)
        if flag is not None:
            values[key] = flag
    if values.get("num_blocks") is not None:
        values.pop("kv_cache_memory", None)
    return values


def knobs_from(values: dict[str, Any]) -> Knobs:
    return Knobs(**{k: values[k] for k in KNOB_KEYS if k in values})


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    values = merged_settings(args)
    engine = {k: values[k] for k in ENGINE_KEYS if values.get(k) is not None}
    return EngineConfig(knobs=knobs_from(values), **engine)
