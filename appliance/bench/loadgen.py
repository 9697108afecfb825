"""Async load generator for any OpenAI-compatible server (streaming /v1/completions, and
/v1/chat/completions for chat requests).

Each request is streamed and timed on the client: TTFT, the gaps between chunks and E2E (see
`metrics`). The streams go through aiohttp, whose HTTP parser is C: a skewed-48 run's 3,228
events cost this process 0.15-0.21 s of CPU against 0.42-0.47 s through httpx (whose h11 parser is
Python), CPU taken from the server under test when both share a machine (and from the engine's
own thread when the dashboard runs the load test inside `appliance serve`). The few control
calls around a run (model, knobs, replica, knob history) use httpx, as the other clients here.

Lengths are forced with max_tokens = min_tokens = output_len and ignore_eos (vLLM's extensions,
which the appliance implements). Against the appliance's own server the prompt goes
as token ids and the body carries `appliance_run_id` / `appliance_source: "loadtest"` so the
server's telemetry links each request to the run; other servers get text and plain bodies.

Every workload item is a closed loop (`workloads.ClosedLoop`; a plain request is a loop of one):
the arrival process starts the loops, and a loop's next request is sent when the reply to its
previous one has arrived (a failed request ends its loop). Arrival: all at once (default),
Poisson at `rate` loops/s, a fixed `concurrency` (loops, hence requests, in flight), or the
workload's own `arrival_offset`s. Results are indexed by position in the workload (a loop's
requests take consecutive indexes). A run ends when every loop has ended, when `max_duration_s`
passes, or when `cancel()` is called (from any thread); outstanding requests are then cancelled
and counted as "cancelled", and unsent ones as not sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import random
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, AsyncIterable, AsyncIterator, Callable, Iterator, Sequence

import aiohttp
import httpx
from aiohttp.http_exceptions import LineTooLong

from appliance.bench.metrics import SLO, RequestResult, Summary, itl_from_times, summarize
from appliance.bench.workloads import BenchRequest, ClosedLoop
from appliance.records import FAILED_REASONS
from appliance.wire import REPLICA_HEADER

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
CONNECT_TIMEOUT_S = 10.0
READ_BUFSIZE = 2**18  # aiohttp's per-stream buffer; it reads lines of up to twice this


class BenchError(RuntimeError):
    """The run cannot start (server unreachable, API key rejected, bad settings)."""


@dataclass(frozen=True)
class Progress:
    """Live figures, reported after the run starts and after every request ends."""

    done: int
    total: int
    ok: int
    failed: int
    in_flight: int
    elapsed_s: float
    output_tokens: int  # of completed requests

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


ProgressCallback = Callable[[Progress], None]


@dataclass(frozen=True)
class RunStart:
    """What is known when the first request is about to be sent."""

    model: str
    appliance_server: bool
    knobs: dict[str, Any] | None
    replica_id: str | None  # the appliance replica that serves the run
    started_at: float  # wall clock


@dataclass
class LoadResult:
    """Everything one run of the generator observed."""

    results: list[RequestResult]  # one per sent request, in workload order
    summary: Summary
    model: str
    started_at: float  # wall clock
    finished_at: float
    stopped: str | None  # None (all requests ended), "cancelled" or "duration"
    appliance_server: bool
    knobs: dict[str, Any] | None = None  # GET /admin/knobs at the start (appliance only)
    replica_id: str | None = None  # GET /admin/state at the start (appliance only)
    knob_changes: list[dict[str, Any]] = field(default_factory=list)  # applied during the run
    requests: list[BenchRequest] = field(default_factory=list)  # the one sent for each result


def normalize_base_url(base_url: str) -> str:
    """The server root: trailing slashes and a trailing /v1 (OpenAI-client style) removed."""
    url = base_url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    if not url.startswith(("http://", "https://")):
        raise BenchError(f"base URL {base_url!r} must start with http:// or https://")
    return url


def arrival_offsets(
    requests: Sequence[BenchRequest], rate: float | None, seed: int
) -> list[float]:
    """Send times in seconds after the start, one per request.

    With `rate`: a Poisson process (seeded exponential gaps of mean 1/rate; the first request at
    0). Without: the workload's own offsets when it has them (missing ones are 0), else all 0.
    """
    if rate is not None:
        rng = random.Random(seed)
        offsets, t = [], 0.0
        for i in range(len(requests)):
            if i:
                t += rng.expovariate(rate)
            offsets.append(t)
        return offsets
    return [r.arrival_offset or 0.0 for r in requests]


async def _text_lines(content: aiohttp.StreamReader) -> AsyncIterator[str]:
    """A body's lines as text, their \\n or \\r\\n dropped (SSE's bare \\r ending is not split)."""
    async for line in content:
        yield line.decode("utf-8", "replace").rstrip("\r\n")


async def iter_sse_data(lines: AsyncIterable[str]) -> AsyncIterator[str]:
    """The data payload of each server-sent event (multi-line data joined with newlines).

    Comment lines (":...") and other fields (event, id, retry) are skipped; a blank line ends an
    event; a last event without its blank line is still delivered.
    """
    data: list[str] = []
    async for line in lines:
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def environment_proxy(url: str) -> str | None:
    """The HTTP proxy the environment names for `url` (HTTP_PROXY / HTTPS_PROXY, unless NO_PROXY
    covers its host; http:// assumed where it gives no scheme, as httpx does for the control
    calls; ALL_PROXY, often socks, is not used), looked up once per run, where aiohttp's trust_env
    would look it (and ~/.netrc) up on a thread for every request."""
    parts = urllib.parse.urlsplit(url)
    if not parts.hostname or urllib.request.proxy_bypass(parts.hostname):
        return None
    proxy = urllib.request.getproxies().get(parts.scheme)
    return proxy if proxy is None or "://" in proxy else f"http://{proxy}"


def http_error_kind(status: int) -> str:
    """Error kind of a non-200 reply: 4xx by code ("http_429"), every 5xx as "http_5xx"."""
    return "http_5xx" if status >= 500 else f"http_{status}"


def _error_text(body: str, reason: str) -> str:
    """An error reply's message: OpenAI's error.message when the body has one, else its start."""
    try:
        message = json.loads(body)["error"]["message"]
        if isinstance(message, str):
            return message
    except (ValueError, KeyError, TypeError):
        pass
    return body[:300] or reason


class LoadGenerator:
    """Sends a workload to a server and times every request. One generator, one run."""

    def __init__(
        self,
        requests: Sequence[ClosedLoop],
        *,
        base_url: str = DEFAULT_BASE_URL,
        rate: float | None = None,
        concurrency: int | None = None,
        seed: int = 0,
        max_duration_s: float | None = None,
        api_key: str | None = None,
        model: str | None = None,
        appliance_server: bool | None = None,
        temperature: float = 0.0,
        request_timeout_s: float = 600.0,
        slo: SLO | None = None,
        progress: ProgressCallback | None = None,
    ):
        """`appliance_server` None: detect the appliance by its GET /admin/knobs at the start.
        `model` None: the first model listed by GET /v1/models. `request_timeout_s` bounds the
        wait for each piece of the reply (first byte, every next chunk); connecting has
        CONNECT_TIMEOUT_S. `requests`: the
        workload's items (BenchRequests, or other closed loops such as Conversations)."""
        if not requests:
            raise BenchError("the workload has no requests")
        if rate is not None and concurrency is not None:
            raise BenchError("give a request rate or a concurrency, not both")
        if rate is not None and not rate > 0:
            raise BenchError(f"rate must be above zero, got {rate}")
        if concurrency is not None and concurrency < 1:
            raise BenchError(f"concurrency must be at least 1, got {concurrency}")
        if max_duration_s is not None and not max_duration_s > 0:
            raise BenchError(f"max duration must be above zero, got {max_duration_s}")
        self.requests = list(requests)
        self.num_requests = sum(loop.max_requests for loop in self.requests)
        self._first_index = list(itertools.accumulate((loop.max_requests for loop in self.requests), initial=0))
        self.base_url = normalize_base_url(base_url)
        self._proxy = environment_proxy(self.base_url)
        self.rate, self.concurrency, self.seed = rate, concurrency, seed
        self.max_duration_s = max_duration_s
        self.api_key, self.model = api_key, model
        self.appliance_server = appliance_server
        self.temperature = temperature
        self.request_timeout_s = request_timeout_s
        self.slo = slo
        self.progress = progress
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._cancel_requested = False
        self._lock = threading.Lock()
        self._results: list[RequestResult] = []
        self._sent: dict[int, BenchRequest] = {}
        self._in_flight = 0
        self._t0 = 0.0

    # ----------------------------------------------------------------------------------- control

    def cancel(self) -> None:
        """Stop the run now (safe from any thread, before or during the run)."""
        with self._lock:
            self._cancel_requested = True
            loop, stop = self._loop, self._stop
        if loop is None or stop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            stop.set()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(stop.set)

    # --------------------------------------------------------------------------------------- run

    @property
    def arrival(self) -> dict[str, Any]:
        """The arrival settings, as stored with a run."""
        if self.concurrency is not None:
            mode = {"mode": "concurrency", "concurrency": self.concurrency}
        elif self.rate is not None:
            mode = {"mode": "poisson", "rate": self.rate, "seed": self.seed}
        elif any(loop.first_request().arrival_offset is not None for loop in self.requests):
            mode = {"mode": "workload"}
        else:
            mode = {"mode": "all-at-once"}
        return {**mode, "max_duration_s": self.max_duration_s}

    async def run(
        self, run_id: str | None = None, on_start: Callable[[RunStart], None] | None = None
    ) -> LoadResult:
        """Send the workload; return every request's result and the run summary.

        `on_start` is called once the server is known, just before the first request is sent.
        """
        with self._lock:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            if self._cancel_requested:
                self._stop.set()
        self._results, self._sent, self._in_flight = [], {}, 0
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        timeout = httpx.Timeout(self.request_timeout_s, connect=CONNECT_TIMEOUT_S)
        async with httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout) as client:
            model = self.model or await self._fetch_model(client)
            knobs = await fetch_knobs(client) if self.appliance_server is not False else None
            ours = knobs is not None if self.appliance_server is None else self.appliance_server
            replica_id = await fetch_replica_id(client) if ours else None
            async with self._stream_session(headers) as session:
                with heap_frozen():
                    started_at = time.time()
                    if on_start is not None:
                        on_start(RunStart(model, ours, knobs, replica_id, started_at))
                    self._t0 = time.perf_counter()
                    self._report()
                    stopped = await self._run_until_stopped(session, model, run_id, ours)
                    duration = time.perf_counter() - self._t0
            finished_at = time.time()
            changes = await self._knob_changes(client, started_at, finished_at) if ours else []
        results = sorted(self._results, key=lambda r: r.index)
        summary = summarize(results, max(duration, 1e-9), self.num_requests, self.slo)
        return LoadResult(results, summary, model, started_at, finished_at, stopped, ours,
                          knobs, replica_id, changes, [self._sent[r.index] for r in results])

    def _stream_session(self, headers: dict[str, str]) -> aiohttp.ClientSession:
        """The session the requests stream through: as many connections as requests in flight,
        `request_timeout_s` for each wait on the server (first byte, every next chunk)."""
        return aiohttp.ClientSession(
            headers=headers,
            read_bufsize=READ_BUFSIZE,
            connector=aiohttp.TCPConnector(limit=self.concurrency or 0),
            timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S,
                                          sock_read=self.request_timeout_s),
        )

    async def _run_until_stopped(
        self, session: aiohttp.ClientSession, model: str, run_id: str | None, ours: bool
    ) -> str | None:
        assert self._stop is not None
        dispatch = asyncio.create_task(self._dispatch(session, model, run_id, ours))
        stop_wait = asyncio.create_task(self._stop.wait())
        try:
            done, _ = await asyncio.wait(
                {dispatch, stop_wait}, timeout=self.max_duration_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            stop_wait.cancel()
            if not dispatch.done():
                dispatch.cancel()
            await asyncio.gather(dispatch, stop_wait, return_exceptions=True)
        # result() re-raises a failure inside the run (e.g. a progress callback's)
        if dispatch in done and dispatch.result():
            return None
        return "cancelled" if self._stop.is_set() else "duration"

    async def _dispatch(
        self, session: aiohttp.ClientSession, model: str, run_id: str | None, ours: bool
    ) -> bool:
        """Start every loop by the arrival process; True when all of them ran to their end."""
        tasks: list[asyncio.Task] = []
        try:
            if self.concurrency is not None:
                queue = iter(range(len(self.requests)))

                async def worker() -> None:
                    for k in queue:
                        if self._stopping():
                            return
                        await self._run_loop(session, k, model, run_id, ours)

                workers = min(self.concurrency, len(self.requests))
                tasks = [asyncio.create_task(worker()) for _ in range(workers)]
            else:
                firsts = [loop.first_request() for loop in self.requests]
                for k, offset in enumerate(arrival_offsets(firsts, self.rate, self.seed)):
                    delay = offset - (time.perf_counter() - self._t0)
                    if delay > 0:
                        await asyncio.sleep(delay)
                    if self._stopping():
                        break
                    tasks.append(asyncio.create_task(self._run_loop(session, k, model, run_id, ours)))
            await asyncio.gather(*tasks)
            return not self._stopping()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_loop(
        self, session: aiohttp.ClientSession, k: int, model: str, run_id: str | None, ours: bool
    ) -> None:
        """Send loop `k`'s requests one after another, each once the previous reply arrived."""
        loop, index = self.requests[k], self._first_index[k]
        request: BenchRequest | None = loop.first_request()
        while request is not None and not self._stopping():
            reply = await self._send(session, index, request, model, run_id, ours)
            if reply is None:
                return  # a failed request ends its loop; the rest count as not sent
            request, index = loop.next_request(request, reply), index + 1

    def request_body(
        self, request: BenchRequest, model: str, run_id: str | None, ours: bool
    ) -> dict[str, Any]:
        """The /v1/completions body for one request (/v1/chat/completions for a chat request)."""
        body: dict[str, Any] = {"model": model}
        if request.messages is not None:
            body["messages"] = list(request.messages)
        else:
            use_ids = request.prompt_ids is not None and (ours or request.prompt is None)
            body["prompt"] = request.prompt_ids if use_ids else request.prompt
        body.update({
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": self.temperature,
        })
        if request.output_len is not None:
            body.update(max_tokens=request.output_len, min_tokens=request.output_len,
                        ignore_eos=True)
        if ours:
            body["appliance_source"] = "loadtest"
            if run_id is not None:
                body["appliance_run_id"] = run_id
        return body

    async def _send(
        self, session: aiohttp.ClientSession, index: int, request: BenchRequest, model: str,
        run_id: str | None, ours: bool,
    ) -> str | None:
        """Send one request and time it; its reply's text when it succeeded, else None."""
        result = RequestResult(index=index, sent_at=time.time(),
                               requested_output_len=request.output_len)
        body = self.request_body(request, model, run_id, ours)
        path = CHAT_PATH if request.messages is not None else COMPLETIONS_PATH
        self._sent[index] = request
        self._in_flight += 1
        start = time.perf_counter()
        try:
            await self._stream(session, path, body, result, start)
        except asyncio.CancelledError:
            _fail(result, "cancelled", "stopped by the client before the reply ended")
            raise
        except asyncio.TimeoutError as exc:  # aiohttp's connect and read timeouts are ones
            _fail(result, "timeout", f"no reply within {self.request_timeout_s:g}s ({type(exc).__name__})")
        except aiohttp.ClientError as exc:
            kind = "connection" if result.status is None else "aborted"
            _fail(result, kind, f"{type(exc).__name__}: {exc}")
        except LineTooLong:
            _fail(result, "protocol", f"an event stream line over {2 * READ_BUFSIZE // 1024} KiB")
        finally:
            self._in_flight -= 1
            result.ok = result.error_kind is None
            self._results.append(result)
            self._report()
        return result.text if result.ok else None

    async def _stream(
        self, session: aiohttp.ClientSession, path: str, body: dict[str, Any], result: RequestResult,
        start: float,
    ) -> None:
        chunk_times: list[float] = []
        async with session.post(self.base_url + path, json=body, proxy=self._proxy,
                                allow_redirects=False) as response:
            result.status = response.status
            result.replica = response.headers.get(REPLICA_HEADER)
            if response.status != 200:
                text = await response.text(errors="replace")
                _fail(result, http_error_kind(response.status), _error_text(text, response.reason or ""))
                return
            content_type = response.headers.get("content-type", "")
            if not content_type.startswith("text/event-stream"):
                await response.read()
                _fail(result, "protocol", f"expected an event stream, got {content_type!r}")
                return
            finished = False
            async for data in iter_sse_data(_text_lines(response.content)):
                if data.strip() == "[DONE]":
                    finished = True
                    break
                if not _take_event(data, result, chunk_times):
                    return
            end = time.perf_counter()
        if chunk_times:
            result.ttft = chunk_times[0] - start
            result.itl = itl_from_times(chunk_times)
        if result.output_tokens is None:
            result.output_tokens = len(chunk_times)
        if not finished:
            _fail(result, "aborted", "the stream ended without data: [DONE]")
        elif result.finish_reason in FAILED_REASONS:
            _fail(result, "aborted", f"the server ended the request (finish_reason {result.finish_reason})")
        else:
            result.e2e = end - start

    # ---------------------------------------------------------------------------------- helpers

    async def _fetch_model(self, client: httpx.AsyncClient) -> str:
        response = await _get(client, "/v1/models")
        if response.status_code != 200:
            raise BenchError(f"GET {self.base_url}/v1/models: HTTP {response.status_code}: "
                             f"{_error_text(response.text, response.reason_phrase)}")
        try:
            return response.json()["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise BenchError(f"GET {self.base_url}/v1/models listed no model") from None

    async def _knob_changes(
        self, client: httpx.AsyncClient, since: float, until: float
    ) -> list[dict[str, Any]]:
        """The run's knob changes; none when the server stopped answering (results matter more)."""
        try:
            return await fetch_knob_history(client, since, until)
        except BenchError:
            return []

    def _stopping(self) -> bool:
        return self._stop is not None and self._stop.is_set()

    def _report(self) -> None:
        if self.progress is None:
            return
        ok = [r for r in self._results if r.ok]
        self.progress(Progress(
            done=len(self._results),
            total=self.num_requests,
            ok=len(ok),
            failed=len(self._results) - len(ok),
            in_flight=self._in_flight,
            elapsed_s=time.perf_counter() - self._t0,
            output_tokens=sum(r.output_tokens or 0 for r in ok),
        ))


@contextlib.contextmanager
def heap_frozen() -> Iterator[None]:
    """While a run is timed, the objects alive before it are out of the cyclic garbage
    collector's sight (`gc.freeze`): a full collection pauses this whole process, so every stream
    in flight at once, and that pause would count in the gaps and TTFTs the run measures as if
    the server had made it (benchmarks/autopilot.py run 83: each of the three full collections
    of 146-167 ms in the benchmark's process while a way was timed came with ITL misses in the
    same tenth of a second, 1, 3 and 5 requests with gaps of 158-174 ms, and no engine step that
    long). No collection is made first (it would delay the run's start by the same pause):
    objects frozen here that become garbage during the run are still freed by reference counting,
    and cycles among them once the heap is given back after the run. A process that froze its
    heap already (`appliance serve`, whose dashboard runs load tests) is left as it is."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _fail(result: RequestResult, kind: str, message: str) -> None:
    result.error_kind, result.error = kind, message


def _take_event(data: str, result: RequestResult, chunk_times: list[float]) -> bool:
    """Apply one streamed JSON event to `result`; False when it ends the request as failed.

    A chunk counts as output (for TTFT/ITL) when it has a choice with text, or a choice without
    finish_reason (a token whose text is not complete yet); a bare finish or usage chunk does not,
    nor a chat chunk that only announces the assistant's role. Text is appended to `result.text`.
    """
    try:
        event = json.loads(data)
    except ValueError:
        _fail(result, "protocol", f"stream event is not JSON: {data[:200]!r}")
        return False
    if not isinstance(event, dict):
        _fail(result, "protocol", f"stream event is not a JSON object: {data[:200]!r}")
        return False
    if "error" in event:
        error = event["error"]
        message = error.get("message") if isinstance(error, dict) else None
        _fail(result, "aborted", str(message or error))
        return False
    if result.server_request_id is None and isinstance(event.get("id"), str):
        result.server_request_id = event["id"]
    choices = event.get("choices") or []
    if choices and isinstance(choices[0], dict):
        choice = choices[0]
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
        text = choice.get("text")
        if text is None:
            text = delta.get("content")
        reason = choice.get("finish_reason")
        if text or (reason is None and "role" not in delta):
            chunk_times.append(time.perf_counter())
        if isinstance(text, str):
            result.text += text
        if reason:
            result.finish_reason = reason
    usage = event.get("usage")
    if isinstance(usage, dict):
        result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
        result.output_tokens = usage.get("completion_tokens", result.output_tokens)
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            result.cached_tokens = details["cached_tokens"]
    return True


async def _get(client: httpx.AsyncClient, path: str) -> httpx.Response:
    """GET with errors a person can act on (unreachable server, rejected API key)."""
    try:
        response = await client.get(path)
    except httpx.TransportError as exc:
        raise BenchError(f"cannot reach {client.base_url}: {type(exc).__name__}: {exc}") from None
    if response.status_code == 401:
        raise BenchError(f"GET {path}: the server rejected the API key (HTTP 401); pass --api-key")
    return response


async def fetch_knobs(client: httpx.AsyncClient) -> dict[str, Any] | None:
    """GET /admin/knobs, or None when the server is not the appliance (no such endpoint)."""
    response = await _get(client, "/admin/knobs")
    if response.status_code != 200:
        return None
    try:
        payload = response.json()
    except ValueError:
        return None
    return payload if isinstance(payload, dict) and "knobs" in payload else None


async def fetch_replica_id(client: httpx.AsyncClient) -> str | None:
    """The appliance's replica id from GET /admin/state (None when it does not say)."""
    response = await _get(client, "/admin/state")
    try:
        replica = response.json().get("replica_id") if response.status_code == 200 else None
    except (ValueError, AttributeError):
        return None
    return replica if isinstance(replica, str) else None


async def fetch_knob_history(
    client: httpx.AsyncClient, since: float, until: float
) -> list[dict[str, Any]]:
    """Knob changes applied between `since` and `until` (wall clock), from the appliance."""
    response = await _get(client, "/admin/knobs/history")
    try:
        entries = response.json()["data"] if response.status_code == 200 else []
    except (ValueError, KeyError, TypeError):
        return []
    return [
        e for e in entries
        if isinstance(e, dict) and isinstance(e.get("applied_at"), (int, float))
        and since <= e["applied_at"] <= until
    ]
