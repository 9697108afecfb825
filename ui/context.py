"""What every dashboard tab shares: the API client, the telemetry store and the login rule."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from ui.api_client import ApplianceAPI


@dataclass
class DashboardContext:
    api: ApplianceAPI
    db_url: str
    configs_dir: Path | None
    require_login: bool  # the server runs with --api-key: only logged-in sessions may act

    def check(self, request: gr.Request | None) -> None:
        """Refuse a handler call from a session that has not logged in (when a key is set).

        Gradio's own auth guards the routes when the server mounts the dashboard with
        `auth=dashboard_auth(key)`; this keeps the admin API closed even if it does not.
        """
        if self.require_login and (request is None or not getattr(request, "username", None)):
            raise gr.Error("log in to the dashboard first (the server runs with an API key)")
