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


def rel_err(got, want):
    """Relative Frobenius error ||got - want|| / ||want|| in float64 (0-safe)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def grad_case(n, d, v_pad, vocab, seed):
    """A gradient problem in f32 (round h and w to the model dtype yourself): hidden [n, d],
    weight [v_pad, d] (logits of std ~1.5), bias, targets with an ignored row and the last
    real token, per-row temperatures, and the logp / lse cotangents."""
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((n, d)).astype(np.float32)
    w = (rng.standard_normal((v_pad, d)) * (1.5 / np.sqrt(d))).astype(np.float32)
    b = (rng.standard_normal(v_pad) * 0.1).astype(np.float32)
    t = rng.integers(0, vocab, n).astype(np.int32)
    t[0], t[1] = -100, vocab - 1
    temp = rng.uniform(0.6, 1.4, n).astype(np.float32)
    g_lp = rng.standard_normal(n).astype(np.float32)
    g_lse = rng.standard_normal(n).astype(np.float32)
    return h, w, b, t, temp, g_lp, g_lse


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


def attention_f64(q, k, v, pos, kv_start, scale=None):
    """Causal GQA softmax attention in float64: query (b, t, h) at position pos[b, t] over the keys
    at cache slots kv_start[b] .. kv_start[b] + pos[b, t] of KV head h // (Hq / Hkv); a query with
    position < 0 gives zeros. q [B, T, Hq, Dh], k / v [B, S, Hkv, Dh]; scale default Dh ** -0.5."""
    import jax.numpy as jnp

    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
    b, t, hq, dh = q.shape
    g = hq // k.shape[2]
    scale = dh**-0.5 if scale is None else scale
    out = np.zeros(q.shape)
    for bb in range(b):
        for tt in range(t):
            p = int(pos[bb, tt])
            if p < 0:
                continue
            keys = np.arange(kv_start[bb], kv_start[bb] + p + 1)
            for h in range(hq):
                s = k[bb, keys, h // g] @ q[bb, tt, h] * scale
                w = np.exp(s - s.max())
                out[bb, tt, h] = (w / w.sum()) @ v[bb, keys, h // g]
    return out
