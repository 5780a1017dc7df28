"""MoE GGUF files (qwen3moe; llama with experts = Mixtral, stacked ``*_exps``
tensors or the older per-expert ones) written by the tests with the gguf
package: the same logits as mlx-lm on the same values in HF layout, and
llama.cpp (llama-cpp-python) agrees on the same file (teacher-forced top-1)."""

import json

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from mlx_lm.utils import load_model
from tiny_gguf import BOS, CHAT_SPECIALS, EOS, PAD, chat_vocab
from tiny_moe import hf_weights_np, make_tiny_moe, write_moe_gguf

from mlxfast import ops
from mlxfast.kv import DenseKVCache
from mlxfast.models import gguf
from mlxfast.models.layers import pack_rows16, set_matmul_activations
from mlxfast.models.loader import build_model
from mlxfast.models.moe import QuantizedSwitchLinear, SparseMoE, SwitchLinear

VOCAB = len(chat_vocab())  # 262: a byte-level BPE vocabulary llama.cpp can load
# llama.cpp's qwen3moe makes every layer MoE and renormalises the top k.
OVERRIDES = {"qwen3_moe": dict(mlp_only_layers=[], norm_topk_prob=True, num_hidden_layers=2),
             "mixtral": {}}


def _vocab(w):
    tokens = chat_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(CHAT_SPECIALS) + [1] * (len(tokens) - len(CHAT_SPECIALS)))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_pad_token_id(PAD)
    w.add_add_bos_token(False)


def _gguf_model(path):
    tensors, meta = gguf.read_gguf(path)
    config = gguf.gguf_config(meta)
    weights, quant = gguf.hf_weights(tensors, config)
    return build_model(config, weights, quant), config


def _write(tmp_path, model_type, qtype, per_expert=False, seed=0, **dims):
    src = make_tiny_moe(tmp_path / "src", model_type, vocab_size=VOCAB, seed=seed,
                        **OVERRIDES[model_type], **dims)
    config, weights = hf_weights_np(src)
    kept = write_moe_gguf(tmp_path / "m.gguf", config, weights, qtype, per_expert=per_expert,
                          vocab=_vocab)
    return config, kept


@pytest.mark.parametrize("model_type,per_expert", [("qwen3_moe", False), ("mixtral", False),
                                                   ("mixtral", True)])
@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_gguf_matches_mlx_lm_on_hf_layout(tmp_path, model_type, per_expert, qtype):
    config, kept = _write(tmp_path, model_type, qtype, per_expert)
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    mx.save_safetensors(str(ref_dir / "model.safetensors"), {k: mx.array(v) for k, v in kept.items()})
    (ref_dir / "config.json").write_text(json.dumps(config))
    ref, _ = load_model(ref_dir)

    model, gcfg = _gguf_model(tmp_path / "m.gguf")
    assert gcfg["model_type"] == model_type and gcfg["gguf_architecture"] in ("qwen3moe", "llama")
    layer = model.model.layers[0]
    moe = layer.mlp if model_type == "qwen3_moe" else layer.block_sparse_moe
    assert isinstance(moe, SparseMoE) and moe.top_k == 2 and moe.normalize == (model_type == "qwen3_moe")
    kind = SwitchLinear if qtype in (Q.F32, Q.F16) else QuantizedSwitchLinear
    assert isinstance(moe.switch_mlp.gate_proj, kind) and moe.switch_mlp.down_proj.weight.shape[0] == 8
    if kind is QuantizedSwitchLinear:
        assert moe.switch_mlp.gate_proj.bits == (8 if qtype == Q.Q8_0 else 4)
        # Q4_0 / Q8_0 are symmetric: their experts keep no biases (Q4_1's are real)
        assert ("biases" in moe.switch_mlp.down_proj) == (qtype == Q.Q4_1)
    tokens = mx.array([[5, 17, 99, 3, 200, 42, 7, 150, 64, 11]])
    got, want = model(tokens, DenseKVCache.for_model(model)), ref(tokens)
    err = (mx.abs(got - want).max() / mx.abs(want).max()).item()
    assert err < 1e-4, err
    # The AVX-512 path's load-time layout (layers.pack_rows16) packs the
    # 4- and 8-bit experts too, and computes the same model.
    packed_layers = pack_rows16(model)
    if ops.cpu_path() == "avx512":
        assert (packed_layers > 0) == (getattr(moe.switch_mlp.gate_proj, "bits", 0) in (4, 8))
    if packed_layers:
        assert moe.switch_mlp.gate_proj["weight"].ndim == 4
        packed = model(tokens, DenseKVCache.for_model(model))
        assert (mx.abs(packed - want).max() / mx.abs(want).max()).item() < 1e-4


def test_gguf_moe_metadata_errors():
    base = {"general.architecture": "qwen3moe", "qwen3moe.block_count": 2,
            "qwen3moe.embedding_length": 64, "qwen3moe.attention.head_count": 4,
            "qwen3moe.expert_count": 8, "qwen3moe.expert_used_count": 2,
            "qwen3moe.expert_feed_forward_length": 32, "qwen3moe.vocab_size": 100}
    cfg = gguf.gguf_config(dict(base))
    assert cfg["model_type"] == "qwen3_moe" and cfg["moe_intermediate_size"] == 32
    assert cfg["intermediate_size"] == 32  # no dense feed_forward_length: the experts' size
    with pytest.raises(ValueError, match="expert_used_count 9"):
        gguf.gguf_config(dict(base, **{"qwen3moe.expert_used_count": 9}))
    with pytest.raises(ValueError, match="expert_feed_forward_length"):
        gguf.gguf_config({k: v for k, v in base.items() if "feed_forward" not in k})
    llama = {k.replace("qwen3moe", "llama"): v for k, v in base.items()}
    llama["general.architecture"] = "llama"
    llama["llama.feed_forward_length"] = 48
    assert gguf.gguf_config(llama)["model_type"] == "mixtral"
    assert gguf.gguf_config(dict(llama, **{"llama.expert_count": 0}))["model_type"] == "llama"


def _scores(llm, ids):
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float32)


def _argmax_ours(model, ids):
    return np.array(mx.argmax(model(mx.array([ids]), DenseKVCache.for_model(model))[0], -1))


# llama.cpp no longer reads the per-expert Mixtral layout (it wants ffn_*_exps):
# those files are checked against mlx-lm above only.
@pytest.mark.parametrize("model_type,per_expert", [("qwen3_moe", False), ("mixtral", False)])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0])
def test_llama_cpp_agrees_on_the_same_file(tmp_path, model_type, per_expert, qtype):
    """Teacher-forced top-1 against llama.cpp on the same files: the quantized
    one, and an F32 and an F16 one holding the same weight values.

    On F32/F16 files llama.cpp computes nearly exactly, and agreement is
    >= 95% (measured 98-100%). On Q8_0/Q4_0 files llama.cpp rounds its
    activations to 8 bits per block of 32 for every quantized matmul, and in
    a tiny random MoE that swaps experts at some routing near-ties: llama.cpp
    then disagrees with itself (the F32 file of the same values) on 4-14% of
    the positions, and with us on as many (measured: always within 0.5% of
    its self-disagreement). So there ours must agree with llama.cpp as well
    as llama.cpp agrees with itself; with int8 activations (the experts'
    and the attention's, where this CPU has the kernel) as well."""
    llama_cpp = pytest.importorskip("llama_cpp")
    dims = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                **({"head_dim": 32, "moe_intermediate_size": 64} if model_type == "qwen3_moe"
                   else {"intermediate_size": 128}))
    src = make_tiny_moe(tmp_path / "src", model_type, vocab_size=VOCAB, seed=1,
                        **OVERRIDES[model_type], **dims)
    config, weights = hf_weights_np(src)
    files = {"q": tmp_path / "q.gguf", "f32": tmp_path / "f32.gguf", "f16": tmp_path / "f16.gguf"}
    kept = write_moe_gguf(files["q"], config, weights, qtype, per_expert=per_expert, vocab=_vocab)
    write_moe_gguf(files["f32"], config, kept, Q.F32, per_expert=per_expert, vocab=_vocab)
    write_moe_gguf(files["f16"], config, kept, Q.F16, per_expert=per_expert, vocab=_vocab)
    ours = {name: _gguf_model(f)[0] for name, f in files.items()}
    if ops.int8_activations_unsupported() == "":
        ours["q_int8"] = _gguf_model(files["q"])[0]
        assert set_matmul_activations(ours["q_int8"], "int8") > 0
        experts = [m for _, m in ours["q_int8"].named_modules() if isinstance(m, QuantizedSwitchLinear)]
        assert experts and all(m.activations == "int8" for m in experts)
    cpp = {name: llama_cpp.Llama(str(f), n_ctx=256, logits_all=True, verbose=False, n_threads=2,
                                 seed=0) for name, f in files.items()}
    rng = np.random.default_rng(0)
    agree = {"cpp_self": 0, **{name: 0 for name in ours}}
    total = 0
    for _ in range(4):
        ids = rng.integers(len(CHAT_SPECIALS), VOCAB, size=64).tolist()
        ref = {name: _scores(llm, ids).argmax(-1) for name, llm in cpp.items()}
        for name, model in ours.items():
            agree[name] += int((_argmax_ours(model, ids) == ref[name.split("_")[0]]).sum())
        agree["cpp_self"] += int((ref["q"] == ref["f32"]).sum())
        total += len(ids)
    share = {k: v / total for k, v in agree.items()}
    print(f"{model_type} {qtype.name} per_expert={per_expert}: top-1 agreement {share}")
    assert share["f32"] >= 0.95 and share["f16"] >= 0.95, share
    assert share["q"] >= share["cpp_self"] - 0.02, share
    if "q_int8" in share:
        assert share["q_int8"] >= share["cpp_self"] - 0.02, share
