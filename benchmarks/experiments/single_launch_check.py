"""Does the decode single launch run on the GPU, and does it give the two launches' bytes?

    python -m benchmarks.experiments.single_launch_check --out single.jsonl

`pk.forward(single_launch=True)` (`sm90_forward_ws.build(fold=)`: every CTA signals a grid
semaphore after its partials, the last CTA waits for all of them and folds) hung on the H200
in its first run (seventeenth session: compiled in 12 s, no result in 80 s, at M=1 and M=64).
A hang gives no message, so each check runs in its own process under a time limit and a hang
is reported as one, and the later checks still run:

* `semaphore`: the smallest grid semaphore (`lowering_checks.semaphores`: 132 CTAs of one
  warpgroup signal, the last waits for all and writes) executed: do Pallas's semaphores work
  on this GPU at all;
* `forward_m1`, `forward_m64`, `forward_m1_entropy`: the Qwen3-8B head at M rows, single launch
  vs the default two launches: rows differing in logp / lse (/ entropy) bytes, in two calls of
  the single launch (a race would show as run-to-run differences);
* `forward_m1_nowait` (a suffix to any forward check): the same with `pl.semaphore_wait` made a
  no-op in that process, so the last CTA folds without waiting: if this runs where the full
  check hangs, the hang is the semaphore's; its bytes may differ (nothing orders the fold
  after the other CTAs' stores), which is why the wait is there;
* `forward_m1_nofold`: `sm90_fold.fold_row_block` made a no-op instead (the wait, the scopes and
  the signals stay; logp / lse are then unwritten memory): if this hangs, the fold is not why.

One JSON line per check (`status` ok / hang / error, seconds, rows differing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string(
    "checks",
    "semaphore,forward_m1,forward_m1_nowait,forward_m1_nofold,forward_m64,forward_m1_entropy",
    "Comma-separated checks.",
)
flags.DEFINE_integer("limit_s", 90, "Seconds each check may take (compile included) before it counts as a hang.")
flags.DEFINE_string("out", None, "Append one JSON line per check here.")
flags.DEFINE_string("child", None, "(internal) run this one check in this process.")


def _semaphore() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n = 132

    def kernel(x_gmem, o_gmem):
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
        cid = lax.axis_index("x")
        o_gmem[cid] = x_gmem[cid] * 2.0
        pl.semaphore_signal(sem, 1)

        @pl.when(cid == n - 1)
        def _():
            pl.semaphore_wait(sem, n)
            o_gmem[n - 1] = o_gmem[n - 1] + 1.0

    f = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((n,), jnp.float32), grid=(n,), grid_names=("x",))
    x = jnp.arange(n, dtype=jnp.float32)
    o = np.asarray(jax.block_until_ready(f(x)))
    want = np.arange(n, dtype=np.float32) * 2.0
    want[-1] += 1.0
    return {"equal": bool(np.array_equal(o, want))}


def _forward(m: int, entropy: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallas_kernels as pk
    from benchmarks import cases, shapes

    shape = shapes.get("qwen3_8b")
    weight = cases.make_weight(shape, jnp.bfloat16, seed=0)
    [(hidden, targets)] = cases.make_inputs(shape, jnp.bfloat16, 0, m)
    inv_t = jnp.ones((m,), jnp.float32)

    def make(single):
        def f(h, w, t, it):
            out = pk.forward(
                h,
                w,
                None,
                t,
                it,
                vocab_size=shape.v_real,
                padded_vocab_size=shape.v_rows,
                return_entropy=entropy,
                single_launch=single,
            )
            return tuple(x for x in (out[0], out[1], out[3]) if x is not None)

        return jax.jit(f)

    t0 = time.perf_counter()
    want = jax.block_until_ready(make(False)(hidden, weight, targets, inv_t))
    single = make(True).lower(hidden, weight, targets, inv_t).compile()
    compiled = time.perf_counter() - t0
    got = [jax.block_until_ready(single(hidden, weight, targets, inv_t)) for _ in range(2)]
    names = ("logp", "lse", "entropy")
    row = {"compile_s": round(compiled, 1)}
    for i, g in enumerate(got):
        for name, a, b in zip(names, g, want):
            bits = np.asarray(a, np.float32).view(np.uint32) != np.asarray(b, np.float32).view(np.uint32)
            row[f"{name}_rows_differing_call{i + 1}"] = int(bits.sum())
            diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
            row[f"{name}_max_abs_diff_call{i + 1}"] = float(np.nanmax(diff)) if diff.size else 0.0
    return row


def _run_child(name: str) -> dict:
    if name == "semaphore":
        return _semaphore()
    if name.startswith("forward_m"):
        rest = name[len("forward_m") :]
        if rest.endswith("_nowait"):
            from jax.experimental import pallas as pl

            pl.semaphore_wait = lambda *args, **kwargs: None  # (this process only)
            rest = rest.removesuffix("_nowait")
        if rest.endswith("_nofold"):
            from pallas_kernels import sm90_fold

            sm90_fold.fold_row_block = lambda *args, **kwargs: None  # (this process only)
            rest = rest.removesuffix("_nofold")
        entropy = rest.endswith("_entropy")
        return _forward(int(rest.removesuffix("_entropy")), entropy)
    raise SystemExit(f"unknown check {name!r}")


def main(argv):
    del argv
    if FLAGS.child:
        print("RESULT " + json.dumps(_run_child(FLAGS.child)), flush=True)
        return
    for name in (x for x in FLAGS.checks.split(",") if x):
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "benchmarks.experiments.single_launch_check", "--child", name]
        row = {"check": name}
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=FLAGS.limit_s)
            lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if p.returncode == 0 and lines:
                row.update(status="ok", **json.loads(lines[-1][len("RESULT ") :]))
            else:
                row.update(status="error", rc=p.returncode, stderr_tail=p.stderr[-600:])
        except subprocess.TimeoutExpired:
            row.update(status="hang", limit_s=FLAGS.limit_s)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(row), flush=True)
        if FLAGS.out:
            with open(FLAGS.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    app.run(main)
