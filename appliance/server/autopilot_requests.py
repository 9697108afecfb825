"""What the autopilot's replays carry: the window's finished requests and the engine's requests
still in flight, replayed from the window's start.

The window's iterations begin at its start (its first iteration: 30 s back, or the latest move,
which empties the window); what the engine ran before that is not in it. A request that arrived
earlier would be replayed into an empty engine, without the requests it queued behind that
finished before the window: in a growing queue the replay then predicts TTFTs seconds short
(benchmarks/autopilot.py run 100: requests measured at 3.4 s replayed at 0.1-0.4 s, the replay
of the knobs in force at 81 % within the targets against 9 % measured). So such a request
arrives in the replay at the window's start: one still waiting then has its wait before it added
to its replayed TTFT; one already streaming keeps the TTFT it had and is replayed from the start
with the tokens it had left (its prompt already in the cache, as one token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from appliance.bench.metrics import SLO, RequestResult
from appliance.numeric import percentile
from appliance.records import COMPLETED_REASONS, FinishReason, InFlightRequest, RequestStats
from appliance.sim.replay import SimRequest

from .autopilot_policy import DecodeGaps

MAX_REQUESTS = 300  # requests replayed at most (~1 s per 200 on this CPU)


def replayable(requests: Sequence[RequestStats], in_flight: Sequence[InFlightRequest] = (),
               start: float | None = None) -> tuple[list[RequestStats], list[InFlightRequest], float | None]:
    """What a replay carries, each by arrival, and from when: the requests in flight (the oldest
    MAX_REQUESTS) and the window's finished requests it can carry (with a token, or aborted). When
    that is more than MAX_REQUESTS in all, the replay starts later than `start`: when the newest
    finished ones that fit were all still in the engine (a replay from `start` without the requests
    that finished first would serve the queue they were part of with nothing ahead of it)."""
    pending = sorted(in_flight, key=lambda r: r.arrival)[:MAX_REQUESTS]
    done = sorted((r for r in requests if r.output_tokens >= 1 or r.finish_reason == FinishReason.ABORT),
                  key=lambda r: r.finished)
    dropped = max(0, len(done) - (MAX_REQUESTS - len(pending)))
    if dropped:
        start = max(done[dropped - 1].finished, start if start is not None else float("-inf"))
    return sorted(done[dropped:], key=lambda r: r.arrival), pending, start


@dataclass(frozen=True)
class ReplaySet:
    """The replay's requests (arrivals in seconds from the window's start, none before it) and,
    for each, what it had shown before the window: `waited`, the seconds it had waited (added to
    its replayed TTFT), or `ttft`, the TTFT it had (its first token came before the window)."""

    requests: list[SimRequest]
    waited: list[float]
    ttft: list[float | None]

    @classmethod
    def of(cls, done: Sequence[RequestStats], in_flight: Sequence[InFlightRequest] = (),
           start: float | None = None, now: float | None = None) -> "ReplaySet":
        """`done`'s requests, then `in_flight`'s (as read at `now`), from `start` (default: the
        first arrival). Aborted requests are cancelled when they were. A request in flight
        generates what it has and more (its output is not known yet): its max_tokens when most
        finished ones ran to theirs (finish reason "length"), else the finished ones' median, up
        to its max_tokens."""
        t0 = min((r.arrival for r in (*done, *in_flight)), default=0.0) if start is None else start
        completed = [r for r in done if r.finish_reason in COMPLETED_REASONS]
        to_length = 2 * sum(r.finish_reason == FinishReason.LENGTH for r in completed) > len(completed)
        typical = round(percentile([r.output_tokens for r in completed], 50)) if completed else 1
        out = cls([], [], [])
        for r in done:
            aborted = r.finish_reason == FinishReason.ABORT
            out._add(t0, r.arrival, r.prompt_tokens, r.output_tokens + aborted, r.first_token, r.cached_tokens,
                     made=made_by(t0, r.first_token, r.finished, r.output_tokens),
                     cancel_at=max(0.0, r.finished - t0) if aborted else None)
        for r in in_flight:
            expected = r.max_tokens if to_length else min(r.max_tokens, max(r.output_tokens + 1, typical))
            made = made_by(t0, r.first_token, now, r.output_tokens) if now is not None else 0
            out._add(t0, r.arrival, r.prompt_tokens, expected, r.first_token, r.cached_tokens, made=made)
        return out

    def _add(self, t0: float, arrival: float, prompt: int, output: int, first_token: float | None, cached: int, *,
             made: int, cancel_at: float | None = None) -> None:
        if arrival >= t0:
            self.requests.append(SimRequest(arrival - t0, max(1, prompt), max(1, output), cancel_at, cached))
            self.waited.append(0.0)
            self.ttft.append(None)
        elif first_token is not None and first_token <= t0:  # streaming at the start: its prompt is in
            self.requests.append(SimRequest(0.0, 1, max(1, output - made), cancel_at))
            self.waited.append(0.0)
            self.ttft.append(first_token - arrival)
        else:  # still waiting at the start
            self.requests.append(SimRequest(0.0, max(1, prompt), max(1, output), cancel_at, cached))
            self.waited.append(t0 - arrival)
            self.ttft.append(None)

    def results(self, results: Sequence[RequestResult]) -> list[RequestResult]:
        """A replay's results (in this set's order) with each TTFT from the request's own arrival."""
        return [r if r.ttft is None else replace(r, ttft=known if known is not None else r.ttft + waited)
                for r, waited, known in zip(results, self.waited, self.ttft)]


def made_by(t0: float, first_token: float | None, until: float | None, tokens: int) -> int:
    """Of the `tokens` a request streamed from `first_token` until `until`, about how many it had
    made by `t0` (evenly spread; 0 without a first token by then)."""
    if first_token is None or first_token > t0 or until is None:
        return 0
    if until <= first_token:
        return tokens
    return min(tokens, 1 + int((t0 - first_token) / (until - first_token) * max(0, tokens - 1)))


def missed_already(r: InFlightRequest, now: float, slo: SLO, gaps: DecodeGaps) -> bool:
    """Whether a request still in flight at `now` has missed `slo` already: it has waited longer
    than the TTFT target for its first token, or, streaming, had a gap longer than the ITL target."""
    ttft = (now if r.first_token is None else r.first_token) - r.arrival
    if slo.ttft is not None and ttft > slo.ttft:
        return True
    return (slo.itl is not None and r.first_token is not None
            and max(gaps.of_request(r.first_token, now), default=0.0) > slo.itl)
