"""The operator dashboard: a Gradio Blocks app the server mounts at /ui.

It is a client of the appliance: it talks to the engine only through the server's public HTTP
API (at `base_url`, the server's own loopback URL) and reads telemetry only through
appliance.telemetry.queries / runs. With an API key the dashboard requires a login (any user
name, the key as password) and calls the API with the key on the server side only.

    mount_dashboard(app, base_url, db_url, api_key, configs_dir)   # what the server calls
    # which is:
    blocks = build_dashboard(base_url, db_url, api_key, configs_dir)
    gr.mount_gradio_app(app, blocks, path="/ui", auth=dashboard_auth(api_key))
"""

from __future__ import annotations

import hmac
import logging
import os
from pathlib import Path
from typing import Callable

import gradio as gr

from appliance.telemetry.store import make_engine
from ui.api_client import ApplianceAPI
from ui.chat_tab import ChatTab
from ui.context import DashboardContext
from ui.knobs_panel import KnobsPanel
from ui.live_tab import LiveTab
from ui.loadtest_tab import LoadTests, LoadTestTab, generator_factory
from ui.runs_tab import RunsTab
from ui.tune_panel import Sweeps, TunePanel
from ui.whatif_panel import WhatIfPanel

log = logging.getLogger(__name__)

TITLE = "Appliance dashboard"
LOGIN_MESSAGE = "This appliance runs with an API key: log in with any user name and the key as password."


def dashboard_auth(api_key: str | None) -> Callable[[str, str], bool] | None:
    """Gradio `auth` for mount_gradio_app: any user name, the API key as password."""
    if not api_key:
        return None

    def check(username: str, password: str) -> bool:
        return hmac.compare_digest(password.encode(), api_key.encode())

    return check


def build_dashboard(
    base_url: str, db_url: str, api_key: str | None = None, configs_dir: Path | None = None
) -> gr.Blocks:
    """The dashboard as a Blocks app (never launched here; the server mounts it)."""
    api = ApplianceAPI(base_url, api_key)
    ctx = DashboardContext(api=api, db_url=db_url, configs_dir=configs_dir, require_login=bool(api_key))
    db = make_engine(db_url)
    tests = LoadTests(db_url, generator_factory(base_url, api_key))
    knobs, live, chat = KnobsPanel(ctx), LiveTab(ctx, db), ChatTab(ctx)
    tune = TunePanel(ctx, Sweeps(tests, base_url, api_key))
    loadtest, runs_tab = LoadTestTab(ctx, tests, tune), RunsTab(ctx, db)
    whatif = WhatIfPanel(ctx, knobs)

    # After every event Gradio summarises its last GRADIO_ANALYTICS_MAX_EVENTS (10,000) events with
    # pandas, for its /monitoring page: with the Live tab's refresh every second per viewer that
    # grows to ~13 ms of server time per refresh. Summarise every 100 events, over the last 1,000.
    for name, value in (("GRADIO_ANALYTICS_CACHE_FREQUENCY", "100"), ("GRADIO_ANALYTICS_MAX_EVENTS", "1000")):
        os.environ.setdefault(name, value)
    with gr.Blocks(title=TITLE, analytics_enabled=False, fill_width=True) as blocks:
        gr.Markdown(f"## {TITLE}", elem_id="dashboard-title")
        with gr.Row():
            with gr.Column(scale=4, min_width=600):
                with gr.Tabs(elem_id="tabs"):
                    with gr.Tab("Live", id="live", elem_id="tab-live") as live_page:
                        live.build()
                    with gr.Tab("Chat", id="chat", elem_id="tab-chat") as chat_page:
                        chat.build()
                    with gr.Tab("Load test", id="loadtest", elem_id="tab-loadtest") as loadtest_page:
                        loadtest.build()
                    with gr.Tab("Runs", id="runs", elem_id="tab-runs") as runs_page:
                        runs_tab.build()
            with gr.Column(scale=1, min_width=300):
                knobs.build()
                whatif.build()
        live.wire(knobs.effective)
        # the Live charts refresh only while their tab is shown
        live_page.select(lambda: gr.Timer(active=True), None, live.timer, api_name="live_shown")
        for name, page in (("chat", chat_page), ("loadtest", loadtest_page), ("runs", runs_page)):
            page.select(lambda: gr.Timer(active=False), None, live.timer, api_name=f"{name}_shown")
        # the Runs list polls the store while its tab is shown (runs started from a terminal)
        runs_page.select(lambda: gr.Timer(active=True), None, runs_tab.timer, api_name="runs_poll_on")
        for name, page in (("live", live_page), ("chat", chat_page), ("loadtest", loadtest_page)):
            page.select(lambda: gr.Timer(active=False), None, runs_tab.timer, api_name=f"runs_poll_off_{name}")
        # the runs list is read again whenever its tab opens (a run started meanwhile, from here or
        # elsewhere, shows at once) and whenever a load test or sweep started here ends (after_job)
        runs_page.select(runs_tab.refresh, None, runs_tab.refresh_outputs, api_name="runs_opened",
                         show_progress="hidden")

        def after_job(request: gr.Request) -> list:
            return [*runs_tab.refresh(request), live.choices()]

        loadtest.wire(after_job, [*runs_tab.refresh_outputs, live.window])

        def on_load(request: gr.Request) -> list:
            return [*knobs.on_reload(request), *runs_tab.refresh(request), live.choices()]

        blocks.load(on_load, None, [*knobs.outputs, *runs_tab.refresh_outputs, live.window],
                    api_name="dashboard_load")
        blocks.load(whatif.on_load, None, whatif.load_outputs, api_name="whatif_load")
        blocks.load(knobs.autopilot.on_view, None, knobs.autopilot.outputs, api_name="autopilot_load")
    quiet_queue(blocks)
    return blocks


# While idle, Gradio's queue looks for new events every 1 ms and for progress updates every 10 ms:
# ~1,100 wake-ups a second in the server process (3-4 % of a core here, each taking the GIL from
# the engine's thread), whether or not a dashboard is open. A dashboard event may wait 20 ms to
# start instead (and gr.Progress, which the dashboard does not use, reports every 100 ms).
QUEUE_POLL_S = 0.02
PROGRESS_POLL_S = 0.1


def quiet_queue(blocks: gr.Blocks) -> None:
    """Slow down the idle polling of `blocks`' Gradio queue.

    Gradio has no public setting for it: this sets attributes of its private `Blocks._queue`
    (pyproject.toml pins the Gradio range tested; tests/test_library_internals.py fails, naming
    the version, when they move). A Gradio without them only logs a warning."""
    queue = getattr(blocks, "_queue", None)
    for name, seconds in (("sleep_when_free", QUEUE_POLL_S), ("progress_update_sleep_when_free", PROGRESS_POLL_S)):
        if isinstance(getattr(queue, name, None), (int, float)):
            setattr(queue, name, max(getattr(queue, name), seconds))
        else:
            log.warning("gradio %s has no Blocks._queue.%s: its idle polling stays at Gradio's default",
                        gr.__version__, name)


def mount_dashboard(app, base_url: str, db_url: str, api_key: str | None = None,
                    configs_dir: Path | None = None, path: str = "/ui") -> gr.Blocks:
    """Build the dashboard and mount it on a Starlette/FastAPI `app` at `path`, with the login
    the API key calls for."""
    blocks = build_dashboard(base_url, db_url, api_key, configs_dir)
    gr.mount_gradio_app(app, blocks, path=path, auth=dashboard_auth(api_key),
                        auth_message=LOGIN_MESSAGE if api_key else None)
    return blocks
