"""`appliance report`: write the report of stored runs.

Exit status: 0 written, 2 bad arguments or unknown run. `format_for` and `write_output` also
serve `appliance tune --report` (appliance.bench.tune_cli).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from appliance.bench.cli import db_url
from appliance.bench.report.runs import FORMATS, normalize_format, render_report

SUFFIX_FORMATS = {".html": "html", ".htm": "html", ".md": "md", ".markdown": "md", ".csv": "csv", ".json": "json"}
FORMAT_CHOICES = [*FORMATS, "markdown"]


def format_for(fmt: str | None, output: str | None) -> str:
    """--format, else the output file's suffix, else html."""
    if fmt is not None:
        return normalize_format(fmt)
    if output is not None and output != "-":
        return SUFFIX_FORMATS.get(Path(output).suffix.lower(), "html")
    return "html"


def write_output(text: str, output: str | None) -> None:
    """Write `text` to the file `output` (standard output for None or "-")."""
    if output is None or output == "-":
        sys.stdout.write(text)
        return
    path = Path(output)
    if path.parent and not path.parent.exists():
        raise FileNotFoundError(f"{path.parent}: no such folder for --output")
    path.write_text(text, encoding="utf-8")


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """The `appliance report` flags."""
    parser.add_argument("run_ids", nargs="+", metavar="RUN_ID", help="stored runs to report on (in order)")
    parser.add_argument("--format", choices=FORMAT_CHOICES, default=None,
                        help="html (self-contained, opens offline), md, csv or json "
                             "(default: from --output's suffix, else html)")
    parser.add_argument("--output", "-o", default=None, help="file to write (default: standard output)")
    parser.add_argument("--db", default=None, help="telemetry store URL (default: sqlite:///appliance.db)")


def report_main(args: argparse.Namespace) -> int:
    try:
        fmt = format_for(args.format, args.output)
        text = render_report(db_url(args.db), list(args.run_ids), fmt)
        write_output(text, args.output)
    except (ValueError, LookupError, FileNotFoundError) as exc:
        print(f"appliance report: error: {exc}", file=sys.stderr)
        return 2
    if args.output not in (None, "-"):
        print(f"wrote the {fmt} report of {len(args.run_ids)} run(s) to {args.output}", file=sys.stderr)
    return 0
