"""The SLO autopilot's switch in the knobs panel: targets and bounds, on/off, and what it did.

Switching goes through PATCH /admin/autopilot (the one path, as for any client); the status
shows the switch, its targets, its latest move with the reason, its latest decision when that
was to hold, and "turned itself off: <error>" after a controller failure. It is read on page
load and on Refresh.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import gradio as gr

from ui.api_client import ApiError, rejected_markdown
from ui.context import DashboardContext

PLACEHOLDER = "ttft_p99=1s,itl_p99=150ms,max_num_seqs=8..128"


def autopilot_markdown(view: dict[str, Any]) -> str:
    """The autopilot's switch, status (or the error it turned itself off after), spec, latest
    move with its reason, and its latest decision when that was not the move."""
    spec = view.get("spec") or {}
    targets = ", ".join(f"{k} {v:g} s" for k, v in (spec.get("targets") or {}).items()) or "none"
    bounds = ", ".join(f"{k} {lo}..{hi}" for k, (lo, hi) in (spec.get("bounds") or {}).items()) or "none"
    if view.get("error") and not view.get("enabled"):
        head = f"**Autopilot off** — turned itself off: {view['error']}."
    else:
        head = f"**Autopilot {'on' if view.get('enabled') else 'off'}** ({view.get('status')})."
    lines = [f"{head} Targets: {targets}. Bounds: {bounds}."]
    moves = view.get("moves") or []
    if moves:
        last = moves[-1]
        lines.append(f"Last move (v{last.get('version')}, {clock(last.get('at'))}): {last['reason']}")
    decision = view.get("last_decision") or {}
    if decision and (not moves or decision.get("reason") != moves[-1]["reason"]):
        lines.append(f"Latest decision ({clock(decision.get('at'))}): {decision.get('reason')}")
    return "\n\n".join(lines)


def spec_text(view: dict[str, Any]) -> str:
    """The view's spec as the text the switch sends back: "ttft_p99=1000ms,max_num_seqs=8..128"."""
    spec = view.get("spec") or {}
    parts = [f"{k}={v * 1000:g}ms" for k, v in (spec.get("targets") or {}).items()]
    parts += [f"{k}={lo}..{hi}" for k, (lo, hi) in (spec.get("bounds") or {}).items()]
    return ",".join(parts)


def clock(t: Any) -> str:
    """Epoch seconds as the local HH:MM:SS ("?" when missing)."""
    return datetime.fromtimestamp(t).strftime("%H:%M:%S") if isinstance(t, (int, float)) else "?"


class AutopilotSwitch:
    """Builds the switch inside the current Blocks context and wires its events."""

    def __init__(self, ctx: DashboardContext):
        self.ctx = ctx

    def build(self) -> None:
        with gr.Accordion("SLO autopilot", open=False, elem_id="autopilot"):
            self.spec = gr.Textbox(label="targets and knob bounds", elem_id="autopilot-spec", placeholder=PLACEHOLDER)
            with gr.Row():
                self.on = gr.Checkbox(False, label="Autopilot on", elem_id="autopilot-switch")
                self.refresh = gr.Button("Refresh", elem_id="autopilot-refresh", size="sm")
            self.status = gr.Markdown("", elem_id="autopilot-status")
        self.on.input(self.on_switch, [self.on, self.spec], [self.on, self.status], api_name="autopilot_switch")
        self.refresh.click(self.on_view, None, self.outputs, api_name="autopilot_view")

    @property
    def outputs(self) -> list[gr.components.Component]:
        """What on_view returns: the switch, the spec box, the status."""
        return [self.on, self.spec, self.status]

    def on_switch(self, on: bool, spec: str, request: gr.Request) -> list[Any]:
        """One PATCH /admin/autopilot (with the spec when one is typed); rejected: the switch goes
        back and the reason is shown."""
        self.ctx.check(request)
        body: dict[str, Any] = {"enabled": bool(on)}
        if spec and spec.strip():
            body["spec"] = spec.strip()
        try:
            view = self.ctx.api.patch_autopilot(body)
        except ApiError as exc:
            return [not on, rejected_markdown(exc)]
        return [view["enabled"], autopilot_markdown(view)]

    def on_view(self, request: gr.Request) -> list[Any]:
        """The autopilot as the server has it now (GET /admin/autopilot)."""
        self.ctx.check(request)
        try:
            view = self.ctx.api.autopilot()
        except ApiError as exc:
            return [gr.update(), gr.update(), f"**Error:** {exc.message}"]
        return [view["enabled"], spec_text(view), autopilot_markdown(view)]
