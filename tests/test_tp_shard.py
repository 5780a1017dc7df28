"""Tensor-parallel sharding in one process (models/shard.py).

Each rank's shard is built here with a singleton group, whose all_sum is the
identity: a row-parallel projection then returns ``residual + its partial
product``, and the partial products of the N shards must add up to the whole
layer's. That checks the segment-aware slicing of the fused qkv / gate_up
weights, the input-column slicing of o / down (quantized: along groups), the
local head counts that qkv_rope and attention see, and the residual moving
after the reduction. The real multi-rank runs are tests/test_tp_parity.py
and tests/test_tp_server.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxfast.kv.dense import DenseKVCache
from mlxfast.models.layers import QuantizedLinear, token_positions
from mlxfast.models.loader import load
from mlxfast.models.shard import ShardError, check_shardable, param_bytes, shard_model
from tiny_models import make_tiny_model

TP_MODEL = {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4,
            "intermediate_size": 512}


@pytest.fixture(scope="module")
def group():
    return mx.distributed.init()  # not launched: a singleton group (all_sum = identity)


@pytest.fixture(scope="module", params=["llama-f32", "qwen2-bias", "llama-q4", "llama-q4-symmetric",
                                        "phi3", "gemma3"])
def tiny(request, tmp_path_factory):
    kind = request.param
    out = tmp_path_factory.mktemp("tp") / kind
    if kind == "llama-f32":
        return make_tiny_model(out, "llama", **TP_MODEL)
    if kind == "qwen2-bias":  # q/k/v biases (fused with them)
        return make_tiny_model(out, "qwen2", **TP_MODEL)
    if kind == "llama-q4":
        return make_tiny_model(out, "mistral", quantize={"group_size": 64, "bits": 4}, **TP_MODEL)
    if kind == "llama-q4-symmetric":  # every bias -8 * scale (as GGUF's Q4_0): loaded without biases
        path = make_tiny_model(out, "mistral", quantize={"group_size": 64, "bits": 4}, **TP_MODEL)
        w = mx.load(str(path / "model.safetensors"))
        w.update({k: w[k[:-len("biases")] + "scales"] * -8 for k in w if k.endswith(".biases")})
        mx.save_safetensors(str(path / "model.safetensors"), w, metadata={"format": "mlx"})
        return path
    if kind == "gemma3":  # q/k norms, GELU MLP without a residual (a norm follows it), sliding layers
        return make_tiny_model(out, "gemma3_text", **TP_MODEL)
    return make_tiny_model(out, "phi3", **TP_MODEL)


def _attn_and_mlp(model, layer, x):
    """The layer's attention and MLP outputs, each with x as its residual
    (Gemma 3's MLP takes none: a norm follows it)."""
    blk = model.layers[layer]
    cache = DenseKVCache.for_model(model)
    pos = token_positions(cache.offsets, *x.shape[:2])
    a = blk.self_attn(x, cache, pos, norm=blk.input_layernorm, residual=x)
    if model.model_type == "gemma3_text":
        m = x + blk.mlp(x, norm=blk.pre_feedforward_layernorm)
    else:
        m = blk.mlp(x, norm=blk.post_attention_layernorm, residual=x)
    return a, m


@pytest.mark.parametrize("size", [2, 4])
def test_partial_products_add_up_to_the_whole_layer(tiny, group, size):
    full, _ = load(tiny)
    x = mx.random.normal((1, 7, TP_MODEL["hidden_size"]), key=mx.random.key(3)).astype(full.dtype)
    want = [_attn_and_mlp(full, i, x) for i in range(len(full.layers))]
    parts = []
    for r in range(size):
        shard, _ = load(tiny)
        info = shard_model(shard, group, rank=r, size=size)
        assert info.rank == r and info.size == size
        quantized = [m for _, m in shard.named_modules() if isinstance(m, QuantizedLinear)]
        if tiny.name == "llama-q4-symmetric":  # the shards keep the full layers' lack of biases
            assert quantized and not any("biases" in m for m in quantized)
        assert shard.args.num_attention_heads == 8 // size
        assert {kv.n_kv_heads for kv in shard.kv_layers} == {4 // size}
        parts.append([_attn_and_mlp(shard, i, x) for i in range(len(shard.layers))])
    for i, (wa, wm) in enumerate(want):
        got_a = x + sum(p[i][0] - x for p in parts)
        got_m = x + sum(p[i][1] - x for p in parts)
        np.testing.assert_allclose(np.array(got_a), np.array(wa), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.array(got_m), np.array(wm), rtol=1e-4, atol=1e-4)


def test_param_bytes_are_a_share_plus_the_replicated_parts(tiny, group):
    full, _ = load(tiny)
    total = param_bytes(full)
    replicated = param_bytes(full.model.embed_tokens) + param_bytes(full.model.norm) + sum(
        param_bytes(blk.input_layernorm) + param_bytes(blk.post_attention_layernorm)
        for blk in full.layers)
    head = param_bytes(full.lm_head) if "lm_head" in full else 0
    shards = []
    for r in range(2):
        m, _ = load(tiny)
        shards.append(shard_model(m, group, rank=r, size=2))
    for info in shards:
        assert info.full_param_bytes == total
        share = (total - replicated - head) / 2
        expect = share + replicated + (head if info.rank == 0 else 0)
        assert abs(info.param_bytes - expect) <= 0.01 * total, (info, expect)


def test_rank_other_than_0_ends_at_the_hidden_state(group, tmp_path):
    path = make_tiny_model(tmp_path / "m", "mistral", **TP_MODEL)
    m, _ = load(path)
    shard_model(m, group, rank=1, size=2)
    assert "lm_head" not in m
    out = m(mx.array([[5, 6, 7]]), DenseKVCache.for_model(m))
    assert out.shape == (1, 3, TP_MODEL["hidden_size"])


def test_heads_that_do_not_divide_are_a_clear_error(group):
    full, _ = load()  # the default model: 9 query heads, 3 KV heads
    with pytest.raises(ShardError, match=r"9 attention heads and 3 KV heads do not divide by 2.*"
                                         r"Sizes that divide: 3"):
        shard_model(full, group, rank=0, size=2)
    check_shardable(full.args, 3)  # 3 ranks split it


def test_quantization_groups_cut_by_the_split_are_refused(group, tmp_path):
    # o_proj takes 8 heads x 16 = 128 inputs in groups of 128: half a group per rank.
    path = make_tiny_model(tmp_path / "q", "llama", quantize={"group_size": 128, "bits": 4},
                           hidden_size=128, num_attention_heads=8, num_key_value_heads=4,
                           intermediate_size=512)
    m, _ = load(path)
    with pytest.raises(ShardError, match=r"o_proj: this rank's input slice \[0, 64\) cuts the "
                                         r"quantization groups of 128"):
        shard_model(m, group, rank=0, size=2)
    assert isinstance(m.layers[0].self_attn.o_proj, QuantizedLinear)  # left whole
    assert m.layers[0].self_attn.n_heads == 8


def test_mixture_of_experts_is_refused(group):
    from mlxfast.models import moe

    args = moe.ModelArgs.from_config({"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 1,
                                      "intermediate_size": 128, "moe_intermediate_size": 64,
                                      "num_attention_heads": 4, "num_key_value_heads": 2,
                                      "vocab_size": 32, "num_experts": 4, "num_experts_per_tok": 2})
    with pytest.raises(ShardError, match="dense families"):
        shard_model(moe.Model(args), group, rank=0, size=2)
