"""Rebuild a benchmark JSON and plot from `benchmarks.run`'s progress log.

For a sweep cut short (e.g. by a time limit on the device) after some cases
were measured: every progress line carries backend, M, median/min/max ms,
TFLOP/s, compile time and the determinism status. The per-sample times,
memory statistics and ratios are not in the log and stay empty; the document
says it was rebuilt.

  python -m benchmarks.from_log --log DIR/bench_fwd.log --shape qwen3_8b --entry trainer --mode fwd \
      --out DIR/qwen3_8b_trainer_fwd_h200.json

--log and --out are required: the command writes only where it is told.
"""

from __future__ import annotations

import re

from absl import app, flags

from benchmarks import cases as bench_cases
from benchmarks import report, shapes

FLAGS = flags.FLAGS


def _define_flags():
    """Flags of the command line only (the names are also benchmarks.run's)."""
    flags.DEFINE_string("log", None, "Progress log of benchmarks.run.")
    flags.DEFINE_string("shape", "qwen3_8b", "Shape name.")
    flags.DEFINE_string("entry", "trainer", "trainer or serving.")
    flags.DEFINE_string("mode", "fwd", "fwd or fwd_bwd.")
    flags.DEFINE_string("out", None, "JSON path (the plot goes next to it as .png).")
    flags.DEFINE_float("hbm_tbps", 4.0, "HBM bandwidth for the floor.")
    flags.DEFINE_float("peak_tflops", 790.0, "Dense bf16 peak for the floor.")


_LINE = re.compile(
    r"\(\d+/\d+\)\s+(?P<backend>\S+)\s+M=(?P<m>\d+)\s+median\s+(?P<med>[\d.]+) ms\s+\[(?P<lo>[\d.]+), (?P<hi>[\d.]+)\]"
    r"\s+(?P<tf>[\d.]+) TFLOP/s\s+compile (?P<comp>[\d.]+)s\s+(?P<det>.*)$"
)


def parse(text: str) -> list[report.CaseResult]:
    """CaseResults of the measured progress lines, with time_vs_xla filled per M."""
    cases = []
    for line in text.splitlines():
        mt = _LINE.search(line)
        if not mt:
            continue
        cases.append(
            report.CaseResult(
                backend=mt["backend"],
                m=int(mt["m"]),
                status="ok",
                median_ms=float(mt["med"]),
                min_ms=float(mt["lo"]),
                max_ms=float(mt["hi"]),
                tflops=float(mt["tf"]),
                compile_s=float(mt["comp"]),
                determinism=mt["det"].strip(),
            )
        )
    xla = {c.m: c.median_ms for c in cases if c.backend == "xla"}
    for c in cases:
        if c.m in xla:
            c.time_vs_xla = c.median_ms / xla[c.m]
    return cases


def main(argv):
    del argv
    if not FLAGS.log or not FLAGS.out:
        raise app.UsageError("--log and --out are required (the JSON goes to --out, the plot next to it)")
    text = open(FLAGS.log).read()
    cases = parse(text)
    # The runner's floor models (benchmarks.cases), for bf16 operands.
    spec = bench_cases.CaseSpec(backend="xla", shape=shapes.SHAPES[FLAGS.shape], entry=FLAGS.entry, mode=FLAGS.mode)
    fl = [
        {
            "m": m,
            "hbm_floor_ms": bench_cases.min_bytes(spec, m, 2) / (FLAGS.hbm_tbps * 1e12) * 1e3,
            "compute_floor_ms": bench_cases.flops(spec, m) / (FLAGS.peak_tflops * 1e12) * 1e3,
        }
        for m in sorted({c.m for c in cases})
    ]
    doc = {
        "schema": report.SCHEMA,
        "rebuilt_from_log": FLAGS.log,
        "shape": FLAGS.shape,
        "entry": FLAGS.entry,
        "mode": FLAGS.mode,
        "floors": fl,
        "cases": [c.as_dict() for c in cases],
    }
    report.write_json(doc, FLAGS.out)
    report.plot(
        cases,
        fl,
        FLAGS.out[:-5] + ".png",
        f"{FLAGS.shape} {FLAGS.entry} {FLAGS.mode} (rebuilt from the progress log)",
        FLAGS.hbm_tbps,
        FLAGS.peak_tflops,
    )
    print(report.format_table(cases))


if __name__ == "__main__":
    _define_flags()
    app.run(main)
