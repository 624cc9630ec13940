"""Mesh and shard_map checks of `linear_logp` for `tests/test_jax_native.py`, on 8 host devices.

Run as `python tests/mesh_cases.py OUT.json` with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (set before JAX starts, hence a
subprocess). Writes one JSON object: per case, rows whose bytes differ from the
single-device call, the gradients' max abs difference from the single-device
gradients (and their scale), or the error text of a case that must be refused.
With MESH_CASES=fast only the cases of the fast test tier run (the first case of each test).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import numpy as np

N_DEVICES = 8
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

B, S, D, VOCAB, V_PAD = 4, 6, 64, 600, 640  # 24 rows over 8 devices: 3 each; [B, S] over (dp, sp)
FAST = os.environ.get("MESH_CASES", "all") == "fast"
pick = lambda *options: options[:1] if FAST else options  # noqa: E731  (the fast tier's first case)


def _data():
    rng = np.random.default_rng(7)
    h = rng.standard_normal((B, S, D)).astype(np.float32)
    w = (rng.standard_normal((V_PAD, D)) * 0.2).astype(np.float32)
    b = (rng.standard_normal(V_PAD) * 0.1).astype(np.float32)
    t = rng.integers(0, VOCAB, (B, S)).astype(np.int32)
    t[0, 0], t[1, 2], t[3, 5] = -100, VOCAB - 1, 0  # ignore, edges
    temp = rng.uniform(0.6, 1.4, (B, S)).astype(np.float32)
    return h, w, b, t, temp


def _bits_rows(a, b) -> int:
    a = np.ascontiguousarray(np.asarray(a, np.float32)).view(np.uint32).reshape(-1)
    b = np.ascontiguousarray(np.asarray(b, np.float32)).view(np.uint32).reshape(-1)
    return int((a != b).sum())


def _maxdiff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def run() -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import detlogp_jax as dl

    assert len(jax.devices()) == N_DEVICES, jax.devices()
    h, w, b, t, temp = _data()
    kw = dict(vocab_size=VOCAB, backend="reference")

    def loss(h, w, b, t, temp, layout="vd"):
        out = dl.linear_logp(h, w, t, bias=b, temperature=temp, weight_layout=layout, **kw)
        return jnp.sum(jnp.nan_to_num(out.logp) + 0.25 * out.lse), out

    grad_fn = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
    g_ref, o_ref = jax.jit(grad_fn)(h, w, b, t, temp)
    scale = max(float(np.max(np.abs(np.asarray(g)))) for g in g_ref)
    res = {"scale": scale}

    def record(name, fn):
        try:
            g, o = fn()
            res[name] = {
                "logp_rows_differ": _bits_rows(o.logp, o_ref.logp),
                "lse_rows_differ": _bits_rows(o.lse, o_ref.lse),
                "grad_max_abs_diff": max(_maxdiff(a, r) for a, r in zip(g, g_ref)),
            }
        except Exception:
            res[name] = {"error": traceback.format_exc()[-3000:]}

    # The entropy and the per-row temperature in the loss (rows sharded per shard_map under
    # Explicit axes: the entropy comes back sharded like logp, the temperature's gradient too).
    def loss_e(h, w, b, t, temp):
        out = dl.linear_logp(h, w, t, bias=b, temperature=temp, return_entropy=True, **kw)
        return jnp.sum(jnp.nan_to_num(out.logp) + 0.25 * out.lse + 0.5 * out.entropy), out

    grad_e = jax.grad(loss_e, argnums=(0, 1, 2, 4), has_aux=True)
    ge_ref, oe_ref = jax.jit(grad_e)(h, w, b, t, temp)
    res["entropy_scale"] = max(float(np.max(np.abs(np.asarray(g)))) for g in ge_ref)

    for kind in pick("explicit", "auto"):
        types = (AxisType.Explicit,) * 2 if kind == "explicit" else (AxisType.Auto,) * 2
        mesh = jax.make_mesh((4, 2), ("dp", "sp"), axis_types=types)
        put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
        rows = lambda x: put(x, "dp", "sp")
        args = (put(h, "dp", "sp", None), put(w), put(b), rows(t), rows(temp))
        # plain jit on sharded inputs (rows over two data axes, [B, S] leading dims)
        record(f"{kind}_jit_grad", lambda: jax.jit(grad_fn)(*args))
        try:
            g, o = jax.jit(grad_e)(*args)
            res[f"{kind}_entropy_temperature_grad"] = {
                "logp_rows_differ": _bits_rows(o.logp, oe_ref.logp),
                "lse_rows_differ": _bits_rows(o.lse, oe_ref.lse),
                "entropy_rows_differ": _bits_rows(o.entropy, oe_ref.entropy),
                "grad_max_abs_diff": max(_maxdiff(a, r) for a, r in zip(g, ge_ref)),
            }
        except Exception:
            res[f"{kind}_entropy_temperature_grad"] = {"error": traceback.format_exc()[-3000:]}
        if FAST:
            continue
        # the same under jax.set_mesh
        with jax.set_mesh(mesh):
            record(f"{kind}_set_mesh_grad", lambda: jax.jit(grad_fn)(*args))
        # rows over one axis only (the other replicated)
        args1 = (put(h, "dp", None, None), put(w), put(b), put(t, "dp", None), put(temp, "dp", None))
        record(f"{kind}_one_axis_grad", lambda: jax.jit(grad_fn)(*args1))
        # a [D, V] kernel on the same mesh
        k = put(np.ascontiguousarray(w.T))
        record(
            f"{kind}_dv_grad",
            lambda: _dv(
                jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=(5,))(
                    args[0], k, args[2], args[3], args[4], "dv"
                )
            ),
        )

    # Plain replicated inputs under `jax.set_mesh` of a mesh with Explicit axes (jax.make_mesh's
    # default): the gradient, jitted and not, in both residual modes, with the entropy in the
    # loss and a [D, V] kernel, equals the no-mesh gradient.
    mesh = jax.make_mesh((4, 2), ("dp", "sp"))
    hr, tr, tmr = jnp.asarray(h), jnp.asarray(t), jnp.asarray(temp)
    for residuals in pick("recompute", "logits"):
        for layout in pick("vd", "dv"):
            wr = jnp.asarray(w if layout == "vd" else np.ascontiguousarray(w.T))

            def loss_r(h, w, b, temp, residuals=residuals, layout=layout):
                out = dl.linear_logp(
                    h,
                    w,
                    tr,
                    bias=b,
                    temperature=temp,
                    weight_layout=layout,
                    return_entropy=True,
                    residuals=residuals,
                    **kw,
                )
                return jnp.sum(jnp.nan_to_num(out.logp) + 0.25 * out.lse + 0.5 * out.entropy), out

            g_r = jax.grad(loss_r, argnums=(0, 1, 2, 3), has_aux=True)
            want, _ = g_r(hr, wr, jnp.asarray(b), tmr)
            for jitted in pick(False, True):
                name = f"replicated_set_mesh_{residuals}_{layout}_{'jit' if jitted else 'eager'}"
                try:
                    with jax.set_mesh(mesh):
                        got, o = (jax.jit(g_r) if jitted else g_r)(hr, wr, jnp.asarray(b), tmr)
                    res[name] = {
                        "logp_rows_differ": _bits_rows(o.logp, oe_ref.logp),
                        "lse_rows_differ": _bits_rows(o.lse, oe_ref.lse),
                        "grad_max_abs_diff": max(_maxdiff(x, y) for x, y in zip(got, want)),
                    }
                except Exception:
                    res[name] = {"error": traceback.format_exc()[-3000:]}

    # A weight sharded over the vocabulary on an Auto mesh under plain jit: XLA's partitioner
    # sees ordinary ops and serves it; the bytes must be the unsharded call's.
    mesh = jax.make_mesh((8,), ("dp",), axis_types=(AxisType.Auto,))
    try:
        fwd = jax.jit(lambda h, w: dl.linear_logp(h, w, jnp.asarray(t.reshape(-1)), **kw)[:2])
        got = fwd(h.reshape(-1, D), jax.device_put(w, NamedSharding(mesh, P("dp", None))))
        want = fwd(h.reshape(-1, D), w)
        res["auto_sharded_weight"] = {
            "logp_rows_differ": _bits_rows(got[0], want[0]),
            "lse_rows_differ": _bits_rows(got[1], want[1]),
        }
    except Exception:
        res["auto_sharded_weight"] = {"error": traceback.format_exc()[-3000:]}

    # A weight sharded over an Explicit axis: refused, pointing to linear_logp_tp.
    mesh = jax.make_mesh((8,), ("dp",))
    try:
        jax.jit(lambda h, w: dl.linear_logp(h, w, jnp.asarray(t.reshape(-1)), **kw).logp)(
            jax.device_put(h.reshape(-1, D), NamedSharding(mesh, P("dp", None))),
            jax.device_put(w, NamedSharding(mesh, P("dp", None))),
        )
        res["sharded_weight_error"] = "no error"
    except Exception as e:
        res["sharded_weight_error"] = f"{type(e).__name__}: {e}"
    try:
        jax.jit(lambda h: dl.linear_logp(h, jnp.asarray(w), jnp.asarray(t[:, :4].reshape(-1)), **kw).logp)(
            jax.device_put(h[:, :4].reshape(-1, D), NamedSharding(mesh, P(None, "dp")))
        )
        res["sharded_d_error"] = "no error"
    except Exception as e:
        res["sharded_d_error"] = f"{type(e).__name__}: {e}"

    # Inside a user's shard_map with the default check_vma=True: forward and gradient.
    mesh = jax.make_mesh((8,), ("dp",))
    hf, tf, tmf = h.reshape(-1, D), t.reshape(-1), temp.reshape(-1)

    def body(hl, wl, bl, tl, tml):  # check_vma=True: the replicated weight's gradient comes back summed
        return grad_fn(hl, wl, bl, tl, tml)

    def body_no_vma(hl, wl, bl, tl, tml):  # check_vma=False: the caller sums it over the data axis
        (dh, dw, db), o = grad_fn(hl, wl, bl, tl, tml)
        return (dh, jax.lax.psum(dw, "dp"), jax.lax.psum(db, "dp")), o

    flat = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
    flat_args = (flat(hf, "dp"), flat(w), flat(b), flat(tf, "dp"), flat(tmf, "dp"))
    for vma, fn in ((True, body), (False, body_no_vma))[: 0 if FAST else 2]:

        def run_map(fn=fn, vma=vma):
            f = jax.shard_map(
                fn,
                mesh=mesh,
                in_specs=(P("dp"), P(), P(), P("dp"), P("dp")),
                out_specs=((P("dp"), P(), P()), P("dp")),
                check_vma=vma,
            )
            (dh, dw, db), o = jax.jit(f)(*flat_args)
            host = lambda x, shape=None: np.asarray(x).reshape(shape if shape else np.shape(x))
            return (host(dh, h.shape), host(dw), host(db)), type(o)(host(o.logp, (B, S)), host(o.lse, (B, S)))

        record(f"shard_map_check_vma_{vma}", run_map)

    # Vocab-parallel TP with a [D, V] kernel (weight_layout="dv", sharded over its V axis):
    # logp/lse bytes equal the single-device [V, D] call at TP = 2, 4, 8.
    from sharding import linear_logp_tp

    rng = np.random.default_rng(11)
    vpad, vocab = 1024, 1000
    hh = rng.standard_normal((24, D)).astype(np.float32)
    ww = (rng.standard_normal((vpad, D)) * 0.2).astype(np.float32)
    tt = rng.integers(0, vocab, 24).astype(np.int32)
    tt[:4] = 0, vpad // 2 - 1, vpad // 2, vocab - 1  # shard edges
    one = dl.linear_logp(hh, ww, tt, vocab_size=vocab, backend="reference")
    kk = np.ascontiguousarray(ww.T)
    for tp in pick(2, 4, 8):
        mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp])
        k_sharded = jax.device_put(kk, NamedSharding(mesh, P(None, "tp")))
        for name, weight in pick(("global", k_sharded), ("shards", list(np.split(kk, tp, axis=1)))):
            try:
                out = linear_logp_tp(
                    hh, weight, tt, mesh=mesh, tp_axis="tp", vocab_size=vocab, backend="reference", weight_layout="dv"
                )
                res[f"tp{tp}_dv_{name}"] = {
                    "logp_rows_differ": _bits_rows(out.logp, one.logp),
                    "lse_rows_differ": _bits_rows(out.lse, one.lse),
                }
            except Exception:
                res[f"tp{tp}_dv_{name}"] = {"error": traceback.format_exc()[-3000:]}
    return res


def _dv(grads_and_out):
    (dh, dk, db), o = grads_and_out
    return (dh, dk.T, db), o


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        out = {"ok": True, "result": run()}
    except Exception:
        out = {"ok": False, "error": traceback.format_exc()}
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
