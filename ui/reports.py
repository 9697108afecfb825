"""Tuning-report export: appliance.bench.report.render_report when it is installed, written to
a temporary file Gradio can offer as a download.

Until that module exists, a minimal built-in table of the chosen runs (knob snapshot and
headline figures) stands in for it.
"""

from __future__ import annotations

import csv
import html
import io
import tempfile
from pathlib import Path
from typing import Any

from appliance.telemetry import runs
from ui.runs_view import TABLE_HEADERS, table_row

FORMATS = {"HTML": ("html", ".html"), "Markdown": ("markdown", ".md"), "CSV": ("csv", ".csv")}


def render(db_url: str, db: Any, run_ids: list[str], fmt: str) -> str | bytes:
    """The report of `run_ids` in `fmt` (a key of FORMATS)."""
    name, _ = FORMATS[fmt]
    try:
        from appliance.bench.report import render_report
    except ImportError:
        return _fallback(db, run_ids, name)
    return render_report(db_url, run_ids, name)


def export(db_url: str, db: Any, run_ids: list[str], fmt: str) -> Path:
    """Write the report to a fresh temporary file and return its path."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown report format {fmt!r}; choose from {', '.join(FORMATS)}")
    if not run_ids:
        raise ValueError("pick at least one run for the report")
    content = render(db_url, db, run_ids, fmt)
    folder = Path(tempfile.mkdtemp(prefix="appliance-report-"))
    path = folder / f"tuning-report{FORMATS[fmt][1]}"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def _fallback(db: Any, run_ids: list[str], fmt: str) -> str:
    rows = []
    for run_id in run_ids:
        run = runs.get_run(db, run_id)
        if run is None:
            raise ValueError(f"no run {run_id}")
        rows.append(["" if v is None else v for v in table_row(db, run)])
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(TABLE_HEADERS)
        writer.writerows(rows)
        return out.getvalue()
    if fmt == "markdown":
        lines = ["# Tuning report", "", "| " + " | ".join(TABLE_HEADERS) + " |",
                 "|" + "---|" * len(TABLE_HEADERS)]
        lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
        return "\n".join(lines) + "\n"
    head = "".join(f"<th>{html.escape(h)}</th>" for h in TABLE_HEADERS)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>" for row in rows)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>Tuning report</title></head>"
            f"<body><h1>Tuning report</h1><table border='1'><tr>{head}</tr>{body}</table></body></html>")
