"""The backward's residual mode (`residuals="logits"`): the forward keeps its own FP32
logits and the backward forms dz from them (no recompute GEMM).

Checked: both modes vs float64 autodiff (hidden, weight in both layouts, bias; the entropy
and the temperature); the forward's bytes (logp, lse, entropy, logits) never depend on the
mode; the residual mode's backward (one dz pass, one GEMM per gradient) agrees with the
recompute mode's chunk walk to rounding (<= 1e-6) when the saved logits equal the
recomputed ones (exact-arithmetic inputs, where every logit is exact in f32, so the
reference's K walk and XLA's einsum agree), run through the chunk walk it gives the same
bytes, and otherwise the modes differ by no more than the documented gradient accuracy;
two runs give identical bytes in both modes; the residual
is the returned logits array itself (no second [N, V] buffer); the fused dz kernel is
not used; an unknown mode is refused. Tensor parallel: `tests/residuals_tp_cases.py`
on 8 host devices, in a subprocess.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import detlogp_jax as dl
from detlogp_jax import backends, grad, inputs, pipeline
from tests.helpers import ROOT, assert_bitwise_equal, rel_err

D, V_ROWS, VOCAB = 16, 200, 190  # padding rows in the weight
MODES = ("recompute", "logits")
# Byte identity across the two modes' programs is an observation about XLA:CPU's compiled
# code (see detlogp_jax/grad.py); tests/gpu/test_residuals_gpu.py prints the GPU's.
cpu_only = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="cross-program byte identity is checked on XLA:CPU"
)


def _problem(n=13, seed=0, dtype=np.float32, exact=False, layout="vd"):
    """hidden, weight (in `layout`), bias, targets (an ignored and a bad one), per-row T.
    exact: dyadic values (k/8 and k/4, |k| <= 4) whose products and sums over D are exact
    in f32, so every program computing the logits gets the same bits."""
    rng = np.random.default_rng(seed)
    if exact:
        h = rng.integers(-4, 5, (n, D)) / 8.0
        w = rng.integers(-4, 5, (V_ROWS, D)) / 8.0
        b = rng.integers(-4, 5, V_ROWS) / 4.0
    else:
        h = rng.standard_normal((n, D))
        w = rng.standard_normal((V_ROWS, D)) * 0.5
        b = rng.standard_normal(V_ROWS) * 0.1
    h, w, b = h.astype(dtype), w.astype(dtype), b.astype(np.float32)
    t = rng.integers(0, VOCAB, n).astype(np.int32)
    t[1], t[4] = -100, VOCAB + 3
    temp = rng.uniform(0.6, 1.4, n).astype(np.float32)
    if layout == "dv":
        w = np.ascontiguousarray(w.T)
    return jnp.asarray(h), jnp.asarray(w), jnp.asarray(b), t, jnp.asarray(temp)


def _coefs(n, seed=1):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(n), jnp.float32) for _ in range(3)] + [
        jnp.asarray(rng.standard_normal((n, VOCAB)) * 0.05, jnp.float32)
    ]


def _loss_fn(t, layout, mode, *, entropy=False, logits=False, coefs):
    c_lp, c_lse, c_h, c_z = coefs

    def loss(h, w, b, temp):
        o = dl.linear_logp(
            h,
            w,
            t,
            bias=b,
            temperature=temp,
            vocab_size=VOCAB,
            backend="reference",
            weight_layout=layout,
            return_entropy=entropy,
            return_logits=logits,
            residuals=mode,
        )
        out = jnp.sum(jnp.nan_to_num(o.logp) * c_lp) + jnp.sum(o.lse * c_lse)
        if entropy:
            out = out + jnp.sum(o.entropy * c_h)
        if logits:
            out = out + jnp.sum(o.logits * c_z)
        return out

    return loss


def _f64_grads(h, w, b, t, temp, layout, coefs, entropy, logits):
    """float64 autodiff of the same loss, materialized, w.r.t. (hidden, weight, bias, T)."""
    c_lp, c_lse, c_h, c_z = (np.asarray(c, np.float64) for c in coefs)
    with jax.enable_x64(True):
        args = [jnp.asarray(np.asarray(x, np.float32), jnp.float64) for x in (h, w, b, temp)]

        def f(h, w, b, temp):
            z = (h @ (w.T if layout == "vd" else w) + b)[:, :VOCAB]
            y = z / temp[:, None]
            lse = jax.nn.logsumexp(y, axis=1)
            live = (t >= 0) & (t < VOCAB)
            yt = jnp.take_along_axis(y, jnp.clip(t, 0, VOCAB - 1)[:, None], axis=1)[:, 0]
            out = jnp.sum(jnp.where(live, yt - lse, 0.0) * c_lp + lse * c_lse)
            if entropy:
                out = out + jnp.sum((lse - jnp.sum(jax.nn.softmax(y, axis=1) * y, axis=1)) * c_h)
            if logits:
                out = out + jnp.sum(z * c_z)
            return out

        return [np.asarray(g) for g in jax.grad(f, argnums=(0, 1, 2, 3))(*args)]


# --- accuracy, determinism, the identical-or-bounded claim ------------------------------------


@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_both_modes_match_float64_and_repeat_bitwise(layout, dtype):
    """logp + lse loss: hidden, weight, bias (and T) vs float64 autodiff, f32 <= 1e-5 relative
    (bf16 <= 1e-2); with the entropy and a logits cotangent <= 1e-4 (f32); two runs, same bytes."""
    h, w, b, t, temp = _problem(dtype=dtype, layout=layout)
    coefs = _coefs(h.shape[0])
    f32 = dtype == np.float32
    for extra in ({}, {"entropy": True, "logits": True}) if f32 else ({},):
        want = _f64_grads(h, w, b, t, temp, layout, coefs, **{"entropy": False, "logits": False, **extra})
        tol = (1e-4 if extra else 1e-5) if f32 else 1e-2
        for mode in MODES:
            g = jax.jit(jax.grad(_loss_fn(t, layout, mode, coefs=coefs, **extra), argnums=(0, 1, 2, 3)))
            got = g(h, w, b, temp)
            for x, e, name in zip(got, want, ("hidden", "weight", "bias", "temperature")):
                if name == "temperature" and not f32:
                    continue
                assert x.shape == e.shape, name
                assert rel_err(x, e) <= tol, (mode, extra, name, rel_err(x, e))
            v_axis = 0 if layout == "vd" else 1
            assert np.abs(np.take(np.asarray(got[1], np.float32), np.arange(VOCAB, V_ROWS), axis=v_axis)).max() == 0
            for x, y in zip(got, g(h, w, b, temp)):
                assert_bitwise_equal(np.asarray(x, np.float32), np.asarray(y, np.float32), f"{mode} repeat")


@pytest.mark.slow
@cpu_only
@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_gradient_modes_agree_to_rounding_when_the_logits_agree(layout, dtype):
    """Exact-arithmetic inputs: the reference's K walk (the saved logits) and the backward's
    XLA einsum (the recomputed ones) give the same bits, so the two modes differ only where
    the residual mode sums differently (one GEMM over the whole vocabulary vs the chunk
    walk's chunk GEMMs, one row reduction vs per-chunk sums): relative Frobenius <= 1e-6 per
    tensor, with the entropy, the per-row temperature and a logits cotangent too. (Through
    the chunk walk, grad.backward(saved_logits_chunked=True), the bytes are identical: the
    next-but-one test.)"""
    h, w, b, t, temp = _problem(dtype=dtype, exact=True, layout=layout)
    coefs = _coefs(h.shape[0])
    for extra in ({}, {"entropy": True, "logits": True}):
        got = {
            mode: jax.jit(jax.grad(_loss_fn(t, layout, mode, coefs=coefs, **extra), argnums=(0, 1, 2, 3)))(
                h, w, b, temp
            )
            for mode in MODES
        }
        for x, y, name in zip(got["recompute"], got["logits"], ("hidden", "weight", "bias", "temperature")):
            assert np.isfinite(np.asarray(y, np.float32)).all(), (name, extra)
            assert rel_err(y, x) <= 1e-6, (name, extra, rel_err(y, x))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_gradient_modes_differ_by_no_more_than_the_accuracy_otherwise(layout, dtype):
    """Random inputs: the saved logits (K walk) and the recomputed ones (einsum) differ in
    rounding, so the gradient bytes may differ; relative Frobenius <= 1e-5 per tensor with
    f32 inputs (<= 1e-2 with bf16: dz is rounded to bf16 for the gradient GEMMs)."""
    h, w, b, t, temp = _problem(n=29, seed=5, dtype=dtype, layout=layout)
    coefs = _coefs(h.shape[0], seed=6)
    f32 = dtype == np.float32
    for extra in ({}, {"entropy": True, "logits": True}):
        got = {
            mode: jax.jit(jax.grad(_loss_fn(t, layout, mode, coefs=coefs, **extra), argnums=(0, 1, 2, 3)))(
                h, w, b, temp
            )
            for mode in MODES
        }
        for x, y, name in zip(got["recompute"], got["logits"], ("hidden", "weight", "bias", "temperature")):
            assert rel_err(y, x) <= (1e-5 if f32 else 1e-2), (name, extra, rel_err(y, x))


def _exact_backward_case(layout, seed=3):
    """grad.backward's operands for exact inputs, with the float64 logits (exact in f32)."""
    h, w, b, t, temp = _problem(n=11, seed=seed, exact=True, layout=layout)
    wv = np.asarray(w, np.float64) if layout == "vd" else np.asarray(w, np.float64).T
    z = np.asarray(h, np.float64) @ wv.T + np.asarray(b, np.float64)
    inv_t = inputs.inv_temperature(temp, h.shape[0])
    y = z[:, :VOCAB] * np.asarray(inv_t, np.float64)[:, None]
    m = y.max(1, keepdims=True)
    e = np.exp(y - m)
    lse = (np.log(e.sum(1)) + m[:, 0]).astype(np.float32)
    ent = (lse - ((e / e.sum(1, keepdims=True)) * y).sum(1)).astype(np.float32)
    rng = np.random.default_rng(seed + 1)
    g = [jnp.asarray(rng.standard_normal(h.shape[0]), jnp.float32) for _ in range(3)]
    g_logits = jnp.asarray(rng.standard_normal((h.shape[0], VOCAB)) * 0.1, jnp.float32)
    args = (h, w, b, jnp.asarray(t), inv_t, jnp.asarray(lse), g[0], g[1])
    extra = dict(entropy=jnp.asarray(ent), g_entropy=g[2], row_sums=True)
    return args, g_logits, extra, jnp.asarray(z.astype(np.float32))


@pytest.mark.slow
@cpu_only
@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("chunk", [48, 50, 64, 8192])  # clamped last chunk, ..., divisor, one chunk
def test_backward_from_saved_logits_is_the_recompute_formula(layout, chunk):
    """grad.backward(logits=z) with z equal to the recomputed logits gives the recompute
    path's bytes for every chunking (a clamped last chunk too), with a logits cotangent,
    the entropy and the temperature's row sums, when z holds all the weight's rows (its
    chunks are sliced in place). With z of the real vocabulary only (read by a gather)
    dh and dW keep those bytes; the bias gradient and the row sums are reductions that
    XLA may fuse with a recomputation of dz, so there they agree to rounding (<= 1e-6)."""
    args, g_logits, extra, z = _exact_backward_case(layout)
    for kw in ({}, extra):
        for gl in (None, g_logits):
            base = jax.tree.leaves(grad.backward(*args, gl, vocab_size=VOCAB, chunk=chunk, weight_layout=layout, **kw))
            for cols in (V_ROWS, VOCAB):
                got = grad.backward(
                    *args,
                    gl,
                    vocab_size=VOCAB,
                    chunk=chunk,
                    weight_layout=layout,
                    logits=z[:, :cols],
                    saved_logits_chunked=True,
                    **kw,
                )
                for i, (x, y) in enumerate(zip(base, jax.tree.leaves(got))):
                    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
                    if cols == V_ROWS or i < 2:
                        assert_bitwise_equal(x, y, f"leaf {i}, {cols} cols, {sorted(kw)}, g_logits={gl is not None}")
                    else:
                        assert rel_err(y, x) <= 1e-6, (i, cols, sorted(kw), rel_err(y, x))


def test_backward_refuses_saved_logits_of_the_wrong_shape():
    args, _, _, z = _exact_backward_case("vd")
    for bad in (z[:-1], z[:, :0], jnp.pad(z, ((0, 0), (0, 1))), z[0]):
        with pytest.raises(ValueError, match="saved logits"):
            grad.backward(*args, None, vocab_size=VOCAB, logits=bad)


# --- the forward ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_forward_bytes_do_not_depend_on_the_mode(layout):
    """logp, lse, entropy and logits: the same bytes in both modes, called plainly and as
    the forward of jax.vjp (where the residual mode asks the backend for its logits)."""
    h, w, b, t, temp = _problem(n=21, seed=7, dtype=ml_dtypes.bfloat16, layout=layout)
    base = dl.linear_logp(
        h,
        w,
        t,
        bias=b,
        temperature=temp,
        vocab_size=VOCAB,
        backend="reference",
        weight_layout=layout,
        return_entropy=True,
        return_logits=True,
    )
    for mode in MODES:
        for logits in (False, True):
            kw = dict(
                bias=b,
                temperature=temp,
                vocab_size=VOCAB,
                backend="reference",
                weight_layout=layout,
                return_entropy=True,
                return_logits=logits,
                residuals=mode,
            )
            plain = dl.linear_logp(h, w, t, **kw)
            under_vjp, _ = jax.vjp(lambda h, w, b: dl.linear_logp(h, w, t, **kw)[:3], h, w, b)
            for o in (plain, under_vjp):
                assert_bitwise_equal(o[0], base.logp, f"logp {mode} logits={logits}")
                assert_bitwise_equal(o[1], base.lse, f"lse {mode} logits={logits}")
                if logits:
                    assert_bitwise_equal(o[2], base.logits, f"logits {mode}")
                else:
                    assert o[2] is None
            assert_bitwise_equal(plain.entropy, base.entropy, f"entropy {mode} logits={logits}")
            ent_vjp, _ = jax.vjp(lambda h: dl.linear_logp(h, w, t, **kw).entropy, h)
            assert_bitwise_equal(ent_vjp, base.entropy, f"entropy under vjp {mode} logits={logits}")


def test_the_residual_is_the_returned_logits_array_not_a_copy():
    """The forward rule keeps the very array it returns as logits (one [N, vocab] f32 value
    in its jaxpr); without return_logits it keeps the backend's [N, V_rows] logits and
    returns none. Compiled: returning logits in residual mode needs no more temporary
    memory than in recompute mode (a second copy would add N * V * 4 bytes)."""
    h, w, b, t, temp = _problem(n=16, seed=8)
    n = h.shape[0]
    inv_t = inputs.inv_temperature(temp, n)
    for return_logits, cols in ((True, VOCAB), (False, V_ROWS)):
        cfg = pipeline.OpConfig("reference", VOCAB, V_ROWS, return_logits, residuals="logits")
        seen = {}

        def fwd(h, w, b, inv_t, cfg=cfg, seen=seen):
            out, res = pipeline._op_fwd(h, w, b, jnp.asarray(t), inv_t, None, cfg)
            seen["same"] = res[-1] is out[2]
            seen["out_logits"] = out[2] is not None
            return out, res

        jaxpr = jax.make_jaxpr(fwd)(h, w, b, inv_t)
        assert seen["out_logits"] == return_logits and (seen["same"] or not return_logits)
        nv = {
            str(v)
            for v in jaxpr.jaxpr.outvars
            if hasattr(v, "aval") and v.aval.shape == (n, cols) and v.aval.dtype == jnp.float32
        }
        assert len(nv) == 1, (return_logits, nv)
    n, v = 256, 4096  # logits (4 MiB) well above the weight and the row vectors
    rng = np.random.default_rng(9)
    h = jnp.asarray(rng.standard_normal((n, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((v, D)) * 0.3, jnp.float32)
    t = jnp.asarray(rng.integers(0, v, n), jnp.int32)

    def temp_bytes(mode):
        def step(h, w):
            def loss(h, w):
                o = dl.linear_logp(h, w, t, backend="reference", return_logits=True, residuals=mode)
                return jnp.sum(o.logp), o.logits

            return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(h, w)

        return jax.jit(step).lower(h, w).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes("logits") < temp_bytes("recompute") + n * v * 4 // 2


# --- backends, errors ----------------------------------------------------------------------


@pytest.fixture
def fresh_traces():
    jax.clear_caches()
    yield
    jax.clear_caches()


def test_the_fused_dz_kernel_is_not_used_in_residual_mode(monkeypatch, fresh_traces):
    """A backend's dz kernel recomputes z; it has no logits input: the residual mode never calls it."""
    calls = []

    def fn(hp, w_c, b_c, t_c, inv_t, lse, c1, c2, lo, hi, weight_layout):
        calls.append(hp.shape)
        z = jnp.einsum("nd,vd->nv", hp, w_c, precision=jax.lax.Precision.HIGHEST) + b_c[None, :]
        cols = jnp.arange(w_c.shape[0])
        live = (cols >= lo) & (cols < hi)
        p = jnp.exp(z * inv_t[:, None] - lse[:, None])
        dz = c1[:, None] * p + c2[:, None] * (cols[None, :] == t_c[:, None])
        return jnp.where(live[None, :], dz, 0.0)

    kern = backends.DzKernel(fn=fn, supports=lambda h, w, chunk, layout: True, row_multiple=8)
    ref = backends.get("reference")
    monkeypatch.setitem(backends._LOADED, "reference", backends.Backend(**{**ref.__dict__, "dz": kern}))
    h, w, b, t, _ = _problem(n=9, seed=10)
    for mode, want_calls in (("logits", False), ("recompute", True)):
        calls.clear()

        def loss(h, w, b):
            o = dl.linear_logp(h, w, t, bias=b, vocab_size=VOCAB, backend="reference", residuals=mode)
            return jnp.sum(jnp.nan_to_num(o.logp)) + jnp.sum(o.lse)

        jax.grad(loss, argnums=(0, 1, 2))(h, w, b)
        assert bool(calls) == want_calls, (mode, calls)


def test_an_unknown_residual_mode_is_refused():
    from flax import nnx

    from detlogp_jax.flax import LogpHead
    from sharding import linear_logp_local, linear_logp_tp

    h, w, b, t, _ = _problem(n=6)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("tp",))
    for bad in ("logit", "none", None, True):
        with pytest.raises(ValueError, match="residuals must be 'recompute'"):
            dl.linear_logp(h, w, t, residuals=bad)
        with pytest.raises(ValueError, match="residuals must be 'recompute'"):
            linear_logp_tp(h, w, t, mesh=mesh, residuals=bad)
        with pytest.raises(ValueError, match="residuals must be 'recompute'"):
            linear_logp_local(h, w, t, vocab_size=V_ROWS, padded_vocab_size=V_ROWS, residuals=bad)
        with pytest.raises(ValueError, match="residuals must be 'recompute'"):
            LogpHead(D, VOCAB, residuals=bad, rngs=nnx.Rngs(0))
    head = LogpHead(D, VOCAB, backend="reference", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="residuals must be 'recompute'"):
        head(h, t, residuals="logit")


def test_the_xla_lane_accepts_the_option_and_differentiates_as_before():
    h, w, b, t, _ = _problem(n=6)

    def g(mode):
        f = lambda h: jnp.sum(jnp.nan_to_num(dl.linear_logp(h, w, t, backend="xla", residuals=mode).logp))
        return jax.grad(f)(h)

    assert_bitwise_equal(g("logits"), g("recompute"), "xla lane")


# --- tensor parallel (8 host devices, in a subprocess) ----------------------------------------


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("residuals_tp") / "tp.json"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "residuals_tp_cases.py"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.exists(), proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["ok"], data.get("error")
    assert data["n_devices"] == 8
    return data["result"]


@pytest.mark.slow
def test_tp_residual_mode_matches_single_device(tp_results):
    """linear_logp_tp(residuals="logits") at TP=8, TP=2 x 2 row shards and a [D, V] kernel at
    TP=4: forward bytes equal single device's; gradients (a logp + lse + logits + entropy
    loss, per-row T) within the TP tolerance of single-device residual-mode gradients, and
    of the recompute mode; deterministic run to run."""
    assert set(tp_results["tp"]) == {"tp8_rows1_vd", "tp2_rows2_vd", "tp4_rows2_dv"}
    for cfg, r in tp_results["tp"].items():
        assert r["forward_rows_differ"] == {"logp": 0, "lse": 0, "entropy": 0, "logits": 0}, cfg
        for ref in ("vs_single_logits", "vs_tp_recompute"):
            for name, g in r[ref].items():
                assert g["finite"], (cfg, name)
                tol = 1e-5 * max(1.0, g["scale"])
                assert g["max_abs_diff"] <= tol, (cfg, ref, name, g)
        assert all(r["repeat_bitwise"].values()), (cfg, r["repeat_bitwise"])


@pytest.mark.slow
def test_local_api_residual_mode_inside_shard_map(tp_results):
    """linear_logp_local(residuals="logits") in a vma-typed shard_map (TP=2 x 2 rows): logp
    bytes and the hidden / weight-shard gradients of single-device residual mode."""
    r = tp_results["local"]
    assert r["logp_rows_differ"] == 0
    tol = 1e-5 * max(1.0, r["scale"])
    assert r["dh_max_abs_diff"] <= tol and r["dw_max_abs_diff"] <= tol, r
