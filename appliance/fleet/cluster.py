"""Start and stop the fleet on Ray: the cluster (local on 127.0.0.1, or joined by address), the
registry actor and the Ray Serve application of engine replicas (both named by the fleet's id,
FleetSpec.app_name and .registry_name, so fleets sharing a cluster leave each other alone)."""

from __future__ import annotations

import logging

from .ingress import Fleet
from .options import FleetSpec
from .replica import ReplicaSettings

log = logging.getLogger(__name__)

DEPLOYMENT_NAME = "engine"


def start_fleet(spec: FleetSpec, settings: ReplicaSettings) -> Fleet:
    """Connect to (or start) Ray, start Serve without its HTTP proxy (the ingress is this
    process's port), and deploy the replicas; returns once they all serve."""
    import ray
    from ray import serve
    from ray.serve.config import ProxyLocation

    from .registry import REGISTRY_NAMESPACE, FleetRegistry
    from .replica import EngineReplica

    if spec.ray_address is None:
        # on loopback only when spec.loopback_only (apply_ray_env, before Ray was imported)
        ray.init(namespace=REGISTRY_NAMESPACE, include_dashboard=spec.ray_dashboard, dashboard_host="127.0.0.1")
    else:
        ray.init(address=spec.ray_address, namespace=REGISTRY_NAMESPACE)
    registry = FleetRegistry.options(name=spec.registry_name, namespace=REGISTRY_NAMESPACE).remote()
    serve.start(proxy_location=ProxyLocation.Disabled)
    deployment = serve.deployment(EngineReplica).options(name=DEPLOYMENT_NAME, **spec.deployment_options())
    log.info("starting %d replica(s) on Ray Serve (%.2f CPU, %d torch thread(s) each)", spec.replicas,
             spec.num_cpus, spec.torch_threads)
    handle = serve.run(deployment.bind(settings, spec.registry_name), name=spec.app_name, route_prefix=None)
    return Fleet(handle=handle, registry=registry, config=settings.server)


def stop_fleet(spec: FleetSpec) -> None:
    """Stop the replicas (each flushes its telemetry) and leave Ray; a local cluster stops too, a
    joined one keeps everything but this fleet's application."""
    import ray
    from ray import serve

    try:
        if spec.ray_address is None:
            serve.shutdown()
        else:
            serve.delete(spec.app_name)
    finally:
        ray.shutdown()
