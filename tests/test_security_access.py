"""Access: with --api-key every /v1 and /admin route and the dashboard need the key (the dashboard
through a login), the key is compared in constant time and never logged nor sent to the
browser; without a key only loopback addresses may be bound."""

from __future__ import annotations

import argparse
import secrets

import httpx
import pytest

from appliance.server.cli import server_options

ERROR_KEYS = {"message", "type", "param", "code"}
ROUTES = [  # every /v1 and /admin route, with a body that would work
    ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("GET", "/admin/knobs", None),
    ("PATCH", "/admin/knobs", {"max_num_seqs": 7}),
    ("GET", "/admin/knobs/history", None),
    ("GET", "/admin/state", None),
]


def bad_credentials(key: str) -> list[dict[str, str]]:
    import base64

    return [
        {},
        {"Authorization": ""},
        {"Authorization": "Bearer"},
        {"Authorization": key},  # no scheme
        {"Authorization": f"Basic {base64.b64encode(f'user:{key}'.encode()).decode()}"},
        {"Authorization": f"Token {key}"},
        {"Authorization": f"Bearer {key[:-1]}"},  # a prefix
        {"Authorization": f"Bearer {key}x"},  # longer
        {"Authorization": f"Bearer {key.upper()}"},
        {"X-API-Key": key},
        {"Cookie": f"api_key={key}"},
    ]


def test_api_key_guards_every_route_and_the_dashboard_and_is_never_logged_or_shown(spawn_server, tmp_path):
    key = f"sk-appliance-{secrets.token_hex(16)}"
    server = spawn_server("--api-key", key, "--num-blocks", "64", "--db", f"sqlite:///{tmp_path}/telemetry.db",
                          "--replica-id", "guarded")
    url = server.base_url
    auth = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, timeout=60) as client:
        state0 = client.get("/admin/state", headers=auth).json()
        for method, path, body in ROUTES:
            for headers in bad_credentials(key):
                response = client.request(method, path, json=body, headers=headers)
                assert response.status_code == 401, (method, path, headers, response.text)
                assert set(response.json()["error"]) == ERROR_KEYS
                assert response.json()["error"]["code"] == "invalid_api_key"
                assert response.headers["www-authenticate"] == "Bearer"
            # the key in the query string is not a credential either
            assert client.request(method, f"{path}?api_key={key}", json=body).status_code == 401
        for path in ("/admin/knobs/", "/v1/models/", "/admin/", "/v1/"):  # near-misses: no data either
            assert client.get(path).status_code in (401, 404)
        # nothing the unauthorised requests asked for happened
        state1 = client.get("/admin/state", headers=auth).json()
        assert state1["iteration"] == state0["iteration"] and state1["knob_version"] == state0["knob_version"]
        for method, path, body in ROUTES:
            response = client.request(method, path, json=body, headers=auth)
            assert response.status_code == 200, (method, path, response.text)
        assert client.request("GET", "/admin/knobs", headers={"Authorization": f"bearer  {key}"}).status_code == 200
        assert client.get("/admin/knobs", headers=auth).json()["knobs"]["max_num_seqs"] == 7
        for public in ("/health", "/metrics", "/openapi.json"):
            assert client.get(public).status_code == 200
        assert key not in client.get("/openapi.json").text and key not in client.get("/metrics").text

        # the dashboard: a login page, but no app config or API without logging in
        page = client.get("/ui/")
        assert page.status_code == 200 and key not in page.text
        config = client.get("/ui/config")
        assert config.status_code == 401 or (config.json().get("auth_required") and not config.json().get("components"))
        assert "max_num_seqs" not in config.text
        for api in ("/ui/gradio_api/info", "/ui/info"):
            assert client.get(api).status_code in (401, 404)
        assert client.post("/ui/login", data={"username": "op", "password": "wrong"}).status_code >= 400
        assert client.post("/ui/login", data={"username": "op", "password": key[:-1]}).status_code >= 400
    with httpx.Client(base_url=url, timeout=60) as browser:  # a browser session that logs in
        login = browser.post("/ui/login", data={"username": "operator", "password": key})
        assert login.status_code == 200, login.text
        assert key not in login.text and all(key not in v for v in login.headers.values())
        config = browser.get("/ui/config")
        assert config.status_code == 200 and config.json().get("components"), config.text[:300]
        assert key not in config.text and key not in browser.get("/ui/").text
        assert all(key not in (cookie.value or "") for cookie in browser.cookies.jar)
        # the session works without the key itself: it is the dashboard that holds it, server-side
        assert browser.get("/admin/knobs").status_code == 401

    from gradio_client import Client

    dashboard = Client(f"{url}/ui/", auth=("operator", key), verbose=False)
    status, effective, *_ = dashboard.predict(api_name="/knobs_reload")
    assert "In force" in effective and "7" in effective  # it reached /admin with the key
    with pytest.raises(Exception):
        Client(f"{url}/ui/", auth=("operator", "sk-wrong"), verbose=False)

    server.terminate()
    assert server.proc.wait(60) == 0
    log = server.log()
    assert "serving" in log and "auth on" in log
    assert key not in log and key.removeprefix("sk-appliance-") not in log
    assert "api_key=[redacted]" in log  # the request lines that carried it in the query, redacted


def test_keys_are_compared_with_hmac_compare_digest(server_factory, monkeypatch):
    """Every key check goes through hmac.compare_digest (time independent of where the first
    difference is), also for keys of another length and for the dashboard login."""
    import hmac

    from ui.app import dashboard_auth

    key = "sk-" + "k" * 29
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    with server_factory(num_blocks=16, api_key=key) as srv:
        for token in ("sk-" + "k" * 28 + "x", "x" + "k" * 31, "short", key):
            status = httpx.get(f"{srv.base_url}/admin/knobs", headers={"Authorization": f"Bearer {token}"}).status_code
            assert status == (200 if token == key else 401)
        assert [a for a, _ in calls] == [t.encode() for t in ("sk-" + "k" * 28 + "x", "x" + "k" * 31, "short", key)]
        assert {b for _, b in calls} == {key.encode()}
    calls.clear()
    check = dashboard_auth(key)
    assert check("op", key) and not check("op", "nope")
    assert len(calls) == 2


@pytest.mark.parametrize("host,key,insecure,allowed", [
    ("127.0.0.1", None, False, True),
    ("127.0.0.9", None, False, True),
    ("localhost", None, False, True),
    ("::1", None, False, True),
    ("[::1]", None, False, True),
    ("0.0.0.0", None, False, False),
    ("::", None, False, False),
    ("192.168.1.20", None, False, False),
    ("10.0.0.1", None, False, False),
    ("example.com", None, False, False),
    ("0.0.0.0", "sk-k", False, True),
    ("192.168.1.20", "sk-k", False, True),
    ("0.0.0.0", None, True, True),
])
def test_without_a_key_only_loopback_binding_is_allowed(host, key, insecure, allowed, monkeypatch):
    monkeypatch.delenv("APPLIANCE_API_KEY", raising=False)
    args = argparse.Namespace(no_telemetry=True, insecure=insecure)
    settings = {"host": host, "api_key": key}
    if allowed:
        assert server_options(settings, args)["host"] == host
    else:
        with pytest.raises(ValueError, match="--api-key"):
            server_options(settings, args)
    monkeypatch.setenv("APPLIANCE_API_KEY", "sk-from-env")  # the key may come from the environment
    assert server_options({"host": host}, args)["api_key"] == "sk-from-env"
