"""Tiny GGUF files of other architectures than llama, and llama.cpp
(llama-cpp-python, test-only) as the independent oracle on them.

The vocabulary is byte-level BPE: Phi-3's control tokens, the 256 bytes and
one merge; teacher-forced checks feed token ids directly, so it only has to
load (in llama.cpp and ours) and carry the chat tokens."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, quants

SPECIALS = ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>", "<|system|>"]
UNK, BOS, EOS_S, ENDOFTEXT, USER, ASSISTANT, END, SYSTEM = range(len(SPECIALS))
MERGED = "ĠĠ"  # two spaces, the one merge
VOCAB = len(SPECIALS) + 256 + 1


def byte_chars() -> list[str]:
    from tiny_gguf import _byte_chars

    return _byte_chars()


def tokens() -> list[str]:
    return SPECIALS + byte_chars() + [MERGED]


def byte_id(b: int) -> int:
    return len(SPECIALS) + b


def add_vocab(w: GGUFWriter, chat_template: str | None = None) -> None:
    toks = tokens()
    assert len(toks) == VOCAB
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_types([3] * len(SPECIALS) + [1] * (VOCAB - len(SPECIALS)))
    w.add_token_merges(["Ġ Ġ"])
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(ENDOFTEXT)
    w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)


def add_tensors(w: GGUFWriter, named: dict, qtype) -> None:
    """GGUF-named fp32 numpy arrays; 2-D ones quantized to qtype (gguf's quantizer)."""
    for name, arr in named.items():
        arr = np.asarray(arr, np.float32)
        if arr.ndim == 2 and qtype != Q.F32:
            w.add_tensor(name, quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, arr)


def finish(w: GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_cpp_logits(path, ids_list, n_ctx: int) -> list[np.ndarray]:
    """llama.cpp's logits at every position of each sequence (fresh KV each)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, logits_all=True, verbose=False, n_threads=2, seed=0)
    out = []
    for ids in ids_list:
        llm.reset()
        llm.eval(ids)
        out.append(np.array(llm.scores[:len(ids)], dtype=np.float32))
    return out


def agreement(a: list, b: list) -> tuple[float, float]:
    """(teacher-forced top-1 agreement, largest |a - b| / largest |b|)."""
    a, b = np.concatenate(a), np.concatenate(b)
    return float((a.argmax(-1) == b.argmax(-1)).mean()), float(np.abs(a - b).max() / np.abs(b).max())


def sequences(seed: int, n: int = 4, length: int = 120) -> list[list[int]]:
    """Random ids past the control tokens."""
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(len(SPECIALS), VOCAB, length)] for _ in range(n)]
