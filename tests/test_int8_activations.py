"""``--matmul-activations int8`` end to end: the model property, the real
server, the start-up error, and the quality on the default model against
llama.cpp (llama-cpp-python, test-only oracle) on the same GGUF.

Quality, measured on this machine (AVX-512 VNNI), default model
(SmolLM2-135M-Instruct Q4_1), teacher-forced over 4 x 128 = 512 positions
(code, a story, JSON records, GPL prose):
  top-1 agreement with llama.cpp: int8 activations 97.07%, fp32 96.68%,
  mlx-lm 96.68% (the bar: mlx-lm's own, on the same positions);
  perplexity: fp32 15.195, int8 15.258 (+0.42%; bar: within 0.5%).
(On 4 x 128 other positions of the GPL text: agreement int8 95.9%, fp32 and
mlx-lm 95.5%; perplexity +0.33%.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import pytest

import mlxfast
from mlxfast import ops
from mlxfast.kv import DenseKVCache
from mlxfast.models.layers import QuantizedEmbedding, QuantizedLinear
from mlxfast.models.loader import default_model_path

from conftest import serve

DATA = Path(__file__).parent / "data"
NATIVE = ops.int8_activations_unsupported() == ""
needs_int8 = pytest.mark.skipif(not NATIVE, reason="this CPU has no int8 kernel: "
                                + (ops.int8_activations_unsupported() or "-"))


@pytest.fixture(scope="module")
def models():
    fp, tok = mlxfast.load()
    i8, _ = mlxfast.load(matmul_activations="int8")
    return fp, i8, tok


def _quantized(model):
    return [m for _, m in model.named_modules() if isinstance(m, (QuantizedLinear, QuantizedEmbedding))]


@needs_int8
def test_the_mode_is_a_property_of_the_loaded_model(models):
    fp, i8, _ = models
    assert fp.matmul_activations == "fp32" and i8.matmul_activations == "int8"
    assert all(m.activations == "fp32" for m in _quantized(fp))
    layers = _quantized(i8)
    assert layers and all(m.activations == ("int8" if m.bits in (4, 8) else "fp32") for m in layers)
    # the fused projections (built at load) carry it too
    assert any(m.activations == "int8" and m.weight.shape[0] > 576 for m in layers)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="matmul activations"):
        mlxfast.load(matmul_activations="int4")


def _sequences(tok, length=128):
    """4 x 128 positions: code, a story, JSON records and licence prose (the
    texts of the Gemma 3 llama.cpp check)."""
    from test_models_gemma3 import CODE, RECORDS, STORY

    gpl = (DATA / "gpl-3.0.txt").read_text()[4000:7000]
    out = [tok.encode(t, add_special_tokens=True)[:length] for t in (CODE, STORY, RECORDS, gpl)]
    assert all(len(ids) == length for ids in out)
    return out


def _logits(model, ids):
    out = model(mx.array([ids]), DenseKVCache.for_model(model))[0].astype(mx.float32)
    return np.array(out)


def _nll(logits, ids):
    """Mean next-token negative log-likelihood of ids[1:]."""
    lg = logits[:-1].astype(np.float64)
    m = lg.max(-1, keepdims=True)
    lse = (m[:, 0] + np.log(np.exp(lg - m).sum(-1)))
    return lse - lg[np.arange(len(ids) - 1), ids[1:]]


@pytest.fixture(scope="module")
def mlx_lm_model(tmp_path_factory):
    mlx_lm = pytest.importorskip("mlx_lm")
    out = tmp_path_factory.mktemp("smollm2-mlx-int8")
    proc = subprocess.run([sys.executable, "-m", "mlxfast.cli", "convert", str(default_model_path()),
                           str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return mlx_lm.load(str(out))[0]


@needs_int8
def test_quality_against_llama_cpp_and_fp32(models, mlx_lm_model):
    """Teacher-forced top-1 agreement with llama.cpp: int8 at least mlx-lm's
    own on the same 512 positions; perplexity within 0.5% of fp32."""
    llama_cpp = pytest.importorskip("llama_cpp")
    fp, i8, tok = models
    llm = llama_cpp.Llama(str(default_model_path()), n_ctx=256, logits_all=True, verbose=False,
                          n_threads=2, seed=0)
    runs = {"fp32": lambda ids: _logits(fp, ids), "int8": lambda ids: _logits(i8, ids),
            "mlx-lm": lambda ids: np.array(mlx_lm_model(mx.array([ids]))[0].astype(mx.float32))}
    agree = dict.fromkeys(runs, 0)
    nll = {k: [] for k in runs}
    total = 0
    for ids in _sequences(tok):
        llm.reset()
        llm.eval(ids)
        ref = np.array(llm.scores[:len(ids)], dtype=np.float32).argmax(-1)
        for name, run in runs.items():
            lg = run(ids)
            agree[name] += int((lg.argmax(-1) == ref).sum())
            nll[name].append(_nll(lg, ids))
        total += len(ids)
    assert total == 512
    top1 = {k: v / total for k, v in agree.items()}
    ppl = {k: float(np.exp(np.concatenate(v).mean())) for k, v in nll.items()}
    print(f"top-1 agreement with llama.cpp over {total} positions: "
          + ", ".join(f"{k} {v:.4f}" for k, v in top1.items())
          + "; perplexity " + ", ".join(f"{k} {v:.3f}" for k, v in ppl.items())
          + f" (int8 {ppl['int8'] / ppl['fp32'] - 1:+.2%} vs fp32)")
    assert top1["int8"] >= top1["mlx-lm"]
    assert abs(ppl["int8"] / ppl["fp32"] - 1) <= 0.005


@needs_int8
def test_the_flag_through_the_real_server():
    gen = serve("int8-key", "--matmul-activations", "int8", "--max-tokens", "16",
                "--max-model-len", "256")
    srv = next(gen)
    try:
        body = {"model": "default", "messages": [{"role": "user", "content": "Name three colors."}],
                "max_tokens": 12, "temperature": 0}
        r = httpx.post(srv.url + "/v1/chat/completions", headers=srv.headers, json=body,
                       timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"].strip()
    finally:
        gen.close()
    out = srv.proc.stdout.read()
    assert "matmul activations: int8" in out, out


@pytest.mark.parametrize("cli", ["serve", "generate"])
def test_no_int8_kernel_is_a_clear_startup_error(cli):
    # Forcing the portable path stands in for a CPU without AVX-512 VNNI (on such
    # a CPU the message names the missing features instead).
    env = dict(os.environ, MLXFAST_CPU_PATH="portable")
    args = (["-m", "mlxfast.serve", "--port", "1"] if cli == "serve"
            else ["-m", "mlxfast.cli", "generate", "--prompt", "hi", "--max-tokens", "1"])
    r = subprocess.run([sys.executable, *args, "--matmul-activations", "int8"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("mlxfast: error:")]
    assert len(lines) == 1 and "int8" in lines[0] and ("lacks" in lines[0] or "portable" in lines[0]), \
        r.stderr
