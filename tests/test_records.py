"""The engine's records declared once (appliance.records) and what is derived from them; the
str-valued enums of finish reasons and run statuses. No model, no store."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

import pytest

from appliance.bench.report import data as report_data
from appliance.metrics_spec import metric, metrics_of
from appliance.records import (
    COMPLETED_REASONS,
    FAILED_REASONS,
    FINAL_STATUSES,
    ITERATION_METRICS,
    REQUEST_METRICS,
    FinishReason,
    IterationStats,
    RequestStats,
    RunStatus,
)
from appliance.telemetry.models import SERIES_COLUMNS, Iteration, Request, iteration_rollups
from ui import live_tab


def test_every_record_field_is_a_declared_metric_and_a_column() -> None:
    for record, metrics, table in ((IterationStats, ITERATION_METRICS, Iteration.__table__),
                                   (RequestStats, REQUEST_METRICS, Request.__table__)):
        assert [m.name for m in metrics] == [f.name for f in fields(record)]
        assert {m.name for m in metrics} == set(table.columns.keys()) - {"id", "replica_id"}
        for m in metrics:
            assert table.c[m.name].nullable is m.nullable, m.name
    assert Iteration.__table__.c.iteration.type.__class__.__name__ == "BigInteger"
    assert Request.__table__.c.finish_reason.type.length == 16
    assert Request.__table__.c.run_id.nullable and not Request.__table__.c.arrival.nullable


def test_rolled_up_metrics_are_the_series_and_the_rollup_columns() -> None:
    assert SERIES_COLUMNS == tuple(m.name for m in ITERATION_METRICS if m.rollup)
    assert "policy" not in SERIES_COLUMNS and "iteration" not in SERIES_COLUMNS
    assert {c for c in iteration_rollups.columns.keys() if c not in ("replica_id", "second", "n")} == {
        f"{name}_{stat}" for name in SERIES_COLUMNS for stat in ("min", "max", "sum")
    }


def test_charts_and_reports_read_only_rolled_up_metrics() -> None:
    assert set(live_tab.SERIES) <= set(SERIES_COLUMNS)
    assert set(report_data.SERIES) <= set(SERIES_COLUMNS)
    assert len(live_tab.CHART_IDS) == len(set(live_tab.CHART_IDS))


def test_declarations_that_cannot_be_stored_are_refused() -> None:
    @dataclass(frozen=True)
    class Undeclared:
        a: int

    @dataclass(frozen=True)
    class UnboundedText:
        a: str = metric("text without a length")

    @dataclass(frozen=True)
    class RolledUpText:
        a: str = metric("text", max_length=8, rollup=True)

    @dataclass(frozen=True)
    class Fine:
        a: float | None = metric("seconds", unit="s")

    for record, message in ((Undeclared, "not declared"), (UnboundedText, "max_length"),
                            (RolledUpText, "rolled up")):
        with pytest.raises(TypeError, match=message):
            metrics_of(record)
    (a,) = metrics_of(Fine)
    assert (a.name, a.type, a.nullable, a.unit, a.label, a.rollup) == ("a", float, True, "s", "a", False)


def test_enums_are_their_stored_strings() -> None:
    assert [r.value for r in FinishReason] == ["stop", "length", "abort", "error"]
    assert set(COMPLETED_REASONS) | set(FAILED_REASONS) == set(FinishReason)
    assert [s.value for s in RunStatus] == ["running", "completed", "cancelled", "failed", "interrupted"]
    assert RunStatus.RUNNING not in FINAL_STATUSES and len(FINAL_STATUSES) == 4
    reason = FinishReason.STOP
    assert reason == "stop" and str(reason) == "stop" and f"{reason}" == "stop" and f"{reason:>5}" == " stop"
    assert json.dumps({"finish_reason": reason}) == '{"finish_reason": "stop"}'
    assert {"stop": 1}[reason] == 1 and FinishReason("length") is FinishReason.LENGTH
