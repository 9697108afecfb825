"""The load-test tab's auto-tuning sweep through gradio_client against the real server: a tiny
sweep's table, its Pareto front and recommendation, Apply (GET /admin/knobs changes), cancel."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from gradio_client import Client

from appliance.telemetry import runs
from ui.tune_panel import POINT_HEADERS

TUNED = ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold")
# the tab's workload fields: workload, arrival, rate, concurrency, max output, seed, upload
WORKLOAD = ("skewed", "all at once", 4, 2, 4, 0, None)


@pytest.fixture(scope="module")
def server(dashboard_server):
    yield dashboard_server
    httpx.patch(f"{dashboard_server.base_url}/admin/knobs",
                json={"max_num_seqs": 64, "max_num_batched_tokens": 512, "long_prefill_token_threshold": 256})


@pytest.fixture
def client(server):
    return Client(server.ui_url, verbose=False)


def knobs(server) -> dict:
    return httpx.get(f"{server.base_url}/admin/knobs").json()["knobs"]


def sweep(client, seqs: str, budgets: str, chunks: str, per_point: int, slo: str, refine: bool = False,
          fmt: str = "Markdown"):
    return client.submit(*WORKLOAD, seqs, budgets, chunks, per_point, slo, 0.9, refine, fmt, api_name="/tune_run")


def dominates(a: list, b: list) -> bool:
    """Row a beats row b on output tok/s (col 6, higher) and P99 TTFT (col 7, lower)."""
    return a[6] >= b[6] and a[7] <= b[7] and (a[6] > b[6] or a[7] < b[7])


def test_a_tiny_sweep_shows_points_front_and_recommendation_and_applies_it(server, client):
    before = knobs(server)
    outputs = list(sweep(client, "1,4", "64", "32", 3, "ttft=60s,e2e=120s"))
    message, progress, table, chart, recommendation, report = outputs[-1]  # (the Apply button has no value)
    assert "Sweep finished" in message and 'data-state="finished"' in progress
    assert any('data-state="running"' in o[1] for o in outputs[:-1] if o[1])  # progress while it ran
    assert knobs(server) == before  # the sweep put the original knobs back

    assert table["headers"] == POINT_HEADERS
    rows = table["data"]
    assert [(r[2], r[3], r[4]) for r in rows] == [(1, 64, 32), (4, 64, 32)]
    assert all(r[1] == "coarse" and r[5] == "ok" and r[6] > 0 and r[7] > 0 and r[8] > 0 for r in rows)
    for row in rows:  # every point is a stored run made with its knobs in force
        stored = runs.get_run(server.db_url, row[-1])
        assert stored["status"] == "completed" and stored["name"].startswith("tune ")
        assert {k: stored["knobs"]["knobs"][k] for k in TUNED} == dict(zip(TUNED, row[2:5]))
    front = [r for r in rows if "TTFT" in r[12]]
    assert front
    for r in rows:  # on the front exactly when no other point dominates it
        assert (r in front) == (not any(dominates(q, r) for q in rows if q is not r))
    recommended = [r for r in rows if "recommended" in r[11]]
    assert len(recommended) == 1 and recommended[0][11] == "yes (recommended)"
    rec = recommended[0]
    assert rec[9] == max(r[9] for r in rows if r[11].startswith("yes"))  # the most goodput
    assert "Recommended: seqs=%d budget=%d chunk=%d" % tuple(rec[2:5]) in recommendation

    figure = json.loads(chart["plot"])
    traces = {t["name"]: t for t in figure["data"]}
    assert len(traces["grid points"]["x"]) == 2
    assert len(traces["Pareto front"]["x"]) == len(front)
    assert figure["layout"]["title"]["text"].startswith("Output throughput vs P99 TTFT")
    assert open(report).read().startswith("# Tuning sweep")

    status = client.predict(api_name="/tune_apply")
    assert "Applied the recommendation" in status
    after = knobs(server)
    assert {k: after[k] for k in TUNED} == dict(zip(TUNED, rec[2:5]))
    history = httpx.get(f"{server.base_url}/admin/knobs/history").json()["data"]
    assert history[-1]["source"] == "tune"  # the header `appliance tune --apply` sends

    message, path = client.predict("JSON", api_name="/tune_export")
    exported = json.load(open(path))
    assert exported["recommendation"] == dict(zip(TUNED, rec[2:5]))


def test_the_tabs_cancel_stops_a_sweep_and_restores_the_knobs(server, client):
    before = knobs(server)
    job = sweep(client, "2,4,8", "64,128", "32", 4, "ttft=60s", refine=True)
    deadline = time.monotonic() + 60
    while not any('data-state="running"' in (o[1] or "") for o in job.outputs()):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert "Cancelling the sweep" in Client(server.ui_url, verbose=False).predict(api_name="/loadtest_cancel")
    message, progress, table, *_ = list(job)[-1]
    assert "Sweep cancelled" in message and 'data-state="cancelled"' in progress
    assert len(table["data"]) < 6
    assert knobs(server) == before
    # a point that finished before the cancel took effect may stand as the recommendation
    recommended = [row for row in table["data"] if "(recommended)" in str(row[11])]
    status = client.predict(api_name="/tune_apply")
    if not recommended:
        assert "Nothing to apply" in status
        return
    try:
        assert "Applied the recommendation" in status
        assert {k: knobs(server)[k] for k in TUNED} == dict(zip(TUNED, recommended[0][2:5]))
    finally:
        assert httpx.patch(f"{server.base_url}/admin/knobs", json={k: before[k] for k in TUNED}).status_code == 200


def test_sweep_form_errors_are_shown(client):
    message, *_ = sweep(client, "2,x", "64", "32", 2, "ttft=1s").result()
    assert "max_num_seqs" in message and "whole numbers" in message
    message, *_ = sweep(client, "2", "64", "32", 2, "latency=1s").result()
    assert "unknown metric" in message
