"""The "What if" panel (under the knobs): predict what knob values would do, then apply them.

Pick a recorded run or "the last N minutes" of this replica's traffic, edit the knobs and Predict:
the server replays that traffic at the knobs it ran with and at the edited ones
(POST /admin/simulate) and the panel shows recorded, simulated and predicted percentiles, the
queue timelines, and the step-time model's held-out error and fitting window. When nothing of
the running configuration can be predicted from, the server's reason is shown instead. Apply
sends the predicted values through the knobs panel's Apply path (one PATCH /admin/knobs).
"""

from __future__ import annotations

import time
from typing import Any

import gradio as gr
import plotly.graph_objects as go
from sqlalchemy.exc import SQLAlchemyError

from appliance.numeric import ms_text
from appliance.policies import POLICIES
from appliance.sim.cli import ALL_METRICS, spread_text
from appliance.telemetry import runs
from ui.api_client import ApiError
from ui.charts import COLORS, layout
from ui.context import DashboardContext
from ui.knobs_panel import SLIDERS, KnobsPanel, coerce
from ui.runs_view import run_label

WINDOW = "window"  # the source choice "the last N minutes"
RUN_CHOICES = 50  # newest runs offered


def source_choices(stored: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The source dropdown: the last N minutes, then the stored runs (newest first)."""
    return [("the last N minutes", WINDOW), *((run_label(r), r["id"]) for r in stored)]


def _cell(label: str, summary: dict[str, Any] | None, get: Any) -> str:
    if summary is None:
        return "—"
    try:
        value = get(summary)
    except (KeyError, TypeError):
        value = None
    if label == "tok/s":
        return "—" if value is None else f"{value:.1f}"
    return "—" if value is None else ms_text(value, unit=" ms")


def _when(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def report_markdown(report: dict[str, Any]) -> str:
    """The prediction as Markdown: source, model (held-out error, fitting window), the table."""
    source, model = report["source"], report["model"]
    recorded_by = "measured by the client" if report["recorded_by"] == "client" else "measured on the server"
    what = (f"run **{source['name']}** ({source['run_id'][:8]})" if source["kind"] == "run"
            else f"**{source['name']}** of replica {source['replica_id']}")
    lines = [
        f"{what}: {source['requests']} requests replayed in {report['elapsed_s']:.2f} s",
        f"**Step-time model** #{model['id']} ({model['method']}): held-out error "
        f"**{model['heldout_mape'] * 100:.1f} %** (MAE {model['heldout_mae_s'] * 1000:.2f} ms) on "
        f"{model['rows_held_out']} of {model['rows_used'] + model['rows_held_out']} iterations, fitted on "
        f"{_when(model['window_start'])}–{_when(model['window_end'])} ({model['engine']}){spread_text(model)}",
    ]
    if source["knob_changes"]:
        lines.append(f"Note: {source['knob_changes']} knob change(s) in it; replayed from the knobs in force "
                     "at its start")
    changed = {k: v for k, v in report["knobs"].items() if report["baseline"]["knobs"].get(k) != v}
    lines.append("**Predicted at** " + (", ".join(f"{k}={v}" for k, v in changed.items()) or "the same knobs"))
    recorded = report["recorded"]
    base, predicted = report["baseline"].get("summary"), report["predicted"].get("summary")
    lines += ["", f"| | recorded ({recorded_by}) | simulated, same knobs | predicted |", "|---|---|---|---|"]
    for label, get in ALL_METRICS:
        lines.append(f"| {label} | {_cell(label, recorded, get)} | {_cell(label, base, get)} | "
                     f"{_cell(label, predicted, get)} |")
    return "\n".join(lines)


def timeline_figure(report: dict[str, Any]) -> go.Figure:
    """Running and waiting sequences (left axis) and KV usage (right axis) over seconds from the
    first iteration: recorded, replayed at the recorded knobs, and predicted."""
    fig = go.Figure()
    lines = (("recorded", report.get("recorded_timeline")), ("same knobs", report["baseline"].get("timeline")),
             ("predicted", report["predicted"].get("timeline")))
    for i, (name, line) in enumerate(lines):
        if not line or not line["t"]:
            continue
        t = [x - line["t"][0] for x in line["t"]]
        color = COLORS[i]
        fig.add_trace(go.Scatter(x=t, y=line["running"], name=f"running, {name}", mode="lines", line=dict(color=color)))
        fig.add_trace(go.Scatter(x=t, y=line["waiting"], name=f"waiting, {name}", mode="lines",
                                 line=dict(color=color, dash="dot")))
        fig.add_trace(go.Scatter(x=t, y=[100 * u for u in line["kv_usage"]], name=f"KV usage %, {name}",
                                 mode="lines", line=dict(color=color, dash="dash", width=1), yaxis="y2"))
    fig.update_layout(**layout("Queue and KV cache: recorded, replayed, predicted", "sequences", "seconds"))
    fig.update_layout(yaxis2=dict(title="KV usage %", overlaying="y", side="right", range=[0, 100], showgrid=False))
    return fig


class WhatIfPanel:
    """Builds the panel inside the current Blocks context; Apply goes through `knobs`."""

    def __init__(self, ctx: DashboardContext, knobs: KnobsPanel):
        self.ctx = ctx
        self.knobs = knobs

    def build(self) -> None:
        with gr.Accordion("What if", open=False, elem_id="whatif-panel"):
            with gr.Row():
                # runs stored after the page loaded are accepted too (the server checks the id)
                self.source = gr.Dropdown(source_choices([]), value=WINDOW, label="replay", elem_id="whatif-source",
                                          allow_custom_value=True, scale=3)
                self.minutes = gr.Number(10, label="N minutes", minimum=0, precision=None, elem_id="whatif-minutes",
                                         scale=1)
            self.fields = [gr.Number(label=spec.name, precision=0, elem_id=f"whatif-{spec.elem_id}")
                           for spec in SLIDERS]
            self.policy = gr.Radio(list(POLICIES), value="continuous", label="scheduling_policy",
                                   elem_id="whatif-policy")
            with gr.Row():
                self.predict = gr.Button("Predict", variant="primary", elem_id="whatif-predict")
                self.apply = gr.Button("Apply these knobs", elem_id="whatif-apply")
            self.result = gr.Markdown("", elem_id="whatif-result")
            self.plot = gr.Plot(elem_id="whatif-timeline", show_label=False)
            self.predicted = gr.State(None)  # the knobs of the last prediction shown
        self.predict.click(self.on_predict, [self.source, self.minutes, *self.fields, self.policy],
                           [self.result, self.plot, self.predicted], api_name="whatif_predict")
        self.apply.click(self.on_apply, [self.predicted], [*self.knobs.outputs, self.result],
                         api_name="whatif_apply")

    @property
    def load_outputs(self) -> list[gr.components.Component]:
        return [self.source, *self.fields, self.policy]

    def on_load(self, request: gr.Request) -> list[Any]:
        """Offer the stored runs and start the form at the knobs in force."""
        self.ctx.check(request)
        try:
            stored = runs.list_runs(self.ctx.db_url, limit=RUN_CHOICES)
        except SQLAlchemyError as exc:
            gr.Warning(f"telemetry store unavailable: {type(exc).__name__}")
            stored = []
        try:
            knobs = self.ctx.api.knobs().get("knobs", {})
        except ApiError:
            knobs = {}
        return [gr.update(choices=source_choices(stored)),
                *(gr.update(value=knobs.get(spec.name)) for spec in SLIDERS),
                gr.update(value=knobs.get("scheduling_policy", "continuous"))]

    def on_predict(self, source: str, minutes: float | None, max_num_seqs: float, max_num_batched_tokens: float,
                   long_prefill_token_threshold: float, max_num_partial_prefills: float,
                   max_long_partial_prefills: float, scheduling_policy: str,
                   request: gr.Request) -> list[Any]:
        """Ask the server to replay the source at the form's knobs; show the answer or its reason."""
        self.ctx.check(request)
        values = (max_num_seqs, max_num_batched_tokens, long_prefill_token_threshold, max_num_partial_prefills,
                  max_long_partial_prefills)
        wanted = {spec.name: coerce(v) for spec, v in zip(SLIDERS, values) if v is not None}
        wanted["scheduling_policy"] = scheduling_policy
        try:
            if source == WINDOW:
                report = self.ctx.api.simulate(wanted, last_minutes=minutes)
            else:
                report = self.ctx.api.simulate(wanted, run_id=source)
        except ApiError as exc:
            lines = [f"**No prediction.** {exc.message}"]
            lines += [f"- `{field}`: {message}" for field, message in exc.errors.items()]
            return ["\n".join(lines), None, None]
        return [report_markdown(report), timeline_figure(report), report["knobs"]]

    def on_apply(self, predicted: dict[str, Any] | None, request: gr.Request) -> list[Any]:
        """Apply the knobs of the last prediction through the knobs panel (one PATCH)."""
        self.ctx.check(request)
        if not predicted:
            return [*[gr.update()] * len(self.knobs.outputs), "**Predict first:** Apply sends the predicted knobs."]
        return [*self.knobs.send(dict(predicted), label="what if"), gr.update()]
