"""Reports of stored runs and of tuning sweeps.

- `runs`: `render_report(db_url, run_ids, fmt)`, the report of stored runs (HTML, Markdown, CSV,
  JSON) and the comparison of several.
- `sweep`: `render_sweep(result, fmt)`, the report of an `appliance tune` sweep.
- `data`: what a report reads of one run from the telemetry store.
- `analysis`: findings in plain words and the comparison of runs.
- `tables`: the report's tables as plain rows, shared by the renderers.
- `page`: self-contained HTML pages with plotly charts that open offline.
- `cli`: the `appliance report` command.
"""
