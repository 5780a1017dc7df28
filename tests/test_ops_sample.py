"""ops.sample_tokens (native) against sample_tokens_reference (pure MLX)."""

import mlx.core as mx
import numpy as np
import pytest

from mlxfast import ops


def keys_for(rng, R):
    return mx.array(rng.integers(0, 2**32, size=(R, 2), dtype=np.uint32))


def nucleus_margin(y_row: np.ndarray, k: int, tp: float) -> float:
    """Distance (in probability) between top_p and the nearest exclusive
    cumulative probability of the top-k distribution (float64)."""
    s = np.sort(y_row.astype(np.float64))[::-1][:k]
    s = s[np.isfinite(s)]
    p = np.exp(s - s[0])
    p /= p.sum()
    excl = np.cumsum(p) - p
    return float(np.abs(excl - tp).min())


def check_rows(x, keys, temps, ks, tps, mps, *, exact_top_p=False):
    got = ops.sample_tokens(x, keys, temps, ks, tps, mps)
    ref = ops.sample_tokens_reference(x, keys, temps, ks, tps, mps)
    assert got.dtype == mx.uint32 and got.shape == (x.shape[0],)
    got, ref = got.tolist(), ref.tolist()
    xn = np.array(x.astype(mx.float32))
    R, V = xn.shape
    for r in range(R):
        if got[r] == ref[r]:
            continue
        # Only top-p's cut may differ, and only within float rounding of a boundary.
        assert not exact_top_p, (r, got[r], ref[r])
        assert temps[r] > 0 and 0 < tps[r] < 1, (r, got[r], ref[r])
        k = ks[r] if 0 < ks[r] < V else V
        assert nucleus_margin(xn[r] / temps[r], k, tps[r]) < 1e-5, (r, got[r], ref[r])


@pytest.mark.parametrize("V", [1, 2, 3, 51, 1000, 49152])
def test_temperature_only_is_exact(V):
    # Exercises the noise: threefry counters, uniform conversion, logs.
    rng = np.random.default_rng(V)
    R = 6
    x = mx.array((rng.normal(size=(R, V)) * 2).astype(np.float32))
    for trial in range(3):
        keys = keys_for(rng, R)
        temps = [0.3, 0.7, 1.0, 1.5, 4.0, 0.0]
        check_rows(x, keys, temps, [0] * R, [1.0] * R, [0.0] * R, exact_top_p=True)


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0])
def test_parameter_mix_matches_reference(scale):
    rng = np.random.default_rng(int(scale * 10))
    R, V = 12, 5000
    for trial in range(6):
        x = mx.array((rng.normal(size=(R, V)) * scale).astype(np.float32))
        keys = keys_for(rng, R)
        temps = rng.choice([0.0, 0.2, 0.7, 1.0, 2.0], R).tolist()
        ks = rng.choice([0, 1, 2, 5, 40, 1000, V, V + 3], R).tolist()
        tps = rng.choice([1.0, 0.0, 1e-6, 0.1, 0.5, 0.9, 0.95, 0.99], R).tolist()
        mps = rng.choice([0.0, 0.0, 0.01, 0.1, 0.5, 1.0], R).tolist()
        check_rows(x, keys, temps, ks, tps, mps)


def test_ties_and_masked_tokens():
    rng = np.random.default_rng(7)
    R, V = 8, 3000
    # few distinct values: ties at the top-k threshold and inside the nucleus
    xn = rng.integers(-4, 4, size=(R, V)).astype(np.float32)
    xn[:, rng.choice(V, V // 2, replace=False)] = -np.inf  # masked (grammar, bans)
    xn[3, :] = -np.inf
    xn[3, [10, 20, 30]] = 1.0  # fewer finite tokens than top_k
    x = mx.array(xn)
    for trial in range(5):
        keys = keys_for(rng, R)
        temps = [1.0, 0.5, 2.0, 1.0, 1.0, 0.8, 1.3, 0.0]
        ks = [0, 10, 100, 50, 3, 0, 2000, 5]
        tps = [0.9, 1.0, 0.5, 0.7, 0.95, 0.3, 0.999, 0.5]
        mps = [0.0, 0.0, 0.1, 0.0, 0.0, 0.2, 0.0, 0.0]
        check_rows(x, keys, temps, ks, tps, mps)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_dtypes(dtype):
    rng = np.random.default_rng(3)
    R, V = 5, 4096
    x = mx.array((rng.normal(size=(R, V)) * 3).astype(np.float32)).astype(dtype)
    keys = keys_for(rng, R)
    check_rows(x, keys, [0.0, 0.7, 1.0, 1.0, 2.0], [0, 0, 20, 0, 0], [1.0, 1.0, 1.0, 0.9, 0.8],
               [0.0, 0.05, 0.0, 0.0, 0.0])


def test_non_contiguous_logits():
    rng = np.random.default_rng(4)
    x = mx.array((rng.normal(size=(300, 4)) * 3).astype(np.float32)).T
    keys = keys_for(rng, 4)
    check_rows(x, keys, [1.0] * 4, [0, 5, 0, 0], [1.0, 1.0, 0.9, 1.0], [0.0, 0.0, 0.0, 0.1])


def test_never_outside_the_nucleus_and_row_independent():
    rng = np.random.default_rng(5)
    V = 20000
    xn = (rng.normal(size=V) * 2.5).astype(np.float32)
    tp, t = 0.8, 0.9
    y = (xn / np.float32(t)).astype(np.float64)
    order = np.argsort(-y)
    p = np.exp(y[order] - y[order[0]])
    p /= p.sum()
    n_keep = int(((np.cumsum(p) - p) < tp).sum())
    nucleus = set(order[:n_keep].tolist())
    other = mx.array((rng.normal(size=(3, V)) * 2).astype(np.float32))
    seen = set()
    for seed in range(40):
        key = keys_for(np.random.default_rng(seed), 1)
        alone = ops.sample_tokens(mx.array(xn[None]), key, t, 0, tp, 0.0).item()
        batch = mx.concatenate([other[:2], mx.array(xn[None]), other[2:]])
        bkeys = mx.concatenate([keys_for(rng, 2), key, keys_for(rng, 1)])
        inside = ops.sample_tokens(batch, bkeys, [1.0, 0.5, t, 2.0], [0, 7, 0, 0],
                                   [0.9, 1.0, tp, 0.5], [0.0, 0.0, 0.0, 0.1]).tolist()[2]
        assert alone == inside
        assert alone in nucleus
        seen.add(alone)
    assert len(seen) > 5


def test_rejects_bad_input():
    x = mx.zeros((2, 10))
    k = mx.zeros((2, 2), mx.uint32)
    with pytest.raises(ValueError, match=r"\[mlxfast.sample_tokens\] logits"):
        ops.sample_tokens(mx.zeros((10,)), k, 1.0)
    with pytest.raises(ValueError, match=r"\[mlxfast.sample_tokens\] keys"):
        ops.sample_tokens(x, mx.zeros((3, 2), mx.uint32), 1.0)
    with pytest.raises(ValueError, match=r"\[mlxfast.sample_tokens\] logits must be float"):
        ops.sample_tokens(mx.zeros((2, 10), mx.int32), k, 1.0)
