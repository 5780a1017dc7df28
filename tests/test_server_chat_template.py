"""``--chat-template`` and models without a chat template, black-box.

The model is a tiny GGUF written here with no chat template (as Gemma 3's
GGUF files ship) and Gemma's control tokens; its next token is a fixed
function of the current one: after a newline it writes "OK", then
``<end_of_turn>``, then a newline again (see ``tiny_gguf.write_chat_gguf``).
So whether ``<end_of_turn>`` ends an answer is plain to see, and the prompt a
template renders is read back through ``/tokenize`` and ``usage``.

Three servers: the bare model (completions work, every chat API is a 400
naming the flag), the bare model with ``--chat-template FILE``, and a model
with a template of its own overridden by ``--chat-template`` template text.
"""

from __future__ import annotations

import subprocess
import sys

import anthropic
import httpx
import openai
import pytest

from conftest import API_KEY, free_port, serve, start_server
from tiny_gguf import write_chat_gguf

GEMMA = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
         "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
         "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
# The model's own template in the override case: no <end_of_turn> in it.
OWN = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"

USER = [{"role": "user", "content": "hi there"}]
TURNS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "OK"},
         {"role": "user", "content": "again"}]
TURNS_TEXT = ("<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\nOK<end_of_turn>\n"
              "<start_of_turn>user\nagain<end_of_turn>\n<start_of_turn>model\n")
ARGS = ("--max-tokens", "8", "--max-model-len", "256", "--kv-cache-gb", "0.05")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat-template")
    template = d / "gemma.jinja"
    template.write_text(GEMMA, encoding="utf-8")
    return {"bare": write_chat_gguf(d / "bare.gguf"), "own": write_chat_gguf(d / "own.gguf", OWN),
            "template": template, "dir": d}


@pytest.fixture(scope="module")
def bare(models):
    yield from serve(API_KEY, "--model", str(models["bare"]), *ARGS)


@pytest.fixture(scope="module")
def templated(models):
    yield from serve(API_KEY, "--model", str(models["bare"]), "--chat-template", str(models["template"]), *ARGS)


@pytest.fixture(scope="module")
def inline(models):
    yield from serve(API_KEY, "--model", str(models["own"]), "--chat-template", GEMMA, *ARGS)


def clients(server):
    return (openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=60),
            anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0, timeout=60))


# ------------------------------------------------------------- no template


def _says_flag(message: str) -> None:
    assert "no chat template" in message and "--chat-template" in message


def test_bare_model_completions_work_and_chat_is_a_400_everywhere(bare):
    oa, an = clients(bare)
    # Raw completions need no template; with none, <end_of_turn> is just a token.
    r = oa.completions.create(model="m", prompt="hello\n", max_tokens=6, temperature=0)
    assert r.choices[0].text.startswith("OK") and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6

    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="m", messages=USER)
    body = e.value.response.json()
    assert set(body) == {"error"} and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "no_chat_template"
    _says_flag(body["error"]["message"])
    with pytest.raises(openai.BadRequestError) as e:
        for _ in oa.chat.completions.create(model="m", messages=USER, stream=True):
            pass
    _says_flag(e.value.response.json()["error"]["message"])

    with pytest.raises(openai.BadRequestError) as e:
        oa.responses.create(model="m", input="hi there")
    body = e.value.response.json()
    assert body["error"]["type"] == "invalid_request_error"
    _says_flag(body["error"]["message"])
    with pytest.raises(openai.BadRequestError) as e:
        oa.responses.create(model="m", input="hi there", stream=True)
    _says_flag(e.value.response.json()["error"]["message"])

    for call in (lambda: an.messages.create(model="m", max_tokens=8, messages=USER),
                 lambda: an.messages.count_tokens(model="m", messages=USER)):
        with pytest.raises(anthropic.BadRequestError) as e:
            call()
        body = e.value.response.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        _says_flag(body["error"]["message"])

    r = httpx.post(bare.url + "/tokenize", json={"messages": USER}, headers=bare.headers)
    assert r.status_code == 400
    _says_flag(r.json()["error"]["message"])

    # Nothing was stored, nothing broke: the server keeps serving.
    assert httpx.get(bare.url + "/health").json() == {"status": "ok"}
    r = oa.completions.create(model="m", prompt="hello\n", max_tokens=3, temperature=0)
    assert r.choices[0].text.startswith("OK") and r.choices[0].finish_reason == "length"
    assert httpx.post(bare.url + "/tokenize", json={"prompt": "hi"}, headers=bare.headers).json()["count"] == 3


def test_bare_model_reports_no_template(bare):
    oa, _ = clients(bare)
    card = httpx.get(bare.url + "/v1/models", headers=bare.headers).json()["data"][0]
    assert card["has_chat_template"] is False
    assert oa.models.retrieve("default").model_extra["has_chat_template"] is False
    assert httpx.get(bare.url + "/stats", headers=bare.headers).json()["has_chat_template"] is False


# ------------------------------------------------------------- --chat-template FILE


def _rendered(server, messages) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"messages": messages}, headers=server.headers)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _raw_ids(server, text: str) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False},
                   headers=server.headers)
    return r.json()["tokens"]


def _decoded(server, ids) -> str:
    return httpx.post(server.url + "/detokenize", json={"tokens": ids}, headers=server.headers).json()["prompt"]


@pytest.mark.parametrize("which", ["templated", "inline"])
def test_the_prompt_is_what_the_template_says(request, which):
    server = request.getfixturevalue(which)
    want = "<bos><start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n"
    ids = _rendered(server, USER)
    assert ids == _raw_ids(server, want) and _decoded(server, ids) == want
    assert ids[:2] == [1, 3]  # <bos> and <start_of_turn> as the control tokens, not their letters
    turns = _rendered(server, TURNS)
    assert turns == _raw_ids(server, TURNS_TEXT) and _decoded(server, turns) == TURNS_TEXT

    oa, an = clients(server)
    r = oa.chat.completions.create(model="m", messages=TURNS, temperature=0)
    assert r.usage.prompt_tokens == len(turns)
    assert an.messages.count_tokens(model="m", messages=TURNS).input_tokens == len(turns)
    m = an.messages.create(model="m", max_tokens=8, messages=TURNS)
    # (Anthropic's input_tokens leave out what the prefix cache read)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(turns)
    assert oa.responses.create(model="m", input="hi there").usage.input_tokens == len(ids)
    assert httpx.get(server.url + "/v1/models", headers=server.headers).json()["data"][0]["has_chat_template"]


@pytest.mark.parametrize("which", ["templated", "inline"])
def test_end_of_turn_ends_the_answer(request, which):
    """The model writes "OK<end_of_turn>" and would go on ("\\nOK..."): the
    template's <end_of_turn> must stop it, on every API. (The inline case's
    model has its own template without <end_of_turn>: the override's turn
    end counts, not the file's.)"""
    server = request.getfixturevalue(which)
    oa, an = clients(server)
    r = oa.chat.completions.create(model="m", messages=USER, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == "OK" and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 8
    chunks = list(oa.chat.completions.create(model="m", messages=USER, max_tokens=8, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "OK"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    m = an.messages.create(model="m", max_tokens=8, messages=USER)
    assert m.content[0].text == "OK" and m.stop_reason == "end_turn"
    resp = oa.responses.create(model="m", input="hi there", max_output_tokens=8)
    assert resp.output_text == "OK" and resp.status == "completed"
    # The stop is the model's, so raw completions end there too.
    c = oa.completions.create(model="m", prompt="hello\n", max_tokens=8, temperature=0)
    assert c.choices[0].text == "OK" and c.choices[0].finish_reason == "stop"


# ------------------------------------------------------------- start-up errors


def _start_fails(*args: str) -> str:
    proc = start_server(free_port(), *args)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, (out, err)
    assert "Traceback" not in err and "ready on" not in out
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_a_missing_template_file_stops_the_start(models):
    missing = str(models["dir"] / "nope.jinja")
    line = _start_fails("--model", str(models["bare"]), "--chat-template", missing)
    assert line.startswith("mlxfast: error: --chat-template") and missing in line and "no such file" in line
    line = _start_fails("--model", str(models["bare"]), "--chat-template", str(models["dir"]))
    assert "--chat-template" in line and "is a directory" in line


def test_a_template_that_does_not_compile_stops_the_start(models):
    bad = models["dir"] / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m['content'] }}", encoding="utf-8")
    line = _start_fails("--model", str(models["bare"]), "--chat-template", str(bad))
    assert "--chat-template" in line and str(bad) in line and "syntax error (line 1)" in line
    line = _start_fails("--model", str(models["bare"]), "--chat-template", "{{ messages[0] }")
    assert "--chat-template" in line and "the template text given" in line and "syntax error" in line


# ------------------------------------------------------------- mlxfast generate


def _generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxfast.cli", "generate", "--max-tokens", "8", *args],
                          capture_output=True, text=True, timeout=300)


def test_cli_generate_takes_the_template(models):
    model = ("--model", str(models["bare"]), "--prompt", "hi there")
    p = _generate(*model, "--chat-template", str(models["template"]))
    assert p.returncode == 0, p.stderr
    assert p.stdout == "OK\n"  # ended by <end_of_turn>
    p = _generate(*model)
    assert p.returncode == 1 and "no chat template" in p.stderr and "--chat-template" in p.stderr
    assert "--no-chat" in p.stderr and "Traceback" not in p.stderr
    p = _generate(*model, "--no-chat")
    assert p.returncode == 0 and p.stdout.startswith("OK"), p.stderr
    p = _generate(*model, "--chat-template", str(models["dir"] / "nope.jinja"))
    assert p.returncode == 1 and "--chat-template" in p.stderr and "nope.jinja" in p.stderr
