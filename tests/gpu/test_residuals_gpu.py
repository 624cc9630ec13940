"""The residual mode (`residuals="logits"`) on pallas_sm90 on a real Hopper GPU (skipped elsewhere).

The forward keeps the kernel's own FP32 logits (its `return_logits` output, from the
accumulator the partials come from) and the backward forms dz from them with XLA (the
fused dz kernel recomputes and is not used). Checked: logp/lse (and logits) bytes equal
the recompute mode's; gradients w.r.t. hidden, weight (both layouts) and bias against
float64 autodiff (relative Frobenius < 1e-2, bf16 operands) and against the recompute
mode (< 1e-2: the kernel's logits and the backward's dz kernel differ in rounding);
two runs give identical bytes. Whether the two modes' bytes coincide is printed, not
asserted (they need not: see detlogp_jax/grad.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import detlogp_jax as dl
from tests.helpers import assert_bitwise_equal, f64_loss_grads, grad_case, rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("n,d,v_pad,vocab", [(12, 128, 1536, 1500), (300, 256, 50176, 50000), (5, 128, 152064, 151936)])
def test_pallas_residual_mode(n, d, v_pad, vocab, layout):
    h, w, b, t, temp, g_lp, g_lse = grad_case(n, d, v_pad, vocab, seed=n)
    hb = jnp.asarray(h, jnp.bfloat16)
    wb = jnp.asarray(w, jnp.bfloat16)
    wl = wb if layout == "vd" else jnp.asarray(np.ascontiguousarray(np.asarray(wb).T))
    kw = dict(temperature=temp, vocab_size=vocab, padded_vocab_size=v_pad, backend="pallas_sm90", weight_layout=layout)

    def loss(h, w, b, mode):
        out = dl.linear_logp(h, w, t, bias=b, residuals=mode, **kw)
        return jnp.sum(out.logp * g_lp) + jnp.sum(out.lse * g_lse)

    with dl.strict_mode():
        grads, fwd = {}, {}
        for mode in ("recompute", "logits"):
            f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)
            grads[mode] = f(hb, wl, jnp.asarray(b), mode)
            again = f(hb, wl, jnp.asarray(b), mode)
            for g, g2 in zip(grads[mode], again):
                assert_bitwise_equal(np.asarray(g, np.float32), np.asarray(g2, np.float32), f"{mode} repeat")
            (fwd[mode], _) = jax.vjp(
                lambda h: dl.linear_logp(h, wl, t, bias=b, residuals=mode, return_logits=True, **kw)[:3], hb
            )
    for x, y, what in zip(fwd["recompute"], fwd["logits"], ("logp", "lse", "logits")):
        assert_bitwise_equal(x, y, what)
    want = f64_loss_grads(
        np.asarray(hb, np.float32), np.asarray(wb, np.float32), b, t, temp[:, None], vocab, g_lp, g_lse
    )
    same = []
    for i, name in enumerate(("hidden", "weight", "bias")):
        got = np.asarray(grads["logits"][i], np.float32)
        if name == "weight" and layout == "dv":
            got = got.T
        assert rel_err(got, want[i]) < 1e-2, (name, rel_err(got, want[i]))
        assert rel_err(grads["logits"][i], grads["recompute"][i]) < 1e-2, name
        same.append(bool((np.asarray(grads["logits"][i]) == np.asarray(grads["recompute"][i])).all()))
    v_axis = 0 if layout == "vd" else 1
    assert np.abs(np.take(np.asarray(grads["logits"][1], np.float32), np.arange(vocab, v_pad), axis=v_axis)).max() == 0
    print(f"residual vs recompute bytes identical (hidden, weight, bias): {same}")
