"""The default model against mlx-lm (test-only oracle) on the same weights:
the GGUF converted with ``mlxfast convert`` and loaded by both."""

import subprocess
import sys

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.sample_utils import make_sampler

import mlxfast
from mlxfast.generation import stream_generate
from mlxfast.kv import DenseKVCache
from mlxfast.models.loader import default_model_path

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a linked list.",
    "Explain photosynthesis to a ten-year-old, in three sentences.",
    "List five prime numbers and say why each is prime.",
    "Translate 'good morning, how are you?' into Spanish and German.",
]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2-mlx")
    proc = subprocess.run(
        [sys.executable, "-m", "mlxfast.cli", "convert", str(default_model_path()), str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    return out


@pytest.fixture(scope="module")
def oracle(converted):
    return mlx_lm.load(str(converted))


@pytest.fixture(scope="module", params=["gguf", "converted"])
def ours(request, converted):
    return mlxfast.load(None if request.param == "gguf" else converted)


SUFFIX = (" Sure. Here is a careful answer with some detail, examples and code where useful:\n"
          "1. First,\n2. Second,\n3. Third, and `print(42)` to finish.")


def _teacher_forced_ids(tokenizer, prompt):
    # tokenize=False is what mlx-lm's HF tokenizer needs; ours renders text anyway.
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                         add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text + SUFFIX, add_special_tokens=False)
    assert len(ids) >= 64
    return ids[:64]


@pytest.fixture(scope="module")
def reference(oracle):
    """mlx-lm's token ids and logits for each prompt, computed once."""
    ref_model, ref_tok = oracle
    out = {}
    for prompt in PROMPTS:
        ids = _teacher_forced_ids(ref_tok, prompt)
        logits = ref_model(mx.array([ids]))[0]
        mx.eval(logits)
        out[prompt] = (ids, logits)
    return out


def test_teacher_forced_logits_match(ours, reference):
    model, tok = ours
    worst = 0.0
    for prompt in PROMPTS:
        want_ids, want = reference[prompt]
        ids = _teacher_forced_ids(tok, prompt)
        assert ids == want_ids  # both tokenizers agree (checked, not assumed)
        got = model(mx.array([ids]), DenseKVCache(len(model.layers)))[0]
        assert (mx.argmax(got, -1) == mx.argmax(want, -1)).all().item(), prompt
        worst = max(worst, (mx.abs(got - want).max() / mx.abs(want).max()).item())
    print(f"max |dlogit| / max |logit| = {worst:.2e}")
    assert worst <= 0.01


@pytest.mark.slow
def test_greedy_continuations_identical(oracle):
    model, tok = mlxfast.load()
    ref_model, ref_tok = oracle
    greedy = make_sampler(temp=0.0)
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        ref_prompt = ref_tok.apply_chat_template(messages, add_generation_prompt=True)
        want = [r.token for r in mlx_lm.stream_generate(ref_model, ref_tok, ref_prompt, max_tokens=64, sampler=greedy)]
        got = [c.token for c in stream_generate(model, tok, messages, max_tokens=64, temp=0.0)]
        # mlx-lm yields the EOS token as its last response; ours reports it too.
        assert got == want, prompt
        assert len(got) >= 8
