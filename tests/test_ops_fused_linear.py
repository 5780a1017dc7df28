"""Fused pieces of the projection primitives (``ops.quantized_matmul`` and
``ops.dense_matmul`` with ``norm=``, ``act=``, ``residual=``).

Oracles:
* exact: the unfused native composition (``residual + matmul(rms_norm(x))``
  etc. with the separate native ops) — the fused primitive must give the same
  bits on every CPU path, GEMV (M <= 8) and GEMM (M > 8);
* approximate, against two oracles, with the error measured against the
  natural scale of the result, ``|x'| @ |W|.T + |r|`` (x' the prologue's
  output, computed by the pure-MLX references):
  - float32 math on x' (dequantized W, fp32 product and add): the error is
    a few ulps of x' (the references round their prologue differently:
    ``silu_mul_reference`` rounds the sigmoid to the dtype first,
    ``gelu_mul_reference`` rounds every op in the dtype as mlx-lm does,
    ``mx.fast.rms_norm`` sums in another order), the product's rounding and
    the residual add's. TOL: fp32 5e-6, fp16 2e-3, bf16 1.6e-2 (measured
    worst here: 4e-7, 5e-4, 3.4e-3; with gelu 4.6e-7, 5.1e-4, 3.2e-3);
  - the public ``*_reference`` composition: the same for dense weights, but
    ``mx.quantized_matmul`` in fp16/bf16 does not compute in float32 (alone
    it is off by up to ~1.3e-3 / 1.2e-2 of the scale on these shapes), so
    REF_TOL: fp32 5e-6, fp16 1e-2, bf16 6e-2 (measured worst: 4e-7, 5.4e-3,
    3.2e-2; with gelu 4.6e-7, 3.5e-3, 1.9e-2).

The fused activations are every name in ``ops.ACTS`` (``silu_mul_halves``,
``gelu_mul_halves``); each variant below runs with each.

The model tests at the end run the models as they ran before fusion (the
layers' fused pieces as separate ops) next to the fused ones: the default
model and tiny models of every family (fused and separate projections,
biases, quantized or not, fp32/fp16/bf16) give bit-identical prefill and
decode logits, and a decode step of the default model has far fewer
primitives.
"""

import io

import mlx.core as mx
import numpy as np
import pytest

from mlxfast import ops

DTYPES = [mx.float32, mx.float16, mx.bfloat16]
TOL = {mx.float32: 5e-6, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}
REF_TOL = {mx.float32: 5e-6, mx.float16: 1e-2, mx.bfloat16: 6e-2}
# (bits, group_size); bits 0 = dense weights in x's dtype.
KINDS = [(4, 32), (4, 64), (4, 128), (8, 32), (8, 64), (8, 128), (0, 0)]
EPS = 1e-5
# "silu" / "gelu": act="silu_mul_halves" / "gelu_mul_halves".
VARIANTS = ["norm", "silu", "gelu", "residual", "norm+residual", "silu+residual", "gelu+residual"]
# The separate native ops the fused act= names stand for (the unfused oracle).
ACT_OPS = {"silu_mul_halves": ops.silu_mul_halves, "gelu_mul_halves": ops.gelu_mul_halves}


def act_of(variant):
    return next((f"{a}_mul_halves" for a in ("silu", "gelu") if a in variant), None)



class Proj:
    """One projection's weights and the three ways to run it."""

    def __init__(self, bits, group_size, N, K, dtype, seed=0):
        mx.random.seed(seed)
        w = mx.random.normal((N, K)) * (1.0 / max(K, 1) ** 0.5)
        self.bits, self.group_size = bits, group_size
        if bits:
            self.wq, s, b = mx.quantize(w, group_size=group_size, bits=bits)
            self.s, self.b = s.astype(dtype), b.astype(dtype)
            self.wf = mx.dequantize(self.wq, self.s.astype(mx.float32), self.b.astype(mx.float32),
                                    group_size=group_size, bits=bits)
        else:
            self.w = w.astype(dtype)
            self.wf = self.w.astype(mx.float32)
        mx.eval(vars(self))

    def fused(self, x, **kw):
        if self.bits:
            return ops.quantized_matmul(x, self.wq, self.s, self.b, group_size=self.group_size,
                                        bits=self.bits, **kw)
        return ops.dense_matmul(x, self.w, **kw)

    def unfused(self, x, norm=None, act=None, residual=None):
        """The separate native ops, as a layer ran them before fusion."""
        if norm is not None:
            x = ops.rms_norm(x, norm[0], norm[1])
        if act is not None:
            x = ACT_OPS[act](x)
        y = self.fused(x)
        return y if residual is None else residual + y

    def reference(self, x, **kw):
        if self.bits:
            return ops.quantized_matmul_reference(x, self.wq, self.s, self.b,
                                                  group_size=self.group_size, bits=self.bits, **kw)
        return ops.dense_matmul_reference(x, self.w, **kw)


def make_case(variant, M, N, K, dtype, lead=None, seed=1):
    """x (with 2K features for act), and the fused keyword arguments."""
    mx.random.seed(seed)
    lead = (M,) if lead is None else lead
    act = act_of(variant)
    kin = 2 * K if act else K
    x = (mx.random.normal((*lead, kin)) * 2).astype(dtype)
    kw = {}
    if "norm" in variant:
        kw["norm"] = ((1 + 0.5 * mx.random.normal((K,))).astype(dtype), EPS)
    if act:
        kw["act"] = act
    if "residual" in variant:
        kw["residual"] = mx.random.normal((*lead, N)).astype(dtype)
    return x, kw


def check_approximate(proj, x, kw, got):
    xp = ops.matmul._prologue(x, kw.get("norm"), kw.get("act"), reference=True).astype(mx.float32)
    exact = xp @ proj.wf.T
    scale = mx.abs(xp) @ mx.abs(proj.wf).T
    if "residual" in kw:
        exact = exact + kw["residual"].astype(mx.float32)
        scale = scale + mx.abs(kw["residual"].astype(mx.float32))
    ref = proj.reference(x, **kw)
    assert ref.dtype == got.dtype and ref.shape == got.shape
    for oracle, tol in ((exact, TOL), (ref.astype(mx.float32), REF_TOL)):
        err = mx.abs(got.astype(mx.float32) - oracle) / (scale + 1e-30)
        worst = err.max().item()
        assert np.isfinite(worst) and worst <= tol[got.dtype], (worst, got.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: f"q{k[0]}g{k[1]}" if k[0] else "dense")
@pytest.mark.parametrize("M", [1, 3, 8, 33])
def test_fused_equals_unfused_native_and_reference(path, kind, dtype, M):
    bits, gs = kind
    N, K = 96, 256
    proj = Proj(bits, gs, N, K, dtype)
    for i, variant in enumerate(VARIANTS):
        x, kw = make_case(variant, M, N, K, dtype, seed=10 * M + i)
        got = proj.fused(x, **kw)
        want = proj.unfused(x, **kw)
        assert got.dtype == dtype and got.shape == (M, N), variant
        assert mx.array_equal(got, want).item(), (variant, path)
        check_approximate(proj, x, kw, got)


@pytest.mark.parametrize("kind", [(4, 64), (8, 32), (0, 0)])
def test_leading_axes_and_strided_inputs(path, kind):
    """x [B, L, K] and a strided x / residual (packed inside the primitive)."""
    bits, gs = kind
    N, K = 64, 128
    proj = Proj(bits, gs, N, K, mx.float32)
    for variant in VARIANTS:
        x, kw = make_case(variant, None, N, K, mx.float32, lead=(2, 5))
        assert mx.array_equal(proj.fused(x, **kw), proj.unfused(x, **kw)).item(), variant
        xs = mx.concatenate([x, x], axis=-1)[..., ::2]  # strided last axis
        if "residual" in kw:
            kw["residual"] = mx.swapaxes(mx.swapaxes(kw["residual"], 0, 1) + 0, 0, 1)
        assert mx.array_equal(proj.fused(xs, **kw), proj.unfused(xs, **kw)).item(), variant


@pytest.mark.parametrize("xdtype,ndtype", [(mx.float16, mx.float32), (mx.bfloat16, mx.float32),
                                           (mx.float32, mx.bfloat16), (mx.float16, mx.bfloat16)])
@pytest.mark.parametrize("kind", [(4, 64), (0, 0)])
@pytest.mark.parametrize("M", [1, 12])
def test_norm_weight_of_another_dtype_promotes_like_rms_norm(kind, xdtype, ndtype, M):
    """rms_norm promotes x with its weight; the fused norm does the same, and
    a residual then has the promoted dtype."""
    bits, gs = kind
    N, K = 48, 128
    proj = Proj(bits, gs, N, K, xdtype)
    x = mx.random.normal((M, K)).astype(xdtype)
    norm = (mx.random.normal((K,)).astype(ndtype), EPS)
    t = mx.result_type(x, norm[0])
    r = mx.random.normal((M, N)).astype(t)
    got = proj.fused(x, norm=norm, residual=r)
    assert got.dtype == t
    assert mx.array_equal(got, proj.unfused(x, norm=norm, residual=r)).item()


@pytest.mark.parametrize("xdtype,wdtype", [(mx.bfloat16, mx.float32), (mx.float16, mx.bfloat16),
                                           (mx.float32, mx.float16)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_dense_weight_dtype_promotion(xdtype, wdtype, variant):
    """dense_matmul follows MLX's promotion of x and w; where w would promote
    the prologue's result the separate ops run (same numbers either way)."""
    N, K = 40, 64
    mx.random.seed(3)
    w = mx.random.normal((N, K)).astype(wdtype)
    x, kw = make_case(variant, 4, N, K, xdtype)
    t = mx.result_type(xdtype, wdtype)
    if "residual" in kw:
        kw["residual"] = kw["residual"].astype(t)
    got = ops.dense_matmul(x, w, **kw)
    xp = x
    if "norm" in kw:
        xp = ops.rms_norm(x, *kw["norm"])
    if "act" in kw:
        xp = ACT_OPS[kw["act"]](x)
    want = ops.dense_matmul(xp, w)
    if "residual" in kw:
        want = kw["residual"] + want
    assert got.dtype == want.dtype == t
    assert mx.array_equal(got, want).item()


def _primitives(y) -> list[str]:
    buf = io.StringIO()
    mx.export_to_dot(buf, y)
    return [line.split('label ="')[1].split('"')[0] for line in buf.getvalue().splitlines()
            if "shape=rectangle" in line]


def test_one_primitive_per_fused_projection():
    proj = Proj(4, 64, 32, 64, mx.float32)
    x = mx.random.normal((3, 128))
    r = mx.random.normal((3, 32))
    x64 = mx.random.normal((3, 64))
    norm = (mx.ones((64,)), EPS)
    mx.eval(x, r, x64, norm[0])
    assert _primitives(proj.fused(x, act="silu_mul_halves", residual=r)) == ["MlxfastQuantizedMatmul"]
    assert _primitives(proj.fused(x, act="gelu_mul_halves", residual=r)) == ["MlxfastQuantizedMatmul"]
    assert _primitives(proj.fused(x64, norm=norm, residual=r)) == ["MlxfastQuantizedMatmul"]
    dense = Proj(0, 0, 32, 64, mx.float32)
    assert _primitives(dense.fused(x64, norm=norm, residual=r)) == ["MlxfastDenseMatmul"]
    assert _primitives(dense.fused(x, act="gelu_mul_halves", residual=r)) == ["MlxfastDenseMatmul"]


def test_equal_nodes_differ_by_fusion():
    """mx.compile merges equivalent nodes: the fused pieces must be compared."""
    proj = Proj(4, 64, 32, 64, mx.float32)
    x = mx.random.normal((2, 64))
    w1, w2 = mx.ones((64,)), mx.ones((64,))

    def f(x):
        return proj.fused(x, norm=(w1, 1e-5)), proj.fused(x, norm=(w2, 1e-2)), proj.fused(x)

    got = mx.compile(f)(x)
    want = f(x)
    for g, w in zip(got, want):
        assert mx.array_equal(g, w).item()
    assert not mx.array_equal(want[0], want[1]).item()
    for p in (proj, Proj(0, 0, 32, 64, mx.float32)):  # silu vs gelu prologue on the same x
        x2 = mx.random.normal((2, 128))

        def g(x):
            return p.fused(x, act="silu_mul_halves"), p.fused(x, act="gelu_mul_halves")

        got, want = mx.compile(g)(x2), g(x2)
        for a, b in zip(got, want):
            assert mx.array_equal(a, b).item()
        assert not mx.array_equal(want[0], want[1]).item()


def test_empty_inputs():
    proj = Proj(4, 32, 8, 64, mx.float32)
    x = mx.zeros((0, 64))
    assert proj.fused(x, norm=(mx.ones((64,)), EPS), residual=mx.zeros((0, 8))).shape == (0, 8)
    dense = Proj(0, 0, 3, 0, mx.float32)
    r = mx.array([[-0.0, 1.0, 2.0], [3.0, -4.0, 5.0]])
    got = dense.fused(mx.ones((2, 0)), residual=r)  # K == 0: r + 0
    assert mx.array_equal(got, dense.unfused(mx.ones((2, 0)), residual=r)).item()


# --- bad input ----------------------------------------------------------------


@pytest.fixture(params=["quantized", "dense"])
def proj(request):
    return Proj(4, 32, 16, 64, mx.float32) if request.param == "quantized" else Proj(0, 0, 16, 64, mx.float32)


@pytest.fixture(params=["native", "reference"])
def backend(request, monkeypatch):
    """The native CPU dispatch, and the reference dispatch other devices take."""
    if request.param == "reference":
        monkeypatch.setattr(ops.dispatch, "on_cpu", lambda stream=None: False)
    return request.param


def test_rejects_bad_residual(proj, backend):
    x = mx.zeros((3, 64))
    for r in (mx.zeros((3, 15)), mx.zeros((16,)), mx.zeros((1, 3, 16)), mx.zeros((3, 16), mx.float16)):
        with pytest.raises(ValueError, match=r"\[mlxfast\.(quantized|dense)_matmul\] residual must have"):
            mx.eval(proj.fused(x, residual=r))


def test_rejects_bad_norm(proj, backend):
    x = mx.zeros((3, 64))
    with pytest.raises(ValueError, match="norm must be a \\(weight, eps\\) pair"):
        proj.fused(x, norm=mx.ones((64,)))
    for act in ACT_OPS:
        with pytest.raises(ValueError, match="norm and act cannot both"):
            proj.fused(mx.zeros((3, 128)), norm=(mx.ones((128,)), EPS), act=act)
    if backend == "native":  # the references raise MLX's own errors for these
        with pytest.raises(ValueError, match="norm weight must be \\[D\\]"):
            proj.fused(x, norm=(mx.ones((63,)), EPS))
        with pytest.raises(ValueError, match="norm weight must be \\[D\\]"):
            proj.fused(x, norm=(mx.ones((1, 64)), EPS))
        with pytest.raises(ValueError, match="norm weight must be float"):
            proj.fused(x, norm=(mx.ones((64,), mx.int32), EPS))
        with pytest.raises(ValueError, match="eps must be >= 0"):
            proj.fused(x, norm=(mx.ones((64,)), -1.0))


BAD_ACT = r"act must be one of 'silu_mul_halves', 'gelu_mul_halves' \(or [Nn]one\), got"


def test_rejects_bad_act(proj, backend):
    for bad in ("gelu", "silu", "gelu_mul", "GELU_MUL_HALVES", 3):
        with pytest.raises(ValueError, match=BAD_ACT):
            proj.fused(mx.zeros((3, 128)), act=bad)
    if backend == "native":
        for act in ACT_OPS:
            with pytest.raises(ValueError, match=f"act='{act}' needs an even last axis"):
                proj.fused(mx.zeros((3, 129)), act=act)
            with pytest.raises(ValueError, match="shape mismatch|multiple of group_size"):
                proj.fused(mx.zeros((3, 64)), act=act)  # K = 32 after act, w has 64


def test_native_and_python_agree_on_act_names():
    """The Python list of fused activations (``ops.ACTS``) and the native
    rule (``gated_act_from_halves_name``) accept the same names: each Python
    name reaches the native primitive, which accepts it and rejects others
    with the same message."""
    from mlxfast import _ext

    assert set(ops.ACTS) == set(ACT_OPS)
    w = mx.random.normal((8, 32))
    wq, s, b = mx.quantize(w, group_size=32, bits=4)
    x = mx.random.normal((2, 64))
    for act in ops.ACTS:
        mx.eval(_ext.dense_matmul(x, w, act=act), _ext.quantized_matmul(x, wq, s, b, group_size=32,
                                                                          bits=4, act=act))
    for bad in ("gelu", "silu_mul"):
        with pytest.raises(ValueError, match=BAD_ACT):
            _ext.dense_matmul(x, w, act=bad)
        with pytest.raises(ValueError, match=BAD_ACT):
            _ext.quantized_matmul(x, wq, s, b, group_size=32, bits=4, act=bad)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ["silu_mul_halves", "gelu_mul_halves"])
@pytest.mark.parametrize("kind,K", [((4, 32), 96), ((8, 64), 64), ((0, 0), 37), ((0, 0), 45)],
                         ids=["q4g32", "q8g64", "dense-K37", "dense-K45"])
@pytest.mark.parametrize("M", [1, 5, 17])
def test_act_prologue_large_inputs_and_odd_sizes(path, act, kind, K, dtype, M):
    """Gate values of +-20 and +-80 (saturating the activation; fp16's x**3
    overflows in the reference) and odd K (vector tails of the prologue):
    the fused result is finite and equals the separate ops bit for bit."""
    bits, gs = kind
    N = 24
    proj = Proj(bits, gs, N, K, dtype, seed=7)
    mx.random.seed(8)
    gate = mx.random.normal((M, K)) * 2
    big = mx.array([20.0, -20.0, 80.0, -80.0])
    gate = mx.where(mx.random.uniform(shape=(M, K)) < 0.3, big[mx.random.randint(0, 4, (M, K))], gate)
    x = mx.concatenate([gate, mx.random.normal((M, K))], axis=-1).astype(dtype)
    r = mx.random.normal((M, N)).astype(dtype)
    for kw in ({"act": act}, {"act": act, "residual": r}):
        got = proj.fused(x, **kw)
        assert got.dtype == dtype and got.shape == (M, N)
        assert mx.all(mx.isfinite(got)).item()
        assert mx.array_equal(got, proj.unfused(x, **kw)).item(), (kw.keys(), path)
        check_approximate(proj, x, kw, got)


def test_reference_dispatch_is_the_reference(proj, monkeypatch):
    """Off the CPU, ops run the reference composition (checked here by forcing
    that dispatch on the CPU)."""
    monkeypatch.setattr(ops.dispatch, "on_cpu", lambda stream=None: False)
    for variant in VARIANTS:
        x, kw = make_case(variant, 3, 16, 64, mx.float32)
        assert mx.array_equal(proj.fused(x, **kw), proj.reference(x, **kw)).item(), variant


# --- the default model ----------------------------------------------------------


@pytest.fixture(scope="module")
def default_model():
    import mlxfast

    return mlxfast.load()[0]


def _decode_graph(model):
    """Prefill logits (evaluated) and the logits of one decode step (lazy)."""
    from mlxfast.kv import DenseKVCache

    cache = DenseKVCache(len(model.layers))
    ids = mx.array([[1, 54, 38, 14, 60, 75, 82, 49]])  # < every test vocab
    prefill = model(ids, cache)
    mx.eval(prefill)
    cache.advance(ids.shape[1])
    return prefill, model(mx.array([[28]]), cache)


def _unfuse_layers(monkeypatch):
    """The model as it ran before fusion: every layer call that passes fused
    pieces runs them as separate ops around the plain projection instead
    (``residual + proj(norm(x))``, ``residual + proj(silu_mul_halves(x))`` or
    the act named, ``head(norm(h))``); the model code itself is unchanged."""
    from mlxfast.models.layers import Embedding, Linear, QuantizedEmbedding, QuantizedLinear

    for cls in (Linear, QuantizedLinear):
        def call(self, x, *, norm=None, act=None, residual=None, _plain=cls.__call__):
            if norm is not None:
                x = norm(x)
            if act is not None:
                x = ACT_OPS[act](x)
            y = _plain(self, x)
            return y if residual is None else residual + y
        monkeypatch.setattr(cls, "__call__", call)
    for cls in (Embedding, QuantizedEmbedding):
        def as_linear(self, x, *, norm=None, _plain=cls.as_linear):
            return _plain(self, x if norm is None else norm(x))
        monkeypatch.setattr(cls, "as_linear", as_linear)


def test_default_model_decode_step_primitives(default_model, monkeypatch):
    """Primitives in one decode step of the default model (30 layers,
    DenseKVCache): 363 before fusion (12 per layer: 2 rms_norm, 4 matmuls,
    2 adds, silu_mul, qkv_rope, kv_write_pair, attention; + embedding, final
    norm, head), 212 after (7 per layer; the final norm rides in the head).
    The bound is one the graph before fusion exceeds (checked below).
    """
    prims = _primitives(_decode_graph(default_model)[1])
    assert len(prims) <= 215, len(prims)
    assert "Add" not in prims and "SiluMul" not in prims and "MlxfastRmsNorm" not in prims
    _unfuse_layers(monkeypatch)
    assert len(_primitives(_decode_graph(default_model)[1])) > 350


def test_default_model_logits_unchanged_by_fusion(default_model, monkeypatch):
    """Prefill and decode logits are bit-identical to the unfused composition."""
    fused = _decode_graph(default_model)
    mx.eval(fused)
    _unfuse_layers(monkeypatch)
    unfused = _decode_graph(default_model)
    for a, b in zip(fused, unfused):
        assert mx.array_equal(a, b).item()


# --- layers and tiny models of every family: fused == unfused, bit for bit ------

TINY = [
    ("llama", mx.float32, None, {}),
    ("llama", mx.bfloat16, {"group_size": 32, "bits": 4}, {}),
    ("llama", mx.float16, None, {"attention_bias": True, "mlp_bias": True}),  # bias before residual
    ("llama", mx.float32, {"group_size": 32, "bits": 4,  # unlike q/k/v and gate/up stay separate
                           "model.layers.0.self_attn.k_proj": {"group_size": 32, "bits": 8},
                           "model.layers.1.mlp.up_proj": {"group_size": 64, "bits": 8}}, {}),
    ("mistral", mx.bfloat16, None, {}),
    ("qwen2", mx.float16, {"group_size": 64, "bits": 8}, {}),  # q/k/v bias
    ("qwen3", mx.bfloat16, None, {}),  # per-head q/k norm
]


@pytest.mark.parametrize("kind,dtype,quant,overrides", TINY,
                         ids=[f"{t[0]}-{t[1]}-{'q' if t[2] else 'dense'}{'-bias' if t[3] else ''}"
                              f"{'-mixed' if t[2] and len(t[2]) > 2 else ''}" for t in TINY])
def test_tiny_model_logits_unchanged_by_fusion(tmp_path, monkeypatch, kind, dtype, quant, overrides):
    import mlxfast
    from tiny_models import make_tiny_model

    model, _ = mlxfast.load(make_tiny_model(tmp_path / "m", kind, dtype=dtype, quantize=quant,
                                            **overrides))
    if quant and len(quant) > 2:
        assert "qkv_proj" not in model.layers[0].self_attn and "gate_up_proj" not in model.layers[1].mlp
    fused = _decode_graph(model)
    mx.eval(fused)
    _unfuse_layers(monkeypatch)
    unfused = _decode_graph(model)
    for a, b in zip(fused, unfused):
        assert a.dtype == b.dtype
        assert mx.array_equal(a, b).item()


def test_engine_tiny_model_unfused_projections(monkeypatch):
    """The engine tests' model (dense, q/k/v and gate/up never fused)."""
    from engine_utils import tiny_model

    model = tiny_model()
    fused = _decode_graph(model)
    mx.eval(fused)
    _unfuse_layers(monkeypatch)
    for a, b in zip(fused, _decode_graph(model)):
        assert mx.array_equal(a, b).item()


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_layers_take_fused_pieces(quantized, bias):
    from mlxfast.models.layers import Linear, QuantizedLinear, RMSNorm

    mx.random.seed(5)
    K, N = 64, 32
    w = mx.random.normal((N, K)).astype(mx.bfloat16)
    if quantized:
        lin = QuantizedLinear(K, N, bias, 32, 4)
        wq, s, b = mx.quantize(w, group_size=32, bits=4)
        lin.update({"weight": wq, "scales": s, "biases": b})
    else:
        lin = Linear(K, N, bias)
        lin.weight = w
    if bias:
        lin.bias = mx.random.normal((N,)).astype(mx.bfloat16)
    norm = RMSNorm(K, 1e-5)
    norm.weight = (1 + mx.random.normal((K,))).astype(mx.bfloat16)
    x = mx.random.normal((2, 3, K)).astype(mx.bfloat16)
    x2 = mx.random.normal((2, 3, 2 * K)).astype(mx.bfloat16)
    r = mx.random.normal((2, 3, N)).astype(mx.bfloat16)
    assert mx.array_equal(lin(x, norm=norm), lin(norm(x))).item()
    assert mx.array_equal(lin(x, norm=norm, residual=r), r + lin(norm(x))).item()
    for act, op in ACT_OPS.items():
        assert mx.array_equal(lin(x2, act=act, residual=r), r + lin(op(x2))).item(), act
        assert mx.array_equal(lin(x2, act=act), lin(op(x2))).item(), act
    r32 = r.astype(mx.float32)  # another dtype: MLX's add promotes, as unfused
    got = lin(x, residual=r32)
    assert got.dtype == mx.float32 and mx.array_equal(got, r32 + lin(x)).item()
    if not bias:
        assert _primitives(lin(x, norm=norm, residual=r))[-1].startswith("Mlxfast")


def test_back_to_back_pool_jobs_run_every_task_once():
    """The residual epilogue adds in place, split over the thread pool: a task
    run twice (or skipped) by a worker racing from one job into the next would
    show as a doubled (or missing) residual. Hundreds of short jobs back to
    back, each checked exactly against the same matmul plus the residual."""
    w = mx.random.normal((4096, 64), key=mx.random.key(3))
    wq, s, b = mx.quantize(w, group_size=32, bits=4)
    x = mx.random.normal((8, 64), key=mx.random.key(4))
    plain = ops.quantized_matmul(x, wq, s, b, group_size=32, bits=4)
    mx.eval(wq, s, b, x, plain)
    outs, want = [], []
    for i in range(300):
        r = mx.full(plain.shape, float(i))
        outs.append(ops.quantized_matmul(x, wq, s, b, group_size=32, bits=4, residual=r))
        want.append(r + plain)
    mx.eval(outs, want)
    for i, (got, exp) in enumerate(zip(outs, want)):
        assert mx.array_equal(got, exp).item(), i
