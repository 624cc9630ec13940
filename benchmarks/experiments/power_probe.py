"""SM clock and board power while a kernel runs back to back (nvidia-h200).

    PYTHONPATH=. python3 -m benchmarks.experiments.power_probe --m 16384 --seconds 4 --out /tmp/power.jsonl

For each variant: time calls for --seconds while `nvidia-smi -lms 50` samples the SM
clock and the board power; one JSON line per variant with the median clock / power
over the samples taken after the first second (the clock settles). The question it
answers: is a fused kernel that runs slower than the GEMM alone, with the same
pipeline, held back by the board's power limit (lower SM clock) rather than by its
schedule? (The earlier third variant, the prefill kernel's pipeline without its chain,
used the kernels' skip_epilogue diagnostic, which is gone: benchmarks/experiments/README.md.
`--stand_ins` puts it back as a timing stand-in: the same kernel with its chain replaced by
each of `chain_stand_ins.STAND_INS`, other bytes.) The kernel is the bucket
`tuning.select_bucket(--m)` serves.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import time

import jax
from absl import app, flags

from benchmarks import baselines
from benchmarks.experiments import chain_stand_ins
from benchmarks.experiments import kernel_timing as kt
from pallas_kernels import tuning

FLAGS = flags.FLAGS
flags.DEFINE_integer("m", 16384, "Rows.")
flags.DEFINE_float("seconds", 4.0, "Seconds of back-to-back calls per variant.")
flags.DEFINE_bool(
    "stand_ins",
    False,
    "Also the kernel with its chain replaced by each of chain_stand_ins.STAND_INS (other bytes).",
)
# --out (JSON lines output): kernel_timing's flag.


def _sample(fn, args, seconds):
    jax.block_until_ready(fn(*args))
    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "50"],
        stdout=subprocess.PIPE,
        text=True,
    )
    t0 = time.perf_counter()
    calls = 0
    while time.perf_counter() - t0 < seconds:
        outs = [fn(*args) for _ in range(4)]
        jax.block_until_ready(outs)
        calls += 4
    elapsed = time.perf_counter() - t0
    smi.terminate()
    text, _ = smi.communicate()
    rows = [tuple(float(x) for x in line.split(",")) for line in text.strip().splitlines() if line.count(",") == 1]
    settled = rows[len(rows) // max(1, int(seconds)) :] or rows
    return {
        "ms_per_call": elapsed / calls * 1e3,
        "calls": calls,
        "samples": len(settled),
        "sm_mhz_median": statistics.median(r[0] for r in settled),
        "sm_mhz_min": min(r[0] for r in settled),
        "power_w_median": statistics.median(r[1] for r in settled),
        "power_w_max": max(r[1] for r in settled),
    }


def main(argv):
    del argv
    m = FLAGS.m
    w = kt.weight()
    h, t = kt.inputs(m, 1)
    out = open(FLAGS.out, "w")

    def record(name, res):
        row = {"name": name, "m": m, **res}
        out.write(json.dumps(row) + "\n")
        out.flush()
        print(json.dumps(row), flush=True)

    ws = tuning.select_bucket(m)
    run, prep = kt.kernel_fn(m, ws)
    hp, tp, ip = prep(h, t)
    record(f"pallas_sm90 {ws.name} kernel", _sample(run, (hp, w, tp, ip), FLAGS.seconds))
    record("xla gemm alone (cuBLAS)", _sample(jax.jit(baselines.gemm), (h, w), FLAGS.seconds))
    if FLAGS.stand_ins:
        for tag, stand_in in chain_stand_ins.STAND_INS.items():
            with chain_stand_ins.replaced_chain(stand_in):
                cfg = dataclasses.replace(ws, name=f"{ws.name} {tag}")
                run_s, _ = kt.kernel_fn(m, cfg)
                jax.block_until_ready(run_s(hp, w, tp, ip))  # built (traced) inside the block
            record(f"pallas_sm90 {ws.name} kernel, chain: {tag}", _sample(run_s, (hp, w, tp, ip), FLAGS.seconds))
    time.sleep(2)
    record(f"pallas_sm90 {ws.name} kernel (again)", _sample(run, (hp, w, tp, ip), FLAGS.seconds))


if __name__ == "__main__":
    app.run(main)
