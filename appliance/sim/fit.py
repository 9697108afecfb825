"""The step-time model: seconds per engine iteration from what the iteration computed.

An iteration's cost follows its composition: decode rows (each a matmul row; static padding
rows count), prefill tokens, prefill chunks (each a separate attention call), and the context
tokens the decode rows attend to (attention reads every cached token), plus a fixed cost per
step. Every coefficient is a cost, so none may be negative (an unconstrained fit of a short run
trades features off against each other, e.g. a negative price per attended token, and then
mispredicts any composition the run did not have). Two non-negative least-squares fits (plain and
relative-error weighted), each with and without the OPTIONAL features, are compared on held-out
iterations; the simplest fit whose held-out error is within one standard error of the best one's
is kept (the one-standard-error rule). A window that cannot tell a feature's price apart from the
others' leaves it out rather than guess one: with one prompt prefilled at a time every prefill step
carries one chunk, so a price per chunk is only the jump from a decode-only step to a prefill step,
which a setting with smaller chunks or several prompts in prefill would multiply (fitted on such a
window, the price per chunk made every small-chunk setting 20-35 % too slow in
benchmarks/simulator_accuracy.py). A model is valid for one engine configuration (its `EngineKey`).

Iterations of one composition do not all take the same time (on a shared CPU the step time of a
small batch varies by 2x from one iteration to the next). The model keeps that spread: the
percentiles of recorded / predicted seconds over the fitted iterations (`noise`), from which a
replay draws one ratio per iteration. Means then come out unbiased whichever fit was kept, and
tail latencies (p99 ITL, TTFT) see the spread the engine really has.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

FEATURES = ("decode_rows", "prefill_tokens", "prefill_seqs", "decode_context_tokens")
OPTIONAL = ("prefill_seqs", "decode_context_tokens")  # priced only when the window shows they pay
INTERCEPT = "intercept"
MIN_ROWS = 20  # fewer iterations than this cannot pin down five coefficients and a held-out error
HOLDOUT_EVERY = 5  # every 5th iteration (in time order) is held out
MIN_STEP_S = 1e-5  # a prediction never goes below this (a step always costs something)
NOISE_PERCENTILES = np.linspace(0.0, 100.0, 101)  # the noise distribution is kept at every percentile


class FitError(ValueError):
    """The iterations cannot support a fit (too few, or missing the needed metrics)."""


@dataclass(frozen=True)
class EngineKey:
    """What changes the cost of a step: the model, its dtype and device, the CPU kernels, threads."""

    model: str
    dtype: str
    device: str
    cpu_kernels: bool | None = None  # None: not recorded (runs stored before the field existed)
    threads: int | None = None

    @classmethod
    def from_fixed(cls, fixed: Mapping[str, Any]) -> "EngineKey":
        """From GET /admin/knobs' "fixed" settings (as stored with every run)."""
        missing = [k for k in ("model", "dtype", "device") if not fixed.get(k)]
        if missing:
            raise FitError(f"the engine's fixed settings lack {', '.join(missing)}: cannot key a step-time model")
        return cls(str(fixed["model"]), str(fixed["dtype"]), str(fixed["device"]),
                   fixed.get("cpu_kernels"), fixed.get("threads"))

    def __str__(self) -> str:
        kernels = {True: "kernels on", False: "kernels off", None: "kernels ?"}[self.cpu_kernels]
        threads = "threads ?" if self.threads is None else f"{self.threads} threads"
        return f"{self.model} {self.dtype} on {self.device}, {kernels}, {threads}"


@dataclass(frozen=True)
class Composition:
    """What one iteration computes (the model's inputs)."""

    decode_rows: int
    prefill_tokens: int
    prefill_seqs: int
    decode_context_tokens: int

    def vector(self) -> list[float]:
        return [float(getattr(self, name)) for name in FEATURES]


def composition_of(row: Mapping[str, Any]) -> Composition:
    """The composition of a stored iteration row (decode rows include static padding rows)."""
    return Composition(int(row["decode_seqs"]) + int(row.get("padding_tokens") or 0), int(row["prefill_tokens"]),
                       int(row["prefill_seqs"]), int(row["decode_context_tokens"]))


@dataclass
class StepTimeModel:
    """A fitted model: step seconds = intercept + sum(coefficient * feature), and the engine-loop
    gap between back-to-back iterations."""

    key: EngineKey
    coefficients: dict[str, float]  # INTERCEPT and every name in FEATURES
    gap_s: float
    method: str
    rows_used: int
    rows_held_out: int
    heldout_mape: float  # mean absolute percentage error on the held-out iterations, 0..1
    heldout_mae_s: float
    replica_id: str = ""
    run_id: str | None = None
    window_start: float = 0.0
    window_end: float = 0.0
    fitted_at: float = field(default_factory=time.time)
    id: int | None = None  # row id once stored
    noise: tuple[float, ...] = ()  # recorded / predicted seconds at each NOISE_PERCENTILES; () none

    def predict(self, c: Composition) -> float:
        """Seconds one iteration of this composition takes (the fit's point estimate)."""
        total = self.coefficients[INTERCEPT] + sum(self.coefficients[n] * v for n, v in zip(FEATURES, c.vector()))
        return max(MIN_STEP_S, total)

    def expected(self, c: Composition) -> float:
        """Mean seconds of iterations of this composition: the point estimate times the spread's
        mean ratio (what a replay averages to)."""
        return self.predict(c) * (float(np.mean(self.noise)) if self.noise else 1.0)

    def ratio(self, u: float) -> float:
        """The recorded / predicted ratio at quantile `u` (0..1) of the fitted spread; 1 without one."""
        if not self.noise:
            return 1.0
        return float(np.interp(u, np.linspace(0.0, 1.0, len(self.noise)), self.noise))

    def step(self, c: Composition, u: float) -> tuple[float, float]:
        """(step seconds, gap before the next step) for an iteration whose noise draw is `u`:
        the replay's step timer interface."""
        return self.predict(c) * self.ratio(u), self.gap_s

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["key"] = asdict(self.key)
        return out


def usable_rows(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The iteration rows a fit uses: those with `decode_context_tokens` and a positive duration."""
    return [r for r in rows if r.get("decode_context_tokens") is not None and r["duration_s"] > 0]


def fit_step_time(
    rows: Sequence[Mapping[str, Any]],
    key: EngineKey,
    *,
    replica_id: str = "",
    run_id: str | None = None,
) -> StepTimeModel:
    """Fit a StepTimeModel to iteration rows (dicts with the `iterations` columns, in time order).

    Rows without `decode_context_tokens` (stored before that metric existed) are skipped. Raises
    FitError naming the count when fewer than MIN_ROWS usable rows remain.
    """
    usable = usable_rows(rows)
    if len(usable) < MIN_ROWS:
        skipped = len(rows) - len(usable)
        note = f" ({skipped} lack decode_context_tokens or a duration)" if skipped else ""
        raise FitError(f"{len(usable)} usable iterations{note}: a step-time fit needs at least {MIN_ROWS}")
    X = np.array([[1.0, *composition_of(r).vector()] for r in usable])
    y = np.array([float(r["duration_s"]) for r in usable])
    held = np.zeros(len(usable), dtype=bool)
    held[HOLDOUT_EVERY - 1 :: HOLDOUT_EVERY] = True
    mape, method, beta = _select(X, y, held)
    mae = float(np.mean(np.abs(_predict(X[held], beta) - y[held])))
    noise = np.percentile(y[~held] / _predict(X[~held], beta), NOISE_PERCENTILES)
    names = (INTERCEPT, *FEATURES)
    started = [float(r["started_at"]) for r in usable]
    return StepTimeModel(
        key=key, coefficients={n: float(b) for n, b in zip(names, beta)}, gap_s=loop_gap(rows),
        method=method, rows_used=int((~held).sum()), rows_held_out=int(held.sum()), heldout_mape=mape,
        heldout_mae_s=mae, replica_id=replica_id, run_id=run_id, window_start=min(started),
        window_end=max(s + float(r["duration_s"]) for s, r in zip(started, usable)),
        noise=tuple(float(q) for q in noise),
    )


def _select(X: np.ndarray, y: np.ndarray, held: np.ndarray) -> tuple[float, str, np.ndarray]:
    """(held-out MAPE, method, coefficients) of the kept fit: of every method over every subset of
    the OPTIONAL features, the one with the fewest features whose held-out error is within one
    standard error of the lowest (then the lowest error); a feature left out is priced at 0."""
    optional = [1 + FEATURES.index(name) for name in OPTIONAL]  # column 0 is the intercept
    fits = []
    for dropped in itertools.chain.from_iterable(itertools.combinations(optional, k) for k in range(len(optional) + 1)):
        cols = [c for c in range(X.shape[1]) if c not in dropped]
        for method, solve in _METHODS.items():
            beta = np.zeros(X.shape[1])
            beta[cols] = solve(X[~held][:, cols], y[~held])
            ape = np.abs(_predict(X[held], beta) - y[held]) / y[held]
            label = method + "".join(f" -{_SHORT[FEATURES[c - 1]]}" for c in dropped)
            fits.append((float(ape.mean()), float(ape.std(ddof=1) / np.sqrt(len(ape))), len(cols), label, beta))
    best = min(fits, key=lambda f: f[0])
    mape, _, _, method, beta = min((f for f in fits if f[0] <= best[0] + best[1]), key=lambda f: (f[2], f[0]))
    return mape, method, beta


def loop_gap(rows: Sequence[Mapping[str, Any]]) -> float:
    """Median seconds from one iteration's end to the next one's start while the engine had work
    left (running or waiting after it): the engine loop's own time between steps. 0 if unknown."""
    gaps = [
        float(b["started_at"]) - float(a["started_at"]) - float(a["duration_s"])
        for a, b in zip(rows, rows[1:])
        if b["iteration"] == a["iteration"] + 1 and a["running"] + a["waiting"] > 0
    ]
    return max(0.0, float(np.median(gaps))) if gaps else 0.0


def _predict(X: np.ndarray, beta: np.ndarray) -> np.ndarray:
    return np.maximum(X @ beta, MIN_STEP_S)


def _ols(X: np.ndarray, y: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
    if w is not None:
        X, y = X * w[:, None], y * w
    return np.linalg.lstsq(X, y, rcond=None)[0]


def _nonneg(X: np.ndarray, y: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
    """Least squares with every coefficient >= 0: refit without the negative ones until none is."""
    active = np.ones(X.shape[1], dtype=bool)
    beta = np.zeros(X.shape[1])
    while active.any():
        beta = np.zeros(X.shape[1])
        beta[active] = _ols(X[:, active], y, w)
        if (beta >= 0).all():
            break
        active &= beta > 0
    return np.maximum(beta, 0.0)


_METHODS = {  # names stay short: a stored model's method (with what it left out) holds 32 characters
    "nnls": _nonneg,
    "relative nnls": lambda X, y: _nonneg(X, y, 1.0 / y),  # minimises relative error
}
_SHORT = {"prefill_seqs": "chunks", "decode_context_tokens": "context"}
