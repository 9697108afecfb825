"""The load-test tab's auto-tuning sweep: `appliance tune` from the dashboard.

The sweep is appliance.bench.tune.run_sweep, the CLI's own code: live PATCH /admin/knobs per grid
point, one short run of the tab's workload per point (stored like any run), Pareto fronts and the
recommendation. It runs in a background thread and takes the tab's one job slot (LoadTests), so
the tab's Cancel button stops it too; the panel's own Cancel does the same. The sweep always puts
the original knobs back; "Apply recommendation" then sets the recommended point through
appliance.bench.tune.apply_recommendation, the code path of `appliance tune --apply`.
"""

from __future__ import annotations

import html
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import gradio as gr
import plotly.graph_objects as go

from appliance.bench.loadgen import BenchError, LoadGenerator, Progress
from appliance.bench.metrics import SLO, parse_slo
from appliance.bench.tune import (
    DEFAULT_ATTAINMENT,
    TUNED,
    Grid,
    PointStatus,
    SweepPoint,
    SweepResult,
    apply_recommendation_at,
    pareto_front,
    run_sweep,
)
from appliance.bench.report.sweep import pareto_figure, render_sweep, summary_lines
from appliance.numeric import to_ms
from ui.context import DashboardContext
from ui.loadtest_tab import LoadSpec, LoadTests, build_spec, run_to_end

DEFAULT_GRID = {"max_num_seqs": "8,32", "max_num_batched_tokens": "512", "long_prefill_token_threshold": "64,256"}
DEFAULT_SLO = "ttft=2s,tpot=250ms"
DEFAULT_PER_POINT = 8
REPORT_FORMATS = {"HTML": ("html", ".html"), "Markdown": ("md", ".md"), "CSV": ("csv", ".csv"),
                  "JSON": ("json", ".json")}
POINT_HEADERS = ["#", "stage", "max_num_seqs", "max_num_batched_tokens", "chunk", "status", "output tok/s",
                 "TTFT p99 ms", "ITL p99 ms", "goodput req/s", "within SLO", "SLO met", "Pareto front",
                 "run id"]
POLL_S = 0.5


def parse_values(text: Any, what: str) -> tuple[int, ...]:
    """"8, 32,64" -> (8, 32, 64); ValueError naming `what` otherwise."""
    parts = [p.strip() for p in str(text or "").split(",") if p.strip()]
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated whole numbers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{what}: expected positive whole numbers, got {text!r}")
    return values


@dataclass(frozen=True)
class SweepSpec:
    """The sweep form, checked."""

    load: LoadSpec  # the workload of every point, and its arrival
    grid: Grid
    slo: SLO
    attainment: float
    refine: bool


def build_sweep_spec(workload: str, arrival: str, rate: Any, concurrency: Any, max_output: Any, seed: Any,
                     upload: str | None, seqs: Any, budgets: Any, chunks: Any, per_point: Any, slo: Any,
                     attainment: Any, refine: bool) -> SweepSpec:
    """Turn the form into a sweep; ValueError/FileNotFoundError say what is wrong."""
    grid = Grid(max_num_seqs=parse_values(seqs, "max_num_seqs"),
                max_num_batched_tokens=parse_values(budgets, "max_num_batched_tokens"),
                long_prefill_token_threshold=parse_values(chunks, "chunk size"))
    share = float(attainment if attainment is not None else DEFAULT_ATTAINMENT)
    if not 0 < share <= 1:
        raise ValueError(f"the share of requests within the SLO must be within (0, 1], got {attainment}")
    target = parse_slo(str(slo or ""))
    load = build_spec(workload, per_point, arrival, rate, concurrency, max_output, seed, None, upload)
    return SweepSpec(load, grid, target, share, bool(refine))


@dataclass
class SweepJob:
    """One sweep running in a background thread; the points fill in as they are measured."""

    spec: SweepSpec
    points: list[SweepPoint] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)  # the sweep's progress lines, one per point
    progress: Progress | None = None  # the current point's run
    generator: LoadGenerator | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    result: SweepResult | None = None
    error: str | None = None

    @property
    def cancelled(self) -> bool:
        return self.stop.is_set()

    def cancel(self) -> None:
        """Stop now: the current point's run is cancelled, no further point starts, the original
        knobs are put back."""
        self.stop.set()
        generator = self.generator
        if generator is not None:
            generator.cancel()

    def watch(self, generator: LoadGenerator) -> None:
        generator.progress = lambda p: setattr(self, "progress", p)
        self.generator = generator
        if self.stop.is_set():
            generator.cancel()

    @property
    def state(self) -> str:
        if not self.done.is_set():
            return "running"
        return "cancelled" if self.cancelled else "failed" if self.error else "finished"


class Sweeps:
    """Starts sweeps in the load-test tab's job slot, against the dashboard's own server."""

    def __init__(self, tests: LoadTests, base_url: str, api_key: str | None):
        self.tests = tests
        self.base_url = base_url
        self.api_key = api_key

    def start(self, spec: SweepSpec) -> SweepJob:
        job = SweepJob(spec)
        self.tests.claim(job)
        threading.Thread(target=self._run, args=(job,), name="dashboard-sweep", daemon=True).start()
        return job

    def _run(self, job: SweepJob) -> None:
        spec = job.spec

        def work() -> None:
            job.result = run_sweep(
                spec.load.requests, spec.slo, base_url=self.base_url, grid=spec.grid, refine=spec.refine,
                apply=False, attainment=spec.attainment, rate=spec.load.rate,
                concurrency=spec.load.concurrency, seed=spec.load.seed, api_key=self.api_key,
                db_url=self.tests.db_url, workload=spec.load.workload, progress=job.lines.append,
                cancel=job.stop, on_point=job.points.append, on_generator=job.watch)

        run_to_end(job, work)

    def apply(self, result: SweepResult) -> dict[str, Any]:
        return apply_recommendation_at(result, self.base_url, self.api_key)


# --------------------------------------------------------------------------------------- views


def partial_result(job: SweepJob) -> SweepResult:
    """The sweep's result when it has ended, else one built from the points measured so far."""
    if job.result is not None:
        return job.result
    points = list(job.points)
    return SweepResult(points, job.spec.slo, job.spec.attainment, {},
                       pareto_ttft=pareto_front(points, "ttft_p99"), pareto_itl=pareto_front(points, "itl_p99"))


def point_rows(result: SweepResult) -> list[list[Any]]:
    """One row per grid point: knobs, throughput, P99 TTFT / ITL, goodput, SLO, fronts."""
    rows = []
    for i, p in enumerate(result.points):
        fronts = [name for name, front in (("TTFT", result.pareto_ttft), ("ITL", result.pareto_itl)) if i in front]
        measured = p.status is PointStatus.OK
        met = ("yes" if p.meets_slo else "no") if measured else "-"
        if i == result.recommended:
            met += " (recommended)"
        rows.append([i + 1, p.stage, *[p.knobs[k] for k in TUNED],
                     p.status if p.reason is None else f"{p.status}: {p.reason}",
                     None if p.output_throughput is None else round(p.output_throughput, 1),
                     to_ms(p.ttft_p99, 1), to_ms(p.itl_p99, 1), None if p.goodput is None else round(p.goodput, 3),
                     "-" if p.attainment is None else f"{p.attainment:.0%}", met,
                     ", ".join(fronts) or "-", p.run_id or "-"])
    return rows


def sweep_figure(result: SweepResult) -> go.Figure:
    """Output throughput vs P99 TTFT, the Pareto front highlighted (the report's chart)."""
    fig = pareto_figure(result, "ttft_p99", result.pareto_ttft, "P99 TTFT")
    fig.update_layout(height=420, margin={"l": 60, "r": 20, "t": 50, "b": 50})
    return fig


def progress_html(job: SweepJob) -> str:
    """Points done out of the coarse grid (then the refinement), the current point's requests and
    the sweep's own lines; the state in data-state for scripts and tests."""
    coarse = len(job.spec.grid.points())
    finished = [p for p in job.points if p.status is not PointStatus.PENDING]
    refined = sum(p.stage == "refine" for p in job.points)
    total = coarse + refined
    parts = [f'<div id="tune-state" data-state="{job.state}" data-points="{len(finished)}">',
             f"<b>Sweep</b> [{job.state}] {len(finished)} points done of {coarse} on the coarse grid"
             + (f" + {refined} refining" if refined else "")
             + f' <progress value="{len(finished)}" max="{max(total, 1)}" style="width:40%"></progress>']
    p = job.progress
    current = next((pt for pt in job.points if pt.status is PointStatus.PENDING), None)
    if current is not None and p is not None and not job.done.is_set():
        parts.append(f"<div>now {html.escape(current.label)}: {p.done}/{p.total} requests done, "
                     f"{p.in_flight} in flight, {p.elapsed_s:.1f} s</div>")
    if job.lines:
        parts.append("<pre style='white-space:pre-wrap'>" + html.escape("\n".join(job.lines)) + "</pre>")
    if job.error:
        parts.append(f"<div><b>Error:</b> {html.escape(job.error)}</div>")
    parts.append("</div>")
    return "".join(parts)


def recommendation_text(result: SweepResult | None) -> str:
    if result is None:
        return ""
    return "\n".join(f"- {line}" for line in summary_lines(result))


def write_report(result: SweepResult, fmt: str) -> Path:
    """The sweep report (appliance.bench.report.sweep) in `fmt` (a key of REPORT_FORMATS), written
    to a fresh temporary file for download."""
    if fmt not in REPORT_FORMATS:
        raise ValueError(f"unknown report format {fmt!r}; choose from {', '.join(REPORT_FORMATS)}")
    name, suffix = REPORT_FORMATS[fmt]
    path = Path(tempfile.mkdtemp(prefix="appliance-sweep-")) / f"sweep-report{suffix}"
    path.write_text(render_sweep(result, name), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------- panel


class TunePanel:
    """The sweep's form and results, under the load-test tab's workload fields (which it reuses)."""

    def __init__(self, ctx: DashboardContext, sweeps: Sweeps):
        self.ctx = ctx
        self.sweeps = sweeps

    def build(self) -> None:
        gr.Markdown("### Auto-tuning sweep\nThe workload and arrival above, a short run per grid point, "
                    "knobs changed live; the original knobs are restored afterwards.",
                    elem_id="tune-title")
        with gr.Row():
            self.seqs = gr.Textbox(DEFAULT_GRID["max_num_seqs"], label="max_num_seqs values",
                                   elem_id="tune-max-num-seqs")
            self.budgets = gr.Textbox(DEFAULT_GRID["max_num_batched_tokens"], label="max_num_batched_tokens values",
                                      elem_id="tune-budgets")
            self.chunks = gr.Textbox(DEFAULT_GRID["long_prefill_token_threshold"],
                                     label="chunk size (long_prefill_token_threshold) values", elem_id="tune-chunks")
        with gr.Row():
            self.per_point = gr.Number(DEFAULT_PER_POINT, label="Requests per point", precision=0, minimum=1,
                                       elem_id="tune-per-point")
            self.slo = gr.Textbox(DEFAULT_SLO, label="SLO (as --slo: ttft, tpot, e2e; ms or s)", elem_id="tune-slo")
            self.attainment = gr.Number(DEFAULT_ATTAINMENT, label="Share of requests within the SLO",
                                        minimum=0.01, maximum=1, elem_id="tune-attainment")
            self.refine = gr.Checkbox(True, label="Refine around the best point", elem_id="tune-refine")
            self.format = gr.Radio(list(REPORT_FORMATS), value="HTML", label="Report format", elem_id="tune-format")
        with gr.Row():
            self.run_button = gr.Button("Run sweep", variant="primary", elem_id="tune-run")
            self.cancel_button = gr.Button("Cancel sweep", variant="stop", elem_id="tune-cancel")
            self.apply_button = gr.Button("Apply recommendation", interactive=False, elem_id="tune-apply")
            self.export_button = gr.Button("Export sweep report", elem_id="tune-export")
        self.message = gr.Markdown("", elem_id="tune-message")
        self.progress = gr.HTML("", elem_id="tune-progress")
        self.points = gr.Dataframe(headers=POINT_HEADERS, value=[], interactive=False, label="Grid points",
                                   elem_id="tune-points")
        with gr.Row():
            self.chart = gr.Plot(elem_id="tune-chart", show_label=False)
            with gr.Column():
                self.recommendation = gr.Markdown("", elem_id="tune-recommendation")
                self.report = gr.File(label="Sweep report", interactive=False, elem_id="tune-report")
        self.result = gr.State(None)

    def wire(self, workload_inputs: list[Any], cancel: Callable[[gr.Request], str],
             after: Callable[..., Any], after_outputs: list[Any]) -> None:
        """`workload_inputs`: the tab's workload, arrival, rate, concurrency, max output, seed and
        upload fields; `cancel`: the tab's cancel handler; `after` runs when a sweep ends."""
        inputs = [*workload_inputs, self.seqs, self.budgets, self.chunks, self.per_point, self.slo,
                  self.attainment, self.refine, self.format]
        outputs = [self.message, self.progress, self.points, self.chart, self.recommendation,
                   self.apply_button, self.report, self.result]
        self.run_button.click(self.run, inputs, outputs, api_name="tune_run", show_progress="hidden",
                              concurrency_limit=None).then(after, None, after_outputs, api_name="tune_run_done")
        self.cancel_button.click(cancel, None, [self.message], api_name="tune_cancel")
        self.apply_button.click(self.apply, [self.result], [self.message], api_name="tune_apply")
        self.export_button.click(self.export, [self.result, self.format], [self.message, self.report],
                                 api_name="tune_export")

    def run(self, workload: str, arrival: str, rate: float, concurrency: float, max_output: float, seed: float,
            upload: str | None, seqs: str, budgets: str, chunks: str, per_point: float, slo: str,
            attainment: float, refine: bool, fmt: str, request: gr.Request) -> Iterator[list[Any]]:
        """Start a sweep and report its progress at once, then every POLL_S until it ends."""
        self.ctx.check(request)
        keep = gr.update()
        yield ["Preparing the sweep…", "", keep, keep, "", gr.update(interactive=False), None, None]
        try:
            spec = build_sweep_spec(workload, arrival, rate, concurrency, max_output, seed, upload, seqs,
                                    budgets, chunks, per_point, slo, attainment, refine)
        except (ValueError, FileNotFoundError) as exc:
            yield [f"**Error:** {exc}", keep, keep, keep, keep, keep, keep, keep]
            return
        job = self.sweeps.start(spec)
        shown = -1
        while True:
            result = partial_result(job)
            measured = sum(p.status is not PointStatus.PENDING for p in result.points)
            chart = keep
            if measured != shown:  # redraw only when a point has ended
                shown, chart = measured, sweep_figure(result)
            yield [f"Sweep running: {spec.load.workload}", progress_html(job), point_rows(result), chart,
                   keep, keep, keep, keep]
            if job.done.wait(POLL_S):
                break
        result = partial_result(job)
        message = f"Sweep {job.state}: {spec.load.workload}"
        if job.error:
            message += f"\n\n**Error:** {job.error}"
        report = None if job.result is None else str(write_report(job.result, fmt))
        rec = job.result is not None and job.result.recommendation is not None
        yield [message, progress_html(job), point_rows(result), sweep_figure(result),
               recommendation_text(job.result), gr.update(interactive=rec), report, job.result]

    def apply(self, result: SweepResult | None, request: gr.Request) -> str:
        """PATCH /admin/knobs with the recommendation (as `appliance tune --apply` does)."""
        self.ctx.check(request)
        if result is None or result.recommendation is None:
            return "Nothing to apply: run a sweep that finds a setting meeting the SLO first."
        try:
            view = self.sweeps.apply(result)
        except BenchError as exc:
            return f"**Error:** {exc}"
        knobs = ", ".join(f"{k}={v}" for k, v in result.recommendation.knobs.items())
        return f"Applied the recommendation: {knobs} (knobs version {view.get('version', '?')})."

    def export(self, result: SweepResult | None, fmt: str, request: gr.Request) -> list[Any]:
        self.ctx.check(request)
        if result is None:
            return ["Run a sweep first.", None]
        try:
            path = write_report(result, fmt)
        except ValueError as exc:
            return [f"**Error:** {exc}", None]
        return [f"Sweep report written: {path.name}.", str(path)]
