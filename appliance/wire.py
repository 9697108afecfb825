"""Names on the wire that the server and its clients (bench, dashboard, fleet) share: each
declared here once, imported by both sides."""

from __future__ import annotations

SOURCE_HEADER = "X-Appliance-Source"  # who sends a knob change (recorded as its source)
REASON_HEADER = "X-Appliance-Reason"  # why (optional; recorded as the change's reason)
REPLICA_HEADER = "X-Appliance-Replica"  # the replica that served a /v1 response
