"""The what-if forecast behind the Live tab's reading of what is holding traffic back: where the
reading recommends raising a limit (holding.raise_to_try), the server's what-if simulator
replays the window at that raise (POST /admin/simulate) and the reading gains its prediction
(holding.forecast_sentence).

A replay takes from a fraction of a second to several (it fits the step-time model on the window
and replays its requests twice), on the server's CPU, beside the engine. So it never runs in a
tick: `Forecasts.sentence` answers at once with the newest finished forecast for the same view
and raise, and starts one in a background thread when none is running and the last is older
than EVERY_S (or was of another raise, or of knobs since changed). A rejected or failed replay
(422: too few iterations of the running engine in the window) leaves the reading without one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ui import holding
from ui.api_client import ApiError

log = logging.getLogger(__name__)

EVERY_S = 60.0  # at most one replay per view this often, while the reading asks for the same raise


@dataclass(frozen=True)
class Source:
    """What to replay: a stored run, or this replica's last `minutes`; `where` names it in the sentence."""

    where: str
    run_id: str | None = None
    minutes: float | None = None


@dataclass
class _Entry:
    key: tuple[Any, ...]
    at: float
    sentence: str | None


class Forecasts:
    """The newest forecast per view, computed in the background (one replay at a time)."""

    def __init__(self, simulate: Callable[..., dict[str, Any]], every_s: float = EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        self._simulate = simulate  # ApplianceAPI.simulate
        self._every_s = every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[Any, _Entry] = {}
        self._busy: threading.Thread | None = None

    def sentence(self, view: Any, source: Source, changes: dict[str, int] | None, knobs_version: Any) -> str | None:
        """The forecast of `changes` for `view` if one finished since the knobs last changed
        (None until then, and None without `changes`); starts a replay when it is due."""
        if not changes:
            return None
        key = (source.run_id, tuple(sorted(changes.items())), knobs_version)
        with self._lock:
            entry = self._entries.get(view)
            fresh = entry is not None and entry.key == key
            due = not fresh or self._clock() - entry.at >= self._every_s
            if due and self._busy is None:
                self._busy = threading.Thread(target=self._run, args=(view, key, source, changes),
                                              name="holding-forecast", daemon=True)
                self._busy.start()
            return entry.sentence if fresh else None

    def wait(self, timeout: float | None = None) -> None:
        """Block until the replay in flight (if any) has finished."""
        with self._lock:
            busy = self._busy
        if busy is not None:
            busy.join(timeout)

    def _run(self, view: Any, key: tuple[Any, ...], source: Source, changes: dict[str, int]) -> None:
        sentence = None
        try:
            report = self._simulate(changes, run_id=source.run_id, last_minutes=source.minutes)
            sentence = holding.forecast_sentence(report, source.where)
        except ApiError as exc:
            log.debug("no what-if forecast for %s: %s", source.where, exc.message)
        except Exception:  # a forecast is an extra: it never takes the Live tab down
            log.exception("what-if forecast for %s failed", source.where)
        finally:
            with self._lock:
                self._entries[view] = _Entry(key, self._clock(), sentence)
                self._busy = None
