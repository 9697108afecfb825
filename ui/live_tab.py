"""Live tab: charts over a chosen window refreshed about once a second, and headline numbers.

Series come from appliance.telemetry.queries (iteration rows, request latencies, knob
timeline); the headline's current state from GET /admin/state and /admin/knobs.
"""

from __future__ import annotations

import html
import time
from dataclasses import dataclass
from typing import Any

import gradio as gr
import plotly.graph_objects as go
from plotly.subplots import make_subplots
from sqlalchemy.exc import SQLAlchemyError

from appliance.telemetry import queries, runs
from appliance.telemetry.queries import LatencyPoint, Series
from ui import charts
from ui.api_client import ApiError
from ui.context import DashboardContext
from ui.knobs_panel import effective_markdown

REFRESH_S = 1.0
WINDOWS = {"1m": 60.0, "5m": 300.0, "1h": 3600.0}
WINDOW_CHOICES = [("1 min", "1m"), ("5 min", "5m"), ("1 h", "1h")]
RUN_PREFIX = "run:"
SERIES_POINTS = {"1m": 120, "5m": 300, "1h": 360}
RUN_POINTS = 300
LATENCY_POINTS = 30
RATE_WINDOW_S = 5.0  # the headline's tokens/s is measured over the last few seconds
CHART_IDS = ("chart-running", "chart-waiting", "chart-kv", "chart-tokens", "chart-step-time",
             "chart-throughput", "chart-ttft", "chart-itl")
# Iteration columns the charts read. Output tokens/s counts decode tokens (one output token each);
# the first token of a reply, produced by its last prefill chunk, is not in the iteration rows.
SERIES = ("running", "max_num_seqs", "waiting", "kv_blocks_used", "kv_blocks_total", "prefill_tokens",
          "decode_tokens", "padding_tokens", "token_budget", "duration_s", "preemptions")


@dataclass
class Window:
    since: float
    until: float
    run_id: str | None
    label: str


@dataclass
class LiveData:
    window: Window
    series: dict[str, Series]
    ttft: list[LatencyPoint]
    itl: list[LatencyPoint]
    changes: list[dict[str, Any]]


def resolve_window(db: Any, choice: str | None, now: float | None = None) -> Window:
    """A window choice ("1m", "5m", "1h" or "run:<id>") as times."""
    now = time.time() if now is None else now
    choice = choice or "1m"
    if choice.startswith(RUN_PREFIX):
        run_id = choice[len(RUN_PREFIX):]
        run = runs.get_run(db, run_id)
        if run is None:
            raise gr.Error(f"no run {run_id}")
        until = run["ended_at"] or now
        return Window(run["started_at"], max(until, run["started_at"] + 1.0), run_id,
                      f"run {run['name']}")
    if choice not in WINDOWS:
        raise gr.Error(f"unknown window {choice!r}")
    return Window(now - WINDOWS[choice], now, None, dict((v, k) for k, v in WINDOW_CHOICES)[choice])


def window_choices(db: Any, limit: int = 20) -> list[tuple[str, str]]:
    """The fixed windows, then the newest runs."""
    recent = runs.list_runs(db, limit=limit)
    return WINDOW_CHOICES + [(f"run: {r['name']} ({r['id'][:8]})", RUN_PREFIX + r["id"]) for r in recent]


def fetch(db: Any, window: Window, choice: str) -> LiveData:
    points = RUN_POINTS if window.run_id else SERIES_POINTS.get(choice, 300)
    series = {
        column: queries.iteration_series(db, column, window.since, window.until, points=points)
        for column in SERIES
    }
    latency = {
        metric: queries.latency_series(db, metric, window.since, window.until, run_id=window.run_id,
                                       points=LATENCY_POINTS)
        for metric in ("ttft", "itl")
    }
    changes = queries.knob_timeline(db, window.since, window.until)
    return LiveData(window, series, latency["ttft"], latency["itl"], changes)


def _xy(s: Series, stat: str, scale: float = 1.0, gaps: bool = True) -> tuple[list[float], list[float | None]]:
    """Bucket midpoints and `stat` x `scale`. With `gaps`, a stretch without iterations (an idle
    engine) breaks the line instead of being bridged; knob values (gaps=False) hold across it."""
    xs: list[float] = []
    ys: list[float | None] = []
    previous = None
    for p in s.points:
        if gaps and previous is not None and p.t - previous > 1.5 * s.bucket_s:
            xs.append(previous + s.bucket_s)
            ys.append(None)
        xs.append(p.t + s.bucket_s / 2)
        ys.append(getattr(p, stat) * scale)
        previous = p.t
    return xs, ys


def build_figures(data: LiveData) -> list[go.Figure]:
    """The Live tab's charts, in CHART_IDS order."""
    w, s = data.window, data.series
    figs = []

    def new(title: str, ytitle: str) -> go.Figure:
        return charts.time_figure(f"{title} — {w.label}", ytitle, w.since, w.until)

    fig = new("Running vs max_num_seqs", "sequences")
    charts.line(fig, *_xy(s["running"], "mean"), "running (mean)", charts.COLORS[0])
    charts.line(fig, *_xy(s["running"], "max"), "running (max)", charts.COLORS[0], dash="dot", width=1)
    charts.line(fig, *_xy(s["max_num_seqs"], "max", gaps=False), "max_num_seqs", charts.COLORS[1], shape="hv")
    figs.append(fig)

    fig = new("Waiting queue depth", "requests")
    charts.line(fig, *_xy(s["waiting"], "mean"), "waiting (mean)", charts.COLORS[4], fill="tozeroy")
    charts.line(fig, *_xy(s["waiting"], "max"), "waiting (max)", charts.COLORS[4], dash="dot", width=1)
    figs.append(fig)

    figs.append(_kv_figure(data))

    fig = new("Tokens per iteration vs token budget", "tokens / iteration")
    charts.line(fig, *_xy(s["decode_tokens"], "mean"), "decode", charts.COLORS[2], stackgroup="work")
    charts.line(fig, *_xy(s["prefill_tokens"], "mean"), "prefill", charts.COLORS[3], stackgroup="work")
    if any(p.max > 0 for p in s["padding_tokens"].points):
        charts.line(fig, *_xy(s["padding_tokens"], "mean"), "padding (static)", "#9ca3af", stackgroup="work")
    charts.line(fig, *_xy(s["token_budget"], "max", gaps=False), "max_num_batched_tokens", charts.COLORS[1],
                shape="hv")
    figs.append(fig)

    fig = new("Step time", "ms")
    charts.line(fig, *_xy(s["duration_s"], "mean", 1000), "mean", charts.COLORS[5])
    charts.line(fig, *_xy(s["duration_s"], "max", 1000), "max", charts.COLORS[5], dash="dot", width=1)
    figs.append(fig)

    fig = new("Output tokens/s", "tokens/s")
    dec = s["decode_tokens"]
    charts.line(fig, *_xy(dec, "sum", 1 / dec.bucket_s), "output tokens/s", charts.COLORS[2], fill="tozeroy")
    figs.append(fig)

    for title, points in (("TTFT percentiles", data.ttft), ("Inter-token latency percentiles", data.itl)):
        fig = new(title, "ms")
        times = [p.t for p in points]
        for i, q in enumerate(("p50", "p90", "p99")):
            charts.line(fig, times, [p.quantiles[q] * 1000 for p in points], q, charts.COLORS[i],
                        markers=True)
        figs.append(fig)

    for fig, has_data in zip(figs, _has_data(data)):
        charts.mark_knob_changes(fig, data.changes)
        if not has_data:
            charts.empty_note(fig)
    return figs


def _has_data(data: LiveData) -> list[bool]:
    iterations = bool(data.series["running"].points)
    return [iterations] * 6 + [bool(data.ttft), bool(data.itl)]


def _kv_figure(data: LiveData) -> go.Figure:
    w, used, total = data.window, data.series["kv_blocks_used"], data.series["kv_blocks_total"]
    blocks = max((p.max for p in total.points), default=0.0)
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.update_layout(charts.layout(f"KV block usage — {w.label}", xaxis={
        "range": [charts.when(w.since), charts.when(w.until)], "type": "date"}))
    times, pct = _xy(used, "mean", 100 / blocks if blocks else 0.0)
    times = [charts.when(t) for t in times]
    fig.add_trace(go.Scatter(x=times, y=pct, name="used % (mean)", mode="lines", fill="tozeroy",
                             line=dict(color=charts.COLORS[3], width=2)), secondary_y=False)
    fig.add_trace(go.Scatter(x=times, y=_xy(used, "max")[1], name="blocks used (max)", mode="lines",
                             line=dict(color=charts.COLORS[3], width=1, dash="dot")), secondary_y=True)
    fig.update_yaxes(title_text="% of KV blocks", range=[0, 100], secondary_y=False)
    fig.update_yaxes(title_text=f"blocks (of {int(blocks)})", range=[0, blocks or 1], secondary_y=True,
                     showgrid=False)
    return fig


# ---------------------------------------------------------------------------------- headline


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h {m:02d}m" if h else f"{m}m {s:02d}s"


def headline_html(state: dict[str, Any] | None, knobs: dict[str, Any] | None, tokens_per_s: float,
                  preemptions: int, error: str | None = None) -> str:
    """The row of headline numbers (each in a [data-stat] cell)."""
    state, knobs = state or {}, knobs or {}
    k = knobs.get("knobs", {})
    used, total = state.get("kv_blocks_used"), state.get("kv_blocks_total")
    kv = f"{used / total * 100:.1f}% ({used}/{total})" if used is not None and total else "—"
    cells = [
        ("running", "running / waiting",
         f"{state.get('running', '—')} / {state.get('waiting', '—')}"
         + (f" (max {k['max_num_seqs']})" if "max_num_seqs" in k else "")),
        ("tokens_per_s", "output tokens/s", f"{tokens_per_s:.1f}"),
        ("kv", "KV usage", kv),
        ("preemptions", "preemptions (window)", str(preemptions)),
        ("drops", "telemetry drops", str(state.get("telemetry_rows_dropped", "—"))),
        ("uptime", "uptime", _duration(state["uptime_s"]) if "uptime_s" in state else "—"),
        ("model", "model", str(state.get("model", "—"))),
        ("device", "device", str(state.get("device", "—"))),
        ("policy", "policy", str(k.get("scheduling_policy", "—"))),
    ]
    body = "".join(
        f'<div class="stat" data-stat="{key}" style="padding:6px 12px;border:1px solid #e5e7eb;'
        f'border-radius:6px;min-width:110px"><div style="font-size:11px;color:#6b7280">{html.escape(label)}'
        f'</div><div class="value" style="font-size:18px;font-weight:600">{html.escape(value)}</div></div>'
        for key, label, value in cells
    )
    warning = f'<div style="color:#b91c1c">{html.escape(error)}</div>' if error else ""
    return f'{warning}<div style="display:flex;flex-wrap:wrap;gap:8px">{body}</div>'


class LiveTab:
    def __init__(self, ctx: DashboardContext, db: Any):
        self.ctx = ctx
        self.db = db

    def build(self) -> None:
        with gr.Row():
            self.window = gr.Dropdown(WINDOW_CHOICES, value="1m", label="Window", elem_id="live-window",
                                      scale=1)
            self.paused = gr.Checkbox(False, label="Pause updates", elem_id="live-pause", scale=0)
        self.headline = gr.HTML("", elem_id="live-headline")
        self.plots = []
        for i in range(0, len(CHART_IDS), 2):
            with gr.Row():
                for chart_id in CHART_IDS[i:i + 2]:
                    self.plots.append(gr.Plot(elem_id=chart_id, show_label=False))
        self.timer = gr.Timer(REFRESH_S)

    def wire(self, effective: gr.Markdown) -> None:
        """Refresh on every tick and window change; `effective` is the knobs panel's view."""
        outputs = [self.headline, *self.plots, effective]
        self.timer.tick(self.refresh, [self.window, self.paused], outputs, api_name="live_refresh",
                        show_progress="hidden", concurrency_limit=4, trigger_mode="always_last")
        self.window.change(self.refresh, [self.window, self.paused], outputs, api_name="live_window",
                           show_progress="hidden")

    def refresh(self, choice: str, paused: bool, request: gr.Request) -> list[Any]:
        """Headline HTML, the charts and the knobs in force."""
        self.ctx.check(request)
        if paused:
            return [gr.update()] * (len(CHART_IDS) + 2)
        state = knobs = None
        error = None
        try:
            state, knobs = self.ctx.api.state(), self.ctx.api.knobs()
        except ApiError as exc:
            error = exc.message
        effective = effective_markdown(knobs) if knobs else gr.update()
        try:
            window = resolve_window(self.db, choice)
            data = fetch(self.db, window, choice)
            now = time.time()
            recent = queries.iteration_series(self.db, "decode_tokens", now - RATE_WINDOW_S, now, points=1)
        except SQLAlchemyError as exc:
            error = f"telemetry store unavailable: {type(exc).__name__}: {str(exc).splitlines()[0]}"
            return [headline_html(state, knobs, 0.0, 0, error), *[gr.update()] * len(CHART_IDS), effective]
        tokens_per_s = sum(p.sum for p in recent.points) / RATE_WINDOW_S
        preemptions = int(sum(p.sum for p in data.series["preemptions"].points))
        return [headline_html(state, knobs, tokens_per_s, preemptions, error), *build_figures(data), effective]

    def choices(self) -> Any:
        try:
            return gr.update(choices=window_choices(self.db))
        except SQLAlchemyError:
            return gr.update(choices=WINDOW_CHOICES)
