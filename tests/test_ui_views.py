"""Dashboard pieces without a server: presets, form checks, chat turns, and the Live / Runs /
report views over a real SQLite telemetry store filled by the real TelemetryWriter."""

from __future__ import annotations

import time
import tomllib
from pathlib import Path

import pytest

from appliance.bench.metrics import RequestResult, summarize
from appliance.engine.stats import IterationStats, KnobChange, RequestStats
from appliance.telemetry import runs, store
from appliance.telemetry.writer import TelemetryWriter
from appliance.records import HoldCause
from appliance.telemetry import request_split
from ui import charts, holding, live_tab, reports, runs_tab, slow_requests
from ui.api_client import ApiError, ChatStats, _take_chat_event
from ui.autopilot_switch import autopilot_markdown, spec_text
from ui.chat_tab import build_messages, message_text, stats_row
from ui.knobs_panel import (
    KNOB_NAMES,
    coerce,
    describe_change,
    diff_knobs,
    effective_markdown,
    load_presets,
    rejected_markdown,
)
from appliance.bench.workloads import WORKLOADS, Conversation
from ui.loadtest_tab import WORKLOAD_CHOICES, build_spec
from ui.runs_view import TABLE_HEADERS, knob_snapshot, run_figures, table_row

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


# ------------------------------------------------------------------------------------- knobs


def test_presets_are_the_knob_keys_of_the_config_files():
    presets = load_presets(CONFIGS)
    assert set(presets) == {"latency", "throughput"}
    for name, knobs in presets.items():
        with (CONFIGS / f"{name}.toml").open("rb") as fh:
            data = tomllib.load(fh)
        assert knobs == {k: v for k, v in data.items() if k in KNOB_NAMES}
        assert knobs  # each preset sets knobs


def test_presets_skip_other_keys_and_missing_files(tmp_path):
    (tmp_path / "latency.toml").write_text('kv_cache_memory = "1GiB"\nmax_num_seqs = 8\n')
    assert load_presets(tmp_path) == {"latency": {"max_num_seqs": 8}}
    assert load_presets(tmp_path / "nowhere") == {}


def test_form_values_are_coerced_and_only_changes_are_sent():
    assert coerce(7.0) == 7 and isinstance(coerce(7.0), int)
    assert coerce(7.5) == 7.5  # left for the server to reject
    assert coerce("static") == "static"
    current = {"max_num_seqs": 64, "scheduling_policy": "continuous"}
    assert diff_knobs(current, {"max_num_seqs": 64, "scheduling_policy": "static"}) == {
        "scheduling_policy": "static"}
    assert describe_change(current, {"max_num_seqs": 16}) == "max_num_seqs 64→16"


def test_a_fleet_whose_replicas_differ_shows_each_replicas_knobs():
    same = {"version": 3, "iteration": 9, "knobs": {"max_num_seqs": 8},
            "replicas": {"a": {"version": 3, "knobs": {"max_num_seqs": 8}}, "b": {"version": 2, "knobs": {"max_num_seqs": 8}}}}
    text = effective_markdown(same)
    assert text.startswith("**In force:** version 3") and "| max_num_seqs | 8 |" in text
    differ = {**same, "replicas": {"a": {"version": 3, "knobs": {"max_num_seqs": 8, "max_num_batched_tokens": 512}},
                                   "b": {"version": 4, "knobs": {"max_num_seqs": 32, "max_num_batched_tokens": 512}}}}
    text = effective_markdown(differ)
    assert text.startswith("**In force per replica** (a v3, b v4): 1 knob(s) differ")
    assert "| **max_num_seqs** (differs) | 8 | 32 |" in text and "| max_num_batched_tokens | 512 | 512 |" in text


def test_rejection_lists_every_field():
    text = rejected_markdown(ApiError("bad", 422, {"max_num_seqs": "must be >= 1", "x": "unknown knob"}))
    assert "nothing applied" in text and "`max_num_seqs`: must be >= 1" in text and "`x`" in text


# -------------------------------------------------------------------------------------- chat


def test_chat_history_in_gradio_parts_becomes_openai_messages():
    history = [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "hello"},
        {"role": "assistant", "content": ""},  # a stopped reply with no text yet is left out
    ]
    assert message_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "ab"
    assert build_messages("  be brief ", history, "again") == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"},
    ]
    assert build_messages("", [], "x") == [{"role": "user", "content": "x"}]


def test_chat_stream_events_fill_the_reply_stats():
    stats = ChatStats(started=10.0)
    assert _take_chat_event('{"choices":[{"delta":{"content":"Hi"},"finish_reason":null}]}', stats) == "Hi"
    assert _take_chat_event('{"choices":[{"delta":{},"finish_reason":"stop"}]}', stats) == ""
    assert _take_chat_event('{"choices":[],"usage":{"prompt_tokens":50,"completion_tokens":9,'
                            '"prompt_tokens_details":{"cached_tokens":32}}}', stats) == ""
    stats.first_token, stats.ended = 10.2, 11.0
    assert stats.finish_reason == "stop" and stats.tokens == 9
    assert stats.ttft_s == pytest.approx(0.2) and stats.tokens_per_s == pytest.approx(8 / 0.8)
    assert stats_row(3, stats) == [3, 200.0, 10.0, 9, "32 / 50", "stop"]
    with pytest.raises(ApiError, match="boom"):
        _take_chat_event('{"error":{"message":"boom"}}', stats)


# --------------------------------------------------------------------------------- load test


def test_load_test_form_is_checked():
    ok = build_spec("skewed", 64, "all at once", 1, 1, 0, 0, "", None)
    assert len(ok.requests) == 64 and ok.rate is None and ok.concurrency is None and ok.name is None
    capped = build_spec("skewed", 64, "Poisson rate", 2.5, 1, 8, 0, " mine ", None)
    assert max(r.output_len for r in capped.requests) == 8 and capped.rate == 2.5 and capped.name == "mine"
    assert build_spec("skewed", 64, "fixed concurrency", 1, 3, 0, 0, "", None).concurrency == 3
    with pytest.raises(ValueError, match="positive whole number"):
        build_spec("skewed", 0, "all at once", 1, 1, 0, 0, "", None)
    with pytest.raises(ValueError, match="upload a JSONL"):
        build_spec("jsonl", 4, "all at once", 1, 1, 0, 0, "", None)
    with pytest.raises(ValueError, match="above zero"):
        build_spec("skewed", 64, "Poisson rate", 0, 1, 0, 0, "", None)
    with pytest.raises(ValueError, match="concurrency"):
        build_spec("skewed", 64, "fixed concurrency", 1, 0, 0, 0, "", None)


def test_load_test_takes_an_uploaded_jsonl(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "hello", "max_tokens": 4}\n{"prompt_ids": [1, 2, 3], "output_len": 2}\n')
    spec = build_spec("jsonl", 2, "all at once", 1, 1, 0, 0, "", str(path))
    assert [r.output_len for r in spec.requests] == [4, 2]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json}\n")
    with pytest.raises(ValueError, match="not valid JSON"):
        build_spec("jsonl", 1, "all at once", 1, 1, 0, 0, "", str(bad))


def test_load_test_offers_every_workload_and_multi_turn_conversations():
    assert [value for _, value in WORKLOAD_CHOICES] == list(WORKLOADS)
    spec = build_spec("multi-turn", 3, "fixed concurrency", 1, 2, 5, 0, "", None)
    assert len(spec.requests) == 3 and all(isinstance(c, Conversation) for c in spec.requests)
    assert all(c.output_len == 5 and 3 <= c.max_requests <= 4 for c in spec.requests)  # default max turns 4
    assert spec.workload.startswith("multi-turn conversations=3 ") and spec.workload.endswith(" max_output=5")
    assert spec.concurrency == 2
    shared = build_spec("shared-prefix", 8, "all at once", 1, 1, 0, 0, "", None)
    assert len(shared.requests) == 8 and shared.workload.startswith("shared-prefix G=4 L=1024")


# ------------------------------------------------------------------------ telemetry-backed views


def _iteration(i: int, t: float, running: int, policy: str = "continuous", version: int = 0) -> IterationStats:
    return IterationStats(
        iteration=i, started_at=t, duration_s=0.05, running=running, waiting=2, prefill_seqs=1,
        prefill_tokens=30, decode_seqs=running, decode_tokens=running, scheduled_tokens=30 + running,
        padding_tokens=0, token_budget=512, max_num_seqs=16, kv_blocks_used=64, kv_blocks_free=448,
        kv_blocks_total=512, preemptions=1 if i == 3 else 0, finished=0, knob_version=version,
        # the 2 waiting requests: held by max_num_seqs in 3 iterations of 4, by KV blocks in the 4th
        sample_s=0.0,
        held_by_max_num_seqs=2 if i % 4 else 0, held_by_token_budget=0, held_by_kv_blocks=0 if i % 4 else 2,
        held_by_partial_prefills=0, held_by_long_partial_prefills=0, chunk_deferred_tokens=0,
        policy=policy, decode_context_tokens=running * 100, kv_blocks_cached_free=32,
        prefix_cache_queries=50 if i % 2 else 0, prefix_cache_hits=20 if i % 2 else 0,
    )


@pytest.fixture
def filled_store(tmp_path):
    """A migrated SQLite store with 40 iterations over the last 20 s, 6 requests, one knob
    change and one stored run, all written through the real writer / runs API."""
    url = f"sqlite:///{tmp_path / 'ui.db'}"
    store.upgrade(url)
    now = time.time()
    writer = TelemetryWriter(url, "r1", flush_interval_s=0.05).start()
    for i in range(40):
        writer.on_iteration(_iteration(i, now - 20 + i * 0.5, running=4 + i % 3))
    for i in range(6):
        arrival = now - 15 + i
        writer.on_request(RequestStats(f"req-{i}", "loadtest", "run-a", arrival, arrival + 0.01,
                                       arrival + 0.1 * (i + 1), arrival + 2.0, 20, 11, "length", 0, 0))
    writer.on_knob_change(KnobChange(1, 20, now - 10, {"max_num_seqs": 64}, {"max_num_seqs": 16}, "dashboard"))
    assert writer.flush()
    writer.close()
    results = [RequestResult(index=i, sent_at=now - 15 + i, ok=True, ttft=0.1 * (i + 1),
                             itl=[0.05] * 10, e2e=2.0, prompt_tokens=20, output_tokens=11) for i in range(6)]
    summary = summarize(results, 8.0, 6)
    knobs = {"knobs": {"max_num_seqs": 16, "max_num_batched_tokens": 512, "scheduling_policy": "continuous",
                       "long_prefill_token_threshold": 256, "max_num_partial_prefills": 1}, "version": 1}
    runs.create_run(url, "smoke", "skewed n=6 seed=0", {"mode": "all-at-once"}, knobs, "r1",
                    run_id="run-a", started_at=now - 16)
    runs.finish_run(url, "run-a", "completed", {"summary": summary.as_dict()}, ended_at=now - 6)
    runs.create_run(url, "bare", "skewed n=6 seed=1", {"mode": "all-at-once"}, knobs["knobs"], "r1",
                    run_id="run-b", started_at=now - 16)
    return url, now, summary


def test_the_replica_selector_shows_one_replica_or_the_whole_fleet(filled_store):
    """A second replica's rows in the same store (a fleet): the selector lists both, a replica's
    view holds only its own iterations and knob changes, the fleet's view holds both."""
    url, now, _ = filled_store
    writer = TelemetryWriter(url, "r2", flush_interval_s=0.05).start()
    for i in range(40):
        writer.on_iteration(_iteration(i, now - 20 + i * 0.5, running=10))
    writer.on_knob_change(KnobChange(1, 5, now - 12, {"max_num_seqs": 64}, {"max_num_seqs": 8}, "api"))
    assert writer.flush()
    writer.close()
    engine = store.make_engine(url)
    window = live_tab.resolve_window(engine, "1m", now=now)
    assert live_tab.replica_choices(engine, window) == [live_tab.FLEET_CHOICE, ("replica r1", "r1"),
                                                        ("replica r2", "r2")]
    views = {replica: live_tab.fetch(engine, window, "1m", replica) for replica in ("r1", "r2", None)}
    running = {replica: [p.mean for p in data.series["running"].points] for replica, data in views.items()}
    assert running["r1"] and all(4 <= v <= 6 for v in running["r1"])
    assert running["r2"] and all(v == 10 for v in running["r2"])
    assert sum(p.count for p in views[None].series["running"].points) == 80  # both replicas' iterations
    assert [c["new"] for c in views["r2"].changes] == [{"max_num_seqs": 8}]
    assert len(views[None].changes) == 2
    # the fleet's running and tokens/s charts: one line per replica, in its own colour, and the total
    assert sorted(views[None].by_replica) == ["r1", "r2"] and views["r1"].by_replica == {}
    figs = dict(zip(live_tab.CHART_IDS, live_tab.figure_specs(views[None])))
    running = {t["name"]: t for t in figs["chart-running"]["data"]}
    assert {"fleet total (mean)", "replica r1", "replica r2", "max_num_seqs"} <= set(running)
    assert running["replica r1"]["line"]["color"] != running["replica r2"]["line"]["color"]
    total = {x: y for x, y in zip(running["fleet total (mean)"]["x"], running["fleet total (mean)"]["y"])}
    r2 = dict(zip(running["replica r2"]["x"], running["replica r2"]["y"]))
    both = [x for x in r2 if x in dict(zip(running["replica r1"]["x"], running["replica r1"]["y"]))]
    assert both and all(total[x] > r2[x] for x in both)  # r1's sequences are added where both ran
    throughput = {t["name"] for t in figs["chart-throughput"]["data"]}
    assert throughput == {"fleet total", "replica r1", "replica r2"}
    one = {t["name"] for t in dict(zip(live_tab.CHART_IDS, live_tab.figure_specs(views["r1"])))["chart-running"]["data"]}
    assert one == {"running (mean)", "running (max)", "max_num_seqs"}


def test_the_fleet_view_draws_the_fleet_size_over_time(filled_store):
    """The ingress's recorded fleet sizes (a replica lost, then replaced) are a step line on the
    running chart's right axis, held to the window's end, while the fleet's replicas ran in the
    window; a replica's own view has none, nor has a fleet whose replicas are gone."""
    from appliance.telemetry import fleet_sizes

    url, now, _ = filled_store
    writer = TelemetryWriter(url, "fleet-a/x1", flush_interval_s=0.05).start()
    for i in range(10):
        writer.on_iteration(_iteration(i, now - 12 + i, running=3))
    assert writer.flush()
    writer.close()
    for at, count in ((now - 300, 2), (now - 15, 1), (now - 8, 2)):
        fleet_sizes.record(url, "fleet-a", count, at)
    fleet_sizes.record(url, "old-fleet", 3, now - 900)  # an earlier fleet on the same store
    engine = store.make_engine(url)
    window = live_tab.resolve_window(engine, "1m", now=now)
    fleet, one = live_tab.fetch(engine, window, "1m"), live_tab.fetch(engine, window, "1m", "fleet-a/x1")
    assert fleet.fleet_sizes == {"fleet-a": [(window.since, 2), (now - 15, 1), (now - 8, 2)]} and one.fleet_sizes == {}
    running = dict(zip(live_tab.CHART_IDS, live_tab.figure_specs(fleet)))["chart-running"]
    size = next(t for t in running["data"] if t["name"] == "replicas live")
    assert size["y"] == [2, 1, 2, 2] and size["yaxis"] == "y2" and size["line"]["shape"] == "hv"
    assert size["x"][-1] == charts.stamp(window.until) and running["layout"]["yaxis2"]["range"] == [0, 3]
    alone = dict(zip(live_tab.CHART_IDS, live_tab.figure_specs(one)))["chart-running"]
    assert "yaxis2" not in alone["layout"] and all(t["name"] != "replicas live" for t in alone["data"])


def test_live_figures_show_the_stored_series_and_the_knob_change(filled_store):
    url, now, _ = filled_store
    engine = store.make_engine(url)
    window = live_tab.resolve_window(engine, "1m", now=now)
    data = live_tab.fetch(engine, window, "1m")
    figs = live_tab.build_figures(data)
    assert len(figs) == len(live_tab.CHART_IDS)
    titles = [f.layout.title.text for f in figs]
    assert titles[0].startswith("Running vs max_num_seqs") and titles[6].startswith("TTFT")
    running = figs[0].data[0]
    assert min(running.y) >= 4 and max(running.y) <= 6  # the running values written
    assert figs[0].data[2].name == "max_num_seqs" and set(figs[0].data[2].y) == {16}
    kv_pct = figs[2].data[0].y
    assert all(v == pytest.approx(64 / 512 * 100) for v in kv_pct)
    assert [t.name for t in figs[2].data[:3]] == ["used % (mean)", "cached free % (mean)", "free % (mean)"]
    assert all(v == pytest.approx(32 / 512 * 100) for v in figs[2].data[1].y if v is not None)
    assert all(v == pytest.approx(416 / 512 * 100) for v in figs[2].data[2].y if v is not None)
    assert titles[-1].startswith("Prefix cache hit rate")
    hit_rate = [v for v in figs[-1].data[0].y if v is not None]
    assert hit_rate and all(v == pytest.approx(40) for v in hit_rate)  # 20 of 50 tokens, every other iteration
    ttft = figs[6].data
    assert [t.name for t in ttft] == ["p50", "p90", "p99"]
    # latency buckets (2 s wide over 1 min) sit on a fixed grid: the fastest request (100 ms) is
    # alone in its bucket or shares it with the next one (200 ms), depending on the clock
    assert round(min(ttft[0].y)) in (100, 150) and max(ttft[2].y) <= 600 + 1e-6
    held = figs[live_tab.CHART_IDS.index("chart-held")]
    assert held.layout.title.text.startswith("What is holding traffic back")
    assert [t.name for t in held.data] == [holding.LABELS[c] for c in HoldCause]
    assert held.data[0].groupnorm == "percent"
    by_name = {t.name: sum(t.y) for t in held.data}  # request-seconds: iterations x 2 waiting x 0.05 s
    assert by_name["max_num_seqs"] == pytest.approx(30 * 2 * 0.05) and by_name["free KV blocks"] == pytest.approx(1.0)
    assert data.held.totals[HoldCause.MAX_NUM_SEQS] == pytest.approx(3.0)
    reading = data.holding_reading({"max_num_seqs": 16})
    # 75 % of 4.0 request-s; KV peak 64/512 = 12.5 %; the knob changed in the window, so "now 16"
    assert reading == ("75 % of the 4.0 request-s of queueing in the last 1 min was max_num_seqs (now 16) "
                       "while KV usage stayed under 20 %: raising max_num_seqs should help.")
    for fig in figs:  # every chart marks the knob change
        labels = [a.text for a in fig.layout.annotations]
        assert "v1: max_num_seqs 64→16" in labels
        assert any(s.type == "line" for s in fig.layout.shapes)
    engine.dispose()


def test_the_kv_chart_names_its_block_count_and_an_empty_window_no_count(filled_store):
    url, now, _ = filled_store
    engine = store.make_engine(url)
    for at, axis in ((now, "blocks (of 512)"), (now - 86_400, "blocks")):  # a day earlier: nothing stored
        data = live_tab.fetch(engine, live_tab.resolve_window(engine, "1m", now=at), "1m")
        kv = live_tab.figure_specs(data)[live_tab.CHART_IDS.index("chart-kv")]
        assert kv["layout"]["yaxis2"]["title"]["text"] == axis
    engine.dispose()


def test_chart_titles_and_legends_take_separate_lines():
    """The title sits on the top line of the figure and the legend starts under it, both placed in
    the figure's pixels, the legend anchored at its top: one that wraps onto more lines grows down
    (plotly reserves its height above the plot area), never up over the title, whatever the
    chart's width. The browser test checks the drawn boxes."""
    for height in (charts.LAYOUT["height"], 320):
        layout = charts.layout("Running vs max_num_seqs — 1 min", "sequences", height=height)
        title, legend = layout["title"], layout["legend"]
        assert title["yref"] == "container" and title["y"] == 1.0 and title["yanchor"] == "top"
        assert legend["yref"] == "container" and legend["yanchor"] == "top"
        title_bottom = title["pad"]["t"] + 1.5 * title["font"]["size"]  # px from the top, generous line height
        legend_top = (1 - legend["y"]) * height
        assert title_bottom <= legend_top < layout["margin"]["t"]


def test_headline_and_run_window(filled_store):
    url, now, _ = filled_store
    engine = store.make_engine(url)
    html = live_tab.headline_html(
        {"running": 3, "waiting": 1, "kv_blocks_used": 128, "kv_blocks_total": 512, "uptime_s": 3725,
         "model": "m", "device": "cpu", "telemetry_rows_dropped": 0,
         "autopilot": "off after an error: RuntimeError: boom"},
        {"knobs": {"max_num_seqs": 16, "scheduling_policy": "static"}}, 12.5, 2, reading="No request <waited>")
    for text in ("3 / 1 (max 16)", "12.5", "25.0% (128/512)", "1h 02m", "static",
                 "off after an error: RuntimeError: boom",
                 '<div data-stat="holding" style="margin-top:6px;font-size:13px">No request &lt;waited&gt;</div>'):
        assert text in html
    window = live_tab.resolve_window(engine, "run:run-a", now=now)
    assert window.run_id == "run-a" and window.since == pytest.approx(now - 16)
    assert ("1 min", "1m") in live_tab.window_choices(engine)
    assert any(v == "run:run-a" for _, v in live_tab.window_choices(engine))
    engine.dispose()


def test_runs_table_compare_and_reports(filled_store, tmp_path):
    url, now, summary = filled_store
    engine = store.make_engine(url)
    stored = runs.get_run(engine, "run-a")
    assert knob_snapshot(stored)["max_num_seqs"] == 16
    figures = run_figures(engine, stored)
    assert figures["completed"] == 6 and figures["ttft_p50_ms"] == pytest.approx(summary.ttft.p50 * 1000, abs=0.1)
    row = table_row(engine, stored)
    assert len(row) == len(TABLE_HEADERS) and row[1] == "smoke" and row[-1] == "run-a"
    # a run without a stored summary falls back to the server-side figures (none here)
    bare = run_figures(engine, runs.get_run(engine, "run-b"))
    assert bare["completed"] == 0 and bare["output_tok_s"] is None
    throughput, latency, overlay = runs_tab.compare_figures(engine, ["run-a", "run-b"])
    assert [t.name for t in throughput.data] == ["smoke (run-a)", "bare (run-b)"]
    assert latency.data[0].y[0] == pytest.approx(summary.ttft.p50 * 1000, abs=0.1)
    assert len(overlay.data) == 2 and len(overlay.data[0].x) > 0
    for fmt, suffix in (("HTML", ".html"), ("Markdown", ".md"), ("CSV", ".csv")):
        path = reports.export(url, ["run-a", "run-b"], fmt)
        assert path.suffix == suffix and path.stat().st_size > 0
        text = path.read_text()
        assert "smoke" in text and "bare" in text
    with pytest.raises(ValueError, match="at least one run"):
        reports.export(url, [], "CSV")
    engine.dispose()


def test_slowest_requests_of_a_run_and_one_explained(filled_store):
    url, now, _ = filled_store
    rows = request_split.slowest_requests(url, run_id="run-a", by="ttft")
    table = slow_requests.table_rows(rows)
    assert [r[1] for r in table] == [f"req-{i}" for i in range(5, -1, -1)]  # TTFT 0.6 s .. 0.1 s
    assert table[0][3] == "0.600" and table[0][2] == "2.000"
    split = request_split.request_split(url, rows[0]["id"])
    text = slow_requests.split_markdown(split)
    assert "| TTFT | 0.600 | 30 % |" in text and "| · queueing | 0.010 |" in text
    fig = slow_requests.timeline_figure(split)
    assert len(fig.data[0].x) == len(split.iterations) > 0
    assert [s.fillcolor for s in fig.layout.shapes] == [c for _, c in slow_requests.PHASES]


def test_charts_label_changes_and_handle_no_data():
    change = {"version": 4, "old": {"scheduling_policy": "continuous", "max_num_seqs": 8},
              "new": {"scheduling_policy": "static", "max_num_seqs": 8}, "applied_at": time.time()}
    assert charts.change_label(change) == "v4: scheduling_policy continuous→static"
    assert charts.change_label({**change, "source": "autopilot"}) == "v4 (autopilot): scheduling_policy continuous→static"
    fig = charts.bar_figure("t", "y", ["a"], {})
    assert any("pick runs" in a.text for a in fig.layout.annotations)


def test_idle_stretches_break_the_lines_but_knob_values_hold():
    from appliance.telemetry.queries import Series, SeriesPoint

    points = [SeriesPoint(t, 1, v, v, v, v) for t, v in ((0.0, 1.0), (1.0, 2.0), (5.0, 3.0))]
    series = Series("running", 0.0, 10.0, 1.0, "raw", points)
    assert live_tab._xy(series, "mean") == ([0.5, 1.5, 2.0, 5.5], [1.0, 2.0, None, 3.0])
    assert live_tab._xy(series, "max", 10, gaps=False) == ([0.5, 1.5, 5.5], [10.0, 20.0, 30.0])


def test_the_dashboard_never_imports_the_engine_or_the_server():
    import subprocess
    import sys

    code = ("import sys, ui.app, ui.loadtest_tab; "
            "print(sorted(m for m in sys.modules if m.startswith(('appliance.engine', 'appliance.server'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]"


def test_only_the_newest_knob_changes_carry_their_label():
    import plotly.graph_objects as go

    now = time.time()
    changes = [{"version": v, "applied_at": now - 10 + v, "old": {"max_num_seqs": v}, "new": {"max_num_seqs": v + 1}}
               for v in range(1, 6)]
    fig = charts.mark_knob_changes(go.Figure(), changes)
    assert len(fig.layout.shapes) == 5
    texts = [a.text for a in fig.layout.annotations]
    assert texts == ["v1", "v2", "v3: max_num_seqs 3→4", "v4: max_num_seqs 4→5", "v5: max_num_seqs 5→6"]
    assert [a.hovertext for a in fig.layout.annotations][0] == "v1: max_num_seqs 1→2"


def test_an_autopilot_marker_carries_its_reason_on_hover():
    import plotly.graph_objects as go

    move = {"version": 2, "applied_at": time.time(), "old": {"max_num_seqs": 8}, "new": {"max_num_seqs": 12},
            "source": "autopilot", "reason": "max_num_seqs 8→12: TTFT p99 2.0 s > target 1.0 s; predicted x → y"}
    fig = charts.mark_knob_changes(go.Figure(), [move, {**move, "version": 3, "source": "admin", "reason": None}])
    hover = [a.hovertext for a in fig.layout.annotations]
    assert hover[0] == ("v2 (autopilot): max_num_seqs 8→12<br>max_num_seqs 8→12: TTFT p99 2.0 s &gt; target 1.0 s"
                        "<br>predicted x → y")
    assert hover[1] == "v3: max_num_seqs 8→12"  # an operator's change without a reason: the label alone


# ------------------------------------------------------------------------ live refresh sharing


class _CountingAPI:
    """The API calls the Live tab makes, answered from memory and counted."""

    def __init__(self):
        self.calls = 0
        self.simulations = 0

    def state(self):
        self.calls += 1
        return {"running": 4, "waiting": 2, "kv_blocks_used": 64, "kv_blocks_total": 512, "uptime_s": 60,
                "model": "m", "device": "cpu", "telemetry_rows_dropped": 0}

    def knobs(self):
        return {"knobs": {"max_num_seqs": 16, "scheduling_policy": "continuous"}, "version": 1, "iteration": 20}

    def simulate(self, changes, **source):
        self.simulations += 1
        raise ApiError("not asked for in these tests", 422)


def test_sessions_refreshing_in_one_tick_share_one_build_and_new_telemetry_shows_next_tick(filled_store,
                                                                                          monkeypatch):
    import json
    from collections import Counter
    from concurrent.futures import ThreadPoolExecutor

    import gradio as gr

    from ui.context import DashboardContext

    url, now, _ = filled_store
    engine = store.make_engine(url)
    calls: Counter = Counter()
    for name in ("fetch", "figure_specs"):
        real = getattr(live_tab, name)
        monkeypatch.setattr(live_tab, name, lambda *a, _real=real, _name=name: calls.update([_name]) or _real(*a))
    api = _CountingAPI()
    clock = [now]
    tab = live_tab.LiveTab(DashboardContext(api, url, None, require_login=False), engine, clock=lambda: clock[0])
    n = len(live_tab.CHART_IDS) + 2  # headline, charts, knobs in force

    # eight sessions' timers fire in the same tick, at once: one API read, one query set, one build
    with ThreadPoolExecutor(8) as pool:
        ticks = list(pool.map(lambda _: tab.tick("1m", False, None, "", None), range(8)))
    assert calls == {"fetch": 1, "figure_specs": 1} and api.calls == 1 and tab.cache.builds == 1
    assert all(t[:n] == ticks[0][:n] for t in ticks)
    assert all(not isinstance(out, dict) for out in ticks[0][:n])  # a new session gets everything
    running = json.loads(ticks[0][1].plot)
    assert max(y for y in running["data"][1]["y"] if y is not None) == 6  # running (max) as written
    assert tab.refresh("1m", False, "", None)[:n] == ticks[0][:n]  # the API endpoint shares it too
    seen = ticks[0][n]

    # the same session in the same tick: nothing changed, nothing sent, and its timer slows down
    again = tab.tick("1m", False, seen, "", None)
    assert again[:n] == [gr.skip()] * n and calls["fetch"] == 1
    assert isinstance(again[n + 1], gr.Timer) and again[n + 1].value == 2 * live_tab.REFRESH_S
    idle = tab.tick("1m", False, again[n], "", None)
    assert idle[n + 1].value == live_tab.IDLE_REFRESH_S

    # an iteration arrives: the next tick is built once more, shows it, and the timer is back to 1 s
    writer = TelemetryWriter(url, "r1", flush_interval_s=0.05).start()
    writer.on_iteration(_iteration(40, now + 0.6, running=9))
    assert writer.flush()
    writer.close()
    clock[0] = now + live_tab.REFRESH_S
    later = tab.tick("1m", False, idle[n], "", None)
    assert calls == {"fetch": 2, "figure_specs": 2} and api.calls == 2
    running = json.loads(later[1].plot)
    assert running["data"][1]["y"][-1] == 9
    assert later[n - 1] == gr.skip()  # the knobs in force did not change: not sent again
    assert isinstance(later[n + 1], gr.Timer) and later[n + 1].value == live_tab.REFRESH_S
    # a paused view sends nothing and builds nothing
    assert tab.tick("1m", True, later[n], "", None)[:n] == [gr.skip()] * n and tab.cache.builds == 2
    # max_num_seqs held most of the queueing, but the knobs changed in the window: no what-if asked
    tab.forecasts.wait(10)
    assert api.simulations == 0
    engine.dispose()


# ------------------------------------------------------------------------------------- autopilot


def test_the_autopilot_status_shows_targets_last_move_and_why_it_turned_itself_off():
    from appliance.engine import Knobs
    from appliance.engine.knobs import KnobSnapshot
    from appliance.server.autopilot import Autopilot
    from appliance.server.autopilot_policy import Choice, Move, parse_spec

    spec = parse_spec("ttft_p99=1s,itl_p99=150ms,max_num_seqs=8..128")
    view = {"enabled": True, "status": "watching", "error": None, "spec": spec.as_dict(),
            "moves": [{"at": 0.0, "version": 3, "changes": {"max_num_seqs": 12}, "reason": "max_num_seqs 8→12: why"}],
            "last_decision": {"at": 10.0, "reason": "hold: targets met"}}
    text = autopilot_markdown(view)
    assert text.startswith("**Autopilot on** (watching). Targets: ttft_p99 1 s, itl_p99 0.15 s. "
                           "Bounds: max_num_seqs 8..128.")
    assert "Last move (v3, " in text and "): max_num_seqs 8→12: why" in text
    assert "): hold: targets met" in text
    assert parse_spec(spec_text(view)) == spec  # what the switch sends back is the same spec

    def broken(changes, **why):
        raise RuntimeError("boom")

    failing = Autopilot(lambda: KnobSnapshot(Knobs(max_num_seqs=8)), broken, spec)
    failing._choose = lambda *args: Choice(Move({"max_num_seqs": 12}, "r"), "r")  # a move is due: apply fails
    failing.tick(100.0)
    assert autopilot_markdown(failing.view()).startswith("**Autopilot off** — turned itself off: RuntimeError: boom.")
