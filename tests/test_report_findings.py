"""Findings and the comparison, on hand-built run figures: each finding appears exactly when the
figures support it, and names them."""

from __future__ import annotations

import dataclasses

from appliance.bench.report.analysis import compare, findings
from appliance.bench.report.tables import changes_table
from appliance.bench.report.data import IterationTotals, RunData

QUIET = IterationTotals(iterations=100, busy_s=10.0, scheduled_tokens=20_000, prefill_tokens=15_000,
                        decode_tokens=5_000, padding_tokens=0, preemptions=0, budget_use_mean=0.8,
                        budget_full_share=0.6, waiting_share=0.1, kv_use_max=0.5, kv_pinned_share=0.0,
                        running_max=8, waiting_max=2)


def dist(p50: float, p99: float, count: int = 20) -> dict:
    return {"count": count, "mean": p50, "p50": p50, "p90": p99, "p99": p99, "min": p50 / 2, "max": p99}


def run(name="r", totals=QUIET, queue=(), arrival=None, knobs=None, **summary) -> RunData:
    base = {"num_requests": 20, "completed": 20, "failed": 0, "errors": {}, "duration_s": 10.0,
            "output_throughput": 100.0, "request_throughput": 2.0, "total_token_throughput": 300.0,
            "goodput": None, "slo": None, "ttft": dist(0.1, 0.2), "tpot": dist(0.02, 0.03),
            "itl": dist(0.02, 0.04), "e2e": dist(1.0, 1.5)}
    base.update(summary)
    return RunData(
        run={"id": name, "name": name, "arrival": arrival or {"mode": "all-at-once"}, "started_at": 0.0},
        summary=base, knobs=knobs or {"max_num_seqs": 8, "max_num_batched_tokens": 512},
        fixed={"num_blocks": 256}, knob_changes=[], server={"requests": 20}, totals=totals,
        queue_s=list(queue))


def kinds(data: RunData) -> list[str]:
    return [f.kind for f in findings(data)]


def test_a_healthy_run_has_no_findings():
    assert findings(run()) == []


def test_p99_over_three_times_p50_is_a_scheduling_bottleneck():
    notes = findings(run(ttft=dist(0.1, 0.31), itl=dist(0.02, 0.059)))
    assert [f.kind for f in notes] == ["latency_tail"]
    assert notes[0].text.startswith("TTFT P99 is 3.1x its P50 (310.0 ms vs 100.0 ms)")
    assert "scheduling bottleneck" in notes[0].text
    assert kinds(run(ttft=dist(0.1, 0.5, count=3))) == []  # too few samples to call it


def test_kv_pinned_with_preemptions():
    pinned = dataclasses.replace(QUIET, preemptions=7, kv_pinned_share=0.4, kv_use_max=1.0)
    text = findings(run(totals=pinned))[0].text
    assert "pinned near full" in text and "40%" in text and "7 preemptions" in text and "256 blocks" in text
    assert kinds(run(totals=dataclasses.replace(QUIET, kv_pinned_share=0.9))) == []  # no preemption: fine


def test_token_budget_rarely_filled():
    rarely = dataclasses.replace(QUIET, budget_full_share=0.05, budget_use_mean=0.2, waiting_share=0.5)
    text = findings(run(totals=rarely))[0].text
    assert "max_num_batched_tokens=512" in text and "5%" in text and "max_num_seqs=8" in text
    idle = dataclasses.replace(rarely, waiting_share=0.0)
    assert "never needed it" in findings(run(totals=idle))[0].text
    assert kinds(run(totals=dataclasses.replace(rarely, iterations=5))) == []


def test_queue_growing_without_bound_only_under_open_arrivals():
    growing = [0.05 * i for i in range(20)]  # each later request waits longer
    poisson = {"mode": "poisson", "rate": 4.0}
    text = findings(run(queue=growing, arrival=poisson))[0].text
    assert "grows without bound" in text and "4 requests/s" in text
    assert kinds(run(queue=growing)) == []  # all at once: a backlog that drains, by design
    assert kinds(run(queue=[0.1, 0.9] * 10, arrival=poisson)) == []  # noisy, not growing


def test_padding_of_a_static_run_is_the_convoy_effect():
    static = dataclasses.replace(QUIET, padding_tokens=500, scheduled_tokens=1500)
    text = findings(run(totals=static))[0].text
    assert text.startswith("25% of the computed rows were padding") and "convoy" in text


def test_failures_and_slo_are_reported():
    notes = findings(run(failed=2, errors={"http_429": 2}, slo={"ttft": 0.5}, slo_met=15, goodput=1.5))
    assert [f.kind for f in notes] == ["failures", "slo"]
    assert "2 of 20 requests failed (http_429: 2)" in notes[0].text
    assert "15 of 20" in notes[1].text and "ttft <= 500.0 ms" in notes[1].text


def test_comparison_names_the_winner_the_margin_and_the_settings():
    slow = run("slow", output_throughput=100.0, ttft=dist(0.2, 0.4), knobs={"max_num_seqs": 8})
    fast = run("fast", output_throughput=125.0, ttft=dist(0.1, 0.4), knobs={"max_num_seqs": 32})
    c = compare([slow, fast])
    by_key = {m.key: m for m in c.metrics}
    assert by_key["output_throughput"].winner == 1 and by_key["output_throughput"].margin == 0.25
    assert by_key["ttft.p50"].winner == 1 and by_key["ttft.p50"].margin == 0.5
    assert by_key["ttft.p99"].tie and by_key["goodput"].winner is None
    assert c.knob_diff == {"max_num_seqs": [8, 32]}
    assert c.lines[0].startswith("Overall run 2 (fast) won 2 of") and "max_num_seqs=32" in c.lines[0]
    assert "Output throughput: run 2 (fast) wins with 125.00 tok/s, 25% more than run 1 (slow)" in c.lines[1]


def test_a_margin_on_near_zero_values_is_a_ratio_not_a_percentage():
    """0.43 against 0.01 req/s is "43x", never "4200% more"; close wins stay percentages."""
    from appliance.bench.report.tables import comparison_table

    good = run("good", goodput=0.43, output_throughput=110.0, ttft=dist(0.01, 0.2))
    poor = run("poor", goodput=0.01, output_throughput=100.0, ttft=dist(0.5, 0.6))
    c = compare([good, poor])
    by_key = {m.key: m for m in c.metrics}
    assert by_key["goodput"].margin_text == "43x" and by_key["ttft.p50"].margin_text == "50x"
    assert by_key["output_throughput"].margin_text == "10%"
    goodput = next(line for line in c.lines if line.startswith("Goodput"))
    assert goodput == "Goodput: run 1 (good) wins with 0.43 req/s vs 0.01 req/s for run 2 (poor) (43x more)."
    ttft = next(line for line in c.lines if line.startswith("TTFT P50"))
    assert "10.0 ms vs 500.0 ms" in ttft and "(50x lower)" in ttft
    _, rows = comparison_table(c)
    margins = {row[0]: row[-1] for row in rows}
    assert margins["Goodput"] == "43x" and margins["TTFT P50"] == "50x" and margins["Output throughput"] == "10%"
    assert not any(len(cell) > 3 and cell.endswith("%") for cell in margins.values())  # never "4200%"


def test_the_changes_table_lists_each_change_with_its_source_and_reason():
    data = dataclasses.replace(run(), knob_changes=[
        {"version": 2, "iteration": 40, "applied_at": 3.5, "old": {"max_num_seqs": 8}, "new": {"max_num_seqs": 12},
         "source": "autopilot", "reason": "max_num_seqs 8→12: TTFT p99 2.000 s > target 1.000 s",
         "prediction": {"before": {"attainment": 0.1}, "after": {"attainment": 0.9}}},
        {"version": 3, "iteration": 90, "applied_at": 7.0, "old": {"max_num_seqs": 12}, "new": {"max_num_seqs": 6},
         "source": "admin", "reason": None}])
    header, rows = changes_table(data)
    assert header[-2:] == ["Source", "Reason"]
    assert rows == [["3.50", "2", "40", "max_num_seqs: 8 -> 12", "autopilot",
                     "max_num_seqs 8→12: TTFT p99 2.000 s > target 1.000 s"],
                    ["7.00", "3", "90", "max_num_seqs: 12 -> 6", "admin", "-"]]
