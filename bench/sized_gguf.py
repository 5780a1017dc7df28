"""Random-weight llama GGUF files with the shapes of real models, for the benchmarks.

Random weights decode at the speed of real ones (the same bytes are read per
token), so a 1B- or 8B-shaped file measures what users' models cost without
shipping them. The quantized blocks are written directly (random codes,
small random fp16 scales: no quantizer pass over billions of weights); norms
are ones. The vocabulary is byte-level BPE padded with filler tokens to the
real size; there is no EOS token (so nothing stops a decode early).

    python bench/sized_gguf.py 1b q4_0 OUT.gguf
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

SHAPES = {
    # Llama-3.2-1B: tied embeddings.
    "1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, ff=8192, vocab=128256, tied=True,
               rope_base=500000.0, ctx=8192),
    # Llama-3.1-8B.
    "8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, ff=14336, vocab=128256, tied=False,
               rope_base=500000.0, ctx=8192),
}
QTYPES = {"q4_0": GGMLQuantizationType.Q4_0, "q8_0": GGMLQuantizationType.Q8_0}
_SCALE_OFFSET = 0  # Q4_0 and Q8_0 blocks start with their fp16 scale


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-unicode table (the byte-level BPE alphabet), in byte order."""
    from mlxfast.text.tokenizer import _bytes_to_unicode

    table = _bytes_to_unicode()
    return [table[b] for b in range(256)]


def random_blocks(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = rng.uniform(0.002, 0.02, size=(rows, cols // block)).astype(np.float16)
    data[:, :, _SCALE_OFFSET:_SCALE_OFFSET + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, -1)


def tensor_shapes(s: dict) -> dict[str, tuple[int, int]]:
    """GGUF tensor name -> (rows, cols) of every 2-D weight."""
    hd = s["hidden"] // s["heads"]
    out = {"token_embd.weight": (s["vocab"], s["hidden"])}
    for i in range(s["layers"]):
        p = f"blk.{i}."
        out[p + "attn_q.weight"] = (s["heads"] * hd, s["hidden"])
        out[p + "attn_k.weight"] = (s["kv_heads"] * hd, s["hidden"])
        out[p + "attn_v.weight"] = (s["kv_heads"] * hd, s["hidden"])
        out[p + "attn_output.weight"] = (s["hidden"], s["heads"] * hd)
        out[p + "ffn_gate.weight"] = (s["ff"], s["hidden"])
        out[p + "ffn_up.weight"] = (s["ff"], s["hidden"])
        out[p + "ffn_down.weight"] = (s["hidden"], s["ff"])
    if not s["tied"]:
        out["output.weight"] = (s["vocab"], s["hidden"])
    return out


def bytes_read_per_token(shape: str, qtype: str) -> int:
    """Weight bytes one decode step reads in this file's own format: every
    matrix once, but one row of the embedding (the output head reads it whole
    when it is tied)."""
    s, q = SHAPES[shape], QTYPES[qtype]
    block, size = GGML_QUANT_SIZES[q]
    total = 0
    for name, (rows, cols) in tensor_shapes(s).items():
        nbytes = rows * cols // block * size
        if name == "token_embd.weight":
            nbytes = nbytes if s["tied"] else nbytes // rows
        total += nbytes
    return total


def write(path: Path, shape: str, qtype: str, seed: int = 0) -> Path:
    s, q = SHAPES[shape], QTYPES[qtype]
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "llama")
    w.add_name(f"random-{shape}-{qtype}")
    w.add_block_count(s["layers"])
    w.add_context_length(s["ctx"])
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["ff"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(s["rope_base"])
    w.add_rope_dimension_count(s["hidden"] // s["heads"])
    w.add_vocab_size(s["vocab"])
    chars = _byte_chars()
    merged = chars[32] * 2  # "ĠĠ": the one merge (a gpt2 vocabulary needs merges)
    tokens = chars + [merged] + [f"<|filler_{i}|>" for i in range(s["vocab"] - len(chars) - 1)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(chars) + 1) + [4] * (s["vocab"] - len(chars) - 1))
    w.add_token_merges([f"{chars[32]} {chars[32]}"])
    w.add_add_bos_token(False)
    for name, (rows, cols) in tensor_shapes(s).items():
        w.add_tensor(name, random_blocks(rows, cols, q, rng), raw_dtype=q)
    ones = np.ones(s["hidden"], np.float32)
    w.add_tensor("output_norm.weight", ones)
    for i in range(s["layers"]):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def cached(shape: str, qtype: str, cache_dir: Path | None = None) -> Path:
    """The file, written once into ``~/.cache/mlxfast-bench``."""
    d = cache_dir or Path.home() / ".cache" / "mlxfast-bench"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"random-{shape}-{qtype}.gguf"
    if not path.is_file():
        tmp = path.with_suffix(".part")
        write(tmp, shape, qtype)
        tmp.replace(path)
    return path


if __name__ == "__main__":
    write(Path(sys.argv[3]), sys.argv[1], sys.argv[2])
