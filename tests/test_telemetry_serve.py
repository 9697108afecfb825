"""A real serve run fills the store consistently: iteration token counts add up to what the
requests received, request timestamps are ordered, and each knob change has one row."""

from __future__ import annotations

import time

import httpx
from sqlalchemy import create_engine, text

PROMPTS = ["The weather today is", "List three fruits:", "Once upon a time"]
MAX_TOKENS = 6


def test_serve_run_writes_consistent_rows(live_server, loaded_model):
    base, state = live_server.base_url, live_server.state
    since = time.time()
    versions = []
    original = httpx.get(f"{base}/admin/knobs").json()["knobs"]["max_num_seqs"]
    with httpx.Client(base_url=base, timeout=120) as http:
        for i, prompt in enumerate(PROMPTS):
            r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS,
                                                   "min_tokens": MAX_TOKENS, "ignore_eos": True})
            assert r.status_code == 200, r.text
            knobs = http.get("/admin/knobs").json()["knobs"]
            change = {"max_num_seqs": knobs["max_num_seqs"] - 1 if i % 2 == 0 else knobs["max_num_seqs"] + 1}
            p = http.patch("/admin/knobs", json=change)
            assert p.status_code == 200, p.text
            versions.append(p.json()["version"])
    assert state.telemetry.flush(timeout=10)
    restored = httpx.patch(f"{base}/admin/knobs", json={"max_num_seqs": original}, timeout=60)
    assert restored.status_code == 200
    prompt_tokens = sum(len(loaded_model.tokenizer.encode(p, add_special_tokens=False)) for p in PROMPTS)

    db = create_engine(live_server.db_url)
    with db.connect() as conn:
        reqs = conn.execute(text(
            "SELECT prompt_tokens, output_tokens, arrival, first_scheduled, first_token, finished, finish_reason "
            "FROM requests WHERE replica_id = 'test' AND arrival >= :t"), {"t": since}).all()
        it = conn.execute(text(
            "SELECT COALESCE(SUM(prefill_tokens), 0), COALESCE(SUM(decode_tokens), 0), COUNT(*) "
            "FROM iterations WHERE replica_id = 'test' AND started_at >= :t"), {"t": since}).one()
        knob_versions = [row[0] for row in conn.execute(text(
            "SELECT version FROM knob_changes WHERE replica_id = 'test' AND applied_at >= :t "
            "AND version <= :last ORDER BY version"), {"t": since, "last": versions[-1]})]
    db.dispose()

    assert len(reqs) == len(PROMPTS)
    assert sum(r.prompt_tokens for r in reqs) == prompt_tokens
    assert all(r.output_tokens == MAX_TOKENS and r.finish_reason == "length" for r in reqs)
    for r in reqs:
        assert r.arrival <= r.first_scheduled <= r.first_token <= r.finished
    prefill, decode, iterations = it
    assert iterations > 0
    assert prefill == prompt_tokens
    # each request's first token comes from its last prefill chunk, the rest from decode rows
    assert decode == len(PROMPTS) * (MAX_TOKENS - 1)
    assert knob_versions == versions
