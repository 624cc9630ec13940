"""Where a decode call's time goes between the host and the device (issue 18, decode <= 1.03x).

    python -m benchmarks.experiments.call_overhead --m 1,64 --out overhead.jsonl

The benchmark runner's per-call time at M=1 sits above a profiler trace's device work per call
for both the trainer forward and the GEMM alone (docs/PERFORMANCE.md). This script asks what the
rest is. For each
lane, the same compiled executable is timed five ways (median over `--samples` samples):

* `enqueue_us`: host time to issue `--calls` calls without waiting, per call (the dispatch
  cost, the kernels' launches included);
* `single_us`: one call, then `jax.block_until_ready` (latency: dispatch + device + sync);
* `sample10_us`: 10 back-to-back calls and one sync, per call (the runner's method);
* `sample100_us`: 100 back-to-back calls and one sync, per call (the fixed costs amortized:
  the device's rate when the host keeps ahead);
* `gap10_us` = sample10 - sample100: the per-call share of what one sync and the first
  dispatch cost in a 10-call sample.

Lanes: `trainer` (as shipped), `gemm` and `gemm_remat` (the runner's own functions,
`benchmarks.cases.build`; with `--mode fwd_bwd` their training step: is the runner's time above
the trace's busy time a per-sample cost or a rate?), `padded` (`pallas_kernels.forward` on rows
already padded to the kernel's row count, `unpadded=False`: no pads, no output slices; the fold
remains) and `kernel` (the forward kernel alone on pre-padded operands,
`kernel_timing.kernel_fn`). trainer - padded is the glue's share, padded - kernel the fold's.
One JSON line per lane and M. The trainer's logp / lse bytes equal the padded lane's first rows
(printed: a restructure check, not a contract check).
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
from benchmarks.experiments import kernel_timing as kt
from detlogp_jax import contract as C
from pallas_kernels import tuning

FLAGS = flags.FLAGS
flags.DEFINE_string("shape", "qwen3_8b", "lm_head shape by name (benchmarks/shapes.py); the kernel lane is Qwen3-8B's.")
flags.DEFINE_string("m", "1,64", "Comma-separated row counts.")
flags.DEFINE_enum(
    "mode", "fwd", list(cases.MODES), "fwd, or fwd_bwd for the runner's lanes (trainer, gemm, gemm_remat)."
)
flags.DEFINE_integer("samples", 15, "Samples per timing.")
flags.DEFINE_integer("calls", 10, "Calls per enqueue sample.")
flags.DEFINE_string("lanes", "trainer,gemm,padded,kernel", "Comma-separated lanes (see the module docstring).")
# --out (append one JSON line per lane and M): kernel_timing's flag.


def _median_us(fn, samples):
    return statistics.median(fn() for _ in range(samples)) * 1e6


def measure(call, samples: int, calls: int) -> dict:
    """The five timings of one compiled call (a no-argument function returning its output)."""
    for _ in range(3):
        jax.block_until_ready(call())

    def issue(n):  # n calls in one stream; only the last output is kept (a training step's
        out = None  # dW is 1.2 GB: 100 of them do not fit), and it is ready after all n
        for _ in range(n):
            out = call()
        return out

    def enqueue():
        t0 = time.perf_counter()
        out = issue(calls)
        dt = time.perf_counter() - t0
        jax.block_until_ready(out)
        return dt / calls

    def single():
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        return time.perf_counter() - t0

    def back_to_back(n):
        def run():
            t0 = time.perf_counter()
            jax.block_until_ready(issue(n))
            return (time.perf_counter() - t0) / n

        return run

    out = {
        "enqueue_us": _median_us(enqueue, samples),
        "single_us": _median_us(single, samples),
        "sample10_us": _median_us(back_to_back(10), samples),
        "sample100_us": _median_us(back_to_back(100), max(3, samples // 3)),
    }
    out["gap10_us"] = out["sample10_us"] - out["sample100_us"]
    return out


def lanes_for(shape, m: int, names) -> dict:
    """{lane: no-argument call} at M = m on the runner's inputs."""
    weight = cases.make_weight(shape, jnp.bfloat16, seed=0)
    [(hidden, targets)] = cases.make_inputs(shape, jnp.bfloat16, 0, m)
    got = {}
    for name in names:
        if name in ("trainer", "gemm", "gemm_remat"):
            backend = "pallas_sm90" if name == "trainer" else name
            spec = cases.CaseSpec(backend=backend, shape=shape, mode=FLAGS.mode)
            f = jax.jit(cases.build(spec)).lower(hidden, weight, targets).compile()
            got[name] = lambda f=f: f(hidden, weight, targets)
        elif FLAGS.mode != "fwd":
            raise SystemExit(f"the {name} lane is a forward (--mode fwd)")
        elif name == "padded":
            cfg = tuning.select_bucket(m, None)
            n_pad = tuning.padded_rows(m, cfg)
            h_p = jnp.pad(hidden, ((0, n_pad - m), (0, 0)))
            t_p = jnp.pad(targets, (0, n_pad - m), constant_values=C.IGNORE_INDEX)
            inv_t = jnp.ones((n_pad,), jnp.float32)

            def padded(h, w, t, it):
                logp, lse, _, _ = pk.forward(
                    h,
                    w,
                    None,
                    t,
                    it,
                    vocab_size=shape.v_real,
                    padded_vocab_size=shape.v_rows,
                    unpadded=False,
                )
                return {"logp": logp, "lse": lse}

            f = jax.jit(padded).lower(h_p, weight, t_p, inv_t).compile()
            got[name] = lambda f=f, a=(h_p, weight, t_p, inv_t): f(*a)
        elif name == "kernel":
            if shape.name != "qwen3_8b":
                raise SystemExit("the kernel lane times the Qwen3-8B head only (benchmarks.experiments.kernel_timing)")
            run, prep = kt.kernel_fn(m, tuning.select_bucket(m, None))
            args = prep(hidden, targets)
            got[name] = lambda run=run, args=args: run(args[0], weight, *args[1:])
        else:
            raise SystemExit(f"unknown lane {name!r}")
    return got


def main(argv):
    del argv
    names = [x for x in FLAGS.lanes.split(",") if x]
    shape = shapes.get(FLAGS.shape)
    for m in (int(x) for x in FLAGS.m.split(",")):
        calls = lanes_for(shape, m, names)
        outs = {}
        for name, call in calls.items():
            row = {"shape": shape.name, "m": m, "mode": FLAGS.mode, "lane": name}
            row["device"] = str(jax.devices()[0].device_kind)
            row.update(measure(call, FLAGS.samples, FLAGS.calls))
            outs[name] = call()
            print(
                f"M={m:5d} {name:8s} enqueue {row['enqueue_us']:8.1f} us  single {row['single_us']:8.1f}  "
                f"10/sample {row['sample10_us']:8.1f}  100/sample {row['sample100_us']:8.1f}  gap10 {row['gap10_us']:6.1f}",
                flush=True,
            )
            if FLAGS.out:
                with open(FLAGS.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
        if "trainer" in outs and "padded" in outs and FLAGS.mode == "fwd":
            for k in ("logp", "lse"):
                a = np.asarray(outs["trainer"][k], np.float32)
                b = np.asarray(outs["padded"][k], np.float32)[:m]
                print(
                    f"M={m} {k}: trainer == padded rows: {bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))}"
                )


if __name__ == "__main__":
    app.run(main)
