"""One request, the same tokens everywhere: ``mlxfast.generate``, the
``mlxfast generate`` command and the server (chat for chat messages,
``/v1/completions`` for raw text) sample with one sampler and render prompts
with one prompt path, so a seeded sampled request gives the same text through
each of them (greedy too)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

import mlxfast
from mlxfast.generation import prompt_ids
from mlxfast.server.prompts import build_chat_prompt

N = 24
CHAT = "Write a short poem about the sea."
RAW = "Once upon a time, in a small village,"

# Library keyword -> server field; each case is (library kwargs); the server
# gets the same values under its names.
CASES = [
    dict(temp=0.0),
    dict(temp=1.0, seed=11),
    dict(temp=0.9, top_p=0.9, seed=3),
    dict(temp=1.1, top_k=20, seed=5),
    dict(temp=1.3, min_p=0.05, seed=9),
    dict(temp=1.0, top_p=0.95, top_k=40, min_p=0.02, seed=1234567),
    dict(temp=0.8, repetition_penalty=1.3, seed=21),
    dict(temp=0.8, presence_penalty=0.8, frequency_penalty=0.5, seed=22),
]
SERVER_NAMES = {"temp": "temperature"}


@pytest.fixture(scope="module")
def default_model():
    return mlxfast.load()


def _body(kw: dict) -> dict:
    body = {SERVER_NAMES.get(k, k): v for k, v in kw.items()}
    return {"max_tokens": N, "top_p": 1.0, "top_k": 0, "min_p": 0.0, **body}


def _server_chat(server, kw: dict, content: str = CHAT) -> str:
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=300, json={
        "model": "default", "messages": [{"role": "user", "content": content}], **_body(kw)})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _server_completion(server, kw: dict, prompt: str = RAW) -> str:
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=300, json={
        "model": "default", "prompt": prompt, **_body(kw)})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_library_equals_server(default_model, server, kw):
    model, tok = default_model
    lib_chat = mlxfast.generate(model, tok, CHAT, max_tokens=N, **kw)
    lib_raw = mlxfast.generate(model, tok, RAW, max_tokens=N, chat=False, **kw)
    assert lib_chat and lib_raw
    assert _server_chat(server, kw) == lib_chat
    assert _server_completion(server, kw) == lib_raw


def test_the_seed_matters(default_model, server):
    """The identity above is not the sampler ignoring its seed or temperature."""
    model, tok = default_model
    kw = dict(temp=1.0, top_p=0.95, seed=11)
    outs = {mlxfast.generate(model, tok, CHAT, max_tokens=N, **{**kw, "seed": s}) for s in range(11, 15)}
    assert len(outs) > 1
    assert mlxfast.generate(model, tok, CHAT, max_tokens=N, **kw) != \
        mlxfast.generate(model, tok, CHAT, max_tokens=N, temp=0.0)
    assert _server_chat(server, {**kw, "seed": 12}) == \
        mlxfast.generate(model, tok, CHAT, max_tokens=N, **{**kw, "seed": 12})


def _cli(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "mlxfast.cli", "generate", "--max-tokens", str(N), *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("\n")
    return proc.stdout[:-1]  # the command adds one newline


def test_cli_equals_library_and_server(default_model, server):
    model, tok = default_model
    kw = dict(temp=1.0, top_p=0.95, top_k=40, min_p=0.02, repetition_penalty=1.1, seed=77)
    cli = _cli("--prompt", CHAT, "--temp", "1.0", "--top-p", "0.95", "--top-k", "40", "--min-p", "0.02",
               "--repetition-penalty", "1.1", "--seed", "77")
    assert cli == mlxfast.generate(model, tok, CHAT, max_tokens=N, **kw)
    assert cli == _server_chat(server, kw)
    raw = dict(temp=0.9, seed=78)
    cli = _cli("--no-chat", "--prompt", RAW, "--temp", "0.9", "--seed", "78")
    assert cli == mlxfast.generate(model, tok, RAW, max_tokens=N, chat=False, **raw)
    assert cli == _server_completion(server, raw)


def test_chat_prompt_takes_the_servers_bos_rule(default_model):
    """A model whose tokenizer adds BOS: the library's chat prompt starts with
    it exactly as the server's (the default model adds none)."""
    _, tok = default_model
    messages = [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Be kind."},
                {"role": "user", "content": "Hi"}]
    assert not tok.add_bos
    assert prompt_ids(tok, messages, chat=True) == \
        build_chat_prompt(tok, messages, tools=None, use_tools=False, template_kwargs={}).ids
    tok.add_bos = True
    try:
        server_ids = build_chat_prompt(tok, messages, tools=None, use_tools=False, template_kwargs={}).ids
        assert server_ids[0] == tok.bos_token_id and server_ids[1] != tok.bos_token_id
        assert prompt_ids(tok, messages, chat=True) == server_ids
        assert prompt_ids(tok, "Hi", chat=True)[0] == tok.bos_token_id
    finally:
        tok.add_bos = False
    # Raw text: the completions endpoint's rule (the tokenizer's own special tokens).
    assert prompt_ids(tok, RAW, chat=False) == tok.encode(RAW, add_special_tokens=True)

