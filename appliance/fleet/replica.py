"""One fleet replica: the single-process server's app (engine, KV cache, engine thread, telemetry
writer) inside a Ray Serve replica.

`EngineReplica` is the deployment's class (the CLI wraps it with `serve.deployment`). Ray Serve
routes OpenAI requests to `http` (a streamed response); requests addressed to this replica by id
(knobs, metrics, state) arrive through the fleet registry. The replica's id is the fleet's
`--replica-id` and Ray Serve's replica id, e.g. `myhost:8000/ab12cd34`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from typing import Any, AsyncIterator

import ray
from ray import serve

from ..engine import AsyncEngine, EngineConfig, LLMEngine
from ..server.app import build_app
from ..server.cli import is_loopback
from ..server.state import AppState, ServerConfig
from .bridge import ForwardedRequest, ResponseStart, asgi_buffered, asgi_request
from .registry import REGISTRY_NAMESPACE

log = logging.getLogger(__name__)

@dataclasses.dataclass
class ReplicaSettings:
    """What every replica is built from (picklable; sent to each replica by Ray Serve)."""

    engine: EngineConfig
    server: ServerConfig
    max_waiting: int | None
    db_url: str | None
    telemetry_retention: str | None
    torch_threads: int


def _serve_grpc_on_loopback() -> None:
    """Ray Serve (2.60) starts an inter-deployment gRPC server in every replica, bound to "[::]:0"
    (every interface) with no setting to change it; the ingress's handle calls the replica through
    it (ray_env: RAY_SERVE_USE_GRPC_BY_DEFAULT), and on every interface it would take requests for
    this replica past the ingress and its API key. On a node whose Ray address is loopback (a local
    fleet, ray_env.LOOPBACK_ONLY_ENV) it is bound to 127.0.0.1 instead, where the handle finds it:
    the one listener that Ray's settings leave on every interface (tests/test_fleet.py checks them
    all). Runs in the replica's process before Serve starts the server."""
    from ray.serve._private import replica as serve_replica

    bind = getattr(serve_replica, "add_port_to_grpc_server", None)
    if bind is None or not is_loopback(ray.util.get_node_ip_address()):
        return

    def on_loopback(server: Any, address: str) -> int:
        return bind(server, "127.0.0.1:" + address.removeprefix("[::]:") if address.startswith("[::]:") else address)

    serve_replica.add_port_to_grpc_server = on_loopback


class EngineReplica:
    async def __init__(self, settings: ReplicaSettings, registry_name: str) -> None:
        import torch

        _serve_grpc_on_loopback()
        torch.set_num_threads(settings.torch_threads)  # replicas share the host's cores
        context = serve.get_replica_context()
        self.replica_id = f"{settings.server.replica_id}/{context.replica_id.unique_id}"[-64:]
        self.registry = ray.get_actor(registry_name, namespace=REGISTRY_NAMESPACE)
        fleet_knobs: dict[str, Any] = {}

        def build_engine() -> LLMEngine:  # on the engine's own loop thread (AsyncEngine.build)
            loaded = _load(settings.engine)
            # Join after the slow load so no fleet knob change is missed in between; from here on
            # changes queue in this replica's inbox until its first poll.
            fleet_knobs.update(ray.get(self.registry.join.remote(self.replica_id)))
            knobs = settings.engine.knobs.with_changes(fleet_knobs)
            return LLMEngine(dataclasses.replace(settings.engine, knobs=knobs), loaded=loaded)

        aeng = await asyncio.to_thread(AsyncEngine.build, build_engine, settings.max_waiting)
        telemetry = None
        if settings.db_url:
            from ..telemetry.writer import TelemetryWriter

            telemetry = TelemetryWriter(settings.db_url, self.replica_id, retention=settings.telemetry_retention)
        server_config = dataclasses.replace(settings.server, replica_id=self.replica_id, self_url=None, api_key=None)
        self.app = build_app(aeng, server_config, telemetry)
        self.state: AppState = self.app.state.appliance
        self.state.start()
        self._poller = asyncio.ensure_future(self._answer_calls())
        log.info("replica %s serving (%d torch threads, fleet knobs %s)", self.replica_id,
                 settings.torch_threads, fleet_knobs or "none")

    async def http(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """One request routed here by Ray Serve: the response head (naming this replica in
        x-appliance-replica, as the server app does), then its body chunks."""
        async for item in asgi_request(self.app, request):
            yield item

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine stopped is replaced."""
        if not self.state.ready:
            raise RuntimeError(f"replica {self.replica_id}: engine not running ({self.state.status})")

    async def _answer_calls(self) -> None:
        while True:
            try:
                calls = await self.registry.next_calls.remote(self.replica_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the registry restarting must not end the loop
                log.warning("replica %s: fleet registry unreachable (%s)", self.replica_id, exc)
                await asyncio.sleep(1.0)
                continue
            for call_id, request in calls:
                asyncio.ensure_future(self._answer(call_id, request))

    async def _answer(self, call_id: int, request: ForwardedRequest) -> None:
        response = await asgi_buffered(self.app, request)
        await self.registry.reply.remote(call_id, response)

    def __del__(self) -> None:
        """Ray Serve's graceful stop: leave the fleet, stop the engine and flush telemetry."""
        with contextlib.suppress(Exception):
            self._poller.cancel()
            self.registry.leave.remote(self.replica_id)
        with contextlib.suppress(Exception):
            self.state.close()


def _load(config: EngineConfig) -> Any:
    from ..model_loader import load_model

    return load_model(config.model, dtype=config.dtype, device=config.device)
