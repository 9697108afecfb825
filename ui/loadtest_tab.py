"""Load-test tab: run a workload against the server with appliance.bench, watch it, cancel it.

A job runs in a background thread with its own event loop; the bench runner stores each run in
the telemetry store and its requests go out with appliance_source "loadtest". One job at a time
(the appliance has one engine, and an A/B job switches its policy). "A/B" is appliance.bench.ab:
the same workload under continuous then static batching (PATCH /admin/knobs before each run),
then the policy that was in force is restored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import html
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol

import gradio as gr
import plotly.graph_objects as go

from appliance.bench.ab import ABResult, format_ab, run_ab
from appliance.bench.cli import build_workload, workload_args
from appliance.bench.loadgen import BenchError, LoadGenerator, Progress
from appliance.bench.runner import BenchmarkRun, run_benchmark
from appliance.bench.workloads import WORKLOADS, ClosedLoop
from appliance.numeric import to_ms
from appliance.policies import POLICIES
from ui import charts
from ui.context import DashboardContext

WORKLOAD_CHOICES = [("custom JSONL upload" if w == "jsonl" else w, w) for w in WORKLOADS]
ARRIVALS = ("all at once", "Poisson rate", "fixed concurrency")
POLL_S = 0.5
RESULT_HEADERS = ["leg", "status", "completed", "failed", "output tok/s", "req/s", "TTFT p50 ms",
                  "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "E2E p99 s", "run id"]


@dataclass(frozen=True)
class LoadSpec:
    """What the form asks for, checked."""

    requests: list[ClosedLoop]  # multi-turn: conversations
    workload: str  # description stored with the run
    rate: float | None
    concurrency: int | None
    seed: int
    name: str | None


def _positive_int(value: Any, what: str) -> int:
    if value is None or float(value) != int(float(value)) or int(float(value)) < 1:
        raise ValueError(f"{what} must be a positive whole number, got {value!r}")
    return int(float(value))


def build_spec(workload: str, num_requests: Any, arrival: str, rate: Any, concurrency: Any,
               max_output: Any, seed: Any, name: str | None, upload: str | None) -> LoadSpec:
    """Turn the form into a workload; ValueError/FileNotFoundError say what is wrong. For
    multi-turn, `num_requests` is the number of conversations and `max_output` caps each answer."""
    n = _positive_int(num_requests, "number of requests")
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}")
    if workload == "jsonl" and not upload:
        raise ValueError("upload a JSONL file for the custom workload")
    count = {"conversations": n} if workload == "multi-turn" else {"num_requests": n}
    args = workload_args(workload=workload, seed=int(seed or 0), file=upload if workload == "jsonl" else None,
                         **count)
    requests, description = build_workload(args)
    cap = int(float(max_output or 0))
    if cap < 0:
        raise ValueError(f"max output tokens must be 0 (the workload's own) or more, got {cap}")
    if cap:
        requests = [dataclasses.replace(r, output_len=min(r.output_len or cap, cap)) for r in requests]
        description += f" max_output={cap}"
    run_rate = float(rate) if arrival == "Poisson rate" else None
    if run_rate is not None and not run_rate > 0:
        raise ValueError(f"the Poisson rate must be above zero, got {rate!r}")
    run_concurrency = _positive_int(concurrency, "concurrency") if arrival == "fixed concurrency" else None
    return LoadSpec(requests, description, run_rate, run_concurrency, int(seed or 0),
                    (name or "").strip() or None)


@dataclass
class Leg:
    """One run of a job (an A/B job has two: continuous, then static)."""

    label: str
    progress: Progress | None = None
    run: BenchmarkRun | None = None
    started: bool = False


@dataclass
class Job:
    legs: list[Leg]
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    error: str | None = None
    ab: ABResult | None = None
    generator: LoadGenerator | None = None  # the one sending now (cancel stops it)

    @property
    def is_ab(self) -> bool:
        return len(self.legs) > 1

    def cancel(self) -> None:
        self.cancelled = True
        if self.generator is not None:
            self.generator.cancel()


class BackgroundJob(Protocol):
    """What LoadTests needs of a job: a load test, an A/B job or a tuning sweep (ui.tune_panel)."""

    done: threading.Event

    def cancel(self) -> None: ...


class LoadTests:
    """Runs at most one job at a time in a background thread with its own event loop.

    A single run goes through appliance.bench.runner; an A/B job through appliance.bench.ab,
    which switches the policy with PATCH /admin/knobs and restores it afterwards. A tuning
    sweep (ui.tune_panel) takes the same slot with `claim`, so Cancel stops whichever runs.
    """

    def __init__(self, db_url: str, make_generator: Callable[..., LoadGenerator]):
        self.db_url = db_url
        self.make_generator = make_generator
        self._lock = threading.Lock()
        self.current: BackgroundJob | None = None

    def claim(self, job: BackgroundJob) -> None:
        """Make `job` the current one; gr.Error while another job runs."""
        with self._lock:
            if self.current is not None and not self.current.done.is_set():
                raise gr.Error("a load test or sweep is already running; cancel it or wait for it to finish")
            self.current = job

    def start(self, spec: LoadSpec, ab: bool) -> Job:
        job = Job([Leg(p) for p in POLICIES] if ab else [Leg("run")])
        self.claim(job)
        threading.Thread(target=self._run, args=(job, spec), name="dashboard-loadtest", daemon=True).start()
        return job

    def cancel(self) -> bool:
        with self._lock:
            job = self.current
        if job is None or job.done.is_set():
            return False
        job.cancel()
        return True

    def _next_generator(self, job: Job, spec: LoadSpec) -> LoadGenerator:
        """A fresh generator for the job's next leg, reporting into that leg."""
        leg = next(leg for leg in job.legs if not leg.started)
        generator = self.make_generator(spec, lambda p: setattr(leg, "progress", p))
        job.generator = generator
        leg.started = True
        if job.cancelled:
            generator.cancel()
        return generator

    def _run(self, job: Job, spec: LoadSpec) -> None:
        def work() -> None:
            if job.is_ab:
                job.ab = asyncio.run(run_ab(lambda: self._next_generator(job, spec), workload=spec.workload,
                                            name=spec.name, db_url=self.db_url))
                for leg in job.legs:
                    leg.run = job.ab.runs.get(leg.label)
            else:
                generator = self._next_generator(job, spec)
                job.legs[0].run = asyncio.run(run_benchmark(generator, workload=spec.workload,
                                                            name=spec.name, db_url=self.db_url))

        run_to_end(job, work)


def run_to_end(job: Any, work: Callable[[], None]) -> None:
    """Run a background job's work; any failure becomes `job.error` (shown to the operator), and
    `job.done` is set whatever happens."""
    try:
        work()
    except BenchError as exc:
        job.error = str(exc)
    except Exception as exc:  # shown to the operator; the job must always end
        job.error = f"{type(exc).__name__}: {exc}"
    finally:
        job.done.set()


def generator_factory(base_url: str, api_key: str | None) -> Callable[..., LoadGenerator]:
    def make(spec: LoadSpec, progress: Callable[[Progress], None]) -> LoadGenerator:
        return LoadGenerator(spec.requests, base_url=base_url, rate=spec.rate,
                             concurrency=spec.concurrency, seed=spec.seed, api_key=api_key,
                             appliance_server=True, progress=progress)

    return make


# --------------------------------------------------------------------------------------- views


def leg_state(leg: Leg, job: Job) -> str:
    if leg.run is not None:
        return leg.run.status
    if not job.done.is_set():
        return "running" if leg.started else "waiting"
    if job.error and leg.started:
        return "failed"
    return "cancelled" if job.cancelled and leg.started else "not run"


def progress_html(job: Job) -> str:
    """One progress bar per leg, with the job state in data-state for scripts and tests."""
    state = "running" if not job.done.is_set() else (
        "cancelled" if job.cancelled else "failed" if job.error else "finished")
    parts = [f'<div id="loadtest-state" data-state="{state}">']
    for leg in job.legs:
        p = leg.progress
        done, total = (p.done, p.total) if p else (0, 0)
        text = (f"{done}/{total} done, {p.ok} ok, {p.failed} failed, {p.in_flight} in flight, "
                f"{p.elapsed_s:.1f} s, {p.output_throughput:.1f} output tok/s") if p else "not started"
        parts.append(
            f'<div class="leg" data-leg="{html.escape(leg.label)}" data-leg-state="{leg_state(leg, job)}">'
            f"<b>{html.escape(leg.label)}</b> [{leg_state(leg, job)}] "
            f'<progress value="{done}" max="{max(total, 1)}" style="width:50%"></progress> '
            f"{html.escape(text)}</div>"
        )
    if job.error:
        parts.append(f"<div><b>Error:</b> {html.escape(job.error)}</div>")
    parts.append("</div>")
    return "".join(parts)


def result_rows(job: Job) -> list[list[Any]]:
    rows = []
    for leg in job.legs:
        if leg.run is None:
            continue
        s = leg.run.load.summary
        rows.append([leg.label, leg.run.status, s.completed, s.failed, round(s.output_throughput, 1),
                     round(s.request_throughput, 2), to_ms(s.ttft.p50, 1), to_ms(s.ttft.p99, 1), to_ms(s.itl.p50, 1),
                     to_ms(s.itl.p99, 1), None if s.e2e.p99 is None else round(s.e2e.p99, 2), leg.run.run_id])
    return rows


def result_figure(job: Job) -> go.Figure:
    """The legs side by side: output tokens/s, and TTFT / ITL percentiles."""
    labels = ["TTFT p50", "TTFT p99", "ITL p50", "ITL p99"]
    throughput, latency = {}, {}
    for leg in job.legs:
        if leg.run is not None:
            s = leg.run.load.summary
            throughput[leg.label] = round(s.output_throughput, 1)
            latency[leg.label] = [to_ms(s.ttft.p50, 1), to_ms(s.ttft.p99, 1), to_ms(s.itl.p50, 1), to_ms(s.itl.p99, 1)]
    title = "A/B: continuous vs static" if job.is_ab else "Load test result"
    return charts.side_by_side_figure(title, throughput, latency, labels)


class LoadTestTab:
    """The load-test form, its jobs and, under them, the auto-tuning sweep (`tune`: a
    ui.tune_panel.TunePanel, which reuses the workload and arrival fields)."""

    def __init__(self, ctx: DashboardContext, tests: LoadTests, tune: Any = None):
        self.ctx = ctx
        self.tests = tests
        self.tune = tune

    def build(self) -> None:
        with gr.Row():
            self.workload = gr.Dropdown(WORKLOAD_CHOICES, value="skewed", label="Workload",
                                        elem_id="loadtest-workload")
            self.num_requests = gr.Number(16, label="Number of requests (multi-turn: conversations)",
                                          precision=0, minimum=1,
                                          elem_id="loadtest-requests")
            self.max_output = gr.Number(0, label="Max output tokens per request (0: the workload's)",
                                        precision=0, minimum=0, elem_id="loadtest-max-output")
            self.seed = gr.Number(0, label="Seed", precision=0, elem_id="loadtest-seed")
        with gr.Row():
            self.arrival = gr.Radio(list(ARRIVALS), value="all at once", label="Arrival",
                                    elem_id="loadtest-arrival")
            self.rate = gr.Number(4.0, label="Poisson rate (requests/s)", elem_id="loadtest-rate")
            self.concurrency = gr.Number(8, label="Concurrency", precision=0, elem_id="loadtest-concurrency")
        with gr.Row():
            self.name = gr.Textbox(label="Run name (optional)", elem_id="loadtest-name")
            self.upload = gr.File(label="Custom JSONL", file_types=[".jsonl"], type="filepath",
                                  elem_id="loadtest-jsonl")
        with gr.Row():
            self.start_button = gr.Button("Start", variant="primary", elem_id="loadtest-start")
            self.ab_button = gr.Button("A/B: continuous vs static", elem_id="loadtest-ab")
            self.cancel_button = gr.Button("Cancel", variant="stop", elem_id="loadtest-cancel")
        self.message = gr.Markdown("", elem_id="loadtest-message")
        self.progress = gr.HTML("", elem_id="loadtest-progress")
        self.results = gr.Dataframe(headers=RESULT_HEADERS, value=[], interactive=False,
                                    label="Results", elem_id="loadtest-results")
        self.chart = gr.Plot(elem_id="loadtest-chart", show_label=False)
        if self.tune is not None:
            self.tune.build()

    def wire(self, after: Callable[..., Any], after_outputs: list[Any]) -> None:
        """Wire the buttons; `after` runs when a job ends (e.g. refresh the runs table)."""
        inputs = [self.workload, self.num_requests, self.arrival, self.rate, self.concurrency,
                  self.max_output, self.seed, self.name, self.upload]
        outputs = [self.message, self.progress, self.results, self.chart]
        for button, ab, api_name in ((self.start_button, False, "loadtest_start"),
                                     (self.ab_button, True, "loadtest_ab")):
            handler = self._start_ab if ab else self._start
            button.click(handler, inputs, outputs, api_name=api_name, show_progress="hidden",
                         concurrency_limit=None).then(after, None, after_outputs,
                                                      api_name=f"{api_name}_done")
        self.cancel_button.click(self.on_cancel, None, [self.message], api_name="loadtest_cancel")
        if self.tune is not None:
            workload = [self.workload, self.arrival, self.rate, self.concurrency, self.max_output, self.seed,
                        self.upload]
            self.tune.wire(workload, self.on_cancel, after, after_outputs)

    def _start(self, workload: str, num_requests: float, arrival: str, rate: float, concurrency: float,
               max_output: float, seed: float, name: str, upload: str | None,
               request: gr.Request) -> Iterator[list[Any]]:
        form = (workload, num_requests, arrival, rate, concurrency, max_output, seed, name, upload)
        yield from self.run(form, ab=False, request=request)

    def _start_ab(self, workload: str, num_requests: float, arrival: str, rate: float,
                  concurrency: float, max_output: float, seed: float, name: str, upload: str | None,
                  request: gr.Request) -> Iterator[list[Any]]:
        form = (workload, num_requests, arrival, rate, concurrency, max_output, seed, name, upload)
        yield from self.run(form, ab=True, request=request)

    def run(self, form: tuple[Any, ...], ab: bool, request: gr.Request) -> Iterator[list[Any]]:
        """Start a job and report its progress at once, then every POLL_S until it ends."""
        self.ctx.check(request)
        yield ["Preparing the workload…", "", gr.update(), gr.update()]
        try:
            spec = build_spec(*form)
        except (ValueError, FileNotFoundError) as exc:
            yield [f"**Error:** {exc}", gr.update(), gr.update(), gr.update()]
            return
        job = self.tests.start(spec, ab)
        label = "A/B job" if ab else "Load test"
        while True:
            yield [f"{label} running: {spec.workload}", progress_html(job), result_rows(job), gr.update()]
            if job.done.wait(POLL_S):
                break
        end = "cancelled" if job.cancelled else "failed" if job.error else "finished"
        message = f"{label} {end}: {spec.workload}"
        if job.error:
            message += f"\n\n**Error:** {job.error}"
        if job.ab is not None:
            message += f"\n\n```\n{format_ab(job.ab)}\n```"
        yield [message, progress_html(job), result_rows(job), result_figure(job)]

    def on_cancel(self, request: gr.Request) -> str:
        self.ctx.check(request)
        job = self.tests.current
        if not self.tests.cancel():
            return "No load test is running."
        return "Cancelling the load test…" if isinstance(job, Job) else "Cancelling the sweep…"
