"""Every supported HF model type, as a tiny random model, against mlx-lm."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model
from tiny_models import TOKENS, build_from_dir, make_tiny_model, rel_err

from mlxfast.kv import DenseKVCache
from mlxfast.models.loader import load_hf_dir

CASES = [
    ("llama", mx.float32, None),
    ("mistral", mx.float32, None),
    ("qwen2", mx.float32, None),
    ("qwen3", mx.float32, None),
    ("llama", mx.float16, None),
    ("qwen3", mx.bfloat16, None),
    ("llama", mx.float32, {"group_size": 32, "bits": 4}),
    ("mistral", mx.float16, {"group_size": 64, "bits": 8}),
    ("qwen2", mx.float32, {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}),
    ("qwen3", mx.float32, {"group_size": 32, "bits": 4, "lm_head": False}),
    ("gemma3_text", mx.float32, None),
    ("gemma3_text", mx.bfloat16, None),
    ("gemma3_text", mx.float16, None),
    ("gemma3_text", mx.float32, {"group_size": 32, "bits": 4}),
]
TOL = {mx.float32: 1e-4, mx.float16: 1e-2, mx.bfloat16: 3e-2}


@pytest.mark.parametrize("model_type,dtype,quant", CASES)
@pytest.mark.parametrize("batch", [1, 2])
def test_logits_match_mlx_lm(tmp_path, model_type, dtype, quant, batch):
    path = make_tiny_model(tmp_path / "m", model_type, dtype=dtype, quantize=quant)
    ours = build_from_dir(path)
    ref, _ = load_model(path)
    tokens = mx.array(TOKENS[:batch])
    tol = TOL[dtype] if quant is None else max(TOL[dtype], 2e-3)

    # Whole sequence in one forward, no cache reuse.
    full = ours(tokens, DenseKVCache.for_model(ours))
    full_ref = ref(tokens)
    assert full.shape == full_ref.shape == (batch, tokens.shape[1], 256)
    if dtype == mx.float32:
        assert rel_err(full, full_ref) < tol
    else:
        # Two half-precision implementations round differently; both are
        # judged against the same weights run in fp32, and ours must be at
        # least about as close as mlx-lm's own.
        ref32, _ = load_model(path)
        ref32.set_dtype(mx.float32)
        exact = ref32(tokens)
        assert rel_err(full, exact) < max(tol, 1.5 * rel_err(full_ref, exact))
        assert rel_err(full, full_ref) < 3 * tol

    # A prefix, then one token at a time through the KV cache.
    cache = DenseKVCache.for_model(ours)
    ref_cache = make_prompt_cache(ref)
    steps = [ours(tokens[:, :6], cache)]
    cache.advance(6)
    ref_steps = [ref(tokens[:, :6], cache=ref_cache)]
    for i in range(6, tokens.shape[1]):
        steps.append(ours(tokens[:, i:i + 1], cache))
        cache.advance(1)
        ref_steps.append(ref(tokens[:, i:i + 1], cache=ref_cache))
    inc, inc_ref = mx.concatenate(steps, axis=1), mx.concatenate(ref_steps, axis=1)
    assert rel_err(inc, inc_ref) < (tol if dtype == mx.float32 else 3 * tol)
    assert rel_err(inc, full) < max(tol, 1e-3 if dtype == mx.float32 else tol)


def test_quantized_layers_are_quantized(tmp_path):
    quant = {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}, "lm_head": False}
    path = make_tiny_model(tmp_path / "m", "qwen3", quantize=quant)
    model = build_from_dir(path)
    from mlxfast.models.layers import Linear, QuantizedEmbedding, QuantizedLinear

    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert model.model.embed_tokens.bits == 8
    qkv = model.model.layers[0].self_attn.qkv_proj  # q/k/v fused at load
    assert isinstance(qkv, QuantizedLinear) and qkv.bits == 4
    assert qkv.weight.shape[0] == (4 + 2 * 2) * 32  # qwen3 tiny: 4 q heads, 2 kv heads, head_dim 32
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, QuantizedLinear)
    assert isinstance(model.lm_head, Linear)


def test_unlike_projections_stay_separate(tmp_path):
    quant = {"group_size": 32, "bits": 4, "model.layers.0.self_attn.k_proj": {"group_size": 32, "bits": 8}}
    path = make_tiny_model(tmp_path / "m", "llama", quantize=quant)
    model = build_from_dir(path)
    attn0, attn1 = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    assert "qkv_proj" not in attn0 and attn0.k_proj.bits == 8
    assert "qkv_proj" in attn1


def test_load_hf_dir_returns_model_and_tokenizer(tmp_path):
    path = make_tiny_model(tmp_path / "m", "llama")
    model, tok = load_hf_dir(path)
    ids = tok.encode("w5 w17 w99", add_special_tokens=False)
    assert ids == [5, 17, 99]
    logits = model(mx.array([ids]), DenseKVCache(len(model.layers)))
    assert logits.shape == (1, 3, 256)


def test_gemma3_final_logit_softcapping(tmp_path):
    """A config's final_logit_softcapping c bounds the logits: c * tanh(z / c)."""
    import json

    path = make_tiny_model(tmp_path / "m", "gemma3_text")
    plain = build_from_dir(path)
    config = json.loads((path / "config.json").read_text())
    config["final_logit_softcapping"] = 5.0
    (path / "config.json").write_text(json.dumps(config))
    capped = build_from_dir(path)
    tokens = mx.array(TOKENS)
    z = plain(tokens, DenseKVCache.for_model(plain))
    got = capped(tokens, DenseKVCache.for_model(capped))
    assert mx.abs(z).max().item() > 5.0  # the cap bites
    assert mx.allclose(got, 5.0 * mx.tanh(z / 5.0), atol=1e-5).item()


def test_gemma3_rejects_what_it_cannot_run(tmp_path):
    import json

    path = make_tiny_model(tmp_path / "m", "gemma3_text")
    config = json.loads((path / "config.json").read_text())
    for key, value, match in (("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
                              ("hidden_activation", "relu", "activation")):
        bad = dict(config, **{key: value})
        (path / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match):
            build_from_dir(path)
