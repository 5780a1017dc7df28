"""Black-box, raw HTTP: malformed input, error shapes and status codes, auth,
body cap, and the exact SSE byte framing of both APIs."""

from __future__ import annotations

import json

import httpx
import pytest

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Hi"}]


def post(server, path, body=None, *, raw: bytes | None = None, headers=None, key=True):
    h = {"content-type": "application/json"}
    if key:
        h.update(server.headers)
    h.update(headers or {})
    return httpx.post(server.url + path, content=raw if raw is not None else json.dumps(body).encode(),
                      headers=h, timeout=60)


def assert_openai_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("raw,param", [
    (b"{not json", None),
    (b"", None),
    (b"[1, 2]", None),
    (json.dumps({"messages": []}).encode(), "messages"),
    (json.dumps({}).encode(), "messages"),
    (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), "messages[0].role"),
    (json.dumps({"messages": MSGS, "temperature": "hot"}).encode(), "temperature"),
    (json.dumps({"messages": MSGS, "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"messages": MSGS, "max_tokens": 2.5}).encode(), "max_tokens"),
    (json.dumps({"messages": MSGS, "top_p": 1.5}).encode(), "top_p"),
    (json.dumps({"messages": MSGS, "stream": "yes"}).encode(), "stream"),
    (json.dumps({"messages": MSGS, "stop": 5}).encode(), None),
    (json.dumps({"messages": MSGS, "logit_bias": {"x": 1}}).encode(), "logit_bias"),
    (json.dumps({"messages": MSGS, "logit_bias": {"99999999": 1}}).encode(), "logit_bias"),
    (json.dumps({"messages": MSGS, "response_format": {"type": "xml"}}).encode(), "response_format.type"),
    (json.dumps({"messages": MSGS, "response_format": {"type": "json_schema"}}).encode(), "response_format"),
    (json.dumps({"messages": MSGS, "tool_choice": "required"}).encode(), "tool_choice"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}).encode(),
     "messages"),
])
def test_chat_bad_requests_are_400(server, raw, param):
    err = assert_openai_error(post(server, CHAT, raw=raw), 400, param)
    assert err["type"] == "invalid_request_error"


def test_image_part_says_text_only(server):
    r = post(server, CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert "text-only" in assert_openai_error(r, 400)["message"]


def test_completion_bad_requests(server):
    assert_openai_error(post(server, "/v1/completions", {"prompt": ["a", ""]}), 400, "prompt")  # an empty one
    assert_openai_error(post(server, "/v1/completions", {"prompt": [10 ** 9]}), 400, "prompt")
    assert_openai_error(post(server, "/v1/completions", {"prompt": "x", "logprobs": 50}), 400, "logprobs")
    assert_openai_error(post(server, "/v1/completions", {"max_tokens": 3}), 400, "prompt")
    for mixed in (["a", [1, 2]], [[1, 2], 3], ["a", 3]):
        err = assert_openai_error(post(server, "/v1/completions", {"prompt": mixed}), 400, "prompt")
        assert "not a mix" in err["message"], err


def test_unknown_route_and_method(server):
    r = httpx.get(server.url + "/v1/nothing", headers=server.headers)
    assert assert_openai_error(r, 404)["type"] == "not_found_error"
    r = httpx.get(server.url + CHAT, headers=server.headers)
    assert_openai_error(r, 405)
    r = httpx.get(server.url + "/v1/messages/nothing", headers=server.headers)
    assert r.status_code == 404 and r.json()["type"] == "error"


def test_a_405_names_every_method_the_path_takes(server):
    # /v1/responses/{id} is two routes (GET and DELETE); POST has its own path.
    r = httpx.request("PUT", server.url + "/v1/responses/resp_x", headers=server.headers)
    assert_openai_error(r, 405)
    assert {m.strip() for m in r.headers["allow"].split(",")} == {"GET", "HEAD", "DELETE"}
    r = httpx.get(server.url + CHAT, headers=server.headers)
    assert r.headers["allow"] == "POST"


def test_get_routes_answer_head_with_headers_only(server):
    get = httpx.get(server.url + "/health")
    head = httpx.head(server.url + "/health")
    assert head.status_code == get.status_code == 200
    assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]
    head = httpx.head(server.url + "/v1/models", headers=server.headers)
    assert head.status_code == 200 and head.content == b""


def test_auth(server):
    r = post(server, CHAT, {"messages": MSGS}, key=False)
    assert assert_openai_error(r, 401)["type"] == "authentication_error"
    r = post(server, CHAT, {"messages": MSGS}, key=False, headers={"Authorization": "Bearer wrong"})
    assert_openai_error(r, 401)
    r = post(server, "/v1/messages", {"model": "m", "max_tokens": 1, "messages": MSGS}, key=False,
             headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed
    r = post(server, CHAT, {"messages": MSGS, "max_tokens": 1}, key=False, headers={"x-api-key": server.api_key})
    assert r.status_code == 200


def test_body_cap_413(server):
    big = {"messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    assert_openai_error(post(server, CHAT, big), 413)
    r = post(server, "/v1/messages", {"model": "m", "max_tokens": 1, "messages": big["messages"]})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"

    def chunks():  # no content-length: counted while reading
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"y" * 65536
        yield b'"}]}'
    r = httpx.post(server.url + CHAT, content=chunks(), headers={**server.headers, "content-type": "application/json"})
    assert_openai_error(r, 413)


def test_never_422(server):
    for raw in (b"null", b'{"messages": "hi"}', b'{"messages": [{"content": "x"}]}'):
        assert post(server, CHAT, raw=raw).status_code == 400
        assert post(server, "/v1/messages", raw=raw).status_code == 400


def test_openai_sse_framing(server):
    with httpx.stream("POST", server.url + CHAT, headers=server.headers, timeout=60,
                      json={"messages": MSGS, "max_tokens": 4, "temperature": 0, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes())
    assert raw.endswith(b"data: [DONE]\n\n")
    events = raw.split(b"\n\n")[:-1]
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events)
    for e in events[:-1]:
        json.loads(e[6:])


def test_anthropic_sse_framing(server):
    with httpx.stream("POST", server.url + "/v1/messages", headers=server.headers, timeout=60,
                      json={"model": "m", "max_tokens": 4, "messages": MSGS, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes())
    events = raw.split(b"\n\n")
    assert events[-1] == b""
    names = []
    for e in events[:-1]:
        name, data = e.split(b"\n")
        assert name.startswith(b"event: ") and data.startswith(b"data: ")
        payload = json.loads(data[6:])
        assert payload["type"] == name[7:].decode()
        names.append(payload["type"])
    assert names[0] == "message_start" and names[-1] == "message_stop" and names[-2] == "message_delta"


def _aborted_total(server) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("mlxfast:request_success_total") and 'finished_reason="abort"' in line:
            return float(line.split()[-1])
    return 0.0


def test_nonstreaming_client_disconnect_aborts(server):
    """A non-streamed request whose client gave up is aborted while its
    tokens still flow (it was looked for only in silences, so it ran to its
    max_tokens). Eight choices of ~240 tokens each (this server's context is
    256) take seconds on any CPU; the client leaves after 0.5 s and the
    server looks for it every second."""
    import time

    for path, extra in ((CHAT, {"messages": MSGS}), ("/v1/completions", {"prompt": "Count:"})):
        before = _aborted_total(server)
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + path, headers=server.headers, timeout=0.5,
                       json={**extra, "n": 8, "max_tokens": 4000, "temperature": 0, "ignore_eos": True})
        deadline = time.time() + 15
        while _aborted_total(server) <= before and time.time() < deadline:
            time.sleep(0.2)
        assert _aborted_total(server) > before, path
        stats = httpx.get(server.url + "/stats", headers=server.headers).json()
        while stats["engine"].get("num_requests_running", 0) and time.time() < deadline:
            time.sleep(0.2)
            stats = httpx.get(server.url + "/stats", headers=server.headers).json()
        assert stats["engine"]["num_requests_running"] == 0, path


def test_client_disconnect_aborts(server):
    before = httpx.get(server.url + "/metrics").text
    with httpx.stream("POST", server.url + CHAT, headers=server.headers, timeout=60,
                      json={"messages": MSGS, "max_tokens": 200, "temperature": 0, "stream": True,
                            "ignore_eos": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    import time

    def aborted(text):
        for line in text.splitlines():
            if line.startswith('mlxfast:request_success_total') and 'finished_reason="abort"' in line:
                return float(line.split()[-1])
        return 0.0

    deadline = time.time() + 15
    while time.time() < deadline:
        after = httpx.get(server.url + "/metrics").text
        if aborted(after) > aborted(before):
            break
        time.sleep(0.2)
    assert aborted(after) > aborted(before)
    stats = httpx.get(server.url + "/stats", headers=server.headers).json()
    deadline = time.time() + 15
    while stats["engine"].get("num_requests_running", 0) and time.time() < deadline:
        time.sleep(0.2)
        stats = httpx.get(server.url + "/stats", headers=server.headers).json()
    assert stats["engine"]["num_requests_running"] == 0
