"""The decode fold's rows per CTA (issue 18, decode M=1 <= 1.03x; shipped: `tuning.DECODE_FOLD`).

    python -m benchmarks.experiments.fold_rows --m 1,8,40 --rows 32,16,8 --out fold_rows.jsonl

At M=1 the fold (`tuning.FoldConfig`, 32 rows per warpgroup: G = 4 threads per row
share its 264 splits) takes ~5 us of the decode call; with 8 rows per warpgroup G = 16 threads
share a row's splits (a quarter of the exp programs per thread), the contract's chain and its
order unchanged. For each M and rows value: the fold alone on the forward kernel's split-major
partials (`sm90_fold.fold_transposed(ztT=, n_rows=M)`, the call `pk.forward`
makes), and the whole decode forward (`pk.forward(fold_cfg=)`), each timed as 100 back-to-back
calls per sync (median of --samples), with their logp / lse (/ entropy) bytes against the
first rows value's (rows differing printed; bit-neutral knobs must give 0). One JSON line each.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import pallas_kernels as pk
from benchmarks import cases, shapes
from pallas_kernels import sm90_fold, tuning, wrapper

FLAGS = flags.FLAGS
flags.DEFINE_string("m", "1,8,40", "Comma-separated row counts.")
flags.DEFINE_string("rows", "32,16,8", "Comma-separated FoldConfig.rows values (the first is the reference).")
flags.DEFINE_integer("samples", 9, "Samples of 100 calls per sync.")
flags.DEFINE_bool("entropy", False, "Fold the entropy statistic too.")
flags.DEFINE_string("out", None, "Append one JSON line per (M, rows, what) here.")


def _per_call_us(fn, samples: int, calls: int = 100) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def main(argv):
    del argv
    shape = shapes.get("qwen3_8b")
    weight = cases.make_weight(shape, jnp.bfloat16, seed=0)
    kw = dict(vocab_size=shape.v_real, padded_vocab_size=shape.v_rows, return_entropy=FLAGS.entropy)
    rows_list = [int(x) for x in FLAGS.rows.split(",")]
    for m in (int(x) for x in FLAGS.m.split(",")):
        [(hidden, targets)] = cases.make_inputs(shape, jnp.bfloat16, 0, m)
        inv_t = jnp.ones((m,), jnp.float32)
        launched = wrapper._launch(hidden, weight, None, targets, inv_t, unpadded=True, **kw)
        ref = {}
        for rows in rows_list:
            cfg = tuning.FoldConfig(rows=rows)

            def fold(cfg=cfg):
                return sm90_fold.fold_transposed(
                    launched.m_t,
                    launched.s_t,
                    None,
                    launched.targets_p,
                    launched.inv_t_p,
                    shape.v_real,
                    aT=launched.a_t,
                    ztT=launched.zt_t,
                    n_rows=launched.targets_p.shape[0],
                    cfg=cfg,
                )

            fwd = jax.jit(lambda h, w, t, it, cfg=cfg: pk.forward(h, w, None, t, it, fold_cfg=cfg, **kw))
            for what, fn in (("fold", jax.jit(fold)), ("forward", lambda fwd=fwd: fwd(hidden, weight, targets, inv_t))):
                out = fn()
                bits = [np.asarray(o, np.float32).view(np.uint32) for o in out if o is not None and o.ndim == 1]
                if what not in ref:
                    ref[what] = bits
                differing = [int((a != b).sum()) for a, b in zip(bits, ref[what])]
                us = _per_call_us(fn, FLAGS.samples)
                row = dict(m=m, rows=rows, what=what, us_per_call=us, rows_differing=differing)
                row["device"] = str(jax.devices()[0].device_kind)
                print(f"M={m:3d} rows={rows:2d} {what:8s} {us:8.2f} us/call (100 per sync)  differing {differing}")
                if FLAGS.out:
                    with open(FLAGS.out, "a") as f:
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    app.run(main)
