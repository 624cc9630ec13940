"""Gradient bytes of `linear_logp` over a fixed set of cases, saved to compare two commits
(or the two residual modes) on one machine.

    PYTHONPATH=. python3 -m benchmarks.experiments.grad_bytes save --out /tmp/gb_head
    (cd <checkout of another commit> && PYTHONPATH=. python3 <this file> save --out /tmp/gb_base)
    python3 -m benchmarks.experiments.grad_bytes compare /tmp/gb_base /tmp/gb_head
    python3 -m benchmarks.experiments.grad_bytes compare /tmp/gb_head /tmp/gb_head --modes recompute,logits

`save` runs each case (backend, weight layout, dtype, shape, bias, per-row temperature,
a logp + lse loss) under jit twice (run-to-run bytes are recorded), in the residual modes
the checkout supports (`residuals=` exists from the residual-mode commit on; older
checkouts save "recompute" only, without passing the argument), and writes one .npy per
gradient plus manifest.json. `compare A B` reports, per case and mode present in both,
whether the bytes are identical and the relative Frobenius difference; with
`--modes m1,m2` it compares mode m1 of A with mode m2 of B instead.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import detlogp_jax as dl

# (n, d, v_rows, vocab): one chunk; 37 chunks of 4096 with a clamped last one (Qwen3 rows);
# a padded Qwen3-8B-sized head at a few rows.
SHAPES = [(12, 128, 1536, 1500), (64, 256, 152064, 151936), (8, 4096, 152064, 151936)]


def _backends():
    out = ["reference"]
    try:
        if dl.backends.get("pallas_sm90").available():
            out.insert(0, "pallas_sm90")
    except Exception:
        pass
    return out


def _modes():
    return ("recompute", "logits") if "residuals" in inspect.signature(dl.linear_logp).parameters else ("recompute",)


def cases(backends, shapes=SHAPES):
    for backend in backends:
        for n, d, v, vocab in shapes:
            if backend == "reference" and d * v > 256 * 152064:
                continue  # the reference K walk is too slow at the full head
            for layout in ("vd", "dv"):
                for dtype in ("bf16",) if backend == "pallas_sm90" else ("f32", "bf16"):
                    yield dict(backend=backend, n=n, d=d, v=v, vocab=vocab, layout=layout, dtype=dtype)


def _name(c):
    return f"{c['backend']}_{c['layout']}_{c['dtype']}_n{c['n']}_d{c['d']}_v{c['v']}"


def _inputs(c):
    rng = np.random.default_rng(c["n"] * 7 + c["d"])
    dt = {"f32": jnp.float32, "bf16": jnp.bfloat16}[c["dtype"]]
    h = jnp.asarray(rng.standard_normal((c["n"], c["d"])), dt)
    w = rng.standard_normal((c["v"], c["d"])) * (1.5 / np.sqrt(c["d"]))
    w = jnp.asarray(w if c["layout"] == "vd" else np.ascontiguousarray(w.T), dt)
    b = jnp.asarray(rng.standard_normal(c["v"]) * 0.1, jnp.float32)
    t = rng.integers(0, c["vocab"], c["n"]).astype(np.int32)
    t[0], t[1] = -100, c["vocab"] - 1
    temp = jnp.asarray(rng.uniform(0.6, 1.4, c["n"]), jnp.float32)
    g = [jnp.asarray(rng.standard_normal(c["n"]), jnp.float32) for _ in range(2)]
    return h, w, b, jnp.asarray(t), temp, g


def save(out_dir, shapes=SHAPES):
    os.makedirs(out_dir, exist_ok=True)
    manifest = {
        "backend_list": _backends(),
        "modes": list(_modes()),
        "device": jax.devices()[0].device_kind,
        "cases": {},
    }
    for c in cases(manifest["backend_list"], shapes):
        h, w, b, t, temp, (g_lp, g_lse) = _inputs(c)
        for mode in manifest["modes"]:
            kw = dict(
                bias=b,
                temperature=temp,
                vocab_size=c["vocab"],
                padded_vocab_size=c["v"],
                backend=c["backend"],
                weight_layout=c["layout"],
            )
            if mode != "recompute":
                kw["residuals"] = mode

            def loss(h, w, b, kw=kw):
                o = dl.linear_logp(h, w, t, **dict(kw, bias=b))
                return jnp.sum(jnp.nan_to_num(o.logp) * g_lp) + jnp.sum(o.lse * g_lse)

            f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            got = [np.asarray(x.astype(jnp.float32)) for x in f(h, w, b)]
            again = [np.asarray(x.astype(jnp.float32)) for x in f(h, w, b)]
            name = f"{_name(c)}_{mode}"
            for i, x in enumerate(got):
                np.save(os.path.join(out_dir, f"{name}_{i}.npy"), x)
            manifest["cases"][name] = dict(
                c, mode=mode, repeat_bitwise=[x.tobytes() == y.tobytes() for x, y in zip(got, again)]
            )
            print(name, "repeat bitwise:", manifest["cases"][name]["repeat_bitwise"], flush=True)
    with open(os.path.join(out_dir, "manifest.json"), "w") as fh:
        json.dump(manifest, fh, indent=1)


def compare(a_dir, b_dir, modes=None):
    ma = json.load(open(os.path.join(a_dir, "manifest.json")))
    mb = json.load(open(os.path.join(b_dir, "manifest.json")))
    ma_mode, mb_mode = modes or (None, None)
    rows = []
    for name, c in ma["cases"].items():
        if ma_mode is not None and c["mode"] != ma_mode:
            continue
        other = name if mb_mode is None else name[: -len(c["mode"])] + mb_mode
        if other not in mb["cases"]:
            continue
        same, rel = [], []
        for i in range(3):
            x = np.load(os.path.join(a_dir, f"{name}_{i}.npy"))
            y = np.load(os.path.join(b_dir, f"{other}_{i}.npy"))
            same.append(x.tobytes() == y.tobytes())
            rel.append(
                float(np.linalg.norm(x.astype(np.float64) - y) / max(np.linalg.norm(y.astype(np.float64)), 1e-30))
            )
        rows.append((name, other, same, rel))
        print(f"{name} vs {other}: identical (dh, dW, db) = {same}; relative Frobenius = {['%.2e' % r for r in rel]}")
    print(f"{sum(all(r[2]) for r in rows)} of {len(rows)} cases byte-identical")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save")
    s.add_argument("--out", required=True)
    s.add_argument("--small", action="store_true", help="the first shape only (a CPU smoke run)")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--modes", default=None, help="m1,m2: mode m1 of A against mode m2 of B")
    a = p.parse_args(argv)
    if a.cmd == "save":
        save(a.out, SHAPES[:1] if a.small else SHAPES)
    else:
        compare(a.a, a.b, tuple(a.modes.split(",")) if a.modes else None)


if __name__ == "__main__":
    main()
