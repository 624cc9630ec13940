"""Byte-level comparison of rollout and trainer logp (numpy, float64 statistics).

All comparisons are of float32 bytes: two values "match" only when their bit
patterns are equal (so -0.0 != +0.0 and NaN payloads count). Differences and
K3 are computed in float64 from the two float32 values.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["bits", "compare_logp", "compare_values", "row_mismatch", "per_step"]


def bits(x) -> np.ndarray:
    """The uint32 bit patterns of `x` as float32 (a contiguous view)."""
    return np.ascontiguousarray(np.asarray(x, np.float32)).view(np.uint32)


def _diff_k3(r: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """d = t - r and K3 = rho - 1 - log(rho) with rho = exp(d), both float64."""
    with np.errstate(invalid="ignore", over="ignore"):
        d = t.astype(np.float64) - r.astype(np.float64)
        k3 = np.expm1(d) - d
    return d, k3


def compare_logp(rollout, trainer) -> dict[str, Any]:
    """Row metrics between two float32 logp vectors (one value per row).

    Keeps: `mismatch_count` counts rows whose bytes differ (not a tolerance);
    `max_abs_diff` and `max_abs_k3` are over finite differences only and 0.0
    when there are none; `nonfinite` counts the rows left out of them.
    """
    r = np.asarray(rollout, np.float32).reshape(-1)
    t = np.asarray(trainer, np.float32).reshape(-1)
    if r.shape != t.shape:
        raise ValueError(f"shape mismatch {r.shape} vs {t.shape}")
    mismatch = int(np.count_nonzero(bits(r) != bits(t)))
    d, k3 = _diff_k3(r, t)
    finite = np.isfinite(d)
    return {
        "rows": int(r.size),
        "mismatch_count": mismatch,
        "max_abs_diff": float(np.max(np.abs(d[finite]))) if finite.any() else 0.0,
        "max_abs_k3": float(np.max(np.abs(k3[finite]))) if finite.any() else 0.0,
        "nonfinite": int(r.size - np.count_nonzero(finite)),
    }


def compare_values(rollout, trainer) -> dict[str, Any]:
    """Byte comparison of two float32 vectors that are not log-probabilities (the entropy):
    rows, mismatch_count (rows whose bytes differ), max_abs_diff over finite differences
    (0.0 when none), nonfinite (rows left out of it)."""
    m = compare_logp(rollout, trainer)
    return {k: m[k] for k in ("rows", "mismatch_count", "max_abs_diff", "nonfinite")}


def row_mismatch(a, b) -> tuple[int, float]:
    """(rows of [N, ...] arrays whose bytes differ anywhere, max |a - b| over finite entries)."""
    a = np.asarray(a, np.float32).reshape(np.shape(a)[0], -1)
    b = np.asarray(b, np.float32).reshape(np.shape(b)[0], -1)
    rows = int(np.count_nonzero((bits(a) != bits(b)).any(axis=1)))
    with np.errstate(invalid="ignore"):
        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    d = d[np.isfinite(d)]
    return rows, float(d.max()) if d.size else 0.0


def per_step(rollout, trainer) -> dict[str, list]:
    """Per decode step metrics of [B, S] logp arrays (column s = step s).

    Keeps: `mismatch[s]` = sequences whose step-s logp bytes differ (0..B);
    `max_abs_k3[s]` = max |K3| over that step's finite rows (0.0 if none).
    """
    r = np.asarray(rollout, np.float32)
    t = np.asarray(trainer, np.float32)
    if r.shape != t.shape or r.ndim != 2:
        raise ValueError(f"expected two [B, S] arrays, got {r.shape} and {t.shape}")
    mismatch = np.count_nonzero(bits(r) != bits(t), axis=0)
    _, k3 = _diff_k3(r, t)
    k3 = np.where(np.isfinite(k3), np.abs(k3), 0.0)
    return {"mismatch": [int(x) for x in mismatch], "max_abs_k3": [float(x) for x in k3.max(axis=0)]}
