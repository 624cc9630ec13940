"""The GEMM-alone ceiling at the lm_head shape: cuBLAS (XLA) vs JAX's Pallas Hopper GEMM.

    PYTHONPATH=. python3 -m benchmarks.experiments.gemm_ceiling --gemm_m 4096 --out /tmp/gemm.jsonl

The fused kernel does the lm_head GEMM plus the streaming log-sum-exp, so the fastest
GEMM alone at the same shape on the same device bounds its effective rate. This times
XLA's GEMM and `jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu` under a small sweep
of its TuningConfig (the weight pre-transposed to [D, V] as that kernel wants), same
timing as `probe_kernel` (`kernel_timing.time_calls`: back-to-back calls, one
synchronization per sample), and
checks each Pallas result against XLA's with allclose (a GEMM, not a contract path).
Device: nvidia-h200.
"""

from __future__ import annotations

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks import baselines
from benchmarks.experiments import kernel_timing as kt

FLAGS = flags.FLAGS
flags.DEFINE_integer("gemm_m", 4096, "Rows.")
# --out (JSON lines output): kernel_timing's flag.


def main(argv):
    del argv
    m = FLAGS.gemm_m
    w = kt.weight()
    h, _ = kt.inputs(m, 1)
    flops = 2.0 * m * w.shape[0] * w.shape[1]
    out = open(FLAGS.out, "w")

    def record(name, res, **extra):
        row = {"name": name, "m": m, **res, **extra}
        if "median_ms" in res:
            row["tflops"] = flops / (res["median_ms"] * 1e-3) / 1e12
        out.write(json.dumps(row) + "\n")
        out.flush()
        print(json.dumps(row), flush=True)

    calls, samples = (6, 9) if m <= 4096 else (3, 7)
    ref, res = kt.time_calls(jax.jit(baselines.gemm), [(h, w)], calls, samples)
    record("xla gemm (cuBLAS)", res)
    ref = np.asarray(ref, np.float32)
    wt = jax.block_until_ready(jnp.asarray(w).T.copy())  # [D, V]
    sweep = itertools.product((128, 192), ("N", "M"), ("N", "M"), (4, 16))
    for tile_n, wg, minor, width in sweep:
        name = f"pallas hopper_matmul_mgpu tile 128x{tile_n} wg={wg} minor={minor} width={width}"
        try:
            fn = kt.pallas_gemm(tile_n=tile_n, wg=wg, minor=minor, width=width)
            o, res = kt.time_calls(fn, [(h, wt)], calls, samples)
            ok = bool(np.allclose(np.asarray(o, np.float32), ref, rtol=2e-2, atol=2e-2))
            record(name, res, allclose_to_xla=ok)
        except Exception as e:  # a config that does not fit (shared memory, divisibility) is skipped
            record(name, {"error": f"{type(e).__name__}: {str(e)[:200]}"})


if __name__ == "__main__":
    app.run(main)
