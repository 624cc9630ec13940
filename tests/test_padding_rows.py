"""Padding weight rows (at or beyond vocab_size) are the op's own: no value held there, NaN or
inf, reaches any output or gradient, and dW's padding rows are exact zeros (CPU reference
backend; both residual modes, both layouts, the entropy and the temperature in the loss, and
a vocab shard of tensor parallelism)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import detlogp_jax as dl

N, D, VOCAB, ROWS = 12, 32, 200, 256


def _problem(poison):
    rng = np.random.default_rng(3)
    h = rng.standard_normal((N, D)).astype(np.float32)
    w = (rng.standard_normal((ROWS, D)) * 0.3).astype(np.float32)
    b = (rng.standard_normal(ROWS) * 0.1).astype(np.float32)
    t = rng.integers(0, VOCAB, N).astype(np.int32)
    t[0] = -100
    if poison:
        w[VOCAB:] = np.nan
        w[VOCAB + 3] = np.inf
        b[VOCAB:] = np.nan
    return h, w, b, t


def _grads(h, w, b, t, layout, residuals):
    ww = w if layout == "vd" else np.ascontiguousarray(w.T)

    def loss(h, w, b, temp):
        out = dl.linear_logp(
            h,
            w,
            jnp.asarray(t),
            bias=b,
            temperature=temp,
            vocab_size=VOCAB,
            weight_layout=layout,
            return_entropy=True,
            residuals=residuals,
            backend="reference",
        )
        return jnp.sum(out.logp) + 0.5 * jnp.sum(out.lse) + 0.1 * jnp.sum(out.entropy), out

    temp = jnp.full((N,), 0.8, jnp.float32)
    (gh, gw, gb, gt), out = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
        jnp.asarray(h), jnp.asarray(ww), jnp.asarray(b), temp
    )
    gw = np.asarray(gw) if layout == "vd" else np.asarray(gw).T
    return [np.asarray(x) for x in (gh, gt)], gw, np.asarray(gb), out


@pytest.mark.parametrize("residuals", ["recompute", "logits"])
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_nan_and_inf_padding_rows_reach_no_gradient(layout, residuals):
    clean = _grads(*_problem(False), layout, residuals)
    dirty = _grads(*_problem(True), layout, residuals)
    for x in dirty[0] + [dirty[1], dirty[2]]:
        assert np.all(np.isfinite(x))
    assert np.all(dirty[1][VOCAB:].view(np.uint32) == 0)  # exact +0.0
    assert np.all(dirty[2][VOCAB:].view(np.uint32) == 0)
    # The real rows' gradients and every output equal the call with clean padding, bit for bit.
    for a, c in zip(dirty[0] + [dirty[1][:VOCAB], dirty[2][:VOCAB]], clean[0] + [clean[1][:VOCAB], clean[2][:VOCAB]]):
        np.testing.assert_array_equal(a.view(np.uint32), c.view(np.uint32))
    for f in ("logp", "lse", "entropy"):
        np.testing.assert_array_equal(
            np.asarray(getattr(dirty[3], f)).view(np.uint32), np.asarray(getattr(clean[3], f)).view(np.uint32)
        )


@pytest.mark.slow
def test_padding_rows_of_a_vocab_shard_reach_no_gradient():
    """Inside shard_map with the vocabulary over a one-device axis: the shard's padding rows too."""
    from sharding import linear_logp_local

    h, w, b, t = _problem(True)
    mesh = jax.make_mesh((1,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))

    def body(h, w, b):
        def loss(h, w, b):
            out = linear_logp_local(
                h, w, jnp.asarray(t), bias=b, vocab_size=VOCAB, padded_vocab_size=ROWS, backend="reference"
            )
            return jnp.sum(out.logp) + jnp.sum(out.lse)

        return jax.grad(loss, argnums=(0, 1, 2))(h, w, b)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("tp"), P("tp")), out_specs=(P(), P("tp"), P("tp")))
    gh, gw, gb = (np.asarray(x) for x in f(jnp.asarray(h), jnp.asarray(w), jnp.asarray(b)))
    assert np.all(np.isfinite(gh)) and np.all(np.isfinite(gw)) and np.all(np.isfinite(gb))
    assert np.all(gw[VOCAB:].view(np.uint32) == 0) and np.all(gb[VOCAB:].view(np.uint32) == 0)
