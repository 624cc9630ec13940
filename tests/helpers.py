"""Shared test helpers, imported as `from tests.helpers import ...` (bitwise means bytes)."""

import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bits(x):
    return np.ascontiguousarray(np.asarray(x, np.float32)).view(np.uint32)


def row_mismatches(a, b):
    """(number of rows whose bytes differ, max_abs_diff over finite entries)."""
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    assert a.shape == b.shape, (a.shape, b.shape)
    diff = bits(a) != bits(b)
    rows = diff.reshape(diff.shape[0], -1).any(axis=1).sum() if diff.ndim else int(diff)
    with np.errstate(invalid="ignore"):
        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    d = d[np.isfinite(d)]
    return int(rows), float(d.max()) if d.size else 0.0


def assert_bitwise_equal(a, b, what=""):
    rows, mad = row_mismatches(a, b)
    assert rows == 0, f"{what}: {rows} rows differ in bytes, max_abs_diff={mad}"


def f64_loss_grads(h, w, b, t, temp, vocab, g_lp, g_lse):
    """d/d(h, w, b) of sum(g_lp * logp + g_lse * lse), in float64, materialized."""
    h = np.asarray(h, np.float64)
    w = np.asarray(w, np.float64)
    z = h @ w.T + np.asarray(b, np.float64)
    y = z / temp
    y[:, vocab:] = -np.inf
    mx = y.max(1, keepdims=True)
    p = np.exp(y - mx)
    p /= p.sum(1, keepdims=True)
    live = (t >= 0) & (t < vocab)
    onehot = np.zeros_like(p)
    onehot[np.arange(len(t))[live], t[live]] = 1
    dz = (g_lse[:, None] * p + (g_lp * live)[:, None] * (onehot - p)) / temp
    return dz @ w, dz.T @ h, dz.sum(0)
