"""The public API's promises on a Hopper GPU with pallas_sm90 (skipped elsewhere).

* NaN / inf held in the weight's and bias's padding rows (at or beyond vocab_size) reach no
  output or gradient: the fused backward walks them in place (the last chunk's dh reads a
  zero-masked copy), dW's and db's padding rows are +0.0, every other byte equals the call with
  clean padding (the Qwen3-8B head's 128 padding rows, both layouts).
* jax.grad under `jax.set_mesh` of a mesh with Explicit axes and plain replicated inputs,
  jitted and not, both residual modes: the no-mesh gradient (its bytes with the default
  recompute mode, whose gradient GEMMs are the backend's in-place kernels; within 1e-6 with
  residuals="logits", whose whole-vocabulary gradient GEMMs are XLA's: two compilations of the
  same GEMM may take two cuBLAS algorithms).
* checked=True under jax.jit: refused at trace time with the way out; under checkify a bad
  target is named with the vocabulary size.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import detlogp_jax as dl
from tests.helpers import row_mismatches

pytestmark = pytest.mark.gpu

V_PAD, VOCAB, D = 152064, 151936, 512


def _operands(n=64, seed=0, poison=False, layout="vd"):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((n, D)), jnp.bfloat16)
    w = np.asarray(rng.standard_normal((V_PAD, D)) * 0.05, np.float32)
    b = np.asarray(rng.standard_normal(V_PAD) * 0.1, np.float32)
    if poison:
        w[VOCAB:] = np.nan
        w[VOCAB + 5] = np.inf
        b[VOCAB:] = np.nan
    w = jnp.asarray(w if layout == "vd" else np.ascontiguousarray(w.T), jnp.bfloat16)
    t = jnp.asarray(rng.integers(0, VOCAB, n), jnp.int32)
    return h, w, jnp.asarray(b), t


@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_nan_padding_rows_reach_no_gradient(layout):
    def grads(poison):
        h, w, b, t = _operands(poison=poison, layout=layout)

        def loss(h, w, b):
            out = dl.linear_logp(
                h, w, t, bias=b, vocab_size=VOCAB, weight_layout=layout, backend="pallas_sm90", return_entropy=True
            )
            return jnp.sum(out.logp) + 0.5 * jnp.sum(out.lse) + 0.1 * jnp.sum(out.entropy), out

        with dl.strict_mode():
            return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(h, w, b)

    (gh, gw, gb), out = grads(True)
    (ch, cw, cb), clean = grads(False)
    gw, cw = (np.asarray(x, np.float32) for x in (gw, cw))
    if layout == "dv":
        gw, cw = gw.T, cw.T
    for name, x in (("hidden", gh), ("weight", gw), ("bias", gb)):
        assert np.isfinite(np.asarray(x, np.float32)).all(), name
    assert np.all(gw[VOCAB:].view(np.uint32) == 0) and np.all(np.asarray(gb)[VOCAB:].view(np.uint32) == 0)
    assert row_mismatches(np.asarray(gh, np.float32), np.asarray(ch, np.float32))[0] == 0
    assert row_mismatches(gw[:VOCAB], cw[:VOCAB])[0] == 0
    assert row_mismatches(np.asarray(gb)[None, :VOCAB], np.asarray(cb)[None, :VOCAB])[0] == 0
    for f in ("logp", "lse", "entropy"):
        assert row_mismatches(np.asarray(getattr(out, f))[:, None], np.asarray(getattr(clean, f))[:, None])[0] == 0


@pytest.mark.parametrize("residuals", ["recompute", "logits"])
def test_gradient_under_set_mesh_of_explicit_axes(residuals):
    h, w, b, t = _operands(n=32, seed=1)
    temp = jnp.full((32,), 0.8, jnp.float32)

    def loss(h, w, b, temp):
        out = dl.linear_logp(
            h, w, t, bias=b, temperature=temp, vocab_size=VOCAB, residuals=residuals, backend="pallas_sm90"
        )
        return jnp.sum(out.logp) + 0.25 * jnp.sum(out.lse)

    g = jax.grad(loss, argnums=(0, 1, 2, 3))
    want = jax.jit(g)(h, w, b, temp)
    mesh = jax.make_mesh((1,), ("dp",))  # jax.make_mesh's default axis type: Explicit
    for fn in (g, jax.jit(g)):
        with jax.set_mesh(mesh):
            got = fn(h, w, b, temp)
        for x, y in zip(got, want):
            x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
            rows, diff = row_mismatches(x.reshape(x.shape[0], -1), y.reshape(y.shape[0], -1))
            if residuals == "recompute":
                assert rows == 0, (rows, diff)
            else:
                assert diff <= 1e-6 * max(1.0, float(np.abs(y).max())), (rows, diff)


def test_checked_mode_under_jit_names_the_bad_target():
    from jax.experimental import checkify

    h, w, b, t = _operands(n=16, seed=2)
    t = t.at[3].set(VOCAB + 7)
    f = jax.jit(lambda h, t: dl.linear_logp(h, w, t, vocab_size=VOCAB, checked=True, backend="pallas_sm90").logp)
    with pytest.raises(ValueError, match="checkify"):
        f(h, t)
    err, _ = checkify.checkify(f)(h, t)
    with pytest.raises(Exception, match=rf"target {VOCAB + 7} at index 3 is outside \[0, {VOCAB}\)"):
        err.throw()
