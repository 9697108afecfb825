"""The scheduling policies, in A/B order (imports nothing: the dashboard, the bench and the
engine all name them)."""

POLICIES = ("continuous", "static")
