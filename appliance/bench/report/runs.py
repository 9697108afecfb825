"""Tuning reports of stored runs: `render_report(db_url, run_ids, fmt)` in HTML, Markdown, CSV
or JSON.

Per run: the knob settings and their changes during the run, the latency table with
percentiles (client and server side), throughput, the scheduler's figures from the ITERATION
telemetry, time series of running / waiting / KV usage / tokens per iteration (HTML, JSON), and
findings in plain words. With several runs, a comparison section says which settings won, by
how much, on which metric.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
from dataclasses import asdict
from typing import Any, Callable, Sequence

from appliance.bench.report import page as h
from appliance.bench.report import tables
from appliance.bench.report.analysis import Comparison, compare, findings
from appliance.bench.report.data import RunData, load_run
from appliance.numeric import to_ms
from appliance.telemetry.store import using_engine

FORMATS = ("html", "md", "csv", "json")
ALIASES = {"markdown": "md", "htm": "html"}
TITLE = "Tuning report"


def normalize_format(fmt: str) -> str:
    """"html", "md" (or "markdown"), "csv" or "json"; ValueError for anything else."""
    name = ALIASES.get(fmt.lower().strip(), fmt.lower().strip())
    if name not in FORMATS:
        raise ValueError(f"unknown report format {fmt!r}; choose from {', '.join(FORMATS)} (or markdown)")
    return name


def render_report(db_url: str, run_ids: list[str], fmt: str) -> str:
    """The report of `run_ids` (in that order) from the store at `db_url`, as text in `fmt`.

    ValueError for a bad format, no run ids or a repeated one; LookupError for an unknown run.
    """
    name = normalize_format(fmt)
    if not run_ids:
        raise ValueError("a report needs at least one run id")
    repeated = sorted({r for r in run_ids if run_ids.count(r) > 1})
    if repeated:
        raise ValueError(f"run id(s) given more than once: {', '.join(repeated)}")
    with using_engine(db_url) as engine:
        data = [load_run(engine, run_id, series=name in ("html", "json")) for run_id in run_ids]
    comparison = compare(data) if len(data) > 1 else None
    return RENDERERS[name](data, comparison)


def _generated() -> str:
    return tables.when(dt.datetime.now(dt.timezone.utc).timestamp())


# ---------------------------------------------------------------------------------- markdown


def md_table(table: tables.Table) -> str:
    headers, rows = table
    if not rows:
        return "_none_\n"

    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(x) for x in headers) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|"]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def render_markdown(data: Sequence[RunData], comparison: Comparison | None) -> str:
    out = [f"# {TITLE}\n", f"Generated {_generated()} for {len(data)} run(s).\n"]
    if comparison is not None:
        out += ["## Comparison\n", *[f"- {line}" for line in comparison.lines], "",
                md_table(tables.comparison_table(comparison))]
        if comparison.knob_diff:
            out += ["Settings that differ:\n", md_table(tables.knob_diff_table(comparison))]
    for i, run in enumerate(data, start=1):
        out += [f"## Run {i}: {run.name}\n"]
        out += [f"- **{k}**: {v}" for k, v in tables.facts(run)] + [""]
        out += ["### Knob settings\n", md_table(tables.settings_table(run)),
                "Changes during the run:\n", md_table(tables.changes_table(run)),
                "### Latency\n", md_table(tables.latency_table(run)),
                "### Throughput\n", md_table(tables.throughput_table(run)),
                "### Scheduler\n", md_table(tables.iterations_table(run)),
                "### Slowest requests: where their time went\n", md_table(tables.worst_requests_table(run)),
                "### Findings\n"]
        notes = findings(run)
        out += [f"- {f.text}" for f in notes] if notes else ["Nothing stands out."]
        out.append("")
    return "\n".join(out)


# --------------------------------------------------------------------------------------- csv

CSV_HEADERS = ("run_id", "run_name", "section", "metric", "stat", "value", "unit")


def render_csv(data: Sequence[RunData], comparison: Comparison | None) -> str:
    """One row per figure: run, section, metric, stat, raw value (seconds, tokens, shares), unit."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_HEADERS)
    for run in data:
        for rec in tables.metric_records(run):
            writer.writerow([run.run_id, run.name, rec["section"], rec["metric"], rec["stat"],
                             _csv_value(rec["value"]), rec["unit"]])
        for f in findings(run):
            writer.writerow([run.run_id, run.name, "finding", f.kind, "text", f.text, ""])
    if comparison is not None:
        for m in comparison.metrics:
            if m.winner is None:
                continue
            winner = data[m.winner]
            writer.writerow([winner.run_id, winner.name, "comparison", m.key, "winner_margin",
                             _csv_value(m.margin), "share"])
    return buf.getvalue()


def _csv_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)
    return str(value)


# -------------------------------------------------------------------------------------- json


def report_dict(data: Sequence[RunData], comparison: Comparison | None) -> dict[str, Any]:
    """The whole report as JSON-ready data."""
    runs = []
    for run in data:
        totals = asdict(run.totals)
        totals["padding_share"] = run.totals.padding_share
        runs.append({
            "run": {k: v for k, v in run.run.items() if k not in ("requests", "summary")},
            "knobs": run.knobs,
            "fixed": run.fixed,
            "knob_changes": run.knob_changes,
            "summary": run.summary,
            "server": run.server,
            "iterations": totals,
            "series": {k: asdict(v) for k, v in run.series.items()},
            "findings": [asdict(f) for f in findings(run)],
            "requests": run.run.get("requests", []),
            "worst_requests": [{k: v for k, v in s.as_dict().items() if k != "iterations"} for s in run.worst],
        })
    out: dict[str, Any] = {"title": TITLE, "generated": _generated(), "runs": runs, "comparison": None}
    if comparison is not None:
        out["comparison"] = {
            "names": comparison.names,
            "lines": comparison.lines,
            "knob_diff": comparison.knob_diff,
            "wins": comparison.wins,
            "metrics": [{**asdict(m), "tie": m.tie} for m in comparison.metrics],
        }
    return out


def render_json(data: Sequence[RunData], comparison: Comparison | None) -> str:
    return json.dumps(report_dict(data, comparison), indent=2, default=str) + "\n"


# -------------------------------------------------------------------------------------- html


def render_html(data: Sequence[RunData], comparison: Comparison | None) -> str:
    page = h.Page(TITLE)
    page.heading(1, TITLE)
    page.add(f'<p class="muted">Generated {h.esc(_generated())} for {len(data)} run(s).</p>')
    if comparison is not None:
        _html_comparison(page, data, comparison)
    for i, run in enumerate(data, start=1):
        _html_run(page, i, run)
    return page.render()


def _html_comparison(page: h.Page, data: Sequence[RunData], comparison: Comparison) -> None:
    page.heading(2, "Comparison", "comparison")
    page.add(h.bullet_list(comparison.lines, "findings"))
    page.add(h.table(*tables.comparison_table(comparison)))
    if comparison.knob_diff:
        page.add("<p>Settings that differ:</p>" + h.table(*tables.knob_diff_table(comparison)))
    names = comparison.names
    throughput = h.bar_figure("Throughput", "tok/s", ["output", "total (input + output)"], [
        (name, [run.summary.get("output_throughput"), run.summary.get("total_token_throughput")])
        for name, run in zip(names, data)])
    categories = ["TTFT P50", "TTFT P99", "TPOT P50", "ITL P99", "E2E P50", "E2E P99"]
    keys = [("ttft", "p50"), ("ttft", "p99"), ("tpot", "p50"), ("itl", "p99"), ("e2e", "p50"), ("e2e", "p99")]
    latency = h.bar_figure("Latency", "ms", categories, [
        (name, [to_ms((run.summary.get(m) or {}).get(s)) for m, s in keys]) for name, run in zip(names, data)])
    page.add(f'<div class="grid">{page.chart(throughput)}{page.chart(latency)}</div>')


def _html_run(page: h.Page, index: int, run: RunData) -> None:
    page.heading(2, f"Run {index}: {run.name}", f"run-{index}")
    page.add(h.facts(tables.facts(run)))
    page.heading(3, "Findings")
    page.add(h.bullet_list([f.text for f in findings(run)], "findings"))
    page.heading(3, "Knob settings")
    page.add(h.table(*tables.settings_table(run)))
    page.add("<p>Changes during the run:</p>" + h.table(*tables.changes_table(run)))
    page.heading(3, "Latency and throughput")
    page.add(h.table(*tables.latency_table(run)))
    page.add(h.table(*tables.throughput_table(run)))
    page.add(f'<div class="grid">{page.chart(_latency_figure(run))}{page.chart(_completion_figure(run))}</div>')
    page.heading(3, "Scheduler (iteration telemetry)")
    page.add(h.table(*tables.iterations_table(run)))
    page.heading(3, "Slowest requests: where their time went")
    page.add(h.table(*tables.worst_requests_table(run)))
    if run.series:
        charts = [page.chart(fig) for fig in _series_figures(run)]
        page.add(f'<div class="grid">{"".join(charts)}</div>')
    else:
        page.add('<p class="muted">No iteration telemetry was recorded for this run '
                 "(a server without telemetry, or another replica).</p>")


def _markers(run: RunData) -> list[tuple[float, str]]:
    start = run.run["started_at"]
    return [(c["applied_at"] - start, ", ".join(f"{k}={v}" for k, v in (c.get("new") or {}).items()))
            for c in run.knob_changes]


def _latency_figure(run: RunData) -> Any:
    """Per-request TTFT and E2E against the time each request was sent."""
    ok = [r for r in run.run.get("requests", []) if r["ok"] and r["start_offset_s"] is not None]
    sent = [r["start_offset_s"] for r in ok]
    return h.line_figure("Latency per request", "sent at (s from run start)", "ms", [
        ("TTFT", sent, [to_ms(r["ttft_s"]) for r in ok], {"mode": "markers"}),
        ("E2E", sent, [to_ms(r["e2e_s"]) for r in ok], {"mode": "markers"}),
    ], _markers(run))


def _completion_figure(run: RunData) -> Any:
    """Output tokens of completed requests per second of the run (by finish time)."""
    buckets: dict[int, int] = {}
    for r in run.run.get("requests", []):
        if r["ok"] and r["start_offset_s"] is not None and r["e2e_s"] is not None:
            second = int(r["start_offset_s"] + r["e2e_s"])
            buckets[second] = buckets.get(second, 0) + (r["output_tokens"] or 0)
    xs = list(range(max(buckets) + 1)) if buckets else []
    return h.line_figure("Throughput (completed output tokens per second)", "s from run start", "tok/s",
                         [("output tok/s", xs, [buckets.get(x, 0) for x in xs], {"line_shape": "hv"})],
                         _markers(run))


def _series_figures(run: RunData) -> list[Any]:
    s, marks = run.series, _markers(run)

    def pair(column: str, stat: str = "mean") -> tuple[list[float], list[float]]:
        series = s[column]
        return series.t, getattr(series, stat)

    running = h.line_figure("Running and waiting requests", "s from run start", "requests", [
        ("running", *pair("running"), {}),
        ("waiting (max)", *pair("waiting", "max"), {}),
        ("max_num_seqs", *pair("max_num_seqs"), {"line": {"dash": "dot", "color": "#999"}}),
    ], marks)
    used, total = s["kv_blocks_used"], s["kv_blocks_total"]
    kv = h.line_figure("KV cache usage", "s from run start", "% of blocks", [
        ("KV used (max)", used.t, [100 * u / t if t else 0 for u, t in zip(used.max, total.max)], {}),
    ], marks)
    kv.update_yaxes(range=[0, 105])
    tokens = h.line_figure("Tokens per iteration", "s from run start", "tokens", [
        ("prefill", *pair("prefill_tokens"), {"stackgroup": "work"}),
        ("decode", *pair("decode_tokens"), {"stackgroup": "work"}),
        ("padding rows", *pair("padding_tokens"), {"stackgroup": "work"}),
        ("token budget", *pair("token_budget"), {"line": {"dash": "dot", "color": "#999"}}),
    ], marks)
    return [running, kv, tokens]


RENDERERS: dict[str, Callable[[Sequence[RunData], Comparison | None], str]] = {
    "html": render_html,
    "md": render_markdown,
    "csv": render_csv,
    "json": render_json,
}
