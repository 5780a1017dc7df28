"""Speculative decoding through the real server: ``server_b`` decodes with
n-gram prompt lookup, ``server`` without; the same model gives the same
answers on both, and the drafts are reported."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

CODE = '''def area(width, height):
    """The area of a rectangle."""
    return width * height


def perimeter(width, height):
    """The perimeter of a rectangle."""
    return 2 * (width + height)
'''
COPY = "Copy this code exactly, changing nothing:\n\n" + CODE
QUESTIONS = [COPY, "Repeat after me: the cat sat on the mat, the cat sat on the mat.", "List the numbers 1 to 12.",
             "Write the word banana five times.", COPY + "\nThen add a docstring to the file.",
             "What is two plus two?", "Name three colors.", "Spell 'speculative', letter by letter."]


def chat(srv, model, question, **kw):
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 60,
            "temperature": 0, **kw}
    r = httpx.post(srv.url + "/v1/chat/completions", headers=srv.headers, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def both(server, server_b, **kw):
    with ThreadPoolExecutor(8) as pool:
        plain = list(pool.map(lambda q: chat(server, "default", q, **kw), QUESTIONS))
        spec = list(pool.map(lambda q: chat(server_b, "smol", q, **kw), QUESTIONS))
    return plain, spec


def test_greedy_answers_are_unchanged_by_speculation(server, server_b):
    plain, spec = both(server, server_b)
    for p, s in zip(plain, spec):
        assert s["choices"][0]["message"]["content"] == p["choices"][0]["message"]["content"]
        assert s["usage"]["completion_tokens"] == p["usage"]["completion_tokens"]
        assert "speculation" not in p["usage"]
        u = s["usage"]["speculation"]
        assert 0 <= u["accepted"] <= u["drafted"]
    # Alone (where verifying drafts is cheapest) the copy prompt's drafts are taken.
    alone = chat(server_b, "smol", COPY)
    assert alone["choices"][0]["message"]["content"] == plain[0]["choices"][0]["message"]["content"]
    assert alone["usage"]["speculation"]["accepted"] > 0


def test_seeded_sampling_is_unchanged_by_speculation(server, server_b):
    plain, spec = both(server, server_b, temperature=0.8, seed=11)
    for p, s in zip(plain, spec):
        assert s["choices"][0]["message"]["content"] == p["choices"][0]["message"]["content"]


def test_structured_output_is_unchanged_by_speculation(server, server_b):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    p = chat(server, "default", "Describe a person.", response_format=fmt)
    s = chat(server_b, "smol", "Describe a person.", response_format=fmt)
    assert s["choices"][0]["message"]["content"] == p["choices"][0]["message"]["content"]
    assert set(json.loads(s["choices"][0]["message"]["content"])) == {"name", "age"}
    spec = s["usage"]["speculation"]
    assert spec["accepted"] == spec["drafted"] > 0  # the forced keys and punctuation


def test_drafts_are_reported_in_the_stream_responses_stats_and_metrics(server_b):
    body = {"model": "smol", "messages": [{"role": "user", "content": COPY}], "max_tokens": 60, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    usage = None
    with httpx.stream("POST", server_b.url + "/v1/chat/completions", headers=server_b.headers, json=body,
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
    assert usage["speculation"]["drafted"] >= usage["speculation"]["accepted"] > 0
    r = httpx.post(server_b.url + "/v1/responses", headers=server_b.headers, timeout=120,
                   json={"model": "smol", "input": COPY, "max_output_tokens": 60, "temperature": 0})
    assert r.json()["usage"]["speculation"]["accepted"] > 0
    stats = httpx.get(server_b.url + "/stats", headers=server_b.headers).json()["engine"]["spec_decode"]
    assert stats["kind"] == "ngram" and stats["num_draft_tokens"] >= stats["num_accepted_tokens"] > 0
    text = httpx.get(server_b.url + "/metrics", headers=server_b.headers).text
    line = next(x for x in text.splitlines() if x.startswith("mlxfast:spec_decode_num_accepted_tokens_total{"))
    assert 'proposer="ngram"' in line and float(line.split()[-1]) > 0


@pytest.mark.parametrize("args,words", [
    (["--num-draft-tokens", "4"], "--draft-kind"),
    (["--draft-kind", "ngram", "--num-draft-tokens", "0"], "1..32"),
    (["--draft-kind", "ngram", "--num-draft-tokens", "33"], "1..32"),
    (["--draft-kind", "ngram", "--ngram-min", "3", "--ngram-max", "2"], "--ngram-min"),
    (["--draft-kind", "eagle"], "invalid choice"),
    (["--draft-kind", "model"], "--draft-model"),
    (["--draft-kind", "ngram", "--draft-model", "x.gguf"], "no --draft-model"),
    (["--draft-model", "x.gguf", "--ngram-max", "3"], "--ngram-max"),
    (["--draft-select", "all"], "--draft-kind"),
    (["--draft-kind", "ngram", "--draft-select", "some"], "invalid choice"),
])
def test_bad_speculation_flags_are_a_clear_startup_error(args, words):
    r = subprocess.run([sys.executable, "-m", "mlxfast.serve", "--port", "1", *args], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and words in r.stderr, r.stderr


@pytest.mark.parametrize("draft,words", [("missing", "could not be loaded"), ("default", "not smaller")])
def test_an_unfit_draft_model_stops_the_server_with_one_clear_line(tmp_path, draft, words):
    from mlxfast.models.loader import default_model_path

    path = str(tmp_path / "nope.gguf") if draft == "missing" else str(default_model_path())
    r = subprocess.run([sys.executable, "-m", "mlxfast.serve", "--port", "0", "--draft-model", path],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("mlxfast: error:")]
    assert len(lines) == 1 and words in lines[0], r.stderr
