"""Plotly figures of the dashboard, built from plain query results (no I/O here).

Every time-series figure marks the knob changes in its window as vertical lines labelled with
what changed ("v3: max_num_seqs 64→16").
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from appliance.bench.report import page as report_page

LABELLED = 3  # knob changes per chart that show their label (older ones: the version)
LABEL_CHARS = 60
COLORS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777")
# The title takes the top line and the legend starts under it, both from the left: side by side
# they overlapped in half-width charts. The legend is placed in container pixels and grows down,
# so plotly reserves its height above the plot: a legend that wraps (narrow chart, wide font)
# pushes the plot down rather than up over the title.
TITLE_PX = 30
LAYOUT = dict(
    height=260,
    margin=dict(l=55, r=20, t=58, b=35),
    legend=dict(orientation="h", yref="container", yanchor="top", xanchor="left", x=0.0, font=dict(size=10)),
    template={},  # plotly.js's own defaults and the settings here: a small payload
    plot_bgcolor="white",
    paper_bgcolor="white",
    font=dict(family="sans-serif", size=11, color="#374151"),
    xaxis=dict(gridcolor="#eef0f3", zeroline=False),
    yaxis=dict(gridcolor="#eef0f3", zerolinecolor="#d1d5db"),
    hovermode="x unified",
)


def layout(title: str, ytitle: str | None = None, xtitle: str | None = None, **extra: Any) -> dict[str, Any]:
    """LAYOUT with a title on the top line (the legend on the line under it) and axis titles;
    `extra` entries replace LAYOUT's (the axes' are merged)."""
    out = {**LAYOUT, "title": dict(text=title, x=0.01, xanchor="left", y=1.0, yref="container", yanchor="top",
                                   pad=dict(t=6), font=dict(size=14))}
    out["xaxis"] = {**LAYOUT["xaxis"], **({"title": dict(text=xtitle)} if xtitle else {}), **extra.pop("xaxis", {})}
    out["yaxis"] = {**LAYOUT["yaxis"], **({"title": dict(text=ytitle)} if ytitle else {}), **extra.pop("yaxis", {})}
    out = {**out, **extra}
    out["legend"] = {**out["legend"], "y": 1 - TITLE_PX / out["height"]}
    return out


def when(t: float) -> datetime:
    return datetime.fromtimestamp(t)


def stamp(t: float) -> str:
    """Epoch seconds as the local time string plotly reads on a date axis (what `when` gives
    once serialised), to the millisecond: "2026-11-29 16:11:02.500"."""
    return datetime.fromtimestamp(t).isoformat(sep=" ", timespec="milliseconds")


def change_label(change: dict[str, Any]) -> str:
    """'v3: max_num_seqs 64→16, scheduling_policy continuous→static' ('v4 (autopilot): ...' for
    the autopilot's moves)."""
    old, new = change.get("old") or {}, change.get("new") or {}
    parts = [f"{k} {old.get(k)}→{v}" for k, v in new.items() if old.get(k) != v]
    by = " (autopilot)" if change.get("source") == "autopilot" else ""
    return f"v{change.get('version')}{by}: " + (", ".join(parts) or "no change")


def change_hover(change: dict[str, Any]) -> str:
    """The marker's hover text: its label, then its reason (one clause a line), when it has one."""
    reason = change.get("reason")
    if not reason:
        return change_label(change)
    return change_label(change) + "<br>" + "<br>".join(html.escape(part) for part in reason.split("; "))


def knob_marks(changes: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(shapes, annotations) as plain layout dicts: each change a dashed vertical line. The
    newest LABELLED changes carry their label (cut at LABEL_CHARS); older ones show their
    version, with the whole label (and the change's reason) on hover."""
    shapes, annotations = [], []
    for i, change in enumerate(changes):
        x = stamp(change["applied_at"])
        label = change_label(change)
        newest = i >= len(changes) - LABELLED
        text = label if len(label) <= LABEL_CHARS else label[:LABEL_CHARS - 1] + "…"
        shapes.append(dict(type="line", x0=x, x1=x, xref="x", y0=0, y1=1, yref="paper",
                           line=dict(color="#6b7280", width=1, dash="dash")))
        annotations.append(dict(x=x, xref="x", y=1 - 0.1 * ((len(changes) - 1 - i) % LABELLED), yref="paper",
                                text=text if newest else f"v{change.get('version')}", hovertext=change_hover(change),
                                showarrow=False, xanchor="left", yanchor="top",
                                font=dict(size=9, color="#374151"), bgcolor="rgba(255,255,255,0.8)"))
    return shapes, annotations


def mark_knob_changes(fig: go.Figure, changes: Sequence[dict[str, Any]]) -> go.Figure:
    """Draw `knob_marks(changes)` on `fig`."""
    shapes, annotations = knob_marks(changes)
    for shape in shapes:
        fig.add_shape(**shape)
    for annotation in annotations:
        fig.add_annotation(**annotation)
    return fig


def trace(x: Sequence[Any], y: Sequence[float | None], name: str, color: str, *, dash: str | None = None,
          shape: str = "linear", fill: str | None = None, width: float = 2, stackgroup: str | None = None,
          markers: bool = False) -> dict[str, Any]:
    """A scatter line as a plain plotly dict."""
    line_style: dict[str, Any] = dict(color=color, width=width)
    if dash:
        line_style["dash"] = dash
    if shape != "linear":
        line_style["shape"] = shape
    out = dict(type="scatter", x=list(x), y=list(y), name=name, mode="lines+markers" if markers else "lines",
               line=line_style)
    if fill:
        out["fill"] = fill
    if stackgroup:
        out["stackgroup"] = stackgroup
    return out


def note(text: str) -> dict[str, Any]:
    """A grey annotation in the middle of a chart, as a layout dict."""
    return dict(text=text, xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False,
                font=dict(size=12, color="#9ca3af"))


def empty_note(fig: go.Figure, text: str = "no data in this window") -> go.Figure:
    fig.add_annotation(**note(text))
    return fig


# ------------------------------------------------------------------------------- run compare


def bar_figure(title: str, yaxis_title: str, categories: Sequence[str],
               series: dict[str, Sequence[float | None]]) -> go.Figure:
    """Grouped bars: one group per category, one bar per entry of `series` (e.g. per run), in the
    dashboard's style."""
    fig = report_page.bar_figure(title, yaxis_title, categories, list(series.items()), COLORS)
    fig.update_layout(layout(title, yaxis_title, barmode="group", height=320, hovermode="closest"))
    if not series:
        empty_note(fig, "pick runs to compare")
    return fig


def side_by_side_figure(title: str, throughput: dict[str, float | None],
                        latency: dict[str, Sequence[float | None]], latency_labels: Sequence[str]) -> go.Figure:
    """Two panels: output tokens/s per entry (left) and latency percentiles in ms (right)."""
    fig = make_subplots(rows=1, cols=2, column_widths=[0.3, 0.7],
                        subplot_titles=("output tokens/s", "latency (ms)"))
    for i, name in enumerate(throughput):
        color = COLORS[i % len(COLORS)]
        fig.add_trace(go.Bar(name=name, x=[name], y=[throughput[name]], marker_color=color,
                             legendgroup=name, showlegend=False), row=1, col=1)
        fig.add_trace(go.Bar(name=name, x=list(latency_labels), y=list(latency[name]), marker_color=color,
                             legendgroup=name), row=1, col=2)
    fig.update_layout(layout(title, barmode="group", height=320, hovermode="closest"))
    if not throughput:
        empty_note(fig, "no completed run")
    return fig


def overlay_figure(title: str, yaxis_title: str,
                   series: dict[str, tuple[Sequence[float], Sequence[float]]]) -> go.Figure:
    """Lines over seconds since each run's start, one per run."""
    fig = go.Figure()
    for i, (name, (xs, ys)) in enumerate(series.items()):
        fig.add_trace(go.Scatter(x=list(xs), y=list(ys), name=name, mode="lines",
                                 line=dict(color=COLORS[i % len(COLORS)], width=2)))
    fig.update_layout(layout(title, yaxis_title, "seconds since the run started", height=320))
    if not series:
        empty_note(fig, "pick runs to compare")
    return fig
