"""The chat page at ``/`` in a real browser (headless Debian chromium through
selenium) against the real server: streaming, history, stop, the API key; and
against an in-test server whose replies are hostile, to check that nothing a
model writes runs as script.

Selenium gets the system chromedriver's path (Selenium Manager never runs, so
it downloads nothing) and ``SE_AVOID_STATS=true``; chromium runs with its
background services off and a dead proxy for every non-loopback address, so
the only traffic is to the loopback servers here.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import httpx
import pytest
from fastapi import Request  # (at module level: the fake API's route annotation is resolved here)

from conftest import API_KEY, free_port, start_server, wait_healthy

os.environ["SE_AVOID_STATS"] = "true"  # before selenium is imported

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
DRIVER_PATHS = ("chromedriver", "/usr/lib/chromium/chromedriver", "/usr/bin/chromedriver")
TIMEOUT = 60


def _find(names) -> str | None:
    for n in names:
        p = shutil.which(n) if not n.startswith("/") else (n if os.access(n, os.X_OK) else None)
        if p:
            return p
    return None


# ------------------------------------------------------------------ servers


class _Drain:
    """Collects a server's stdout/stderr lines (a full pipe would block it)."""

    def __init__(self, proc):
        self.lines: deque[str] = deque(maxlen=500)
        for stream in (proc.stdout, proc.stderr):
            threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream):
        try:
            for line in stream:
                self.lines.append(line.rstrip("\n"))
        except (OSError, ValueError):
            pass

    def wait_for(self, needle: str, timeout: float = 30) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for line in list(self.lines):
                if needle in line:
                    return line
            time.sleep(0.05)
        raise AssertionError(f"no line with {needle!r} in the server's output:\n" + "\n".join(self.lines))


class _Proc:
    def __init__(self, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = start_server(self.port, *args)
        self.out = _Drain(self.proc)
        wait_healthy(self.url, self.proc)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except Exception:
                self.proc.kill()


@pytest.fixture(scope="module")
def web_server():
    """The real server with an API key, as a user starts it."""
    srv = _Proc("--api-key", API_KEY, "--max-tokens", "16", "--max-model-len", "1024")
    yield srv
    srv.stop()


def _api(srv, method: str, path: str, **kw):
    r = httpx.request(method, srv.url + path, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=TIMEOUT, **kw)
    r.raise_for_status()
    return r.json()


# ------------------------------------------------------------------ browser


@pytest.fixture(scope="module")
def driver():
    browser, chromedriver = _find(CHROMIUM_NAMES), _find(DRIVER_PATHS)
    if browser is None or chromedriver is None:
        # Where apt-get exists, `make install-test` installs them: their absence
        # is a broken setup, not a reason to pass. Elsewhere (macOS) the browser
        # cannot be installed by the test setup.
        if shutil.which("apt-get"):
            pytest.fail("chromium and chromedriver are missing although apt-get is here: run "
                        "`make install-test` (it installs Debian's chromium and chromium-driver)")
        pytest.skip("no apt-get to install chromium and chromedriver with (the browser test needs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="mlxfast-webui-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              f"--user-data-dir={profile}", "--window-size=1200,900", "--no-first-run",
              "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
              "--disable-component-update", "--disable-sync", "--disable-default-apps", "--no-pings",
              "--disable-domain-reliability", "--disable-client-side-phishing-detection",
              "--disable-features=Translate,OptimizationHints,MediaRouter,AutofillServerCommunication",
              # Nothing leaves the machine: non-loopback hosts resolve nowhere, and go to a dead proxy.
              "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1",
              "--proxy-server=http://127.0.0.1:9"):
        opts.add_argument(a)
    service = Service(executable_path=chromedriver)  # the system driver: Selenium Manager is never run
    d = webdriver.Chrome(service=service, options=opts)
    d.set_script_timeout(TIMEOUT)
    yield d
    d.quit()
    shutil.rmtree(profile, ignore_errors=True)


def _wait(d, cond, what: str, timeout: float = TIMEOUT):
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(d, timeout, poll_frequency=0.02).until(lambda _: cond())
    except Exception:
        logs = d.execute_script("return document.body ? document.body.outerHTML.slice(0, 3000) : ''")
        raise AssertionError(f"timed out waiting for {what}; page:\n{logs}") from None


def _busy(d) -> bool:
    return d.execute_script("return document.body.dataset.busy") == "true"


def _assistants(d):
    return d.find_elements("css selector", '[data-role="assistant"]')


def _set(d, element_id: str, value: str):
    d.execute_script("const e = document.getElementById(arguments[0]); e.value = arguments[1];"
                     "e.dispatchEvent(new Event('change'));", element_id, value)


def _open_with_key(d, srv):
    d.get(srv.url + "/")
    key_form = d.find_element("id", "key-form")
    _wait(d, key_form.is_displayed, "the page to ask for the API key")
    d.find_element("id", "api-key").send_keys(API_KEY)
    d.find_element("id", "key-submit").click()
    _wait(d, lambda: d.execute_script("return document.body.dataset.ready") == "true", "the models to load")
    assert not key_form.is_displayed()


# A recorder of the assistant's text while the page is busy: one entry per DOM change.
RECORD = """
window.__seen = [];
const note = () => {
  const a = document.querySelectorAll('[data-role="assistant"]');
  const last = a[a.length - 1];
  const body = last && last.querySelector(".content");
  window.__seen.push([document.body.dataset.busy, body ? body.textContent : null]);
};
new MutationObserver(note).observe(document.body, {subtree: true, childList: true, characterData: true,
                                                   attributes: true, attributeFilter: ["data-busy"]});
"""


def _ask(d, text: str):
    box = d.find_element("id", "input")
    box.clear()
    box.send_keys(text)
    from selenium.webdriver.common.keys import Keys

    box.send_keys(Keys.ENTER)


def _stats(srv) -> dict:
    return _api(srv, "GET", "/stats")


# ------------------------------------------------------------------ the page itself (no browser)


def test_page_is_static_public_and_locked_down(web_server):
    r = httpx.get(web_server.url + "/", timeout=TIMEOUT)  # no key: the page is public, the API is not
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
    assert directives["default-src"] == "'none'"
    assert directives["script-src"] == "'self'" and directives["connect-src"] == "'self'"
    assert "unsafe" not in csp and "http" not in csp and "*" not in csp
    assert directives["frame-ancestors"] == "'none'" and r.headers["x-frame-options"] == "DENY"  # no clickjacking
    html = r.text
    # No inline script or handler, nothing from another origin: the page works offline.
    scripts = re.findall(r"<script\b([^>]*)>(.*?)</script>", html, re.S)
    assert scripts and all('src="' in attrs and not body.strip() for attrs, body in scripts)
    assert not re.search(r"\son\w+\s*=", html) and not re.search(r"(src|href)=\"(https?:)?//", html)
    for name, kind in (("app.js", "text/javascript"), ("markdown.js", "text/javascript"), ("style.css", "text/css")):
        f = httpx.get(f"{web_server.url}/webui/{name}", timeout=TIMEOUT)
        assert f.status_code == 200 and f.headers["content-type"].startswith(kind)
        assert f.headers["content-security-policy"] == csp and f.headers["x-content-type-options"] == "nosniff"
        # Nothing loaded from elsewhere: no imports, CSS urls, or absolute fetches.
        assert not re.search(r"@import|url\(|\bimport\s*\(|importScripts|new Worker", f.text)
        assert all("//" not in u for u in re.findall(r"fetch\(\s*[\"'`]([^\"'`]*)", f.text))
    assert re.findall(r"fetch\(\s*\"([^\"]*)", httpx.get(web_server.url + "/webui/app.js").text) == \
        ["v1/models", "v1/chat/completions"]
    assert httpx.get(web_server.url + "/webui/serve.py", timeout=TIMEOUT).status_code == 404
    assert httpx.get(web_server.url + "/webui/..%2Fapp.py", timeout=TIMEOUT).status_code == 404
    assert httpx.get(web_server.url + "/v1/models", timeout=TIMEOUT).status_code == 401
    # The ready line names the page.
    line = web_server.out.wait_for("ready on")
    assert line.endswith(f"chat page: {web_server.url}/"), line


def test_no_webui_turns_the_page_off_only():
    srv = _Proc("--no-webui", "--max-tokens", "4")
    try:
        for path in ("/", "/webui/app.js"):
            r = httpx.get(srv.url + path, timeout=TIMEOUT)
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert httpx.get(srv.url + "/v1/models", timeout=TIMEOUT).status_code == 200
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=TIMEOUT,
                       json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert "chat page" not in srv.out.wait_for("ready on")
    finally:
        srv.stop()


def test_packaged_files_are_package_data():
    """The files are found through importlib.resources, and scikit-build-core's
    wheel file list (every file under wheel.packages) carries them."""
    from scikit_build_core.build._pathutil import iter_package_files

    from mlxfast.server import webui

    for name in webui.FILES:
        assert webui.read(name)
    root = Path(webui.__file__).resolve().parents[3]  # python/mlxfast/server/webui -> python
    shipped = {str(t) for _, t in iter_package_files(
        packages={"mlxfast": str(root / "mlxfast")}, include=[], src_exclude=[], target_exclude=[],
        build_dir="build", mode="default")}
    for name in webui.FILES:
        assert f"mlxfast/server/webui/{name}" in shipped


# ------------------------------------------------------------------ the real server in a browser


def test_chat_streams_and_keeps_history(driver, web_server):
    d = driver
    _open_with_key(d, web_server)
    assert d.find_element("id", "model").get_attribute("value") == "SmolLM2-135M-Instruct"
    _set(d, "temperature", "0")
    _set(d, "top-p", "1")
    _set(d, "max-tokens", "16")
    _set(d, "system", "")

    # Shift+Enter is a new line; it sends nothing.
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    box = d.find_element("id", "input")
    box.click()
    box.send_keys("What is the capital of France?")
    ActionChains(d).key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(Keys.SHIFT).perform()
    box.send_keys("Answer in one sentence.")
    q1 = box.get_attribute("value")
    assert q1 == "What is the capital of France?\nAnswer in one sentence."
    assert not _assistants(d) and not _busy(d)

    d.execute_script(RECORD)
    st0 = _stats(web_server)["metrics"]
    box.send_keys(Keys.ENTER)
    _wait(d, lambda: len(_assistants(d)) == 1 and not _busy(d)
          and _assistants(d)[0].get_attribute("data-done") == "true", "the first answer")
    seen = d.execute_script("return window.__seen")
    partial = list(dict.fromkeys(t for busy, t in seen if busy == "true" and t))  # distinct, in order
    final = _assistants(d)[0].find_element("css selector", ".content").get_attribute("textContent")
    # Streamed: part of the answer was on the page while the reply was still
    # coming (texts that grow, the first short of the whole; the whole may show
    # before the busy flag drops). How many distinct texts the recorder catches
    # depends on how chunks batch into the browser's tasks on a loaded machine,
    # so one partial one is enough.
    assert final and partial and len(partial[0]) < len(final), f"the answer did not stream: {seen}"
    assert all(len(a) < len(b) for a, b in zip(partial, partial[1:])), partial
    assert d.find_element("id", "input").get_attribute("value") == ""
    assert d.find_elements("css selector", '[data-role="user"]')[0].text == q1
    usage = d.find_element("id", "usage")
    st1 = _stats(web_server)["metrics"]
    n1 = int(usage.get_attribute("data-completion-tokens"))
    assert 1 <= n1 <= 16 and n1 == st1["generation_tokens_total"] - st0["generation_tokens_total"]
    assert "tok/s" in usage.text and "cached" in usage.text

    # The first answer, independently: the same request, greedy.
    a1 = _api(web_server, "POST", "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": q1}], "temperature": 0, "top_p": 1, "max_tokens": 16,
    })["choices"][0]["message"]["content"]
    p1 = _api(web_server, "GET", "/stats")["metrics"]["prompt_tokens_total"]
    assert p1 - st0["prompt_tokens_total"] == 2 * int(usage.get_attribute("data-prompt-tokens"))  # the page's, ours

    q2 = "And of Italy?"
    _ask(d, q2)
    _wait(d, lambda: len(_assistants(d)) == 2 and not _busy(d)
          and _assistants(d)[1].get_attribute("data-done") == "true", "the second answer")
    received = _stats(web_server)["metrics"]["prompt_tokens_total"] - p1  # the prompt the server got
    full = _api(web_server, "POST", "/tokenize", json={"messages": [
        {"role": "user", "content": q1}, {"role": "assistant", "content": a1}, {"role": "user", "content": q2}]})
    alone = _api(web_server, "POST", "/tokenize", json={"messages": [{"role": "user", "content": q2}]})
    assert received == full["count"] > alone["count"], (received, full["count"], alone["count"])
    assert int(usage.get_attribute("data-prompt-tokens")) == received
    assert int(usage.get_attribute("data-cached-tokens")) > 0  # the first turn's blocks were reused

    # A system prompt from the panel goes first.
    d.find_element("id", "new-chat").click()
    assert not _assistants(d)
    _set(d, "system", "You are terse.")
    p2 = _stats(web_server)["metrics"]["prompt_tokens_total"]
    _ask(d, q2)
    _wait(d, lambda: len(_assistants(d)) == 1 and _assistants(d)[0].get_attribute("data-done") == "true"
          and not _busy(d), "the answer after a new chat")
    with_system = _api(web_server, "POST", "/tokenize", json={"messages": [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": q2}]})
    assert _stats(web_server)["metrics"]["prompt_tokens_total"] - p2 == with_system["count"]
    _set(d, "system", "")


def test_stop_aborts_the_request(driver, web_server):
    d = driver
    if d.execute_script("return document.body.dataset.ready") != "true" or not d.current_url.startswith(web_server.url):
        _open_with_key(d, web_server)
    d.find_element("id", "new-chat").click()
    _set(d, "temperature", "0")
    _set(d, "max-tokens", "900")
    st0 = _stats(web_server)
    s0, s0_engine = st0["metrics"], st0["engine"]
    aborted0 = s0["request_success_total"].get("abort", 0)
    _ask(d, "Write a very long story about a dragon who learns to fly, with many chapters.")
    _wait(d, lambda: _busy(d) and len(_assistants(d)) == 1 and _assistants(d)[0].text.strip(),
          "the answer to start streaming")
    d.find_element("id", "stop").click()
    _wait(d, lambda: not _busy(d), "the page to stop")
    msg = _assistants(d)[0]
    assert "Stopped." in msg.text

    deadline = time.time() + 20
    while time.time() < deadline:
        st = _stats(web_server)
        if st["metrics"]["request_success_total"].get("abort", 0) == aborted0 + 1:
            break
        time.sleep(0.1)
    s1 = st["metrics"]
    assert s1["request_success_total"].get("abort", 0) == aborted0 + 1, s1
    assert sum(s1["request_success_total"].values()) == sum(s0["request_success_total"].values()) + 1
    # Nothing left running, and every KV block free again (cached blocks are free to reuse).
    deadline = time.time() + 10
    while time.time() < deadline and (st["engine"]["num_requests_running"]
                                      or st["engine"]["free_blocks"] != st["engine"]["total_blocks"]):
        time.sleep(0.1)
        st = _stats(web_server)
    e = st["engine"]
    assert e["num_requests_running"] == 0 and e["num_requests_waiting"] == 0, e
    assert e["free_blocks"] == e["total_blocks"], e
    assert st["metrics"]["num_requests_running"] == 0 and st["metrics"]["num_requests_waiting"] == 0
    # It was stopped early: far fewer tokens than the 900 asked for.
    assert e["generation_tokens_total"] - s0_engine["generation_tokens_total"] < 300

    # The stopped turn stays in the history; the page is usable again.
    _set(d, "max-tokens", "4")
    _ask(d, "Thanks.")
    _wait(d, lambda: len(_assistants(d)) == 2 and _assistants(d)[1].get_attribute("data-done") == "true"
          and not _busy(d), "an answer after the stop")
    assert int(d.find_element("id", "usage").get_attribute("data-completion-tokens")) <= 4


# ------------------------------------------------------------------ hostile replies


HOSTILE_REASONING = ["I will <img src=x onerr", "or=\"window.__pwned='reasoning'\"> think."]
HOSTILE = [
    "Here is **bold**, `inline <b>code</b>` and a [link](https://example.invalid/a).\n",
    "<scr", "ipt>window.__pwned='script'</script>\n",
    "<img src=x onerror=\"window.__pwned='img'\">\n",
    "[click](javascript:window.__pwned='link') <a href=\"javascript:window.__pwned='a'\">a</a>\n",
    "<svg onload=\"window.__pwned='svg'\"></svg> <iframe srcdoc=\"<script>parent.__pwned='frame'</script>\">\n",
    "```html\n</code></pre><script>window.__pwned='code'</script>\n```\n",
    "- item <b onmouseover=\"window.__pwned='b'\">one</b>\n- item two\n",
]


class _FakeAPI:
    """An OpenAI-style server in this process (loopback), serving the packaged
    page and streaming the hostile reply above: the page's code is what is
    under test here."""

    def __init__(self):
        from fastapi import FastAPI
        from fastapi.responses import StreamingResponse

        from mlxfast.server import webui

        app = FastAPI()
        app.include_router(webui.router)
        self.requests: list[dict] = []

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "hostile", "object": "model"}]}

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.requests.append({"body": body, "auth": request.headers.get("authorization")})

            def chunk(delta, finish=None):
                return "data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"

            async def events():
                yield chunk({"role": "assistant", "content": ""})
                for r in HOSTILE_REASONING:
                    await asyncio.sleep(0.01)
                    yield chunk({"reasoning_content": r})
                for c in HOSTILE:
                    await asyncio.sleep(0.01)
                    yield chunk({"content": c})
                yield chunk({}, "stop")
                yield "data: " + json.dumps({"choices": [], "usage": {
                    "prompt_tokens": 11, "completion_tokens": 22, "total_tokens": 33,
                    "prompt_tokens_details": {"cached_tokens": 5}}}) + "\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started and time.time() < deadline:
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def hostile_api():
    api = _FakeAPI()
    yield api
    api.stop()


def test_hostile_reply_is_shown_as_text(driver, hostile_api):
    d = driver
    d.get(hostile_api.url + "/")
    _wait(d, lambda: d.execute_script("return document.body.dataset.ready") == "true", "the page to load")
    assert not d.find_element("id", "key-form").is_displayed()  # no key asked where none is needed
    _set(d, "temperature", "0.5")
    _set(d, "max-tokens", "64")
    _ask(d, "Say something nasty.")
    _wait(d, lambda: len(_assistants(d)) == 1 and _assistants(d)[0].get_attribute("data-done") == "true"
          and not _busy(d), "the hostile answer")
    time.sleep(0.3)  # an onerror / onload would have fired by now
    assert d.execute_script("return window.__pwned") is None
    assert d.execute_script("return window.parent.__pwned") is None

    msg = _assistants(d)[0]
    # Nothing the model wrote became an element that could run or load anything.
    assert d.execute_script("return document.scripts.length") == 2  # markdown.js and app.js
    assert not msg.find_elements("css selector", "script, img, svg, iframe, b, object, embed, style")
    for tag, attrs in d.execute_script(
            "return [...arguments[0].querySelectorAll('*')].map(e => [e.tagName, [...e.attributes].map(a => a.name)])",
            msg):
        assert not any(a.startswith("on") or a in ("src", "srcdoc", "style") for a in attrs), (tag, attrs)
    hrefs = [a.get_attribute("href") for a in msg.find_elements("css selector", "a")]
    assert hrefs == ["https://example.invalid/a"]  # javascript: links are text

    # ... and it is all there, as the characters the model wrote.
    text = msg.get_attribute("textContent")
    for literal in ("<script>window.__pwned='script'</script>", "<img src=x onerror=\"window.__pwned='img'\">",
                    "[click](javascript:window.__pwned='link')", "<svg onload=", "<iframe srcdoc=",
                    "</code></pre><script>window.__pwned='code'</script>", "<b onmouseover="):
        assert literal in text, literal
    # Markdown still renders around it.
    assert msg.find_element("css selector", ".content strong").text == "bold"
    assert msg.find_element("css selector", ".content p code").get_attribute("textContent") == "inline <b>code</b>"
    block = msg.find_element("css selector", "pre code")
    assert block.get_attribute("textContent") == "</code></pre><script>window.__pwned='code'</script>"
    assert block.get_attribute("data-lang") == "html"
    assert len(msg.find_elements("css selector", "ul > li")) == 2
    # The reasoning is folded, and text too.
    reasoning = msg.find_element("css selector", "details.reasoning")
    assert reasoning.get_attribute("open") is None
    thoughts = reasoning.find_element("css selector", ".reasoning-text").get_attribute("textContent")
    assert thoughts == "".join(HOSTILE_REASONING)
    assert d.find_element("id", "usage").text.startswith("22 tokens · prompt 11 (5 cached)")

    # What the page sent: the settings, streamed, with usage.
    body = hostile_api.requests[-1]["body"]
    assert body["model"] == "hostile" and body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.5 and body["max_tokens"] == 64 and body["top_p"] == 1
    assert body["messages"] == [{"role": "user", "content": "Say something nasty."}]
    assert hostile_api.requests[-1]["auth"] is None


MARKDOWN_CASES = [
    ("# Title\n\ntext", "<h1>Title</h1><p>text</p>"),
    ("a\nb", "<p>a<br>b</p>"),
    ("**b** *i* _e_ ~~s~~ snake_case_name", "<p><strong>b</strong> <em>i</em> <em>e</em> <del>s</del> snake_case_name</p>"),
    ("1. one\n2. two", "<ol><li>one</li><li>two</li></ol>"),
    ("- a\n  - b\n- c", "<ul><li><p>a</p><ul><li>b</li></ul></li><li>c</li></ul>"),
    ("> quoted", "<blockquote><p>quoted</p></blockquote>"),
    ("| a | b |\n|---|--:|\n| 1 | 2 |",
     '<div class="table-wrap"><table><thead><tr><th>a</th><th style="text-align: right;">b</th></tr></thead>'
     '<tbody><tr><td>1</td><td style="text-align: right;">2</td></tr></tbody></table></div>'),
    ("---", "<hr>"),
    ("## Closing hashes ##", "<h2>Closing hashes</h2>"),
    ("# C#", "<h1>C#</h1>"),
    ("#nospace", "<p>#nospace</p>"),
    ("\\*not em\\*", "<p>*not em*</p>"),
    ("<b>x</b> &amp;", "<p>&lt;b&gt;x&lt;/b&gt; &amp;amp;</p>"),
    ("[x](javascript:alert(1)) [y](data:text/html,z)", "<p>[x](javascript:alert(1)) [y](data:text/html,z)</p>"),
    ("see https://example.invalid/p.", '<p>see <a href="https://example.invalid/p" rel="noopener noreferrer nofollow" '
                                      'target="_blank">https://example.invalid/p</a>.</p>'),
]


def test_markdown_renderer(driver, hostile_api):
    d = driver
    if not d.current_url.startswith(hostile_api.url):
        d.get(hostile_api.url + "/")
    _wait(d, lambda: d.execute_script("return !!window.MlxMarkdown"), "markdown.js")
    got = d.execute_script("""
        return arguments[0].map(src => {
          const div = document.createElement('div');
          div.appendChild(MlxMarkdown.render(src));
          return div.innerHTML;
        });""", [src for src, _ in MARKDOWN_CASES])
    for (src, want), html in zip(MARKDOWN_CASES, got):
        assert html == want, f"{src!r}: {html}"
    # A code block as it streams (no closing fence yet) is code already.
    html = d.execute_script("const div = document.createElement('div');"
                            "div.appendChild(MlxMarkdown.render('```py\\nx = 1')); return div.innerHTML;")
    assert '<pre><code data-lang="py">x = 1</code></pre>' in html
    # Lines a backtracking regex would take minutes over (the script times
    # out at TIMEOUT), and nesting that overflowed the stack: drawn, as text
    # where they are not Markdown.
    got = d.execute_script("""
        return arguments[0].map(src => {
          const div = document.createElement('div');
          div.appendChild(MlxMarkdown.render(src));
          return [div.firstChild.tagName, div.textContent.length];
        });""", ["# a" + " " * 20000 + "x", "```" + "a" * 20000 + "`", "a | b\n" + " " * 20000 + "x",
                 ">" * 5000 + " deep", "see http://a.example/" + ".," * 20000 + "x"])
    assert got[0] == ["H1", len("a" + " " * 20000 + "x")]
    assert got[1] == ["P", 20004] and got[2] == ["P", 20006]
    assert got[3][0] == "BLOCKQUOTE" and got[3][1] > 0
    assert got[4] == ["P", len("see http://a.example/" + ".," * 20000 + "x")]
