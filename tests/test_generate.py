"""Generation through the Python API and the ``mlxfast generate`` command."""

import subprocess
import sys

import pytest

import mlxfast


@pytest.fixture(scope="module")
def default_model():
    return mlxfast.load()


def test_greedy_answer_is_sensible(default_model):
    model, tok = default_model
    out = mlxfast.generate(model, tok, "What is the capital of France?", max_tokens=24, temp=0.0)
    assert "Paris" in out


def test_stream_pieces_join_to_generate(default_model):
    model, tok = default_model
    chunks = list(mlxfast.stream_generate(model, tok, "Count from one to ten in words.", max_tokens=20))
    assert chunks[-1].finish_reason in ("stop", "length")
    assert all(c.finish_reason is None for c in chunks[:-1])
    joined = "".join(c.text for c in chunks)
    assert joined == mlxfast.generate(model, tok, "Count from one to ten in words.", max_tokens=20)
    assert joined == tok.decode([c.token for c in chunks if c.token not in tok.eos_token_ids])


def test_max_tokens_is_respected(default_model):
    model, tok = default_model
    chunks = list(mlxfast.stream_generate(model, tok, "Tell me a long story.", max_tokens=5))
    assert len(chunks) == 5 and chunks[-1].finish_reason == "length"
    assert list(mlxfast.stream_generate(model, tok, "hi", max_tokens=0))[-1].finish_reason == "length"


def test_seeded_sampling_is_reproducible(default_model):
    model, tok = default_model
    kw = dict(max_tokens=16, temp=0.9, top_p=0.95, top_k=50, seed=7)
    a = [c.token for c in mlxfast.stream_generate(model, tok, "Name a color.", **kw)]
    b = [c.token for c in mlxfast.stream_generate(model, tok, "Name a color.", **kw)]
    assert a == b
    kw["seed"] = 8
    others = {tuple(c.token for c in mlxfast.stream_generate(model, tok, "Write one random word.", temp=1.5, max_tokens=8, seed=s)) for s in range(4)}
    assert len(others) > 1


def test_cli_generate_prints_the_same_text(default_model):
    model, tok = default_model
    want = mlxfast.generate(model, tok, "What is 2+2?", max_tokens=12, temp=0.0)
    proc = subprocess.run(
        [sys.executable, "-m", "mlxfast.cli", "generate", "--prompt", "What is 2+2?", "--max-tokens", "12"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout[:-1] == want  # the command adds one newline


def test_cli_generate_no_chat_feeds_raw_text(default_model):
    model, tok = default_model
    want = mlxfast.generate(model, tok, "The quick brown fox", max_tokens=8, temp=0.0, chat=False)
    proc = subprocess.run(
        [sys.executable, "-m", "mlxfast.cli", "generate", "--no-chat", "--prompt", "The quick brown fox", "--max-tokens", "8"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout[:-1] == want  # the command adds one newline
    assert want != mlxfast.generate(model, tok, "The quick brown fox", max_tokens=8, temp=0.0)
