"""Black-box, raw HTTP against the real server (issue #16): malformed input on
every route is a 4xx in that route's own error shape, never a 500, a hang or
a dead engine.

Contract, per request:

* the status is 400 (413 for a body over ``--max-body-mb``, 404 for an
  unknown model id); never 5xx, never 422, and an answer within TIMEOUT;
* the body is the route's error shape: OpenAI ``{"error": {"message",
  "type", "param", "code"}}`` for /v1/chat/completions, /v1/completions,
  /tokenize, /detokenize and /v1/models; Anthropic ``{"type": "error",
  "error": {"type", "message"}}`` for /v1/messages(/count_tokens);
* where the input has an offending field, the message or ``param`` names
  it. A body the JSON parser itself rejects (nesting, a >4300-digit
  integer, a NaN literal, bytes that are not UTF-8) has no field to name;
* afterwards ``/health`` is still 200.

Inputs that killed the engine thread (``top_k`` >= 2**63, a lone surrogate
in ``cache_salt``) go to a separate, restartable server (``victim``) so
that one of them cannot take the session server, and every later test, with
it. The last test checks that every route still serves a normal request.

Bodies are written as raw JSON text (``raw(obj, NAME=text)``) so that what
Python's json would never emit (``NaN``, ``\\ud800`` escapes, 5000-digit
integers, 10,000 levels of nesting) reaches the server byte for byte.
"""

from __future__ import annotations

import json
import re
import socket
import threading
from collections import deque

import httpx
import pytest

from conftest import free_port, start_server, wait_healthy

TIMEOUT = 30  # seconds; a request that takes longer is a hang
SERVER_FLAGS = ("--api-key", "test-key", "--max-batch", "16", "--max-body-mb", "1",
                "--max-tokens", "16", "--max-model-len", "256")

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MSGS = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
TOK = "/tokenize"
DETOK = "/detokenize"
POST_ROUTES = (CHAT, CMPL, MSGS, COUNT, TOK, DETOK)
_ROUTE_ID = {CHAT: "chat", CMPL: "completions", MSGS: "messages", COUNT: "count_tokens", TOK: "tokenize",
             DETOK: "detokenize"}

USER = [{"role": "user", "content": "Hi"}]
# A valid request per route; each case breaks one thing in it.
OK = {
    CHAT: {"messages": USER, "max_tokens": 2},
    CMPL: {"prompt": "Hi", "max_tokens": 2},
    MSGS: {"model": "m", "max_tokens": 2, "messages": USER},
    COUNT: {"model": "m", "messages": USER},
    TOK: {"prompt": "Hi"},
    DETOK: {"tokens": [1, 2]},
}

DEEP = 10_000
BIG_INT = "9" * 5000  # past Python's 4300-digit int-str limit
HI_SURROGATE = '"a\\ud800b"'  # JSON text: the 6-character escape of a lone high surrogate
LO_SURROGATE = '"\\udfff"'
SURROGATES = pytest.mark.parametrize("sur", [HI_SURROGATE, LO_SURROGATE], ids=["hi", "lo"])


def deep(kind: str, n: int = DEEP) -> str:
    return "[" * n + "]" * n if kind == "array" else '{"a":' * n + "1" + "}" * n


def raw(obj, **subs: str) -> bytes:
    """``json.dumps(obj)``, each string ``"$NAME"`` replaced by the raw JSON text ``subs[NAME]``."""
    text = json.dumps(obj)
    for name, value in subs.items():
        placeholder = json.dumps("$" + name)
        assert placeholder in text, f"no ${name} in {obj}"
        text = text.replace(placeholder, value)
    return text.encode()


def with_(path: str, **fields) -> dict:
    return {**OK[path], **fields}


# ------------------------------------------------------------ helpers


class _Drain:
    """Read a server's stdout/stderr as it runs: a full pipe would block its
    logging (and with it the event loop), and the tail explains failures."""

    def __init__(self, proc):
        self.lines: deque[str] = deque(maxlen=400)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream):
        try:
            for line in stream:
                self.lines.append(line.rstrip("\n"))
        except (OSError, ValueError):
            pass

    def tail(self, n: int = 40) -> str:
        return "\n".join(list(self.lines)[-n:])


_drains: dict[int, _Drain] = {}


def _drain(proc) -> _Drain:
    if proc.pid not in _drains:
        _drains[proc.pid] = _Drain(proc)
    return _drains[proc.pid]


_clients: dict[str, httpx.Client] = {}


def _client(srv) -> httpx.Client:
    """One client per server, one connection per request ("Connection: close": a kept-alive
    connection here waits out Nagle/delayed-ACK, ~40 ms a request)."""
    if srv.url not in _clients:
        _clients[srv.url] = httpx.Client(base_url=srv.url, timeout=TIMEOUT, headers={"connection": "close"})
    return _clients[srv.url]


@pytest.fixture(scope="module", autouse=True)
def _drain_session_server(server):
    _drain(server.proc)
    yield
    for c in _clients.values():
        c.close()
    _clients.clear()


def send(srv, path: str, body=None, *, content: bytes | None = None, headers=None, method: str = "POST"):
    h = [("content-type", "application/json"), *srv.headers.items()]
    if isinstance(headers, dict):
        h = [(k, v) for k, v in h if k.lower() not in {x.lower() for x in headers}] + list(headers.items())
    elif headers is not None:  # a list of pairs: duplicates allowed
        h = [(k, v) for k, v in h if k.lower() not in {x.lower() for x, _ in headers}] + list(headers)
    if content is None:
        content = json.dumps(body).encode() if body is not None else b""
    try:
        return _client(srv).request(method, path, content=content, headers=h)
    except httpx.TimeoutException:
        pytest.fail(f"{method} {path}: no answer within {TIMEOUT}s (hang)\n{_drain(srv.proc).tail()}")


def health(srv) -> int:
    try:
        return _client(srv).get("/health", timeout=10).status_code
    except httpx.HTTPError as e:
        return f"unreachable: {e!r}"


def assert_error(r: httpx.Response, path: str, status: int = 400, names=()) -> dict:
    """``r`` is an error of ``status`` in ``path``'s shape; the message or param names one of ``names``."""
    assert r.status_code == status, f"{path}: expected {status}, got {r.status_code}: {r.text[:600]}"
    assert r.headers.get("content-type", "").startswith("application/json"), \
        f"{path}: the error is not JSON: {r.headers.get('content-type')!r} {r.text[:300]!r}"
    try:
        body = r.json()
    except ValueError:
        pytest.fail(f"{path}: the error body is not JSON: {r.text[:300]!r}")
    if path.startswith("/v1/messages"):
        assert isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error", body
        err = body["error"]
        assert isinstance(err, dict) and {"type", "message"} <= set(err), body
        assert isinstance(err["type"], str) and isinstance(err["message"], str) and err["message"], body
        said = err["message"]
    else:
        assert isinstance(body, dict) and set(body) == {"error"}, body
        err = body["error"]
        assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, body
        assert isinstance(err["type"], str) and isinstance(err["message"], str) and err["message"], body
        said = err["message"] + " " + str(err["param"] or "")
    if names:
        assert any(n in said for n in names), f"{path}: the error names none of {names}: {err}"
    return err


def reject(srv, path: str, body=None, *, content=None, names=(), status: int = 400, headers=None,
           method: str = "POST") -> dict:
    """Send; the answer is the route's error and the engine is still alive."""
    r = send(srv, path, body, content=content, headers=headers, method=method)
    h = health(srv)
    try:
        err = assert_error(r, path, status, names)
    except AssertionError as e:
        raise AssertionError(f"{e}\n/health afterwards: {h}\nserver log tail:\n{_drain(srv.proc).tail()}") from None
    assert h == 200, f"{path}: answered {status} but the engine died: /health {h}\n{_drain(srv.proc).tail()}"
    return err


# ------------------------------------------------------------ 1. nesting


@pytest.mark.parametrize("kind", ["array", "object"])
@pytest.mark.parametrize("path", POST_ROUTES)
def test_deep_body(server, path, kind):
    reject(server, path, content=deep(kind).encode())


def _deep_in_fields():
    d = "$D"
    cases = {
        "chat-messages[0].content": (CHAT, with_(CHAT, messages=[{"role": "user", "content": d}])),
        "chat-content-part-text": (CHAT, with_(CHAT, messages=[{"role": "user", "content": [{"type": "text", "text": d}]}])),
        "chat-response_format-schema": (CHAT, with_(CHAT, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": d}}}})),
        "chat-tools-parameters": (CHAT, with_(CHAT, tools=[{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": d}}}}])),
        "chat-chat_template_kwargs": (CHAT, with_(CHAT, chat_template_kwargs={"x": d})),
        "chat-tool_calls-arguments": (CHAT, with_(CHAT, messages=USER + [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": d}}}]}])),
        "chat-unknown-field": (CHAT, with_(CHAT, extra_unknown_field=d)),
        "completions-prompt": (CMPL, with_(CMPL, prompt=d)),
        "completions-response_format-schema": (CMPL, with_(CMPL, response_format={
            "type": "json_schema", "json_schema": {"schema": {"items": d}}})),
        "messages-metadata": (MSGS, with_(MSGS, metadata={"a": d})),
        "messages-tools-input_schema": (MSGS, with_(MSGS, tools=[{"name": "f", "input_schema": {
            "type": "object", "properties": {"a": d}}}])),
        "messages-system-block": (MSGS, with_(MSGS, system=[{"type": "text", "text": d}])),
        "messages-content-block-extra": (MSGS, with_(MSGS, messages=[{"role": "user", "content": [
            {"type": "text", "text": "x", "extra": d}]}])),
        "count_tokens-content": (COUNT, with_(COUNT, messages=[{"role": "user", "content": d}])),
        "tokenize-messages-content": (TOK, {"messages": [{"role": "user", "content": d}]}),
        "detokenize-tokens": (DETOK, {"tokens": d}),
    }
    return [pytest.param(path, body, id=name) for name, (path, body) in cases.items()]


@pytest.mark.parametrize("kind", ["array", "object"])
@pytest.mark.parametrize("path,body", _deep_in_fields())
def test_deep_value_in_field(server, path, body, kind):
    reject(server, path, content=raw(body, D=deep(kind)))


# ------------------------------------------------------------ 2. huge integers


def _big_int_cases():
    n = "$N"
    cases = {
        "chat-max_tokens": (CHAT, with_(CHAT, max_tokens=n)),
        "chat-max_completion_tokens": (CHAT, with_(CHAT, max_completion_tokens=n)),
        "chat-seed": (CHAT, with_(CHAT, seed=n)),
        "chat-top_k": (CHAT, with_(CHAT, top_k=n)),
        "chat-n": (CHAT, with_(CHAT, n=n)),
        "chat-top_logprobs": (CHAT, with_(CHAT, top_logprobs=n, logprobs=True)),
        "chat-temperature": (CHAT, with_(CHAT, temperature=n)),
        "chat-logit_bias-value": (CHAT, with_(CHAT, logit_bias={"5": n})),
        "chat-stop_token_ids": (CHAT, with_(CHAT, stop_token_ids=[n])),
        "chat-unknown-field": (CHAT, with_(CHAT, unknown_field=n)),
        "completions-prompt-ids": (CMPL, with_(CMPL, prompt=[1, n])),
        "completions-prompt-nested-ids": (CMPL, with_(CMPL, prompt=[[1, n]])),
        "completions-logprobs": (CMPL, with_(CMPL, logprobs=n)),
        "completions-seed": (CMPL, with_(CMPL, seed=n)),
        "completions-best_of": (CMPL, with_(CMPL, best_of=n)),
        "messages-max_tokens": (MSGS, with_(MSGS, max_tokens=n)),
        "messages-top_k": (MSGS, with_(MSGS, top_k=n)),
        "messages-metadata": (MSGS, with_(MSGS, metadata={"x": n})),
        "messages-budget_tokens": (MSGS, with_(MSGS, thinking={"type": "enabled", "budget_tokens": n})),
        "count_tokens-unknown-field": (COUNT, with_(COUNT, unknown_field=n)),
        "tokenize-unknown-field": (TOK, with_(TOK, unknown_field=n)),
        "detokenize-tokens": (DETOK, {"tokens": [1, n]}),
    }
    return [pytest.param(path, body, id=name) for name, (path, body) in cases.items()]


@pytest.mark.parametrize("sign", ["", "-"], ids=["pos", "neg"])
@pytest.mark.parametrize("path,body", _big_int_cases())
def test_integer_beyond_the_digit_limit(server, path, body, sign):
    # Python's json raises a plain ValueError on > 4300 digits (not a JSONDecodeError).
    reject(server, path, content=raw(body, N=sign + BIG_INT))


# ------------------------------------------------------------ 3. out-of-range numbers

U64 = 2 ** 64
I64_MIN = -(2 ** 63)


def _show(v) -> str:
    if isinstance(v, str) and v.startswith("RAW:"):
        return v[4:].replace(" ", "")
    return json.dumps(v, separators=(",", ":"))[:40].replace(" ", "_")


def _range_cases():
    """(path, body as raw JSON text, names)"""
    cases = []

    def add(path, names, **fields):
        subs = {k: v for k, v in fields.items() if isinstance(v, str) and v.startswith("RAW:")}
        body = with_(path, **{k: ("$" + k if k in subs else v) for k, v in fields.items()})
        cases.append(pytest.param(path, raw(body, **{k: v[4:] for k, v in subs.items()}), names,
                                  id=_ROUTE_ID[path] + "-" + "-".join(
                                      f"{k}={_show(v)}" for k, v in fields.items())))

    for path in (CHAT, CMPL):
        # A seed is a signed 64-bit integer, as vLLM takes it (-1 is a valid seed):
        # 2**63 and -2**63-1 do not fit.
        for seed in (U64, 1 << 63, I64_MIN - 1):
            add(path, ("seed",), seed=seed)
        # max_tokens is capped to the context, but a count no 64-bit type holds is malformed.
        for mt in (U64, 10 ** 30):
            add(path, ("max_tokens",), max_tokens=mt)
        add(path, ("max_tokens",), max_tokens=0)
        add(path, ("max_tokens",), max_tokens=-1)
        for f, v in (("temperature", -0.1), ("temperature", 2.5), ("temperature", "RAW:NaN"),
                     ("temperature", "RAW:Infinity"), ("temperature", "RAW:-Infinity"),
                     ("top_p", 0), ("top_p", 1.5), ("top_p", "RAW:NaN"), ("min_p", -0.5), ("min_p", 1.5),
                     ("min_p", "RAW:NaN"), ("presence_penalty", 2.5), ("presence_penalty", "RAW:NaN"),
                     ("frequency_penalty", -2.5), ("frequency_penalty", "RAW:Infinity"),
                     ("repetition_penalty", 0), ("repetition_penalty", -1), ("repetition_penalty", 11),
                     ("repetition_penalty", "RAW:NaN"), ("top_k", -2), ("top_k", "RAW:NaN"),
                     ("top_k", "RAW:Infinity"), ("n", 0), ("n", -1), ("n", U64), ("seed", "RAW:NaN"),
                     ("seed", 1.5), ("max_tokens", "RAW:NaN"), ("max_tokens", "RAW:Infinity")):
            names = (f,) if not (isinstance(v, str) and v[4:] in ("NaN", "Infinity", "-Infinity")) else ()
            add(path, names, **{f: v})
        for tid in (-1, 2 ** 32, 2 ** 63, U64, "VOCAB"):
            add(path, ("stop_token_ids",), stop_token_ids=[1, tid])
            add(path, ("logit_bias",), logit_bias={"VOCAB_KEY" if tid == "VOCAB" else str(tid): 1})
        # keys that int() accepts but are not token ids
        for key in (" 5", "5_0", "\u0663", "1e3", "0x10", "", "1.5"):
            add(path, ("logit_bias",), logit_bias={key: 1})
        for v in (101, -101, "RAW:NaN", "RAW:Infinity", "RAW:-Infinity", U64, "RAW:1e308"):
            names = () if isinstance(v, str) and v[4:] in ("NaN", "Infinity", "-Infinity") else ("logit_bias",)
            add(path, names, logit_bias={"5": v})
        # NaN/Infinity are not JSON (RFC 8259): rejected even where nothing reads them.
        add(path, (), unknown_field="RAW:NaN")
        add(path, (), unknown_field="RAW:[Infinity]")
    add(CHAT, ("top_logprobs",), logprobs=True, top_logprobs=-1)
    add(CHAT, ("top_logprobs",), logprobs=True, top_logprobs=21)
    add(CHAT, ("top_logprobs",), logprobs=True, top_logprobs=U64)
    add(CHAT, ("max_completion_tokens",), max_completion_tokens=U64)
    add(CHAT, ("max_completion_tokens",), max_completion_tokens=0)
    add(CMPL, ("logprobs",), logprobs=-1)
    add(CMPL, ("logprobs",), logprobs=21)
    add(CMPL, ("best_of",), best_of=-1)
    add(CMPL, ("best_of",), best_of=U64)
    for tid in (-1, 2 ** 32, 2 ** 63, U64, "VOCAB"):
        add(CMPL, ("prompt",), prompt=[1, tid])
        add(CMPL, ("prompt",), prompt=[[1, tid]])
        cases.append(pytest.param(DETOK, raw({"tokens": [1, tid]}), ("tokens",), id=f"detok-{tid}"))
    for mt in (0, -1, U64, 10 ** 30, "RAW:NaN"):
        add(MSGS, ("max_tokens",) if mt != "RAW:NaN" else (), max_tokens=mt)
    for f, v in (("temperature", 1.5), ("temperature", -0.1), ("temperature", "RAW:NaN"), ("top_p", 0),
                 ("top_p", "RAW:NaN"), ("top_k", -1), ("top_k", "RAW:Infinity")):
        add(MSGS, (f,) if not (isinstance(v, str) and v.startswith("RAW:")) else (), **{f: v})
    for path in (MSGS, COUNT):
        for b in (-1, U64):
            add(path, ("budget_tokens",), thinking={"type": "enabled", "budget_tokens": b})
    add(MSGS, (), metadata="RAW:{\"user_id\": NaN}")
    add(COUNT, (), unknown_field="RAW:NaN")
    cases.append(pytest.param(TOK, raw({"prompt": "x", "n": "$X"}, X="NaN"), (), id="tokenize-NaN"))
    cases.append(pytest.param(DETOK, raw({"tokens": [1, "$X"]}, X="NaN"), (), id="detok-NaN"))
    return cases


@pytest.fixture(scope="module")
def vocab(tokenizer):
    """The first token id past the vocabulary (the default model's embedding is as large)."""
    return tokenizer.vocab_size


@pytest.mark.parametrize("path,content,names", _range_cases())
def test_out_of_range_number(server, vocab, path, content, names):
    # "VOCAB" stands for the vocabulary size: the first token id past the end.
    content = content.replace(b'"VOCAB"', b"%d" % vocab).replace(b'"VOCAB_KEY"', b'"%d"' % vocab)
    reject(server, path, content=content, names=names)


# ---- inputs that killed the engine thread: each on the restartable victim server


class Victim:
    """A server like the session one, restarted whenever a test left it dead."""

    def __init__(self):
        self.proc = None
        self.url = None
        self.headers = {"Authorization": "Bearer test-key"}

    def ensure(self) -> "Victim":
        if self.proc is not None and self.proc.poll() is None and health(self) == 200:
            return self
        self.stop()
        port = free_port()
        self.proc = start_server(port, *SERVER_FLAGS)
        _drain(self.proc)
        self.url = f"http://127.0.0.1:{port}"
        wait_healthy(self.url, self.proc)
        return self

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except Exception:
                self.proc.kill()
        self.proc = None


@pytest.fixture(scope="module")
def victim():
    v = Victim()
    yield v
    v.stop()


def _engine_killer(victim, path, content, names):
    srv = victim.ensure()
    r = send(srv, path, content=content)
    h = health(srv)
    assert h == 200, (f"{path}: this input killed the engine thread: /health {h}, "
                      f"answer {r.status_code}: {r.text[:300]}\n{_drain(srv.proc).tail()}")
    assert_error(r, path, 400, names)


@pytest.mark.parametrize("top_k", [2 ** 63, U64, 10 ** 30], ids=["2^63", "2^64", "1e30"])
@pytest.mark.parametrize("path,extra", [
    (CHAT, {}), (CHAT, {"stream": True}), (CHAT, {"temperature": 0}), (CMPL, {}), (MSGS, {}), (MSGS, {"stream": True}),
], ids=["chat", "chat-stream", "chat-greedy", "completions", "messages", "messages-stream"])
def test_top_k_beyond_int64(victim, path, extra, top_k):
    # top_k above 2**63-1 reached the sampler's int64 conversion and killed the engine thread.
    _engine_killer(victim, path, json.dumps(with_(path, top_k=top_k, **extra)).encode(), ("top_k",))


@SURROGATES
@pytest.mark.parametrize("path,extra", [(CHAT, {}), (CHAT, {"stream": True}), (CMPL, {})],
                         ids=["chat", "chat-stream", "completions"])
def test_lone_surrogate_in_cache_salt(victim, path, extra, sur):
    # cache_salt was encoded to UTF-8 on the engine thread, outside the per-request guard.
    _engine_killer(victim, path, raw(with_(path, cache_salt="$S", **extra), S=sur), ("cache_salt",))


# ------------------------------------------------------------ 4. lone surrogates


def _surrogate_cases():
    s = "$S"
    tool = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
    past_call = {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                      "function": {"name": "f", "arguments": "{}"}}]}
    return [
        (CHAT, with_(CHAT, messages=[{"role": "user", "content": s}]), ("content", "messages")),
        (CHAT, with_(CHAT, messages=[{"role": "user", "content": [{"type": "text", "text": s}]}]), ("messages",)),
        (CHAT, with_(CHAT, messages=[{"role": "system", "content": s}] + USER), ("messages",)),
        (CHAT, with_(CHAT, messages=[{"role": "developer", "content": [{"type": "text", "text": s}]}] + USER),
         ("messages",)),
        (CHAT, with_(CHAT, messages=[{"role": "user", "content": "Hi", "name": s}]), ("messages", "name")),
        (CHAT, with_(CHAT, stop=s), ("stop",)),
        (CHAT, with_(CHAT, stop=["x", s]), ("stop",)),
        (CHAT, with_(CHAT, tools=[{**tool, "function": {**tool["function"], "name": s}}]), ("tools", "name")),
        (CHAT, with_(CHAT, tools=[{**tool, "function": {**tool["function"], "description": s}}]), ("tools",)),
        (CHAT, with_(CHAT, tools=[{**tool, "function": {**tool["function"], "parameters": {
            "type": "object", "properties": {"x": {"type": "string", "description": s}}}}}]), ("tools",)),
        (CHAT, with_(CHAT, messages=USER + [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                                                "function": {"name": s}}]}]),
         ("messages",)),
        (CHAT, with_(CHAT, messages=USER + [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                                                "function": {"name": "f",
                                                                                             "arguments": {"a": s}}}]}]),
         ("messages", "arguments")),
        (CHAT, with_(CHAT, messages=USER + [past_call, {"role": "tool", "tool_call_id": "c1", "content": s}]),
         ("messages",)),
        (CHAT, with_(CHAT, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "string", "enum": [s]}}}), ("response_format",)),
        (CHAT, with_(CHAT, model=s), ("model",)),
        (CMPL, with_(CMPL, prompt=s), ("prompt",)),
        (CMPL, with_(CMPL, prompt=[s]), ("prompt",)),
        (CMPL, with_(CMPL, prompt=s, echo=True), ("prompt",)),
        (CMPL, with_(CMPL, stop=[s]), ("stop",)),
        (CMPL, with_(CMPL, model=s), ("model",)),
        (MSGS, with_(MSGS, messages=[{"role": "user", "content": s}]), ("messages", "content")),
        (MSGS, with_(MSGS, messages=[{"role": "user", "content": [{"type": "text", "text": s}]}]), ("messages",)),
        (MSGS, with_(MSGS, system=s), ("system",)),
        (MSGS, with_(MSGS, system=[{"type": "text", "text": s}]), ("system",)),
        (MSGS, with_(MSGS, stop_sequences=[s]), ("stop_sequences",)),
        (MSGS, with_(MSGS, tools=[{"name": s, "input_schema": {"type": "object"}}]), ("tools", "name")),
        (MSGS, with_(MSGS, tools=[{"name": "f", "description": s, "input_schema": {"type": "object"}}]), ("tools",)),
        (MSGS, with_(MSGS, messages=USER + [
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": s}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]),
         ("messages",)),
        (MSGS, with_(MSGS, messages=USER + [
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": s}]}]),
         ("messages",)),
        (MSGS, with_(MSGS, model=s), ("model",)),
        (COUNT, with_(COUNT, messages=[{"role": "user", "content": s}]), ("messages", "content")),
        (COUNT, with_(COUNT, system=[{"type": "text", "text": s}]), ("system",)),
        (COUNT, with_(COUNT, tools=[{"name": "f", "description": s, "input_schema": {"type": "object"}}]),
         ("tools",)),
        (TOK, {"prompt": s}, ("prompt",)),
        (TOK, {"messages": [{"role": "user", "content": s}]}, ("messages",)),
        (TOK, {"messages": [{"role": "user", "content": [{"type": "text", "text": s}]}]}, ("messages",)),
        (DETOK, {"tokens": [1], "model": s}, ("model",)),
    ]


@SURROGATES
@pytest.mark.parametrize("path,body,names", [pytest.param(*c, id=f"{_ROUTE_ID[c[0]]}-{i}-{c[2][-1]}")
                                             for i, c in enumerate(_surrogate_cases())])
def test_lone_surrogate(server, path, body, names, sur):
    reject(server, path, content=raw(body, S=sur), names=names)


def test_valid_surrogate_pair_is_fine(server):
    r = send(server, CHAT, content=raw(with_(CHAT, messages=[{"role": "user", "content": "$S"}]),
                                       S='"\\ud83d\\ude00"'))
    assert r.status_code == 200, r.text


# ------------------------------------------------------------ 5. reserved template kwargs


@pytest.mark.parametrize("key,value", [
    ("add_generation_prompt", False), ("add_generation_prompt", True), ("tools", []), ("tools", None),
    ("messages", []), ("messages", None), ("continue_final_message", True),
])
def test_reserved_chat_template_kwarg(server, key, value):
    # The server sets these itself; a caller's copy must not be merged over them.
    reject(server, CHAT, with_(CHAT, chat_template_kwargs={key: value}), names=(key,))


# ------------------------------------------------------------ 6. hostile JSON schemas

SELF_REQUIRED = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
DEFS_REQUIRED = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                 "required": ["next"]}}, "$ref": "#/$defs/n"}
# Schemas no finite JSON value satisfies, or that reference what is not
# there: nothing can be generated, so the request is a 400 at arrival.
BROKEN = {
    "self_ref_required": SELF_REQUIRED,
    "defs_self_ref_required": DEFS_REQUIRED,
    "unknown_ref": {"$ref": "#/$defs/nope"},
    "unknown_ref_in_property": {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}},
                                "required": ["a"]},
    "remote_ref": {"$ref": "http://example.com/schema.json"},
}


def _schema_contexts():
    """(id, path, body builder) for every place a schema constrains generation."""

    def rf(path, stream=False):
        def build(schema):
            b = with_(path, max_tokens=4, response_format={"type": "json_schema", "json_schema": {
                "name": "x", "schema": schema}})
            return {**b, "stream": True} if stream else b
        return build

    def chat_tool(choice, stream=False):
        def build(params):
            b = with_(CHAT, max_tokens=4, tools=[{"type": "function", "function": {"name": "f", "parameters": params}}],
                      tool_choice=choice)
            return {**b, "stream": True} if stream else b
        return build

    def msg_tool(choice, stream=False):
        def build(params):
            b = with_(MSGS, max_tokens=4, tools=[{"name": "f", "input_schema": params}], tool_choice=choice)
            return {**b, "stream": True} if stream else b
        return build

    named = {"type": "function", "function": {"name": "f"}}
    return [
        ("chat-response_format", CHAT, rf(CHAT), ("response_format",)),
        ("chat-response_format-stream", CHAT, rf(CHAT, True), ("response_format",)),
        ("completions-response_format", CMPL, rf(CMPL), ("response_format",)),
        ("chat-tool_choice-required", CHAT, chat_tool("required"), ("tools",)),
        ("chat-tool_choice-named", CHAT, chat_tool(named), ("tools",)),
        ("chat-tool_choice-required-stream", CHAT, chat_tool("required", True), ("tools",)),
        ("messages-tool_choice-any", MSGS, msg_tool({"type": "any"}), ("tools", "input_schema")),
        ("messages-tool_choice-tool", MSGS, msg_tool({"type": "tool", "name": "f"}), ("tools", "input_schema")),
        ("messages-tool_choice-any-stream", MSGS, msg_tool({"type": "any"}, True), ("tools", "input_schema")),
    ]


SCHEMA_CONTEXTS = pytest.mark.parametrize("ctx", _schema_contexts(), ids=lambda c: c[0])


@pytest.mark.parametrize("schema", BROKEN.values(), ids=BROKEN.keys())
@SCHEMA_CONTEXTS
def test_broken_schema_is_400_at_arrival(server, ctx, schema):
    # Not a 200 (or a 200 stream) that fails at the first token: today these
    # compile, then the matcher errors during generation (a 500, or an error
    # event inside a 200 stream).
    _, path, build, names = ctx
    reject(server, path, build(schema), names=names)


# Schemas that compile and that llguidance can enforce (or that a correct
# server may refuse up front). Each comes with a check of a *finished* output;
# an output cut by max_tokens cannot be checked and only has to be a 200.
# Patterns follow JSON Schema's unanchored (search) semantics; the checks use
# equivalent regexes that cannot backtrack catastrophically here.
def _obj_chain(key):
    def ok(v):
        while isinstance(v, dict) and key in v:
            v = v[key]
        return isinstance(v, dict)
    return ok


ENFORCEABLE = {
    # {"$ref": "#"} constrains nothing: any JSON value validates. 400 or any JSON.
    "ref_root": ({"$ref": "#"}, lambda v: True, True),
    # Two $defs that only point at each other: also "anything". 400 or any JSON.
    "defs_mutual_refs": ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
                         lambda v: True, True),
    # Optional recursion (a linked list / tree) is an ordinary, supported schema:
    # it must be enforced, not refused.
    "self_ref_optional": ({"type": "object", "properties": {"a": {"$ref": "#"}}}, _obj_chain("a"), False),
    "defs_self_ref_optional": ({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}},
                                "$ref": "#/$defs/n"}, _obj_chain("next"), False),
    # Catastrophic for a backtracking engine, linear for llguidance's: enforce.
    "pattern_(a+)+$": ({"type": "string", "pattern": "(a+)+$"}, lambda v: isinstance(v, str) and v.endswith("a"),
                       False),
    "pattern_^(a|a)*b$": ({"type": "string", "pattern": "^(a|a)*b$"},
                          lambda v: isinstance(v, str) and re.fullmatch("a*b", v) is not None, False),
    # Huge counted repetition: may be refused up front; if accepted, it must
    # not fail midway (no output of a million 'a's fits the context, so a
    # finished output is never valid).
    "pattern_a{1000000}": ({"type": "string", "pattern": "a{1000000}"},
                           lambda v: isinstance(v, str) and "a" * 1_000_000 in v, True),
    "pattern_^(a{1000}){1000}$": ({"type": "string", "pattern": "^(a{1000}){1000}$"},
                                  lambda v: v == "a" * 1_000_000, True),
    "pattern_(a{1,1000}){1,1000}": ({"type": "string", "pattern": "(a{1,1000}){1,1000}"},
                                    lambda v: isinstance(v, str) and "a" in v, True),
}


def _as_tool_params(schema):
    """Tool parameters are an object: object schemas go in as they are (so "#"
    still means the schema itself), others as the required property x."""
    if schema.get("type") == "string":
        return {"type": "object", "properties": {"x": schema}, "required": ["x"]}, True
    return schema, False


@pytest.mark.parametrize("name", ENFORCEABLE)
@SCHEMA_CONTEXTS
def test_enforceable_schema(server, ctx, name):
    cid, path, build, names = ctx
    schema, valid, may_refuse = ENFORCEABLE[name]
    is_tool = "tool" in cid
    wrapped = False
    if is_tool:
        schema, wrapped = _as_tool_params(schema)
    body = {**build(schema), "max_tokens": 24, "temperature": 0}
    r = send(server, path, body)
    assert health(server) == 200, f"the engine died\n{_drain(server.proc).tail()}"
    if r.status_code == 400 and may_refuse:
        assert_error(r, path, 400, names)
        return
    want = "200 with output valid for the schema, or a 400 at arrival" if may_refuse else "200 (it is enforceable)"
    assert r.status_code == 200, f"{cid} {name}: expected {want}, got {r.status_code}: {r.text[:600]}"
    if body.get("stream"):
        _check_stream(r, path)
        return
    out = r.json()
    value, finished = _structured_output(out, path, is_tool)
    if not finished:
        return
    if wrapped:
        assert isinstance(value, dict) and "x" in value, value
        value = value["x"]
    assert valid(value), f"{cid} {name}: the finished output does not satisfy the schema: {value!r}"


def _check_stream(r, path):
    """A 200 stream ends normally, with no error event inside it."""
    text = r.text
    if path == CHAT:
        bad = re.search(r'^data: \{"error".*$', text, re.M)
        assert not bad, f"a 200 stream carried an error event: {bad.group(0)[:300]}"
        assert text.rstrip().endswith("data: [DONE]"), f"the stream did not end with [DONE]: {text[-300:]}"
    else:
        bad = re.search(r"^event: error\ndata: .*$", text, re.M)
        assert not bad, f"a 200 stream carried an error event: {bad.group(0)[:300]}"
        assert "event: message_stop" in text, f"the stream did not end with message_stop: {text[-300:]}"


def _structured_output(out, path, is_tool):
    """(the parsed structured value, whether generation finished on its own)."""
    if path == MSGS:
        finished = out["stop_reason"] in ("end_turn", "tool_use", "stop_sequence")
        if not finished:
            return None, False
        uses = [b for b in out["content"] if b["type"] == "tool_use"]
        assert uses, f"a forced tool call finished without a tool_use block: {out}"
        return uses[0]["input"], True
    choice = out["choices"][0]
    finished = choice["finish_reason"] in ("stop", "tool_calls")
    if not finished:
        return None, False
    if is_tool:
        calls = choice["message"].get("tool_calls") or []
        assert calls, f"a forced tool call finished without tool_calls: {out}"
        return json.loads(calls[0]["function"]["arguments"]), True
    text = choice["message"]["content"] if path == CHAT else choice["text"]
    try:
        return json.loads(text), True
    except ValueError:
        pytest.fail(f"the finished output is not JSON: {text!r}")


# ------------------------------------------------------------ 7. not an object, wrong types, bad framing


@pytest.mark.parametrize("content", [
    b"", b"  \n", b"null", b"[]", b"[1, 2]", b'"x"', b"1", b"true", b"NaN", b"{'a': 1}", b'{"a": ', b"\x00",
    b'{"a": 1} {"b": 2}', b'{"a": 1}]', b"\xff\xfe", b'{"prompt": "\xff\xfe"}', '{"prompt": "\u00e9"}'.encode("latin-1"),
], ids=["empty", "whitespace", "null", "empty-list", "list", "string", "number", "true", "NaN", "single-quotes",
        "truncated", "nul", "two-values", "trailing-bracket", "bare-ff-fe", "invalid-utf8-in-string", "latin-1"])
@pytest.mark.parametrize("path", POST_ROUTES)
def test_body_that_is_not_a_json_object(server, path, content):
    reject(server, path, content=content)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32"])
@pytest.mark.parametrize("path", POST_ROUTES)
def test_body_not_utf8(server, path, encoding):
    # A valid request, but not UTF-8 (RFC 8259 8.1); Python's json.loads(bytes) would guess the encoding.
    reject(server, path, content=json.dumps(OK[path]).encode(encoding))


WRONG_TYPES = [
    (CHAT, {"messages": {"role": "user", "content": "Hi"}}, ("messages",)),
    (CHAT, {"messages": "Hi"}, ("messages",)),
    (CHAT, {"messages": [["user", "Hi"]]}, ("messages",)),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, ("messages",)),
    (CHAT, {"messages": [{"role": "user", "content": {"text": "x"}}]}, ("messages",)),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, ("messages",)),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, ("messages",)),
    (CHAT, {"messages": [{"role": "user", "content": ["x"]}]}, ("messages",)),
    (CHAT, {"messages": [{"role": 5, "content": "x"}]}, ("role",)),
    (CHAT, with_(CHAT, max_tokens="2"), ("max_tokens",)),
    (CHAT, with_(CHAT, max_tokens=True), ("max_tokens",)),
    (CHAT, with_(CHAT, max_tokens=2.5), ("max_tokens",)),
    (CHAT, with_(CHAT, temperature="0.5"), ("temperature",)),
    (CHAT, with_(CHAT, stop={"a": 1}), ("stop",)),
    (CHAT, with_(CHAT, stop=[1]), ("stop",)),
    (CHAT, with_(CHAT, logit_bias=[1]), ("logit_bias",)),
    (CHAT, with_(CHAT, logit_bias={"5": "x"}), ("logit_bias",)),
    (CHAT, with_(CHAT, stop_token_ids=5), ("stop_token_ids",)),
    (CHAT, with_(CHAT, stop_token_ids=["5"]), ("stop_token_ids",)),
    (CHAT, with_(CHAT, tools={"type": "function"}), ("tools",)),
    (CHAT, with_(CHAT, tools=[5]), ("tools",)),
    (CHAT, with_(CHAT, tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]), ("tools",)),
    (CHAT, with_(CHAT, tool_choice=5), ("tool_choice",)),
    (CHAT, with_(CHAT, response_format="json"), ("response_format",)),
    (CHAT, with_(CHAT, response_format={"type": "json_schema", "json_schema": {"schema": []}}), ("response_format",)),
    (CHAT, with_(CHAT, chat_template_kwargs=[]), ("chat_template_kwargs",)),
    (CHAT, with_(CHAT, stream_options=True), ("stream_options",)),
    (CHAT, with_(CHAT, cache_salt=5), ("cache_salt",)),
    (CHAT, with_(CHAT, seed="1"), ("seed",)),
    (CHAT, with_(CHAT, messages=USER + [{"role": "assistant", "tool_calls": {"id": "x"}}]), ("messages",)),
    (CHAT, with_(CHAT, messages=USER + [{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": 5}}]}]), ("messages",)),
    (CHAT, with_(CHAT, messages=USER + [{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "{not json"}}]}]), ("messages",)),
    (CHAT, with_(CHAT, messages=USER + [{"role": "tool", "content": {"a": 1}}]), ("messages",)),
    (CMPL, {"prompt": 5}, ("prompt",)),
    (CMPL, {"prompt": {"a": 1}}, ("prompt",)),
    (CMPL, {"prompt": [1.5]}, ("prompt",)),
    (CMPL, {"prompt": [True]}, ("prompt",)),
    (CMPL, {"prompt": [["a"]]}, ("prompt",)),
    (CMPL, {"prompt": None}, ("prompt",)),
    (CMPL, with_(CMPL, echo="yes"), ("echo",)),
    (CMPL, with_(CMPL, logprobs=True), ("logprobs",)),
    (CMPL, with_(CMPL, response_format={"type": "json_schema", "json_schema": {"schema": 5}}), ("response_format",)),
    (MSGS, with_(MSGS, messages={"role": "user"}), ("messages",)),
    (MSGS, with_(MSGS, max_tokens="2"), ("max_tokens",)),
    (MSGS, with_(MSGS, model=5), ("model",)),
    (MSGS, {"max_tokens": 2, "messages": USER}, ("model",)),
    (MSGS, with_(MSGS, messages=[{"role": "user", "content": 5}]), ("messages",)),
    (MSGS, with_(MSGS, messages=[{"role": "user", "content": [5]}]), ("messages",)),
    (MSGS, with_(MSGS, messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]), ("messages",)),
    (MSGS, with_(MSGS, messages=[{"role": "user", "content": [{"type": 5}]}]), ("messages",)),
    (MSGS, with_(MSGS, system=5), ("system",)),
    (MSGS, with_(MSGS, system=[5]), ("system",)),
    (MSGS, with_(MSGS, system=[{"type": "text"}]), ("system",)),
    (MSGS, with_(MSGS, stop_sequences="x"), ("stop_sequences",)),
    (MSGS, with_(MSGS, tools=[{"name": "f", "input_schema": []}]), ("tools",)),
    (MSGS, with_(MSGS, tool_choice="any"), ("tool_choice",)),
    (MSGS, with_(MSGS, metadata=[]), ("metadata",)),
    (MSGS, with_(MSGS, thinking=True), ("thinking",)),
    (MSGS, with_(MSGS, messages=USER + [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": [1]}]}]), ("messages",)),
    (MSGS, with_(MSGS, messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": {"a": 1}}]}]), ("messages",)),
    (MSGS, with_(MSGS, messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [5]}]}]), ("messages",)),
    (COUNT, with_(COUNT, messages="Hi"), ("messages",)),
    (COUNT, {"model": "m"}, ("messages",)),
    (COUNT, with_(COUNT, system={"a": 1}), ("system",)),
    (TOK, {"prompt": 5}, ("prompt",)),
    (TOK, {"prompt": ["x"]}, ("prompt",)),
    (TOK, {"messages": "Hi"}, ("messages",)),
    (TOK, {}, ("prompt", "messages")),
    (TOK, {"prompt": "x", "messages": USER}, ("prompt", "messages")),
    (TOK, {"prompt": "x", "add_special_tokens": "no"}, ("add_special_tokens",)),
    (DETOK, {"tokens": "1,2"}, ("tokens",)),
    (DETOK, {"tokens": [1.5]}, ("tokens",)),
    (DETOK, {"tokens": [[1]]}, ("tokens",)),
    (DETOK, {"tokens": [True]}, ("tokens",)),
    (DETOK, {"tokens": {"0": 1}}, ("tokens",)),
    (DETOK, {"tokens": None}, ("tokens",)),
    (DETOK, {}, ("tokens",)),
]


@pytest.mark.parametrize("path,body,names", [pytest.param(*c, id=f"{_ROUTE_ID[c[0]]}-{i}-{c[2][0]}")
                                             for i, c in enumerate(WRONG_TYPES)])
def test_wrong_type(server, path, body, names):
    reject(server, path, body, names=names)


@pytest.mark.parametrize("headers", [
    {"content-type": "text/plain"}, {"content-type": ""}, {"content-type": "application/json, text/html"},
    [("content-type", "application/json"), ("content-type", "text/html")],
    {"content-type": "application/json; charset=latin-1"}, {"content-type": "multipart/form-data; boundary=x"},
], ids=["text-plain", "empty", "two-in-one", "duplicate-header", "charset-latin-1", "multipart"])
@pytest.mark.parametrize("path", POST_ROUTES)
def test_content_type_oddities(server, path, headers):
    # The body is read as JSON whatever the content-type says (curl -d sends
    # x-www-form-urlencoded), so a valid body may succeed; what is refused is
    # refused in the route's shape, and nothing is a 500.
    r = send(server, path, OK[path], headers=headers)
    assert health(server) == 200
    if r.status_code != 200:
        assert_error(r, path, r.status_code)
        assert 400 <= r.status_code < 500, r.text


def _raw_http(srv, path: str, head: bytes, body: bytes) -> tuple[int, bytes, bytes]:
    """One request over a raw socket (httpx refuses to send a broken Content-Length)."""
    host, port = srv.url.rsplit("//", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
        s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                  + b"Authorization: Bearer " + srv.api_key.encode() + b"\r\n"
                  + b"Content-Type: application/json\r\n" + head + b"\r\n" + body)
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except socket.timeout:
            pytest.fail(f"{path}: no answer within {TIMEOUT}s (hang): {data[:300]!r}")
    status_line, _, rest = data.partition(b"\r\n")
    headers, _, payload = rest.partition(b"\r\n\r\n")
    return int(status_line.split()[1]), headers, payload


class _Raw:
    def __init__(self, status, headers, payload):
        self.status_code = status
        self._headers = {k.strip().lower(): v.strip() for k, _, v in
                         (line.decode("latin-1").partition(":") for line in headers.split(b"\r\n"))}
        self.text = payload.decode("utf-8", "replace")

    @property
    def headers(self):
        return self._headers

    def json(self):
        return json.loads(self.text)


@pytest.mark.parametrize("value", [b"abc", b"-5", b"1e3", b"+60", b"99999999999999999999999", b"12, 5", b""],
                         ids=["letters", "negative", "exponent", "plus", "huge", "list", "empty"])
@pytest.mark.parametrize("path", [CHAT, MSGS, TOK])
def test_invalid_content_length(server, path, value):
    # Rejected by the HTTP layer before any route runs: still a 400, and in the route's shape.
    body = json.dumps(OK[path]).encode()
    status, headers, payload = _raw_http(server, path, b"Content-Length: " + value + b"\r\n", body)
    assert health(server) == 200
    assert_error(_Raw(status, headers, payload), path, 400)


@pytest.mark.parametrize("path", [CHAT, MSGS])
def test_conflicting_content_lengths(server, path):
    body = json.dumps(OK[path]).encode()
    status, headers, payload = _raw_http(
        server, path, b"Content-Length: %d\r\nContent-Length: 5\r\n" % len(body), body)
    assert health(server) == 200
    assert_error(_Raw(status, headers, payload), path, 400)


@pytest.mark.parametrize("path", [CHAT, MSGS])
def test_content_length_shorter_than_body(server, path):
    body = json.dumps(OK[path]).encode()
    status, headers, payload = _raw_http(server, path, b"Content-Length: 10\r\n", body)
    assert health(server) == 200
    assert_error(_Raw(status, headers, payload), path, 400)


# ------------------------------------------------------------ 8. oversized bodies


@pytest.mark.parametrize("path", POST_ROUTES)
def test_body_over_the_cap_is_413(server, path):
    big = with_(path, padding="x" * (1 << 20))
    reject(server, path, big, status=413)


@pytest.mark.parametrize("path", POST_ROUTES)
def test_chunked_body_over_the_cap_is_413(server, path):
    def chunks():  # no content-length: the cap is counted while reading
        yield b'{"padding": "'
        for _ in range(20):
            yield b"y" * 65536
        yield b'"}'
    try:
        r = httpx.post(server.url + path, content=chunks(), timeout=TIMEOUT,
                       headers={**server.headers, "content-type": "application/json"})
    except httpx.TimeoutException:
        pytest.fail(f"{path}: no answer within {TIMEOUT}s")
    assert health(server) == 200
    assert_error(r, path, 413)


def test_get_with_oversized_body_is_413(server):
    reject(server, "/v1/models", content=b"x" * ((1 << 20) + 10), status=413, method="GET")


# ------------------------------------------------------------ /v1/models


@pytest.mark.parametrize("model_id", ["nope", "%ED%A0%80", "%FF", "%00", "a" * 8000, "..%2F..%2Fetc"],
                         ids=["unknown", "surrogate-bytes", "ff", "nul", "long", "traversal"])
def test_unknown_model_id_is_404(server, model_id):
    reject(server, "/v1/models/" + model_id, method="GET", status=404)


def test_models_ignores_a_junk_body_and_query(server):
    r = send(server, "/v1/models?x=%FF%00&&=", content=b"\xff{[", method="GET")
    assert r.status_code == 200 and r.json()["object"] == "list", r.text


# ------------------------------------------------------------ after everything (keep last)


def test_zz_every_route_still_serves(server):
    """After the whole malformed suite: the engine is alive and every route answers a normal request."""
    assert health(server) == 200, _drain(server.proc).tail()
    for path in POST_ROUTES:
        r = send(server, path, OK[path])
        assert r.status_code == 200, f"{path}: {r.status_code} {r.text[:300]}"
    assert send(server, CHAT, with_(CHAT, stream=True)).text.rstrip().endswith("data: [DONE]")
    assert "event: message_stop" in send(server, MSGS, with_(MSGS, stream=True)).text
    r = send(server, "/v1/models", method="GET")
    assert r.status_code == 200
    model = r.json()["data"][0]["id"]
    assert send(server, f"/v1/models/{model}", method="GET").status_code == 200
    assert health(server) == 200


# ------------------------------------------------------------ JSON inside strings, and other fuzzed 500s
# (a schemathesis run and hand probes, session 39): each was a 500.

ARGS_CALL = {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "$A"}}]}
RESPONSES = "/v1/responses"


def _json_in_strings():
    """Fields that hold JSON as a string: tool-call arguments (chat and
    Responses) and vLLM's guided_json / structured_outputs.json."""
    def text(inner: str) -> str:
        return json.dumps(inner)  # the raw JSON text of a string holding ``inner``

    inners = {"deep": "[" * 2000 + "]" * 2000, "bigint": "[" + "9" * 5000 + "]",
              "surrogate": '{"a": "\\ud800"}', "inf": "[1e400]"}
    for name, inner in inners.items():
        if name != "inf":  # a past call's arguments: what the model wrote (test_a_past_calls_..._are_taken)
            yield pytest.param(CHAT, raw(with_(CHAT, messages=[*USER, ARGS_CALL, {"role": "tool", "tool_call_id": "c1",
                                                                                  "content": "ok"}]), A=text(inner)),
                               "messages", id=f"chat-arguments-{name}")
        yield pytest.param(CHAT, raw(with_(CHAT, guided_json="$A"), A=text(inner)), "guided_json",
                           id=f"chat-guided_json-{name}")
        yield pytest.param(CMPL, raw(with_(CMPL, structured_outputs={"json": "$A"}), A=text(inner)),
                           "structured_outputs.json", id=f"completions-structured_outputs-{name}")
        if name != "inf":
            yield pytest.param(RESPONSES, _responses_call(text(inner)), "input", id=f"responses-arguments-{name}")


def _responses_call(arguments_text: str) -> bytes:
    return raw({"max_output_tokens": 16, "input": [
        {"type": "message", "role": "user", "content": "Hi"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "$A"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}, A=arguments_text)


@pytest.mark.parametrize("number", ["1e400", "-1e400", "NaN", "Infinity"])
def test_a_past_calls_arguments_beyond_floats_are_taken(server, number):
    """A past call's arguments are what a model wrote, sent back: a number
    JSON cannot carry reads as null (as the server's own answers write it),
    not a 400 for the server's own output. The same prompt as with null."""
    def both(args: str) -> list:
        chat = raw(with_(CHAT, messages=[*USER, ARGS_CALL, {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
                         max_tokens=1), A=json.dumps(args))
        return [send(server, CHAT, content=chat), send(server, RESPONSES, content=_responses_call(json.dumps(args)))]

    got, want = both('{"x": [1, %s]}' % number), both('{"x": [1, null]}')
    for g, w, key in zip(got, want, ("prompt_tokens", "input_tokens")):
        assert g.status_code == 200, g.text
        assert g.json()["usage"][key] == w.json()["usage"][key]


@pytest.mark.parametrize("path,content,param", list(_json_in_strings()))
def test_json_inside_a_string_field_is_checked_like_the_body(server, path, content, param):
    """Depth, 64-bit integers, valid Unicode and finite numbers hold for JSON
    a string field carries, as for the body: a 400 naming the field."""
    r = send(server, path, content=content)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert health(server) == 200


@pytest.mark.parametrize("path,body", [
    (CHAT, with_(CHAT, tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "$defs": [1]}}}], tool_choice="required")),
    (MSGS, with_(MSGS, tools=[{"name": "f", "input_schema": {"type": "object", "definitions": 5}}],
                 tool_choice={"type": "any"})),
], ids=["chat-$defs", "messages-definitions"])
def test_a_tool_schema_whose_definitions_are_not_an_object(server, path, body):
    reject(server, path, body, names=("tools",))


@pytest.mark.parametrize("text", [5, [1], {"a": 1}, True])
@pytest.mark.parametrize("path", [MSGS, COUNT])
def test_an_anthropic_prefill_whose_text_is_not_a_string(server, path, text):
    body = with_(path, messages=[*USER, {"role": "assistant", "content": [{"type": "text", "text": text}]}])
    r = send(server, path, body)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert health(server) == 200


@pytest.mark.parametrize("key", ["template", "self"])
@pytest.mark.parametrize("path", [CHAT, TOK])
def test_template_variables_named_like_the_renderers_parameters(server, path, key):
    """Template variables are passed as one mapping: any name is a variable
    (``template`` and ``self`` collided with the renderer's parameters)."""
    body = with_(path, messages=USER, chat_template_kwargs={key: "x"})
    body.pop("prompt", None)
    r = send(server, path, body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("number", ["1e400", "-1e400"])
def test_a_number_beyond_floats_is_refused(server, number):
    """1e400 parses to infinity: refused like Infinity, not taken as a
    schema's ``const`` (the output was forced to null)."""
    content = raw(with_(CHAT, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"const": "$N"}}}), N=number)
    err = reject(server, CHAT, content=content, names=("response_format",))
    assert "finite" in err["message"]


def test_an_error_quotes_the_request_within_bounds(server):
    """A 1 MB model name or previous_response_id came back whole in the 404."""
    huge = "m" * 500_000
    for r in (send(server, RESPONSES, {"input": "Hi", "max_output_tokens": 4, "previous_response_id": huge}),
              send(server, "/v1/models/" + "m" * 20_000, method="GET")):
        assert r.status_code == 404 and len(r.content) < 4000, (r.status_code, len(r.content))
        assert "more characters" in r.json()["error"]["message"]


def test_count_tokens_refuses_what_messages_refuses(server):
    """A forced tool whose schema cannot be enforced: /v1/messages is a 400,
    and count_tokens said 200 with a count (it never compiled the grammar)."""
    tools = [{"name": "f", "input_schema": SELF_REQUIRED}]
    for path in (MSGS, COUNT):
        reject(server, path, with_(path, tools=tools, tool_choice={"type": "any"}), names=("tools", "schema"))
    ok = send(server, COUNT, with_(COUNT, tools=[{"name": "f", "input_schema": {"type": "object"}}],
                                   tool_choice={"type": "any"}))
    assert ok.status_code == 200 and ok.json()["input_tokens"] > 0
