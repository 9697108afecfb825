"""Knob validation (pure) and live changes on a real engine."""

from __future__ import annotations

import pytest

from appliance.engine import KnobError, Knobs, SamplingParams


def test_defaults_valid_and_names():
    k = Knobs()
    assert set(k.as_dict()) == set(Knobs.names())


@pytest.mark.parametrize(
    "changes, bad",
    [
        ({"max_num_seqs": 0}, {"max_num_seqs"}),
        ({"max_num_seqs": True}, {"max_num_seqs"}),
        ({"max_num_seqs": 2.5}, {"max_num_seqs"}),
        ({"max_num_batched_tokens": 8, "max_num_seqs": 16}, {"max_num_batched_tokens"}),
        ({"long_prefill_token_threshold": 4096}, {"long_prefill_token_threshold"}),
        ({"max_long_partial_prefills": 5, "max_num_partial_prefills": 2}, {"max_long_partial_prefills"}),
        ({"scheduling_policy": "fifo"}, {"scheduling_policy"}),
        ({"bogus": 1}, {"bogus"}),
        ({"max_num_seqs": -1, "scheduling_policy": None, "bogus": 1}, {"max_num_seqs", "scheduling_policy", "bogus"}),
    ],
)
def test_invalid_sets_name_every_bad_field(changes, bad):
    base = Knobs(max_num_seqs=8, max_num_batched_tokens=512, long_prefill_token_threshold=256)
    with pytest.raises(KnobError) as err:
        base.with_changes(changes)
    assert set(err.value.errors) == bad
    assert base == Knobs(max_num_seqs=8, max_num_batched_tokens=512, long_prefill_token_threshold=256)


def test_valid_change_returns_new_set():
    base = Knobs()
    new = base.with_changes({"max_num_seqs": 4, "long_prefill_token_threshold": 32})
    assert (new.max_num_seqs, new.long_prefill_token_threshold) == (4, 32)
    assert base.max_num_seqs == 64


def test_engine_applies_at_boundary_and_never_aborts(make_engine, record_iterations):
    engine = make_engine(max_num_seqs=8, max_num_batched_tokens=128, long_prefill_token_threshold=64)
    seen = record_iterations(engine)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"r{i}", engine.encode_prompt(f"Count to ten: {i},"), params)
    engine.step()
    engine.step()
    assert engine.num_running == 6
    change = engine.update_knobs({"max_num_seqs": 2}, source="test")
    assert change.iteration == engine.iteration == 2 and change.version == 1
    assert change.old == {"max_num_seqs": 8} and change.new == {"max_num_seqs": 2}
    with pytest.raises(KnobError):
        engine.update_knobs({"max_num_seqs": 3, "max_num_batched_tokens": 0})
    assert engine.knobs.max_num_seqs == 2 and engine.knob_version == 1  # rejected whole
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert all(o.finish_reason == "length" and o.output_tokens == 12 for o in finals.values())
    assert len(finals) == 6
    assert [s.knob_version for s in seen[:2]] == [0, 0] and all(s.knob_version == 1 for s in seen[2:])
    assert all(s.max_num_seqs == 2 for s in seen[2:])


def test_knob_state_versions_only_real_changes_and_keeps_one_snapshot():
    from appliance.engine.knobs import KnobState, KnobUpdate

    state = KnobState(Knobs(max_num_seqs=8))
    first = state.snapshot
    assert state.apply(KnobUpdate({"max_num_seqs": 8}, "test"), iteration=3) is None  # nothing changes
    with pytest.raises(KnobError):
        state.apply(KnobUpdate({"max_num_seqs": 4, "bogus": 1}, "test"), iteration=3)
    assert state.snapshot is first  # rejected whole: the same snapshot, no version
    change = state.apply(KnobUpdate({"max_num_seqs": 4, "scheduling_policy": "continuous"}, "test"), iteration=5)
    snap = state.snapshot
    assert (change.version, change.iteration, change.old, change.new) == (1, 5, {"max_num_seqs": 8}, {"max_num_seqs": 4})
    assert (snap.knobs.max_num_seqs, snap.version, snap.iteration, snap.history) == (4, 1, 5, (change,))
    assert first.knobs.max_num_seqs == 8 and first.version == 0  # an old snapshot never changes


def test_knob_schema_comes_from_the_declaration():
    schema = Knobs.model_json_schema(mode="serialization")
    assert set(schema["properties"]) == set(Knobs.names()) == set(schema["required"])
    assert schema["properties"]["max_num_seqs"]["minimum"] == 1
    assert schema["properties"]["scheduling_policy"]["enum"] == ["continuous", "static"]


def test_an_update_for_a_stale_version_is_refused_whole():
    from appliance.engine.knobs import KnobConflict, KnobState, KnobUpdate

    state = KnobState(Knobs(max_num_seqs=8))
    state.apply(KnobUpdate({"max_num_seqs": 6}, "admin"), iteration=1)  # version 1
    with pytest.raises(KnobConflict) as err:
        state.apply(KnobUpdate({"max_num_seqs": 12}, "autopilot", expected_version=0), iteration=2)
    assert set(err.value.errors) == {"version"} and state.knobs.max_num_seqs == 6 and state.snapshot.version == 1
    change = state.apply(KnobUpdate({"max_num_seqs": 12}, "autopilot", reason="why", prediction={"after": {}},
                                    expected_version=1), iteration=3)
    assert (change.version, change.reason, change.prediction) == (2, "why", {"after": {}})
