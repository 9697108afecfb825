"""Plain-word findings about a run, and the comparison of several runs.

Findings are only stated when the data supports them (thresholds below); each names the
figures it rests on. The comparison says, per headline metric, which run won and by how much,
and which knob settings set the runs apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import fmean
from typing import Any, Sequence

from appliance.bench.report.data import BUDGET_FULL, KV_PINNED, RunData
from appliance.numeric import ms_text

TAIL_RATIO = 3.0  # P99/P50 above this: the article's sign of a scheduling bottleneck
MIN_SAMPLES = 4  # fewer latencies than this: no tail finding
KV_PINNED_SHARE = 0.2  # pinned in at least this share of iterations
BUDGET_RARELY = 0.1  # budget filled in fewer than this share of iterations
MIN_ITERATIONS = 10
PADDING_SHARE = 0.05
QUEUE_GROWTH = 3.0  # last-quarter queue time above this multiple of the first quarter's
QUEUE_GROWTH_MIN_S = 0.25
TIE = 0.02  # relative differences below this are ties
RATIO_FROM = 2.0  # a winner at least this many times better is said as a ratio ("43x"), not a percentage
LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E"}
TAIL_CAUSES = {
    "ttft": "requests wait behind others before their first token (queueing, admission limits)",
    "itl": "decode steps stall behind other work, typically long prefills in the same "
           "iteration (a smaller long_prefill_token_threshold spreads them out)",
    "e2e": "some requests are held back by others (queueing or stalls)",
}


@dataclass(frozen=True)
class Finding:
    kind: str  # latency_tail | kv_pressure | budget_unused | queue_growth | padding | failures | slo
    text: str


def pct(share: float | None) -> str:
    return "-" if share is None else f"{share * 100:.0f}%"


def findings(data: RunData) -> list[Finding]:
    """What the run's figures say, in plain words (empty when nothing stands out)."""
    out: list[Finding] = []
    out += _failures(data)
    out += _tails(data)
    out += _kv_pressure(data)
    out += _budget(data)
    out += _queue_growth(data)
    out += _padding(data)
    out += _slo(data)
    return out


def _failures(data: RunData) -> list[Finding]:
    s = data.summary
    failed = s.get("failed") or 0
    if not failed:
        return []
    kinds = ", ".join(f"{k}: {v}" for k, v in (s.get("errors") or {}).items())
    return [Finding("failures", f"{failed} of {s.get('num_requests')} requests failed"
                                + (f" ({kinds})." if kinds else "."))]


def _tails(data: RunData) -> list[Finding]:
    out = []
    for metric in ("ttft", "itl", "e2e"):
        d = data.summary.get(metric) or {}
        p50, p99 = d.get("p50"), d.get("p99")
        if (d.get("count") or 0) < MIN_SAMPLES or not p50 or p99 is None:
            continue
        ratio = p99 / p50
        if ratio > TAIL_RATIO:
            out.append(Finding("latency_tail", (
                f"{LABELS[metric]} P99 is {ratio:.1f}x its P50 ({ms_text(p99)} vs {ms_text(p50)}). Above "
                f"{TAIL_RATIO:g}x is the sign of a scheduling bottleneck: {TAIL_CAUSES[metric]}.")))
    return out


def _kv_pressure(data: RunData) -> list[Finding]:
    t = data.totals
    if not t.preemptions:
        return []
    blocks = data.fixed.get("num_blocks")
    cache = f"of its {blocks} blocks " if blocks else ""
    pinned = t.kv_pinned_share or 0.0
    if pinned >= KV_PINNED_SHARE:
        text = (f"The KV cache was pinned near full (>= {KV_PINNED:.0%} {cache}in {pct(pinned)} of "
                f"iterations) and {t.preemptions} preemptions threw away computed prefills: memory "
                "is the bottleneck. Lower max_num_seqs or give the KV cache more memory.")
    else:
        text = (f"{t.preemptions} preemptions happened (KV cache peak {pct(t.kv_use_max)}): "
                "bursts ran out of KV blocks; a lower max_num_seqs avoids the recomputation.")
    return [Finding("kv_pressure", text)]


def _budget(data: RunData) -> list[Finding]:
    t = data.totals
    if t.iterations < MIN_ITERATIONS or t.budget_full_share is None or t.budget_full_share >= BUDGET_RARELY:
        return []
    budget = data.knobs.get("max_num_batched_tokens")
    name = f"max_num_batched_tokens={budget}" if budget else "max_num_batched_tokens"
    text = (f"The token budget ({name}) was rarely filled: >= {BUDGET_FULL:.0%} used in only "
            f"{pct(t.budget_full_share)} of {t.iterations} iterations (mean use {pct(t.budget_use_mean)}).")
    if (t.waiting_share or 0.0) > 0.2:
        text += (f" Requests were left waiting in {pct(t.waiting_share)} of iterations, so admission "
                 f"was limited elsewhere (max_num_seqs={data.knobs.get('max_num_seqs')} or the KV cache).")
    else:
        text += " The load never needed it; a smaller budget would bound each step's time."
    return [Finding("budget_unused", text)]


def _queue_growth(data: RunData) -> list[Finding]:
    q = data.queue_s
    if len(q) < 8 or (data.run.get("arrival") or {}).get("mode") not in ("poisson", "workload"):
        return []  # all-at-once and fixed-concurrency runs queue by design
    n = len(q) // 4
    quarters = [fmean(q[i * n:(i + 1) * n]) for i in range(3)] + [fmean(q[3 * n:])]
    first, last = quarters[0], quarters[3]
    growing = quarters[1] <= quarters[2] <= last
    if not (growing and last > QUEUE_GROWTH * first and last - first > QUEUE_GROWTH_MIN_S):
        return []
    rate = (data.run.get("arrival") or {}).get("rate")
    at = f" ({rate:g} requests/s)" if rate else ""
    return [Finding("queue_growth", (
        f"The waiting queue kept growing while requests arrived: the last quarter of requests "
        f"waited {last:.2f} s to be scheduled against {first:.2f} s for the first quarter (peak "
        f"{data.totals.waiting_max} waiting). The arrival rate{at} is above what the server "
        "sustains at these settings, so the queue grows without bound; lower the rate or raise capacity."))]


def _padding(data: RunData) -> list[Finding]:
    t = data.totals
    share = t.padding_share
    if share is None or share < PADDING_SHARE:
        return []
    return [Finding("padding", (
        f"{pct(share)} of the computed rows were padding ({t.padding_tokens} padding rows against "
        f"{t.scheduled_tokens} real tokens): finished requests stayed in the static batch until its "
        "longest member ended (the convoy effect)."))]


def _slo(data: RunData) -> list[Finding]:
    s = data.summary
    if not s.get("slo"):
        return []
    met, done = s.get("slo_met"), s.get("completed")
    targets = ", ".join(f"{k} <= {ms_text(v)}" for k, v in s["slo"].items())
    return [Finding("slo", f"{met} of {done} completed requests met the SLO ({targets}); "
                           f"goodput {s.get('goodput') or 0:.2f} requests/s.")]


# ------------------------------------------------------------------------------------ comparison

# (summary key, label, unit ("ms": seconds shown as ms), higher is better)
COMPARED: tuple[tuple[str, str, str, bool], ...] = (
    ("output_throughput", "Output throughput", "tok/s", True),
    ("request_throughput", "Request throughput", "req/s", True),
    ("goodput", "Goodput", "req/s", True),
    ("ttft.p50", "TTFT P50", "ms", False),
    ("ttft.p99", "TTFT P99", "ms", False),
    ("tpot.p50", "TPOT P50", "ms", False),
    ("itl.p99", "ITL P99", "ms", False),
    ("e2e.p50", "E2E P50", "ms", False),
    ("e2e.p99", "E2E P99", "ms", False),
)


def metric_value(summary: dict[str, Any], key: str) -> float | None:
    """A summary figure by dotted key, e.g. "ttft.p99" or "output_throughput"."""
    value: Any = summary
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


@dataclass(frozen=True)
class MetricComparison:
    key: str
    label: str
    unit: str
    higher_is_better: bool
    values: list[float | None]  # per run, in the order given
    winner: int | None  # index of the best run; None when fewer than two runs have the figure
    runner_up: int | None
    margin: float | None  # relative advantage of the winner over the runner-up (0.23 = 23 %)

    @property
    def tie(self) -> bool:
        return self.margin is not None and self.margin < TIE

    @property
    def ratio(self) -> float | None:
        """How many times better the winner is than the runner-up (None without both, or a zero)."""
        if self.winner is None or self.runner_up is None:
            return None
        best, second = self.values[self.winner], self.values[self.runner_up]
        if best is None or second is None:
            return None
        better, worse = (best, second) if self.higher_is_better else (second, best)
        return better / worse if worse > 0 else None

    @property
    def margin_text(self) -> str:
        """The margin in words: "25%" for a close win, "43x" from RATIO_FROM times up (a value near
        zero makes percentages meaningless: 0.43 against 0.01 is 43x, not "4200% more")."""
        ratio = self.ratio
        if ratio is not None and ratio >= RATIO_FROM:
            return f"{ratio:.1f}x" if ratio < 10 else f"{ratio:.0f}x"
        return pct(self.margin)


@dataclass(frozen=True)
class Comparison:
    names: list[str]
    metrics: list[MetricComparison]
    knob_diff: dict[str, list[Any]]  # knobs whose starting values differ between runs
    wins: list[int]  # metrics won (ties not counted) per run
    lines: list[str]  # the comparison in plain words


def compare(runs: Sequence[RunData]) -> Comparison:
    """Which run won each headline metric, by how much, and with which settings."""
    names = [_label(r, i) for i, r in enumerate(runs)]
    metrics = [_compare_metric(runs, *spec) for spec in COMPARED]
    keys = sorted({k for r in runs for k in r.knobs})
    knob_diff = {k: [r.knobs.get(k) for r in runs] for k in keys
                 if len({repr(r.knobs.get(k)) for r in runs}) > 1}
    wins = [0] * len(runs)
    lines = []
    for m in metrics:
        if m.winner is None or m.runner_up is None or m.margin is None:
            continue
        best, second = m.values[m.winner], m.values[m.runner_up]
        if m.tie:
            lines.append(f"{m.label}: a tie ({_fmt(best, m.unit)} vs {_fmt(second, m.unit)}).")
            continue
        wins[m.winner] += 1
        direction = "more" if m.higher_is_better else "lower"
        if m.ratio is not None and m.ratio >= RATIO_FROM:
            lines.append(f"{m.label}: {names[m.winner]} wins with {_fmt(best, m.unit)} vs {_fmt(second, m.unit)} "
                         f"for {names[m.runner_up]} ({m.margin_text} {direction}).")
        else:
            lines.append(f"{m.label}: {names[m.winner]} wins with {_fmt(best, m.unit)}, {m.margin_text} "
                         f"{direction} than {names[m.runner_up]} ({_fmt(second, m.unit)}).")
    if any(wins):
        top = max(range(len(runs)), key=lambda i: wins[i])
        settings = ", ".join(f"{k}={v[top]}" for k, v in knob_diff.items())
        lines.insert(0, f"Overall {names[top]} won {wins[top]} of {sum(1 for m in metrics if m.margin is not None)} "
                        f"compared metrics" + (f", with {settings}." if settings else " (same knob settings)."))
    return Comparison(names, metrics, knob_diff, wins, lines)


def _label(run: RunData, index: int) -> str:
    return f"run {index + 1} ({run.name})"


def _compare_metric(runs: Sequence[RunData], key: str, label: str, unit: str, higher: bool) -> MetricComparison:
    values = [metric_value(r.summary, key) for r in runs]
    ranked = sorted((i for i, v in enumerate(values) if v is not None),
                    key=lambda i: values[i], reverse=higher)  # type: ignore[arg-type, return-value]
    if len(ranked) < 2:
        return MetricComparison(key, label, unit, higher, values, None, None, None)
    best, second = values[ranked[0]], values[ranked[1]]
    assert best is not None and second is not None
    if higher:
        margin = best / second - 1 if second > 0 else (0.0 if best == second else None)
    else:
        margin = (second - best) / second if second > 0 else 0.0
    return MetricComparison(key, label, unit, higher, values, ranked[0], ranked[1], margin)


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "ms":
        return ms_text(value)
    return f"{value:.2f} {unit}"
