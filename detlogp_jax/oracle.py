"""The executable specification: the contract's post-GEMM arithmetic in numpy.

No JAX here. Every f32 operation is a single IEEE-754 binary32 operation with
round-to-nearest-even, and subnormal inputs and results are flushed to
sign-preserving zero (FTZ), exactly as `docs/CONTRACT.md` states. numpy never
contracts `a*b + c` into an FMA, so each `f_mul`/`f_add` below is one rounding.
The contract uses no FMA anywhere (see CONTRACT.md, "Why no FMA").

Given a backend's FP32 logits (the serving entry returns them), `logp_lse`
recomputes logp and lse; a contract-bearing backend must match it bit for bit.
`entropy` (and `logp_lse_entropy`) recompute the per-row entropy statistic of
`linear-logp-entropy-v1` (CONTRACT.md section 9) from the same logits; a backend
that produces the entropy must match it bit for bit too.
"""

from __future__ import annotations

import numpy as np

from detlogp_jax import contract as C

F32 = np.float32
_TINY = F32(C.F32_MIN_NORMAL)


def ftz(x):
    """Flushes subnormals to sign-preserving zero."""
    x = np.asarray(x, dtype=F32)
    return np.where(np.abs(x) < _TINY, np.copysign(F32(0), x), x).astype(F32)


def f_add(a, b):
    with np.errstate(all="ignore"):
        return ftz(ftz(a) + ftz(b))


def f_sub(a, b):
    with np.errstate(all="ignore"):
        return ftz(ftz(a) - ftz(b))


def f_mul(a, b):
    with np.errstate(all="ignore"):
        return ftz(ftz(a) * ftz(b))


def f_div(a, b):
    with np.errstate(all="ignore"):
        return ftz(ftz(a) / ftz(b))


def f_fma(a, b, c):
    """Exact binary32 fused multiply-add fl(a*b + c) (one rounding), FTZ.

    NOT used by the contract (which has no FMA); it models what a compiler
    that contracts `a*b + c` would compute, so tests can show that contraction
    changes bits and would be caught. a*b is exact in float64; the float64 sum
    is made round-to-odd (TwoSum error term, then a nudge of an even result
    toward the error), which makes the final rounding to binary32 correct.
    """
    a, b, c = (ftz(np.asarray(v, F32)).astype(np.float64) for v in (a, b, c))
    with np.errstate(all="ignore"):
        p = a * b
        s = p + c
        bb = s - p
        err = (p - (s - bb)) + (c - bb)
        even = (s.view(np.int64) & 1) == 0
        nudge = (err != 0) & even & np.isfinite(s)
        s = np.where(nudge, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
        return ftz(s.astype(F32))


def _bits(x):
    return np.asarray(x, dtype=F32).view(np.int32)


def _from_bits(i):
    return np.asarray(i, dtype=np.int32).view(F32)


def pexp(x):
    """The contract's exp for x <= 0 (also defined for x > 0 up to ~88).

    xc = x < -104 ? -104 : x;  t = xc*log2e;  k = (t + M) - M  (M = 1.5*2**23, so
    k = rint(t));  r = (xc - k*ln2_hi) - k*ln2_lo;  p = Horner(EXP_POLY, r) with a
    separately rounded multiply and add per step;  result = p * 2**k by adding k
    to the exponent field;  k < -125 -> +0;  NaN -> NaN.
    """
    x = np.asarray(x, dtype=F32)
    with np.errstate(all="ignore"):
        xc = np.where(x < F32(C.EXP_CLAMP_LO), F32(C.EXP_CLAMP_LO), x).astype(F32)
        t = f_mul(xc, F32(C.EXP_LOG2E))
        tm = f_add(t, F32(C.EXP_ROUND_MAGIC))
        k = f_sub(tm, F32(C.EXP_ROUND_MAGIC))
        ki = _bits(tm) - np.int32(C.EXP_ROUND_MAGIC_BITS)
        r = f_sub(f_sub(xc, f_mul(k, F32(C.EXP_LN2_HI))), f_mul(k, F32(C.EXP_LN2_LO)))
        p = np.full_like(r, F32(C.EXP_POLY[0]))
        for c in C.EXP_POLY[1:]:
            p = f_add(f_mul(p, r), F32(c))
        ki_safe = np.where(np.isnan(x), np.int32(0), ki).astype(np.int32)
        out = _from_bits(_bits(p) + (ki_safe << np.int32(23)))
        out = np.where(ki < np.int32(C.EXP_K_MIN), F32(0), out)
        out = np.where(np.isnan(x), x, out)
    return out.astype(F32)


def plog(s):
    """The contract's natural log.

    s = 2**e * f with f in [1, 2) from the bits; if f >= sqrt2: f *= 0.5, e += 1;
    r = f - 1 (exact);  q = Horner(LOG_POLY, r);  lg = (e*ln2_lo + r*q) + e*ln2_hi,
    each op separately rounded.  s == 0 -> -inf, s == +inf -> +inf, s < 0 or NaN
    -> NaN.  (Subnormal s is +-0 under FTZ.)
    """
    s = ftz(s)
    with np.errstate(all="ignore"):
        bits = _bits(s)
        e = ((bits >> np.int32(23)) & np.int32(0xFF)) - np.int32(127)
        f = _from_bits((bits & np.int32(0x7FFFFF)) | np.int32(0x3F800000))
        big = f >= F32(C.LOG_SQRT2)
        f = np.where(big, f_mul(f, F32(0.5)), f).astype(F32)
        e = np.where(big, e + np.int32(1), e).astype(np.int32)
        r = f_sub(f, F32(1.0))
        q = np.full_like(r, F32(C.LOG_POLY[0]))
        for c in C.LOG_POLY[1:]:
            q = f_add(f_mul(q, r), F32(c))
        ef = e.astype(F32)
        lg = f_add(f_add(f_mul(ef, F32(C.LOG_LN2_LO)), f_mul(r, q)), f_mul(ef, F32(C.LOG_LN2_HI)))
        lg = np.where(s == 0, F32(-np.inf), lg)
        lg = np.where(np.isposinf(s), F32(np.inf), lg)
        lg = np.where((s < 0) | np.isnan(s), F32(np.nan), lg)
    return lg.astype(F32)


def tree64(e):
    """Adjacent-pairwise balanced binary sum over the last axis (length 64)."""
    e = np.asarray(e, dtype=F32)
    assert e.shape[-1] == C.TILE_V
    while e.shape[-1] > 1:
        e = f_add(e[..., 0::2], e[..., 1::2])
    return e[..., 0]


def inv_temperature(temperature, n_rows: int):
    """inv_t = fl(1 / T) per row (T is a scalar or one value per row)."""
    t = np.broadcast_to(np.asarray(temperature, dtype=F32), (n_rows,))
    return f_div(F32(1.0), t)


def reciprocal(s):
    """rcp(s) = fl(1 / s), one correctly rounded division under FTZ (the entropy's 1/S)."""
    return f_div(F32(1.0), np.asarray(s, F32))


def rescale_a(a, s, m, m_new, w):
    """The entropy statistic A of a partial (m, S, A) re-based from max m to max m_new >= m.

    With delta = fl(m - m_new) <= 0 and w = pexp(delta) (the weight S is scaled by):
    sum e^(y - m_new) (y - m_new) = w * (A + delta * S), so
    resc = A                                  if m == m_new  (the max did not move)
         = +0                                 if w == 0      (a zero weight: also m = -inf)
         = fl(w * fl(A + fl(delta * S)))      otherwise.
    """
    a, s, m, m_new, w = (np.asarray(v, F32) for v in (a, s, m, m_new, w))
    with np.errstate(all="ignore"):
        moved = f_mul(w, f_add(a, f_mul(f_sub(m, m_new), s)))
        out = np.where(w == 0, F32(0.0), moved)
        return np.where(m == m_new, a, out).astype(F32)


def split_partials(z, vocab_size: int, padded_vocab_size: int, inv_t, *, return_entropy: bool = False):
    """Per-split (m, S) of scaled logits y = fl(z * inv_t) for rows of z [N, >= vocab_size].

    Lanes at col >= vocab_size are padding (y = -inf, e = +0) whatever z holds.
    Chain per split over ascending tiles:  tm = max(y_tile);  m' = max(m, tm);
    alpha = 1 if m == m' else exp(m - m');  e = exp(y - m') (0 on padding);
    S = fl(fl(S*alpha) + tree64(e));  m = m'.  Starts at m = -inf, S = +0.

    return_entropy: also the entropy statistic A per split (returns (m, S, A)). In the
    same step, from the same S before its update: d = fl(y - m') (the argument of e's
    exp), u = +0 if e == 0 else fl(e * d), A = fl(rescale_a(A, S, m, m', alpha) + tree64(u)).
    Starts at A = +0.
    """
    plan = C.split_bounds(padded_vocab_size)
    z = np.asarray(z, dtype=F32)
    n = z.shape[0]
    width = plan.n_tiles * C.TILE_V
    zz = np.zeros((n, width), F32)
    keep = min(z.shape[1], vocab_size)
    zz[:, :keep] = z[:, :keep]
    cols = np.arange(width)
    valid = cols < vocab_size
    inv_t = np.asarray(inv_t, dtype=F32).reshape(n, 1)
    y = np.where(valid[None, :], f_mul(zz, inv_t), F32(-np.inf)).astype(F32)
    m_out = np.empty((n, plan.n_split), F32)
    s_out = np.empty((n, plan.n_split), F32)
    a_out = np.empty((n, plan.n_split), F32)
    for j, (t0, t1) in enumerate(zip(plan.starts, plan.ends)):
        m = np.full((n,), F32(-np.inf))
        s = np.zeros((n,), F32)
        a = np.zeros((n,), F32)
        for tile in range(t0, t1):
            sl = slice(tile * C.TILE_V, (tile + 1) * C.TILE_V)
            yt, vt = y[:, sl], valid[sl]
            m_new = np.maximum(m, np.max(yt, axis=1))
            alpha = np.where(m == m_new, F32(1.0), pexp(f_sub(m, m_new))).astype(F32)
            d = f_sub(yt, m_new[:, None])
            e = np.where(vt[None, :], pexp(d), F32(0.0)).astype(F32)
            if return_entropy:
                u = np.where(e == 0, F32(0.0), f_mul(e, d)).astype(F32)
                a = f_add(rescale_a(a, s, m, m_new, alpha), tree64(u))
            s = f_add(f_mul(s, alpha), tree64(e))
            m = m_new
        m_out[:, j] = m
        s_out[:, j] = s
        a_out[:, j] = a
    return (m_out, s_out, a_out) if return_entropy else (m_out, s_out)


def fold(m, s, z_t, targets, inv_t, vocab_size: int):
    """Merges split partials in ascending order; returns (logp, lse).

    M = max_j m_j (exact, first);  S = +0; for j ascending:
    S = fl(S + fl(S_j * w_j)), w_j = 1 if m_j == M else exp(m_j - M);
    lse = fl(M + log(S));  y_t = fl(z_t * inv_t);  d = fl(y_t - lse);
    logp = +0 if d > 0 else d.  target == -100 -> logp = +0;  target < 0
    (other) or >= vocab_size -> logp = NaN.
    """
    m = np.asarray(m, F32)
    s = np.asarray(s, F32)
    targets = np.asarray(targets)
    big_m = np.max(m, axis=1)
    acc = np.zeros(m.shape[0], F32)
    for j in range(m.shape[1]):
        w = np.where(m[:, j] == big_m, F32(1.0), pexp(f_sub(m[:, j], big_m))).astype(F32)
        acc = f_add(acc, f_mul(s[:, j], w))
    lse = f_add(big_m, plog(acc))
    y_t = f_mul(np.asarray(z_t, F32), np.asarray(inv_t, F32))
    d = f_sub(y_t, lse)
    logp = np.where(d > 0, F32(0.0), d).astype(F32)
    logp = np.where(targets == C.IGNORE_INDEX, F32(0.0), logp)
    bad = C.bad_target(targets, vocab_size)
    logp = np.where(bad, F32(np.nan), logp).astype(F32)
    return logp, lse


def fold_entropy(m, s, a):
    """Merges split partials (m, S, A) in ascending order; returns the entropy [N].

    M = max_j m_j; S = +0, A = +0; for j ascending: w_j = 1 if m_j == M else
    exp(m_j - M); S = fl(S + fl(S_j * w_j)); A = fl(A + rescale_a(A_j, S_j, m_j, M, w_j)).
    h = fl(plog(S) - fl(A * rcp(S)));  entropy = +0 if h < 0 else h (NaN propagates).
    (S and the global max are exactly those of `fold`; A <= 0, so h >= 0 already.)
    """
    m = np.asarray(m, F32)
    s = np.asarray(s, F32)
    a = np.asarray(a, F32)
    big_m = np.max(m, axis=1)
    s_acc = np.zeros(m.shape[0], F32)
    a_acc = np.zeros(m.shape[0], F32)
    for j in range(m.shape[1]):
        w = np.where(m[:, j] == big_m, F32(1.0), pexp(f_sub(m[:, j], big_m))).astype(F32)
        s_acc = f_add(s_acc, f_mul(s[:, j], w))
        a_acc = f_add(a_acc, rescale_a(a[:, j], s[:, j], m[:, j], big_m, w))
    return entropy_of(s_acc, a_acc)


def entropy_of(s, a):
    """h = fl(plog(S) - fl(A * rcp(S))); +0 if h < 0 else h: the entropy of folded (S, A)."""
    h = f_sub(plog(s), f_mul(np.asarray(a, F32), reciprocal(s)))
    return np.where(h < 0, F32(0.0), h).astype(F32)


def entropy(logits, *, temperature=1.0, vocab_size=None, padded_vocab_size=None):
    """The entropy [N] of softmax(logits / T) over the real vocabulary, per `linear-logp-entropy-v1`,
    from FP32 (unscaled, bias included) logits [N, >= vocab_size]. Targets play no part."""
    z = ftz(np.asarray(logits, F32))
    n = z.shape[0]
    vocab_size = z.shape[1] if vocab_size is None else int(vocab_size)
    padded_vocab_size = vocab_size if padded_vocab_size is None else int(padded_vocab_size)
    inv_t = inv_temperature(temperature, n)
    m, s, a = split_partials(z, vocab_size, padded_vocab_size, inv_t, return_entropy=True)
    return fold_entropy(m, s, a)


def logp_lse_entropy(logits, targets, *, temperature=1.0, vocab_size=None, padded_vocab_size=None):
    """(logp, lse, entropy) of FP32 logits: `logp_lse` and `entropy` from one pass of partials."""
    z = ftz(np.asarray(logits, F32))
    n = z.shape[0]
    vocab_size = z.shape[1] if vocab_size is None else int(vocab_size)
    padded_vocab_size = vocab_size if padded_vocab_size is None else int(padded_vocab_size)
    targets = np.asarray(targets).astype(np.int64)
    inv_t = inv_temperature(temperature, n)
    m, s, a = split_partials(z, vocab_size, padded_vocab_size, inv_t, return_entropy=True)
    safe = np.clip(targets, 0, z.shape[1] - 1)
    logp, lse = fold(m, s, z[np.arange(n), safe], targets, inv_t, vocab_size)
    return logp, lse, fold_entropy(m, s, a)


def logp_lse(logits, targets, *, temperature=1.0, vocab_size=None, padded_vocab_size=None):
    """logp and lse of FP32 (unscaled, bias included) logits [N, >= vocab_size]."""
    z = ftz(np.asarray(logits, F32))
    n = z.shape[0]
    vocab_size = z.shape[1] if vocab_size is None else int(vocab_size)
    padded_vocab_size = vocab_size if padded_vocab_size is None else int(padded_vocab_size)
    targets = np.asarray(targets).astype(np.int64)
    inv_t = inv_temperature(temperature, n)
    m, s = split_partials(z, vocab_size, padded_vocab_size, inv_t)
    safe = np.clip(targets, 0, z.shape[1] - 1)
    z_t = z[np.arange(n), safe]
    return fold(m, s, z_t, targets, inv_t, vocab_size)


def reference_logits(hidden, weight, bias=None):
    """The reference backend's logits: per output, an ascending sequential sum over
    d of fl(h_d * w_d) with separately rounded f32 ops under FTZ, then fl(acc + b).
    (Inputs are first converted to f32.) Bit-exact for the reference backend on
    XLA:CPU, whose f32 arithmetic is FTZ/DAZ."""
    h = ftz(np.asarray(hidden, dtype=np.float32))
    w = ftz(np.asarray(weight, dtype=np.float32))
    acc = np.zeros((h.shape[0], w.shape[0]), F32)
    for d in range(h.shape[1]):
        acc = f_add(acc, f_mul(h[:, d : d + 1], w[None, :, d]))
    if bias is not None:
        acc = f_add(acc, np.asarray(bias, np.float32)[None, :])
    return acc
