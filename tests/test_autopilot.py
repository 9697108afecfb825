"""The SLO autopilot against scripted telemetry windows (no model, no clock: tick(now) is called
directly), and its HTTP switch on the real server."""

from __future__ import annotations

import httpx
import pytest

from appliance.engine import Knobs
from appliance.records import ITERATION_METRICS, HoldCause, IterationStats, KnobChange, RequestStats
from appliance.server.autopilot import SOURCE, Autopilot
from appliance.server.autopilot_policy import SpecError, parse_spec


def iteration(t: float, duration: float = 0.1, kv: float = 0.3, prefill: int = 0, **held: int) -> IterationStats:
    base = {m.name: 0 for m in ITERATION_METRICS}
    base.update(started_at=t, duration_s=duration, policy="continuous", kv_blocks_total=100,
                kv_blocks_used=int(kv * 100), prefill_tokens=prefill,
                **{HoldCause[k.upper()].column: v for k, v in held.items()})
    return IterationStats(**base)


def request(t: float, ttft: float, itl: float = 0.02, out: int = 11) -> RequestStats:
    return RequestStats("r", "api", None, t, t, t + ttft, t + ttft + itl * (out - 1), 8, out, "length", 0, 0)


class Engine:
    """The knob path as the autopilot sees it: validated, versioned, announced to sinks."""

    def __init__(self, **knobs):
        self.knobs = Knobs(**knobs)
        self.version = 0
        self.sinks = []
        self.fail = False

    def apply(self, changes, source=SOURCE, at=0.0):
        if self.fail:
            raise RuntimeError("boom")
        old = self.knobs
        self.knobs = old.with_changes(changes)
        self.version += 1
        change = KnobChange(self.version, 0, at, {k: old.as_dict()[k] for k in changes}, dict(changes), source)
        for sink in self.sinks:
            sink.on_knob_change(change)
        return change


def pilot(spec: str, **knobs) -> tuple[Autopilot, Engine]:
    engine = Engine(**knobs)
    ap = Autopilot(lambda: engine.knobs, engine.apply, parse_spec(spec), window_s=30, cooldown_s=10,
                   manual_hold_s=60)
    engine.sinks.append(ap)
    return ap, engine


def feed(ap: Autopilot, t0: float, ttft: float = 2.0, itl: float = 0.02, prefill: int = 0, kv: float = 0.3,
         **held: int) -> None:
    """10 s of traffic: 50 iterations and 10 finished requests."""
    for i in range(50):
        ap.on_iteration(iteration(t0 + i * 0.2, kv=kv, prefill=prefill, **held))
    for i in range(10):
        ap.on_request(request(t0 + i, ttft, itl))


def test_spec_parsing_names_every_bad_entry():
    spec = parse_spec("ttft_p99=1s, itl_p99=150ms, max_num_seqs=8..128")
    assert spec.targets == {"ttft_p99": 1.0, "itl_p99": 0.15} and spec.bounds == {"max_num_seqs": (8, 128)}
    assert parse_spec({"targets": {"ttft_p99": "500ms"}, "bounds": {"max_num_seqs": [2, 4]}}).bounds == {
        "max_num_seqs": (2, 4)}
    with pytest.raises(SpecError) as err:
        parse_spec("ttft_p99=soon,max_num_seqs=9..3,color=red,nonsense")
    assert set(err.value.errors) == {"ttft_p99", "max_num_seqs", "color", "nonsense"}
    with pytest.raises(SpecError, match="at least one"):
        parse_spec("max_num_seqs=1..4")


def test_ttft_over_target_with_max_num_seqs_binding_raises_it_within_bounds():
    ap, engine = pilot("ttft_p99=1s,max_num_seqs=4..20", max_num_seqs=8, max_num_batched_tokens=512)
    now = 1000.0
    values = []
    for step in range(6):
        feed(ap, now - 10, ttft=2.0, max_num_seqs=3)
        move = ap.tick(now)
        values.append(engine.knobs.max_num_seqs)
        now += 11  # past the cooldown
        if move is not None:
            assert "TTFT p99 2.000 s > target 1.000 s" in move.reason and "max_num_seqs" in move.reason
    assert values == [12, 18, 20, 20, 20, 20]  # x1.5 each move, then held at the upper bound
    assert [m["changes"] for m in ap.view()["moves"]] == [{"max_num_seqs": 12}, {"max_num_seqs": 18},
                                                          {"max_num_seqs": 20}]


def test_a_full_kv_cache_stops_max_num_seqs_from_rising():
    ap, engine = pilot("ttft_p99=1s", max_num_seqs=8)
    feed(ap, 990.0, ttft=2.0, kv=0.95, max_num_seqs=3)
    assert ap.tick(1000.0) is None and engine.knobs.max_num_seqs == 8


def test_token_budget_binding_raises_the_budget():
    ap, engine = pilot("ttft_p99=1s,max_num_batched_tokens=64..600", max_num_batched_tokens=512)
    feed(ap, 990.0, ttft=2.0, token_budget=4)
    ap.tick(1000.0)
    assert engine.knobs.max_num_batched_tokens == 600


def test_itl_over_target_with_prefill_in_steps_halves_the_chunk():
    ap, engine = pilot("ttft_p99=1s,itl_p99=50ms,long_prefill_token_threshold=64..512",
                       long_prefill_token_threshold=256)
    feed(ap, 990.0, ttft=0.2, itl=0.2, prefill=256)
    move = ap.tick(1000.0)
    assert engine.knobs.long_prefill_token_threshold == 128 and "ITL p99 200 ms > target 50 ms" in move.reason
    feed(ap, 1001.0, ttft=0.2, itl=0.2, prefill=256)
    ap.tick(1012.0)
    assert engine.knobs.long_prefill_token_threshold == 64
    feed(ap, 1013.0, ttft=0.2, itl=0.2, prefill=256)
    ap.tick(1024.0)  # the chunk is at its bound: max_num_seqs goes down instead
    assert engine.knobs.long_prefill_token_threshold == 64 and engine.knobs.max_num_seqs == 48


def test_rate_limit_and_hysteresis_no_flapping():
    ap, engine = pilot("ttft_p99=1s,max_num_seqs=4..64", max_num_seqs=8)
    feed(ap, 990.0, ttft=2.0, max_num_seqs=3)
    assert ap.tick(1000.0) is not None
    feed(ap, 1000.0, ttft=2.0, max_num_seqs=3)
    assert ap.tick(1005.0) is None  # within the cooldown
    # (each window below holds only the traffic fed just before its tick)
    feed(ap, 1035.0, ttft=0.8, max_num_seqs=3)  # under target but not under half of it: stay
    assert ap.tick(1045.0) is None and engine.knobs.max_num_seqs == 12
    feed(ap, 1046.0, ttft=0.3)  # well under: give the last raise back, once
    move = ap.tick(1080.0)
    assert engine.knobs.max_num_seqs == 8 and "giving back" in move.reason
    feed(ap, 1081.0, ttft=0.3)
    assert ap.tick(1091.0) is None and engine.knobs.max_num_seqs == 8


def test_stops_when_switched_off_and_resumes_when_on():
    ap, engine = pilot("ttft_p99=1s", max_num_seqs=8)
    ap.configure(enabled=False)
    feed(ap, 990.0, ttft=2.0, max_num_seqs=3)
    assert ap.tick(1000.0) is None and engine.version == 0 and ap.view()["status"] == "off"
    ap.configure(enabled=True)
    assert ap.tick(1000.0) is not None and engine.knobs.max_num_seqs == 12


def test_a_manual_change_wins_and_holds_the_autopilot():
    ap, engine = pilot("ttft_p99=1s", max_num_seqs=8)
    feed(ap, 990.0, ttft=2.0, max_num_seqs=3)
    engine.apply({"max_num_seqs": 6}, source="admin", at=999.0)  # an operator's PATCH
    assert ap.tick(1000.0) is None and engine.knobs.max_num_seqs == 6
    assert ap.view()["status"].startswith("holding")
    feed(ap, 1050.0, ttft=2.0, max_num_seqs=3)
    assert ap.tick(1058.0) is None  # still within the hold
    assert ap.tick(1060.0) is not None and engine.knobs.max_num_seqs == 9  # from the operator's 6


def test_a_manual_change_while_deciding_drops_the_decision():
    ap, engine = pilot("ttft_p99=1s", max_num_seqs=8)
    feed(ap, 990.0, ttft=2.0, max_num_seqs=3)
    knobs = ap._knobs

    def read_then_patch():  # the operator's PATCH lands between the autopilot's read and its apply
        value = knobs()
        if engine.version == 0:
            engine.apply({"max_num_batched_tokens": 256}, source="admin", at=0.0)
        return value

    ap._knobs = read_then_patch
    assert ap.tick(1000.0) is None and engine.knobs.max_num_seqs == 8 and engine.version == 1


def test_a_controller_failure_turns_it_off_without_raising():
    ap, engine = pilot("ttft_p99=1s", max_num_seqs=8)
    engine.fail = True
    feed(ap, 990.0, ttft=2.0, max_num_seqs=3)
    assert ap.tick(1000.0) is None
    view = ap.view()
    assert view["enabled"] is False and view["status"] == "off after an error: RuntimeError: boom"
    engine.fail = False
    assert ap.tick(1011.0) is None and engine.version == 0


def test_too_few_requests_means_no_decision():
    ap, engine = pilot("ttft_p99=1s", max_num_seqs=8)
    for i in range(4):
        ap.on_request(request(995.0 + i, 5.0))
        ap.on_iteration(iteration(995.0 + i, max_num_seqs=3))
    assert ap.tick(1000.0) is None


def test_admin_autopilot_route(live_server):
    base = live_server.base_url
    view = httpx.get(f"{base}/admin/autopilot").json()
    assert view["enabled"] is False and view["status"] == "off"
    assert httpx.get(f"{base}/admin/state").json()["autopilot"] == "off"  # what the Live headline shows
    bad = httpx.patch(f"{base}/admin/autopilot", json={"enabled": True, "spec": "ttft_p99=fast"})
    assert bad.status_code == 422 and "spec.ttft_p99" in bad.json()["error"]["message"]
    assert httpx.get(f"{base}/admin/autopilot").json() == view  # nothing changed
    assert httpx.patch(f"{base}/admin/autopilot", json={"enabled": True}).status_code == 422  # no targets yet
    on = httpx.patch(f"{base}/admin/autopilot", json={"enabled": True, "spec": "ttft_p99=2s,max_num_seqs=8..64"})
    assert on.status_code == 200
    assert on.json()["enabled"] is True and on.json()["spec"] == {"targets": {"ttft_p99": 2.0},
                                                                 "bounds": {"max_num_seqs": [8, 64]}}
    off = httpx.patch(f"{base}/admin/autopilot", json={"enabled": False})
    assert off.json()["enabled"] is False and off.json()["spec"]["targets"] == {"ttft_p99": 2.0}


def test_serve_flag_is_checked_and_carried():
    import argparse

    from appliance.server.cli import add_serve_arguments, server_options

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--no-telemetry", "--autopilot", "ttft_p99=1s,max_num_seqs=8..128"])
    assert args.autopilot == "ttft_p99=1s,max_num_seqs=8..128"
    assert server_options({"autopilot": args.autopilot}, args)["autopilot"] == args.autopilot
    with pytest.raises(ValueError, match=r"--autopilot 'ttft_p99=x': ttft_p99: must be a positive duration"):
        server_options({"autopilot": "ttft_p99=x"}, args)
