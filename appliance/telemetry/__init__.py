"""The SQL telemetry store: models and migrations (models, store), the engine's stats sink
that writes off the hot path (writer), and the read side (queries, runs)."""
