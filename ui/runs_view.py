"""Plain views of stored runs (telemetry `runs` rows): knob snapshot, headline figures, rows.

A run's `summary` is what the bench runner stored (`BenchmarkRun.as_dict()`: client-side
figures under "summary"); runs without one (still running, failed) fall back to the
server-side figures of `queries.run_summary`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from appliance.records import COMPLETED_REASONS, FAILED_REASONS
from appliance.telemetry import queries

KNOB_COLUMNS = (
    ("scheduling_policy", "policy"),
    ("max_num_seqs", "max_num_seqs"),
    ("max_num_batched_tokens", "max_num_batched_tokens"),
    ("long_prefill_token_threshold", "chunk size"),
    ("max_num_partial_prefills", "partial prefills"),
)
FIGURE_COLUMNS = (
    ("completed", "completed"),
    ("failed", "failed"),
    ("output_tok_s", "output tok/s"),
    ("req_s", "req/s"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p99_ms", "TTFT p99 ms"),
    ("itl_p50_ms", "ITL p50 ms"),
    ("itl_p99_ms", "ITL p99 ms"),
    ("e2e_p99_s", "E2E p99 s"),
)
TABLE_HEADERS = ["started", "name", "status", "workload",
                 *(label for _, label in KNOB_COLUMNS), *(label for _, label in FIGURE_COLUMNS), "id"]


def knob_snapshot(run: dict[str, Any]) -> dict[str, Any]:
    """The knobs in force when the run started (stored flat, or as a GET /admin/knobs body)."""
    knobs = run.get("knobs") or {}
    inner = knobs.get("knobs")
    return dict(inner) if isinstance(inner, dict) else dict(knobs)


def _scaled(value: float | None, scale: float, digits: int) -> float | None:
    return None if value is None else round(value * scale, digits)


def run_figures(db: Any, run: dict[str, Any]) -> dict[str, Any]:
    """Headline figures of a run (keys of FIGURE_COLUMNS; None when unknown)."""
    stored = (run.get("summary") or {}).get("summary")
    if isinstance(stored, dict):
        dist = {k: stored.get(k) or {} for k in ("ttft", "itl", "e2e")}
        counts = {"completed": stored.get("completed"), "failed": stored.get("failed")}
        rates = (stored.get("output_throughput"), stored.get("request_throughput"))
    else:
        server = queries.run_summary(db, run["id"])
        dist = {k: server.get(f"{k}_s") or {} for k in ("ttft", "itl", "e2e")}
        reasons = server.get("finish_reasons", {})
        counts = {"completed": reasons.get("stop", 0) + reasons.get("length", 0),
                  "failed": reasons.get("abort", 0) + reasons.get("error", 0)}
        rates = (server.get("output_tokens_per_s"), server.get("requests_per_s"))
    return {
        **counts,
        "output_tok_s": _scaled(rates[0], 1, 1),
        "req_s": _scaled(rates[1], 1, 2),
        **{f"{metric}_{p}_ms": _scaled(dist[metric].get(p), 1000, 1)
           for metric in ("ttft", "itl") for p in ("p50", "p90", "p99")},
        "e2e_p50_s": _scaled(dist["e2e"].get("p50"), 1, 2),
        "e2e_p99_s": _scaled(dist["e2e"].get("p99"), 1, 2),
    }


def run_label(run: dict[str, Any]) -> str:
    return f"{run['name']} ({run['id'][:8]})"


def table_row(db: Any, run: dict[str, Any]) -> list[Any]:
    knobs = knob_snapshot(run)
    figures = run_figures(db, run)
    started = datetime.fromtimestamp(run["started_at"]).strftime("%Y-%m-%d %H:%M:%S")
    return [started, run["name"], run["status"], run["workload"],
            *(knobs.get(key) for key, _ in KNOB_COLUMNS),
            *(figures.get(key) for key, _ in FIGURE_COLUMNS), run["id"]]
