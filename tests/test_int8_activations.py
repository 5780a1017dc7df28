"""``--matmul-activations int8`` end to end: the model property, the real
server, the start-up error, and the quality on the default model against
llama.cpp (llama-cpp-python, test-only oracle) on the same GGUF.

Quality, measured on this machine (AVX-512 VNNI), default model
(SmolLM2-135M-Instruct Q4_1), teacher-forced over the whole GPL text in
windows of 256 tokens (7,424 positions), int8 on every 4/8-bit projection
inside the blocks (the output head keeps fp32):
  top-1 agreement with llama.cpp: int8 96.09%, fp32 95.81%, mlx-lm 95.86%;
  perplexity: fp32 28.041, int8 28.094 (+0.19%; bar: within 0.5%)
  (the row-interleaved VNNI kernel; over MLX's layout it was 96.04%).
Over only 512 positions (4 x 128: code, a story, JSON records, GPL prose)
the same run gives int8 95.9% vs mlx-lm 96.7% and perplexity +1.1%: at that
size the numbers are dominated by which near-ties flip (see the quality
test), and the int8 bars are not met there.
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
    layers = [(p, m) for p, m in i8.named_modules()
              if isinstance(m, (QuantizedLinear, QuantizedEmbedding))]
    for path, m in layers:
        head = isinstance(m, QuantizedEmbedding) or path.endswith("lm_head")
        assert m.activations == ("int8" if m.bits in (4, 8) and not head else "fp32"), path
    layers = [m for _, m in layers]
    # the fused projections (built at load) carry it too (a row-interleaved
    # weight, 3-D, holds 16 rows per entry of its first axis)
    rows = [m.weight.shape[0] * (16 if m.weight.ndim == 3 else 1) for m in layers]
    assert any(m.activations == "int8" and n > 576 for m, n in zip(layers, rows))


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="matmul activations"):
        mlxfast.load(matmul_activations="int4")


def _windows(tok, length=256):
    """The whole GPL text as consecutive windows of 256 tokens (29: 7,424
    positions)."""
    ids = tok.encode((DATA / "gpl-3.0.txt").read_text(), add_special_tokens=False)
    return [ids[i:i + length] for i in range(0, len(ids) - length + 1, length)]


def _logits(model, ids):
    out = model(mx.array([ids]), DenseKVCache.for_model(model))[0].astype(mx.float32)
    return np.array(out)


def _nll(logits, ids):
    """Next-token negative log-likelihoods of ids[1:]."""
    lg = logits[:-1].astype(np.float64)
    m = lg.max(-1, keepdims=True)
    lse = (m[:, 0] + np.log(np.exp(lg - m).sum(-1)))
    return lse - lg[np.arange(len(ids) - 1), ids[1:]]


# mlx-lm's top-1 agreement with llama.cpp on the same 7,424 positions (the
# converted GGUF, measured once on this machine: mlx-lm takes ~11 minutes
# for them on this CPU; its logits equal mlxfast's fp32 ones to float
# rounding, test_parity_default_model.py).
MLX_LM_TOP1 = 0.9586


@pytest.mark.slow
@needs_int8
def test_quality_against_llama_cpp_and_fp32(models):
    """Teacher-forced top-1 agreement with llama.cpp at least mlx-lm's own,
    and perplexity within 0.5% of fp32 activations, over 7,424 positions.

    Over fewer positions these numbers are noise: int8 rounding is
    discontinuous, so any change of float summation order moves a few
    roundings and, through 30 layers, a few near-tie argmaxes. On 4 x 128
    positions (code, a story, JSON, GPL prose) the same math gave perplexity
    +0.4% (an earlier kernel's order) to +1.0% (the pure-MLX reference), and
    agreement 95.7% to 97.1% against mlx-lm's 96.7%.
    """
    llama_cpp = pytest.importorskip("llama_cpp")
    fp, i8, tok = models
    llm = llama_cpp.Llama(str(default_model_path()), n_ctx=256, logits_all=True, verbose=False,
                          n_threads=2, seed=0)
    agree = {"fp32": 0, "int8": 0}
    nll = {"fp32": [], "int8": []}
    total = 0
    for ids in _windows(tok):
        llm.reset()
        llm.eval(ids)
        ref = np.array(llm.scores[:len(ids)], dtype=np.float32).argmax(-1)
        for name, model in (("fp32", fp), ("int8", i8)):
            lg = _logits(model, ids)
            agree[name] += int((lg.argmax(-1) == ref).sum())
            nll[name].append(_nll(lg, ids))
        total += len(ids)
    assert total == 7424
    top1 = {k: v / total for k, v in agree.items()}
    ppl = {k: float(np.exp(np.concatenate(v).mean())) for k, v in nll.items()}
    print(f"top-1 agreement with llama.cpp over {total} positions: fp32 {top1['fp32']:.4f}, "
          f"int8 {top1['int8']:.4f} (mlx-lm {MLX_LM_TOP1}); perplexity fp32 {ppl['fp32']:.3f}, "
          f"int8 {ppl['int8']:.3f} ({ppl['int8'] / ppl['fp32'] - 1:+.2%})")
    assert top1["int8"] >= MLX_LM_TOP1
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
