"""Quantized KV: scheme parsing and sizes, the pure-MLX quantizers (packing,
affine error, TurboQuant MSE against the paper), the paged reference paths,
and quantized schemes through the engine (batching, prefix cache, preemption)."""

import math
import random

import mlx.core as mx
import numpy as np
import pytest

from engine_utils import ToyTokenizer, greedy, run_requests, tiny_model
from kv_oracle import rounded_query
from mlxfast import ops
from mlxfast.engine.api import Request
from mlxfast.engine.config import EngineConfig
from mlxfast.engine.engine import Engine
from mlxfast.kv.block_pool import KVPool
from mlxfast.kv.layer_spec import uniform_layers
from mlxfast.kv.paged import PagedContext, SeqSlice
from mlxfast.kv.schemes import parse_kv_quant
from mlxfast.ops.kvquant import (LLOYD_MAX_GAUSSIAN, _pack, _unpack, codebook, lloyd_max_gaussian,
                                 rotation_signs)

SCHEMES = ["8", "4", "turbo", "turbo:k8v4", "turbo:k8v2", "turbo:k4v4"]


def test_scheme_ids_and_bytes_per_token():
    def spec(q, **kw):
        return parse_kv_quant(q, head_dim=64, **kw)
    assert spec("off").scheme_id == "f32"
    assert spec("off", dtype=mx.float16).scheme_id == "f16"
    assert spec("8").scheme_id == "q8g64" and spec("4", group_size=32).scheme_id == "q4g32"
    assert spec("turbo").scheme_id == "turbo-k8v3-s0" == spec("turbo:k8v3").scheme_id
    assert spec("turbo:k4v2", seed=7).scheme_id == "turbo-k4v2-s7"
    for bad in ("3", "turbo:k8v5", "turbo:k2v3", "fp8"):
        with pytest.raises(ValueError):
            spec(bad)
    with pytest.raises(ValueError):
        parse_kv_quant("turbo", head_dim=48)  # the Walsh-Hadamard rotation needs 2^n
    # The default model: 30 layers, 3 kv heads, head_dim 64.
    fp16 = spec("off", dtype=mx.float16).bytes_per_token(uniform_layers(30, 3, 64))
    assert fp16 == 30 * 3 * 2 * 64 * 2
    per_head = {q: spec(q).fmt.row_bytes for q in ("8", "4", "turbo", "turbo:k8v4")}
    # K: codes + fp16 scale + fp16 bias per group; turbo V: 3-bit codes + fp32 norm.
    assert per_head == {"8": 2 * (64 + 4), "4": 2 * (32 + 4), "turbo": 68 + 24 + 4,
                        "turbo:k8v4": 68 + 32 + 4}
    k8v3 = spec("turbo").bytes_per_token(uniform_layers(30, 3, 64))
    assert fp16 / k8v3 >= 2.5, fp16 / k8v3
    assert KVPool(uniform_layers(30, 3, 64), 2, 16, kv_quant="turbo").bytes_per_block == 16 * k8v3


def test_codebook_constants_are_lloyd_max():
    for bits, half in LLOYD_MAX_GAUSSIAN.items():
        c, _ = lloyd_max_gaussian(bits)
        np.testing.assert_allclose(c[len(c) // 2:], half, atol=1e-8)
    assert list(codebook(3)) == sorted(codebook(3))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_roundtrip_is_tight(bits):
    codes = mx.array(np.random.default_rng(bits).integers(0, 1 << bits, (5, 3, 64)), mx.uint8)
    packed = _pack(codes, bits)
    assert packed.shape == (5, 3, 64 * bits // 8)
    assert mx.array_equal(_unpack(packed, bits, 64), codes.astype(mx.uint32))
    if bits == 3:  # LSB-first stream: code 0 = low 3 bits of byte 0
        assert int(packed[0, 0, 0]) & 7 == int(codes[0, 0, 0])


@pytest.mark.parametrize("bits,g", [(8, 64), (4, 64), (8, 32), (4, 32)])
def test_affine_error_within_half_a_step(bits, g):
    fmt = ops.KVQuantFormat(64, bits, bits, g, False)
    mx.random.seed(bits + g)
    k = mx.random.normal((200, 2, 64)) * 3 + 1
    kd, vd = ops.kv_quant_dequant_reference(ops.kv_quant_encode_reference(k, k, fmt), fmt)
    kg = k.reshape(200, 2, 64 // g, g)
    step = (kg.max(-1) - kg.min(-1)) / ((1 << bits) - 1)
    err = mx.abs(kd - k).reshape(200, 2, 64 // g, g).max(-1)
    # half a step, plus the fp16 rounding of scale and bias
    assert bool(mx.all(err <= step * 0.5 + 2e-3 * (mx.abs(kg).max(-1) + step * (1 << bits))))
    assert mx.array_equal(kd, vd)


# TurboQuant (Zandieh, Daliri, Hadian, Mirrokni: "TurboQuant: Online Vector
# Quantization with Near-optimal Distortion Rate", arXiv:2504.19874), Theorem 1:
# for unit-norm x the MSE quantizer (random rotation + Lloyd-Max per coordinate)
# has D_mse = E|x - x^|^2 <= (sqrt(3) pi / 2) 4^-b, and for b = 1, 2, 3, 4
# D_mse ~= 0.36, 0.117, 0.03, 0.009 (the Lloyd-Max MSE of the rotated
# coordinates: 0.3634, 0.1175, 0.0345, 0.0095 for N(0,1)).
PAPER_MSE = {2: 0.117, 3: 0.03, 4: 0.009}


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("D", [64, 128])
def test_turbo_mse_matches_the_paper(bits, D):
    fmt = ops.KVQuantFormat(D, 8, bits, 64, True)
    signs = mx.array(rotation_signs(3, 0, D))
    mx.random.seed(bits * D)
    # Anisotropic, heavy-tailed vectors of random norms: the rotation must make
    # the coordinates Gaussian-like whatever the input.
    v = mx.random.normal((4000, D)) * mx.exp(mx.random.normal((1, D))) * mx.random.uniform(
        0.1, 10, (4000, 1))
    v = v + 5 * (mx.random.uniform(shape=(4000, D)) < 0.02)  # outlier coordinates
    _, vd = ops.kv_quant_dequant_reference(ops.kv_quant_encode_reference(v, v, fmt, signs), fmt, signs)
    rel = float(mx.mean(((vd - v) ** 2).sum(-1) / (v * v).sum(-1)))
    lm = lloyd_max_gaussian(bits)[1]
    print(f"b={bits} D={D}: measured MSE/|x|^2 {rel:.5f}, paper ~{PAPER_MSE[bits]}, "
          f"Lloyd-Max N(0,1) {lm:.5f}, bound {math.sqrt(3) * math.pi / 2 * 4 ** -bits:.5f}")
    assert rel <= math.sqrt(3) * math.pi / 2 * 4 ** -bits  # Theorem 1's upper bound
    assert 0.8 * lm <= rel <= 1.1 * lm  # within 10% of the Lloyd-Max figure
    assert rel <= 1.2 * PAPER_MSE[bits]
    # norm correction: reconstructions keep the norm
    np.testing.assert_allclose(np.linalg.norm(np.array(vd), axis=-1),
                               np.linalg.norm(np.array(v), axis=-1), rtol=1e-4)


def test_turbo_signs_are_seeded_per_layer():
    a, b, c = rotation_signs(0, 0, 64), rotation_signs(0, 1, 64), rotation_signs(1, 0, 64)
    assert set(np.unique(a)) == {-1.0, 1.0}
    assert (a != b).any() and (a != c).any()
    assert np.array_equal(a, rotation_signs(0, 0, 64))


def _naive(q, k, v, tables, seq_idx, positions, scale, bs):
    q, k, v = (np.array(a.astype(mx.float32), np.float64) for a in (q, k, v))
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    out = np.zeros((T, Hq, D))
    for t in range(T):
        table = tables[seq_idx[t]]
        slots = [table[p // bs] * bs + p % bs for p in range(positions[t] + 1)]
        for h in range(Hq):
            s = k[slots, h // (Hq // Hkv)] @ q[t, h] * scale
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ v[slots, h // (Hq // Hkv)]
    return out


@pytest.mark.parametrize("quant", ["8", "4", "turbo"])
@pytest.mark.parametrize("native", [False, True])
def test_paged_context_over_quant_pool_matches_naive(quant, native):
    mx.random.seed(7)
    bs, Hq, Hkv, D = 4, 6, 2, 64
    pool = KVPool(uniform_layers(1, Hkv, D), 32, bs, kv_quant=quant)
    seqs, used = [], 0
    for n_ctx, n in ((9, 1), (13, 5), (4, 4), (1, 1)):
        nb = -(-n_ctx // bs)
        seqs.append(SeqSlice([list(range(used, used + nb))[::-1]], n_ctx - n, n))
        used += nb
    # fill the context with random quantized KV first
    slots = mx.arange(32 * bs)
    pool.write(0, slots, mx.random.normal((32 * bs, Hkv, D)), mx.random.normal((32 * bs, Hkv, D)))
    T = sum(s.n for s in seqs)
    q, k, v = (mx.random.normal((T, 1, h, D)) for h in (Hq, Hkv, Hkv))
    out = PagedContext(pool, seqs, native=native).attend(0, q, k, v, 0.125)
    kd, vd = ops.kv_quant_dequant_reference(pool.arrays()[0], pool.spec.fmt, pool.scheme.signs[0])
    seq_idx = [i for i, s in enumerate(seqs) for _ in range(s.n)]
    pos = [p for s in seqs for p in range(s.start, s.start + s.n)]
    # quantized schemes score keys against the query rounded to 8 bits
    qr = mx.array(rounded_query(q.reshape(T, Hq, D), 0.125, pool.spec.fmt.group_size))
    want = _naive(qr, kd, vd, [s.block_tables[0] for s in seqs], seq_idx, pos, 1.0, bs)
    np.testing.assert_allclose(np.array(out.reshape(T, Hq, D)), want, atol=2e-4, rtol=1e-3)
    # the new tokens' KV landed in their slots (quantized)
    kn, _ = ops.kv_quant_dequant_reference(pool.arrays()[0][PagedContext(pool, seqs).slots],
                                           pool.spec.fmt, pool.scheme.signs[0])
    assert float(mx.abs(kn - k.reshape(T, Hkv, D)).max()) < (0.1 if quant != "4" else 0.6)


# --- through the engine (tiny model with head_dim 64) ---------------------------


@pytest.fixture(scope="module")
def model():
    return tiny_model(5, hidden=128, heads=2, kv_heads=1)  # head_dim 64, 2 q heads per kv head


def _engine(model, quant, **kw):
    kw.setdefault("num_blocks", 96)
    kw.setdefault("block_size", 8)
    return Engine(model, ToyTokenizer(), EngineConfig(kv_quant=quant, **kw)).start()


@pytest.mark.parametrize("quant", ["8", "turbo"])
def test_engine_batched_equals_solo_prefix_and_preemption(model, quant):
    rng = random.Random(11)
    prompts = [[rng.randrange(1, 97) for _ in range(n)] for n in (3, 17, 30, 41, 9, 25)]
    eng = _engine(model, quant, max_num_batched_tokens=24)
    try:
        stats = eng.stats()
        solo = [run_requests(eng, [Request(p, greedy(10, ignore_eos=True), cache_salt="solo")])[0][0]
                for p in prompts]
        batched = run_requests(eng, [Request(p, greedy(10, ignore_eos=True)) for p in prompts],
                               delays=[0.005 * i for i in range(len(prompts))])
        # a prefix hit reuses quantized blocks: same tokens
        (hit, _, fin), = run_requests(eng, [Request(prompts[3], greedy(10, ignore_eos=True))])
        assert eng.stats()["free_blocks"] == eng.stats()["total_blocks"]
    finally:
        eng.shutdown()
    assert stats["kv_scheme"] == eng.kv_spec.scheme_id and stats["kv_bytes_per_token"] == (
        2 * eng.kv_spec.fmt.row_bytes)
    assert [b[0] for b in batched] == solo
    assert fin.cached_tokens == 40 and hit == solo[3]
    # a pool too small for all of them at once: preemption + recompute
    eng = _engine(model, quant, num_blocks=14, max_num_batched_tokens=64)
    try:
        again = run_requests(eng, [Request(p, greedy(10, ignore_eos=True)) for p in prompts])
        pre = eng.stats()["num_preemptions_total"]
    finally:
        eng.shutdown()
    assert pre > 0 and [a[0] for a in again] == solo


def test_engine_namespace_includes_the_scheme(model):
    engines = {q: _engine(model, q) for q in ("off", "8", "turbo", "turbo:k8v4")}
    try:
        ns = {q: e._namespace for q, e in engines.items()}
        sizes = {q: e.kv_bytes_per_token for q, e in engines.items()}
        blocks = {q: _engine_blocks(model, q) for q in ("off", "8", "turbo")}
    finally:
        for e in engines.values():
            e.shutdown()
    assert len(set(ns.values())) == 4 and "turbo-k8v3-s0" in ns["turbo"]
    # dense "auto" KV of a float32 model is float16 (kv.block_pool.default_kv_dtype)
    assert sizes == {"off": 2 * 2 * 64 * 2, "8": 2 * 136, "turbo": 2 * 96, "turbo:k8v4": 2 * 104}
    # pool sizing counts the scheme's true bytes: same memory, more blocks
    assert blocks["turbo"] > blocks["8"] > blocks["off"]


def _engine_blocks(model, quant):
    return Engine(model, ToyTokenizer(), EngineConfig(kv_quant=quant, kv_cache_gb=0.001)).num_blocks
