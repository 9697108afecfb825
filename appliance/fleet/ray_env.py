"""Ray's settings for a fleet started from here, as environment variables: set before Ray is
started (and before Ray Serve is imported, which reads its own at import) and inherited by every
process of a local cluster. An operator's own setting of any of them wins. No Ray import here."""

from __future__ import annotations

import os

# The replicas share the host's cores with Ray's own processes, so those are kept light. Sampled
# over a skewed-64 run on 2 cores: Serve's controller 2.6 % -> 0.8 % of a core, the GCS 1.7 % ->
# 0.7 %, the dashboard agent 0.9 % -> 0.3 %. (Fleet-of-one throughput did not move beyond the
# box's noise; nor did running the replica's app on Ray's main loop, so that stays Ray's default.)
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",  # no usage reports (these machines are offline anyway)
    "RAY_enable_metrics_collection": "0",  # no Ray-internal metrics export (/metrics is the appliance's own)
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1",  # Serve's controller loop (0.1 s by default)
    # DeploymentHandle calls go to each replica's own gRPC server instead of through Ray actor
    # calls (as in Serve's RAY_SERVE_THROUGHPUT_OPTIMIZED profile): a streamed chunk costs less
    # CPU. Fleet of one / plain process on skewed-64, same box and session: 0.906 and 0.941 with it,
    # 0.855 without (benchmarks/fleet.py).
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
}


# Ray's switch for a cluster of this one node: its node address becomes 127.0.0.1, and the GCS,
# the raylet, every worker and the agents then listen on loopback only (otherwise ray.init turns
# even an explicit 127.0.0.1 into the host's routable address, and they listen on every interface).
LOOPBACK_ONLY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def apply_ray_env(loopback_only: bool) -> None:
    """Set RAY_ENV (and LOOPBACK_ONLY_ENV for a local cluster behind a loopback ingress) where the
    operator has not."""
    for name, value in {**RAY_ENV, **(LOOPBACK_ONLY_ENV if loopback_only else {})}.items():
        os.environ.setdefault(name, value)
