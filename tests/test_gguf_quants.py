"""Each GGUF block format against gguf's own (llama.cpp-maintained) dequantizer."""

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants
from tiny_gguf import random_kquant

from mlxfast.models.gguf_quants import convert_tensor


def _values(converted: dict) -> np.ndarray:
    if "scales" in converted:
        w, s, b = converted["weight"], converted["scales"], converted["biases"]
        bits = w.shape[-1] * 32 // (s.shape[-1] * 32)
        return np.array(mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=32, bits=bits))
    return np.array(converted["weight"].astype(mx.float32))


@pytest.mark.parametrize("qtype,bits", [(Q.Q4_0, 4), (Q.Q4_1, 4), (Q.Q8_0, 8), (Q.Q5_0, 8), (Q.Q5_1, 8)])
def test_block_formats_become_exact_affine_groups(qtype, bits):
    rng = np.random.default_rng(int(qtype))
    w = (rng.standard_normal((24, 256)) * 0.1).astype(np.float32)
    data = quants.quantize(w, qtype)
    got = convert_tensor(qtype.name, data.reshape(-1), (24, 256))
    assert got["weight"].dtype == mx.uint32 and got["weight"].shape == (24, 256 * bits // 32)
    want = quants.dequantize(data, qtype).reshape(24, 256)
    # fp16 scales/biases are the only rounding: relative to the block's scale.
    np.testing.assert_allclose(_values(got), want, atol=2e-3 * np.abs(want).max())


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K])
def test_k_formats_match_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    data = random_kquant(8, 512, qtype, rng)
    got = _values(convert_tensor(qtype.name, data.reshape(-1), (8, 512)))
    want = quants.dequantize(data, qtype).reshape(8, 512)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


def test_plain_formats():
    w = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    np.testing.assert_array_equal(_values(convert_tensor("F32", w.view(np.uint8).reshape(-1), (4, 64))), w)
    h = w.astype(np.float16)
    np.testing.assert_array_equal(_values(convert_tensor("F16", h.view(np.uint8).reshape(-1), (4, 64))), h)
    bf = quants.quantize(w, Q.BF16)
    got = convert_tensor("BF16", bf.view(np.uint8).reshape(-1), (4, 64))["weight"]
    assert got.dtype == mx.bfloat16
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)), quants.dequantize(bf, Q.BF16).reshape(4, 64))


def test_unsupported_type_is_named():
    with pytest.raises(ValueError, match="is IQ2_XS, which cannot be loaded yet"):
        convert_tensor("IQ2_XS", np.zeros(74, np.uint8), (1, 256), "blk.0.attn_q.weight")


def test_q6_k_stays_quantized_within_half_an_8bit_step():
    rng = np.random.default_rng(6)
    data = random_kquant(16, 1024, Q.Q6_K, rng)
    conv = convert_tensor("Q6_K", data.reshape(-1), (16, 1024))
    assert conv["weight"].dtype == mx.uint32 and conv["weight"].shape == (16, 1024 * 8 // 32)
    got = _values(conv)
    want = quants.dequantize(data, Q.Q6_K).reshape(16, 1024)
    step = np.array(conv["scales"].astype(mx.float32)).repeat(32, axis=1)
    err = np.abs(got - want)
    # rounding to the 8-bit grid, plus the fp16 bias (relative 2^-11 of the group's minimum)
    lows = np.abs(np.array(conv["biases"].astype(mx.float32))).repeat(32, axis=1)
    assert (err <= 0.5 * step + lows * 2.0 ** -11 + 1e-7).all()
    # random scales (adversarial: neighbouring sub-blocks 100x apart) still match
    # to 1% of the block's largest weight
    np.testing.assert_allclose(got, want, atol=1e-2 * np.abs(want).max())


def _q6_step(raw: np.ndarray, shape) -> np.ndarray:
    """Q6_K's own quantization step per weight: d * |sub-block scale| (16 weights each)."""
    b = np.asarray(raw).reshape(-1, 210)
    d = b[:, 208:210].copy().view(np.float16).astype(np.float32)
    return (np.abs(b[:, 192:208].view(np.int8).astype(np.float32)) * d).repeat(16, axis=1).reshape(shape)


def test_q6_k_error_on_a_real_file(gemma3_gguf):
    """The Gemma 3 file's Q6_K tensors (ffn_down): the 8-bit requantization's
    error, measured against Q6_K's own step and the weights' size."""
    from mlxfast.models.gguf_file import GGUFFile

    f = GGUFFile(gemma3_gguf)
    infos = [i for i in f.tensors.values() if i.type_name == "Q6_K"]
    assert len(infos) == 9
    for info in infos[:3]:
        raw = f.tensor_bytes(info)
        want = quants.dequantize(np.asarray(raw), Q.Q6_K).reshape(info.shape)
        err = np.abs(_values(convert_tensor("Q6_K", raw, info.shape)) - want)
        step = _q6_step(raw, info.shape)
        ratio = err[step > 0] / step[step > 0]
        rel_rms = np.sqrt((err ** 2).mean() / (want ** 2).mean())
        print(f"{info.name}: error mean {ratio.mean():.3f}, p99 {np.quantile(ratio, 0.99):.3f} of a Q6_K "
              f"step; relative rms {rel_rms:.4f}")
        # Q6_K's own rounding error is ~0.29 of its step (uniform): ours adds a fraction of it
        assert ratio.mean() < 0.1 and np.quantile(ratio, 0.99) < 0.3 and rel_rms < 0.01
