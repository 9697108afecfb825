"""`appliance serve --replicas N`: validate, prepare the store, start the fleet, serve the ingress
(drained on SIGINT/SIGTERM as one box is: `--drain-grace-s`)."""

from __future__ import annotations

import argparse
import logging
import os

import uvicorn

log = logging.getLogger(__name__)


def absolute_sqlite(url: str) -> str:
    """A relative SQLite path made absolute: Ray's worker processes do not share this cwd."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or not parsed.database or parsed.database == ":memory:":
        return url
    return parsed.set(database=os.path.abspath(parsed.database)).render_as_string(hide_password=False)


def fleet_main(args: argparse.Namespace) -> int:
    from ..server.cli import ApplianceServer, _check_bindable, _self_url, server_options
    from ..server.state import ServerConfig
    from ..settings import engine_config_from_args, merged_settings
    from ..telemetry import store
    from .options import fleet_spec

    opts = server_options(merged_settings(args), args)
    spec = fleet_spec(args, opts)
    engine_config = engine_config_from_args(args)
    _check_bindable(opts["host"], opts["port"])
    db = absolute_sqlite(opts["db"]) if opts["db"] else None
    if db is not None:
        try:
            store.upgrade(db)
        except Exception as exc:  # noqa: BLE001 - as on one box: serving goes on, the writers retry
            log.warning("telemetry store not usable now (%s); serving anyway", type(exc).__name__)
    config = ServerConfig(served_model_name=opts["served_model_name"], api_key=opts["api_key"],
                          max_body_bytes=opts["max_body_bytes"], replica_id=opts["replica_id"], db_url=db,
                          self_url=None if args.no_dashboard else _self_url(opts["host"], opts["port"]))

    from .ray_env import apply_ray_env

    apply_ray_env(spec.loopback_only)  # before Ray is imported
    from .cluster import start_fleet, stop_fleet
    from .drain import IngressDrain
    from .ingress import build_ingress
    from .replica import ReplicaSettings

    settings = ReplicaSettings(engine=engine_config, server=config, max_waiting=opts["max_waiting"], db_url=db,
                               telemetry_retention=opts["telemetry_retention"], torch_threads=spec.torch_threads)
    fleet = start_fleet(spec, settings)
    try:
        drain = IngressDrain()
        app = build_ingress(fleet, drain)
        log.info("fleet of %d replica(s) serving on http://%s:%d (auth %s)", spec.replicas, opts["host"],
                 opts["port"], "on" if opts["api_key"] else "off")
        server = ApplianceServer(uvicorn.Config(app, host=opts["host"], port=opts["port"], log_config=None,
                                                lifespan="on", timeout_graceful_shutdown=5),
                                 drain.drain, opts["drain_grace_s"])
        try:
            server.run()
        except SystemExit as exc:  # uvicorn exits this way when it cannot bind
            return exc.code if isinstance(exc.code, int) and exc.code else 1
        return 0 if server.started else 1
    finally:
        stop_fleet(spec)
