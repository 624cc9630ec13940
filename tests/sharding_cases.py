"""Multi-device checks for `tests/test_sharding.py`, run in subprocesses.

XLA_FLAGS (the host device count) must be set before JAX initialises, and the
rest of the test suite runs on one device, so these checks run here, in their
own processes, and report JSON that the pytest side asserts on.

    python tests/sharding_cases.py suite NAME OUT.json       # 8 host CPU devices
    python tests/sharding_cases.py mp-worker PID PORT OUTDIR # one of two JAX processes

Data generation (`make_case`) has no side effects, so pytest imports it too.
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

N_DEVICES = 8

# name: (real vocab, D, rows, dtype, bias, temperature kind)
CASES = {
    # Qwen-like: real vocab 37*128 -> canonical 5120 (80 tiles, 8 groups, one tile per split);
    # the last TP-8 shard is 60% padding.
    "qwen": dict(vocab=4736, d=8, n=24, dtype="float32", bias=True, temperature="rows"),
    # Llama-like: real vocab 69*256 -> canonical 17920 (280 tiles, 8 groups of 35 cut in 33
    # parts: splits of one and two tiles, so the in-split chain runs).
    "llama": dict(vocab=17664, d=8, n=24, dtype="float32", bias=False, temperature=0.7),
    # Full-size Qwen vocab: 151936 -> 152064 (264 splits), small D, bf16.
    "full": dict(vocab=151936, d=16, n=8, dtype="bfloat16", bias=False, temperature=1.0),
}


def boundary_targets(vocab: int, vpad: int, n: int, rng) -> np.ndarray:
    """0, last id of each TP-8 shard and first id of the next, last real id,
    ignore_index, a padded id (-> NaN row), then random real ids."""
    shard = vpad // 8
    special = [0]
    for k in range(1, 8):
        special += [k * shard - 1, k * shard]
    special += [vocab - 1, -100, vocab]
    special = [t for t in special if t < vpad]
    t = rng.integers(0, vocab, n).astype(np.int32)
    m = min(n, len(special))
    t[:m] = special[:m]
    return t


def make_case(name: str, dirty_padding: bool = False):
    """Deterministic inputs for one case (numpy; bf16 via ml_dtypes)."""
    from detlogp_jax.contract import canonical_padded_vocab

    spec = CASES[name]
    vocab, d, n = spec["vocab"], spec["d"], spec["n"]
    vpad = canonical_padded_vocab(vocab)
    rng = np.random.default_rng({"qwen": 1, "llama": 2, "full": 3}[name])
    h = rng.standard_normal((n, d)).astype(np.float32)
    w = (rng.standard_normal((vpad, d)) * (3.0 / np.sqrt(d))).astype(np.float32)
    b = (rng.standard_normal(vpad) * 0.5).astype(np.float32) if spec["bias"] else None
    t = boundary_targets(vocab, vpad, n, rng)
    if n < 18:  # few rows: keep the outer shard edges, the last real id, ignore and a padded id
        shard = vpad // 8
        t[:8] = [0, shard - 1, shard, 7 * shard - 1, 7 * shard, vocab - 1, -100, vocab]
    if spec["temperature"] == "rows":
        temp = rng.uniform(0.5, 1.5, n).astype(np.float32)
    else:
        temp = float(spec["temperature"])
    if dirty_padding:  # garbage in padded weight/bias rows must change nothing
        w[vocab:] = rng.standard_normal((vpad - vocab, d)).astype(np.float32) * 1e6
        w[vocab::7] = np.nan
        if b is not None:
            b[vocab:] = 1e30
    if spec["dtype"] == "bfloat16":
        import ml_dtypes

        h = h.astype(ml_dtypes.bfloat16)
        w = w.astype(ml_dtypes.bfloat16)
    return dict(h=h, w=w, b=b, t=t, temp=temp, vocab=vocab, vpad=vpad)


# ----------------------------------------------------------------------------------------
# Everything below runs with JAX initialised on 8 host CPU devices.


def _bits(x):
    return np.ascontiguousarray(np.asarray(x, np.float32)).view(np.uint32)


def _rows_differ(a, b) -> int:
    a, b = _bits(a), _bits(b)
    d = a != b
    return int(d.reshape(d.shape[0], -1).any(axis=1).sum())


def _mesh(tp: int, rows: int):
    import jax
    from jax.sharding import Mesh

    devs = np.array(jax.devices()[: tp * rows]).reshape(rows, tp)
    return Mesh(devs, ("dp", "tp"))


def _single(case, return_logits=True, return_entropy=True):
    from detlogp_jax import linear_logp

    return linear_logp(
        case["h"],
        case["w"],
        case["t"],
        bias=case["b"],
        temperature=case["temp"],
        vocab_size=case["vocab"],
        padded_vocab_size=case["vpad"],
        backend="reference",
        return_logits=return_logits,
        return_entropy=return_entropy,
    )


def _tp(case, tp, rows, *, return_logits=True, weight=None, bias="same", return_entropy=True):
    from sharding import linear_logp_tp

    return linear_logp_tp(
        case["h"],
        case["w"] if weight is None else weight,
        case["t"],
        mesh=_mesh(tp, rows),
        row_axes=("dp",),
        bias=case["b"] if bias == "same" else bias,
        temperature=case["temp"],
        vocab_size=case["vocab"],
        return_logits=return_logits,
        return_entropy=return_entropy,
        backend="reference",
    )


def _compare(out, ref, vocab):
    r = dict(
        logp_rows_differ=_rows_differ(out.logp, ref.logp),
        lse_rows_differ=_rows_differ(out.lse, ref.lse),
    )
    if out.entropy is not None:
        r["entropy_rows_differ"] = _rows_differ(out.entropy, ref.entropy)
        r["entropy_nonnegative"] = bool((np.asarray(out.entropy) >= 0).all())
    if out.logits is not None:
        lg = np.asarray(out.logits)
        r["logits_rows_differ"] = _rows_differ(lg[:, :vocab], ref.logits)
        r["padded_logits_all_neginf"] = bool(np.isneginf(lg[:, vocab:]).all())
    return r


def _row_semantics(case, out):
    logp = np.asarray(out.logp)
    t = case["t"]
    return dict(
        padded_target_rows_nan=bool(np.isnan(logp[t >= case["vocab"]]).all()),
        ignore_rows_zero=bool((_bits(logp[t == -100]) == 0).all()),
        real_rows_finite=bool(np.isfinite(logp[(t >= 0) & (t < case["vocab"])]).all()),
        lse_finite=bool(np.isfinite(np.asarray(out.lse)).all()),
        n_padded_target_rows=int((t >= case["vocab"]).sum()),
        n_ignore_rows=int((t == -100).sum()),
    )


CONFIGS_FULL = [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2), (8, 1)]  # (TP, row shards) on 8 devices


def suite_invariance(name, configs):
    """TP x row-sharding sweep: bytes of logp/lse/logits vs single-device reference."""
    case = make_case(name)
    ref = _single(case)
    res = {"case": name, "vocab": case["vocab"], "vpad": case["vpad"], "configs": {}}
    res["ref_semantics"] = _row_semantics(case, ref)
    for tp, rows in configs:
        t0 = time.time()
        out = _tp(case, tp, rows)
        r = _compare(out, ref, case["vocab"])
        r["semantics"] = _row_semantics(case, out)
        r["seconds"] = round(time.time() - t0, 2)
        res["configs"][f"tp{tp}_rows{rows}"] = r
    return res


def _naive_lse(z, vocab, tp):
    """NEGATIVE CONTROL: per-shard logsumexp merged with pmax/psum (what the contract forbids)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    mesh = _mesh(tp, 1)
    shard = z.shape[1] // tp

    def body(zl):
        cols = lax.axis_index("tp") * shard + jnp.arange(shard)
        y = jnp.where(cols[None, :] < vocab, zl, -jnp.inf)
        lse_r = jax.nn.logsumexp(y, axis=1)
        m = lax.pmax(lse_r, "tp")
        return m + jnp.log(lax.psum(jnp.exp(lse_r - m), "tp"))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(None, "tp"), out_specs=P(), check_vma=False))
    return np.asarray(f(jnp.asarray(z)))


def suite_qwen():
    """Qwen-like sweep + dirty padding, shard lists, no-logits, negative control, gradients."""
    import jax
    import jax.numpy as jnp

    from detlogp_jax import linear_logp

    out = {"invariance": suite_invariance("qwen", CONFIGS_FULL)}
    case = make_case("qwen")
    ref = _single(case)

    # Garbage in padded weight/bias rows changes nothing (same compiled programs).
    dirty = make_case("qwen", dirty_padding=True)
    d8 = _tp(dirty, 8, 1)
    d1 = _tp(dirty, 1, 2)
    out["dirty_padding"] = {"tp8": _compare(d8, ref, case["vocab"]), "tp1_rows2": _compare(d1, ref, case["vocab"])}

    # Weight and bias given as per-rank shard lists.
    tp = 4
    ws = np.split(case["w"], tp)
    bs = np.split(case["b"], tp)
    out["shard_list"] = _compare(_tp(case, tp, 2, weight=ws, bias=bs), ref, case["vocab"])

    # return_logits=False gives the same bytes; so does return_entropy=False (and it has none).
    out["no_logits"] = _compare(_tp(case, 2, 2, return_logits=False), ref, case["vocab"])
    no_ent = _tp(case, 4, 2, return_entropy=False)
    out["no_entropy"] = dict(_compare(no_ent, ref, case["vocab"]), entropy_is_none=no_ent.entropy is None)

    # Negative control on the same logits (the reference's exact logits, so only the merge differs).
    z = np.full((case["h"].shape[0], case["vpad"]), -np.inf, np.float32)
    z[:, : case["vocab"]] = np.asarray(ref.logits)
    z = z * np.asarray(1.0 / np.float32(case["temp"]), np.float32)[:, None]
    naive1, naive8 = _naive_lse(z, case["vocab"], 1), _naive_lse(z, case["vocab"], 8)
    ours8 = _tp(case, 8, 1)
    out["negative_control"] = {
        "naive_rows_differ_tp1_vs_tp8": _rows_differ(naive1, naive8),
        "ours_rows_differ_tp1_vs_tp8": _rows_differ(_tp(case, 1, 1).lse, ours8.lse),
        "naive_max_abs_diff": float(np.max(np.abs(naive1.astype(np.float64) - naive8))),
    }

    # Gradients (hidden, weight, bias; cotangents on logp, lse and logits) vs single device.
    rng = np.random.default_rng(7)
    n, vocab = case["h"].shape[0], case["vocab"]
    c1 = jnp.asarray(rng.standard_normal(n), jnp.float32)
    c2 = jnp.asarray(rng.standard_normal(n), jnp.float32)
    c3 = jnp.asarray(rng.standard_normal((n, vocab)) * 0.01, jnp.float32)
    temp, t = case["temp"], case["t"]

    def loss_single(h, w, b):
        o = linear_logp(
            h,
            w,
            t,
            bias=b,
            temperature=temp,
            vocab_size=vocab,
            padded_vocab_size=case["vpad"],
            backend="reference",
            return_logits=True,
        )
        return jnp.sum(jnp.nan_to_num(o.logp) * c1) + jnp.sum(o.lse * c2) + jnp.sum(o.logits * c3)

    args = (jnp.asarray(case["h"]), jnp.asarray(case["w"]), jnp.asarray(case["b"]))
    g_ref = [np.asarray(g) for g in jax.grad(loss_single, argnums=(0, 1, 2))(*args)]
    from sharding import linear_logp_tp

    grads = {}
    for tp, rows in [(4, 2)]:
        mesh = _mesh(tp, rows)

        def loss_tp(h, w, b):
            o = linear_logp_tp(
                h,
                w,
                t,
                mesh=mesh,
                row_axes=("dp",),
                bias=b,
                temperature=temp,
                vocab_size=vocab,
                return_logits=True,
                backend="reference",
            )
            return jnp.sum(jnp.nan_to_num(o.logp) * c1) + jnp.sum(o.lse * c2) + jnp.sum(o.logits[:, :vocab] * c3)

        g = [np.asarray(x) for x in jax.grad(loss_tp, argnums=(0, 1, 2))(*args)]
        g2 = [np.asarray(x) for x in jax.grad(loss_tp, argnums=(0, 1, 2))(*args)]
        grads[f"tp{tp}_rows{rows}"] = {
            nm: {
                "max_abs_diff": float(np.max(np.abs(a.astype(np.float64) - r))),
                "scale": float(np.max(np.abs(r))),
                "finite": bool(np.isfinite(a).all()),
                "repeat_bitwise": bool((_bits(a) == _bits(a2)).all()),
            }
            for nm, a, a2, r in zip(("hidden", "weight", "bias"), g, g2, g_ref)
        }
    # The entropy and the temperature (per-row T): a mixed loss vs single device.
    c4 = jnp.asarray(rng.standard_normal(n), jnp.float32)
    temp_rows = jnp.asarray(np.asarray(temp, np.float32))

    def mixed(o):
        return jnp.sum(jnp.nan_to_num(o.logp) * c1) + jnp.sum(o.lse * c2) + jnp.sum(o.entropy * c4)

    kw = dict(bias=None, vocab_size=vocab, backend="reference", return_entropy=True)
    args4 = (jnp.asarray(case["h"]), jnp.asarray(case["w"]), jnp.asarray(case["b"]), temp_rows)
    g_ref = [
        np.asarray(g)
        for g in jax.grad(
            lambda h, w, b, T: mixed(
                linear_logp(h, w, t, **dict(kw, bias=b, temperature=T, padded_vocab_size=case["vpad"]))
            ),
            argnums=(0, 1, 2, 3),
        )(*args4)
    ]
    for tp, rows in [(8, 1), (2, 2)]:
        mesh = _mesh(tp, rows)

        def loss_e(h, w, b, T):
            return mixed(linear_logp_tp(h, w, t, mesh=mesh, row_axes=("dp",), **dict(kw, bias=b, temperature=T)))

        g = [np.asarray(x) for x in jax.grad(loss_e, argnums=(0, 1, 2, 3))(*args4)]
        g2 = [np.asarray(x) for x in jax.grad(loss_e, argnums=(0, 1, 2, 3))(*args4)]
        grads[f"tp{tp}_rows{rows}_entropy_temperature"] = {
            nm: {
                "max_abs_diff": float(np.max(np.abs(a.astype(np.float64) - r))),
                "scale": float(np.max(np.abs(r))),
                "finite": bool(np.isfinite(a).all()),
                "repeat_bitwise": bool((_bits(a) == _bits(a2)).all()),
            }
            for nm, a, a2, r in zip(("hidden", "weight", "bias", "temperature"), g, g2, g_ref)
        }
    out["grads"] = grads
    return out


def suite_other():
    """Llama-like and full-size sweeps, the in-shard_map local API."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from detlogp_jax import linear_logp
    from sharding import linear_logp_local, tp_partials_and_fold

    out = {
        "llama": suite_invariance("llama", [(1, 2), (2, 1), (4, 2), (8, 1)]),
        "full": suite_invariance("full", [(8, 1), (2, 2)]),
    }

    # linear_logp_local inside the caller's shard_map (grad taken inside the body).
    case = make_case("llama")
    vocab, vpad, temp = case["vocab"], case["vpad"], case["temp"]
    h, w, t = jnp.asarray(case["h"]), jnp.asarray(case["w"]), jnp.asarray(case["t"])
    ref = linear_logp(h, w, t, temperature=temp, vocab_size=vocab, padded_vocab_size=vpad, backend="reference")
    g_ref = jax.grad(
        lambda h, w: jnp.sum(
            jnp.nan_to_num(
                linear_logp(
                    h, w, t, temperature=temp, vocab_size=vocab, padded_vocab_size=vpad, backend="reference"
                ).logp
            )
        ),
        argnums=(0, 1),
    )(h, w)
    mesh = _mesh(2, 2)

    def local_value_and_grad(hl, wl, tl):
        """This rank's nan-safe sum of logp and its gradients w.r.t. (hidden, weight shard)."""

        def loss(hl, wl):
            o = linear_logp_local(
                hl,
                wl,
                tl,
                axis_name="tp",
                temperature=temp,
                vocab_size=vocab,
                padded_vocab_size=vpad,
                backend="reference",
            )
            return jnp.sum(jnp.nan_to_num(o.logp)), o.logp

        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(hl, wl)

    def body(hl, wl, tl):
        (_, logp), (dh, dw) = local_value_and_grad(hl, wl, tl)
        return logp, dh, jax.lax.psum(dw, "dp")  # data-parallel weight gradient: the caller's psum

    f = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("dp", None), P("tp", None), P("dp")),
            out_specs=(P("dp"), P("dp", None), P("tp", None)),
            check_vma=False,
        )
    )
    logp, dh, dw = f(h, w, t)
    out["local_api"] = {
        "logp_rows_differ": _rows_differ(logp, ref.logp),
        "dh_max_abs_diff": float(np.max(np.abs(np.asarray(dh, np.float64) - np.asarray(g_ref[0])))),
        "dw_max_abs_diff": float(np.max(np.abs(np.asarray(dw, np.float64) - np.asarray(g_ref[1])))),
        "scale": float(max(np.max(np.abs(np.asarray(g_ref[0]))), np.max(np.abs(np.asarray(g_ref[1]))))),
    }

    # The same inside a vma-typed shard_map (check_vma=True, jax's default): the op's
    # carries and cotangents carry the mesh axes, and the weight gradient comes back
    # summed over the data axis it is replicated on (no psum by the caller).
    def body_vma(hl, wl, tl):
        (_, logp), (dh, dw) = local_value_and_grad(hl, wl, tl)
        inv_t = jnp.full(tl.shape, np.float32(1.0) / np.float32(temp), jnp.float32)
        fwd = tp_partials_and_fold(
            hl, wl, None, tl, inv_t, axis_name="tp", vocab_size=vocab, padded_vocab_size=vpad, backend="reference"
        )[0]
        ent_pf = tp_partials_and_fold(
            hl,
            wl,
            None,
            tl,
            inv_t,
            axis_name="tp",
            vocab_size=vocab,
            padded_vocab_size=vpad,
            backend="reference",
            return_entropy=True,
        )[3]
        ent_local = linear_logp_local(
            hl,
            wl,
            tl,
            axis_name="tp",
            temperature=temp,
            vocab_size=vocab,
            padded_vocab_size=vpad,
            backend="reference",
            return_entropy=True,
        ).entropy
        return logp, fwd, dh, dw, ent_pf, ent_local

    f = jax.jit(
        jax.shard_map(
            body_vma,
            mesh=mesh,
            in_specs=(P("dp", None), P("tp", None), P("dp")),
            out_specs=(P("dp"), P("dp"), P("dp", None), P("tp", None), P("dp"), P("dp")),
        )
    )
    logp, fwd, dh, dw, ent_pf, ent_local = f(h, w, t)
    ref_ent = linear_logp(
        h, w, t, temperature=temp, vocab_size=vocab, padded_vocab_size=vpad, backend="reference", return_entropy=True
    ).entropy
    out["local_api_vma"] = {
        "logp_rows_differ": _rows_differ(logp, ref.logp),
        "partials_fold_rows_differ": _rows_differ(fwd, ref.logp),
        "partials_fold_entropy_rows_differ": _rows_differ(ent_pf, ref_ent),
        "local_entropy_rows_differ": _rows_differ(ent_local, ref_ent),
        "dh_max_abs_diff": float(np.max(np.abs(np.asarray(dh, np.float64) - np.asarray(g_ref[0])))),
        "dw_max_abs_diff": float(np.max(np.abs(np.asarray(dw, np.float64) - np.asarray(g_ref[1])))),
        "scale": out["local_api"]["scale"],
    }
    return out


SUITES = {"qwen": suite_qwen, "other": suite_other}


def run_suite(name: str, out_path: str) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    t0 = time.time()
    try:
        res = {"ok": True, "result": SUITES[name]()}
    except Exception:
        res = {"ok": False, "error": traceback.format_exc()}
    res["seconds"] = round(time.time() - t0, 2)
    import jax

    res["n_devices"] = len(jax.devices())
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


# ----------------------------------------------------------------------------------------
# Multi-process: two JAX processes, one CPU device each, TP=2 across processes.

MP_CASE = "qwen"


def mp_worker(pid: int, port: int, out_dir: str) -> None:
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=120
    )
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from sharding import linear_logp_tp

    assert jax.process_count() == 2 and len(jax.devices()) == 2, (jax.process_count(), jax.devices())
    case = make_case(MP_CASE)
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    rep = NamedSharding(mesh, P())

    def replicated(x):
        return jax.make_array_from_callback(x.shape, rep, lambda idx: x[idx])

    # Each process passes only the weight/bias shard it owns (the other rank's is None).
    tp = 2
    mine = [d.process_index == jax.process_index() for d in mesh.devices.reshape(-1)]
    ws = [s if m else None for s, m in zip(np.split(case["w"], tp), mine)]
    bs = [s if m else None for s, m in zip(np.split(case["b"], tp), mine)]
    temp = case["temp"]
    out = linear_logp_tp(
        replicated(case["h"]),
        ws,
        replicated(case["t"]),
        mesh=mesh,
        tp_axis="tp",
        bias=bs,
        temperature=replicated(np.asarray(temp, np.float32)) if isinstance(temp, np.ndarray) else temp,
        vocab_size=case["vocab"],
        backend="reference",
    )
    logp = np.asarray(out.logp.addressable_data(0))
    lse = np.asarray(out.lse.addressable_data(0))
    np.save(os.path.join(out_dir, f"logp_{pid}.npy"), logp)
    np.save(os.path.join(out_dir, f"lse_{pid}.npy"), lse)
    jax.distributed.shutdown()


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "suite":
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={N_DEVICES}"
        run_suite(sys.argv[2], sys.argv[3])
    elif cmd == "mp-worker":
        mp_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        raise SystemExit(f"unknown command {cmd!r}")
