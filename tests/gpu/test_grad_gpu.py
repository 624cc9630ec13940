"""Gradients of the pallas_sm90 path on a real Hopper GPU (skipped elsewhere).

The backward recomputes z per vocab chunk with the fused Pallas dz kernel
(`pallas_kernels.sm90_dz`) and runs the two gradient GEMMs either in place in Pallas
(`pallas_kernels.sm90_grad_gemm`, where they tile the operands) or in XLA on weight-chunk
slices (`detlogp_jax.grad`). Checked here: gradients w.r.t. hidden, weight and bias of
sum(g_logp * logp + g_lse * lse) against float64 autodiff of the materialized
math (relative Frobenius error < 1e-2 with bf16 operands, the documented
tolerance) with bias, per-row temperature, a padded vocabulary and ignored
rows; the fused path against the XLA-formed dz with both walks; two runs give identical
bytes; with the in-place walk a row's dh bytes do not depend on its batch.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import detlogp_jax as dl
from detlogp_jax import backends, grad, inputs
from detlogp_jax.layout import VD
from tests.helpers import assert_bitwise_equal, f64_loss_grads, grad_case, rel_err

pytestmark = pytest.mark.gpu


def _case(n, d, v_pad, vocab, seed):
    h, w, b, t, temp, g_lp, g_lse = grad_case(n, d, v_pad, vocab, seed)
    return jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), b, t, temp, g_lp, g_lse


@pytest.mark.parametrize(
    "n,d,v_pad,vocab",
    [
        (12, 128, 1536, 1500),
        (300, 256, 50176, 50000),
        (5, 128, 152064, 151936),
        (64, 256, 19008, 18990),
        (64, 256, 16064, 16000),
    ],
    ids=["one-chunk", "tiled-tail", "qwen-head", "tp8-shard-tail", "short-head-rounded-chunk"],
)
def test_pallas_gradients_match_float64(n, d, v_pad, vocab):
    """jax.grad of linear_logp on pallas_sm90 (strict mode) against float64 autodiff; two runs
    identical. The last case has a TP=8 shard's vocabulary (19008 rows = one chunk of 16384 +
    2624, which the dW kernel does not tile at an offset: the last chunk's dW block is written
    before the full chunk; it failed to compile on the H200 when XLA formed those rows). The
    last is a head shorter than one chunk that the kernels do not take whole (a TP=8 shard of
    the Llama-3 head padded to 128512 has 16064 rows): it walks in place in a chunk of its rows
    rounded down (15872) and a last chunk of the rest."""
    hb, wb, b, t, temp, g_lp, g_lse = _case(n, d, v_pad, vocab, seed=n)
    if v_pad == 19008:
        walk = backends.get("pallas_sm90").dz.in_place
        assert grad._in_place_ok(backends.get("pallas_sm90").dz, hb, wb, grad.IN_PLACE_CHUNK, VD)
        assert not walk.dw_cols_supported(v_pad % grad.IN_PLACE_CHUNK)
    if v_pad == 16064:
        assert grad._in_place_chunk(backends.get("pallas_sm90").dz, hb, wb, VD) == 15872

    def loss(h, w, b):
        out = dl.linear_logp(
            h, w, t, bias=b, temperature=temp, vocab_size=vocab, padded_vocab_size=v_pad, backend="pallas_sm90"
        )
        return jnp.sum(out.logp * g_lp) + jnp.sum(out.lse * g_lse)

    with dl.strict_mode():
        f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        got = f(hb, wb, jnp.asarray(b))
        again = f(hb, wb, jnp.asarray(b))
    want = f64_loss_grads(
        np.asarray(hb, np.float32), np.asarray(wb, np.float32), b, t, temp[:, None], vocab, g_lp, g_lse
    )
    for g, e, name in zip(got, want, ("hidden", "weight", "bias")):
        assert rel_err(g, e) < 1e-2, (name, rel_err(g, e))
    assert np.abs(np.asarray(got[1], np.float32)[vocab:]).max() == 0
    for g, g2 in zip(got, again):
        assert_bitwise_equal(np.asarray(g, np.float32), np.asarray(g2, np.float32))


@pytest.mark.parametrize(
    "walk,v_pad",
    [("in_place", 33792), ("slices", 33792), ("in_place", 33600)],
    ids=["in_place", "slices", "in_place-tail832"],
)
@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("entropy", [False, True], ids=["plain", "entropy"])
def test_fused_dz_equals_xla_formed_dz_within_bf16(entropy, layout, walk, v_pad):
    """grad.backward on the fused dz kernel (both weight layouts, with and without the entropy
    term) == the XLA-formed dz path within bf16, with both chunk walks: the in-place one
    (`backends.InPlaceWalk`: dz and dh read the weight at the chunk's offset, dW written at
    it, sm90_grad_gemm) and the slice walk (XLA's GEMMs on weight-chunk copies); the kernel
    path ran (a spy); two runs give identical bytes; padding rows get no gradient. The
    vocabulary ends in a partial chunk (2 x 16384 + 1024 rows in place, 8 x 4096 + 1024 on
    slices; 33600 = 2 x 16384 + 832: a last chunk walked as 1024 whose new columns the dW
    kernel does not tile at an offset, so its dW block is written before the full chunks, as
    for the unpadded Qwen3 vocabulary 151936 = 9 x 16384 + 4480)."""
    import dataclasses

    n, d = 256, 512
    vocab = v_pad - 92
    hb, wb, b, t, temp, g_lp, g_lse = _case(n, d, v_pad, vocab, seed=3)
    inv_t = inputs.inv_temperature(jnp.asarray(temp), n)
    out = dl.linear_logp(
        hb,
        wb,
        t,
        bias=b,
        temperature=temp,
        vocab_size=vocab,
        padded_vocab_size=v_pad,
        backend="reference",
        return_entropy=True,
    )
    wl = jnp.asarray(wb.T) if layout == "dv" else wb
    args = (hb, wl, jnp.asarray(b), jnp.asarray(t), inv_t, out.lse, jnp.asarray(g_lp), jnp.asarray(g_lse), None)
    kw = dict(vocab_size=vocab, weight_layout=layout)
    if entropy:
        g_h = np.random.default_rng(4).standard_normal(n).astype(np.float32)
        kw.update(entropy=out.entropy, g_entropy=jnp.asarray(g_h))
    kern = backends.get("pallas_sm90").dz
    calls = []

    def spy(fn):
        def run(*a, **k):
            calls.append(sorted(k))
            return fn(*a, **k)

        return run

    if walk == "in_place":
        fused_dz = dataclasses.replace(kern, in_place=dataclasses.replace(kern.in_place, dz=spy(kern.in_place.dz)))
    else:
        fused_dz = dataclasses.replace(kern, fn=spy(kern.fn), in_place=None)
    fused = grad.backward(*args, dz=fused_dz, **kw)
    again = grad.backward(*args, dz=fused_dz, **kw)
    plain = grad.backward(*args, **kw)
    assert calls, "the fused dz kernel did not run"
    for g, e, name in zip(fused, plain, ("hidden", "weight", "bias")):
        assert np.isfinite(np.asarray(g, np.float32)).all(), name
        assert rel_err(g, e) < 1e-2, (name, rel_err(g, e))
    dw = np.asarray(fused[1], np.float32)
    assert np.abs(dw.T[vocab:] if layout == "dv" else dw[vocab:]).max() == 0
    for g, g2 in zip(fused, again):
        assert_bitwise_equal(np.asarray(g, np.float32), np.asarray(g2, np.float32))


def test_in_place_walk_gives_each_row_its_own_dh_bytes():
    """With the in-place walk a row's dh is one fixed sum over the vocabulary (dz row by row
    from the dz kernel, then dh += dz @ W_c in one FP32 accumulator per element): the same
    rows in a batch of 256 and of 64 (other rows dropped, per-row cotangents kept) give the
    same dh bytes. (XLA's GEMMs choose their algorithm by shape, so the slice walk promises
    no such thing.) Both layouts."""
    n, d, v_pad, vocab = 256, 512, 33792, 33700
    hb, wb, b, t, temp, g_lp, g_lse = _case(n, d, v_pad, vocab, seed=9)
    inv_t = inputs.inv_temperature(jnp.asarray(temp), n)
    out = dl.linear_logp(
        hb, wb, t, bias=b, temperature=temp, vocab_size=vocab, padded_vocab_size=v_pad, backend="reference"
    )
    kern = backends.get("pallas_sm90").dz
    assert kern.in_place.supports(256, d, v_pad, 4096, "vd") and kern.in_place.supports(128, d, v_pad, 4096, "dv")
    for layout in ("vd", "dv"):
        wl = jnp.asarray(wb.T) if layout == "dv" else wb
        row = lambda x, k: jnp.asarray(x)[:k]
        dh = {}
        for k in (256, 64):
            args = (hb[:k], wl, jnp.asarray(b), row(t, k), inv_t[:k], out.lse[:k], row(g_lp, k), row(g_lse, k), None)
            dh[k] = np.asarray(grad.backward(*args, vocab_size=vocab, weight_layout=layout, dz=kern)[0], np.float32)
        assert_bitwise_equal(dh[64], dh[256][:64])
