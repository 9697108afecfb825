"""LivePlot: a Plotly chart that is drawn once and then updated in place.

gr.Plot re-creates its element on every new value and plotly.js draws the figure from scratch
(a new <div>, a full newPlot, then a resize): several times the browser time of `Plotly.react`
on the element already drawn (measured here: ~140 ms against ~18 ms for one Live chart in
headless Chromium). The Live tab's charts get a new value every second, so they use this
component instead: a gr.HTML (Gradio's supported way to make a custom component) whose script
calls `Plotly.react` on the same element whenever the value changes (a chart in a hidden tab or
page draws its newest value when it shows again). It takes and sends gr.Plot's payload,
{"type": "plotly", "plot": "<figure JSON>"}, so API clients see the same shape as before.

plotly.js comes from the plotly Python package (`plotly.offline.get_plotlyjs()`, written once per
process to a private temporary file that Gradio's file route serves after login, like any
allowed file): no CDN. The script keeps its own reference to that copy, since Gradio's bundled
copy (used by gr.Plot elsewhere on the page) sets window.Plotly too when it loads.
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr
from plotly.offline import get_plotlyjs


@functools.cache
def plotly_js_file() -> Path:
    """plotly.js as a file of its own (in a directory only this user can read, removed at exit)."""
    folder = Path(tempfile.mkdtemp(prefix="appliance-plotly-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = folder / "plotly.min.js"
    path.write_text(get_plotlyjs(), encoding="utf-8")
    return path


@dataclass(frozen=True)
class PlotPayload:
    """gr.Plot's payload shape: the figure as plotly JSON (serialised once) in `plot`."""

    plot: str
    type: str = "plotly"

# Runs once per chart element when it mounts (Gradio passes element, props and watch).
# Draws the payload with Plotly.react on the same element. A chart without width (in a hidden tab)
# or in a hidden page is not drawn; the newest payload is drawn as soon as it shows. The
# element's layout is contained, so plotly's layout reads while one chart redraws do not lay
# out the whole page again.
JS_ON_LOAD = """
const P = window.__appliancePlotly || (window.__appliancePlotly = window.Plotly);
const box = element.querySelector('.live-plot');
const config = {displaylogo: false, responsive: false};
let drawn = null, width = 0, drawnWidth = 0;
function payload() {
  const v = props.value;
  return v && (typeof v === 'string' ? v : v.plot);
}
function draw() {
  const text = payload();
  if (!P || !text || text === drawn || document.hidden || !width) return;
  drawn = text;
  drawnWidth = width;
  const fig = JSON.parse(text);
  fig.layout.autosize = true;
  P.react(box, fig.data, fig.layout, config);
}
watch('value', draw);
new ResizeObserver((entries) => {  // its width, without asking the page for a layout
  width = Math.round(entries[entries.length - 1].contentRect.width);
  if (!width) return;
  if (payload() !== drawn) draw();
  else if (drawn && width !== drawnWidth) { drawnWidth = width; P.Plots.resize(box); }
}).observe(box);
document.addEventListener('visibilitychange', draw);
"""


def plot_payload(value: Any) -> dict[str, str] | None:
    """gr.Plot's payload for a PlotPayload, a plotly JSON dict or an already built payload."""
    if value is None:
        return None
    if isinstance(value, PlotPayload):
        return {"type": value.type, "plot": value.plot}
    if isinstance(value, dict) and "plot" in value:
        return {"type": value.get("type", "plotly"), "plot": value["plot"]}
    if isinstance(value, dict):
        return {"type": "plotly", "plot": json.dumps(value, separators=(",", ":"))}
    raise TypeError(f"LivePlot takes a PlotPayload or a plotly figure dict, not {type(value).__name__}")


class LivePlot(gr.HTML):
    """A chart for values that change every second (see the module docstring)."""

    def __init__(self, elem_id: str, height: int = 260, **kwargs: Any):
        plotly_js = plotly_js_file()
        gr.set_static_paths([plotly_js])  # only this file; Gradio's file route still asks for the login
        super().__init__(
            value=None,
            html_template=f'<div class="live-plot" style="width:100%;height:{height}px;contain:layout paint"></div>',
            js_on_load=JS_ON_LOAD,
            head=f'<script src="gradio_api/file={plotly_js.as_posix()}"></script>',
            elem_id=elem_id,
            apply_default_css=False,
            container=True,
            **kwargs,
        )

    def preprocess(self, payload: Any) -> Any:
        return payload

    def postprocess(self, value: Any) -> dict[str, str] | None:  # type: ignore[override]
        return plot_payload(value)

    def api_info(self) -> dict[str, Any]:
        return {"type": "object", "properties": {"type": {"type": "string"}, "plot": {"type": "string"}},
                "description": "gr.Plot's payload: the figure as plotly JSON in `plot`"}

    def example_payload(self) -> Any:
        return None

    def example_value(self) -> Any:
        return None
