"""AsyncEngine.build: the engine is made on the thread that then runs its loop (every torch op of
a server on one thread, so OpenMP keeps one team), failures reach the caller, and an engine built
but never started leaves no thread behind."""

from __future__ import annotations

import asyncio
import threading

import pytest

from appliance.engine import SamplingParams
from appliance.engine.async_engine import AsyncEngine
from appliance.engine.stats import StatsSink


class _Threads(StatsSink):
    def __init__(self) -> None:
        self.seen: set[int] = set()

    def on_iteration(self, stats) -> None:
        self.seen.add(threading.get_ident())


def test_a_built_engine_is_made_and_stepped_on_one_thread(make_engine):
    made_on: list[int] = []

    def build():
        made_on.append(threading.get_ident())
        return make_engine()

    aeng = AsyncEngine.build(build)
    threads = _Threads()
    aeng.engine.add_sink(threads)
    assert not aeng.is_running  # built, waiting for start()
    aeng.start()

    async def generate() -> list[int]:
        tokens: list[int] = []
        async for out in aeng.generate("one", [1, 2, 3, 4], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)):
            tokens += out.new_token_ids
        return tokens

    try:
        assert aeng.is_running and len(asyncio.run(generate())) == 4
    finally:
        aeng.shutdown()
    assert made_on[0] != threading.get_ident() and threads.seen == {made_on[0]}


def test_a_failing_build_raises_in_the_caller():
    def build():
        raise ValueError("KV cache budget of 0 bytes holds no block")

    with pytest.raises(ValueError, match="holds no block"):
        AsyncEngine.build(build)


def test_an_engine_built_and_never_started_stops_its_thread(make_engine):
    aeng = AsyncEngine.build(make_engine)
    aeng.shutdown()
    assert not aeng._thread.is_alive() and not aeng.is_running
