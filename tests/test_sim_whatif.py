"""The what-if simulator where operators use it: POST /admin/simulate and the dashboard's
"What if" panel, against a real server (dashboard at /ui, telemetry in a real SQLite store) on a
run recorded with the real `appliance bench`."""

from __future__ import annotations

import contextlib
import io
import json
import random
import time
import uuid

import httpx
import pytest
from gradio_client import Client
from sqlalchemy import func, insert, select

from appliance.cli import main
from appliance.engine import Knobs
from appliance.sim.window import NoMatchingIterations, load_window
from appliance.telemetry import store
from appliance.telemetry.models import Request, Run, StepTimeModelRow
from conftest import serve_dashboard

KNOBS = dict(max_num_seqs=8, max_num_batched_tokens=128, long_prefill_token_threshold=32)
FORM = (8, 128, 32, 1, 1, "continuous")  # KNOBS as the panel's form (slider order, then the policy)


@pytest.fixture(scope="module")
def recorded(loaded_model, tmp_path_factory):
    """(server, run id of 30 requests at Poisson 10/s, the requests, id of a copy of that run
    recorded as if on another engine configuration)."""
    tmp = tmp_path_factory.mktemp("whatif")
    db = f"sqlite:///{tmp / 'telemetry.db'}"
    rng = random.Random(7)
    requests = [{"prompt_ids": [rng.randrange(100, 20000) for _ in range(rng.randint(5, 80))],
                 "output_len": rng.randint(4, 16)} for _ in range(30)]
    (tmp / "w.jsonl").write_text("\n".join(json.dumps(r) for r in requests) + "\n")
    with serve_dashboard(loaded_model, db, **KNOBS) as srv:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            status = main(["bench", "--base-url", srv.base_url, "--db", db, "--workload", "jsonl",
                           "--file", str(tmp / "w.jsonl"), "--rate", "10", "--json"])
        assert status == 0, buf.getvalue()
        run_id = json.loads(buf.getvalue())["run_id"]
        srv.app.state.appliance.telemetry.flush()
        yield srv, run_id, requests, copy_on_other_engine(db, run_id)


def copy_on_other_engine(db: str, run_id: str) -> str:
    """A copy of the run (its request rows kept under another replica) whose recorded engine ran
    one more thread."""
    new_id = str(uuid.uuid4())
    runs, rq = Run.__table__, Request.__table__
    with store.using_engine(db) as engine, engine.begin() as conn:
        run = dict(conn.execute(select(runs).where(runs.c.id == run_id)).first()._mapping)
        fixed = dict(run["knobs"]["fixed"])
        fixed["threads"] = (fixed.get("threads") or 1) + 1
        conn.execute(insert(runs).values({**run, "id": new_id, "name": "other engine",
                                          "knobs": {**run["knobs"], "fixed": fixed}}))
        rows = [dict(r._mapping) for r in conn.execute(select(rq).where(rq.c.run_id == run_id))]
        conn.execute(insert(rq), [{**{k: v for k, v in r.items() if k != "id"}, "run_id": new_id,
                                "replica_id": "elsewhere"} for r in rows])
    return new_id


def simulate(srv, body) -> httpx.Response:
    return httpx.post(f"{srv.base_url}/admin/simulate", json=body, timeout=120)


def knobs_in_force(srv) -> dict:
    return httpx.get(f"{srv.base_url}/admin/knobs").json()


def stored_models(srv) -> int:
    with store.using_engine(srv.db_url) as engine, engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(StepTimeModelRow.__table__)).scalar_one()


# ------------------------------------------------------------------------------ the endpoint


def test_a_recorded_run_at_one_sequence_queues_more_and_nothing_is_applied(recorded):
    srv, run_id, requests, _ = recorded
    before, models = knobs_in_force(srv), stored_models(srv)
    response = simulate(srv, {"run_id": run_id, "knobs": {"max_num_seqs": 1}})
    assert response.status_code == 200, response.text
    report = response.json()
    base, predicted = report["baseline"], report["predicted"]
    assert base["knobs"]["max_num_seqs"] == 8 and predicted["knobs"]["max_num_seqs"] == 1
    assert report["knobs"] == {**base["knobs"], "max_num_seqs": 1}
    for outcome in (base, predicted):
        assert outcome["summary"]["completed"] == 30
        assert outcome["summary"]["total_output_tokens"] == sum(r["output_len"] for r in requests)
        assert len(outcome["timeline"]["t"]) == len(outcome["timeline"]["waiting"]) > 0
    assert predicted["summary"]["ttft"]["p99"] > base["summary"]["ttft"]["p99"]
    assert max(predicted["timeline"]["running"]) == 1 < max(base["timeline"]["running"]) <= 8
    model = report["model"]
    assert model["run_id"] == run_id and model["rows_used"] + model["rows_held_out"] >= 20
    assert 0 <= model["heldout_mape"] < 10
    source = report["source"]
    assert source["kind"] == "run"
    assert source["since"] <= model["window_start"] <= model["window_end"] <= source["until"]
    assert report["recorded"]["completed"] == 30 and report["recorded_by"] == "client"
    recorded_line = report["recorded_timeline"]  # the run's own iterations, as stored
    assert len(recorded_line["t"]) == len(recorded_line["kv_usage"]) == len(recorded_line["running"]) > 0
    assert source["since"] <= recorded_line["t"][0] and max(recorded_line["running"]) <= 8
    assert all(0 <= u <= 1 for u in recorded_line["kv_usage"]) and max(recorded_line["kv_usage"]) > 0
    assert knobs_in_force(srv) == before and stored_models(srv) == models + 1


def test_a_second_question_about_a_run_reuses_its_stored_model(recorded):
    srv, run_id, _, _ = recorded
    first = simulate(srv, {"run_id": run_id, "knobs": {"max_num_seqs": 2}})
    assert first.status_code == 200, first.text
    models = stored_models(srv)
    again = simulate(srv, {"run_id": run_id, "knobs": {"max_num_seqs": 4}})
    assert again.status_code == 200, again.text
    assert again.json()["model"] == first.json()["model"] and stored_models(srv) == models


def test_the_last_minutes_replay_this_replicas_own_requests(recorded):
    srv, _, requests, _ = recorded
    response = simulate(srv, {"last_minutes": 60, "knobs": {"max_num_batched_tokens": 256}})
    assert response.status_code == 200, response.text
    report = response.json()
    assert report["source"]["kind"] == "window" and report["source"]["replica_id"] == "ui-test"
    assert report["source"]["requests"] == 30 and report["recorded_by"] == "server"
    assert report["recorded"]["completed"] == 30 and report["model"]["run_id"] is None
    assert report["baseline"]["knobs"]["max_num_batched_tokens"] == 128  # the knobs the traffic ran with
    assert report["predicted"]["summary"]["total_input_tokens"] == sum(len(r["prompt_ids"]) for r in requests)


def test_a_run_of_another_engine_configuration_is_not_guessed_from(recorded):
    srv, _, _, other = recorded
    models = stored_models(srv)
    response = simulate(srv, {"run_id": other, "knobs": {}})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "no_matching_iterations" and error["param"] == "run_id"
    assert "running configuration" in error["message"] and other in error["message"]
    assert stored_models(srv) == models


def test_a_window_without_iterations_of_the_running_engine_is_not_guessed_from(recorded):
    srv, *_ = recorded
    now = time.time()
    with pytest.raises(NoMatchingIterations, match="only 0 iteration"):
        load_window(srv.db_url, "ui-test", now - 600, now, knobs=Knobs(**KNOBS), fixed=knobs_in_force(srv)["fixed"],
                    engine_started=now + 1, knob_changes=0)


@pytest.mark.parametrize("body, param, named", [
    ({"run_id": "no-such-run"}, "run_id", "no-such-run"),
    ({"last_minutes": 0}, "last_minutes", "0"),
    ({"last_minutes": "ten"}, "last_minutes", "ten"),
    ({"run_id": "x", "last_minutes": 5}, "run_id", "exactly one"),
    ({}, "run_id", "exactly one"),
    ({"last_minutes": 5, "knobs": [1]}, "knobs", "[1]"),
    ({"last_minutes": 5, "knob": {}}, "knob", "knob"),
    ([1, 2], "body", "JSON object"),
])
def test_bad_requests_are_400_naming_the_value(recorded, body, param, named):
    srv, *_ = recorded
    before, models = knobs_in_force(srv), stored_models(srv)
    response = simulate(srv, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and named in error["message"]
    assert knobs_in_force(srv) == before and stored_models(srv) == models


@pytest.mark.parametrize("knobs, field", [
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"num_blocks": 4}, "num_blocks"),
    ({"long_prefill_token_threshold": 4096}, "long_prefill_token_threshold"),  # above the token budget
    ({"scheduling_policy": "fastest"}, "scheduling_policy"),
])
def test_invalid_knobs_are_400_per_field_and_nothing_is_fitted(recorded, knobs, field):
    srv, run_id, _, _ = recorded
    models = stored_models(srv)
    response = simulate(srv, {"run_id": run_id, "knobs": knobs})
    assert response.status_code == 400, response.text
    payload = response.json()
    assert payload["error"]["code"] == "invalid_knobs" and field in payload["errors"]
    assert field in payload["error"]["message"] and stored_models(srv) == models


# ------------------------------------------------------------------------------ the panel


@pytest.fixture
def client(recorded):
    return Client(recorded[0].ui_url, verbose=False)


@pytest.fixture
def restore_knobs(recorded):
    yield
    httpx.patch(f"{recorded[0].base_url}/admin/knobs", json=dict(zip(
        ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold", "max_num_partial_prefills",
         "max_long_partial_prefills", "scheduling_policy"), FORM)))


def test_the_panel_offers_the_runs_and_starts_at_the_knobs_in_force(recorded, client):
    _, run_id, _, other = recorded
    source, *form = client.predict(api_name="/whatif_load")
    assert [c[1] for c in source["choices"]][:1] == ["window"]
    assert {run_id, other} <= {c[1] for c in source["choices"]}
    assert tuple(v["value"] if isinstance(v, dict) else v for v in form) == FORM


def test_predict_then_apply_sends_the_predicted_knobs_in_one_patch(recorded, client, restore_knobs):
    srv, run_id, _, _ = recorded
    before = knobs_in_force(srv)
    assert "Predict first" in client.predict(api_name="/whatif_apply")[-1]
    assert knobs_in_force(srv) == before
    text, plot, *_ = client.predict(run_id, 10, 2, 128, 32, 1, 1, "continuous", api_name="/whatif_predict")
    assert "held-out error" in text and "max_num_seqs=2" in text and "| TTFT p99 |" in text
    assert all(f"| {m} p90 |" in text for m in ("TTFT", "TPOT", "ITL", "E2E"))
    assert "step times vary" in text  # the fitted spread the replay draws from
    assert "simulated, same knobs" in text and plot is not None
    traces = json.dumps(plot)
    assert all(f"{what}, {name}" in traces for what in ("running", "KV usage %")
               for name in ("recorded", "same knobs", "predicted"))
    assert knobs_in_force(srv) == before  # predicting applies nothing
    outputs = client.predict(api_name="/whatif_apply")
    after = knobs_in_force(srv)
    assert after["knobs"]["max_num_seqs"] == 2 and after["version"] == before["version"] + 1
    assert "Applied" in outputs[0] and "max_num_seqs 8→2" in outputs[0]
    history = httpx.get(f"{srv.base_url}/admin/knobs/history").json()["data"]
    assert history[-1]["source"] == "dashboard" and history[-1]["new"] == {"max_num_seqs": 2}


def test_the_panel_says_when_nothing_matches_the_running_configuration(recorded, client):
    srv, _, _, other = recorded
    before = knobs_in_force(srv)
    text, plot, *_ = client.predict(other, 10, *FORM, api_name="/whatif_predict")
    assert text.startswith("**No prediction.**") and "running configuration" in text and plot is None
    text, *_ = client.predict("window", 10, 0, *FORM[1:], api_name="/whatif_predict")
    assert "No prediction" in text and "`max_num_seqs`" in text
    assert knobs_in_force(srv) == before
