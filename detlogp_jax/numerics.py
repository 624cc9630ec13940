"""The contract's pinned f32 programs (exp, log, tree, chain, fold) in JAX.

Each function takes an `ops` object that supplies the three rounded primitives
(`mul`, `add`, `sub`); everything else is exact (compare, select, max, integer
bit operations). `XlaOps` (default) runs on XLA and keeps every product a
separately rounded f32 multiply: XLA lets LLVM contract `a*b + c` into an FMA,
so each product passes an opaque integer xor with zero that no compiler can see
through. Pallas kernels pass their own ops (inline PTX `mul.rn.ftz.f32`, ...).

These functions mirror `detlogp_jax.oracle` operation by operation; the oracle
is the spec, these are implementations. The entropy statistic
(`linear-logp-entropy-v1`) has its own functions (`chain_step_entropy`,
`rescale_a`, `entropy_of`, `fold(..., a=...)`), used only when it is asked for.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from detlogp_jax import contract as C
from detlogp_jax import vma

F32 = jnp.float32


def opaque_zero(*sources):
    """A uint32 zero that neither XLA nor LLVM can prove to be zero.

    u = xor of the low bytes of the first element of every source array;
    zero = (u^3 - u) mod 3, which is 0 for every u by Fermat's little theorem
    (u <= 255, so nothing wraps), while constant folding and known-bits analyses
    cannot see it. Pass every runtime input of the computation: the zero is
    opaque as long as one of them is not a compile-time constant (with none,
    an optimization barrier on a constant is the last resort).
    """
    u = None
    for src in sources:
        if src is None or src.size == 0:
            continue
        first = jnp.ravel(src)[:1]
        if jnp.issubdtype(first.dtype, jnp.floating):
            first = lax.bitcast_convert_type(first.astype(jnp.float32), jnp.uint32)
        first = first.astype(jnp.uint32)[0]
        u = first if u is None else u ^ first
    if u is None:
        u = lax.optimization_barrier(jnp.zeros((), jnp.uint32))
    u = u & jnp.uint32(0xFF)
    return (u * u * u - u) % jnp.uint32(3)


class XlaOps:
    """Rounded f32 primitives on XLA, each result pinned behind an opaque xor.

    The pin stops LLVM from contracting a product into a following add (FMA)
    and XLA's simplifier from re-associating constants, e.g. folding the
    round-to-integer idiom (t + M) - M into t.
    """

    def __init__(self, zero=None):
        self._zero = opaque_zero() if zero is None else zero

    def _pin(self, v):
        bits = lax.bitcast_convert_type(v, jnp.uint32) ^ self._zero
        return lax.bitcast_convert_type(bits, F32)

    def mul(self, a, b):
        return self._pin(a * b)

    def add(self, a, b):
        return self._pin(a + b)

    def sub(self, a, b):
        return self._pin(a - b)


def ftz(x):
    """Flushes subnormals to sign-preserving zero (explicit; XLA:GPU does not).

    Exact integer ops only (a zero exponent field keeps just the sign bit), so
    the same code lowers in Mosaic GPU kernels, where jnp.copysign does not.
    """
    bits = lax.bitcast_convert_type(x, jnp.int32)
    is_sub = (bits & jnp.int32(0x7F800000)) == 0
    return lax.bitcast_convert_type(jnp.where(is_sub, bits & jnp.int32(-0x80000000), bits), F32)


def pexp(x, ops):
    """Contract exp (see oracle.pexp). x is f32 of any shape."""
    f = lambda v: jnp.asarray(v, F32)
    xc = jnp.where(x < f(C.EXP_CLAMP_LO), f(C.EXP_CLAMP_LO), x)
    t = ops.mul(xc, f(C.EXP_LOG2E))
    tm = ops.add(t, f(C.EXP_ROUND_MAGIC))
    k = ops.sub(tm, f(C.EXP_ROUND_MAGIC))
    ki = lax.bitcast_convert_type(tm, jnp.int32) - jnp.int32(C.EXP_ROUND_MAGIC_BITS)
    r = ops.sub(ops.sub(xc, ops.mul(k, f(C.EXP_LN2_HI))), ops.mul(k, f(C.EXP_LN2_LO)))
    p = jnp.full_like(r, C.EXP_POLY[0])
    for c in C.EXP_POLY[1:]:
        p = ops.add(ops.mul(p, r), f(c))
    isnan = x != x
    ki_safe = jnp.where(isnan, jnp.int32(0), ki)
    out = lax.bitcast_convert_type(lax.bitcast_convert_type(p, jnp.int32) + (ki_safe << 23), F32)
    out = jnp.where(ki < jnp.int32(C.EXP_K_MIN), f(0.0), out)
    return jnp.where(isnan, x, out)


def plog(s, ops):
    """Contract log (see oracle.plog)."""
    f = lambda v: jnp.asarray(v, F32)
    s = ftz(s)
    bits = lax.bitcast_convert_type(s, jnp.int32)
    e = ((bits >> 23) & 0xFF) - 127
    fr = lax.bitcast_convert_type((bits & 0x7FFFFF) | 0x3F800000, F32)
    big = fr >= f(C.LOG_SQRT2)
    fr = jnp.where(big, ops.mul(fr, f(0.5)), fr)
    e = jnp.where(big, e + 1, e)
    r = ops.sub(fr, f(1.0))
    q = jnp.full_like(r, C.LOG_POLY[0])
    for c in C.LOG_POLY[1:]:
        q = ops.add(ops.mul(q, r), f(c))
    ef = e.astype(F32)
    lg = ops.add(ops.add(ops.mul(ef, f(C.LOG_LN2_LO)), ops.mul(r, q)), ops.mul(ef, f(C.LOG_LN2_HI)))
    lg = jnp.where(s == 0, f(-jnp.inf), lg)
    lg = jnp.where(s == jnp.inf, f(jnp.inf), lg)
    return jnp.where((s < 0) | (s != s), f(jnp.nan), lg)


def tree64(e, ops):
    """Adjacent-pairwise balanced binary sum over the last axis (length 64)."""
    assert e.shape[-1] == C.TILE_V, e.shape
    while e.shape[-1] > 1:
        e = e.reshape(e.shape[:-1] + (e.shape[-1] // 2, 2))
        e = ops.add(e[..., 0], e[..., 1])
    return e[..., 0]


def chain_step(m, s, y, valid, ops):
    """One tile of the ascending chain: (m, S) <- tile of scaled lanes y [..., 64].

    `y` must already be -inf on padding lanes; `valid` marks real lanes.
    """
    m_new = jnp.maximum(m, jnp.max(y, axis=-1))
    alpha = jnp.where(m == m_new, jnp.asarray(1.0, F32), pexp(ops.sub(m, m_new), ops))
    e = jnp.where(valid, pexp(ops.sub(y, m_new[..., None]), ops), jnp.asarray(0.0, F32))
    return m_new, ops.add(ops.mul(s, alpha), tree64(e, ops))


def fmul_ftz(a, b, ops):
    """fl(a * b) flushed explicitly (the entropy's products can be subnormal; XLA:GPU does not flush)."""
    return ftz(ops.mul(a, b))


def rescale_a(a, s, m, m_new, w, ops):
    """The entropy statistic A of a partial (m, S, A) re-based from max m to m_new >= m
    (see oracle.rescale_a): A if m == m_new, else +0 if w == 0, else
    fl(w * fl(A + fl(fl(m - m_new) * S))), with w = pexp(fl(m - m_new)) S's weight."""
    moved = fmul_ftz(w, ops.add(a, fmul_ftz(ftz(ops.sub(m, m_new)), s, ops)), ops)
    out = jnp.where(w == 0, jnp.asarray(0.0, F32), moved)
    return jnp.where(m == m_new, a, out)


def chain_step_entropy(m, s, a, y, valid, ops):
    """`chain_step` that also carries the entropy statistic A [..] (oracle.split_partials,
    return_entropy=True). m and S get exactly `chain_step`'s bits: e = pexp(d) with
    d = fl(y - m'); u = +0 if e == 0 else fl(e * d); A = fl(resc(A) + tree64(u))."""
    m_new = jnp.maximum(m, jnp.max(y, axis=-1))
    alpha = jnp.where(m == m_new, jnp.asarray(1.0, F32), pexp(ops.sub(m, m_new), ops))
    d = ops.sub(y, m_new[..., None])
    e = jnp.where(valid, pexp(d, ops), jnp.asarray(0.0, F32))
    u = jnp.where(e == 0, jnp.asarray(0.0, F32), fmul_ftz(e, ftz(d), ops))
    a_new = ops.add(rescale_a(a, s, m, m_new, alpha, ops), tree64(u, ops))
    return m_new, ops.add(ops.mul(s, alpha), tree64(e, ops)), a_new


def entropy_of(s, a, ops):
    """h = fl(plog(S) - fl(A * rcp(S))) with rcp = `reciprocal_rn`; +0 if h < 0 else h."""
    h = ops.sub(plog(s, ops), fmul_ftz(a, reciprocal_rn(s), ops))
    return jnp.where(h < 0, jnp.asarray(0.0, F32), h)


def reciprocal_rn(t):
    """fl(1 / t) for f32 t: correctly rounded (nearest even), FTZ on input and output.

    Integer operations only, so every backend gives the same bits: XLA:GPU's f32
    division is not correctly rounded (on an H200 with jax 0.11.2, `1 / t` differed
    from IEEE division in 138730 of 2^20 random t in [0.05, 4)). With t = 2^E * M/2^23
    (2^23 <= M < 2^24): a power of two gives 2^-E exactly; otherwise 1/t =
    2^(-E-1) * q/2^23 with q = round(2^47 / M), from a 24-step restoring division
    (remainder < 2^25 fits uint32) and round-half-even on the remainder. Subnormal or
    zero t gives +-inf (FTZ input, as the oracle's f_div), results below 2^-126 give
    +-0, inf gives +-0, NaN stays NaN.
    """
    t = jnp.asarray(t, F32)
    bits = lax.bitcast_convert_type(t, jnp.uint32)
    sign = bits & jnp.uint32(0x80000000)
    be = ((bits >> 23) & jnp.uint32(0xFF)).astype(jnp.int32)
    frac = bits & jnp.uint32(0x7FFFFF)
    m = frac | jnp.uint32(0x800000)
    r = jnp.full_like(m, 0x800000)
    q = jnp.zeros_like(m)
    for _ in range(24):
        r = r << 1
        ge = r >= m
        r = jnp.where(ge, r - m, r)
        q = (q << 1) | ge.astype(jnp.uint32)
    two_r = r << 1
    up = (two_r > m) | ((two_r == m) & ((q & jnp.uint32(1)) == 1))
    q = q + up.astype(jnp.uint32)
    pow2 = frac == 0
    biased = jnp.where(pow2, 254 - be, 253 - be)
    mant = jnp.where(pow2, jnp.uint32(0), q - jnp.uint32(0x800000))
    out_bits = sign | (jnp.maximum(biased, 0).astype(jnp.uint32) << 23) | mant
    out = lax.bitcast_convert_type(out_bits, F32)
    signed_zero = lax.bitcast_convert_type(sign, F32)
    out = jnp.where(biased <= 0, signed_zero, out)
    out = jnp.where(be == 0, lax.bitcast_convert_type(sign | jnp.uint32(0x7F800000), F32), out)
    return jnp.where(jnp.isnan(t), t, out)


def inv_temperature(temperature, n_rows: int):
    """inv_t = fl(1/T) per row, as f32 [n_rows] (`reciprocal_rn`: the same bits on every backend)."""
    t = jnp.broadcast_to(jnp.asarray(temperature, F32), (n_rows,))
    return reciprocal_rn(t)


def fold(m, s, z_t, targets, inv_t, vocab_size: int, ops=None, a=None):
    """Merges split partials [N, n_split] in ascending order -> (logp, lse) [N].

    Global max first, then S = fl(S + fl(S_j * w_j)) over ascending j; see
    oracle.fold for the full statement (ignore_index, bad targets, clamp).
    a: the entropy statistic [N, n_split] of the same splits (or None); given, the same
    scan also folds A = fl(A + rescale_a(A_j, S_j, m_j, M, w_j)) and the result is
    (logp, lse, entropy) (oracle.fold_entropy); S, lse and logp keep their bits.
    """
    ops = XlaOps(opaque_zero(m, s, z_t, targets, inv_t)) if ops is None else ops
    big_m = jnp.max(m, axis=1)
    if a is None:

        def body(acc, cols):
            m_j, s_j = cols
            w = jnp.where(m_j == big_m, jnp.asarray(1.0, F32), pexp(ops.sub(m_j, big_m), ops))
            return ops.add(acc, ops.mul(s_j, w)), None

        acc, _ = lax.scan(body, vma.like(jnp.zeros_like(big_m), m, s), (m.T, s.T))
        entropy = None
    else:

        def body_h(carry, cols):
            acc, acc_a = carry
            m_j, s_j, a_j = cols
            w = jnp.where(m_j == big_m, jnp.asarray(1.0, F32), pexp(ops.sub(m_j, big_m), ops))
            acc_a = ops.add(acc_a, rescale_a(a_j, s_j, m_j, big_m, w, ops))
            return (ops.add(acc, ops.mul(s_j, w)), acc_a), None

        init = vma.like((jnp.zeros_like(big_m), jnp.zeros_like(big_m)), m, s, a)
        (acc, acc_a), _ = lax.scan(body_h, init, (m.T, s.T, a.T))
        entropy = entropy_of(acc, acc_a, ops)
    lse = ops.add(big_m, plog(acc, ops))
    y_t = ftz(ops.mul(ftz(z_t), inv_t))
    d = ops.sub(y_t, lse)
    logp = jnp.where(d > 0, jnp.asarray(0.0, F32), d)
    logp = jnp.where(targets == C.IGNORE_INDEX, jnp.asarray(0.0, F32), logp)
    bad = C.bad_target(targets, vocab_size)
    logp = jnp.where(bad, jnp.asarray(jnp.nan, F32), logp)
    return (logp, lse) if entropy is None else (logp, lse, entropy)
