"""Where one call's time goes: per-kernel device time from a JAX profiler trace.

    python -m benchmarks.experiments.trace_calls --shape qwen3_8b --m 1 --backend pallas_sm90 --calls 20

Runs `--calls` back-to-back calls of the benchmark case (the same jitted function
`benchmarks.run` times) under `jax.profiler.trace`, reads the Chrome-format
`*.trace.json.gz` the profiler writes, and prints, per event name on the device
(GPU stream) threads, the number of events, the total and the mean duration per
call, plus the span from the first to the last device event per call (kernels and
the gaps between them). On a CPU-only machine there are no device threads and the
host-side XLA events are summarized instead. `--json` writes the table.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax
import jax.numpy as jnp
from absl import app, flags

from benchmarks import cases, shapes
from benchmarks.experiments.trace_summary import load_trace, summarize

FLAGS = flags.FLAGS
flags.DEFINE_string("shape", "qwen3_8b", "lm_head shape by name (benchmarks/shapes.py).")
flags.DEFINE_integer("m", 1, "Rows per call.")
flags.DEFINE_string("backend", "pallas_sm90", f"One of {cases.ALL_BACKENDS}.")
flags.DEFINE_enum("entry", "trainer", list(cases.ENTRIES), "trainer or serving.")
flags.DEFINE_enum("mode", "fwd", list(cases.MODES), "fwd or fwd_bwd.")
flags.DEFINE_bool(
    "entropy",
    False,
    "Trace the case with return_entropy=True.",
)
flags.DEFINE_enum("residuals", "recompute", list(cases.RESIDUALS), "--mode fwd_bwd: linear_logp(residuals=...).")
flags.DEFINE_integer("calls", 20, "Traced back-to-back calls (after 3 warmup calls).")
flags.DEFINE_integer("top", 25, "Rows of the table.")
flags.DEFINE_string("trace_dir", None, "Keep the raw trace here (default: a temporary directory).")
flags.DEFINE_string("json", None, "Write the summary as JSON to this path.")


def main(argv):
    del argv
    shape = shapes.get(FLAGS.shape)
    spec = cases.CaseSpec(
        backend=FLAGS.backend,
        shape=shape,
        entry=FLAGS.entry,
        mode=FLAGS.mode,
        entropy=FLAGS.entropy,
        residuals=FLAGS.residuals,
    )
    why = cases.unavailable_reason(FLAGS.backend)
    if why:
        raise SystemExit(f"{FLAGS.backend}: {why}")
    fn = jax.jit(cases.build(spec))
    weight = cases.make_weight(shape, jnp.bfloat16, seed=0)  # the inputs `benchmarks.run` times
    [(hidden, targets)] = cases.make_inputs(shape, jnp.bfloat16, 0, FLAGS.m)
    for _ in range(3):
        jax.block_until_ready(fn(hidden, weight, targets))
    trace_dir = FLAGS.trace_dir or tempfile.mkdtemp(prefix="trace_calls_")
    with jax.profiler.trace(trace_dir):
        outs = [fn(hidden, weight, targets) for _ in range(FLAGS.calls)]
        jax.block_until_ready(outs)
    summary = summarize(load_trace(trace_dir), FLAGS.calls)
    summary.update(
        shape=shape.name,
        m=FLAGS.m,
        backend=FLAGS.backend,
        entry=FLAGS.entry,
        mode=FLAGS.mode,
        device=str(jax.devices()[0].device_kind),
        trace_dir=trace_dir,
    )
    span = summary["span_us_per_call"]
    print(
        f"{FLAGS.backend} {shape.name} M={FLAGS.m} {FLAGS.entry}/{FLAGS.mode} on {summary['device']}: "
        f"{summary['scope']} events, busy {summary['busy_us_per_call']:.1f} us per call, "
        f"span {('%.1f' % span) if span is not None else '-'} us per call ({FLAGS.calls} calls)"
    )
    print(f"{'us/call':>10} {'count':>7}  name")
    for r in summary["rows"][: FLAGS.top]:
        print(f"{r['us_per_call']:10.2f} {r['count']:7d}  {r['name'][:110]}")
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    app.run(main)
