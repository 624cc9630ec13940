"""Inputs shared by the pallas_sm90 tests (CPU interpret tests and the GPU tests)."""

from __future__ import annotations

import numpy as np

from detlogp_jax import contract as C
from detlogp_jax import oracle


def fold_problem(n, ns, v, seed):
    """Partials with the fold's edge rows (NaN, all -inf, equal m, +-0, max in the last split):
    (m [n, ns], s [n, ns], z_t [n], targets [n], inv_t [n])."""
    rng = np.random.default_rng(seed)
    m = rng.normal(0, 3, (n, ns)).astype(np.float32)
    s = rng.uniform(0.5, 40, (n, ns)).astype(np.float32)
    m[0, :], s[0, :] = -np.inf, 0  # all -inf: M = -inf, every w_j = 1, S = +0
    m[1, ns - 1] = np.nan  # NaN in the last split (the ragged step of the staged fold)
    m[2, ::2], s[2, ::2] = -np.inf, 0
    m[3, :] = m[3, 0]  # equal m: every w_j = 1
    m[4, :] = np.where(np.arange(ns) % 2, np.float32(0.0), np.float32(-0.0))  # +-0 maxima
    s[4, :] = 1
    m[5, :], s[5, :] = -np.inf, 0
    m[5, ns - 1], s[5, ns - 1] = 2.5, 3.0  # the max only in the last split
    s[6, ns // 2] = np.nan
    m[7, 0] = 60.0  # one dominant split, the others underflow to w = 0
    m[8, :] = np.float32(-1e-40)  # subnormal maxima (FTZ in the subtraction)
    m[8, 0] = 0.0
    z_t = rng.normal(0, 5, n).astype(np.float32)
    z_t[9] = 1e-40
    t = rng.integers(0, v, n).astype(np.int32)
    t[10], t[11], t[12] = C.IGNORE_INDEX, v, -3
    inv_t = oracle.inv_temperature(rng.uniform(0.3, 2, n).astype(np.float32), n)
    return m, s, z_t, t, inv_t


def entropy_fold_problem(n, ns, v, seed):
    """fold_problem's partials and an entropy statistic A for them (`linear-logp-entropy-v1`):
    A = -S * U(0, 6) (A <= 0, as the chain makes it), A = 0 where S = 0, -0 zeros in row 9, a NaN
    A in row 10, tiny statistics in row 11 (their rescale products underflow and are flushed).
    Returns (m, s, a, z_t, targets, inv_t); rows 0-8 keep fold_problem's edge rows."""
    m, s, z_t, t, inv_t = fold_problem(n, ns, v, seed=seed)
    rng = np.random.default_rng(seed + 1000)
    a = (-s * rng.uniform(0, 6, (n, ns))).astype(np.float32)
    a[s == 0] = 0.0
    a[9, :] = np.float32(-0.0)
    a[10, ns // 2] = np.nan
    a[11, :] = oracle.f_mul(s[11, :], np.float32(-1e-30))
    return m, s, a, z_t, t, inv_t


def split_captures(z_t, ns, seed):
    """The forward kernel's split-major target captures for z_t [n] over ns splits: [ns, n]
    f32, +0 everywhere but in one split per row (its owner, at a random split: the first and
    the last split included), which holds z_t; rows whose z_t is +0 hold no capture other than
    +0 either (an ignored / negative target). Also returns the owner of each row."""
    rng = np.random.default_rng(seed)
    n = z_t.shape[0]
    owner = rng.integers(0, ns, n)
    owner[:2] = [0, ns - 1]
    zt = np.zeros((ns, n), np.float32)
    zt[owner, np.arange(n)] = z_t
    return zt, owner
