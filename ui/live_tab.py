"""Live tab: charts over a chosen window refreshed about once a second, and headline numbers.

Series come from appliance.telemetry.queries (iteration rows, request latencies, knob
timeline); the headline's current state from GET /admin/state and /admin/knobs.

Watching must not slow serving: the Live data is computed once per tick and window for every
session together (LiveCache: the API's state and knobs, a few bounded queries and one figure
build a second, however many dashboards are open), the figures are plain dicts serialised once,
a session is sent only the outputs that changed since its last tick, its timer slows down (up
to IDLE_REFRESH_S) while nothing changes and returns to REFRESH_S as soon as something does,
and the browser redraws each chart in place (ui.live_plot).
"""

from __future__ import annotations

import html
import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gradio as gr
import plotly.graph_objects as go
from sqlalchemy.exc import SQLAlchemyError

from appliance.records import HoldCause
from appliance.telemetry import fleet_sizes, queries, runs
from appliance.telemetry.queries import HeldTime, LatencyPoint, Series
from ui import charts, holding
from ui.api_client import ApiError
from ui.context import DashboardContext
from ui.holding_forecast import Forecasts, Source
from ui.knobs_panel import effective_markdown
from ui.live_plot import LivePlot, PlotPayload
from ui.slow_requests import Scope, SlowRequestsPanel

REFRESH_S = 1.0
IDLE_REFRESH_S = 4.0  # the slowest a session's refresh gets while nothing changes
WINDOWS = {"1m": 60.0, "5m": 300.0, "1h": 3600.0}
WINDOW_CHOICES = [("1 min", "1m"), ("5 min", "5m"), ("1 h", "1h")]
RUN_PREFIX = "run:"
FLEET_CHOICE = ("fleet (all replicas)", "")  # the replica selector's "every replica together"
SERIES_POINTS = {"1m": 120, "5m": 300, "1h": 360}
RUN_POINTS = 300
LATENCY_POINTS = 30
HELD_POINTS = 60  # buckets of the "what is holding traffic back" chart
RATE_WINDOW_S = 5.0  # the headline's tokens/s is measured over the last few seconds


@dataclass(frozen=True)
class LiveChart:
    """One Live chart: its plot's element id and the iteration series (rolled-up metrics of
    appliance.records) it reads. figure_specs draws them in this order."""

    id: str
    series: tuple[str, ...] = ()


# Output tokens/s counts decode tokens (one output token each); the first token of a reply,
# produced by its last prefill chunk, is not in the iteration rows.
CHARTS = (
    LiveChart("chart-running", ("running", "max_num_seqs")),
    LiveChart("chart-waiting", ("waiting",)),
    LiveChart("chart-kv", ("kv_blocks_used", "kv_blocks_cached_free", "kv_blocks_free", "kv_blocks_total")),
    LiveChart("chart-tokens", ("decode_tokens", "prefill_tokens", "padding_tokens", "token_budget")),
    LiveChart("chart-step-time", ("duration_s",)),
    LiveChart("chart-throughput", ("decode_tokens",)),
    LiveChart("chart-ttft"),  # request latencies, not iteration series
    LiveChart("chart-itl"),
    LiveChart("chart-held"),  # queued request-time by cause (queries.held_time)
    LiveChart("chart-prefix-cache", ("prefix_cache_hits", "prefix_cache_queries")),
)
CHART_IDS = tuple(chart.id for chart in CHARTS)
HEADLINE_SERIES = ("preemptions",)  # the headline's preemption count over the window
REPLICA_SERIES = ("running", "decode_tokens")  # drawn per replica (one colour each) in a fleet's view
REPLICA_COLORS = charts.COLORS[5:] + charts.COLORS[:5]  # replica i's colour, after the fleet total's
# Every iteration column the tab reads, fetched in one query per tick.
SERIES = tuple(dict.fromkeys([*(name for chart in CHARTS for name in chart.series), *HEADLINE_SERIES]))


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
    held: HeldTime
    by_replica: dict[str, dict[str, Series]] = field(default_factory=dict)  # REPLICA_SERIES; a fleet's view only
    fleet_sizes: dict[str, list[tuple[float, int]]] = field(default_factory=dict)  # live replicas; a fleet's view

    def kv_peak(self) -> float | None:
        """The highest KV usage in the window (0..1), None without iterations."""
        used, total = self.series["kv_blocks_used"].points, self.series["kv_blocks_total"].points
        blocks = max((p.max for p in total), default=0.0)
        return max(p.max for p in used) / blocks if used and blocks else None

    def where(self) -> str:
        """The window as the reading names it ("run smoke", "the last 5 min")."""
        return self.window.label if self.window.run_id else f"the last {self.window.label}"

    def forecast_source(self) -> Source:
        """What the what-if replays for the reading's forecast: the run, or the window's minutes."""
        if self.window.run_id:
            return Source(self.where(), run_id=self.window.run_id)
        return Source(self.where(), minutes=(self.window.until - self.window.since) / 60)

    def raise_to_try(self, knobs: dict[str, Any]) -> dict[str, int] | None:
        """holding.raise_to_try of this window, with the knobs in force; None when the knobs
        changed in it (the what-if replays a window at the knobs it started with, which then
        are not the ones a raise would start from)."""
        return None if self.changes else holding.raise_to_try(self.held.totals, knobs, self.kv_peak())

    def holding_reading(self, knobs: dict[str, Any], forecast: str | None = None) -> str:
        """holding.reading of this window, with the knobs in force (and the what-if's `forecast`)."""
        preemptions = int(sum(p.sum for p in self.series["preemptions"].points))
        return holding.reading(self.held.totals, self.where(), knobs, self.kv_peak(), preemptions, bool(self.changes),
                               forecast)


def resolve_window(db: Any, choice: str | None, now: float | None = None) -> Window:
    """A window choice ("1m", "5m", "1h" or "run:<id>") as times. A sliding window ends at the
    next multiple of its bucket width (its span / SERIES_POINTS), so its buckets stay put from
    one tick to the next and only the newest change."""
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
    step = WINDOWS[choice] / SERIES_POINTS[choice]
    until = math.ceil(now / step) * step
    return Window(until - WINDOWS[choice], until, None, dict((v, k) for k, v in WINDOW_CHOICES)[choice])


def window_choices(db: Any, limit: int = 20) -> list[tuple[str, str]]:
    """The fixed windows, then the newest runs."""
    recent = runs.list_runs(db, limit=limit)
    return WINDOW_CHOICES + [(f"run: {r['name']} ({r['id'][:8]})", RUN_PREFIX + r["id"]) for r in recent]


def replica_choices(db: Any, window: Window) -> list[tuple[str, str]]:
    """The fleet as a whole, then each replica that ran iterations in the window."""
    return [FLEET_CHOICE] + [(f"replica {r}", r) for r in queries.replicas(db, window.since, window.until)]


def fetch(db: Any, window: Window, choice: str, replica: str | None = None) -> LiveData:
    """Every series of the Live charts over `window`: the iteration columns in ONE downsampled
    query, the latency percentiles (LATENCY_POINTS buckets) and the knob changes; of one replica
    when `replica` names one, of every replica together otherwise."""
    points = RUN_POINTS if window.run_id else SERIES_POINTS.get(choice, 300)
    series = queries.iteration_series_many(db, SERIES, window.since, window.until, replica_id=replica,
                                           points=points)
    # latency buckets on a grid of their own width, so they stay put as a window slides
    width = (window.until - window.since) / LATENCY_POINTS
    since = window.since if window.run_id else math.floor(window.since / width) * width
    latency = {
        metric: queries.latency_series(db, metric, since, since + width * (LATENCY_POINTS + 1), run_id=window.run_id,
                                       replica_id=replica, points=LATENCY_POINTS + 1)
        for metric in ("ttft", "itl")
    }
    changes = queries.knob_timeline(db, window.since, window.until, replica_id=replica)
    held = queries.held_time(db, window.since, window.until, replica_id=replica, points=HELD_POINTS)
    ids = [] if replica else queries.replicas(db, window.since, window.until)
    by_replica = {r: queries.iteration_series_many(db, REPLICA_SERIES, window.since, window.until, replica_id=r,
                                                   points=points) for r in ids} if len(ids) > 1 else {}
    # a fleet's size, while its replicas (ids "<fleet id>/<replica>") ran iterations in the window:
    # a store kept from an earlier fleet keeps that fleet's last size, which no longer says anything
    sizes = {fleet: points for fleet, points in fleet_sizes.series_by_fleet(db, window.since, window.until).items()
             if any(r.startswith(f"{fleet}/") for r in ids)} if ids else {}
    return LiveData(window, series, latency["ttft"], latency["itl"], changes, held, by_replica, sizes)


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


class _Stamps:
    """Epoch seconds as plotly date strings, each formatted once per figure build."""

    def __init__(self) -> None:
        self._cache: dict[float, str] = {}

    def __call__(self, times: list[float]) -> list[str]:
        cache = self._cache
        out = []
        for t in times:
            text = cache.get(t)
            if text is None:
                text = cache[t] = charts.stamp(t)
            out.append(text)
        return out


def _round(values: list[float | None]) -> list[float | None]:
    """4 decimals are plenty for a chart and keep the JSON small (and no NaN reaches it)."""
    return [round(v, 4) if v is not None and math.isfinite(v) else None for v in values]


def figure_specs(data: LiveData) -> list[dict[str, Any]]:
    """The Live tab's charts as plain plotly JSON dicts (data + layout), in CHART_IDS order.

    Built without plotly's Python objects: they are rebuilt every tick beside the engine, and
    validating and serialising graph objects cost ~20x more than these dicts and json.dumps."""
    w, s = data.window, data.series
    stamps = _Stamps()
    x_range = [charts.stamp(w.since), charts.stamp(w.until)]
    shapes, annotations = charts.knob_marks(data.changes)

    def figure(title: str, ytitle: str, traces: list[dict[str, Any]], has_data: bool,
               **axes: Any) -> dict[str, Any]:
        layout = charts.layout(f"{title} — {w.label}", ytitle, xaxis={"range": x_range, "type": "date"},
                               yaxis={"rangemode": "tozero", **axes.pop("yaxis", {})}, **axes)
        layout["shapes"] = shapes
        layout["annotations"] = annotations + ([charts.note(NO_DATA)] if not has_data else [])
        return {"data": traces, "layout": layout}

    def line(xy: tuple[list[float], list[float | None]], name: str, color: str, **style: Any) -> dict[str, Any]:
        return charts.trace(stamps(xy[0]), _round(xy[1]), name, color, **style)

    iterations = bool(s["running"].points)
    replicas = sorted(data.by_replica)

    def per_replica(column: str, stat: str, scale: Callable[[Series], float] = lambda _: 1.0) -> list[dict[str, Any]]:
        return [line(_xy(data.by_replica[r][column], stat, scale(data.by_replica[r][column])), f"replica {r}",
                     REPLICA_COLORS[i % len(REPLICA_COLORS)], width=1.5) for i, r in enumerate(replicas)]

    if replicas:  # a fleet: each replica's running sequences and the fleet's total
        running = [line(_fleet_total(data.by_replica, "running"), "fleet total (mean)", charts.COLORS[0]),
                   *per_replica("running", "mean")]
    else:
        running = [line(_xy(s["running"], "mean"), "running (mean)", charts.COLORS[0]),
                   line(_xy(s["running"], "max"), "running (max)", charts.COLORS[0], dash="dot", width=1)]
    sizes = [line(_steps(points, w.until), f"replicas live ({fleet})" if len(data.fleet_sizes) > 1 else "replicas live",
                  "#6b7280", shape="hv", dash="dash", width=1.5) for fleet, points in data.fleet_sizes.items()]
    for trace in sizes:
        trace["yaxis"] = "y2"
    most_replicas = max((n for points in data.fleet_sizes.values() for _, n in points), default=0)
    replica_axis = {"yaxis2": {"title": {"text": "replicas"}, "range": [0, most_replicas + 1], "overlaying": "y",
                               "side": "right", "showgrid": False, "zeroline": False, "dtick": 1},
                    "margin": {**charts.LAYOUT["margin"], "r": 60}} if sizes else {}
    figs = [
        figure("Running vs max_num_seqs", "sequences", [
            *running,
            line(_xy(s["max_num_seqs"], "max", gaps=False), "max_num_seqs", charts.COLORS[1], shape="hv"),
            *sizes,
        ], iterations or bool(sizes), **replica_axis),
        figure("Waiting queue depth", "requests", [
            line(_xy(s["waiting"], "mean"), "waiting (mean)", charts.COLORS[4], fill="tozeroy"),
            line(_xy(s["waiting"], "max"), "waiting (max)", charts.COLORS[4], dash="dot", width=1),
        ], iterations),
    ]

    used, total = s["kv_blocks_used"], s["kv_blocks_total"]
    blocks = max((p.max for p in total.points), default=0.0)
    scale = 100 / blocks if blocks else 0.0
    cached_xy = _xy(s["kv_blocks_cached_free"], "mean", scale)
    free_x, free_y = _xy(s["kv_blocks_free"], "mean", scale)
    plain_free = (free_x, [None if f is None or c is None else f - c for f, c in zip(free_y, cached_xy[1])])
    kv = [line(_xy(used, "mean", scale), "used % (mean)", charts.COLORS[3], stackgroup="kv"),
          line(cached_xy, "cached free % (mean)", charts.COLORS[2], stackgroup="kv"),
          line(plain_free, "free % (mean)", "#d1d5db", stackgroup="kv")]
    most = line(_xy(used, "max"), "blocks used (max)", charts.COLORS[3], dash="dot", width=1)
    most["yaxis"] = "y2"
    figs.append(figure("KV blocks: used / cached free / free", "% of KV blocks", [*kv, most], iterations,
                       yaxis={"range": [0, 100], "rangemode": "normal"},
                       yaxis2={"title": {"text": f"blocks (of {int(blocks)})" if blocks else "blocks"}, "range": [0, blocks or 1],
                               "overlaying": "y", "side": "right", "showgrid": False, "zeroline": False, "tickmode": "auto"},
                       margin={**charts.LAYOUT["margin"], "r": 60}))

    work = [line(_xy(s["decode_tokens"], "mean"), "decode", charts.COLORS[2], stackgroup="work"),
            line(_xy(s["prefill_tokens"], "mean"), "prefill", charts.COLORS[3], stackgroup="work")]
    if any(p.max > 0 for p in s["padding_tokens"].points):
        work.append(line(_xy(s["padding_tokens"], "mean"), "padding (static)", "#9ca3af", stackgroup="work"))
    work.append(line(_xy(s["token_budget"], "max", gaps=False), "max_num_batched_tokens", charts.COLORS[1],
                     shape="hv"))
    figs.append(figure("Tokens per iteration vs token budget", "tokens / iteration", work, iterations))

    figs.append(figure("Step time", "ms", [
        line(_xy(s["duration_s"], "mean", 1000), "mean", charts.COLORS[5]),
        line(_xy(s["duration_s"], "max", 1000), "max", charts.COLORS[5], dash="dot", width=1),
    ], iterations))

    dec = s["decode_tokens"]
    figs.append(figure("Output tokens/s", "tokens/s", [
        line(_xy(dec, "sum", 1 / dec.bucket_s), "fleet total" if replicas else "output tokens/s", charts.COLORS[2],
             fill="tozeroy"),
        *per_replica("decode_tokens", "sum", lambda series: 1 / series.bucket_s),
    ], iterations))

    for title, points in (("TTFT percentiles", data.ttft), ("Inter-token latency percentiles", data.itl)):
        times = [p.t for p in points]
        figs.append(figure(title, "ms", [
            line((times, [p.quantiles[q] * 1000 for p in points]), q, charts.COLORS[i], markers=True)
            for i, q in enumerate(("p50", "p90", "p99"))
        ], bool(points)))

    times, by_cause = holding.stacked(data.held)
    traces = [line((times, by_cause[cause]), holding.LABELS[cause], charts.COLORS[i], stackgroup="held")
              for i, cause in enumerate(HoldCause)]
    traces[0]["groupnorm"] = "percent"
    figs.append(figure("What is holding traffic back", "% of queued request-time", traces, bool(times),
                       yaxis={"range": [0, 100], "rangemode": "normal"}))
    figs.append(figure("Prefix cache hit rate", "% of looked-up prompt tokens", [
        line(hit_rate(s["prefix_cache_hits"], s["prefix_cache_queries"]), "hit rate", charts.COLORS[2], markers=True),
    ], any(p.sum > 0 for p in s["prefix_cache_queries"].points), yaxis={"range": [0, 100], "rangemode": "normal"}))
    return figs


NO_DATA = "no data in this window"


def _fleet_total(by_replica: dict[str, dict[str, Series]], column: str) -> tuple[list[float], list[float | None]]:
    """Per bucket, the sum over replicas of each one's mean `column` (a replica without
    iterations in a bucket adds nothing): e.g. the fleet's running sequences."""
    totals: dict[float, float] = {}
    for series in by_replica.values():
        for p in series[column].points:
            totals[p.t] = totals.get(p.t, 0.0) + p.mean
    bucket = next(iter(by_replica.values()))[column].bucket_s  # one grid: fetched over the same window
    times = sorted(totals)
    return [t + bucket / 2 for t in times], [totals[t] for t in times]


def _steps(points: list[tuple[float, int]], until: float) -> tuple[list[float], list[float | None]]:
    """A step function's change points, held to `until` (drawn with shape "hv")."""
    return [t for t, _ in points] + [until], [float(n) for _, n in points] + [float(points[-1][1])]


def hit_rate(hits: Series, queries: Series) -> tuple[list[float], list[float | None]]:
    """Per bucket, the % of prompt tokens looked up at admission that were served from the prefix
    cache; buckets where nothing was admitted are left out."""
    by_time = {p.t: p.sum for p in hits.points}
    xs, ys = [], []
    for p in queries.points:
        if p.sum > 0:
            xs.append(p.t + queries.bucket_s / 2)
            ys.append(100 * by_time.get(p.t, 0.0) / p.sum)
    return xs, ys


def build_figures(data: LiveData) -> list[go.Figure]:
    """`figure_specs` as plotly Figures (for callers that want graph objects; validated)."""
    return [go.Figure(spec) for spec in figure_specs(data)]


def plot_data(spec: dict[str, Any]) -> PlotPayload:
    """A figure as gr.Plot's payload, serialised once."""
    return PlotPayload(json.dumps(spec, separators=(",", ":"), allow_nan=False))


# ---------------------------------------------------------------------------------- headline


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h {m:02d}m" if h else f"{m}m {s:02d}s"


def headline_html(state: dict[str, Any] | None, knobs: dict[str, Any] | None, tokens_per_s: float,
                  preemptions: int, error: str | None = None, reading: str | None = None) -> str:
    """The row of headline numbers (each in a [data-stat] cell), then `reading` (what is holding
    traffic back) on a line of its own."""
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
        ("autopilot", "autopilot", str(state.get("autopilot", "—"))),
    ]
    body = "".join(
        f'<div class="stat" data-stat="{key}" style="padding:6px 12px;border:1px solid #e5e7eb;'
        f'border-radius:6px;min-width:110px"><div style="font-size:11px;color:#6b7280">{html.escape(label)}'
        f'</div><div class="value" style="font-size:18px;font-weight:600">{html.escape(value)}</div></div>'
        for key, label, value in cells
    )
    warning = f'<div style="color:#b91c1c">{html.escape(error)}</div>' if error else ""
    line = (f'<div data-stat="holding" style="margin-top:6px;font-size:13px">{html.escape(reading)}</div>'
            if reading else "")
    return f'{warning}<div style="display:flex;flex-wrap:wrap;gap:8px">{body}</div>{line}'


@dataclass(frozen=True)
class Snapshot:
    """The Live tab's outputs for one window choice at one tick, shared by every session."""

    headline: str
    plots: tuple[PlotPayload | None, ...]  # None where the store was unavailable (the charts keep theirs)
    effective: str | None  # None: the knobs could not be read
    activity: tuple[Any, ...]  # changes whenever new telemetry or engine state arrived

    def outputs(self) -> list[Any]:
        """[headline, *plots, effective] as the Live tab's handlers return them."""
        plots = [gr.update() if p is None else p for p in self.plots]
        return [self.headline, *plots, gr.update() if self.effective is None else self.effective]

    def digests(self) -> tuple[Any, ...]:
        """What each output holds, to tell a session's unchanged outputs from changed ones."""
        return (self.headline, *[None if p is None else p.plot for p in self.plots], self.effective)


View = tuple[str, str]  # (window choice, replica id or "" for the fleet)


class LiveCache:
    """One computation per view (window choice and replica) and tick, however many sessions refresh.

    `get(view)` returns the snapshot of the current tick (floor(now / tick_s)); the first
    session to ask in a tick builds it (the telemetry queries, the figures serialised once, the
    state and knobs read from the API) while the others wait for it and share it. `builds`
    counts the snapshots built."""

    def __init__(self, build: Callable[[View, float], Snapshot], tick_s: float = REFRESH_S,
                 clock: Callable[[], float] = time.time, keep: int = 8):
        self._build = build
        self._tick_s = tick_s
        self._clock = clock
        self._keep = keep
        self._lock = threading.Lock()
        self._snapshots: dict[View, tuple[int, Snapshot]] = {}  # view: (tick, snapshot), oldest first
        self.builds = 0

    def get(self, view: View) -> Snapshot:
        with self._lock:
            now = self._clock()
            tick = math.floor(now / self._tick_s)
            cached = self._snapshots.get(view)
            if cached is not None and cached[0] == tick:
                return cached[1]
            snapshot = self._build(view, now)
            self.builds += 1
            self._snapshots.pop(view, None)
            self._snapshots[view] = (tick, snapshot)
            while len(self._snapshots) > self._keep:
                self._snapshots.pop(next(iter(self._snapshots)))
            return snapshot


def next_interval(previous: float, changed: bool) -> float:
    """The refresh interval after a tick: REFRESH_S while data changes, doubling up to
    IDLE_REFRESH_S while nothing does (an idle engine, a finished run, a paused view)."""
    return REFRESH_S if changed else min(previous * 2, IDLE_REFRESH_S)


class LiveTab:
    def __init__(self, ctx: DashboardContext, db: Any, clock: Callable[[], float] = time.time):
        self.ctx = ctx
        self.db = db
        self.cache = LiveCache(self.snapshot, clock=clock)
        self.forecasts = Forecasts(ctx.api.simulate)
        self.clock = clock
        self.slow = SlowRequestsPanel(ctx, db, "live", self.scope)

    def build(self) -> None:
        with gr.Row():
            self.window = gr.Dropdown(WINDOW_CHOICES, value="1m", label="Window", elem_id="live-window",
                                      scale=1)
            self.replica = gr.Dropdown([FLEET_CHOICE], value="", label="Replica", elem_id="live-replica", scale=1,
                                       info="a fleet's replicas (appliance serve --replicas N)")
            self.paused = gr.Checkbox(False, label="Pause updates", elem_id="live-pause", scale=0)
        self.headline = gr.HTML("", elem_id="live-headline")
        self.plots = []
        for i in range(0, len(CHART_IDS), 2):
            with gr.Row():
                for chart_id in CHART_IDS[i:i + 2]:
                    self.plots.append(LivePlot(chart_id))
        self.slow.build(self.window)
        self.timer = gr.Timer(REFRESH_S)
        self.seen = gr.State(None)  # per session: what its page shows, and its refresh interval

    def wire(self, effective: gr.Markdown) -> None:
        """Refresh on every tick and window change; `effective` is the knobs panel's view.

        The timer's tick (`live_tick`) sends a session only the outputs that changed since its
        last tick and stretches its own interval while nothing changes; `live_refresh` (a window
        change, and the API) sends everything."""
        outputs = [self.headline, *self.plots, effective]
        self.timer.tick(self.tick, [self.window, self.paused, self.seen, self.replica],
                        [*outputs, self.seen, self.timer], api_name="live_tick", show_progress="hidden",
                        concurrency_limit=4, trigger_mode="always_last")
        self.window.change(self.refresh, [self.window, self.paused, self.replica], outputs, api_name="live_refresh",
                           show_progress="hidden")
        self.replica.change(self.refresh, [self.window, self.paused, self.replica], outputs,
                            api_name="live_replica", show_progress="hidden")
        self.replica.focus(self.replicas, [self.window, self.replica], self.replica, api_name="live_replicas",
                           show_progress="hidden")

    def scope(self, choice: str | None) -> Scope:
        """The slowest-requests scope of a window choice."""
        window = resolve_window(self.db, choice, self.clock())
        return window.since, window.until, window.run_id

    def replicas(self, choice: str | None, replica: str | None, request: gr.Request) -> Any:
        """The replica selector's choices over the window (read when the operator opens it)."""
        self.ctx.check(request)
        try:
            options = replica_choices(self.db, resolve_window(self.db, choice, self.clock()))
        except SQLAlchemyError:
            return gr.skip()
        known = {value for _, value in options}
        return gr.update(choices=options, value=replica if replica in known else "")

    def snapshot(self, view: View, now: float) -> Snapshot:
        """Build the outputs of `view` at `now` (LiveCache calls this once per tick)."""
        choice, replica = view
        state = knobs = None
        error = None
        try:
            state, knobs = self.ctx.api.state(), self.ctx.api.knobs()
        except ApiError as exc:
            error = exc.message
        effective = effective_markdown(knobs) if knobs else None
        engine = tuple((state or {}).get(k) for k in ("running", "waiting", "kv_blocks_used")) + (
            (knobs or {}).get("version"),)
        try:
            window = resolve_window(self.db, choice, now)
            data = fetch(self.db, window, choice, replica or None)
            recent = queries.iteration_series(self.db, "decode_tokens", now - RATE_WINDOW_S, now,
                                              replica_id=replica or None, points=1)
        except SQLAlchemyError as exc:
            error = f"telemetry store unavailable: {type(exc).__name__}: {str(exc).splitlines()[0]}"
            return Snapshot(headline_html(state, knobs, 0.0, 0, error), (None,) * len(CHART_IDS), effective,
                            (error, *engine))
        tokens_per_s = sum(p.sum for p in recent.points) / RATE_WINDOW_S
        preemptions = int(sum(p.sum for p in data.series["preemptions"].points))
        plots = tuple(plot_data(spec) for spec in figure_specs(data))
        newest = data.series["running"].points[-1:]
        activity = (error, *engine, *[(p.t, p.count) for p in newest], sum(p.count for p in data.ttft),
                    len(data.changes))
        in_force = (knobs or {}).get("knobs", {})
        # the what-if replays the serving replica's own traffic: not a fleet's, nor one replica of several
        one_replica = not replica and not data.by_replica
        forecast = self.forecasts.sentence(view, data.forecast_source(), data.raise_to_try(in_force) if one_replica
                                           else None, (knobs or {}).get("version"))
        reading = data.holding_reading(in_force, forecast)
        return Snapshot(headline_html(state, knobs, tokens_per_s, preemptions, error, reading), plots, effective,
                        activity)

    def refresh(self, choice: str, paused: bool, replica: str | None, request: gr.Request) -> list[Any]:
        """Headline HTML, the charts and the knobs in force (all of them)."""
        self.ctx.check(request)
        if paused:
            return [gr.update()] * (len(CHART_IDS) + 2)
        return self.cache.get((choice or "1m", replica or "")).outputs()

    def tick(self, choice: str, paused: bool, seen: dict[str, Any] | None, replica: str | None,
             request: gr.Request) -> list[Any]:
        """A timer tick: the outputs that changed since this session's last tick (gr.skip() for
        the others), its new state, and its timer's new interval when that changes."""
        self.ctx.check(request)
        seen = seen or {}
        interval = seen.get("interval", REFRESH_S)
        if paused:
            return [*[gr.skip()] * (len(CHART_IDS) + 2), seen, gr.skip()]
        view = (choice or "1m", replica or "")
        snapshot = self.cache.get(view)
        digests = snapshot.digests()
        shown = seen.get("digests") if seen.get("view") == view else None
        outputs = snapshot.outputs()
        if shown is not None:
            outputs = [gr.skip() if new == old else out for out, new, old in zip(outputs, digests, shown)]
        changed = seen.get("view") != view or seen.get("activity") != snapshot.activity
        new_interval = next_interval(interval, changed)
        state = {"view": view, "digests": digests, "activity": snapshot.activity, "interval": new_interval}
        timer = gr.Timer(value=new_interval) if new_interval != interval else gr.skip()
        return [*outputs, state, timer]

    def choices(self) -> Any:
        try:
            return gr.update(choices=window_choices(self.db))
        except SQLAlchemyError:
            return gr.update(choices=WINDOW_CHOICES)
