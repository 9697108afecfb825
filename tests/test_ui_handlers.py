"""The dashboard's flows through gradio_client against the real server (dashboard at /ui):
the same handlers the browser calls, checked against the server's API and telemetry store."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import httpx
import pytest
from gradio_client import Client

from appliance.server.autopilot_policy import parse_spec
from appliance.telemetry import runs
from appliance.telemetry.models import Request
from appliance.telemetry.store import make_engine
from sqlalchemy import select

from conftest import serve_dashboard
from ui.chat_tab import STATS_HEADERS

DEFAULT_FORM = (64, 512, 256, 1, 1, "continuous", True)  # Knobs() defaults, in the order of the form
NO_REPLIES = {"headers": STATS_HEADERS, "data": [], "metadata": None}  # the empty per-reply table


@pytest.fixture(scope="module")
def server(dashboard_server):
    return dashboard_server


@pytest.fixture
def client(server):
    return Client(server.ui_url, verbose=False)


@pytest.fixture
def restore_knobs(server):
    """Put the server back on the default knobs after the test."""
    yield
    httpx.patch(f"{server.base_url}/admin/knobs", json=dict(zip(
        ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold",
         "max_num_partial_prefills", "max_long_partial_prefills", "scheduling_policy",
         "enable_prefix_caching"), DEFAULT_FORM)))


def knobs(server) -> dict:
    return httpx.get(f"{server.base_url}/admin/knobs").json()


def wait_for(predicate, timeout: float = 20.0, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("condition not met in time")


# ------------------------------------------------------------------------------------- knobs


def test_reload_shows_the_knobs_in_force_and_the_fixed_settings(server, client):
    status, effective, fixed, *form = client.predict(api_name="/knobs_reload")
    current = knobs(server)
    values = [u["value"] if isinstance(u, dict) else u for u in form]
    assert values == [current["knobs"][k] for k in ("max_num_seqs", "max_num_batched_tokens",
                                                     "long_prefill_token_threshold", "max_num_partial_prefills",
                                                     "max_long_partial_prefills", "scheduling_policy",
                                                     "enable_prefix_caching")]
    assert f"version {current['version']}" in effective
    for key in ("model", "device", "num_blocks", "block_size", "max_model_len"):
        assert f"| {key} | {current['fixed'][key]} |" in fixed


def test_apply_sends_one_patch_and_reports_where_it_took_effect(server, client, restore_knobs):
    before = knobs(server)
    form = (24, 512, 128, 1, 1, "continuous", True)
    status, effective, *_ = client.predict(*form, api_name="/knobs_apply")
    after = knobs(server)
    assert after["knobs"]["max_num_seqs"] == 24 and after["knobs"]["long_prefill_token_threshold"] == 128
    assert after["version"] == before["version"] + 1  # both changes in ONE patch
    assert "Applied" in status and "max_num_seqs 64→24" in status and "long_prefill_token_threshold 256→128" in status
    assert f"version {after['version']}" in status and f"iteration {after['iteration']}" in status
    history = httpx.get(f"{server.base_url}/admin/knobs/history").json()["data"]
    assert history[-1]["source"] == "dashboard" and history[-1]["version"] == after["version"]
    # the same values again: nothing to send
    status, *_ = client.predict(*form, api_name="/knobs_apply")
    assert "nothing to apply" in status and knobs(server)["version"] == after["version"]


def test_the_prefix_caching_switch_is_a_live_knob(server, client, restore_knobs):
    status, *form = client.predict(64, 512, 256, 1, 1, "continuous", False, api_name="/knobs_apply")
    assert "enable_prefix_caching True→False" in status
    assert knobs(server)["knobs"]["enable_prefix_caching"] is False
    assert (form[-1]["value"] if isinstance(form[-1], dict) else form[-1]) is False


def test_an_invalid_set_shows_the_servers_message_and_applies_nothing(server, client):
    before = knobs(server)
    status, effective, *_ = client.predict(64, 512, 1024, 1, 1, "continuous", True, api_name="/knobs_apply")
    assert "Rejected — nothing applied" in status
    assert "long_prefill_token_threshold (1024) must be <= max_num_batched_tokens (512)" in status
    assert knobs(server) == before
    assert f"version {before['version']}" in effective
    status, *_ = client.predict(64, 512, 256, 1, 1, "static", True, api_name="/knobs_apply")  # valid again
    assert "Applied" in status
    client.predict(*DEFAULT_FORM, api_name="/knobs_apply")


def test_presets_apply_the_knob_keys_of_the_config_files(server, client, restore_knobs):
    import tomllib

    configs = Path(__file__).resolve().parents[1] / "configs"
    for name in ("latency", "throughput"):
        status, *_ = client.predict(api_name=f"/knobs_preset_{name}")
        with (configs / f"{name}.toml").open("rb") as fh:
            preset = tomllib.load(fh)
        current = knobs(server)["knobs"]
        assert {k: current[k] for k in current if k in preset} == {k: preset[k] for k in current if k in preset}
        assert f"preset {name}" in status and "Applied" in status


# -------------------------------------------------------------------------------------- live


def test_live_refresh_charts_the_telemetry_and_marks_knob_changes(server, client, restore_knobs):
    httpx.post(f"{server.base_url}/v1/completions", timeout=60,
               json={"prompt": "Hello there", "max_tokens": 8, "min_tokens": 8, "ignore_eos": True})
    client.predict(32, 512, 256, 1, 1, "continuous", True, api_name="/knobs_apply")
    time.sleep(0.5)  # the writer flushes every 0.1 s

    def labels(plot: dict) -> list[str]:
        return [a.get("text", "") for a in json.loads(plot["plot"])["layout"].get("annotations", [])]

    def refreshed():
        out = client.predict("1m", False, "", api_name="/live_refresh")
        return out if any("max_num_seqs 64→32" in text for text in labels(out[1])) else None

    headline, *plots, effective = wait_for(refreshed)
    state = httpx.get(f"{server.base_url}/admin/state").json()
    assert state["model"] in headline and 'data-stat="uptime"' in headline
    assert len(plots) == 10
    assert 'data-stat="holding"' in headline  # the reading of what is holding traffic back
    figures = [json.loads(p["plot"]) for p in plots]
    for plot, figure in zip(plots, figures):
        assert plot["type"] == "plotly"
        assert any("max_num_seqs 64→32" in text for text in labels(plot))  # every chart marks it
    assert figures[0]["layout"]["title"]["text"].startswith("Running vs max_num_seqs")
    assert figures[6]["layout"]["title"]["text"].startswith("TTFT percentiles")
    # output tokens/s of the completion above (None marks idle gaps, which break the line)
    assert max(y for y in figures[5]["data"][0]["y"] if y is not None) > 0
    assert "| max_num_seqs | 32 |" in effective


def test_the_holding_reading_carries_the_whatifs_forecast_of_the_raise_it_recommends(loaded_model, tmp_path):
    """max_num_seqs 2 under 12 requests at once: it holds the queueing with the cache nearly empty,
    so the reading recommends raising it, and the what-if's replay of that raise joins the line."""
    import re
    from concurrent.futures import ThreadPoolExecutor

    with serve_dashboard(loaded_model, f"sqlite:///{tmp_path / 'forecast.db'}", max_num_seqs=2) as srv:
        body = {"prompt": "Hello there", "max_tokens": 8, "min_tokens": 8, "ignore_eos": True}
        with ThreadPoolExecutor(12) as pool:
            replies = list(pool.map(lambda _: httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=120),
                                    range(12)))
        assert all(r.status_code == 200 for r in replies)
        client = Client(srv.ui_url, verbose=False)

        def forecast():
            headline = client.predict("1m", False, "", api_name="/live_refresh")[0]
            return headline if "what-if replay" in headline else None

        headline = wait_for(forecast, timeout=90, every=1.0)
    assert "was max_num_seqs (2) while KV usage stayed under" in headline
    assert re.search(r"raising max_num_seqs should help\. The what-if replay of the last 1 min predicts TTFT p99 "
                     r"[0-9.]+ m?s → [0-9.]+ m?s with max_num_seqs 2 → 4 \(step-time model held-out error "
                     r"[0-9]+ %\)\.", headline), headline


# -------------------------------------------------------------------------------------- chat


def test_chat_streams_multi_turn_with_reply_figures(server, client):
    outputs = list(client.submit("Name a colour.", [], "You are terse.", 0.0, 12, NO_REPLIES, api_name="/chat"))
    assert len(outputs) >= 3  # the user turn, then the reply growing as it streams
    chat, box, error, table = outputs[-1]
    assert error == "" and box == ""
    assert [m["role"] for m in chat] == ["user", "assistant"]
    reply = chat[-1]["content"][0]["text"]
    assert reply
    partial = [o[0][-1]["content"][0]["text"] for o in outputs[1:-1] if len(o[0]) == 2 and o[0][-1]["content"]]
    assert any(len(p) < len(reply) for p in partial if p)  # text appeared before the reply ended
    (row,) = table["data"]
    assert row[0] == 1 and row[1] > 0 and 0 < row[3] <= 12 and row[5] in ("stop", "length")
    cached, prompt = map(int, row[4].split(" / "))  # prompt tokens served from the prefix cache
    assert 0 <= cached < prompt
    # second turn: the earlier turns go with it
    outputs = list(client.submit("And another.", chat, "You are terse.", 0.0, 12, table, api_name="/chat"))
    chat, _, error, table = outputs[-1]
    assert error == "" and [m["role"] for m in chat] == ["user", "assistant", "user", "assistant"]
    assert [r[0] for r in table["data"]] == [1, 2]
    cached, prompt = map(int, table["data"][1][4].split(" / "))
    assert cached >= 16 and cached < prompt  # the first turn's full blocks came from the cache
    chat, error, table = client.predict(api_name="/chat_clear")
    assert chat == [] and error == "" and table["data"] == []


def test_enter_sends_the_message_and_shift_enter_adds_a_line(server):
    """The message box is a one-line box that grows (Gradio submits on Enter only there; a
    textarea adds a line on Shift+Enter) and its submit event is the chat handler."""
    config = httpx.get(f"{server.ui_url}config").json()
    (box,) = [c for c in config["components"] if c.get("props", {}).get("elem_id") == "chat-input"]
    assert box["props"]["lines"] == 1 and box["props"]["max_lines"] > 1
    assert "Enter sends" in box["props"]["placeholder"]
    submits = [d for d in config["dependencies"] if [box["id"], "submit"] in d["targets"]]
    assert [d["api_name"] for d in submits] == ["chat_submit"]


def test_chats_from_several_tabs_run_at_once(server):
    clients = [Client(server.ui_url, verbose=False) for _ in range(2)]
    first_token: dict[int, float] = {}
    ended: dict[int, float] = {}

    def chat(i: int) -> None:
        for out in clients[i].submit("Count from one to twenty.", [], "", 0.0, 40, NO_REPLIES, api_name="/chat"):
            if len(out[0]) == 2 and out[0][-1]["content"] and i not in first_token:
                first_token[i] = time.monotonic()
        ended[i] = time.monotonic()

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert set(ended) == {0, 1}
    # each reply started streaming before the other one ended: they overlapped
    assert first_token[0] < ended[1] and first_token[1] < ended[0]


def test_stop_aborts_the_request_on_the_server(server, client):
    submitted = time.time()  # only this test's request: earlier tests on this server aborted chats too
    job = client.submit("Write a very long story about a dragon.", [], "", 1.0, 2000, NO_REPLIES, api_name="/chat")
    wait_for(lambda: any(len(o[0]) == 2 and o[0][-1]["content"] for o in job.outputs()), timeout=60)
    job.cancel()

    def aborted():
        with make_engine(server.db_url).connect() as conn:
            rows = conn.execute(select(Request.finish_reason, Request.output_tokens)
                                .where(Request.source == "chat", Request.arrival >= submitted)).all()
        return [r for r in rows if r.finish_reason == "abort"]

    (row,) = wait_for(aborted, timeout=30)
    assert row.output_tokens < 2000
    assert wait_for(lambda: httpx.get(f"{server.base_url}/admin/state").json()["running"] == 0)


def test_chat_refuses_an_empty_message(client):
    chat, box, error, table = client.predict("   ", [], "", 0.7, 16, NO_REPLIES, api_name="/chat")
    assert "Type a message" in error and chat == []


# --------------------------------------------------------------------------------- load tests


def _final(job):
    outputs = list(job)
    return outputs, outputs[-1]


def test_load_test_runs_reports_progress_and_is_stored(server, client):
    job = client.submit("skewed", 4, "all at once", 4, 2, 8, 0, "ui smoke", None, api_name="/loadtest_start")
    outputs, (message, progress, results, _chart) = _final(job)
    assert "finished" in message and 'data-state="finished"' in progress
    assert any('data-state="running"' in o[1] for o in outputs[:-1])  # progress reported from the start
    (row,) = results["data"]
    assert row[1] == "completed" and row[2] == 4 and row[3] == 0
    run = runs.get_run(server.db_url, row[-1], with_requests=True)
    assert run["status"] == "completed" and run["name"] == "ui smoke" and len(run["requests"]) == 4
    assert run["knobs"]["knobs"] == knobs(server)["knobs"]
    store = make_engine(server.db_url)

    def sources() -> list[str]:  # the server's own request records, which its telemetry writer lands in batches
        with store.connect() as conn:
            return conn.execute(select(Request.source).where(Request.run_id == row[-1])).scalars().all()

    landed = wait_for(lambda: len(found := sources()) == 4 and found)
    assert set(landed) == {"loadtest"}
    table, select_update = client.predict(api_name="/runs_refresh")
    assert row[-1] in [r[-1] for r in table["data"]]
    assert row[-1] in [c[1] for c in select_update["choices"]]


def test_load_test_of_an_uploaded_jsonl(server, client, tmp_path):
    from gradio_client import handle_file

    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "The sky is", "max_tokens": 3}\n{"prompt_ids": [504, 3276, 314], "output_len": 2}\n')
    job = client.submit("jsonl", 2, "fixed concurrency", 4, 1, 0, 0, "upload", handle_file(str(path)),
                        api_name="/loadtest_start")
    _, (message, progress, results, _chart) = _final(job)
    (row,) = results["data"]
    assert row[1] == "completed" and row[2] == 2
    run = runs.get_run(server.db_url, row[-1], with_requests=True)
    assert run["workload"].startswith("jsonl") and [r["output_tokens"] for r in run["requests"]] == [3, 2]


def test_load_test_of_multi_turn_conversations(server, client):
    job = client.submit("multi-turn", 2, "fixed concurrency", 4, 2, 3, 0, "chats", None, api_name="/loadtest_start")
    _, (message, progress, results, _chart) = _final(job)
    (row,) = results["data"]
    assert "finished" in message and row[1] == "completed" and row[3] == 0
    run = runs.get_run(server.db_url, row[-1], with_requests=True)
    assert run["workload"].startswith("multi-turn conversations=2 ") and run["workload"].endswith(" max_output=3")
    summary = run["summary"]["summary"]
    assert 6 <= row[2] == summary["num_requests"] == len(run["requests"]) <= 8  # 2 conversations x 3-4 turns
    assert {r["output_tokens"] for r in run["requests"]} == {3} and summary["total_cached_tokens"] > 0


def test_load_test_form_errors_are_shown(client):
    message, *_ = client.predict("jsonl", 4, "all at once", 4, 2, 0, 0, "", None, api_name="/loadtest_start")
    assert "upload a JSONL" in message


def test_cancel_stops_a_running_load_test(server, client):
    job = client.submit("skewed", 24, "fixed concurrency", 4, 2, 64, 0, "to cancel", None,
                        api_name="/loadtest_start")
    wait_for(lambda: any('data-state="running"' in o[1] for o in job.outputs()), timeout=60)
    assert "Cancelling" in Client(server.ui_url, verbose=False).predict(api_name="/loadtest_cancel")
    outputs, (message, progress, results, _chart) = _final(job)
    assert "cancelled" in message and 'data-state="cancelled"' in progress
    (row,) = results["data"]
    assert row[1] == "cancelled" and row[2] < 24
    assert runs.get_run(server.db_url, row[-1])["status"] == "cancelled"
    assert "No load test" in client.predict(api_name="/loadtest_cancel")


def test_ab_runs_both_policies_side_by_side_and_restores_the_policy(server, client):
    before = knobs(server)
    job = client.submit("skewed", 4, "all at once", 4, 2, 8, 0, "ab", None, api_name="/loadtest_ab")
    _, (message, progress, results, chart) = _final(job)
    assert "finished" in message and "static/cont." in message  # the bench's side-by-side table
    legs = {r[0]: r for r in results["data"]}
    assert set(legs) == {"continuous", "static"} and all(r[1] == "completed" for r in legs.values())
    for policy, row in legs.items():
        run = runs.get_run(server.db_url, row[-1])
        assert run["knobs"]["knobs"]["scheduling_policy"] == policy and run["name"] == f"ab [{policy}]"
    assert {t["name"] for t in json.loads(chart["plot"])["data"]} == {"continuous", "static"}
    after = knobs(server)
    assert after["knobs"]["scheduling_policy"] == before["knobs"]["scheduling_policy"] == "continuous"
    history = httpx.get(f"{server.base_url}/admin/knobs/history").json()["data"]
    switches = [h for h in history if h["version"] > before["version"]]
    assert [h["new"]["scheduling_policy"] for h in switches] == ["static", "continuous"]


# --------------------------------------------------------------------------------------- runs


def test_the_runs_list_reloads_when_its_tab_opens_and_when_a_job_ends(server, client):
    """A run started elsewhere (here: written straight to the store, as `appliance bench` does)
    is listed as soon as the Runs tab opens; a load test, A/B job or sweep started on the
    dashboard reloads the list when it ends."""
    run_id = runs.create_run(server.db_url, "started elsewhere", "skewed n=1 seed=0", {"mode": "all-at-once"},
                             knobs(server), "cli")
    try:
        table, select_update = client.predict(api_name="/runs_opened")
        (row,) = [r for r in table["data"] if r[-1] == run_id]
        assert row[1] == "started elsewhere" and row[2] == "running"
        assert run_id in [c[1] for c in select_update["choices"]]
    finally:
        runs.finish_run(server.db_url, run_id, "failed")
    config = httpx.get(f"{server.ui_url}config").json()
    by_name = {d["api_name"]: d for d in config["dependencies"]}
    tab = next(c["id"] for c in config["components"] if c.get("props", {}).get("elem_id") == "tab-runs")
    assert [tab, "select"] in by_name["runs_opened"]["targets"]
    runs_table = next(c["id"] for c in config["components"] if c.get("props", {}).get("elem_id") == "runs-table")
    for job in ("loadtest_start", "loadtest_ab", "tune_run"):
        assert runs_table in by_name[f"{job}_done"]["outputs"]


def test_the_open_runs_tab_shows_a_run_started_elsewhere_without_a_refresh(server, client):
    """While the Runs tab is shown its timer polls: a run created in the store (as a terminal's
    `appliance bench` does) appears with the operator's selection kept, and a poll that finds
    nothing new sends nothing."""
    def create(name: str) -> str:
        return runs.create_run(server.db_url, name, "skewed n=1 seed=0", {"mode": "all-at-once"}, knobs(server), "cli")

    first = create("selected before")
    later = None
    try:
        table, select = client.predict([], api_name="/runs_poll")  # the session's first poll lists all
        assert first in [r[-1] for r in table["data"]] and first in [c[1] for c in select["choices"]]
        unchanged = client.predict([first], api_name="/runs_poll")
        assert all(set(update) == {"__type__"} for update in unchanged)  # skipped: nothing re-sent
        later = create("from a terminal")
        table, select = client.predict([first], api_name="/runs_poll")
        assert later in [r[-1] for r in table["data"]] and later in [c[1] for c in select["choices"]]
        assert select["value"] == [first]
    finally:
        for run_id in filter(None, (first, later)):
            runs.finish_run(server.db_url, run_id, "failed")
    config = httpx.get(f"{server.ui_url}config").json()
    by_name = {d["api_name"]: d for d in config["dependencies"]}
    tab = next(c["id"] for c in config["components"] if c.get("props", {}).get("elem_id") == "tab-runs")
    assert [tab, "select"] in by_name["runs_poll_on"]["targets"]


def test_compare_and_export_stored_runs(server, client):
    ids = [r["id"] for r in runs.list_runs(server.db_url) if r["status"] == "completed"][:2]
    if len(ids) < 2:
        for i in range(2 - len(ids)):
            _final(client.submit("skewed", 2, "all at once", 4, 2, 4, i, f"cmp {i}", None,
                                 api_name="/loadtest_start"))
        ids = [r["id"] for r in runs.list_runs(server.db_url) if r["status"] == "completed"][:2]
    client.predict(api_name="/runs_refresh")  # as the page does on load: the selector lists the runs
    status, *plots = client.predict(ids[:1], api_name="/runs_compare")
    assert "two or more" in status
    status, throughput, latency, overlay = client.predict(ids, api_name="/runs_compare")
    assert "Comparing 2 runs" in status
    for plot in (throughput, latency, overlay):
        names_shown = [t["name"] for t in json.loads(plot["plot"])["data"]]
        assert [n[-9:-1] for n in names_shown] == [run_id[:8] for run_id in ids]
    names = [runs.get_run(server.db_url, i)["name"] for i in ids]
    for fmt, suffix in (("HTML", ".html"), ("Markdown", ".md"), ("CSV", ".csv")):
        status, path = client.predict(ids, fmt, api_name="/report_export")
        assert "Report written" in status and path.endswith(suffix)
        text = Path(path).read_text()
        assert all(name in text for name in names)
    status, path = client.predict([], "CSV", api_name="/report_export")
    assert "at least one run" in status and path is None


# --------------------------------------------------------------------------------------- auth


def test_with_an_api_key_the_dashboard_needs_a_login_and_keeps_the_key(loaded_model, tmp_path):
    key = "sk-dashboard-secret"
    with serve_dashboard(loaded_model, f"sqlite:///{tmp_path / 'auth.db'}", api_key=key, num_blocks=64) as srv:
        page = httpx.get(srv.ui_url)
        assert page.status_code == 200 and key not in page.text
        config = httpx.get(f"{srv.base_url}/ui/config")
        assert config.status_code == 401 or config.json().get("auth_required")
        with pytest.raises(Exception):
            Client(srv.ui_url, verbose=False, auth=("operator", "wrong"))
        authed = Client(srv.ui_url, verbose=False, auth=("operator", key))
        status, effective, fixed, *form = authed.predict(api_name="/knobs_reload")
        assert "In force" in effective  # the dashboard called /admin with the key, server-side
        status, *_ = authed.predict(8, 512, 256, 1, 1, "continuous", api_name="/knobs_apply")
        assert "Applied" in status
        assert httpx.get(f"{srv.base_url}/admin/knobs", headers={"Authorization": f"Bearer {key}"}
                         ).json()["knobs"]["max_num_seqs"] == 8
        with httpx.Client(base_url=srv.base_url) as browser:  # what a logged-in browser receives
            assert browser.post("/ui/login", data={"username": "op", "password": key}).status_code == 200
            assert key not in browser.get("/ui/config").text
            assert key not in browser.get("/ui/").text


def test_handlers_refuse_sessions_without_a_login_even_when_mounted_without_auth(server):
    import gradio as gr
    from gradio_client.exceptions import AppError
    from starlette.applications import Starlette

    from conftest import run_app
    from ui.app import build_dashboard

    app = Starlette()
    gr.mount_gradio_app(app, build_dashboard(server.base_url, server.db_url, api_key="sk-x"), path="/ui")
    with run_app(app) as url:
        anonymous = Client(f"{url}/ui/", verbose=False)
        for api_name, args in (("/knobs_reload", ()), ("/knobs_apply", (8, 512, 256, 1, 1, "static")),
                               ("/live_refresh", ("1m", False, ""))):
            with pytest.raises(AppError, match="log in"):
                anonymous.predict(*args, api_name=api_name)
    assert knobs(server)["knobs"]["scheduling_policy"] == "continuous"


# ---------------------------------------------------------------------------------- access log


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_the_dashboards_polling_stays_out_of_the_access_log_at_info(server, client):
    """At INFO the access log keeps an operator's requests and drops the dashboard's refresh
    (Gradio queue events, its GETs of /admin/*); at DEBUG those show, as DEBUG records."""
    logger = logging.getLogger("uvicorn.access")
    capture, level = _Records(), logger.level
    logger.addHandler(capture)
    try:
        logger.setLevel(logging.INFO)
        client.predict("1m", False, "", api_name="/live_refresh")
        dashboard = {"X-Appliance-Source": "dashboard"}
        httpx.get(f"{server.base_url}/admin/state", headers=dashboard)
        httpx.get(f"{server.base_url}/admin/knobs", headers=dashboard)
        httpx.get(f"{server.base_url}/admin/state")  # an operator's request
        httpx.get(f"{server.base_url}/v1/models")
        info = [r.getMessage() for r in capture.records]
        assert sum("GET /admin/state" in line for line in info) == 1  # the operator's, not the dashboard's
        assert not any("GET /admin/knobs" in line for line in info)
        assert any("GET /v1/models" in line for line in info)
        assert not any("/gradio_api/queue/" in line for line in info)  # the live_refresh event

        capture.records.clear()
        logger.setLevel(logging.DEBUG)
        httpx.get(f"{server.base_url}/admin/knobs", headers=dashboard)
        (record,) = [r for r in capture.records if "GET /admin/knobs" in r.getMessage()]
        assert record.levelno == logging.DEBUG
    finally:
        logger.removeHandler(capture)
        logger.setLevel(level)


def test_slowest_requests_list_and_explain_one(server, client):
    httpx.post(f"{server.base_url}/v1/completions", timeout=60,
               json={"prompt": "Why is the sky blue?", "max_tokens": 6, "min_tokens": 6, "ignore_eos": True})

    def listed():
        rows = client.predict("1m", "e2e", api_name="/live_slowest")["data"]
        return rows or None

    rows = wait_for(listed)
    e2e = [float(r[2]) for r in rows]
    assert e2e == sorted(e2e, reverse=True)  # slowest first
    split, plot = client.predict(rows[0][0], api_name="/live_request_split")
    assert f"(row {rows[0][0]})" in split and "· queueing" in split and "· prefill compute" in split
    figure = json.loads(plot["plot"])
    assert [t["name"] for t in figure["data"]] == ["batch size", "prefill tokens", "KV %", "step ms"]
    assert len(figure["data"][0]["x"]) >= 6  # at least its own prefill and decode iterations
    error, _ = client.predict(10**9, api_name="/live_request_split")
    assert "no request row" in error


def test_autopilot_switch_in_the_knobs_panel(server, client):
    on, status = client.predict(True, "ttft_p99=fast", api_name="/autopilot_switch")
    assert on is False and "spec.ttft_p99" in status  # rejected: the switch goes back, nothing changed
    assert httpx.get(f"{server.base_url}/admin/autopilot").json()["enabled"] is False
    on, status = client.predict(True, "ttft_p99=5s,max_num_seqs=16..64", api_name="/autopilot_switch")
    assert on is True and status.startswith("**Autopilot on**") and "max_num_seqs 16..64" in status
    view = httpx.get(f"{server.base_url}/admin/autopilot").json()
    assert view["enabled"] is True and view["spec"]["targets"] == {"ttft_p99": 5.0}
    on, spec, status = client.predict(api_name="/autopilot_view")  # what a page load or Refresh shows
    assert on is True and parse_spec(spec) == parse_spec("ttft_p99=5s,max_num_seqs=16..64")
    assert status.startswith("**Autopilot on**") and "Targets: ttft_p99 5 s" in status
    on, status = client.predict(False, "", api_name="/autopilot_switch")
    assert on is False and status.startswith("**Autopilot off**")
    assert httpx.get(f"{server.base_url}/admin/autopilot").json()["enabled"] is False
