"""GGUF loading: llama.cpp's layout (permuted q/k, its names, its quant types)
gives the same logits as mlx-lm on the same weights in HF layout."""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from mlx_lm.utils import load_model
from tiny_gguf import roundtrip, write_kquant_gguf, write_tiny_gguf
from tiny_models import make_tiny_model

from mlxfast import ops
from mlxfast.kv import DenseKVCache
from mlxfast.models import gguf
from mlxfast.models.layers import QuantizedLinear, pack_rows16
from mlxfast.models.loader import build_model

TOKENS = mx.array([[5, 17, 99, 3, 200, 42, 7, 150, 64, 11]])


def _gguf_model(path):
    tensors, meta = gguf.read_gguf(path)
    config = gguf.gguf_config(meta)
    weights, quant = gguf.hf_weights(tensors, config)
    return build_model(config, weights, quant), config, quant


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
@pytest.mark.parametrize("tied", [True, False])
def test_gguf_matches_mlx_lm_on_hf_layout(tmp_path, qtype, tied):
    src = make_tiny_model(tmp_path / "src", "llama", tie_word_embeddings=tied)
    config = json.loads((src / "config.json").read_text())
    weights = {k: np.array(v) for k, v in mx.load(str(src / "model.safetensors")).items()}
    write_tiny_gguf(tmp_path / "m.gguf", config, weights, qtype)

    # The oracle: mlx-lm on the HF layout with the values the quantizer kept.
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    kept = {k: mx.array(roundtrip(v, qtype) if v.ndim == 2 else v) for k, v in weights.items()}
    mx.save_safetensors(str(ref_dir / "model.safetensors"), kept)
    (ref_dir / "config.json").write_text(json.dumps(config))
    ref, _ = load_model(ref_dir)

    model, gcfg, quant = _gguf_model(tmp_path / "m.gguf")
    assert gcfg["tie_word_embeddings"] == tied
    if qtype not in (Q.F32, Q.F16, Q.BF16):
        qkv = model.model.layers[0].self_attn.qkv_proj
        assert isinstance(qkv, QuantizedLinear) and qkv.group_size == 32
        assert qkv.bits == (4 if qtype in (Q.Q4_0, Q.Q4_1) else 8)
        # Symmetric formats (bias = -2^(bits-1) * scale) are loaded without
        # biases, the embedding and the head too; Q4_1 / Q5_1 keep theirs.
        layers = [m for _, m in model.named_modules() if hasattr(m, "bits") and "scales" in m]
        assert layers and all(("biases" in m) == (qtype in (Q.Q4_1, Q.Q5_1)) for m in layers)
    got = model(TOKENS, DenseKVCache(len(model.layers)))
    want = ref(TOKENS)
    err = (mx.abs(got - want).max() / mx.abs(want).max()).item()
    assert err < 1e-4, err
    assert (mx.argmax(got, -1) == mx.argmax(want, -1)).all().item()
    # The AVX-512 path's load-time layout (layers.pack_rows16: 4- and 8-bit
    # layers, a tied head's embedding too) computes the same model.
    widths = {m.bits for _, m in model.named_modules() if hasattr(m, "bits") and "scales" in m}
    packed_layers = pack_rows16(model)
    if ops.cpu_path() == "avx512":
        assert (packed_layers > 0) == bool(widths & {4, 8}), widths
    if packed_layers:
        assert model.model.embed_tokens["weight"].ndim == 3
        packed = model(TOKENS, DenseKVCache(len(model.layers)))
        assert (mx.abs(packed - want).max() / mx.abs(want).max()).item() < 1e-4
        assert (mx.argmax(packed, -1) == mx.argmax(want, -1)).all().item()


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_k_quants_match_gguf_dequantizer(tmp_path, qtype):
    """K-quant tensors (what most GGUF files hold): Q4_K/Q5_K become exact
    affine groups, Q6_K 8-bit groups (requantized, near exact); the model
    computes with gguf's own values."""
    dims = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    src = make_tiny_model(tmp_path / "src", "llama", tie_word_embeddings=False, **dims)
    config = json.loads((src / "config.json").read_text())
    weights = {k: np.array(v) for k, v in mx.load(str(src / "model.safetensors")).items()}
    oracle_weights = write_kquant_gguf(tmp_path / "m.gguf", config, weights, qtype)
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    mx.save_safetensors(str(ref_dir / "model.safetensors"), {k: mx.array(v) for k, v in oracle_weights.items()})
    (ref_dir / "config.json").write_text(json.dumps(config))
    ref, _ = load_model(ref_dir)
    model, _, _ = _gguf_model(tmp_path / "m.gguf")
    gate_up = model.model.layers[0].mlp.gate_up_proj
    assert isinstance(gate_up, QuantizedLinear) and gate_up.bits == (4 if qtype == Q.Q4_K else 8)
    got, want = model(TOKENS, DenseKVCache(len(model.layers))), ref(TOKENS)
    # Q6_K: the requantization's error with random int8 sub-block scales (one
    # sub-block up to 100x its neighbour: its worst case; a real file's error
    # is measured in test_gguf_quants.py)
    tol = 3e-2 if qtype == Q.Q6_K else 1e-3
    assert (mx.abs(got - want).max() / mx.abs(want).max()).item() < tol


def test_unloadable_tensor_types_are_named(tmp_path):
    src = make_tiny_model(tmp_path / "src", "llama", hidden_size=256, intermediate_size=512)
    config = json.loads((src / "config.json").read_text())
    weights = {k: np.array(v) for k, v in mx.load(str(src / "model.safetensors")).items()}
    write_kquant_gguf(tmp_path / "m.gguf", config, weights, Q.Q2_K)
    with pytest.raises(ValueError, match="is Q2_K, which cannot be loaded yet.*Q4_K"):
        gguf.read_gguf(tmp_path / "m.gguf")


def test_unsupported_gguf_architecture_lists_supported(tmp_path):
    src = make_tiny_model(tmp_path / "src", "llama")
    config = json.loads((src / "config.json").read_text())
    weights = {k: np.array(v) for k, v in mx.load(str(src / "model.safetensors")).items()}
    write_tiny_gguf(tmp_path / "m.gguf", config, weights, Q.F32, arch="gptneox")
    _, meta = gguf.read_gguf(tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gptneox'.*llama"):
        gguf.gguf_config(meta)


FUZZ = r"""
import random, sys
from pathlib import Path
from mlxfast.models import gguf
src = Path(sys.argv[1]).read_bytes()
header_end = int(sys.argv[2])
rng = random.Random(1234)
outcomes = {"error": 0, "loaded": 0}
for i in range(int(sys.argv[3])):
    data = bytearray(src)
    for _ in range(rng.randint(1, 4)):
        pos = rng.randrange(header_end)
        data[pos] = rng.randrange(256)
    if rng.random() < 0.3:
        data = data[: rng.randrange(len(data))]
    p = Path(sys.argv[4])
    p.write_bytes(bytes(data))
    try:
        gguf.read_gguf(p)
        outcomes["loaded"] += 1
    except ValueError:
        outcomes["error"] += 1
print(outcomes)
"""


def test_damaged_gguf_headers_raise_never_crash(tmp_path):
    """Random byte flips and truncations in the header: a ValueError or a
    load, never a crashed process (MLX's own reader segfaults on some)."""
    src = make_tiny_model(tmp_path / "src", "llama")
    config = json.loads((src / "config.json").read_text())
    weights = {k: np.array(v) for k, v in mx.load(str(src / "model.safetensors")).items()}
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, config, weights, Q.Q8_0)
    # The header is everything before the first tensor's data.
    from gguf import GGUFReader

    header_end = GGUFReader(str(path)).data_offset
    proc = subprocess.run(
        [sys.executable, "-c", FUZZ, str(path), str(header_end), "400", str(tmp_path / "bad.gguf")],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    outcomes = eval(proc.stdout.strip().splitlines()[-1])
    assert outcomes["error"] > 100  # most damage is caught, and all of it is survived


def test_truncated_gguf_names_the_problem(tmp_path):
    src = make_tiny_model(tmp_path / "src", "llama")
    config = json.loads((src / "config.json").read_text())
    weights = {k: np.array(v) for k, v in mx.load(str(src / "model.safetensors")).items()}
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, config, weights, Q.Q4_1)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match="truncated"):
        gguf.read_gguf(path)
