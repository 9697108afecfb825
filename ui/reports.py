"""Tuning-report export: appliance.bench.report.runs.render_report written to a temporary file that
Gradio offers as a download."""

from __future__ import annotations

import tempfile
from pathlib import Path

from appliance.bench.report.runs import render_report

FORMATS = {"HTML": ("html", ".html"), "Markdown": ("md", ".md"), "CSV": ("csv", ".csv")}


def export(db_url: str, run_ids: list[str], fmt: str) -> Path:
    """Write the report of `run_ids` in `fmt` (a key of FORMATS) to a fresh temporary file."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown report format {fmt!r}; choose from {', '.join(FORMATS)}")
    if not run_ids:
        raise ValueError("pick at least one run for the report")
    name, suffix = FORMATS[fmt]
    content = render_report(db_url, run_ids, name)
    path = Path(tempfile.mkdtemp(prefix="appliance-report-")) / f"tuning-report{suffix}"
    path.write_text(content, encoding="utf-8")
    return path
