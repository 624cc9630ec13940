"""Compile, time, and probe one case (device-synchronized wall-clock timing)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclasses.dataclass
class Timing:
    times_ms: list[float]
    warmup_done: int
    truncated: bool  # fewer warmups/iterations than asked, to respect the per-case guard

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def min_ms(self) -> float:
        return min(self.times_ms)

    @property
    def max_ms(self) -> float:
        return max(self.times_ms)


def compile_case(fn, args) -> tuple[Any, float]:
    """jit + lower + compile once; returns (compiled executable, seconds)."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - t0


def _timed_call(compiled, args) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = compiled(*args)
    jax.block_until_ready(out)
    return out, time.perf_counter() - t0


def _timed_sample(compiled, arg_sets, first_index: int, calls: int) -> float:
    """Seconds per call of `calls` back-to-back calls with one synchronization at the end."""
    t0 = time.perf_counter()
    outs = [compiled(*arg_sets[(first_index + j) % len(arg_sets)]) for j in range(calls)]
    jax.block_until_ready(outs)
    dt = time.perf_counter() - t0
    del outs
    return dt / calls


def time_case(
    compiled, arg_sets: Sequence[tuple], *, warmup: int, iters: int, budget_s: float, calls_per_sample: int = 1
):
    """Warm up, then take `iters` timed samples rotating over `arg_sets`.

    A sample is one call followed by `jax.block_until_ready` (or, with
    calls_per_sample > 1, that many back-to-back calls and one sync, divided).
    Returns (timing, first_output): the first warmup call's output on
    arg_sets[0] is kept for the correctness and determinism checks. Under
    `budget_s` the warmup stops after a quarter of the budget and the sample
    count shrinks (at least one); `truncated` then says so.
    """
    start = time.perf_counter()
    first, t_call = _timed_call(compiled, arg_sets[0])
    warm = 1
    while warm < max(warmup, 1) and time.perf_counter() - start + t_call <= 0.25 * budget_s:
        out, t_call = _timed_call(compiled, arg_sets[warm % len(arg_sets)])
        del out
        warm += 1
    remaining = budget_s - (time.perf_counter() - start)
    n = max(1, min(iters, int(remaining / max(t_call * calls_per_sample, 1e-9))))
    times = [_timed_sample(compiled, arg_sets, i, calls_per_sample) * 1e3 for i in range(n)]
    truncated = n < iters or warm < max(warmup, 1)
    return Timing(times, warm, truncated), first


def paired_ratios(compiled_a, compiled_b, arg_sets: Sequence[tuple], *, pairs: int, calls_per_sample: int = 1):
    """Time b against a in interleaved samples: pair i times one sample of each, a first
    on even i and b first on odd i (order and clock drift cancel), and records t_b / t_a.
    Returns the per-pair ratios (both functions are already compiled and warm)."""
    ratios = []
    for i in range(max(1, pairs)):
        order = (compiled_a, compiled_b) if i % 2 == 0 else (compiled_b, compiled_a)
        t = {id(f): _timed_sample(f, arg_sets, i, calls_per_sample) for f in order}
        ratios.append(t[id(compiled_b)] / t[id(compiled_a)])
    return ratios


def compiled_memory(compiled) -> dict[str, int | None]:
    """XLA's memory analysis of the executable (works on CPU and GPU)."""
    keys = (
        "temp_size_in_bytes",
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "alias_size_in_bytes",
        "generated_code_size_in_bytes",
    )
    try:
        ma = compiled.memory_analysis()
    except Exception:
        ma = None
    return {
        k.replace("_size_in_bytes", "_bytes"): (int(getattr(ma, k)) if ma is not None and hasattr(ma, k) else None)
        for k in keys
    }


def device_memory() -> dict[str, int | None]:
    """Allocator stats of device 0 (None where the platform has none, e.g. CPU).

    `peak_bytes_in_use` is the process-wide high-water mark so far, not per case.
    """
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:
        stats = {}
    return {k: (int(stats[k]) if k in stats else None) for k in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit")}


def tree_nbytes(tree) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree)))


def _as_bits(x):
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[x.dtype.itemsize]
    return lax.bitcast_convert_type(x, width)


@jax.jit
def _bits_equal(a, b):
    eq = [
        jnp.array_equal(_as_bits(x), _as_bits(y))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
    ]
    return jnp.all(jnp.stack(eq))


@jax.jit
def _take_row(tree, row):
    return jax.tree_util.tree_map(lambda x: lax.dynamic_index_in_dim(x, row, 0, keepdims=False), tree)


@jax.jit
def _slice_rows(tree, row):
    return jax.tree_util.tree_map(lambda x: lax.dynamic_slice_in_dim(x, row, 1, 0), tree)


def row_inputs(hidden, targets, row: int):
    """(hidden[row:row+1], targets[row:row+1]) without eager per-op dispatch."""
    return _slice_rows((hidden, targets), row)


def same_bytes(a: dict, b: dict) -> bool:
    """Every output leaf of a and b has identical bytes (compared on device)."""
    return bool(_bits_equal(a, b))


def _max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    with np.errstate(invalid="ignore"):
        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    d = d[np.isfinite(d)]
    return float(d.max()) if d.size else 0.0


def compare_rows(batch: dict, alone: dict, row: int, fields: Sequence[str]) -> dict[str, dict]:
    """Bytes of row `row` of the batch outputs vs row 0 of the outputs of that row alone."""
    fields = [f for f in fields if f in batch and f in alone]
    if not fields:
        return {}
    batch_rows = jax.device_get(_take_row({f: batch[f] for f in fields}, row))
    detail = {}
    for f in fields:
        a = np.asarray(batch_rows[f])
        b = np.asarray(alone[f])[0]
        equal = a.tobytes() == b.tobytes()
        detail[f] = {"bitwise_equal": equal, "max_abs_diff": 0.0 if equal else _max_abs_diff(a, b)}
    return detail


def summarize(detail: dict[str, dict], trivial: bool = False) -> str | None:
    """'bitwise-invariant' or 'drift (max_abs_diff=..., in f1,f2)'."""
    if not detail:
        return None
    bad = [f for f, d in detail.items() if not d["bitwise_equal"]]
    if not bad:
        return "bitwise-invariant (trivial at M=1)" if trivial else "bitwise-invariant"
    mad = max(detail[f]["max_abs_diff"] for f in bad)
    return f"drift (max_abs_diff={mad:.3g} in {','.join(bad)})"
