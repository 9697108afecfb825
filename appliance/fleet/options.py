"""The fleet's flags of `appliance serve` and their validation (no Ray import here)."""

from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from appliance.server.cli import is_loopback

MAX_ONGOING_REQUESTS = 256  # per replica; the engine's own --max-waiting bound answers 429 beyond


def add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    fleet = parser.add_argument_group("fleet (Ray Serve; see README 'Deployment')")
    fleet.add_argument("--replicas", type=int, default=None,
                       help="serve N engine replicas on Ray Serve behind this port (default: one process, no Ray)")
    fleet.add_argument("--ray-address", default=None,
                       help="join this Ray cluster (e.g. 10.0.0.5:6379) instead of starting a local one")
    fleet.add_argument("--min-replicas", type=int, default=None, help="Ray Serve autoscaling: fewest replicas")
    fleet.add_argument("--max-replicas", type=int, default=None, help="Ray Serve autoscaling: most replicas")
    fleet.add_argument("--target-ongoing-requests", type=float, default=None,
                       help="Ray Serve autoscaling: ongoing requests per replica it aims for")
    fleet.add_argument("--upscale-delay-s", type=float, default=None,
                       help="Ray Serve autoscaling: how long it wants more replicas before adding one (Serve: 30)")
    fleet.add_argument("--downscale-delay-s", type=float, default=None,
                       help="Ray Serve autoscaling: how long it wants fewer replicas before removing one (Serve: 600)")
    fleet.add_argument("--replica-num-cpus", type=float, default=None,
                       help="Ray CPUs each replica reserves (default: this host's cores / max replicas)")
    fleet.add_argument("--ray-dashboard", action="store_true", help="start Ray's own dashboard (off by default)")


@dataclass
class FleetSpec:
    replicas: int
    min_replicas: int | None
    max_replicas: int | None
    target_ongoing_requests: float | None
    upscale_delay_s: float | None
    downscale_delay_s: float | None
    num_cpus: float  # reserved per replica
    torch_threads: int  # per replica
    ray_address: str | None
    ray_dashboard: bool
    host: str
    fleet_id: str  # the fleet's --replica-id; names its Ray Serve application and registry actor

    @property
    def app_name(self) -> str:
        """The Ray Serve application of this fleet: one per fleet id, so fleets sharing a cluster
        (--ray-address) leave each other alone."""
        return "appliance-" + _slug(self.fleet_id)

    @property
    def registry_name(self) -> str:
        """The named Ray actor of this fleet's registry (appliance.fleet.registry)."""
        return "appliance-registry-" + _slug(self.fleet_id)

    @property
    def autoscaling(self) -> bool:
        return any(v is not None for v in (self.min_replicas, self.max_replicas, self.target_ongoing_requests,
                                           self.upscale_delay_s, self.downscale_delay_s))

    @property
    def loopback_only(self) -> bool:
        """A local cluster for an ingress on loopback: every Ray listener stays on 127.0.0.1."""
        return self.ray_address is None and is_loopback(self.host)

    def deployment_options(self) -> dict[str, Any]:
        """Ray Serve deployment options: a fixed replica count, or its autoscaling config."""
        options: dict[str, Any] = {"ray_actor_options": {"num_cpus": self.num_cpus},
                                   "max_ongoing_requests": MAX_ONGOING_REQUESTS}
        if not self.autoscaling:
            options["num_replicas"] = self.replicas
            return options
        autoscaling: dict[str, Any] = {"initial_replicas": self.replicas,
                                       "min_replicas": self.min_replicas if self.min_replicas is not None else 1,
                                       "max_replicas": self.max_replicas if self.max_replicas is not None
                                       else self.replicas}
        for name in ("target_ongoing_requests", "upscale_delay_s", "downscale_delay_s"):
            if getattr(self, name) is not None:
                autoscaling[name] = getattr(self, name)
        options["autoscaling_config"] = autoscaling
        return options


def _slug(fleet_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", fleet_id)


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"--{name} must be a positive integer, got {value!r}")
    return value


def fleet_spec(args: argparse.Namespace, server: dict[str, Any]) -> FleetSpec:
    """Validated fleet settings (ValueError naming the flag and the bad value). `server` is the
    validated server options of appliance.server.cli.server_options."""
    replicas = _positive_int("replicas", args.replicas)
    low = None if args.min_replicas is None else _positive_int("min-replicas", args.min_replicas)
    high = None if args.max_replicas is None else _positive_int("max-replicas", args.max_replicas)
    if (low or 1) > replicas or replicas > (high or replicas):
        raise ValueError(f"--replicas {replicas} must lie between --min-replicas {low} and --max-replicas {high}")
    target = args.target_ongoing_requests
    if target is not None and (not math.isfinite(target) or target <= 0):
        raise ValueError(f"--target-ongoing-requests must be a number > 0, got {target!r}")
    for flag in ("upscale-delay-s", "downscale-delay-s"):
        delay = getattr(args, flag.replace("-", "_"))
        if delay is not None and (not math.isfinite(delay) or delay < 0):
            raise ValueError(f"--{flag} must be a number of seconds >= 0, got {delay!r}")
    if args.ray_address is not None and not args.ray_address.strip():
        raise ValueError("--ray-address must be a Ray cluster address such as 10.0.0.5:6379")
    cpus = args.replica_num_cpus
    if cpus is None:
        cpus = round((os.cpu_count() or 1) / (high or replicas), 2)
    elif not math.isfinite(cpus) or cpus <= 0:
        raise ValueError(f"--replica-num-cpus must be a number > 0, got {cpus!r}")
    if server.get("autopilot") is not None:
        raise ValueError(f"--autopilot {server['autopilot']!r} steers one engine's knobs and is not available with "
                         "--replicas yet: serve one process with --autopilot, or a fleet without it")
    db = server.get("db")
    if args.ray_address is not None and db is not None and db.startswith("sqlite"):
        raise ValueError(
            f"--db {db} is a SQLite file on this host, but with --ray-address the replicas may run on other "
            "hosts, where that file is not: give one store the whole fleet reaches, a PostgreSQL URL such as "
            "--db postgresql+psycopg://USER:PASSWORD@HOST/DB (or --no-telemetry)")
    return FleetSpec(replicas=replicas, min_replicas=low, max_replicas=high, target_ongoing_requests=target,
                     upscale_delay_s=args.upscale_delay_s, downscale_delay_s=args.downscale_delay_s,
                     num_cpus=cpus, torch_threads=max(1, math.floor(cpus)), ray_address=args.ray_address,
                     ray_dashboard=args.ray_dashboard, host=server["host"], fleet_id=server["replica_id"])
