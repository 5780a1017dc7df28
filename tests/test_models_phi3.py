"""Phi-3 (HF ``phi3``, GGUF ``phi3``): tiny random models against mlx-lm and
llama.cpp, the paged engine, the chat template and its ``<|end|>`` stop.

Variants (all with a sliding_window of 4 that every reference ignores):
``plain`` (Phi-3-mini-4k: full RoPE), ``su`` (Phi-3-mini-128k: LongRoPE,
full RoPE, untied head), ``longrope`` (Phi-4-mini: LongRoPE on 3/4 of each
head, tied embeddings). LongRoPE configs claim a context 8x the original
one, so the attention factor is sqrt(1 + ln 8 / ln 256) and the long factors
(random, 1..8) are what mlx-lm and llama.cpp (context above the original)
rotate with.
"""

from __future__ import annotations

import asyncio
import json

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf_oracle import (ASSISTANT, END, ENDOFTEXT, SPECIALS, SYSTEM, VOCAB, add_tensors, add_vocab,
                         agreement, byte_chars, byte_id, finish, llama_cpp_logits, sequences)
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model
from tiny_gguf import roundtrip
from tiny_models import TOKENS, build_from_dir, make_tiny_model, rel_err, rms_err

from mlxfast.kv import DenseKVCache
from mlxfast.models import gguf
from mlxfast.models.layers import QuantizedLinear
from mlxfast.models.loader import build_model, load, read_hf_config

HEAD_DIM = 16  # tiny_models: hidden 64, 4 heads
ORIGINAL = 256  # llama.cpp rounds its context up to 256: short factors need it this long


def _factors(n: int, seed: int, lo: float, hi: float) -> list[float]:
    return [float(x) for x in np.random.default_rng(seed).uniform(lo, hi, n)]


def variant(name: str) -> dict:
    """make_tiny_model overrides of each variant."""
    if name == "plain":
        return {}
    longrope = dict(max_position_embeddings=8 * ORIGINAL, original_max_position_embeddings=ORIGINAL)
    if name == "su":
        n = HEAD_DIM // 2
        return dict(longrope, rope_scaling={"type": "su", "long_factor": _factors(n, 1, 1, 8),
                                            "short_factor": _factors(n, 2, 1, 1.5)})
    if name == "longrope":
        n = int(HEAD_DIM * 0.75) // 2
        return dict(longrope, partial_rotary_factor=0.75, tie_word_embeddings=True,
                    rope_scaling={"type": "longrope", "long_factor": _factors(n, 3, 1, 8),
                                  "short_factor": _factors(n, 4, 1, 1.5)})
    raise KeyError(name)


CASES = [
    ("plain", mx.float32, None),
    ("su", mx.float32, None),
    ("longrope", mx.float32, None),
    ("longrope", mx.bfloat16, None),
    ("su", mx.float16, None),
    ("plain", mx.float32, {"group_size": 32, "bits": 4, "lm_head": False}),
    ("su", mx.float16, {"group_size": 64, "bits": 8}),
    ("longrope", mx.float32, {"group_size": 32, "bits": 4}),
]
TOL = {mx.float32: 1e-4, mx.float16: 1e-2, mx.bfloat16: 3e-2}


def test_config_reads_partial_rope_and_longrope(tmp_path):
    model = build_from_dir(make_tiny_model(tmp_path / "m", "phi3", **variant("longrope")))
    a = model.args
    assert model.model_type == "phi3" and a.head_dim == HEAD_DIM and a.rope_dims == 12
    assert a.rope_attention_factor == pytest.approx((1 + np.log(8) / np.log(ORIGINAL)) ** 0.5)
    attn = model.model.layers[0].self_attn
    # the checkpoint's fused projections, as they are
    assert attn.qkv_proj.weight.shape == ((4 + 2 * 2) * HEAD_DIM, 64) and "q_proj" not in attn
    assert model.model.layers[0].mlp.gate_up_proj.weight.shape == (2 * 128, 64)
    assert attn.rope.dims == 12 and attn.rope["_freqs"].shape == (6,)
    assert [layer.window for layer in model.kv_layers] == [0, 0]  # sliding_window 4 not applied


@pytest.mark.parametrize("name,dtype,quant", CASES)
@pytest.mark.parametrize("batch", [1, 2])
def test_logits_match_mlx_lm(tmp_path, name, dtype, quant, batch):
    path = make_tiny_model(tmp_path / "m", "phi3", dtype=dtype, quantize=quant, **variant(name))
    ours = build_from_dir(path)
    ref, _ = load_model(path)
    if quant is not None:
        qkv = ours.model.layers[0].self_attn.qkv_proj
        assert isinstance(qkv, QuantizedLinear) and qkv.bits == quant["bits"]
    tokens = mx.array(TOKENS[:batch])
    tol = TOL[dtype] if quant is None else max(TOL[dtype], 2e-3)

    full = ours(tokens, DenseKVCache.for_model(ours))
    full_ref = ref(tokens)
    assert full.shape == full_ref.shape == (batch, tokens.shape[1], 256)
    if dtype == mx.float32:
        assert rel_err(full, full_ref) < tol
    else:
        # Judged against the same weights in fp32: at least about as close as
        # mlx-lm's own (rms: the largest error of two roundings is a matter of
        # chance, 1.6x either way over seeds; the rms ratio stays within 1.3x).
        ref32, _ = load_model(path)
        ref32.set_dtype(mx.float32)
        exact = ref32(tokens)
        assert rms_err(full, exact) < 1.5 * rms_err(full_ref, exact)
        assert rel_err(full, full_ref) < 3 * tol

    # a prefix, then one token at a time through the KV cache
    cache, ref_cache = DenseKVCache.for_model(ours), make_prompt_cache(ref)
    steps, ref_steps = [ours(tokens[:, :6], cache)], [ref(tokens[:, :6], cache=ref_cache)]
    cache.advance(6)
    for i in range(6, tokens.shape[1]):
        steps.append(ours(tokens[:, i:i + 1], cache))
        cache.advance(1)
        ref_steps.append(ref(tokens[:, i:i + 1], cache=ref_cache))
    inc, inc_ref = mx.concatenate(steps, axis=1), mx.concatenate(ref_steps, axis=1)
    assert rel_err(inc, inc_ref) < (tol if dtype == mx.float32 else 3 * tol)
    assert rel_err(inc, full) < max(tol, 1e-3 if dtype == mx.float32 else tol)


def test_longrope_pieces_each_matter(tmp_path):
    """The parity above would not hold without each LongRoPE piece: dropping
    the attention factor or rotating with the short factors moves the logits
    far beyond its tolerance."""
    path = make_tiny_model(tmp_path / "m", "phi3", **variant("longrope"))
    ref, _ = load_model(path)
    tokens = mx.array(TOKENS)
    want = ref(tokens)
    config = read_hf_config(path)
    weights = mx.load(str(path / "model.safetensors"))
    assert rel_err(build_model(config, weights, {})(tokens, DenseKVCache(2)), want) < 1e-4
    no_factor = dict(config, rope_scaling=dict(config["rope_scaling"], attention_factor=1.0))
    short = dict(config, rope_scaling=dict(config["rope_scaling"],
                                            long_factor=config["rope_scaling"]["short_factor"]))
    for wrong in (no_factor, short):
        assert rel_err(build_model(wrong, weights, {})(tokens, DenseKVCache(2)), want) > 1e-2


@pytest.mark.parametrize("name,quant", [("su", None), ("longrope", {"group_size": 32, "bits": 4})])
def test_greedy_continuation_matches_mlx_lm(tmp_path, name, quant):
    from mlx_lm.generate import generate_step

    from mlxfast.generation import stream_generate

    path = make_tiny_model(tmp_path / "m", "phi3", quantize=quant, **variant(name))
    model, tok = load(path)
    ref, _ = load_model(path)
    tok.eos_token_ids = set()  # the random model writes </s> soon; mlx-lm's loop does not stop
    prompt = TOKENS[0]
    ours = [c.token for c in stream_generate(model, tok, prompt, max_tokens=32, chat=False)]
    theirs = [int(t) for t, _ in generate_step(mx.array(prompt), ref, max_tokens=32)]
    assert len(ours) == 32 and ours == theirs
    assert len(set(ours)) > 3  # not one token over and over


def test_engine_matches_one_shot(tmp_path):
    """The paged engine (chunked prefill, batching, partial LongRoPE through
    PagedContext) scores and continues as one plain forward does."""
    from engine_utils import ToyTokenizer, greedy

    from mlxfast.engine.api import Request, TokenEvent
    from mlxfast.engine.config import EngineConfig
    from mlxfast.engine.engine import Engine

    model, _ = load(make_tiny_model(tmp_path / "m", "phi3", **variant("longrope")))
    rng = np.random.default_rng(5)
    prompts = [[int(x) for x in rng.integers(3, 97, n)] for n in (70, 33, 9)]
    eng = Engine(model, ToyTokenizer(), EngineConfig(num_blocks=200, block_size=4, kv_dtype="float32",
                                                     max_num_batched_tokens=32)).start()
    try:
        async def one(p):
            params = greedy(6, ignore_eos=True, prompt_logprobs=0, logprobs=True)
            return [ev async for ev in eng.submit(Request(p, params))]

        async def main():
            return await asyncio.gather(*(one(p) for p in prompts))

        results = asyncio.run(main())
    finally:
        eng.shutdown()
    for p, events in zip(prompts, results):
        toks = [e.token_id for e in events if isinstance(e, TokenEvent)]
        scores = np.array([e.logprob for e in events[0].prompt_logprobs[1:]])
        logits = model(mx.array([p + toks]), DenseKVCache.for_model(model))[0].astype(mx.float32)
        ref = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        n = len(p)
        np.testing.assert_allclose(scores, ref[np.arange(n - 1), p[1:]], atol=5e-4)
        assert toks == [int(ref[n - 1 + i].argmax()) for i in range(len(toks))]


# ---------------------------------------------------------------- GGUF

PHI3_TEMPLATE = (  # Phi-3.5-mini-instruct's
    "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")

_GGUF_NAMES = {"self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
               "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    parts = hf.split(".")
    return f"blk.{parts[2]}.{_GGUF_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"


def write_phi3_gguf(path, config: dict, weights: dict, qtype, chat_template: str | None = None):
    """HF-named fp32 numpy weights as the GGUF llama.cpp's converter writes for
    phi3 (fused attn_qkv and ffn_up as they are, no q/k permutation; LongRoPE
    factors as tensors, its attention factor and original context as keys)."""
    w = GGUFWriter(str(path), "phi3")
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_rope_dimension_count(int(config.get("partial_rotary_factor", 1.0) * config["hidden_size"])
                               // config["num_attention_heads"])
    w.add_sliding_window(config["sliding_window"])
    w.add_vocab_size(config["vocab_size"])
    scaling = config.get("rope_scaling")
    if scaling:
        orig = config["original_max_position_embeddings"]
        s = config["max_position_embeddings"] / orig
        w.add_rope_scaling_attn_factors((1 + np.log(s) / np.log(orig)) ** 0.5)
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], np.float32))
    add_vocab(w, chat_template)
    add_tensors(w, {_gguf_name(k): v for k, v in weights.items()}, qtype)
    finish(w)
    return path


def _tiny_gguf(tmp_path, name: str, qtype, **overrides):
    src = make_tiny_model(tmp_path / "src", "phi3", vocab_size=VOCAB, **{**variant(name), **overrides})
    config = read_hf_config(src)
    weights = {k: np.array(v) for k, v in mx.load(str(src / "model.safetensors")).items()}
    return write_phi3_gguf(tmp_path / "m.gguf", config, weights, qtype), src, config, weights


def _gguf_model(path):
    tensors, meta = gguf.read_gguf(path)
    config = gguf.gguf_config(meta)
    weights, quant = gguf.hf_weights(tensors, config)
    return build_model(config, weights, quant), config


@pytest.mark.parametrize("name", ["plain", "su", "longrope"])
@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0])
def test_gguf_matches_mlx_lm_on_hf_layout(tmp_path, name, qtype):
    path, src, config, weights = _tiny_gguf(tmp_path, name, qtype)
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    kept = {k: mx.array(roundtrip(v, qtype) if v.ndim == 2 else v) for k, v in weights.items()}
    mx.save_safetensors(str(ref_dir / "model.safetensors"), kept)
    (ref_dir / "config.json").write_text(json.dumps(config))
    ref, _ = load_model(ref_dir)

    model, gcfg = _gguf_model(path)
    assert gcfg["model_type"] == "phi3" and gcfg["tie_word_embeddings"] == config["tie_word_embeddings"]
    assert model.args.rope_dims == int(HEAD_DIM * config.get("partial_rotary_factor", 1.0))
    assert model.args.rope_scaling == (None if name == "plain" else {
        "type": "longrope", "long_factor": pytest.approx(config["rope_scaling"]["long_factor"]),
        "short_factor": pytest.approx(config["rope_scaling"]["short_factor"]),
        "attention_factor": pytest.approx(model.args.rope_attention_factor)})
    if name != "plain":
        assert model.args.rope_attention_factor == pytest.approx((1 + np.log(8) / np.log(ORIGINAL)) ** 0.5)
    if qtype == Q.Q8_0:
        assert model.model.layers[0].self_attn.qkv_proj.bits == 8
    tokens = mx.array(TOKENS)
    got, want = model(tokens, DenseKVCache(len(model.layers))), ref(tokens)
    assert rel_err(got, want) < 1e-4
    assert (mx.argmax(got, -1) == mx.argmax(want, -1)).all().item()


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0])
def test_gguf_converts_to_a_directory_mlx_lm_loads(tmp_path, qtype):
    """``mlxfast convert``: the directory's config carries LongRoPE as HF
    writes it; mlxfast computes the same logits from it as from the file,
    and mlx-lm too (F32: mlx-lm dequantizes a quantized embedding in fp16)."""
    from mlxfast.convert import convert_gguf

    path, *_ = _tiny_gguf(tmp_path, "longrope", qtype)
    out = convert_gguf(path, tmp_path / "conv")
    config = read_hf_config(out)
    assert config["model_type"] == "phi3" and config["rope_scaling"]["type"] == "longrope"
    assert config["original_max_position_embeddings"] == ORIGINAL
    tokens = mx.array(TOKENS)
    from_file = _gguf_model(path)[0](tokens, DenseKVCache(2))
    assert rel_err(load(out)[0](tokens, DenseKVCache(2)), from_file) < 1e-5
    if qtype == Q.F32:
        assert rel_err(load_model(out)[0](tokens), from_file) < 1e-4


def _ours_logits(model, ids_list):
    return [np.array(model(mx.array([ids]), DenseKVCache(len(model.layers)))[0].astype(mx.float32))
            for ids in ids_list]


@pytest.mark.parametrize("name", ["plain", "su", "longrope"])
def test_gguf_agrees_with_llama_cpp(tmp_path, name):
    """Teacher-forced top-1 over random sequences, llama.cpp on the same F32
    file with a context above the original one (its long factors, as ours)."""
    path, *_ = _tiny_gguf(tmp_path, name, Q.F32)
    seqs = sequences(7)
    top1, diff = agreement(_ours_logits(_gguf_model(path)[0], seqs),
                            llama_cpp_logits(path, seqs, n_ctx=2 * ORIGINAL))
    print(f"{name} F32: top-1 agreement {top1:.3f}, max rel diff {diff:.2e}")
    assert top1 >= 0.98
    assert diff < 2e-2  # llama.cpp keeps K/V in f16


@pytest.mark.parametrize("name", ["su", "longrope"])
def test_q8_0_gguf_agrees_with_llama_cpp_as_it_does_with_itself(tmp_path, name):
    """A Q8_0 file: llama.cpp rounds the activations to 8 bits too, so it
    disagrees with itself on the same weights in F32 at ~4% of these random
    positions (measured). Ours agree with its Q8_0 run about as often as its
    F32 run does, and with its F32 run almost always."""
    from tiny_gguf import roundtrip as kept

    path, _, config, weights = _tiny_gguf(tmp_path, name, Q.Q8_0)
    f32 = write_phi3_gguf(tmp_path / "kept.gguf", config,
                          {k: kept(v, Q.Q8_0) if v.ndim == 2 else v for k, v in weights.items()}, Q.F32)
    seqs = sequences(7)
    ours = _ours_logits(_gguf_model(path)[0], seqs)
    q8 = llama_cpp_logits(path, seqs, n_ctx=2 * ORIGINAL)
    ref32 = llama_cpp_logits(f32, seqs, n_ctx=2 * ORIGINAL)
    top1, diff = agreement(ours, q8)
    self_top1, self_diff = agreement(ref32, q8)
    top1_32, diff_32 = agreement(ours, ref32)
    print(f"{name} Q8_0: top-1 vs llama.cpp {top1:.3f} (llama.cpp F32 vs Q8_0: {self_top1:.3f}), "
          f"vs llama.cpp F32 {top1_32:.3f}, max rel diff {diff:.2e} ({self_diff:.2e}; {diff_32:.2e})")
    assert top1 >= self_top1 - 0.01 and diff < 1.2 * self_diff
    assert top1_32 >= 0.98 and diff_32 < 2e-2


def test_gguf_long_factors_are_llama_cpps_long_context_ones(tmp_path):
    """llama.cpp rotates with the short factors when its context is within
    the original one and the long ones above it; ours are the long ones (the
    check sees the difference: it is no formality)."""
    path, *_ = _tiny_gguf(tmp_path, "longrope", Q.F32)
    seqs = sequences(8, n=2, length=ORIGINAL // 2)
    ours = _ours_logits(_gguf_model(path)[0], seqs)
    top1_long, diff_long = agreement(ours, llama_cpp_logits(path, seqs, n_ctx=2 * ORIGINAL))
    top1_short, diff_short = agreement(ours, llama_cpp_logits(path, seqs, n_ctx=ORIGINAL))
    print(f"long context: top-1 {top1_long:.3f} diff {diff_long:.2e}; "
          f"short context: top-1 {top1_short:.3f} diff {diff_short:.2e}")
    assert top1_long >= 0.98 and diff_long < 2e-2
    assert diff_short > 10 * diff_long and top1_short < 0.9


# ---------------------------------------------------------------- chat

def _chat_weights(hidden: int, vocab: int) -> dict:
    """A one-layer phi3 model whose next token is a fixed function of the
    current one (attention and MLP write nothing; the head maps a token's
    one-hot embedding to its successor): after a newline "O", then "K", then
    <|end|>, then a newline again; after anything else "O"."""
    nl, o, k = byte_id(ord("\n")), byte_id(ord("O")), byte_id(ord("K"))
    nxt = np.full(vocab, o)
    nxt[nl], nxt[o], nxt[k], nxt[END] = o, k, END, nl
    rng = np.random.default_rng(0)
    embed = np.zeros((vocab, hidden), np.float32)
    embed[np.arange(vocab), np.arange(vocab)] = 1.0
    head = np.zeros((vocab, hidden), np.float32)
    head[nxt, np.arange(vocab)] = 1.0
    p = "model.layers.0."
    return {
        "model.embed_tokens.weight": embed,
        p + "input_layernorm.weight": np.ones(hidden, np.float32),
        p + "self_attn.qkv_proj.weight": rng.normal(0, 0.02, (2 * hidden, hidden)).astype(np.float32),
        p + "self_attn.o_proj.weight": np.zeros((hidden, hidden), np.float32),
        p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
        p + "mlp.gate_up_proj.weight": rng.normal(0, 0.02, (256, hidden)).astype(np.float32),
        p + "mlp.down_proj.weight": np.zeros((hidden, 128), np.float32),
        "model.norm.weight": np.ones(hidden, np.float32),
        "lm_head.weight": head,
    }


CHAT_CONFIG = {"model_type": "phi3", "hidden_size": 288, "num_hidden_layers": 1, "intermediate_size": 128,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
               "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
               "original_max_position_embeddings": 4096, "sliding_window": 2047,
               "tie_word_embeddings": False, "hidden_act": "silu", "eos_token_id": ENDOFTEXT}


def _phi3_hf_tokenizer(out):
    """A byte-level BPE tokenizer.json with Phi-3's added special tokens, and
    Phi-3's tokenizer_config (eos <|endoftext|>, its chat template)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS + byte_chars() + ["ĠĠ"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "Ġ")], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "<|endoftext|>", "unk_token": "<unk>", "add_bos_token": False,
        "tokenizer_class": "LlamaTokenizer", "chat_template": PHI3_TEMPLATE}))


@pytest.fixture(params=["hf", "gguf"])
def chat_model(request, tmp_path):
    weights = _chat_weights(CHAT_CONFIG["hidden_size"], VOCAB)
    if request.param == "hf":
        out = tmp_path / "phi3-chat"
        out.mkdir()
        mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
        (out / "config.json").write_text(json.dumps(CHAT_CONFIG))
        _phi3_hf_tokenizer(out)
        return load(out)
    return load(write_phi3_gguf(tmp_path / "phi3-chat.gguf", CHAT_CONFIG, weights, Q.F32,
                                chat_template=PHI3_TEMPLATE))


def test_chat_template_and_end_of_turn_stop(chat_model):
    from mlxfast.generation import generate, stream_generate

    model, tok = chat_model
    assert tok.eos_token_id == ENDOFTEXT and END in tok.eos_token_ids  # <|end|>: from the template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(messages)
    assert text == "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    ids = tok.encode(text, add_special_tokens=True)
    assert ids[:2] == [SYSTEM, byte_id(ord("\n"))] and ids[-2:] == [ASSISTANT, byte_id(ord("\n"))]
    # The model writes "OK<|end|>\nOK<|end|>..." after a newline: the answer
    # ends at <|end|>, which never reaches the text.
    chunks = list(stream_generate(model, tok, messages, max_tokens=16))
    assert chunks[-1].finish_reason == "stop" and chunks[-1].token == END
    assert "".join(c.text for c in chunks) == "OK"
    # raw text, no template: the same model goes on past <|end|> only if it
    # is not a stop; it is one for raw prompts too (the model's own template)
    assert generate(model, tok, "x\n", max_tokens=16, chat=False) == "OK"


def test_convert_writes_only_a_new_or_empty_directory(tmp_path):
    """A user's files are never replaced, and a link is never written
    through: a non-empty directory, a file, or a broken link as the output
    is refused before anything is written; an empty directory is taken."""
    from mlxfast import cli
    from mlxfast.convert import convert_gguf

    path, *_ = _tiny_gguf(tmp_path, "longrope", Q.F32)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("mine")
    outside = tmp_path / "outside.json"
    outside.write_text("outside")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "config.json").symlink_to(outside)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    broken = tmp_path / "broken"
    broken.symlink_to(tmp_path / "nowhere")
    for out, why in ((mine, "not empty"), (linked, "not empty"), (a_file, "not a directory"),
                     (broken, "broken link")):
        with pytest.raises(ValueError, match=why):
            convert_gguf(path, out)
        assert cli.main(["convert", str(path), str(out)]) == 1  # one line, no traceback
    assert (mine / "config.json").read_text() == "mine" and outside.read_text() == "outside"
    assert not (tmp_path / "nowhere").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert read_hf_config(convert_gguf(path, empty))["model_type"] == "phi3"
