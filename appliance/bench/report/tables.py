"""The tables of a run report as plain rows, shared by the Markdown, CSV and HTML renderers.

Every table is (headers, rows) with rows of display strings; `metric_records` gives the same
figures as raw numbers (seconds, tokens, shares) for CSV and JSON.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict
from typing import Any

from appliance.bench.report.analysis import Comparison, pct
from appliance.bench.report.data import BUDGET_FULL, KV_PINNED, LATENCIES, RunData
from appliance.bench.metrics import balance_text
from appliance.bench.runner import describe_arrival
from appliance.numeric import ms_text

Table = tuple[list[str], list[list[str]]]
STATS = ("count", "mean", "p50", "p90", "p99", "max")
LATENCY_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E", "queue": "Queue"}
SERVER_LATENCIES = (("ttft_s", "TTFT (server)"), ("itl_s", "TPOT (server)"),
                    ("e2e_s", "E2E (server)"), ("queue_s", "Queue (server)"))
THROUGHPUT = (
    ("completed", "Completed requests", ""),
    ("failed", "Failed requests", ""),
    ("total_input_tokens", "Input tokens", ""),
    ("total_output_tokens", "Output tokens", ""),
    ("duration_s", "Duration", "s"),
    ("request_throughput", "Request throughput", "req/s"),
    ("output_throughput", "Output throughput", "tok/s"),
    ("total_token_throughput", "Total token throughput", "tok/s"),
    ("goodput", "Goodput (within SLO)", "req/s"),
)


def when(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def number(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def facts(data: RunData) -> list[tuple[str, str]]:
    run, s = data.run, data.summary
    fixed = data.fixed
    server = ", ".join(f"{k} {fixed[k]}" for k in ("model", "device", "dtype", "num_blocks", "block_size")
                       if fixed.get(k) is not None)
    return [
        ("Run id", run["id"]),
        ("Workload", run["workload"]),
        ("Arrival", describe_arrival(run["arrival"]) if run.get("arrival") else "-"),
        ("Status", run["status"]),
        ("Started", when(run["started_at"])),
        ("Duration", f"{data.duration_s:.2f} s"),
        ("Replica", run["replica_id"]),
        ("Served by", balance_text(s["replicas"]) + " (completed requests each)" if s.get("replicas") else "-"),
        ("Server", server or "-"),
        ("Requests", f"{s.get('completed', 0)} completed of {s.get('num_requests', 0)}"
                     f" (the server recorded {data.server['requests']})"),
    ]


def settings_table(data: RunData) -> Table:
    return ["Knob", "Value at start"], [[k, str(v)] for k, v in sorted(data.knobs.items())]


def changes_table(data: RunData) -> Table:
    """Every knob change of the run with who made it and why (the autopilot's moves carry their
    reason and predicted figures; a person's change its reason when one was given)."""
    start = data.run["started_at"]
    rows = []
    for c in data.knob_changes:
        new, old = c.get("new") or {}, c.get("old") or {}
        what = ", ".join(f"{k}: {old.get(k)} -> {v}" for k, v in new.items())
        rows.append([f"{c['applied_at'] - start:.2f}", str(c.get("version", "-")),
                     str(c.get("iteration", "-")), what, str(c.get("source", "-")), c.get("reason") or "-"])
    return ["At (s)", "Version", "Iteration", "Change", "Source", "Reason"], rows


def latency_table(data: RunData) -> Table:
    """Client-side distributions, then the server's own (from its requests rows), in ms."""
    rows = []
    for metric in LATENCIES:
        d = data.summary.get(metric) or {}
        rows.append([LATENCY_LABELS[metric], str(d.get("count") or 0)]
                    + [ms_text(d.get(stat), 2, "") for stat in STATS[1:]])
    for key, label in SERVER_LATENCIES:
        d = data.server.get(key)
        if d:
            rows.append([label, str(data.server["requests"])] + [ms_text(d.get(stat), 2, "") for stat in STATS[1:]])
    return ["Latency (ms)", "Count", "Mean", "P50", "P90", "P99", "Max"], rows


def throughput_table(data: RunData) -> Table:
    rows = []
    for key, label, unit in THROUGHPUT:
        value = data.summary.get(key)
        if key == "goodput" and value is None:
            continue
        rows.append([label, number(value), unit])
    return ["Figure", "Value", "Unit"], rows


def iterations_table(data: RunData) -> Table:
    t = data.totals
    rows = [
        ["Iterations", str(t.iterations)],
        ["Busy time (s)", number(t.busy_s)],
        ["Prefill tokens", str(t.prefill_tokens)],
        ["Decode tokens", str(t.decode_tokens)],
        ["Padding rows", str(t.padding_tokens)],
        ["Padding share of computed rows", pct(t.padding_share)],
        ["Preemptions", str(t.preemptions)],
        ["Prefix cache hit rate (tokens at admission)", pct(t.prefix_cache_hit_rate)],
        ["Mean token budget use", pct(t.budget_use_mean)],
        [f"Iterations filling >= {BUDGET_FULL:.0%} of the budget", pct(t.budget_full_share)],
        ["Iterations with requests waiting", pct(t.waiting_share)],
        ["KV cache peak", pct(t.kv_use_max)],
        [f"Iterations with KV >= {KV_PINNED:.0%}", pct(t.kv_pinned_share)],
        ["Max running", str(t.running_max)],
        ["Max waiting", str(t.waiting_max)],
    ]
    return ["Scheduler (iteration telemetry)", "Value"], rows


def worst_requests_table(data: RunData) -> Table:
    """The slowest requests (by E2E) and where their time went (ms; see request_split)."""
    def ms(seconds: float | None) -> str:
        return ms_text(seconds, 2, "")

    rows = []
    for s in data.worst:
        held = {k: v for k, v in s.queue_by_cause.items() if v > 0}
        top = max(held, key=held.__getitem__) if held else None
        rows.append([s.request_id, ms(s.e2e_s), ms(s.ttft_s), ms(s.queue_s),
                     f"{top} ({ms(held[top])} ms)" if top else "—", ms(s.prefill_s),
                     ms(s.first_token_sampling_s), ms(s.decode_own_s), ms(s.decode_prefill_stall_s)])
    return ["Request", "E2E ms", "TTFT ms", "Queue ms", "Most queueing held by", "Prefill ms",
            "First-token sampling ms", "Decode own steps ms", "Decode stall from prefill ms"], rows


def comparison_table(comparison: Comparison) -> Table:
    headers = ["Metric", *comparison.names, "Winner", "Margin"]
    rows = []
    for m in comparison.metrics:
        if all(v is None for v in m.values):
            continue
        cells = [ms_text(v) if m.unit == "ms" else (f"{v:.2f} {m.unit}" if v is not None else "-")
                 for v in m.values]
        if m.winner is None:
            winner, margin = "-", "-"
        elif m.tie:
            winner, margin = "tie", m.margin_text
        else:
            winner, margin = comparison.names[m.winner], m.margin_text
        rows.append([m.label, *cells, winner, margin])
    return headers, rows


def knob_diff_table(comparison: Comparison) -> Table:
    return (["Knob", *comparison.names],
            [[k, *[str(v) for v in values]] for k, values in comparison.knob_diff.items()])


# ------------------------------------------------------------------------------ raw records


def metric_records(data: RunData) -> list[dict[str, Any]]:
    """Every figure of the run as {section, metric, stat, value, unit} with raw numbers."""
    out: list[dict[str, Any]] = []

    def add(section: str, metric: str, stat: str, value: Any, unit: str = "") -> None:
        out.append({"section": section, "metric": metric, "stat": stat, "value": value, "unit": unit})

    for k, v in sorted(data.knobs.items()):
        add("settings", k, "value", v)
    for c in data.knob_changes:
        for k, v in (c.get("new") or {}).items():
            add("knob_change", k, f"at {c['applied_at'] - data.run['started_at']:.3f}s", v)
    for metric in LATENCIES:
        d = data.summary.get(metric) or {}
        for stat in STATS:
            add("client", metric, stat, d.get(stat), "" if stat == "count" else "s")
    for key, unit in ((k, u) for k, _, u in THROUGHPUT):
        add("throughput", key, "value", data.summary.get(key), unit)
    for key, _ in SERVER_LATENCIES:
        for stat, value in (data.server.get(key) or {}).items():
            add("server", key.removesuffix("_s"), stat, value, "s")
    for key in ("requests", "prompt_tokens", "output_tokens", "duration_s", "output_tokens_per_s",
                "requests_per_s"):
        add("server", key, "value", data.server.get(key))
    totals = asdict(data.totals)
    totals["padding_share"] = data.totals.padding_share
    for key, value in totals.items():
        add("iterations", key, "value", value)
    return out
