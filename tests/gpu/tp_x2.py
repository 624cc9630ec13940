"""TP=2 vs TP=1 on two H200s: bytes and time per call (run on nvidia-h200-x2).

    OUT=$OUT PYTHONPATH=. python3 tests/gpu/tp_x2.py

Qwen3-8B lm_head (D=4096, V_pad=152064, real 151936, bf16), backend pallas_sm90.
For M in {1, 64, 4096}: logp/lse of linear_logp_tp on a 2-device mesh must equal
single-device linear_logp byte for byte; prints a table and writes tp_x2.json.
"""

import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import detlogp_jax as dl  # noqa: E402
from sharding import linear_logp_tp  # noqa: E402

D, V_PAD, VOCAB = 4096, 152064, 151936
BACKEND = os.environ.get("TP_BACKEND", "pallas_sm90")


def timed(fn, iters=20, warmup=3):
    for _ in range(warmup):
        jax.block_until_ready(fn())
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts), min(ts), max(ts)


def main():
    devs = jax.devices()
    print(f"devices: {[d.device_kind for d in devs]}", flush=True)
    assert len(devs) >= 2, "needs 2 GPUs"
    mesh = jax.make_mesh((2,), ("tp",), devices=devs[:2])
    rng = np.random.default_rng(0)
    w_host = (rng.standard_normal((V_PAD, D), dtype=np.float32) * 0.08).astype(jnp.bfloat16)
    w1 = jax.device_put(w_host, devs[0])
    w2 = jax.device_put(w_host, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("tp", None)))
    rows = []
    for m in (1, 64, 4096):
        h_host = (rng.standard_normal((m, D), dtype=np.float32) * 2).astype(jnp.bfloat16)
        t_host = rng.integers(0, VOCAB, m).astype(np.int32)
        t_host[: min(m, 4)] = [0, V_PAD // 2 - 1, V_PAD // 2, VOCAB - 1][: min(m, 4)]  # shard edges
        h1, t1 = jax.device_put(h_host, devs[0]), jax.device_put(t_host, devs[0])
        rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        h2, t2 = jax.device_put(h_host, rep), jax.device_put(t_host, rep)  # resident: time compute, not transfers
        f1 = jax.jit(
            lambda h, w, t: dl.linear_logp(h, w, t, vocab_size=VOCAB, padded_vocab_size=V_PAD, backend=BACKEND)[:2]
        )
        f2 = jax.jit(
            lambda h, w, t: linear_logp_tp(
                h, w, t, mesh=mesh, tp_axis="tp", vocab_size=VOCAB, padded_vocab_size=V_PAD, backend=BACKEND
            )[:2]
        )
        with dl.strict_mode():
            a = jax.device_get(f1(h1, w1, t1))
            b = jax.device_get(f2(h2, w2, t2))
            prov = dl.last_provenance()
        diff_lp = int((np.asarray(a[0]).view(np.uint32) != np.asarray(b[0]).view(np.uint32)).sum())
        diff_lse = int((np.asarray(a[1]).view(np.uint32) != np.asarray(b[1]).view(np.uint32)).sum())
        mad = float(np.nanmax(np.abs(np.asarray(a[0], np.float64) - np.asarray(b[0], np.float64))))
        t1m = timed(lambda: f1(h1, w1, t1))
        t2m = timed(lambda: f2(h2, w2, t2))
        row = dict(
            m=m,
            logp_mismatch_rows=diff_lp,
            lse_mismatch_rows=diff_lse,
            max_abs_diff=mad,
            tp1_ms=t1m,
            tp2_ms=t2m,
            backend=prov.backend,
            fallback=prov.fallback,
        )
        rows.append(row)
        print(
            f"M={m:5d} mismatches logp={diff_lp} lse={diff_lse} max_abs_diff={mad:.3g} "
            f"TP1 {t1m[0]:.3f} ms  TP2 {t2m[0]:.3f} ms  (backend {prov.backend})",
            flush=True,
        )
    out = dict(
        command="OUT=$OUT PYTHONPATH=. python3 tests/gpu/tp_x2.py",
        device=devs[0].device_kind,
        n_devices=len(devs),
        jax=jax.__version__,
        rows=rows,
    )
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "tp_x2.json"), "w") as f:
            json.dump(out, f, indent=1)
    ok = all(r["logp_mismatch_rows"] == 0 and r["lse_mismatch_rows"] == 0 for r in rows)
    print("TP=2 == TP=1 bytes:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
