"""Prefix caching with the real model: greedy outputs are the same with caching on and off, and
the cache is actually used (tokens served from it > 0) in each case."""

from __future__ import annotations

from appliance.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=8, min_tokens=8, temperature=0)
SYSTEM = ("You are a careful assistant for a hardware shop. Answer briefly and politely, name the "
          "aisle where each item is found, and never invent prices. The shop sells hammers, nails, "
          "screws, drills, paint, brushes, ladders, garden hoses, light bulbs and extension cords.")


def _both(make_engine, run, **config):
    """Run `run(engine)` on a fresh engine with caching on and with it off; return both results
    and the on-engine (for its counters)."""
    on = make_engine(enable_prefix_caching=True, **config)
    off = make_engine(enable_prefix_caching=False, **config)
    return run(on), run(off), on


def _check_idle(engine) -> None:
    bm = engine.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


def test_multi_turn_chat_same_answers_and_earlier_turns_served_from_cache(make_engine):
    questions = ["Where are the hammers?", "And the nails that go with them?", "Do you sell ladders too?",
                 "Thanks. Which light bulbs last longest?"]

    def converse(engine):
        messages = [{"role": "system", "content": SYSTEM}]
        answers, cached = [], []
        for question in questions:  # each turn re-sends the whole conversation, with the model's answers
            messages.append({"role": "user", "content": question})
            [out] = engine.generate([engine.encode_chat(messages)], GREEDY)
            answers.append(out.token_ids)
            cached.append(out.cached_tokens)
            messages.append({"role": "assistant", "content": out.text})
        _check_idle(engine)
        return answers, cached

    (on_answers, on_cached), (off_answers, off_cached), _ = _both(make_engine, converse)
    assert on_answers == off_answers
    assert off_cached == [0, 0, 0, 0]
    assert on_cached[0] == 0 and all(c >= 48 for c in on_cached[1:])  # the system prompt and earlier turns


def test_shared_system_prompt_same_answers(make_engine, record_iterations):
    questions = ["Where is the paint?", "What sizes of screws do you have?", "Can I rent a drill?",
                 "Are garden hoses in stock?", "Where are the brushes?", "Do you sell extension cords?"]

    def ask(engine):
        stats = record_iterations(engine)
        prompts = [engine.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
                   for q in questions]
        first = engine.generate(prompts[:1], GREEDY)  # fills the cache with the system prompt
        rest = engine.generate(prompts[1:], GREEDY)
        _check_idle(engine)
        hits = sum(s.prefix_cache_hits for s in stats)
        return [o.token_ids for o in first + rest], [o.cached_tokens for o in rest], hits

    (on_tokens, on_cached, on_hits), (off_tokens, off_cached, off_hits), _ = _both(
        make_engine, ask, max_num_seqs=8, max_num_batched_tokens=256, long_prefill_token_threshold=64,
        max_num_partial_prefills=2)
    assert on_tokens == off_tokens
    assert off_hits == 0 and off_cached == [0] * 5
    assert all(c >= 48 for c in on_cached) and on_hits == sum(on_cached)


def test_prompt_that_is_an_exact_multiple_of_the_block_size(make_engine):
    def twice(engine):
        ids = engine.encode_prompt(SYSTEM)[:64]  # 4 full blocks of 16
        outs = [engine.generate([ids], GREEDY)[0] for _ in range(2)]
        _check_idle(engine)
        return [o.token_ids for o in outs], [o.cached_tokens for o in outs]

    (on_tokens, on_cached), (off_tokens, _), _ = _both(make_engine, twice)
    assert on_tokens == off_tokens and on_tokens[0] == on_tokens[1]
    assert on_cached == [0, 48]  # the last block is recomputed: its last token gives the logits


def test_chunked_prefill_continues_after_a_hit(make_engine, record_iterations):
    def run(engine):
        stats = record_iterations(engine)
        base = engine.encode_prompt(" ".join([SYSTEM] * 3))
        assert len(base) >= 150
        first = engine.generate([base[:150]], GREEDY)[0]
        # shares 144 tokens (9 blocks) with the first, then 60 more: several 16-token chunks
        question = engine.encode_prompt(" Where are the ladders, please?" * 12)[:60]
        assert len(question) == 60
        second = engine.generate([base[:144] + question], GREEDY)[0]
        _check_idle(engine)
        chunks = [s.prefill_tokens for s in stats[-20:] if s.prefill_tokens]
        return [first.token_ids, second.token_ids], second.cached_tokens, chunks

    (on_tokens, on_cached, on_chunks), (off_tokens, off_cached, _), _ = _both(
        make_engine, run, max_num_batched_tokens=64, long_prefill_token_threshold=16)
    assert on_tokens == off_tokens
    assert on_cached == 144 and off_cached == 0
    assert on_chunks[-4:] == [16, 16, 16, 12]  # 60 uncached tokens in chunks of 16


def test_small_pool_forces_preemption_and_eviction_same_answers(make_engine, record_iterations):
    prompts_text = [SYSTEM[: 120 + 25 * i] + f" Question {i}: where is item {i}?" for i in range(8)]
    evictions = []

    def run(engine):
        stats = record_iterations(engine)
        prompts = [engine.encode_prompt(p) for p in prompts_text]
        bm = engine.block_manager
        for i, p in enumerate(prompts):
            engine.add_request(f"q{i}", p, SamplingParams(max_tokens=24, min_tokens=24, temperature=0))
        finals, cached_before = {}, set()
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.token_ids
            cached_now = {b for b in range(bm.num_blocks) if bm.is_cached(b)}
            evictions.append(len(cached_before - cached_now))
            cached_before = cached_now
        # a second wave with the same prompts: served partly from what the first left cached
        again = engine.generate(prompts, GREEDY)
        _check_idle(engine)
        return ([finals[f"q{i}"] for i in range(8)], [o.token_ids for o in again],
                sum(s.preemptions for s in stats), sum(s.prefix_cache_hits for s in stats))

    on, off, _ = _both(make_engine, run, num_blocks=40, block_size=4, max_num_seqs=8,
                       max_num_batched_tokens=256, long_prefill_token_threshold=256, max_num_partial_prefills=4)
    assert on[:2] == off[:2]
    assert on[2] > 0 and off[2] > 0  # preemptions happened both ways
    assert on[3] > 0 and off[3] == 0
    assert sum(evictions) > 0  # cached blocks were evicted to make room


def test_turning_caching_off_live_stops_matching(make_engine):
    engine = make_engine()
    ids = engine.encode_prompt(SYSTEM)
    engine.generate([ids], GREEDY)
    assert engine.block_manager.num_cached_free_blocks > 0
    engine.update_knobs({"enable_prefix_caching": False})
    off = engine.generate([ids], GREEDY)[0]
    assert off.cached_tokens == 0 and engine.block_manager.num_cached_free_blocks == 0
    engine.update_knobs({"enable_prefix_caching": True})
    engine.generate([ids], GREEDY)
    assert engine.generate([ids], GREEDY)[0].cached_tokens > 0
