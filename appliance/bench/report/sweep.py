"""The report of a tuning sweep (`appliance tune --report PATH`): every grid point, the Pareto
fronts (output throughput vs P99 TTFT and vs P99 ITL) and the recommendation."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

import plotly.graph_objects as go

from appliance.bench.report import page as h
from appliance.bench.report.runs import md_table, normalize_format
from appliance.bench.tune import TUNED, PointStatus, SweepResult

TITLE = "Tuning sweep"
HEADERS = ["#", "Stage", *TUNED, "Status", "Output tok/s", "Req/s", "TTFT P99 (ms)", "ITL P99 (ms)",
           "Goodput (req/s)", "Within SLO", "Meets SLO", "Pareto", "Run id"]


def summary_lines(result: SweepResult) -> list[str]:
    """The sweep's outcome in plain words."""
    ok = sum(p.status is PointStatus.OK for p in result.points)
    skipped = [p for p in result.points if p.status is PointStatus.SKIPPED]
    lines = [f"{len(result.points)} grid points: {ok} measured, {len(skipped)} skipped as invalid, "
             f"{len(result.points) - ok - len(skipped)} failed. SLO: {result.slo} for at least "
             f"{result.attainment:.0%} of the requests."]
    rec = result.recommendation
    if rec is not None:
        lines.append(f"Recommended: {rec.label} - goodput {rec.goodput or 0:.2f} req/s, "
                     f"{rec.output_throughput or 0:.1f} output tok/s, {(rec.attainment or 0):.0%} within the SLO.")
    else:
        lines.append("No point met the SLO; nothing is recommended.")
        if result.best_goodput is not None:
            best = result.points[result.best_goodput]
            lines.append(f"Most goodput, though short of the SLO: {best.label} ({best.goodput or 0:.2f} req/s, "
                         f"{(best.attainment or 0):.0%} within the SLO).")
    if result.applied:
        lines.append("Applied on the server: " + ", ".join(f"{k}={v}" for k, v in result.applied.items()) + ".")
    else:
        lines.append("The original knobs were restored: "
                     + ", ".join(f"{k}={v}" for k, v in result.original_knobs.items()) + ".")
    return lines


PREDICTED_HEADERS = ["Point", "Output tok/s (sim / live)", "TTFT P99 ms (sim / live)", "ITL P99 ms (sim / live)",
                     "Goodput req/s (sim / live)", "Within SLO (sim / live)"]


def predicted_rows(result: SweepResult) -> list[list[str]]:
    """Predicted beside measured, for the points `appliance tune --simulate` measured live."""
    def pair(predicted: float | None, measured: float | None, scale: float = 1.0, digits: int = 1) -> str:
        cell = lambda v: "-" if v is None else f"{v * scale:.{digits}f}"  # noqa: E731
        return f"{cell(predicted)} / {cell(measured)}"

    rows = []
    for p in result.points:
        if p.predicted is None:
            continue
        sim = p.predicted
        rows.append([p.label, pair(sim["output_throughput"], p.output_throughput),
                     pair(sim["ttft_p99"], p.ttft_p99, 1000, 0), pair(sim["itl_p99"], p.itl_p99, 1000, 0),
                     pair(sim["goodput"], p.goodput, 1, 2), pair(sim["attainment"], p.attainment, 100, 0)])
    return rows


def _rows(result: SweepResult) -> list[list[str]]:
    def cell(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
        return "-" if value is None else f"{value * scale:.{digits}f}"

    rows = []
    for i, p in enumerate(result.points):
        fronts = [name for name, front in (("TTFT", result.pareto_ttft), ("ITL", result.pareto_itl)) if i in front]
        status = p.status if p.reason is None else f"{p.status}: {p.reason}"
        rows.append([str(i + 1), p.stage, *[str(p.knobs[k]) for k in TUNED], status,
                     cell(p.output_throughput), cell(p.request_throughput), cell(p.ttft_p99, 1000),
                     cell(p.itl_p99, 1000), cell(p.goodput),
                     "-" if p.attainment is None else f"{p.attainment:.0%}",
                     "-" if p.status is not PointStatus.OK else
                     ("yes" if p.meets_slo else "no") + (" (recommended)" if i == result.recommended else ""),
                     ", ".join(fronts) or "-", p.run_id or "-"])
    return rows


def render_sweep(result: SweepResult, fmt: str) -> str:
    """The sweep report as html, md, csv or json."""
    name = normalize_format(fmt)
    if name == "json":
        return json.dumps(result.as_dict(), indent=2) + "\n"
    if name == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(["index", "stage", *TUNED, "status", "reason", "output_throughput", "request_throughput",
                         "ttft_p99_s", "itl_p99_s", "goodput", "attainment", "meets_slo", "pareto_ttft",
                         "pareto_itl", "recommended", "run_id"])
        for i, p in enumerate(result.points):
            writer.writerow([i, p.stage, *[p.knobs[k] for k in TUNED], p.status, p.reason or "",
                             *["" if v is None else repr(v) for v in (p.output_throughput, p.request_throughput,
                                                                      p.ttft_p99, p.itl_p99, p.goodput, p.attainment)],
                             p.meets_slo, i in result.pareto_ttft, i in result.pareto_itl,
                             i == result.recommended, p.run_id or ""])
        return buf.getvalue()
    if name == "md":
        out = [f"# {TITLE}: {result.workload}\n", *[f"- {line}" for line in summary_lines(result)], "",
               md_table((HEADERS, _rows(result)))]
        if predicted_rows(result):
            out += ["## Predicted vs measured\n", md_table((PREDICTED_HEADERS, predicted_rows(result)))]
        runs = [p.run_id for p in result.points if p.run_id]
        if runs:
            out.append(f"Compare stored points with `appliance report {' '.join(runs[:4])} ...`.\n")
        return "\n".join(out)
    return _html(result)


def _html(result: SweepResult) -> str:
    page = h.Page(f"{TITLE}: {result.workload}")
    page.heading(1, f"{TITLE}: {result.workload}")
    page.add(h.bullet_list(summary_lines(result), "findings"))
    charts = [page.chart(pareto_figure(result, "ttft_p99", result.pareto_ttft, "P99 TTFT")),
              page.chart(pareto_figure(result, "itl_p99", result.pareto_itl, "P99 ITL"))]
    page.add(f'<div class="grid">{"".join(charts)}</div>')
    page.heading(2, "Grid points")
    page.add(h.table(HEADERS, _rows(result)))
    if predicted_rows(result):
        page.heading(2, "Predicted vs measured")
        page.add(h.table(PREDICTED_HEADERS, predicted_rows(result)))
    return page.render()


def pareto_figure(result: SweepResult, latency: str, front: list[int], label: str) -> Any:
    """Output throughput against `latency` ("ttft_p99" or "itl_p99") of every measured point,
    the points of `front` ringed and joined as the Pareto front, the recommendation starred
    (the report's charts and the dashboard's sweep chart)."""
    measured = [(i, p) for i, p in enumerate(result.points)
                if p.status is PointStatus.OK and getattr(p, latency) is not None]
    fig = go.Figure()
    fig.add_trace(go.Scatter(
        x=[getattr(p, latency) * 1000 for _, p in measured], y=[p.output_throughput for _, p in measured],
        mode="markers", name="grid points", text=[p.label for _, p in measured],
        marker={"color": ["#2ca02c" if p.meets_slo else "#d62728" for _, p in measured], "size": 9},
        hovertemplate="%{text}<br>%{x:.0f} ms, %{y:.1f} tok/s<extra></extra>"))
    ordered = sorted(front, key=lambda i: getattr(result.points[i], latency))
    fig.add_trace(go.Scatter(
        x=[getattr(result.points[i], latency) * 1000 for i in ordered],
        y=[result.points[i].output_throughput for i in ordered],
        mode="lines+markers", name="Pareto front", line={"color": "#1f77b4", "shape": "hv"},
        marker={"symbol": "circle-open", "size": 15, "line": {"width": 2}, "color": "#1f77b4"},
        text=[result.points[i].label for i in ordered],
        hovertemplate="front: %{text}<br>%{x:.0f} ms, %{y:.1f} tok/s<extra></extra>"))
    if result.recommended is not None:
        rec = result.points[result.recommended]
        if getattr(rec, latency) is not None:
            fig.add_trace(go.Scatter(x=[getattr(rec, latency) * 1000], y=[rec.output_throughput],
                                     mode="markers", name="recommended",
                                     marker={"symbol": "star", "size": 16, "color": "#ff7f0e"}))
    fig.update_layout(title=f"Output throughput vs {label} (green: meets the SLO)",
                      xaxis_title=f"{label} (ms)", yaxis_title="output tok/s")
    return fig
