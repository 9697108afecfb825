"""The slowest requests of a window or run, and why one was slow: its TTFT / decode split and its
timeline against the iterations it lived through (appliance.telemetry.request_split).

Used by the Live tab (scope: its window) and the Runs tab (scope: the first selected run).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gradio as gr
import plotly.graph_objects as go
from sqlalchemy.exc import SQLAlchemyError

from appliance.telemetry import request_split as rs
from appliance.telemetry.request_split import RequestSplit
from ui import charts
from ui.context import DashboardContext

LIMIT = 10
HEADERS = ["row", "request", "E2E s", "TTFT s", "queue s", "prompt", "output", "preempted", "finish"]
Scope = tuple[float | None, float | None, str | None]  # since, until, run_id
PHASES = (("queue", "#fde68a"), ("prefill", "#bfdbfe"), ("decode", "#bbf7d0"))


def table_rows(rows: list[dict[str, Any]]) -> list[list[Any]]:
    def s(v: float | None) -> str:
        return "—" if v is None else f"{v:.3f}"

    return [[r["id"], r["request_id"], s(r["e2e_s"]), s(r["ttft_s"]), s(r["queue_s"]), r["prompt_tokens"],
             r["output_tokens"], r["preemptions"], str(r["finish_reason"])] for r in rows]


def split_markdown(s: RequestSplit) -> str:
    """The split as a short Markdown table (seconds and share of E2E)."""
    def row(label: str, v: float | None) -> str:
        if v is None:
            return f"| {label} | — | |"
        return f"| {label} | {v:.3f} | {v / s.e2e_s * 100:.0f} % |" if s.e2e_s > 0 else f"| {label} | {v:.3f} | |"

    lines = [f"**{s.request_id}** (row {s.id}): {s.prompt_tokens} prompt / {s.output_tokens} output tokens, "
             f"{s.preemptions} preemption(s), finished `{s.finish_reason}`", "",
             "| part | s | of E2E |", "|---|---:|---:|",
             row("E2E", s.e2e_s), row("TTFT", s.ttft_s), row("· queueing", s.queue_s)]
    lines += [row(f"  · held by {cause}", v) for cause, v in s.queue_by_cause.items() if v > 0]
    lines += [row("· prefill compute", s.prefill_s), row("· first-token sampling", s.first_token_sampling_s),
              row("decode", s.decode_s), row("· own steps", s.decode_own_s),
              row(f"· stall from others' prefill chunks ({s.decode_steps_with_prefill} of {s.decode_steps} steps)",
                  s.decode_prefill_stall_s)]
    return "\n".join(lines)


def timeline_figure(s: RequestSplit) -> go.Figure:
    """The iterations the request lived through (batch size, prefill tokens, KV %, step time)
    with its queue / prefill / decode phases shaded."""
    its = s.iterations
    x = [charts.when(i["started_at"]) for i in its]
    fig = go.Figure()
    fig.add_scatter(x=x, y=[i["running"] for i in its], name="batch size", line=dict(color=charts.COLORS[0]))
    fig.add_scatter(x=x, y=[i["prefill_tokens"] for i in its], name="prefill tokens", line=dict(color=charts.COLORS[3]))
    fig.add_scatter(x=x, y=[i["kv_blocks_used"] / i["kv_blocks_total"] * 100 if i["kv_blocks_total"] else None
                            for i in its], name="KV %", line=dict(color=charts.COLORS[4], dash="dot"))
    fig.add_scatter(x=x, y=[i["duration_s"] * 1000 for i in its], name="step ms", yaxis="y2",
                    line=dict(color=charts.COLORS[5]))
    scheduled = s.arrival + s.queue_s
    first = s.arrival + s.ttft_s if s.ttft_s is not None else s.finished
    for (name, color), (lo, hi) in zip(PHASES, ((s.arrival, scheduled), (scheduled, first), (first, s.finished))):
        if hi > lo:
            fig.add_vrect(x0=charts.when(lo), x1=charts.when(hi), fillcolor=color, opacity=0.4, line_width=0,
                          layer="below", annotation_text=name, annotation_position="top left")
    fig.update_layout(**charts.layout(f"Request {s.request_id}: the iterations it lived through", "per iteration"),
                      yaxis2=dict(title=dict(text="step ms"), overlaying="y", side="right", showgrid=False))
    if not its:
        charts.empty_note(fig, "no iterations stored for this request")
    return fig


class SlowRequestsPanel:
    """A "slowest requests" list; choosing one shows its split and timeline."""

    def __init__(self, ctx: DashboardContext, db: Any, prefix: str, scope: Callable[[Any], Scope]):
        self.ctx, self.db, self.prefix, self.scope = ctx, db, prefix, scope

    def build(self, scope_input: gr.components.Component) -> None:
        p = self.prefix
        with gr.Accordion("Slowest requests: why was this one slow?", open=False, elem_id=f"{p}-slow"):
            with gr.Row():
                by = gr.Radio(list(rs.SLOW_BY), value="e2e", label="slowest by", elem_id=f"{p}-slow-by", scale=2)
                list_button = gr.Button("List slowest", elem_id=f"{p}-slow-list", scale=0)
                row = gr.Number(None, label="request row", precision=0, elem_id=f"{p}-slow-row", scale=1)
                explain = gr.Button("Explain", elem_id=f"{p}-slow-explain", scale=0)
            table = gr.Dataframe(headers=HEADERS, value=[], interactive=False, elem_id=f"{p}-slow-table")
            split = gr.Markdown("", elem_id=f"{p}-slow-split")
            plot = gr.Plot(elem_id=f"{p}-slow-timeline", show_label=False)
        list_button.click(self.list, [scope_input, by], [table], api_name=f"{p}_slowest")
        explain.click(self.explain, [row], [split, plot], api_name=f"{p}_request_split")
        table.select(self.pick, None, [row]).then(self.explain, [row], [split, plot])

    def list(self, scope_value: Any, by: str, request: gr.Request) -> list[list[Any]]:
        self.ctx.check(request)
        since, until, run_id = self.scope(scope_value)
        try:
            return table_rows(rs.slowest_requests(self.db, since, until, run_id=run_id, by=by or "e2e", limit=LIMIT))
        except SQLAlchemyError as exc:
            raise gr.Error(f"telemetry store unavailable: {type(exc).__name__}") from exc

    def pick(self, evt: gr.SelectData) -> Any:
        """A click in the table: the row id of the clicked line."""
        row = evt.row_value if evt.row_value is not None else None
        return row[0] if row else gr.update()

    def explain(self, row_id: Any, request: gr.Request) -> list[Any]:
        self.ctx.check(request)
        if row_id is None:
            return ["Pick a request in the list (or type its row).", gr.update()]
        try:
            s = rs.request_split(self.db, int(row_id))
        except LookupError as exc:
            return [f"**Error:** {exc}", gr.update()]
        return [split_markdown(s), timeline_figure(s)]
