"""Self-contained HTML pages with plotly charts that open offline.

plotly.js is inlined once per page. The bundle names external resources (map tiles, fonts,
plotly's cloud, licence links) that this page never uses: every such http(s) URL is replaced
by about:blank, and the W3C XML namespace names it needs to draw SVG (identifiers that are
never fetched) are written with an escaped colon inside their JS strings, so the file holds no
URL a browser could fetch. MathJax is not included and the plotly logo and cloud links are off.
"""

from __future__ import annotations

import functools
import html
import json
import re
from typing import Any, Sequence

import plotly.graph_objects as go

PLOTLY_CONFIG = {"displaylogo": False, "showLink": False, "showSendToCloud": False,
                 "showEditInChartStudio": False, "responsive": True}
URL = re.compile(r"""https?://[^\s"'`<>()\\]*""", re.IGNORECASE)
XML_NAMESPACE = re.compile(r"(https?):(//www\.w3\.org/)", re.IGNORECASE)
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:2rem auto;max-width:1200px;
 padding:0 1rem;color:#222;line-height:1.4}
h1{font-size:1.7rem}h2{border-bottom:2px solid #ddd;padding-bottom:.2rem;margin-top:2.2rem}
h3{margin-top:1.5rem}
table{border-collapse:collapse;margin:.6rem 0;font-size:.9rem}
th,td{border:1px solid #ccc;padding:.25rem .6rem;text-align:right}
th:first-child,td:first-child{text-align:left}th{background:#f4f4f4}
dl.facts{display:grid;grid-template-columns:max-content auto;gap:.15rem 1rem}dl.facts dt{font-weight:600}
dl.facts dd{margin:0}
.findings li{margin:.3rem 0}.chart{width:100%;height:360px}.muted{color:#777}
.grid{display:grid;grid-template-columns:1fr 1fr;gap:.5rem}
"""


@functools.lru_cache(maxsize=1)
def offline_plotlyjs() -> str:
    """plotly.js with every fetchable URL removed (see the module docstring)."""
    from plotly.offline import get_plotlyjs

    js = XML_NAMESPACE.sub(r"\1\\x3a\2", get_plotlyjs())
    return URL.sub("about:blank", js)


def external_urls(text: str) -> list[str]:
    """The http(s) URLs in `text` (a finished page must have none)."""
    return URL.findall(text)


def esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], cls: str = "") -> str:
    if not rows:
        return '<p class="muted">none</p>'
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    attr = f' class="{cls}"' if cls else ""
    return f"<table{attr}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def facts(items: Sequence[tuple[str, str]]) -> str:
    return '<dl class="facts">' + "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in items) + "</dl>"


def bullet_list(items: Sequence[str], cls: str = "") -> str:
    if not items:
        return '<p class="muted">nothing stands out</p>'
    attr = f' class="{cls}"' if cls else ""
    return f"<ul{attr}>" + "".join(f"<li>{esc(i)}</li>" for i in items) + "</ul>"


class Page:
    """An HTML page assembled section by section; charts get ids chart-1, chart-2, ..."""

    def __init__(self, title: str):
        self.title = title
        self.parts: list[str] = []
        self._charts = 0

    def add(self, markup: str) -> None:
        self.parts.append(markup)

    def heading(self, level: int, text: str, anchor: str | None = None) -> None:
        ident = f' id="{esc(anchor)}"' if anchor else ""
        self.add(f"<h{level}{ident}>{esc(text)}</h{level}>")

    def chart(self, fig: go.Figure) -> str:
        """A div that draws `fig` once plotly.js has loaded (markup to place with `add`)."""
        self._charts += 1
        ident = f"chart-{self._charts}"
        fig.update_layout(template="plotly_white", margin={"l": 60, "r": 20, "t": 50, "b": 50},
                          legend={"orientation": "h", "y": -0.2})
        spec = fig.to_json().replace("</", "<\\/")
        config = json.dumps(PLOTLY_CONFIG)
        return (f'<div id="{ident}" class="chart"></div><script>(function(){{var f={spec};'
                f'Plotly.newPlot("{ident}",f.data,f.layout,{config});}})();</script>')

    def render(self) -> str:
        body = "\n".join(self.parts)
        return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
                f'<meta name="viewport" content="width=device-width, initial-scale=1">'
                f"<title>{esc(self.title)}</title><style>{STYLE}</style>"
                f"<script>{offline_plotlyjs()}</script></head>\n<body>\n{body}\n</body></html>\n")


def line_figure(title: str, x_title: str, y_title: str,
                traces: Sequence[tuple[str, Sequence[float], Sequence[float], dict[str, Any]]],
                markers: Sequence[tuple[float, str]] = ()) -> go.Figure:
    """Lines (name, x, y, extra scatter options), with dashed vertical markers (x, label)."""
    fig = go.Figure()
    for i, (name, xs, ys, extra) in enumerate(traces):
        options = {"mode": "lines", "line": {"color": COLORS[i % len(COLORS)]}, **extra}
        fig.add_trace(go.Scatter(x=list(xs), y=list(ys), name=name, **options))
    for x, label in markers:
        fig.add_vline(x=x, line={"dash": "dash", "color": "#888"},
                      annotation={"text": label, "font": {"size": 10}})
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title=y_title)
    return fig


def bar_figure(title: str, y_title: str, categories: Sequence[str],
               groups: Sequence[tuple[str, Sequence[float | None]]], colors: Sequence[str] = COLORS) -> go.Figure:
    """Grouped bars: one group per category, one bar per (name, values) series (the report's
    charts and the dashboard's comparison)."""
    fig = go.Figure()
    for i, (name, values) in enumerate(groups):
        fig.add_trace(go.Bar(x=list(categories), y=list(values), name=name,
                             marker={"color": colors[i % len(colors)]}))
    fig.update_layout(title=title, yaxis_title=y_title, barmode="group")
    return fig
