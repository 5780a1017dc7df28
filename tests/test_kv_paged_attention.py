"""Paged attention: the MLX reference paths against a naive dense computation,
and the native kernels against the references."""

import random
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest

from mlxfast import ops
from mlxfast.kv.block_pool import KVPool
from mlxfast.kv.layer_spec import uniform_layers
from mlxfast.kv.paged import PagedContext, SeqSlice

TOL = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 2e-2}


@dataclass
class Seq:
    """One sequence's part of a step, for the kernel tests: ``n`` tokens from
    position ``start`` over ``block_table``."""

    block_table: list
    start: int
    n: int


def _kv_pool(num_blocks, bs, Hkv, D, dtype):
    """A one-layer KVPool."""
    return KVPool(uniform_layers(1, Hkv, D), num_blocks, bs, dtype=dtype)


def _seq_slice(s):
    """The kv layer's SeqSlice for a Seq (one KV group: one table)."""
    return SeqSlice([list(s.block_table)], s.start, s.n)


def naive(q, kp, vp, tables, seq_idx, positions, scale, bs, window=0):
    """Numpy float64: each token over its own sequence's keys 0..pos (with a
    window W > 0: keys pos - W + 1 .. pos), brute force."""
    q, kp, vp = (np.array(a.astype(mx.float32), np.float64) for a in (q, kp, vp))
    T, Hq, D = q.shape
    Hkv = kp.shape[1]
    out = np.zeros((T, Hq, vp.shape[-1]))
    for t in range(T):
        pos = positions[t]
        table = tables[seq_idx[t]]
        keys = [j for j in range(pos + 1) if window == 0 or pos - j < window]
        slots = [table[p // bs] * bs + p % bs for p in keys]
        for h in range(Hq):
            kh = h // (Hq // Hkv)
            s = kp[slots, kh] @ q[t, h] * scale
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ vp[slots, kh]
    return out


def random_case(rng, *, n_seqs, bs, Hq, Hkv, D, dtype, num_blocks=64, max_len=70):
    perm = list(range(num_blocks))
    rng.shuffle(perm)
    seqs, used = [], 0
    for _ in range(n_seqs):
        length = rng.randint(1, max_len)
        n = rng.choice([1, 1, rng.randint(1, length)])
        nb = -(-length // bs)
        seqs.append(Seq(perm[used:used + nb], length - n, n))
        used += nb
    k_pool = mx.random.normal((num_blocks * bs, Hkv, D)).astype(dtype)
    v_pool = mx.random.normal((num_blocks * bs, Hkv, D)).astype(dtype)
    T = sum(s.n for s in seqs)
    q = mx.random.normal((T, Hq, D)).astype(dtype)
    k_new = mx.random.normal((T, Hkv, D)).astype(dtype)
    v_new = mx.random.normal((T, Hkv, D)).astype(dtype)
    return seqs, k_pool, v_pool, q, k_new, v_new


def flat_meta(seqs):
    seq_idx, positions = [], []
    for i, s in enumerate(seqs):
        seq_idx += [i] * s.n
        positions += list(range(s.start, s.start + s.n))
    maxb = max(len(s.block_table) for s in seqs)
    tables = [s.block_table + [0] * (maxb - len(s.block_table)) for s in seqs]
    return tables, seq_idx, positions


def run_context(seqs, k_pool, v_pool, q, k_new, v_new, bs, native):
    Hkv, D = k_pool.shape[1:]
    pool = _kv_pool(k_pool.shape[0] // bs, bs, Hkv, D, k_pool.dtype)
    pool.keys[0], pool.values[0] = mx.array(k_pool), mx.array(v_pool)
    ctx = PagedContext(pool, [_seq_slice(s) for s in seqs], native=native)
    T = q.shape[0]
    out = ctx.attend(0, q[:, None], k_new[:, None], v_new[:, None], 0.3)
    mx.eval(out)
    return out.reshape(T, q.shape[1], D), pool.keys[0], pool.values[0]


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("bs", [4, 16])
def test_reference_context_matches_naive(Hq, Hkv, bs):
    rng = random.Random(Hq * 100 + bs)
    mx.random.seed(rng.randrange(1000))
    seqs, kp, vp, q, kn, vn = random_case(rng, n_seqs=5, bs=bs, Hq=Hq, Hkv=Hkv, D=16, dtype=mx.float32)
    out, kp2, vp2 = run_context(seqs, kp, vp, q, kn, vn, bs, native=False)
    tables, seq_idx, positions = flat_meta(seqs)
    # The new K/V landed in their slots
    slots = [tables[i][p // bs] * bs + p % bs for i, p in zip(seq_idx, positions)]
    np.testing.assert_array_equal(np.array(kp2[mx.array(slots)]), np.array(kn))
    want = naive(q, kp2, vp2, tables, seq_idx, positions, 0.3, bs)
    np.testing.assert_allclose(np.array(out), want, atol=2e-5, rtol=2e-5)


def test_ops_reference_matches_naive():
    rng = random.Random(7)
    seqs, kp, vp, q, _, _ = random_case(rng, n_seqs=4, bs=8, Hq=6, Hkv=2, D=32, dtype=mx.float32)
    tables, seq_idx, positions = flat_meta(seqs)
    out = ops.paged_attention_reference(q, kp, vp, mx.array(tables), mx.array(seq_idx),
                                        mx.array(positions), scale=0.2, block_size=8)
    want = naive(q, kp, vp, tables, seq_idx, positions, 0.2, 8)
    np.testing.assert_allclose(np.array(out), want, atol=2e-5, rtol=2e-5)


def test_paged_gather_reference():
    kp = mx.arange(8 * 4 * 2 * 3).reshape(32, 2, 3).astype(mx.float32)
    got = ops.paged_gather_reference(kp, mx.array([[3, 1], [0, 7]]), 4)
    assert got.shape == (2, 8, 2, 3)
    np.testing.assert_array_equal(np.array(got[0, :4]), np.array(kp[12:16]))
    np.testing.assert_array_equal(np.array(got[1, 4:]), np.array(kp[28:32]))


def assert_native_matches_reference(seqs, q, kp, vp, bs, dtype):
    """The native paged attention over these sequences equals the reference."""
    D = q.shape[-1]
    tables, seq_idx, positions = flat_meta(seqs)
    args = (q, kp, vp, mx.array(tables), mx.array(seq_idx), mx.array(positions))
    got = ops.paged_attention(*args, scale=D ** -0.5, block_size=bs)
    ref = ops.paged_attention_reference(*args, scale=D ** -0.5, block_size=bs)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(ref.astype(mx.float32)),
                               atol=TOL[dtype], rtol=TOL[dtype])


native = pytest.mark.skipif(not ops.has_native_paged_attention(), reason="no native paged attention")


@native
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("Hq,Hkv,D", [(4, 4, 64), (9, 3, 64), (8, 2, 32), (12, 3, 128), (4, 1, 256),
                                     (64, 8, 128), (40, 10, 64)])
def test_native_matches_reference(dtype, Hq, Hkv, D):
    for trial, bs in enumerate([1, 4, 16, 32]):
        rng = random.Random(trial * 31 + Hq + D)
        mx.random.seed(trial)
        seqs, kp, vp, q, _, _ = random_case(rng, n_seqs=rng.randint(1, 6), bs=bs, Hq=Hq, Hkv=Hkv,
                                            D=D, dtype=dtype, num_blocks=max(80, 160 // bs))
        tables, seq_idx, positions = flat_meta(seqs)
        args = (q, kp, vp, mx.array(tables), mx.array(seq_idx), mx.array(positions))
        got = ops.paged_attention(*args, scale=D ** -0.5, block_size=bs)
        ref = ops.paged_attention_reference(*args, scale=D ** -0.5, block_size=bs)
        assert got.dtype == dtype and got.shape == ref.shape
        np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(ref.astype(mx.float32)),
                                   atol=TOL[dtype], rtol=TOL[dtype])


@native
def test_native_mixed_dtypes_and_context():
    """fp32 queries over an fp16 pool; the full context path native vs reference."""
    rng = random.Random(3)
    seqs, kp, vp, q, kn, vn = random_case(rng, n_seqs=6, bs=16, Hq=9, Hkv=3, D=64, dtype=mx.float16)
    q32 = q.astype(mx.float32)
    a, _, _ = run_context(seqs, kp, vp, q32, kn, vn, 16, native=True)
    b, _, _ = run_context(seqs, kp, vp, q32, kn, vn, 16, native=False)
    assert a.dtype == mx.float32
    np.testing.assert_allclose(np.array(a), np.array(b), atol=2e-3, rtol=2e-3)


@native
@pytest.mark.parametrize("merge_heads", [False, True])
def test_native_leading_axes_and_merged_heads(merge_heads):
    """q [B, L, Hq, D] (T = B*L tokens); merge_heads gives [B, L, Hq*D]."""
    rng = random.Random(11)
    mx.random.seed(11)
    seqs, kp, vp, q, _, _ = random_case(rng, n_seqs=4, bs=16, Hq=9, Hkv=3, D=64, dtype=mx.float32)
    T = q.shape[0] - q.shape[0] % 2  # the first T tokens, as [2, T/2, Hq, D]
    tables, seq_idx, positions = flat_meta(seqs)
    meta = (mx.array(tables), mx.array(seq_idx[:T]), mx.array(positions[:T]))
    flat = ops.paged_attention(q[:T], kp, vp, *meta, scale=0.125, block_size=16)
    q4 = q[:T].reshape(2, T // 2, 9, 64)
    got = ops.paged_attention(q4, kp, vp, *meta, scale=0.125, block_size=16, merge_heads=merge_heads)
    ref = ops.paged_attention_reference(q4, kp, vp, *meta, scale=0.125, block_size=16,
                                        merge_heads=merge_heads)
    want_shape = (2, T // 2, 9 * 64) if merge_heads else (2, T // 2, 9, 64)
    assert got.shape == ref.shape == want_shape
    np.testing.assert_allclose(np.array(got).reshape(T, 9, 64), np.array(flat), atol=1e-6)
    np.testing.assert_allclose(np.array(got), np.array(ref), atol=1e-4, rtol=1e-4)


@native
def test_native_validation():
    q = mx.zeros((2, 4, 8))
    kp = mx.zeros((16, 2, 8))
    good = (mx.array([[0, 1]]), mx.array([0, 0]), mx.array([0, 1]))
    with pytest.raises(ValueError, match="mlxfast.paged_attention"):
        ops.paged_attention(mx.zeros((2, 3, 8)), kp, kp, *good, scale=1.0, block_size=8)
    with pytest.raises(ValueError, match="mlxfast.paged_attention"):
        ops.paged_attention(q, kp, kp, *good, scale=1.0, block_size=5)
    with pytest.raises(ValueError, match="mlxfast.paged_attention"):
        ops.paged_attention(q, kp, kp, good[0], mx.array([0]), good[2], scale=1.0, block_size=8)


@native
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("Hq,Hkv,D", [(9, 3, 64), (4, 4, 64), (8, 2, 128), (6, 3, 96), (4, 1, 256),
                                     (8, 2, 256)])
def test_native_prefill_chunks_every_path(path, dtype, Hq, Hkv, D):
    """Long prefill chunks (whole 16-token query tiles, several key blocks,
    chunks that start mid-sequence and mid-block, a partly filled last
    block): the register-blocked AVX-512 tile kernel (head dims 64/128/256)
    and the generic kernel of every path against the reference."""
    rng = random.Random(D + Hq)
    mx.random.seed(D)
    bs = 16
    seqs, used, perm = [], 0, list(range(200))
    rng.shuffle(perm)
    for start, n in [(0, 70), (37, 45), (100, 3), (5, 1)]:
        nb = -(-(start + n) // bs)
        seqs.append(Seq(perm[used:used + nb], start, n))
        used += nb
    kp = mx.random.normal((200 * bs, Hkv, D)).astype(dtype)
    vp = mx.random.normal((200 * bs, Hkv, D)).astype(dtype)
    q = (mx.random.normal((sum(s.n for s in seqs), Hq, D)) * 2).astype(dtype)
    assert_native_matches_reference(seqs, q, kp, vp, bs, dtype)


@native
@pytest.mark.parametrize("bs", [1, 8, 16, 64, 512])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_native_long_decode_every_block_size(path, bs, D):
    """Decode rows over long contexts: the AVX-512 decode kernel runs its
    online softmax per span of several blocks (256 keys), so contexts of
    several spans, a partial last span and a partial last block, and a
    few-token chunk (3 query tokens x 3 heads < 16 rows) all go through it."""
    Hq, Hkv, dtype = 9, 3, mx.float32
    rng = random.Random(bs + D)
    mx.random.seed(bs)
    lengths = [700, 257, 600]  # last sequence: a 3-token chunk at its end
    nblocks = [-(-n // bs) for n in lengths]
    perm = list(range(sum(nblocks) + 4))
    rng.shuffle(perm)
    seqs, used = [], 0
    for n, nb in zip(lengths, nblocks):
        q_len = 3 if n == 600 else 1
        seqs.append(Seq(perm[used:used + nb], n - q_len, q_len))
        used += nb
    slots = len(perm) * bs
    kp = mx.random.normal((slots, Hkv, D)).astype(dtype)
    vp = mx.random.normal((slots, Hkv, D)).astype(dtype)
    q = (mx.random.normal((sum(s.n for s in seqs), Hq, D)) * 2).astype(dtype)
    assert_native_matches_reference(seqs, q, kp, vp, bs, dtype)


@native
@pytest.mark.parametrize("bs,n_ctx", [(16, 1024), (16, 1500), (256, 3000), (1, 1100), (512, 2000)])
@pytest.mark.parametrize("Hq,Hkv,D,dtype", [(9, 3, 64, mx.float32), (8, 2, 128, mx.float16),
                                            (4, 1, 256, mx.float32), (8, 2, 256, mx.bfloat16),
                                            (64, 8, 128, mx.float16), (40, 10, 64, mx.float32)])
def test_native_single_row_long_context(path, bs, n_ctx, Hq, Hkv, D, dtype):
    """One decode row over a long context: the x86 kernels split the blocks
    of each kv head (AVX-512) or head group (AVX2: up to 32 query rows, so
    64/8 and 40/10 heads make several groups, the last one smaller) across the
    pool (flash-decoding) and merge the partial softmax states; every path
    against the reference, with a block left unused at the end of the table
    and keys beyond the row's position that must be ignored."""
    rng = random.Random(bs + n_ctx + D)
    mx.random.seed(n_ctx)
    nb = -(-(n_ctx + 5) // bs) + 1
    perm = list(range(nb + 3))
    rng.shuffle(perm)
    seqs = [Seq(perm[:nb], n_ctx - 1, 1)]
    kp = mx.random.normal(((nb + 3) * bs, Hkv, D)).astype(dtype)
    vp = mx.random.normal(((nb + 3) * bs, Hkv, D)).astype(dtype)
    q = (mx.random.normal((1, Hq, D)) * 2).astype(dtype)
    assert_native_matches_reference(seqs, q, kp, vp, bs, dtype)


# --- sliding window ----------------------------------------------------------

# Garbage block ids for table entries wholly before a sequence's window (the
# engine releases those blocks): huge, negative, past the pool, and POISON (a
# real block whose K and V are NaN: any read of it would poison the result).
POISON = "poison"
GARBAGE = [2 ** 31 - 1, -1, POISON, 10 ** 6, -(2 ** 31)]


def window_case(rng, specs, *, bs, Hq, Hkv, D, dtype, window, scale_q=2.0):
    """Sequences (start, n) with their blocks shuffled in a pool; returns the
    Seqs (clean tables), k/v pools (last block: NaN, the poison block), q, and
    the same tables with every entry wholly before the sequence's earliest
    window start (the block of max(0, start - window + 1)) replaced by garbage."""
    nbs = [-(-(start + n) // bs) for start, n in specs]
    num_blocks = sum(nbs) + 3
    poison = num_blocks - 1
    perm = list(range(num_blocks - 1))
    rng.shuffle(perm)
    seqs, used = [], 0
    for (start, n), nb in zip(specs, nbs):
        seqs.append(Seq(perm[used:used + nb], start, n))
        used += nb
    kp = np.array(mx.random.normal((num_blocks * bs, Hkv, D)))
    vp = np.array(mx.random.normal((num_blocks * bs, Hkv, D)))
    kp[poison * bs:] = np.nan
    vp[poison * bs:] = np.nan
    kp, vp = mx.array(kp).astype(dtype), mx.array(vp).astype(dtype)
    q = (mx.random.normal((sum(n for _, n in specs), Hq, D)) * scale_q).astype(dtype)
    garbage = []
    for s in seqs:
        first = max(0, s.start - window + 1) // bs if window else 0
        junk = [GARBAGE[(b + s.start) % len(GARBAGE)] for b in range(first)]
        garbage.append([poison if j == POISON else j for j in junk] + s.block_table[first:])
    return seqs, kp, vp, q, garbage


def _padded(tables):
    maxb = max(len(t) for t in tables)
    return mx.array([list(t) + [0] * (maxb - len(t)) for t in tables], dtype=mx.int32)


# Decode rows and prefill chunks mixed in one step, ragged: a prefill from 0
# (whole 16-token tiles), decode rows, a chunk mid-sequence and mid-block, a
# few-token chunk (fewer than 16 rows: the decode kernels) and a long decode.
WINDOW_SPECS = [(0, 40), (75, 1), (130, 33), (5, 1), (250, 3), (299, 1)]
WINDOWS = [1, 3, 16, 21, 64, 1000]  # 16 = block size; 21 not a multiple; 1000 >= context


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("bs", [4, 16])
def test_reference_window_matches_naive(Hq, Hkv, bs):
    """The reference (also the fallback off the CPU) against brute force, with
    garbage in the table entries before each window (the reference must not use
    them either)."""
    rng = random.Random(Hq * 10 + Hkv + bs)
    mx.random.seed(bs + Hq)
    for window in [0] + WINDOWS:
        seqs, kp, vp, q, garbage = window_case(rng, WINDOW_SPECS, bs=bs, Hq=Hq, Hkv=Hkv, D=16,
                                               dtype=mx.float32, window=window)
        tables, seq_idx, positions = flat_meta(seqs)
        meta = (mx.array(seq_idx), mx.array(positions))
        got = ops.paged_attention_reference(q, kp, vp, _padded(garbage), *meta, scale=0.3,
                                            block_size=bs, window=window)
        want = naive(q, kp, vp, tables, seq_idx, positions, 0.3, bs, window=window)
        np.testing.assert_allclose(np.array(got), want, atol=2e-5, rtol=2e-5, err_msg=f"window {window}")


def test_reference_window_edges():
    """window 1 attends only the query's own key (output = its value row);
    a window >= the context equals full attention."""
    rng = random.Random(1)
    seqs, kp, vp, q, _ = window_case(rng, WINDOW_SPECS, bs=8, Hq=4, Hkv=2, D=8, dtype=mx.float32,
                                     window=0)
    tables, seq_idx, positions = flat_meta(seqs)
    args = (q, kp, vp, mx.array(tables), mx.array(seq_idx), mx.array(positions))
    one = ops.paged_attention_reference(*args, scale=0.5, block_size=8, window=1)
    slots = [tables[i][p // 8] * 8 + p % 8 for i, p in zip(seq_idx, positions)]
    own_v = np.repeat(np.array(vp[mx.array(slots)]), 2, axis=1)  # kv head h // 2
    np.testing.assert_allclose(np.array(one), own_v, atol=1e-6)
    full = ops.paged_attention_reference(*args, scale=0.5, block_size=8)
    wide = ops.paged_attention_reference(*args, scale=0.5, block_size=8, window=max(positions) + 1)
    np.testing.assert_allclose(np.array(wide), np.array(full), atol=1e-6)


def assert_window_native(seqs, kp, vp, q, garbage, bs, dtype, window):
    """Native with window == reference; garbage before the windows changes nothing."""
    D = q.shape[-1]
    tables, seq_idx, positions = flat_meta(seqs)
    meta = (mx.array(seq_idx), mx.array(positions))
    kw = dict(scale=D ** -0.5, block_size=bs, window=window)
    got = ops.paged_attention(q, kp, vp, mx.array(tables), *meta, **kw)
    ref = ops.paged_attention_reference(q, kp, vp, mx.array(tables), *meta, **kw)
    assert got.dtype == dtype and got.shape == ref.shape
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(ref.astype(mx.float32)),
                               atol=TOL[dtype], rtol=TOL[dtype], err_msg=f"window {window}")
    junk = ops.paged_attention(q, kp, vp, _padded(garbage), *meta, **kw)
    assert mx.array_equal(junk, got).item(), f"window {window}: garbage before the window was read"
    return got


@native
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("Hq,Hkv,D", [(4, 1, 256), (8, 2, 128), (9, 3, 64), (4, 4, 64), (6, 3, 96)])
def test_native_window_every_path(path, dtype, Hq, Hkv, D):
    """Sliding windows (1, 3, the block size, not a multiple of it, beyond the
    context) over ragged decode rows and prefill chunks in one step, GQA, every
    head dim with a register-blocked AVX-512 path (64/128/256) and one without
    (96), every CPU path: native == reference, and the table entries before
    each window (garbage, including a NaN block) are never read."""
    rng = random.Random(D * 7 + Hq)
    mx.random.seed(D + Hq)
    for window in WINDOWS:
        seqs, kp, vp, q, garbage = window_case(rng, WINDOW_SPECS, bs=16, Hq=Hq, Hkv=Hkv, D=D,
                                               dtype=dtype, window=window)
        assert_window_native(seqs, kp, vp, q, garbage, 16, dtype, window)


@native
@pytest.mark.parametrize("bs", [1, 4, 64])
def test_native_window_block_sizes(path, bs):
    rng = random.Random(bs)
    mx.random.seed(bs)
    for window in [1, 3, bs, bs + 5, 2 * bs, 1000]:
        seqs, kp, vp, q, garbage = window_case(rng, WINDOW_SPECS, bs=bs, Hq=8, Hkv=2, D=128,
                                               dtype=mx.float32, window=window)
        assert_window_native(seqs, kp, vp, q, garbage, bs, mx.float32, window)


@native
@pytest.mark.parametrize("bs,n_ctx,window", [(16, 4096, 512), (16, 1500, 1024), (16, 3000, 1100),
                                             (256, 3000, 700), (1, 2100, 1500), (16, 1100, 2000),
                                             (16, 2000, 100)])
@pytest.mark.parametrize("Hq,Hkv,D,dtype", [(4, 1, 256, mx.float32), (9, 3, 64, mx.float32),
                                            (8, 2, 128, mx.float16)])
def test_native_window_single_row_long_context(path, bs, n_ctx, window, Hq, Hkv, D, dtype):
    """One decode row over a long context with a window: AVX-512 splits the
    window's blocks (not the whole context's) across the pool when the window
    is long, and reads none of the blocks before it."""
    rng = random.Random(bs + n_ctx + D)
    mx.random.seed(n_ctx + window)
    seqs, kp, vp, q, garbage = window_case(rng, [(n_ctx - 1, 1)], bs=bs, Hq=Hq, Hkv=Hkv, D=D,
                                           dtype=dtype, window=window)
    assert_window_native(seqs, kp, vp, q, garbage, bs, dtype, window)


@native
@pytest.mark.parametrize("D", [64, 256])
def test_native_window_zero_is_full_attention(path, D):
    """window=0 is the call without the argument, bit for bit (native and reference)."""
    rng = random.Random(D)
    mx.random.seed(D)
    seqs, kp, vp, q, _ = window_case(rng, WINDOW_SPECS + [(1100, 1)], bs=16, Hq=4, Hkv=1, D=D,
                                     dtype=mx.float16, window=0)
    tables, seq_idx, positions = flat_meta(seqs)
    args = (q, kp, vp, mx.array(tables), mx.array(seq_idx), mx.array(positions))
    for f in (ops.paged_attention, ops.paged_attention_reference):
        assert mx.array_equal(f(*args, scale=0.1, block_size=16, window=0),
                              f(*args, scale=0.1, block_size=16)).item()
    # and a single long decode row (the AVX-512 split path)
    one = (q[:1], kp, vp, mx.array([tables[-1]]), mx.array([0]), mx.array([1100]))
    assert mx.array_equal(ops.paged_attention(*one, scale=0.1, block_size=16, window=0),
                          ops.paged_attention(*one, scale=0.1, block_size=16)).item()


@native
@pytest.mark.parametrize("D", [64, 128, 256])
def test_native_window_rows_independent_of_the_batch(path, D):
    """A sequence's rows come out bit-identical whatever else is in the step
    (tiles never mix sequences); windows included."""
    rng = random.Random(D + 1)
    mx.random.seed(D + 1)
    specs = [(0, 40), (130, 33), (299, 1), (75, 1), (250, 3)]
    seqs, kp, vp, q, _ = window_case(rng, specs, bs=16, Hq=8, Hkv=2, D=D, dtype=mx.float32,
                                     window=0)
    tables, seq_idx, positions = flat_meta(seqs)
    starts = np.cumsum([0] + [s.n for s in seqs])
    for window in (0, 21):
        kw = dict(scale=D ** -0.5, block_size=16, window=window)
        full = ops.paged_attention(q, kp, vp, mx.array(tables), mx.array(seq_idx),
                                   mx.array(positions), **kw)
        for pick in ([0, 1], [1, 2, 3], [4, 0], [3, 4]):
            rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in pick])
            sub_tables = [tables[i] for i in pick]
            sub_seq = np.repeat(np.arange(len(pick)), [seqs[i].n for i in pick]).astype(np.int32)
            got = ops.paged_attention(q[mx.array(rows)], kp, vp, mx.array(sub_tables),
                                      mx.array(sub_seq),
                                      mx.array(np.array(positions, np.int32)[rows]), **kw)
            assert mx.array_equal(got, full[mx.array(rows)]).item(), (window, pick)


@native
def test_native_window_validation():
    q = mx.zeros((2, 4, 8))
    kp = mx.zeros((16, 2, 8))
    good = (mx.array([[0, 1]]), mx.array([0, 0]), mx.array([0, 1]))
    with pytest.raises(ValueError, match=r"mlxfast.paged_attention\] window must be >= 0"):
        ops.paged_attention(q, kp, kp, *good, scale=1.0, block_size=8, window=-1)
    with pytest.raises(ValueError, match=r"mlxfast.paged_attention\] window must be >= 0"):
        ops.paged_attention_reference(q, kp, kp, *good, scale=1.0, block_size=8, window=-3)


# --- batch invariance ----------------------------------------------------------


def _rows_alone(q, kp, vp, table, positions, **kw):
    """Each position's row computed in a call of its own (T = 1: over a long
    context, the split decode path)."""
    out = {}
    for p in positions:
        out[p] = ops.paged_attention(q[p][None], kp, vp, mx.array([table]), mx.array([0]),
                                     mx.array([p]), **kw)[0]
    return out


@native
@pytest.mark.parametrize("Hq,Hkv,D", [(9, 3, 64), (8, 2, 128), (4, 1, 256), (6, 3, 96), (16, 1, 64)])
@pytest.mark.parametrize("window", [0, 300])
def test_native_rows_are_batch_invariant(path, Hq, Hkv, D, window):
    """A row's output is bit-identical however its step is made up: alone (a
    decode row; the split path over long contexts), as the last of k + 1
    tokens of its sequence (a speculative verify step, k up to 32), inside a
    prefill chunk, beside other sequences' rows. Greedy speculative decoding
    reproduces plain decoding token for token only if this holds."""
    rng = np.random.default_rng(D + Hq + window)
    bs, n_pos = 16, 2200
    nb = n_pos // bs + 2
    table = [int(b) for b in rng.permutation(nb)]
    kp = mx.array(rng.standard_normal((nb * bs, Hkv, D)).astype(np.float16))
    vp = mx.array(rng.standard_normal((nb * bs, Hkv, D)).astype(np.float16))
    q = mx.array((rng.standard_normal((n_pos, Hq, D)) * 2).astype(np.float32))
    kw = dict(scale=D ** -0.5, block_size=bs, window=window)

    def call(parts):
        """One step over sequences given as (table, first position, n tokens);
        returns {(part index, position): row}."""
        tables = [t for t, _, _ in parts]
        seq = np.concatenate([np.full(n, i, np.int32) for i, (_, _, n) in enumerate(parts)])
        pos = np.concatenate([np.arange(p0, p0 + n, dtype=np.int32) for _, p0, n in parts])
        out = ops.paged_attention(q[mx.array(pos)], kp, vp, mx.array(tables), mx.array(seq),
                                  mx.array(pos), **kw)
        return {(int(s), int(p)): out[i] for i, (s, p) in enumerate(zip(seq, pos))}

    for p in (40, 700, 2150):
        targets = [p - 5, p - 1, p]
        alone = _rows_alone(q, kp, vp, table, targets, **kw)
        steps = [[(table, p - k, k + 1)] for k in (1, 2, 4, 5, 8, 15, 16, 32)]
        steps.append([(table, max(0, p - 20), min(p, 20) + 10)])                 # prefill chunk
        steps.append([(table, 0, 37), (table, p, 1), (table, 1000, 9)])           # mixed batch
        steps.append([(table, 300 + 97 * i, 1) for i in range(7)] + [(table, p, 1)])  # decode batch
        for parts in steps:
            got = call(parts)
            for (s, pos), row in got.items():
                if pos in alone:
                    assert mx.array_equal(row, alone[pos]).item(), (
                        f"position {pos} of {[(p0, n) for _, p0, n in parts]} differs from "
                        f"the row alone by {mx.abs(row - alone[pos]).max().item()}")
