"""Native quantized-KV kernels (encode, dequant, fused paged attention)
against their pure-MLX references, on every CPU path this machine runs."""

import random

import mlx.core as mx
import numpy as np
import pytest

from mlxfast import ops
from kv_oracle import rounded_query
from mlxfast.ops.kvquant import KVQuantFormat, rotation_signs

FORMATS = [KVQuantFormat(64, 8, 8, 64, False), KVQuantFormat(64, 4, 4, 64, False),
           KVQuantFormat(64, 8, 8, 32, False), KVQuantFormat(64, 4, 4, 32, False),
           KVQuantFormat(64, 8, 3, 64, True), KVQuantFormat(64, 8, 4, 64, True),
           KVQuantFormat(64, 8, 2, 64, True), KVQuantFormat(64, 4, 3, 32, True),
           KVQuantFormat(128, 8, 3, 64, True), KVQuantFormat(32, 4, 4, 32, False),
           KVQuantFormat(16, 8, 2, 16, True), KVQuantFormat(24, 8, 8, 8, False),
           # head dim 256 (Gemma 3): every scheme, rotation of size 256
           KVQuantFormat(256, 8, 8, 64, False), KVQuantFormat(256, 4, 4, 64, False),
           KVQuantFormat(256, 8, 8, 32, False), KVQuantFormat(256, 4, 4, 32, False),
           KVQuantFormat(256, 8, 3, 64, True), KVQuantFormat(256, 8, 4, 64, True),
           KVQuantFormat(256, 8, 2, 64, True), KVQuantFormat(256, 4, 3, 32, True)]



def fid(f):
    return f"D{f.head_dim}k{f.k_bits}v{f.v_bits}{'t' if f.v_turbo else 'a'}g{f.group_size}"


def signs_for(fmt, layer=0):
    return mx.array(rotation_signs(1, layer, fmt.head_dim))


ENC = [(f, (mx.float32, mx.float16, mx.bfloat16)[i % 3]) for i, f in enumerate(FORMATS)]


@pytest.mark.parametrize("fmt,dtype", ENC, ids=[f"{fid(f)}-{str(d)[9:]}" for f, d in ENC])
def test_encode_and_dequant_match_reference(path, fmt, dtype):
    mx.random.seed(fmt.head_dim + fmt.v_bits)
    k = (mx.random.normal((37, 3, fmt.head_dim)) * 2).astype(dtype)
    v = mx.random.normal((37, 3, fmt.head_dim)).astype(dtype)
    s = signs_for(fmt)
    nat, ref = ops.kv_quant_encode(k, v, fmt, s), ops.kv_quant_encode_reference(k, v, fmt, s)
    assert nat.shape == ref.shape == (37, 3, fmt.row_bytes) and nat.dtype == mx.uint8
    kb = fmt.k_bytes
    assert mx.array_equal(nat[..., :kb], ref[..., :kb])  # affine keys: bit-exact
    kn, vn = ops.kv_quant_dequant(nat, fmt, s, dtype=mx.float32)
    kr, vr = ops.kv_quant_dequant_reference(ref, fmt, s)
    np.testing.assert_allclose(np.array(kn), np.array(kr), atol=1e-6)
    # values: codes may differ at a decision boundary (fp rounding of the rotation)
    tol = 1e-5 if not fmt.v_turbo else 0.35 * float(mx.abs(vr).max())
    np.testing.assert_allclose(np.array(vn), np.array(vr), atol=tol)
    close = mx.abs(vn - vr) < 1e-4
    assert float(close.astype(mx.float32).mean()) > 0.99
    # dequant of the same bytes is exact up to float rounding, in every output dtype
    for odt in (mx.float32, mx.float16, mx.bfloat16):
        kn2, vn2 = ops.kv_quant_dequant(ref, fmt, s, dtype=odt)
        assert kn2.dtype == odt
        tol = {mx.float32: 2e-5, mx.float16: 3e-3, mx.bfloat16: 2e-2}[odt]
        np.testing.assert_allclose(np.array(vn2.astype(mx.float32)), np.array(vr), atol=tol * 4,
                                   rtol=tol)


def random_case(rng, fmt, *, n_seqs, bs, Hq, Hkv, num_blocks, max_len, max_n=None):
    perm = list(range(num_blocks))
    rng.shuffle(perm)
    tables, seq_idx, positions, used = [], [], [], 0
    for i in range(n_seqs):
        length = rng.randint(1, max_len)
        n = rng.choice([1, 1, rng.randint(1, min(length, max_n or length))])  # decode / prefill
        nb = -(-length // bs)
        tables.append(perm[used:used + nb])
        used += nb
        seq_idx += [i] * n
        positions += list(range(length - n, length))
    maxb = max(len(t) for t in tables)
    tables = [t + [rng.randrange(num_blocks)] * (maxb - len(t)) for t in tables]  # junk padding
    D = fmt.head_dim
    s = signs_for(fmt, 3)
    packed = ops.kv_quant_encode_reference(mx.random.normal((num_blocks * bs, Hkv, D)) * 1.5,
                                           mx.random.normal((num_blocks * bs, Hkv, D)), fmt, s)
    q = mx.random.normal((len(seq_idx), Hq, D))
    return (q, packed, mx.array(tables, dtype=mx.int32), mx.array(seq_idx, dtype=mx.int32),
            mx.array(positions, dtype=mx.int32), s)


SHAPES = [(4, 4, 16), (9, 3, 16), (8, 2, 8), (6, 1, 32), (2, 2, 1)]  # Hq, Hkv, block_size
CASES = [(f, SHAPES[(i + j) % len(SHAPES)]) for i, f in enumerate(FORMATS) for j in (0, 2)]


@pytest.mark.parametrize("fmt,shape", CASES, ids=[f"{fid(f)}-{s}" for f, s in CASES])
def test_attention_matches_reference(path, fmt, shape):
    Hq, Hkv, bs = shape
    rng = random.Random(hash((fid(fmt), Hq, bs)) & 0xFFFF)
    mx.random.seed(rng.randrange(1000))
    num_blocks = max(8, 400 // bs)
    q, packed, tables, seq_idx, pos, s = random_case(rng, fmt, n_seqs=5, bs=bs, Hq=Hq, Hkv=Hkv,
                                                     num_blocks=num_blocks, max_len=70)
    kw = dict(scale=fmt.head_dim ** -0.5, block_size=bs, fmt=fmt, signs=s)
    got = ops.kv_quant_paged_attention(q, packed, tables, seq_idx, pos, **kw)
    want = ops.kv_quant_paged_attention_reference(q, packed, tables, seq_idx, pos, **kw)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[4], KVQuantFormat(256, 4, 4, 32, False),
                                 KVQuantFormat(256, 8, 3, 64, True)], ids=fid)
def test_attention_long_context_split_and_dtypes(path, fmt):
    """Long contexts with few rows are split along the keys and merged."""
    rng = random.Random(5)
    mx.random.seed(5)
    bs, Hq, Hkv = 16, 9, 3
    q, packed, tables, seq_idx, pos, s = random_case(rng, fmt, n_seqs=3, bs=bs, Hq=Hq, Hkv=Hkv,
                                                     num_blocks=400, max_len=2000, max_n=24)
    kw = dict(scale=0.125, block_size=bs, fmt=fmt, signs=s)
    for dt, tol in ((mx.float32, 2e-5), (mx.float16, 2e-3), (mx.bfloat16, 2e-2)):
        # The reference on the same half-precision query: the query's 8-bit
        # rounding (ops/kvquant.py, "Scores") sees q as the kernel does.
        want = ops.kv_quant_paged_attention_reference(q.astype(dt), packed, tables, seq_idx, pos,
                                                      **kw)
        got = ops.kv_quant_paged_attention(q.astype(dt), packed, tables, seq_idx, pos, **kw)
        assert got.dtype == dt == want.dtype
        np.testing.assert_allclose(np.array(got.astype(mx.float32)),
                                   np.array(want.astype(mx.float32)), atol=tol, rtol=tol * 5)


@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[3], KVQuantFormat(128, 8, 3, 64, True)], ids=fid)
def test_decode_items_of_head_groups(path, fmt):
    """Decode tiles whose rows over all kv heads pass one item's limit (48 on
    the avx512 path) run in groups of heads, uneven at the end (8 heads of 10
    rows each: 4 + 4; of 14 rows: 3 + 3 + 2), each head's rows in its place."""
    rng = random.Random(17)
    mx.random.seed(17)
    bs, Hq, Hkv = 16, 16, 8
    for n in (5, 7):
        q, packed, tables, seq_idx, pos, s = random_case(rng, fmt, n_seqs=1, bs=bs, Hq=Hq, Hkv=Hkv,
                                                         num_blocks=120, max_len=1500, max_n=1)
        # one sequence's last n positions: a decode tile of n tokens
        length = int(pos[0]) + 1
        assert length >= n
        pos = mx.array(list(range(length - n, length)), dtype=mx.int32)
        seq_idx = mx.zeros((pos.shape[0],), dtype=mx.int32)
        q = mx.random.normal((pos.shape[0], Hq, fmt.head_dim))
        kw = dict(scale=fmt.head_dim ** -0.5, block_size=bs, fmt=fmt, signs=s)
        got = ops.kv_quant_paged_attention(q, packed, tables, seq_idx, pos, **kw)
        want = ops.kv_quant_paged_attention_reference(q, packed, tables, seq_idx, pos, **kw)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[3], KVQuantFormat(128, 8, 3, 64, True)], ids=fid)
def test_scores_use_the_query_rounded_to_8_bits(path, fmt):
    """Every path scores the keys against scale * q rounded to 8 bits per row:
    the output is attention over the dequantized KV with that query, and it
    is measurably not the one with the query as given."""
    rng = random.Random(11)
    mx.random.seed(11)
    q, packed, tables, seq_idx, pos, s = random_case(rng, fmt, n_seqs=4, bs=16, Hq=4, Hkv=2,
                                                     num_blocks=40, max_len=300)
    scale = fmt.head_dim ** -0.5
    got = np.array(ops.kv_quant_paged_attention(q * 3, packed, tables, seq_idx, pos, scale=scale,
                                                block_size=16, fmt=fmt, signs=s))
    k, v = ops.kv_quant_dequant_reference(packed, fmt, s)
    dense = lambda qq, sc: np.array(ops.paged_attention_reference(
        qq, k, v, tables, seq_idx, pos, scale=sc, block_size=16))
    g = fmt.group_size
    rounded = dense(mx.array(rounded_query(q * 3, scale, g)), 1.0)
    exact = dense(q * 3, scale)
    np.testing.assert_allclose(got, rounded, atol=2e-5, rtol=1e-4)
    assert np.abs(got - exact).max() > 1e-4
    # per block of the keys' group: d * integers in [-127, 127], the largest 127
    blocks = lambda a: np.array(a, np.float32).reshape(*a.shape[:-1], -1, g)
    amax = np.abs(blocks(np.array(q * 3) * scale)).max(-1, keepdims=True)
    q8 = blocks(rounded_query(q * 3, scale, g)) / (amax / 127)
    np.testing.assert_allclose(q8, np.round(q8), atol=1e-3)
    assert np.all(np.abs(np.round(q8)).max(-1) == 127)
    assert np.abs(np.round(q8)).max() == 127


def test_validation():
    fmt = KVQuantFormat(64, 8, 3, 64, True)
    s = signs_for(fmt)
    q = mx.zeros((2, 4, 64))
    packed = mx.zeros((32, 2, fmt.row_bytes), mx.uint8)
    t = mx.zeros((1, 2), mx.int32)
    i = mx.zeros((2,), mx.int32)
    with pytest.raises(ValueError, match="signs"):
        ops.kv_quant_paged_attention(q, packed, t, i, i, scale=1.0, block_size=16, fmt=fmt)
    with pytest.raises(ValueError, match="packed"):
        ops.kv_quant_paged_attention(q, packed[..., :-1], t, i, i, scale=1.0, block_size=16,
                                     fmt=fmt, signs=s)
    with pytest.raises(ValueError, match="block_size"):
        ops.kv_quant_paged_attention(q, packed, t, i, i, scale=1.0, block_size=7, fmt=fmt, signs=s)
    with pytest.raises(ValueError, match="multiple"):
        ops.kv_quant_paged_attention(mx.zeros((2, 3, 64)), packed, t, i, i, scale=1.0,
                                     block_size=16, fmt=fmt, signs=s)
    with pytest.raises(ValueError, match="shape"):
        ops.kv_quant_encode(mx.zeros((2, 64)), mx.zeros((3, 64)), fmt, s)


# --- sliding window ----------------------------------------------------------

WINDOW_FORMATS = [KVQuantFormat(256, 8, 8, 64, False), KVQuantFormat(256, 4, 4, 32, False),
                  KVQuantFormat(256, 8, 3, 64, True), KVQuantFormat(256, 4, 4, 64, True),
                  KVQuantFormat(256, 8, 2, 32, True), KVQuantFormat(64, 8, 8, 32, False),
                  KVQuantFormat(64, 4, 4, 64, False), KVQuantFormat(64, 8, 3, 64, True),
                  KVQuantFormat(128, 8, 4, 64, True)]
# ragged decode rows and prefill chunks (whole tiles, mid-block starts, a
# few-token chunk) in one step
WINDOW_SPECS = [(0, 40), (75, 1), (130, 33), (5, 1), (250, 3), (299, 1)]
WINDOWS = [1, 3, 16, 21, 64, 1000]  # 16 = block size; 21 not a multiple; 1000 >= context


def window_case(rng, fmt, specs, *, bs, Hq, Hkv, window):
    """Packed pool (last block: 0xFF bytes, NaN scales -- any read of it would
    poison the result), q, clean tables and tables whose entries wholly before
    each sequence's earliest window start hold garbage (huge, negative, past
    the pool, the poison block)."""
    nbs = [-(-(start + n) // bs) for start, n in specs]
    num_blocks = sum(nbs) + 3
    poison = num_blocks - 1
    perm = list(range(num_blocks - 1))
    rng.shuffle(perm)
    tables, junk_tables, seq_idx, positions, used = [], [], [], [], 0
    garbage = [2 ** 31 - 1, -1, poison, 10 ** 6, -(2 ** 31)]
    for i, ((start, n), nb) in enumerate(zip(specs, nbs)):
        t = perm[used:used + nb]
        used += nb
        first = max(0, start - window + 1) // bs if window else 0
        tables.append(t)
        junk_tables.append([garbage[(b + start) % len(garbage)] for b in range(first)] + t[first:])
        seq_idx += [i] * n
        positions += list(range(start, start + n))
    maxb = max(nbs)
    pad = lambda ts: mx.array([t + [0] * (maxb - len(t)) for t in ts], dtype=mx.int32)
    D = fmt.head_dim
    s = signs_for(fmt, 2)
    packed = ops.kv_quant_encode_reference(mx.random.normal((num_blocks * bs, Hkv, D)) * 1.5,
                                           mx.random.normal((num_blocks * bs, Hkv, D)), fmt, s)
    packed = np.array(packed)
    packed[poison * bs:] = 0xFF
    q = mx.random.normal((len(seq_idx), Hq, D)) * 2
    return (q, mx.array(packed), pad(tables), pad(junk_tables), mx.array(seq_idx, dtype=mx.int32),
            mx.array(positions, dtype=mx.int32), s)


def brute_force(q, packed, tables, seq_idx, positions, scale, bs, fmt, signs, window):
    """Numpy float64 over the dequantized pool and the rounded query, keys
    p - W < j <= p (W = 0: all j <= p)."""
    k, v = ops.kv_quant_dequant_reference(packed, fmt, signs)
    k, v, q = (np.array(a, np.float64) for a in (k, v, rounded_query(q, scale, fmt.group_size)))
    scale = 1.0
    tables, seq_idx, positions = (np.array(a).tolist() for a in (tables, seq_idx, positions))
    T, Hq, D = q.shape
    G = Hq // k.shape[1]
    out = np.zeros((T, Hq, D))
    for t in range(T):
        p, table = positions[t], tables[seq_idx[t]]
        keys = [j for j in range(p + 1) if window == 0 or p - j < window]
        slots = [table[j // bs] * bs + j % bs for j in keys]
        for h in range(Hq):
            sc = k[slots, h // G] @ q[t, h] * scale
            e = np.exp(sc - sc.max())
            out[t, h] = (e / e.sum()) @ v[slots, h // G]
    return out


@pytest.mark.parametrize("fmt", WINDOW_FORMATS[:3] + WINDOW_FORMATS[5:8], ids=fid)
def test_reference_window_matches_brute_force(fmt):
    """The reference itself against brute force, on garbage tables before the windows."""
    rng = random.Random(fmt.head_dim + fmt.v_bits)
    mx.random.seed(fmt.head_dim)
    for window in [0, 1, 3, 21, 1000]:
        q, packed, tables, junk, seq_idx, pos, s = window_case(rng, fmt, WINDOW_SPECS, bs=16, Hq=4,
                                                               Hkv=2, window=window)
        kw = dict(scale=fmt.head_dim ** -0.5, block_size=16, fmt=fmt, signs=s, window=window)
        got = ops.kv_quant_paged_attention_reference(q, packed, junk, seq_idx, pos, **kw)
        want = brute_force(q, packed, tables, seq_idx, pos, kw["scale"], 16, fmt, s, window)
        np.testing.assert_allclose(np.array(got), want, atol=2e-5, rtol=1e-4, err_msg=f"window {window}")


@pytest.mark.parametrize("shape", [(4, 1, 16), (8, 2, 16), (9, 3, 4)], ids=str)
@pytest.mark.parametrize("fmt", WINDOW_FORMATS, ids=fid)
def test_attention_window_matches_reference(path, fmt, shape):
    """Windows 1, 3, the block size, not a multiple of it, beyond the context:
    native == reference; garbage table entries before the windows (a NaN block
    among them) change nothing."""
    Hq, Hkv, bs = shape
    rng = random.Random(hash((fid(fmt), Hq, bs)) & 0xFFFF)
    mx.random.seed(rng.randrange(1000))
    for window in WINDOWS[:-2] + [bs * 3 + 1, 1000]:
        q, packed, tables, junk, seq_idx, pos, s = window_case(rng, fmt, WINDOW_SPECS, bs=bs, Hq=Hq,
                                                               Hkv=Hkv, window=window)
        kw = dict(scale=fmt.head_dim ** -0.5, block_size=bs, fmt=fmt, signs=s, window=window)
        got = ops.kv_quant_paged_attention(q, packed, tables, seq_idx, pos, **kw)
        want = ops.kv_quant_paged_attention_reference(q, packed, tables, seq_idx, pos, **kw)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-4,
                                   err_msg=f"window {window}")
        got_junk = ops.kv_quant_paged_attention(q, packed, junk, seq_idx, pos, **kw)
        assert mx.array_equal(got_junk, got).item(), f"window {window}: blocks before it were read"


@pytest.mark.parametrize("fmt", [WINDOW_FORMATS[0], WINDOW_FORMATS[2], WINDOW_FORMATS[7]], ids=fid)
@pytest.mark.parametrize("n_ctx,window", [(4096, 512), (2000, 1500), (1500, 100)])
def test_attention_window_long_single_row(path, fmt, n_ctx, window):
    """One decode row over a long context: the chunks (split along the keys)
    cover the window's blocks only."""
    rng = random.Random(n_ctx + window)
    mx.random.seed(window)
    q, packed, tables, junk, seq_idx, pos, s = window_case(rng, fmt, [(n_ctx - 1, 1)], bs=16, Hq=4,
                                                           Hkv=1, window=window)
    kw = dict(scale=0.1, block_size=16, fmt=fmt, signs=s, window=window)
    got = ops.kv_quant_paged_attention(q, packed, junk, seq_idx, pos, **kw)
    want = ops.kv_quant_paged_attention_reference(q, packed, tables, seq_idx, pos, **kw)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fmt", [FORMATS[0], KVQuantFormat(256, 8, 3, 64, True)], ids=fid)
def test_attention_window_zero_is_full_attention(path, fmt):
    rng = random.Random(9)
    mx.random.seed(9)
    q, packed, tables, _, seq_idx, pos, s = window_case(rng, fmt, WINDOW_SPECS + [(1500, 1)], bs=16,
                                                        Hq=4, Hkv=1, window=0)
    kw = dict(scale=0.1, block_size=16, fmt=fmt, signs=s)
    for f in (ops.kv_quant_paged_attention, ops.kv_quant_paged_attention_reference):
        assert mx.array_equal(f(q, packed, tables, seq_idx, pos, window=0, **kw),
                              f(q, packed, tables, seq_idx, pos, **kw)).item()


def test_window_validation():
    fmt = KVQuantFormat(64, 8, 8, 64, False)
    q = mx.zeros((2, 4, 64))
    packed = mx.zeros((32, 2, fmt.row_bytes), mx.uint8)
    t = mx.zeros((1, 2), mx.int32)
    i = mx.zeros((2,), mx.int32)
    for f in (ops.kv_quant_paged_attention, ops.kv_quant_paged_attention_reference):
        with pytest.raises(ValueError, match=r"kv_quant_paged_attention\] window must be >= 0"):
            f(q, packed, t, i, i, scale=1.0, block_size=16, fmt=fmt, window=-1)
