"""ops.quantized_argmax: the greedy choice of a quantized output head is the
argmax of the full head's logits (ties, near-ties and non-finite rows
included) on every CPU path; its int8 error bounds hold; the engine's greedy
tokens are the same with the head choosing them and without."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import numpy as np
import pytest

from mlxfast import ops

ROWS16_PATHS = [p for p in ("avx2", "avx512") if ops.cpu_supports(p)]


@pytest.fixture(params=ROWS16_PATHS)
def rows16_path(request):
    ops.set_cpu_path(request.param)
    yield request.param
    ops.set_cpu_path("")


def make_head(N, K, bits, group_size, sdtype=mx.float16, symmetric=False, seed=0):
    """A packed (row-interleaved) head and its bounds; symmetric: no biases."""
    mx.random.seed(seed)
    wq, s, b = mx.quantize(mx.random.normal((N, K)) * 0.05, group_size=group_size, bits=bits)
    s, b = s.astype(sdtype), None if symmetric else b.astype(sdtype)
    w, s, b = ops.pack_rows16(wq, s, b)
    return w, s, b, ops.argmax_bounds(w, s, b, group_size=group_size, bits=bits)


def full_argmax(x, w, s, b, group_size, bits, norm=None):
    return mx.argmax(ops.quantized_matmul(x, w, s, b, group_size=group_size, bits=bits, norm=norm),
                     axis=-1)


def head_argmax(x, w, s, b, bounds, group_size, bits, norm=None):
    assert ops.has_native_quantized_argmax(x, w, bits, norm)
    return ops.quantized_argmax(x, w, s, b, bounds, group_size=group_size, bits=bits, norm=norm)


def assert_same(x, w, s, b, bounds, gs, bits, norm=None):
    got = head_argmax(x, w, s, b, bounds, gs, bits, norm)
    want = full_argmax(x, w, s, b, gs, bits, norm)
    assert got.dtype == mx.uint32 and got.shape == want.shape
    assert got.tolist() == want.tolist()
    return want


@pytest.mark.parametrize("bits,gs,symmetric,sdtype", [
    (8, 32, True, mx.float16), (8, 64, False, mx.bfloat16), (4, 32, False, mx.float16),
    (4, 128, True, mx.float32), (4, 64, False, mx.float32),
])
@pytest.mark.parametrize("M", [1, 3, 8, 17, 72, 130])
def test_matches_the_full_heads_argmax(rows16_path, bits, gs, symmetric, sdtype, M):
    w, s, b, bounds = make_head(16 * 48, 256, bits, gs, sdtype, symmetric, seed=M)
    mx.random.seed(100 + M)
    x = mx.random.normal((M, 256)) * mx.random.uniform(0.1, 3.0, (M, 1))
    assert_same(x, w, s, b, bounds, gs, bits)
    norm = (mx.random.uniform(0.5, 1.5, (256,)), 1e-5)
    assert_same(x, w, s, b, bounds, gs, bits, norm)


@pytest.mark.parametrize("xdtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("M", [2, 9, 40])
def test_half_precision_heads_compare_their_rounded_logits(rows16_path, xdtype, M):
    # Logits rounded to 8 (bfloat16) or 11 (float16) significant bits tie
    # often: the first of the rows that round to the best value wins.
    gs, bits = 32, 4
    w, s, b, bounds = make_head(16 * 64, 256, bits, gs, mx.bfloat16, seed=20 + M)
    mx.random.seed(30 + M)
    x = (mx.random.normal((M, 256)) * 4).astype(xdtype)
    want = assert_same(x, w, s, b, bounds, gs, bits)
    assert_same(x, w, s, b, bounds, gs, bits, (mx.ones((256,), xdtype), 1e-5))
    y = ops.quantized_matmul(x, w, s, b, group_size=gs, bits=bits)
    assert y.dtype == xdtype and want.tolist() == mx.argmax(y, axis=-1).tolist()


def test_a_bfloat16_tie_below_the_screens_threshold_still_wins(rows16_path):
    """Rows 0 and 16 round to the same bfloat16 logit; row 0 (the first,
    MLX's choice) is below row 16 in fp32 and, with these activations'
    int8 rounding, its upper bound is below row 16's lower one: only the
    screen's widening by bfloat16's ulp keeps it (without it: 16)."""
    N, K, gs, bits = 32, 32, 32, 8
    x = np.random.default_rng(0).uniform(0.5, 1.0, (1, K)).astype(np.float32)
    x[0, 0] = 1.0
    x = mx.array(x).astype(mx.bfloat16)
    xf = np.array(x.astype(mx.float32))[0]
    r = np.rint(xf * 127) - xf * 127  # int8 rounding: row 0 reads x rounded down, row 16 up
    codes = np.full((N, K), 128)
    codes[0, np.where(r < -0.3)[0]] = 181
    codes[16, np.where(r > 0.3)[0]] = 166
    s = mx.full((N, 1), 0.0625, dtype=mx.float16)
    w, s, _ = ops.pack_rows16(pack_codes(codes, bits), s, None)
    bounds = ops.argmax_bounds(w, s, None, group_size=gs, bits=bits)
    y = ops.quantized_matmul(x, w, s, None, group_size=gs, bits=bits)
    y32 = ops.quantized_matmul(x.astype(mx.float32), w, s, None, group_size=gs, bits=bits)
    y8 = ops.quantized_matmul(x.astype(mx.float32), w, s, None, group_size=gs, bits=bits,
                              activations="int8")
    e = (mx.abs(x.astype(mx.float32)).max() / 127
         * ops.unpack_rows16(bounds, bounds, None)[0].astype(mx.float32)[:, 0])
    assert y[0, 0].item() == y[0, 16].item() and y32[0, 0].item() < y32[0, 16].item()
    assert (y8[0, 0] + e[0]).item() < (y8[0, 16] - e[16]).item()
    assert assert_same(x, w, s, None, bounds, gs, bits).tolist() == [0]


def test_exact_ties_take_the_first_index(rows16_path):
    # Every row repeats one of 8 patterns: each logit ties with copies of it
    # in other lanes and blocks; the argmax is the first copy of the best.
    N, K, gs, bits = 16 * 40, 128, 32, 8
    mx.random.seed(1)
    base = mx.random.normal((8, K)) * 0.05
    wq, s, b = mx.quantize(mx.concatenate([base] * (N // 8)), group_size=gs, bits=bits)
    w, s, b = ops.pack_rows16(wq, s, b)
    bounds = ops.argmax_bounds(w, s, b, group_size=gs, bits=bits)
    x = mx.random.normal((24, K))
    want = assert_same(x, w, s, b, bounds, gs, bits)
    assert max(want.tolist()) < 8  # the copies' logits are the same bits: the first wins


def pack_codes(codes: np.ndarray, bits: int) -> mx.array:
    """[N, K] integer codes as MLX's packed uint32 words (LSB first)."""
    N, K = codes.shape
    per = 32 // bits
    shifts = (bits * np.arange(per)).astype(np.uint64)
    words = (codes.astype(np.uint64).reshape(N, K // per, per) << shifts).sum(-1)
    return mx.array(words.astype(np.uint32))


def test_near_ties_are_decided_in_fp32(rows16_path):
    """Rows that are one row with single codes nudged by +-1: logits closer
    together than the int8 activations' error, spread over every block."""
    N, K, gs, bits = 16 * 64, 256, 32, 8
    rng = np.random.default_rng(2)
    codes = np.repeat(rng.integers(0, 256, (1, K)), N, axis=0)
    k = rng.integers(0, K, N)
    codes[np.arange(N), k] = np.clip(codes[np.arange(N), k] + rng.choice([-1, 1], N), 0, 255)
    s = mx.array(rng.uniform(0.001, 0.002, (N, K // gs)).astype(np.float16))
    w, s, _ = ops.pack_rows16(pack_codes(codes, bits), s, None)
    bounds = ops.argmax_bounds(w, s, None, group_size=gs, bits=bits)
    mx.random.seed(3)
    assert_same(mx.random.normal((64, K)), w, s, None, bounds, gs, bits)


def test_a_row_the_int8_logits_rank_lower_still_wins(rows16_path):
    """Row 0 wins in fp32 (0.45 + 0.45 > 0.6 of a unit) but loses in int8
    (0.45 rounds to 0, 0.6 to 1): only its bound keeps it in the running.
    The check can fail: with zero bounds the screen drops it."""
    N, K, gs, bits = 32, 64, 32, 8
    codes = np.full((N, K), 128)  # symmetric 8-bit: 128 is 0
    codes[0, [1, 2]] = 129
    codes[16, 3] = 129  # another 16-row block
    s = mx.full((N, K // gs), 0.01, dtype=mx.float16)
    w, s, _ = ops.pack_rows16(pack_codes(codes, bits), s, None)
    bounds = ops.argmax_bounds(w, s, None, group_size=gs, bits=bits)
    x = np.zeros((1, K), np.float32)
    x[0, :4] = [127.0, 0.45, 0.45, 0.6]  # the block's int8 scale d = 1
    x = mx.array(x)
    assert ops.quantized_matmul(x, w, s, None, group_size=gs, bits=bits,
                                activations="int8").argmax().item() == 16
    assert assert_same(x, w, s, None, bounds, gs, bits).tolist() == [0]
    assert head_argmax(x, w, s, None, mx.zeros_like(bounds), gs, bits).tolist() == [16]


def test_rows_that_are_not_finite_follow_mlx(rows16_path):
    gs, bits = 32, 4
    w, s, b, bounds = make_head(16 * 20, 128, bits, gs, seed=4)
    mx.random.seed(5)
    x = np.array(mx.random.normal((6, 128)))
    x[1, 7] = np.nan
    x[2, 3] = np.inf
    x[3, :] = 1e37  # overflowing logits (+-inf, and NaN from inf - inf)
    x[4, 5] = -np.inf
    x = mx.array(x)
    assert_same(x, w, s, b, bounds, gs, bits)
    assert_same(x, w, s, b, bounds, gs, bits, (mx.ones((128,)), 1e-5))


@pytest.mark.parametrize("bits,gs,symmetric", [(8, 32, True), (4, 64, False), (4, 32, True)])
def test_bounds_hold(rows16_path, bits, gs, symmetric):
    """|fp32 logit - int8 logit| <= sum_b d_b c[n, b], for heavy-tailed x."""
    K = 512
    w, s, b, bounds = make_head(16 * 32, K, bits, gs, symmetric=symmetric, seed=6)
    mx.random.seed(7)
    x = mx.random.normal((40, K)) / (mx.random.uniform(0.02, 1.0, (40, K)) ** 2)
    y32 = ops.quantized_matmul(x, w, s, b, group_size=gs, bits=bits)
    y8 = ops.quantized_matmul(x, w, s, b, group_size=gs, bits=bits, activations="int8")
    d = mx.abs(x).reshape(40, K // 32, 32).max(-1) / 127
    c = ops.unpack_rows16(bounds, bounds, None)[0].astype(mx.float32)  # [N, K / 32]
    err, bound = mx.abs(y32 - y8), d @ c.T
    assert (err <= bound).all().item()
    assert (err > 0).any().item()  # the int8 logits do differ


def test_falls_back_to_the_full_head(rows16_path):
    # MLX's layout (not row-interleaved) or no bounds: the full head's argmax.
    mx.random.seed(8)
    wq, s, b = mx.quantize(mx.random.normal((100, 64)) * 0.05, group_size=32, bits=4)
    x = mx.random.normal((5, 64))
    assert not ops.has_native_quantized_argmax(x, wq, 4)
    got = ops.quantized_argmax(x, wq, s, b, None, group_size=32, bits=4)
    assert got.tolist() == full_argmax(x, wq, s, b, 32, 4).tolist()


def test_validation_errors(rows16_path):
    from mlxfast import _ext
    w, s, b, bounds = make_head(16 * 4, 64, 8, 32)
    x = mx.random.normal((2, 64))
    with pytest.raises(ValueError, match="bounds must be float16"):
        _ext.quantized_argmax(x, w, s, b, bounds[:2], group_size=32, bits=8)
    with pytest.raises(ValueError, match="bounds must be float16"):
        _ext.quantized_argmax(x, w, s, b, bounds.astype(mx.float32), group_size=32, bits=8)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        _ext.quantized_argmax(x.astype(mx.int32), w, s, b, bounds, group_size=32, bits=8)
    with pytest.raises(ValueError, match="row-interleaved"):
        _ext.quantized_argmax(mx.random.normal((2, 32)), w, s, b, bounds, group_size=32, bits=8)
    with pytest.raises(ValueError, match="bits"):
        _ext.quantized_argmax(x, w, s, b, bounds, group_size=32, bits=2)


@pytest.fixture(scope="module", params=["default", "gemma3"])
def real_model(request):
    """The default model (tied 8-bit head, 49152 rows) and Gemma 3 270M
    (tied 8-bit head, 262144 rows): installed by `make test`; missing must
    fail, not skip."""
    import mlxfast
    if request.param == "default":
        return mlxfast.load()
    return mlxfast.load(request.getfixturevalue("gemma3_gguf"))


def test_engine_greedy_tokens_are_the_same_with_and_without_the_heads_choice(real_model):
    """Eight greedy streams, plain and with prompt lookup: the same tokens
    whether the head chooses them or the sampler takes the logits' argmax."""
    from mlxfast.engine.api import Request, SamplingParams, TokenEvent
    from mlxfast.engine.config import EngineConfig
    from mlxfast.engine.engine import Engine

    model, tok = real_model
    head = model.output_head
    x = mx.zeros((2, model.args.hidden_size), model.dtype)
    native = ops.has_native_quantized_argmax(x, head["weight"], head.bits, (model.model.norm.weight, 1e-6))
    assert native == (ops.cpu_path() in ("avx2", "avx512"))  # where it runs, this checks it
    prompts = [tok.encode(f"def f{i}(x):\n    return x * {i} + 1\n\n# again: def f{i}(x):")
               for i in range(8)]

    def run(**cfg):
        engine = Engine(model, tok, EngineConfig(max_num_seqs=8, kv_cache_gb=0.25, **cfg)).start()

        async def one(p, delay):
            await asyncio.sleep(delay)
            params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
            return [ev.token_id async for ev in engine.submit(Request(p, params))
                    if isinstance(ev, TokenEvent)]

        async def main():
            return await asyncio.gather(*(one(p, 0.02 * i) for i, p in enumerate(prompts)))
        try:
            return asyncio.run(main())
        finally:
            engine.shutdown()

    for spec in (None, "ngram"):
        on = run(head_choice=True, spec_kind=spec)
        off = run(head_choice=False, spec_kind=spec)
        assert on == off and all(len(t) == 40 for t in on)
