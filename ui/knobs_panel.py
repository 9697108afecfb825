"""The knobs panel (always visible): sliders with number boxes, policy switch, prefix-caching
switch, Apply, presets, and the SLO autopilot's switch (ui.autopilot_switch).

Apply sends ONE PATCH /admin/knobs with the knobs that differ from the values in force; the
server validates the set as a whole, so a rejection means nothing was applied. Presets are the
knob keys of configs/latency.toml and configs/throughput.toml.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from appliance.policies import POLICIES
from ui.api_client import ApiError, rejected_markdown
from ui.autopilot_switch import AutopilotSwitch
from ui.context import DashboardContext

# The live knobs (the server's contract; the dashboard never imports the engine).
KNOB_NAMES = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "long_prefill_token_threshold",
    "max_num_partial_prefills",
    "max_long_partial_prefills",
    "scheduling_policy",
    "enable_prefix_caching",
)
PRESETS = ("latency", "throughput")
FIXED_ORDER = ("model", "device", "dtype", "block_size", "num_blocks", "max_model_len")


@dataclass(frozen=True)
class SliderSpec:
    name: str
    label: str
    elem_id: str
    maximum: int  # the slider's initial range; the number box takes any value the range holds


SLIDERS = (
    SliderSpec("max_num_seqs", "max_num_seqs (running sequences)", "knob-max-num-seqs", 1024),
    SliderSpec("max_num_batched_tokens", "max_num_batched_tokens (token budget per iteration)",
               "knob-max-num-batched-tokens", 16384),
    SliderSpec("long_prefill_token_threshold", "long_prefill_token_threshold (chunk size)",
               "knob-long-prefill-token-threshold", 16384),
    SliderSpec("max_num_partial_prefills", "max_num_partial_prefills", "knob-max-num-partial-prefills", 64),
    SliderSpec("max_long_partial_prefills", "max_long_partial_prefills", "knob-max-long-partial-prefills", 64),
)


def default_configs_dir() -> Path:
    """The repository's configs/ folder (next to the ui package)."""
    return Path(__file__).resolve().parents[1] / "configs"


def load_presets(configs_dir: Path | None) -> dict[str, dict[str, Any]]:
    """{preset: knob values} for each of PRESETS found in `configs_dir` (knob keys only)."""
    folder = configs_dir or default_configs_dir()
    presets: dict[str, dict[str, Any]] = {}
    for name in PRESETS:
        path = folder / f"{name}.toml"
        if not path.is_file():
            continue
        with path.open("rb") as fh:
            data = tomllib.load(fh)
        knobs = {k: v for k, v in data.items() if k in KNOB_NAMES}
        if knobs:
            presets[name] = knobs
    return presets


def coerce(value: Any) -> Any:
    """A whole-number float from a slider or number box as an int; anything else unchanged
    (the server reports it, e.g. 7.5 is not an integer)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def diff_knobs(current: dict[str, Any], wanted: dict[str, Any]) -> dict[str, Any]:
    """The entries of `wanted` that differ from `current`."""
    return {k: v for k, v in wanted.items() if current.get(k) != v}


def describe_change(old: dict[str, Any], new: dict[str, Any]) -> str:
    """'max_num_seqs 64→16, scheduling_policy continuous→static' (keys of `new` that changed)."""
    parts = [f"{k} {old.get(k)}→{v}" for k, v in new.items() if old.get(k) != v]
    return ", ".join(parts) or "no change"


def effective_markdown(payload: dict[str, Any]) -> str:
    """The knobs in force (GET /admin/knobs). A fleet's answer lists each replica's ("replicas");
    when their values differ (a PATCH with ?replica=, or a replica still applying), every replica
    gets a column of its own and the rows that differ are marked."""
    knobs = payload.get("knobs", {})
    replicas = {r: v.get("knobs") or {} for r, v in (payload.get("replicas") or {}).items()}
    differ = [n for n in KNOB_NAMES if len({repr(k.get(n)) for k in replicas.values()}) > 1]
    if not differ:
        rows = "\n".join(f"| {name} | {knobs.get(name, '—')} |" for name in KNOB_NAMES)
        return (f"**In force:** version {payload.get('version')}, since iteration "
                f"{payload.get('iteration')}\n\n| knob | value |\n|---|---|\n{rows}")
    ids = sorted(replicas)
    versions = ", ".join(f"{r} v{(payload['replicas'][r] or {}).get('version', '?')}" for r in ids)
    rows = "\n".join(f"| {'**' + n + '** (differs)' if n in differ else n} | "
                     + " | ".join(str(replicas[r].get(n, '—')) for r in ids) + " |" for n in KNOB_NAMES)
    return (f"**In force per replica** ({versions}): {len(differ)} knob(s) differ\n\n"
            f"| knob | {' | '.join(ids)} |\n|---|{'---|' * len(ids)}\n{rows}")


def fixed_markdown(payload: dict[str, Any]) -> str:
    fixed = payload.get("fixed", {})
    names = [k for k in FIXED_ORDER if k in fixed] + sorted(set(fixed) - set(FIXED_ORDER))
    rows = "\n".join(f"| {k} | {fixed[k]} |" for k in names)
    return f"**Fixed at start** (read-only)\n\n| setting | value |\n|---|---|\n{rows}"


def applied_markdown(before: dict[str, Any], after: dict[str, Any]) -> str:
    change = describe_change(before.get("knobs", {}), after.get("knobs", {}))
    return (f"**Applied:** {change} — version {after.get('version')}, "
            f"took effect at iteration {after.get('iteration')}")


class KnobsPanel:
    """Builds the panel inside the current Blocks context and wires its events."""

    def __init__(self, ctx: DashboardContext):
        self.ctx = ctx
        self.presets = load_presets(ctx.configs_dir)
        self.autopilot = AutopilotSwitch(ctx)

    def build(self) -> None:
        with gr.Column(elem_id="knobs-panel"):
            gr.Markdown("### Knobs", elem_id="knobs-title")
            self.sliders = [
                gr.Slider(1, spec.maximum, step=1, precision=0, label=spec.label, elem_id=spec.elem_id)
                for spec in SLIDERS
            ]
            self.policy = gr.Radio(list(POLICIES), value="continuous", label="scheduling_policy",
                                   elem_id="knob-policy")
            self.caching = gr.Checkbox(value=True, label="enable_prefix_caching", elem_id="knob-prefix-caching")
            with gr.Row():
                self.apply = gr.Button("Apply", variant="primary", elem_id="knob-apply")
                self.reload = gr.Button("Reload", elem_id="knob-reload", size="sm")
            with gr.Row():
                self.preset_buttons = {
                    name: gr.Button(f"Preset: {name}", elem_id=f"preset-{name}", size="sm")
                    for name in self.presets
                }
            self.status = gr.Markdown("", elem_id="knob-status")
            self.effective = gr.Markdown("", elem_id="knob-effective")
            self.fixed = gr.Markdown("", elem_id="knob-fixed")
            self.autopilot.build()
        inputs = [*self.sliders, self.policy, self.caching]
        outputs = self.outputs
        self.apply.click(self.on_apply, inputs, outputs, api_name="knobs_apply")
        self.reload.click(self.on_reload, None, outputs, api_name="knobs_reload")
        for name, button in self.preset_buttons.items():
            button.click(self._preset_handler(name), None, outputs, api_name=f"knobs_preset_{name}")

    @property
    def outputs(self) -> list[gr.components.Component]:
        """What every handler here returns: status, knobs in force, fixed settings, the form."""
        return [self.status, self.effective, self.fixed, *self.sliders, self.policy, self.caching]

    # ------------------------------------------------------------------------------- handlers

    def _form(self, payload: dict[str, Any]) -> list[Any]:
        """Slider and policy updates showing the values in force (ranges widened to fit)."""
        knobs = payload.get("knobs", {})
        updates: list[Any] = []
        for spec in SLIDERS:
            value = knobs.get(spec.name)
            if isinstance(value, int) and value > spec.maximum:
                updates.append(gr.update(value=value, maximum=value * 2))
            else:
                updates.append(gr.update(value=value))
        updates.append(gr.update(value=knobs.get("scheduling_policy")))
        updates.append(gr.update(value=knobs.get("enable_prefix_caching")))
        return updates

    def _view(self, status: str, payload: dict[str, Any], form: bool = True) -> list[Any]:
        rest = self._form(payload) if form else [gr.update()] * (len(SLIDERS) + 2)
        return [status, effective_markdown(payload), fixed_markdown(payload), *rest]

    @staticmethod
    def _failed(error: ApiError) -> list[Any]:
        """The server could not be asked: say so, leave the rest as it is."""
        return [f"**Error:** {error.message}", *[gr.update()] * (len(SLIDERS) + 4)]

    def on_reload(self, request: gr.Request) -> list[Any]:
        self.ctx.check(request)
        try:
            return self._view("", self.ctx.api.knobs())
        except ApiError as exc:
            return self._failed(exc)

    def on_apply(self, max_num_seqs: float, max_num_batched_tokens: float,
                 long_prefill_token_threshold: float, max_num_partial_prefills: float,
                 max_long_partial_prefills: float, scheduling_policy: str, enable_prefix_caching: bool,
                 request: gr.Request) -> list[Any]:
        """One PATCH with the form's values that differ from those in force."""
        self.ctx.check(request)
        values = (max_num_seqs, max_num_batched_tokens, long_prefill_token_threshold,
                  max_num_partial_prefills, max_long_partial_prefills)
        wanted = {spec.name: coerce(v) for spec, v in zip(SLIDERS, values)}
        wanted["scheduling_policy"] = scheduling_policy
        wanted["enable_prefix_caching"] = bool(enable_prefix_caching)
        return self.send(wanted)

    def _preset_handler(self, name: str):
        def on_preset(request: gr.Request) -> list[Any]:
            self.ctx.check(request)
            return self.send(dict(self.presets[name]), label=f"preset {name}")

        return on_preset

    def send(self, wanted: dict[str, Any], label: str = "") -> list[Any]:
        """PATCH the knobs of `wanted` that differ from those in force; the panel's new view."""
        prefix = f"{label}: " if label else ""
        try:
            before = self.ctx.api.knobs()
        except ApiError as exc:
            return self._failed(exc)
        changes = diff_knobs(before.get("knobs", {}), wanted)
        if not changes:
            return self._view(f"{prefix}nothing to apply: these values are already in force", before)
        try:
            after = self.ctx.api.patch_knobs(changes)
        except ApiError as exc:
            if exc.status == 422:
                return self._view(prefix + rejected_markdown(exc), before, form=False)
            return self._view(f"**Error:** {prefix}{exc.message}", before, form=False)
        return self._view(prefix + applied_markdown(before, after), after)
