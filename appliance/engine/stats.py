"""The engine's stats sinks, and the records it hands them (declared in appliance.records)."""

from __future__ import annotations

from ..records import (  # noqa: F401 - the engine's records, re-exported where the engine names them
    FinishReason,
    IterationStats,
    KnobChange,
    RequestStats,
)


class StatsSink:
    """Receives engine records. Implementations must never block (the engine calls them inline)."""

    def on_iteration(self, stats: IterationStats) -> None:  # pragma: no cover - interface
        pass

    def on_request(self, stats: RequestStats) -> None:  # pragma: no cover - interface
        pass

    def on_knob_change(self, change: KnobChange) -> None:  # pragma: no cover - interface
        pass

