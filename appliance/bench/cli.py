"""`appliance bench`: load-test an OpenAI-compatible server and print the run summary.

`--ab` runs the workload twice on the appliance, under continuous then static scheduling, and
prints both side by side (see appliance.bench.ab).

Exit status: 0 when every request succeeded, 1 when some failed, were cancelled or were never
sent (or the run could not be stored), 2 when the run could not start (bad arguments, server
unreachable, API key rejected).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from typing import Any, Callable, TextIO

from appliance.bench.loadgen import DEFAULT_BASE_URL, BenchError, LoadGenerator, Progress
from appliance.bench.metrics import SLO, Distribution, Summary, parse_slo
from appliance.bench.runner import BenchmarkRun, describe_arrival, run_benchmark
from appliance.bench.workloads import (
    WORKLOADS,
    ClosedLoop,
    jsonl,
    long_prompt_burst,
    multi_turn,
    shared_prefix,
    sharegpt,
    skewed,
)
from appliance.numeric import ms_text

DEFAULT_NUM_REQUESTS = {"skewed": 64, "sharegpt": 64, "long-prompt-burst": 32, "shared-prefix": 64}
DEFAULT_CONVERSATIONS = 16
API_KEY_ENV = "APPLIANCE_API_KEY"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above zero, got {text}")
    return value


def _slo(text: str) -> SLO:
    try:
        return parse_slo(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The `appliance bench` flags."""
    add_workload_arguments(parser)
    parser.add_argument("--name", default=None, help="run name (default: workload and arrival)")
    parser.add_argument("--json", action="store_true", help="print one JSON object, not a table")
    parser.add_argument("--ab", action="store_true",
                        help="run the workload under continuous, then static scheduling (switched live "
                             "on the appliance, then restored) and compare them side by side")


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags naming the server, the workload, its arrival and the store (bench and tune)."""
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL,
                        help=f"server root (a trailing /v1 is fine; default {DEFAULT_BASE_URL})")
    parser.add_argument("--workload", choices=WORKLOADS, default="skewed",
                        help="skewed (the 64-request benchmark mix), sharegpt, long-prompt-burst, "
                             "shared-prefix (--prefix-groups system prompts of --prefix-len tokens, each "
                             "followed by different questions), multi-turn (--conversations ShareGPT chats, "
                             "each turn sent with the whole history once the previous answer arrived), "
                             "or jsonl (your own file, see --file)")
    parser.add_argument("--file", default=None,
                        help='JSONL for --workload jsonl: one {"prompt" or "prompt_ids", '
                             '"output_len"} object per line')
    parser.add_argument("--num-requests", "-n", type=_positive_int, default=None,
                        help="requests to send (default: 64; 32 for long-prompt-burst; "
                             "every line of a jsonl file; multi-turn takes --conversations)")
    arrival = parser.add_mutually_exclusive_group()
    arrival.add_argument("--rate", type=_positive_float, default=None,
                         help="Poisson arrivals at this many requests/s, or conversations/s for "
                              "multi-turn (default: all at once)")
    arrival.add_argument("--concurrency", type=_positive_int, default=None,
                         help="keep this many requests (multi-turn: conversations) in flight")
    parser.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    parser.add_argument("--slo", type=_slo, default=None,
                        help="goodput targets, e.g. ttft=500ms,tpot=100ms,e2e=2s")
    parser.add_argument("--db", default=None,
                        help="telemetry store URL to keep the run in (default: sqlite:///appliance.db)")
    parser.add_argument("--api-key", default=None,
                        help=f"bearer token for the server (default: ${API_KEY_ENV})")
    parser.add_argument("--duration", type=_positive_float, default=None,
                        help="stop after this many seconds (outstanding requests are cancelled)")
    parser.add_argument("--request-timeout", type=_positive_float, default=600.0,
                        help="seconds to wait for each part of a reply (default 600)")
    parser.add_argument("--long-prompt-len", type=_positive_int, default=1024,
                        help="prompt length of the long requests of long-prompt-burst")
    parser.add_argument("--prefix-groups", type=_positive_int, default=4,
                        help="shared-prefix: how many different system prompts (default 4)")
    parser.add_argument("--prefix-len", type=_positive_int, default=1024,
                        help="shared-prefix: tokens in each system prompt (default 1024)")
    parser.add_argument("--conversations", type=_positive_int, default=None,
                        help=f"multi-turn: ShareGPT conversations to hold (default {DEFAULT_CONVERSATIONS})")
    parser.add_argument("--max-turns", type=_positive_int, default=4,
                        help="multi-turn: user turns per conversation at most (default 4)")
    parser.add_argument("--max-turn-tokens", type=_positive_int, default=256,
                        help="multi-turn: each user turn cut to this many tokens (default 256)")
    parser.add_argument("--turn-output-len", type=_positive_int, default=64,
                        help="multi-turn: tokens forced in each answer (default 64)")
    parser.add_argument("--model", default=None,
                        help="local model whose tokenizer counts (sharegpt), cuts (multi-turn) or decodes "
                             "(sampled skewed, long-prompt-burst, shared-prefix) tokens (default: embedded SmolLM2)")


def workload_args(**given: Any) -> argparse.Namespace:
    """The workload flags at their defaults, overridden by `given` (for callers that do not parse
    `appliance bench` flags: the dashboard, `appliance simulate`)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_workload_arguments(parser)
    return argparse.Namespace(**{**vars(parser.parse_args([])), **given})


def build_workload(args: argparse.Namespace) -> tuple[list[ClosedLoop], str]:
    """The requests (multi-turn: conversations) the flags ask for, and a short description."""
    kind, n, seed = args.workload, args.num_requests, args.seed
    if args.file is not None and kind != "jsonl":
        raise ValueError("--file is only used with --workload jsonl")
    if args.conversations is not None and kind != "multi-turn":
        raise ValueError(f"--conversations {args.conversations} is only used with --workload multi-turn")
    if kind == "multi-turn":
        if n is not None:
            raise ValueError(f"--num-requests {n}: multi-turn sends every turn of --conversations "
                             "conversations (up to --max-turns each)")
        return _multi_turn(args)
    if kind == "jsonl":
        if args.file is None:
            raise ValueError("--workload jsonl needs --file PATH")
        requests = jsonl(args.file)
        if n is not None:
            if n > len(requests):
                raise ValueError(f"--num-requests {n}: {args.file} has only {len(requests)} requests")
            requests = requests[:n]
        return requests, f"jsonl {args.file} n={len(requests)}"
    n = n or DEFAULT_NUM_REQUESTS[kind]
    if kind == "skewed":
        packaged = skewed(n, seed) if (n, seed) == (64, 0) else None
        requests = packaged or skewed(n, seed, detokenize=_tokenizer(args).decode)
    elif kind == "sharegpt":
        tokenizer = _tokenizer(args)
        requests = sharegpt(n, seed, lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
    elif kind == "shared-prefix":
        requests = shared_prefix(args.prefix_groups, args.prefix_len, n, seed=seed, detokenize=_tokenizer(args).decode)
        return requests, f"{kind} G={args.prefix_groups} L={args.prefix_len} n={n} seed={seed}"
    else:
        requests = long_prompt_burst(n, seed, long_prompt_len=args.long_prompt_len,
                                     detokenize=_tokenizer(args).decode)
    return requests, f"{kind} n={n} seed={seed}"


def _multi_turn(args: argparse.Namespace) -> tuple[list[ClosedLoop], str]:
    n, limit = args.conversations or DEFAULT_CONVERSATIONS, args.max_turn_tokens
    conversations = multi_turn(n, args.seed, token_cut(_tokenizer(args), limit), max_turns=args.max_turns,
                               output_len=args.turn_output_len)
    return list(conversations), (f"multi-turn conversations={n} max_turns={args.max_turns} "
                                 f"turn_tokens={limit} output_len={args.turn_output_len} seed={args.seed}")


def token_cut(tokenizer: Any, limit: int) -> Callable[[str], str]:
    """Shortens a text to its first `limit` tokens (a shorter text is kept as it is)."""

    def cut(text: str) -> str:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return text if len(ids) <= limit else tokenizer.decode(ids[:limit])

    return cut


def _tokenizer(args: argparse.Namespace) -> Any:
    from appliance.model_loader import load_tokenizer

    return load_tokenizer(args.model)


class ConsoleProgress:
    """A one-line progress bar on a terminal; a line every 10% elsewhere."""

    def __init__(self, stream: TextIO | None = None, width: int = 30):
        self.stream, self.width = stream or sys.stderr, width
        self.tty = self.stream.isatty()
        self._last_draw = 0.0
        self._last_decile = -1

    def __call__(self, p: Progress) -> None:
        line = (f"{p.done}/{p.total} done, {p.failed} failed, {p.in_flight} in flight, "
                f"{p.elapsed_s:.1f}s, {p.output_throughput:.1f} tok/s")
        if self.tty:
            now = time.monotonic()
            if p.done < p.total and now - self._last_draw < 0.1:
                return
            self._last_draw = now
            filled = self.width * p.done // max(p.total, 1)
            self.stream.write(f"\r[{'#' * filled}{'-' * (self.width - filled)}] {line}\x1b[K")
        else:
            decile = 10 * p.done // max(p.total, 1)
            if decile == self._last_decile:
                return
            self._last_decile = decile
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def bench_main(args: argparse.Namespace) -> int:
    """Run `appliance bench` with parsed arguments; return the exit status."""
    try:
        requests, workload = build_workload(args)
        generator = make_generator(args, requests)
    except (ValueError, FileNotFoundError, BenchError) as exc:
        print(f"appliance bench: error: {exc}", file=sys.stderr)
        return 2
    if args.ab:
        return _ab_main(args, requests, workload)
    progress = ConsoleProgress()
    generator.progress = progress
    try:
        run = asyncio.run(_run(generator, workload, args.name, db_url(args.db)))
    except BenchError as exc:
        print(f"appliance bench: error: {exc}", file=sys.stderr)
        return 2
    finally:
        progress.close()
    if args.json:
        print(json.dumps(run.as_dict()))
    else:
        print(format_run(run))
    if run.storage_error:
        print(f"appliance bench: warning: the run was not stored in {run.db_url}: "
              f"{run.storage_error}", file=sys.stderr)
    summary = run.load.summary
    return 0 if summary.failed == 0 and summary.not_sent == 0 and not run.storage_error else 1


def make_generator(args: argparse.Namespace, requests: list[ClosedLoop]) -> LoadGenerator:
    """A load generator for `requests` with the flags' arrival, limits and server."""
    return LoadGenerator(
        requests,
        base_url=args.base_url,
        rate=args.rate,
        concurrency=args.concurrency,
        seed=args.seed,
        max_duration_s=args.duration,
        api_key=args.api_key or os.environ.get(API_KEY_ENV),
        request_timeout_s=args.request_timeout,
        slo=args.slo,
    )


def _ab_main(args: argparse.Namespace, requests: list[ClosedLoop], workload: str) -> int:
    """`appliance bench --ab`: continuous then static on the same server, side by side."""
    from appliance.bench.ab import format_ab, run_ab

    progress = ConsoleProgress()

    def factory() -> LoadGenerator:
        generator = make_generator(args, requests)
        generator.progress = progress
        return generator

    try:
        result = asyncio.run(run_ab(factory, workload=workload, name=args.name,
                                    db_url=db_url(args.db)))
    except BenchError as exc:
        print(f"appliance bench: error: {exc}", file=sys.stderr)
        return 2
    finally:
        progress.close()
    print(json.dumps(result.as_dict()) if args.json else format_ab(result))
    runs = list(result.runs.values())
    for run in runs:
        if run.storage_error:
            print(f"appliance bench: warning: the run was not stored in {run.db_url}: "
                  f"{run.storage_error}", file=sys.stderr)
    clean = len(runs) == 2 and all(
        r.load.summary.failed == 0 and r.load.summary.not_sent == 0 and not r.storage_error for r in runs)
    return 0 if clean else 1


def db_url(url: str | None) -> str:
    """`--db`, else the default telemetry store."""
    from appliance.telemetry.store import DEFAULT_URL

    return url or DEFAULT_URL


async def _run(generator: LoadGenerator, workload: str, name: str | None, db: str) -> BenchmarkRun:
    loop = asyncio.get_running_loop()
    try:  # Ctrl-C stops the run but still prints and stores what it measured
        loop.add_signal_handler(signal.SIGINT, generator.cancel)
    except (NotImplementedError, RuntimeError, ValueError):
        pass
    try:
        return await run_benchmark(generator, workload=workload, name=name, db_url=db)
    finally:
        try:
            loop.remove_signal_handler(signal.SIGINT)
        except (NotImplementedError, RuntimeError, ValueError):
            pass


# ---------------------------------------------------------------------------------- printing


def _latency_rows(summary: Summary) -> list[str]:
    rows = [f"{'latency (ms)':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}"]
    named: list[tuple[str, Distribution]] = [("TTFT", summary.ttft), ("TPOT", summary.tpot),
                                             ("ITL", summary.itl), ("E2E", summary.e2e)]
    for label, d in named:
        rows.append(f"{label:<14}" + "".join(f"{ms_text(v, unit=''):>10}" for v in (d.mean, d.p50, d.p90, d.p99, d.max)))
    return rows


def format_run(run: BenchmarkRun) -> str:
    """The run summary as a plain-text table."""
    s, load = run.load.summary, run.load
    server = "appliance" if load.appliance_server else "OpenAI-compatible"
    stop_note = {None: "", "duration": " (duration limit reached)", "cancelled": " (cancelled)"}
    lines = [
        f"Run {run.run_id}  {run.name}",
        f"{'Workload':<24}{run.workload}",
        f"{'Server':<24}{run.base_url} ({server}, model {load.model})",
        f"{'Arrival':<24}{describe_arrival(run.arrival)}",
        f"{'Completed':<24}{s.completed}/{s.num_requests}{stop_note[load.stopped]}",
        f"{'Failed':<24}{s.failed}" + (f"  ({_errors(s.errors)})" if s.errors else ""),
        f"{'Not sent':<24}{s.not_sent}",
        f"{'Duration':<24}{s.duration_s:.2f} s",
        f"{'Input tokens':<24}{s.total_input_tokens}",
        f"{'Output tokens':<24}{s.total_output_tokens}",
        f"{'Prefix cache hit rate':<24}"
        + ("n/a" if s.prefix_cache_hit_rate is None else f"{s.prefix_cache_hit_rate:.1%} of input tokens"),
        f"{'Request throughput':<24}{s.request_throughput:.2f} req/s",
        f"{'Output throughput':<24}{s.output_throughput:.1f} tok/s",
        f"{'Total throughput':<24}{s.total_token_throughput:.1f} tok/s",
    ]
    if s.replicas:
        lines.append(f"{'Served by':<24}{s.balance} (completed requests each)")
    if s.output_len_mismatch:
        lines.append(f"{'Length not forced':<24}{s.output_len_mismatch} requests")
    if s.slo is not None:
        lines.append(f"{'Goodput':<24}{s.goodput:.2f} req/s ({s.slo_met}/{s.completed} within {s.slo})")
    if load.knob_changes:
        lines.append(f"{'Knob changes':<24}{len(load.knob_changes)} during the run")
    lines.append("")
    lines.extend(_latency_rows(s))
    if run.db_url and not run.storage_error:
        lines.append(f"\nStored in {run.db_url}")
    return "\n".join(lines)


def _errors(errors: dict[str, int]) -> str:
    return ", ".join(f"{kind}: {count}" for kind, count in errors.items())

