"""Tensor parallelism in the fast tier: `dl.linear_logp_tp` on two host CPU devices gives the
one-device bytes (logp, lse, entropy) and gradients within rounding, both weight layouts; a
subprocess, since the device count is fixed before JAX starts. The sweeps over TP = 1..8,
meshes, vocabularies and the naive-merge control are tests/test_sharding.py (slow tier)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
import detlogp_jax as dl
assert jax.device_count() == 2
rng = np.random.default_rng(0)
n, d, vocab = 12, 64, 1000
vpad = dl.canonical_padded_vocab(vocab)
h = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
w = jnp.asarray(rng.standard_normal((vpad, d)) * 0.1, jnp.float32)
t = jnp.asarray(rng.integers(0, vocab, n), jnp.int32).at[3].set(-100)
import contextlib
out = {}
for layout, axis_type in (("vd", jax.sharding.AxisType.Explicit), ("dv", jax.sharding.AxisType.Auto)):
    mesh = jax.make_mesh((2,), ("tp",), axis_types=(axis_type,))
    ctx = lambda: jax.set_mesh(mesh) if axis_type == jax.sharding.AxisType.Explicit else contextlib.nullcontext()
    wl = w if layout == "vd" else w.T
    kw = dict(vocab_size=vocab, weight_layout=layout, return_entropy=True, backend="reference")
    one = dl.linear_logp(h, wl, t, **kw)
    bits = lambda x: np.asarray(x, np.float32).view(np.uint32)
    loss = lambda f: (lambda h, w: jnp.sum(f(h, w).logp) + jnp.sum(f(h, w).lse))
    with ctx():
        tp = dl.linear_logp_tp(h, wl, t, mesh=mesh, tp_axis="tp", **kw)
    out[layout] = {f: int((bits(getattr(one, f)) != bits(getattr(tp, f))).sum()) for f in ("logp", "lse", "entropy")}
    if layout == "vd":  # the gradient through the rank-ordered merge, once
        g1 = jax.grad(loss(lambda h, w: dl.linear_logp(h, w, t, **kw)), argnums=(0, 1))(h, wl)
        with ctx():
            g2 = jax.grad(loss(lambda h, w: dl.linear_logp_tp(h, w, t, mesh=mesh, tp_axis="tp", **kw)), argnums=(0, 1))(h, wl)
        out[layout]["grad_max_abs_diff"] = max(float(jnp.abs(a - b).max()) for a, b in zip(g1, g2))
print(json.dumps(out))
"""


def test_tp2_gives_the_one_device_bytes():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    env["XLA_FLAGS"] = " ".join(
        [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
        + ["--xla_force_host_platform_device_count=2"]
    )
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert sorted(res) == ["dv", "vd"], res
    for layout, got in res.items():
        assert (got["logp"], got["lse"], got["entropy"]) == (0, 0, 0), (layout, got)
    assert res["vd"]["grad_max_abs_diff"] < 1e-5, res["vd"]  # the gradient is computed once, for vd
