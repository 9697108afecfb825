"""The SQL telemetry store: models and migrations (models, store), the engine's stats sink
that writes off the hot path (writer, with its parts buffer, batch, retention, store_handle
and health), and the read side (queries, runs)."""
