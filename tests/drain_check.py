"""What the drain tests of one box and of the fleet share: a short and a long stream started
before SIGTERM, and the check that new work is refused while the server drains."""

from __future__ import annotations

import json
import threading
import time

import httpx

MODEL = "SmolLM2-135M-Instruct"


class DrainStreams:
    """A short (12 tokens) and a long (4000, ignore_eos) streamed completion against `url`;
    `start()` returns once both are generating. `events[name]` holds each one's status, its
    parsed `data:` events and {"done": True} for `data: [DONE]`."""

    def __init__(self, url: str):
        self.url = url
        self.events: dict[str, list[dict]] = {}
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        for name, max_tokens in (("short", 12), ("long", 4000)):
            started = threading.Event()
            self.threads.append(threading.Thread(target=self._stream, args=(name, max_tokens, started)))
            self.threads[-1].start()
            assert started.wait(60), self.events

    def join(self, timeout_s: float = 60.0) -> None:
        for thread in self.threads:
            thread.join(timeout_s)
            assert not thread.is_alive(), f"a stream did not end: {self.events}"

    def _stream(self, name: str, max_tokens: int, started: threading.Event) -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True}
        events = self.events.setdefault(name, [])
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as response:
            events.append({"status": response.status_code})
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append({"done": True} if line == "data: [DONE]" else json.loads(line[6:]))
                    started.set()


def assert_refusing_while_draining(url: str) -> None:
    """Within 3 s of the signal, /health and a new completion both answer 503 "draining"."""
    deadline = time.monotonic() + 3
    health = refused = None
    while time.monotonic() < deadline and (health is None or refused is None):
        health = httpx.get(f"{url}/health", timeout=5)
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=5)
    assert health is not None and refused is not None
    assert health.status_code == 503 and health.json() == {"status": "draining"}
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
