#!/usr/bin/env python
"""Side-by-side medians of benchmarks.run JSON files (one column per file), e.g. the vd and dv
sweeps of tests/gpu/h200_layout.sh:

    python tests/gpu/compare_bench.py $OUT/bench_vd.json $OUT/bench_dv.json

Prints, per (backend, M), each file's median ms, the ratio of the last to the first, and each
file's batch-invariance verdict."""

from __future__ import annotations

import json
import os
import sys


def main(paths):
    docs = [json.load(open(p)) for p in paths]
    names = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    cases = [{(c["backend"], c["m"]): c for c in d["cases"]} for d in docs]
    keys = sorted(set().union(*cases), key=lambda k: (k[0], k[1]))
    print(f"{'backend':<12} {'M':>6} " + " ".join(f"{n:>14}" for n in names) + f" {'last/first':>10}  determinism")
    for key in keys:
        got = [c.get(key, {}) for c in cases]
        ms = [g.get("median_ms") for g in got]
        cols = " ".join(f"{x:14.4f}" if x else f"{'-':>14}" for x in ms)
        ratio = f"{ms[-1] / ms[0]:10.3f}" if ms[0] and ms[-1] else f"{'-':>10}"
        det = " | ".join(str(g.get("determinism", g.get("status", "-"))) for g in got)
        print(f"{key[0]:<12} {key[1]:>6} {cols} {ratio}  {det}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
