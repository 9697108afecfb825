"""`appliance report` over two runs stored by a real server: Markdown and CSV carry the store's
numbers, JSON the whole report, and the HTML opens in headless Chromium with no network."""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

import pytest
from sqlalchemy import func, select

from appliance.bench.report.runs import render_report
from appliance.cli import main
from appliance.telemetry import queries, runs
from appliance.telemetry.models import Iteration
from appliance.telemetry.store import using_engine
from bench_live_server import REPLICA, telemetry_server
from report_runs import make_runs

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E"}


@pytest.fixture(scope="module")
def stored(server_factory, tmp_path_factory):
    db = f"sqlite:///{tmp_path_factory.mktemp('report') / 'telemetry.db'}"
    with telemetry_server(server_factory, db) as srv:
        yield make_runs(srv, db)


@pytest.fixture(scope="module")
def ids(stored):
    return [stored.a.run_id, stored.b.run_id]


def run_section(md: str, index: int) -> str:
    return md.split(f"## Run {index}: ")[1].split("\n## ")[0]


def ms(value):
    return f"{value * 1000:.2f}"


def iteration_figures(db, run):
    it = Iteration.__table__
    with using_engine(db) as engine, engine.connect() as conn:
        return conn.execute(
            select(func.count(), func.sum(it.c.scheduled_tokens), func.sum(it.c.padding_tokens),
                   func.sum(it.c.preemptions), func.max(it.c.waiting), func.max(it.c.running))
            .where(it.c.replica_id == REPLICA, it.c.started_at >= run["started_at"],
                   it.c.started_at <= run["ended_at"])).one()


def test_markdown_holds_the_store_numbers(stored, ids):
    md = render_report(stored.db, ids, "md")
    assert md.startswith("# Tuning report")
    for index, run_id in enumerate(ids, start=1):
        section = run_section(md, index)
        run = runs.get_run(stored.db, run_id)
        summary = run["summary"]["summary"]
        assert f"**Run id**: {run_id}" in section
        assert f"- **Served by**: 1 replica: {REPLICA} {summary['completed']} (completed requests each)" in section
        for metric, label in LABELS.items():
            d = summary[metric]
            row = f"| {label} | {d['count']} | " + " | ".join(ms(d[s]) for s in ("mean", "p50", "p90", "p99", "max"))
            assert row + " |" in section
        server = queries.run_summary(stored.db, run_id)
        d = server["queue_s"]
        assert (f"| Queue (server) | {server['requests']} | "
                + " | ".join(ms(d[s]) for s in ("mean", "p50", "p90", "p99", "max")) + " |") in section
        assert f"| Output throughput | {summary['output_throughput']:.2f} | tok/s |" in section
        assert f"| Output tokens | {summary['total_output_tokens']} |  |" in section
        assert f"| max_num_seqs | {run['knobs']['knobs']['max_num_seqs']} |" in section
        count, scheduled, padding, preemptions, waiting, running = iteration_figures(stored.db, run)
        assert count > 0
        assert f"| Iterations | {count} |" in section and f"| Max waiting | {waiting} |" in section
        assert f"| Padding rows | {padding} |" in section and f"| Preemptions | {preemptions} |" in section
        assert re.search(r"\| Prefix cache hit rate \(tokens at admission\) \| \d+% \|", section)
    # the live change during run A is listed with the run, the comparison names the winner
    assert "max_num_seqs: 2 -> 3" in run_section(md, 1)
    assert "max_num_seqs: 2 -> 3" not in run_section(md, 2)
    comparison = md.split("## Comparison")[1].split("## Run 1")[0]
    a, b = (runs.get_run(stored.db, i)["summary"]["summary"]["output_throughput"] for i in ids)
    winner = "run 1 (seqs-2)" if a > b else "run 2 (seqs-8)"
    assert f"Output throughput: {winner} wins" in comparison
    assert "| max_num_seqs | 2 | 8 |" in comparison


def test_csv_holds_the_store_numbers(stored, ids):
    rows = list(csv.DictReader(io.StringIO(render_report(stored.db, ids, "csv"))))
    values = {(r["run_id"], r["section"], r["metric"], r["stat"]): r["value"] for r in rows}
    for run_id in ids:
        run = runs.get_run(stored.db, run_id)
        summary = run["summary"]["summary"]
        for metric in LABELS:
            for stat, value in summary[metric].items():
                if stat in ("count", "mean", "p50", "p90", "p99", "max"):
                    assert float(values[(run_id, "client", metric, stat)]) == value
        for key in ("request_throughput", "output_throughput", "total_input_tokens", "duration_s"):
            assert float(values[(run_id, "throughput", key, "value")]) == summary[key]
        server = queries.run_summary(stored.db, run_id)
        for metric in ("ttft", "itl", "e2e", "queue"):
            for stat, value in server[f"{metric}_s"].items():
                assert float(values[(run_id, "server", metric, stat)]) == value
        assert int(values[(run_id, "server", "requests", "value")]) == server["requests"] == 6
        count, scheduled, padding, preemptions, waiting, running = iteration_figures(stored.db, run)
        assert int(values[(run_id, "iterations", "iterations", "value")]) == count
        assert int(values[(run_id, "iterations", "scheduled_tokens", "value")]) == scheduled
        assert int(values[(run_id, "iterations", "padding_tokens", "value")]) == padding
        assert int(values[(run_id, "iterations", "running_max", "value")]) == running
        for knob, value in run["knobs"]["knobs"].items():
            assert values[(run_id, "settings", knob, "value")] == str(value)
    assert values[(ids[0], "knob_change", "max_num_seqs", next(
        r["stat"] for r in rows if r["section"] == "knob_change"))] == "3"


def test_json_report(stored, ids):
    report = json.loads(render_report(stored.db, ids, "json"))
    assert [r["run"]["id"] for r in report["runs"]] == ids
    first = report["runs"][0]
    assert first["knobs"]["max_num_seqs"] == 2 and first["knob_changes"][0]["new"] == {"max_num_seqs": 3}
    assert len(first["requests"]) == 6 and first["server"]["requests"] == 6
    series = first["series"]
    assert set(series) >= {"running", "waiting", "kv_blocks_used", "prefill_tokens", "decode_tokens"}
    assert series["running"]["t"] and max(series["running"]["max"]) <= 3
    assert report["comparison"]["knob_diff"] == {"max_num_seqs": [2, 8]}
    assert all(isinstance(f["text"], str) for r in report["runs"] for f in r["findings"])
    worst = first["worst_requests"]  # the 5 slowest of its 6 requests by E2E, each split
    assert len(worst) == 5 and [w["e2e_s"] for w in worst] == sorted((w["e2e_s"] for w in worst), reverse=True)
    for w in worst:
        assert w["queue_s"] + w["prefill_s"] + w["first_token_sampling_s"] == pytest.approx(w["ttft_s"], abs=1e-9)
        assert w["ttft_s"] + w["decode_own_s"] + w["decode_prefill_stall_s"] == pytest.approx(w["e2e_s"], abs=1e-9)
    md = run_section(render_report(stored.db, ids, "md"), 1)
    table = md.split("### Slowest requests: where their time went")[1]
    assert all(w["request_id"] in table for w in worst)


def test_html_has_no_external_url(stored, ids):
    html = render_report(stored.db, ids, "html")
    assert re.findall(r"https?://", html, re.IGNORECASE) == []
    assert "<script src" not in html and "<link" not in html  # everything inline
    assert html.count('class="chart"') == 2 + 2 * 5  # comparison + per run (latency, throughput, 3 series)


def test_bad_requests_are_refused(stored, ids):
    with pytest.raises(LookupError, match="no run 'nope'"):
        render_report(stored.db, ["nope"], "md")
    with pytest.raises(ValueError, match="unknown report format"):
        render_report(stored.db, ids, "pdf")
    with pytest.raises(ValueError, match="at least one run"):
        render_report(stored.db, [], "md")
    with pytest.raises(ValueError, match="more than once"):
        render_report(stored.db, [ids[0], ids[0]], "md")
    assert render_report(stored.db, ids[:1], "markdown").startswith("# Tuning report")


def test_report_command(stored, ids, tmp_path, capsys):
    out = tmp_path / "r.md"
    assert main(["report", *ids, "--output", str(out), "--db", stored.db]) == 0
    assert out.read_text().startswith("# Tuning report") and "## Comparison" in out.read_text()
    assert main(["report", ids[0], "--format", "csv", "--db", stored.db]) == 0
    assert capsys.readouterr().out.startswith("run_id,run_name,section")
    assert main(["report", "missing-run", "--db", stored.db]) == 2
    assert "no run 'missing-run'" in capsys.readouterr().err


@pytest.mark.browser
def test_html_opens_offline_in_chromium(stored, ids, tmp_path, browser):
    path = tmp_path / "report.html"
    path.write_text(render_report(stored.db, ids, "html"), encoding="utf-8")
    attempted: list[str] = []
    errors: list[str] = []

    def gate(route):
        url = route.request.url
        if url.startswith(("file://", "about:")):
            route.continue_()
        else:
            attempted.append(url)
            route.abort()

    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.route("**/*", gate)
    page = context.new_page()
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("request", lambda r: None if r.url.startswith(("file://", "about:", "data:")) else attempted.append(r.url))
    page.goto(path.as_uri())
    page.wait_for_selector(".chart .main-svg", timeout=60_000)
    page.wait_for_function(
        "() => [...document.querySelectorAll('.chart')].every(d => d.querySelector('.main-svg'))",
        timeout=60_000)
    charts = page.locator(".chart").count()
    titles = page.locator(".chart .gtitle").all_text_contents()
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)
    context.close()
    assert attempted == [] and errors == []
    assert charts == 12
    assert {"Running and waiting requests", "KV cache usage", "Tokens per iteration",
            "Throughput", "Latency"} <= set(titles)
