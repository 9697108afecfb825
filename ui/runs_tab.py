"""Runs and reports tab: past runs with knob snapshots and figures, comparison, report export."""

from __future__ import annotations

from typing import Any

import gradio as gr
import plotly.graph_objects as go
from sqlalchemy.exc import SQLAlchemyError

from appliance.telemetry import queries, runs
from ui import charts, reports
from ui.context import DashboardContext
from ui.runs_view import TABLE_HEADERS, run_figures, run_label, table_row
from ui.slow_requests import Scope, SlowRequestsPanel

RUNS_LIMIT = 200
POLL_S = 5.0  # while the tab is shown: a run started or ended elsewhere shows within this
OVERLAY_POINTS = 200
THROUGHPUT_BARS = (("output_tok_s", "output tokens/s"),)
LATENCY_BARS = (("ttft_p50_ms", "TTFT p50"), ("ttft_p90_ms", "TTFT p90"), ("ttft_p99_ms", "TTFT p99"),
                ("itl_p50_ms", "ITL p50"), ("itl_p90_ms", "ITL p90"), ("itl_p99_ms", "ITL p99"))


def compare_figures(db: Any, run_ids: list[str]) -> tuple[go.Figure, go.Figure, go.Figure]:
    """Throughput bars, latency-percentile bars and overlaid output tokens/s of the runs."""
    throughput: dict[str, list[float | None]] = {}
    latency: dict[str, list[float | None]] = {}
    overlay: dict[str, tuple[list[float], list[float]]] = {}
    for run_id in run_ids:
        run = runs.get_run(db, run_id)
        if run is None:
            raise gr.Error(f"no run {run_id}")
        label = run_label(run)
        figures = run_figures(db, run)
        throughput[label] = [figures.get(k) for k, _ in THROUGHPUT_BARS]
        latency[label] = [figures.get(k) for k, _ in LATENCY_BARS]
        series = queries.iteration_series(db, "decode_tokens", run_id=run_id, points=OVERLAY_POINTS)
        overlay[label] = ([p.t + series.bucket_s / 2 - run["started_at"] for p in series.points],
                          [p.sum / series.bucket_s for p in series.points])
    return (
        charts.bar_figure("Throughput", "tokens/s", [label for _, label in THROUGHPUT_BARS], throughput),
        charts.bar_figure("Latency percentiles", "ms", [label for _, label in LATENCY_BARS], latency),
        charts.overlay_figure("Output tokens/s during each run", "tokens/s", overlay),
    )


class RunsTab:
    def __init__(self, ctx: DashboardContext, db: Any):
        self.ctx = ctx
        self.db = db

    def build(self) -> None:
        with gr.Row():
            self.refresh_button = gr.Button("Refresh", elem_id="runs-refresh", size="sm", scale=0)
            self.status = gr.Markdown("", elem_id="runs-status")
        self.table = gr.Dataframe(headers=TABLE_HEADERS, value=[], interactive=False,
                                  label="Past runs (newest first)", elem_id="runs-table")
        self.select = gr.CheckboxGroup([], label="Runs to compare / report", elem_id="runs-select")
        with gr.Row():
            self.compare_button = gr.Button("Compare", variant="primary", elem_id="runs-compare")
            self.format = gr.Radio(list(reports.FORMATS), value="HTML", label="Report format",
                                   elem_id="report-format")
            self.export_button = gr.Button("Export report", elem_id="report-export")
        self.report_file = gr.File(label="Tuning report", elem_id="report-file", interactive=False)
        with gr.Row():
            self.throughput_plot = gr.Plot(elem_id="runs-throughput-chart", show_label=False)
            self.latency_plot = gr.Plot(elem_id="runs-latency-chart", show_label=False)
        self.overlay_plot = gr.Plot(elem_id="runs-timeseries-chart", show_label=False)
        SlowRequestsPanel(self.ctx, self.db, "runs", self.scope).build(self.select)

        self.seen = gr.State(None)  # what the table shows: the listed runs' ids and statuses
        self.timer = gr.Timer(POLL_S, active=False)  # on while the tab is shown (ui.app)
        self.refresh_button.click(self.refresh, None, [self.table, self.select], api_name="runs_refresh")
        self.timer.tick(self.poll, [self.seen, self.select], [self.table, self.select, self.seen],
                        api_name="runs_poll", show_progress="hidden")
        self.compare_button.click(self.compare, [self.select],
                                  [self.status, self.throughput_plot, self.latency_plot, self.overlay_plot],
                                  api_name="runs_compare")
        self.export_button.click(self.export, [self.select, self.format], [self.status, self.report_file],
                                 api_name="report_export")

    @staticmethod
    def scope(run_ids: list[str] | None) -> Scope:
        """The slowest-requests scope: the first selected run."""
        if not run_ids:
            raise gr.Error("Select a run first.")
        return None, None, run_ids[0]

    @property
    def refresh_outputs(self) -> list[gr.components.Component]:
        return [self.table, self.select]

    def refresh(self, request: gr.Request) -> list[Any]:
        """The runs table and the choices of the selector (keeping nothing selected)."""
        self.ctx.check(request)
        try:
            stored = runs.list_runs(self.db, limit=RUNS_LIMIT)
            rows = [table_row(self.db, run) for run in stored]
        except SQLAlchemyError as exc:
            gr.Warning(f"telemetry store unavailable: {type(exc).__name__}")
            return [gr.update(), gr.update()]
        return [rows, gr.update(choices=[(run_label(r), r["id"]) for r in stored])]

    def poll(self, seen: str | None, selected: list[str] | None, request: gr.Request) -> list[Any]:
        """The table again only when a run was added or changed status since `seen` (the
        operator's selection is kept); otherwise nothing is sent."""
        self.ctx.check(request)
        try:
            stored = runs.list_runs(self.db, limit=RUNS_LIMIT)
        except SQLAlchemyError:
            return [gr.skip(), gr.skip(), gr.skip()]
        signature = ",".join(f"{r['id']}:{r['status']}" for r in stored)
        if signature == seen:
            return [gr.skip(), gr.skip(), gr.skip()]
        try:
            rows = [table_row(self.db, run) for run in stored]
        except SQLAlchemyError:
            return [gr.skip(), gr.skip(), gr.skip()]
        ids = {r["id"] for r in stored}
        keep = [run_id for run_id in selected or [] if run_id in ids]
        return [rows, gr.update(choices=[(run_label(r), r["id"]) for r in stored], value=keep), signature]

    def compare(self, run_ids: list[str], request: gr.Request) -> list[Any]:
        self.ctx.check(request)
        run_ids = list(run_ids or [])
        if len(run_ids) < 2:
            return ["Pick two or more runs to compare.", gr.update(), gr.update(), gr.update()]
        return [f"Comparing {len(run_ids)} runs.", *compare_figures(self.db, run_ids)]

    def export(self, run_ids: list[str], fmt: str, request: gr.Request) -> list[Any]:
        self.ctx.check(request)
        try:
            path = reports.export(self.ctx.db_url, list(run_ids or []), fmt)
        except (ValueError, LookupError) as exc:
            return [f"**Error:** {exc}", None]
        return [f"Report written: {path.name} ({len(run_ids)} runs).", str(path)]
