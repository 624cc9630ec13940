"""Runs a module as `python -m` does, with `pallas_kernels.tuning.DECODE_FOLD` set.

    python3 tests/gpu/with_decode_fold.py -m detlogp_jax.golden --backend pallas_sm90
    python3 tests/gpu/with_decode_fold.py -m pytest -q tests/gpu/test_pallas_gpu.py -k "fused_forward and M1"
    python3 tests/gpu/with_decode_fold.py -m benchmarks.experiments.trace_calls --m 1 --backend pallas_sm90

For checking or timing the decode fold with a given row count: in this process only,
`tuning.DECODE_FOLD = tuning.FoldConfig(rows=DECODE_FOLD_ROWS)` (environment, default 8: the
shipped value since the twenty-second session, which validated it this way; 16 or 32, the fold
before it, for a comparison), read when `pallas_kernels.forward` is traced, so `linear_logp` at
N <= 64 rows folds with it. Nothing is written anywhere.
"""

from __future__ import annotations

import os
import sys

from with_entropy import check_usage, run_module  # (this script's folder is on sys.path)


def main(argv: list[str]) -> None:
    check_usage(argv, "with_decode_fold.py")
    from pallas_kernels import tuning

    tuning.DECODE_FOLD = tuning.FoldConfig(rows=int(os.environ.get("DECODE_FOLD_ROWS", "8")))
    run_module(argv, f"with_decode_fold: tuning.DECODE_FOLD = {tuning.DECODE_FOLD} in this process")


if __name__ == "__main__":
    main(sys.argv[1:])
