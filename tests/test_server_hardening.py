"""The real server under requests that used to hurt it: a large body must not
hold up the event loop, and credentials are read as clients send them."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest

from conftest import API_KEY_B, ORIGIN_B

KEY = API_KEY_B
ORIGIN = ORIGIN_B


@pytest.fixture(scope="module")
def big_server(server_b):
    return server_b.url, int(server_b.url.rsplit(":", 1)[1])


def _raw_request(port: int, method: str, path: str, body: bytes = b"", headers: dict | None = None) -> bytes:
    head = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close",
            f"Content-Length: {len(body)}"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_health_answers_while_a_10mb_request_is_prepared(big_server):
    """Ordering, not timing: /health is sent after the whole 10 MB body has
    been written, and must be answered before the big request is."""
    url, port = big_server
    words = " ".join(f"word{i % 997}" for i in range(1_300_000))  # ~10 MB of text to render and tokenize
    body = json.dumps({"model": "default", "max_tokens": 1,
                       "messages": [{"role": "user", "content": words}]}).encode()
    assert len(body) > 10_000_000
    order: list[str] = []
    big = socket.create_connection(("127.0.0.1", port), timeout=300)
    big.sendall(_raw_request(port, "POST", "/v1/chat/completions", body,
                             {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}))
    reply: dict = {}

    def wait_big():
        reply["big"] = _read_all(big)
        order.append("big")

    t = threading.Thread(target=wait_big)
    t.start()
    r = httpx.get(url + "/health", timeout=300)
    order.append("health")
    t.join(300)
    big.close()
    assert r.status_code == 200
    assert order == ["health", "big"], order
    # The big prompt does not fit the context: a 400 in OpenAI's shape, after it was prepared.
    status_line, _, rest = reply["big"].partition(b"\r\n")
    assert b" 400 " in status_line
    err = json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["code"] == "context_length_exceeded"


@pytest.mark.parametrize("headers, status", [
    ({"x-api-key": "", "Authorization": f"Bearer {KEY}"}, 200),  # an empty header must not hide the key
    ({"x-api-key": KEY, "Authorization": ""}, 200),
    ({"x-api-key": "", "Authorization": "Bearer"}, 401),
    ({"x-api-key": "wrong", "Authorization": f"Bearer {KEY}"}, 401),  # the first given credential decides
    ({}, 401),
])
def test_the_first_non_empty_credential_is_checked(big_server, headers, status):
    url, _ = big_server
    r = httpx.get(url + "/v1/models", headers=headers, timeout=30)
    assert r.status_code == status, r.text
    if status == 401:
        assert r.json()["error"]["type"] == "authentication_error"


def test_metrics_require_the_key_when_asked(big_server):
    url, _ = big_server
    assert httpx.get(url + "/metrics", timeout=30).status_code == 401
    r = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200 and "num_requests_running" in r.text
    assert httpx.get(url + "/health", timeout=30).status_code == 200  # health stays open


def test_metrics_are_open_by_default(server):
    r = httpx.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 200 and "num_requests_running" in r.text
    assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 401


def _preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(url + "/v1/chat/completions", timeout=30, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_preflight_from_an_allowed_origin(big_server):
    url, _ = big_server
    r = _preflight(url, ORIGIN)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()


def test_cors_other_origins_get_no_cors_headers(big_server):
    url, _ = big_server
    r = _preflight(url, "http://evil.example")
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(url + "/v1/models", headers={"Origin": "http://evil.example",
                                               "Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_requests_still_need_the_key(big_server):
    url, _ = big_server
    r = httpx.get(url + "/v1/models", headers={"Origin": ORIGIN}, timeout=30)
    assert r.status_code == 401  # the browser can read the 401 ...
    assert r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(url + "/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN


def test_no_cors_unless_origins_are_given(server):
    r = _preflight(server.url, ORIGIN)
    # Without --allowed-origins a preflight is an ordinary unauthenticated request.
    assert r.status_code == 401 and "access-control-allow-origin" not in r.headers
    assert r.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_lone_surrogate_in_an_object_key_is_a_400(server, path):
    """The key is named in the error, escaped (the raw key cannot be encoded)."""
    body = ('{"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], '
            '"metadata": {"\\ud800x": 1}}').encode()
    r = httpx.post(server.url + path, content=body, timeout=30,
                   headers={**server.headers, "content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "metadata." in err["message"] and "surrogate" in err["message"]


# ------------------------------------------------ browsers: DNS rebinding and other sites' pages


@pytest.mark.parametrize("path, anthropic", [("/v1/models", False), ("/v1/messages", True), ("/", False)])
def test_a_host_the_server_does_not_answer_to_is_refused(server, path, anthropic):
    """Listening on loopback, the server answers only to loopback names: a
    page of another site whose name was rebound to 127.0.0.1 names itself
    in the Host header."""
    port = server.url.rsplit(":", 1)[1]
    for host in (f"rebind.evil.example:{port}", "evil.example", f"10.0.0.1:{port}"):
        r = httpx.get(server.url + path, headers={**server.headers, "Host": host}, timeout=30)
        assert r.status_code == 400, (host, r.text)
        err = r.json()["error"]
        assert "allowed-hosts" in err["message"] and (r.json().get("type") == "error") == anthropic
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "127.0.0.2", "app.localhost"):
        r = httpx.get(server.url + "/v1/models", headers={**server.headers, "Host": host}, timeout=30)
        assert r.status_code == 200, (host, r.text)


def test_writes_from_another_sites_page_are_refused(server):
    """A page elsewhere may send a "simple" cross-site POST (text/plain, no
    preflight): refused by its Origin. Same-origin pages (the chat page) and
    clients that send no Origin are served; reads are left to CORS."""
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    for origin in ("http://evil.example", "null", "http://127.0.0.1:1"):
        r = httpx.post(server.url + "/v1/chat/completions", content=body, timeout=30,
                       headers={**server.headers, "content-type": "text/plain", "Origin": origin,
                                "Sec-Fetch-Site": "cross-site"})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", (origin, r.text)
    r = httpx.post(server.url + "/v1/messages", content=body, timeout=30,
                   headers={**server.headers, "Origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    same = server.url  # http://127.0.0.1:<port>, as the chat page's own requests carry
    proxied = {"Origin": "https://chat.example", "X-Forwarded-Host": "chat.example"}  # behind a proxy
    for headers in ({"Origin": same}, {}, proxied, {"Origin": "https://chat.example", "Sec-Fetch-Site": "same-origin"}):
        r = httpx.post(server.url + "/v1/chat/completions", content=body, timeout=60,
                       headers={**server.headers, "content-type": "application/json", **headers})
        assert r.status_code == 200, r.text
    r = httpx.get(server.url + "/v1/models", headers={**server.headers, "Origin": "http://evil.example"}, timeout=30)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_allowed_origins_may_write(big_server):
    url, _ = big_server
    r = httpx.post(url + "/tokenize", json={"prompt": "hi"}, timeout=30,
                   headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN


def test_which_hosts_a_server_answers_to():
    from mlxfast.serve import _allowed_hosts
    from mlxfast.server.app import host_allowed

    assert _allowed_hosts("127.0.0.1", None) == () and _allowed_hosts("::1", None) == ()
    assert _allowed_hosts("0.0.0.0", None) is None and _allowed_hosts("192.168.1.5", None) is None
    assert _allowed_hosts("0.0.0.0", ("box.lan",)) == ("box.lan",)
    assert _allowed_hosts("0.0.0.0", ("Box.LAN:8080", "[::2]")) == ("box.lan", "::2")  # as Host headers are read
    assert host_allowed("evil.example", None) and host_allowed(None, ())
    assert host_allowed("BOX.lan:8080", ("box.lan",)) and not host_allowed("box.lan.evil:80", ("box.lan",))
    assert host_allowed("anything", ("*",)) and not host_allowed("127.0.0.1.evil.example", ())
