"""Tensor-parallel checks of the residual mode for `tests/test_residuals.py`, run in a
subprocess on 8 host CPU devices (XLA_FLAGS must be set before JAX starts).

    python tests/residuals_tp_cases.py OUT.json

The Qwen-like case of `tests/sharding_cases.py` (vocab 4736 -> V_pad 5120, bias, per-row T,
boundary targets): `linear_logp_tp(residuals="logits")` vs single-device `linear_logp` in
the same mode (forward bytes; gradients of a logp + lse + logits + entropy loss w.r.t.
hidden, weight, bias, T), vs TP in the recompute mode, run to run; and
`linear_logp_local(residuals="logits")` inside a vma-typed shard_map.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _bits(x):
    return np.ascontiguousarray(np.asarray(x, np.float32)).view(np.uint32)


def _rows_differ(a, b) -> int:
    d = _bits(a) != _bits(b)
    return int(d.reshape(d.shape[0], -1).any(axis=1).sum())


def _diff(got, ref):
    return {
        name: {
            "max_abs_diff": float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(r, np.float64)))),
            "scale": float(np.max(np.abs(np.asarray(r, np.float64)))),
            "finite": bool(np.isfinite(np.asarray(a, np.float32)).all()),
        }
        for name, a, r in zip(("hidden", "weight", "bias", "temperature"), got, ref)
    }


def run():
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from detlogp_jax import linear_logp
    from sharding import linear_logp_local, linear_logp_tp
    from tests.sharding_cases import _mesh, make_case

    case = make_case("qwen")
    t, vocab, vpad = case["t"], case["vocab"], case["vpad"]
    n = case["h"].shape[0]
    rng = np.random.default_rng(7)
    c1, c2, c4 = (jnp.asarray(rng.standard_normal(n), jnp.float32) for _ in range(3))
    c3 = jnp.asarray(rng.standard_normal((n, vocab)) * 0.01, jnp.float32)

    def mixed(o):
        return (
            jnp.sum(jnp.nan_to_num(o.logp) * c1)
            + jnp.sum(o.lse * c2)
            + jnp.sum(o.logits[:, :vocab] * c3)
            + jnp.sum(o.entropy * c4)
        )

    kw = dict(vocab_size=vocab, backend="reference", return_entropy=True, return_logits=True)
    w_vd = jnp.asarray(case["w"])
    args = (jnp.asarray(case["h"]), w_vd, jnp.asarray(case["b"]), jnp.asarray(case["temp"]))

    def single(layout, mode):
        w = w_vd if layout == "vd" else jnp.asarray(np.ascontiguousarray(case["w"].T))
        f = lambda h, w, b, T: linear_logp(
            h, w, t, bias=b, temperature=T, padded_vocab_size=vpad, weight_layout=layout, residuals=mode, **kw
        )
        a = (args[0], w) + args[2:]
        return f(*a), jax.grad(lambda *x: mixed(f(*x)), argnums=(0, 1, 2, 3))(*a), a

    out = {"tp": {}}
    refs = {layout: single(layout, "logits") for layout in ("vd", "dv")}
    for tp, rows, layout in ((8, 1, "vd"), (2, 2, "vd"), (4, 2, "dv")):
        mesh = _mesh(tp, rows)
        ref_out, ref_g, a = refs[layout]

        def f(h, w, b, T, mode, mesh=mesh, layout=layout):
            return linear_logp_tp(
                h, w, t, mesh=mesh, row_axes=("dp",), bias=b, temperature=T, weight_layout=layout, residuals=mode, **kw
            )

        o = f(*a, "logits")
        grads = {}
        for mode in ("logits", "recompute"):
            g = jax.grad(lambda *x, mode=mode: mixed(f(*x, mode)), argnums=(0, 1, 2, 3))
            grads[mode] = [np.asarray(x) for x in g(*a)]
            if mode == "logits":
                again = [np.asarray(x) for x in g(*a)]
        lg = np.asarray(o.logits)
        out["tp"][f"tp{tp}_rows{rows}_{layout}"] = {
            "forward_rows_differ": {
                "logp": _rows_differ(o.logp, ref_out.logp),
                "lse": _rows_differ(o.lse, ref_out.lse),
                "entropy": _rows_differ(o.entropy, ref_out.entropy),
                "logits": _rows_differ(lg[:, :vocab], ref_out.logits),
            },
            "vs_single_logits": _diff(grads["logits"], ref_g),
            "vs_tp_recompute": _diff(grads["logits"], grads["recompute"]),
            "repeat_bitwise": {
                nm: bool((_bits(x) == _bits(y)).all())
                for nm, x, y in zip(("hidden", "weight", "bias", "temperature"), grads["logits"], again)
            },
        }

    # linear_logp_local inside a vma-typed shard_map (jax's default check_vma=True).
    h, w = args[0], w_vd
    temp = float(np.asarray(case["temp"])[0])
    loc_kw = dict(temperature=temp, vocab_size=vocab, padded_vocab_size=vpad, backend="reference", residuals="logits")
    ref_logp = linear_logp(h, w, t, **loc_kw).logp
    g_ref = jax.grad(lambda h, w: jnp.sum(jnp.nan_to_num(linear_logp(h, w, t, **loc_kw).logp)), argnums=(0, 1))(h, w)
    mesh = _mesh(2, 2)

    def body(hl, wl, tl):
        def loss(hl, wl):
            o = linear_logp_local(hl, wl, tl, axis_name="tp", **loc_kw)
            return jnp.sum(jnp.nan_to_num(o.logp)), o.logp

        (_, logp), (dh, dw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(hl, wl)
        return logp, dh, dw

    fn = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("dp", None), P("tp", None), P("dp")),
            out_specs=(P("dp"), P("dp", None), P("tp", None)),
        )
    )
    logp, dh, dw = fn(h, w, jnp.asarray(t))
    out["local"] = {
        "logp_rows_differ": _rows_differ(logp, ref_logp),
        "dh_max_abs_diff": float(np.max(np.abs(np.asarray(dh, np.float64) - np.asarray(g_ref[0])))),
        "dw_max_abs_diff": float(np.max(np.abs(np.asarray(dw, np.float64) - np.asarray(g_ref[1])))),
        "scale": float(max(np.max(np.abs(np.asarray(g_ref[0]))), np.max(np.abs(np.asarray(g_ref[1]))))),
    }
    return out


def main(out_path: str) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    t0 = time.time()
    try:
        res = {"ok": True, "result": run()}
    except Exception:
        res = {"ok": False, "error": traceback.format_exc()}
    import jax

    res["n_devices"] = len(jax.devices())
    res["seconds"] = round(time.time() - t0, 2)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    main(sys.argv[1])
