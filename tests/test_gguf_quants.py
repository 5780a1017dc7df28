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


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
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
