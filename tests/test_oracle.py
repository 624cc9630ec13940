"""The numpy oracle: rounding primitives vs exact rationals, exp/log accuracy, trees."""

from fractions import Fraction

import numpy as np
import pytest

from detlogp_jax import contract as C
from detlogp_jax import oracle as O
from tests.helpers import bits

F32 = np.float32
MIN_NORMAL = Fraction(2) ** -126


def round_f32_ftz(q: Fraction) -> np.float32:
    """Correct round-to-nearest-even of an exact rational to binary32, then FTZ."""
    if q == 0:
        return F32(0.0)
    sign = -1 if q < 0 else 1
    a = abs(q)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    e = max(e, -126)  # subnormal quantum below
    quantum = Fraction(2) ** (e - 23)
    n = a / quantum
    fl = n.numerator // n.denominator
    rem = n - fl
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and fl % 2 == 1):
        fl += 1
    val = fl * quantum
    if val >= Fraction(2) ** 128:
        return F32(sign * np.inf)
    if val < MIN_NORMAL:  # FTZ: subnormal results flush to signed zero
        return F32(-0.0) if sign < 0 else F32(0.0)
    return F32(sign * float(val))


def _samples(rng, n):
    kinds = [
        rng.standard_normal(n),
        rng.standard_normal(n) * 1e30,
        rng.standard_normal(n) * 1e-30,
        rng.standard_normal(n) * 2.0**-120,  # near the subnormal range
        rng.integers(-5, 5, n).astype(np.float64),
    ]
    return np.concatenate(kinds).astype(F32)


@pytest.mark.parametrize(
    "op,exact",
    [
        (O.f_add, lambda a, b: a + b),
        (O.f_sub, lambda a, b: a - b),
        (O.f_mul, lambda a, b: a * b),
        (O.f_div, lambda a, b: a / b),
    ],
)
def test_rounded_primitives_match_exact_rationals(op, exact):
    rng = np.random.default_rng(0)
    a = _samples(rng, 400)
    b = rng.permutation(_samples(rng, 400))
    out = op(a, b)
    for x, y, got in zip(a, b, out):
        xf, yf = O.ftz(x), O.ftz(y)  # DAZ on inputs
        if op is O.f_div and yf == 0:
            continue
        want = round_f32_ftz(exact(Fraction(float(xf)), Fraction(float(yf))))
        if want == 0 and got == 0:
            continue  # the sign of an exact zero sum is IEEE's; checked below
        assert bits(got) == bits(want), (x, y, got, want)


def test_ftz_flushes_subnormals_with_sign():
    x = np.array([1e-40, -1e-40, 2.0**-126, -(2.0**-126), 0.0], F32)
    got = O.ftz(x)
    assert list(bits(got)) == list(bits(np.array([0.0, -0.0, 2.0**-126, -(2.0**-126), 0.0], F32)))
    assert O.f_mul(F32(1e-20), F32(1e-20)) == 0  # subnormal product flushes
    assert O.f_mul(F32(1e-40), F32(2.0**30)) == 0  # subnormal input is zero (DAZ)


def _ulp_err(got, want64):
    got = got.astype(np.float64)
    ulp = np.spacing(np.abs(want64).astype(F32)).astype(np.float64)
    return np.abs(got - want64) / ulp


def test_pexp_accuracy_and_specials():
    rng = np.random.default_rng(1)
    x = np.concatenate([-rng.uniform(0, 87, 200_000), -rng.uniform(0, 1, 200_000), -np.linspace(0, 1e-4, 1001)]).astype(
        F32
    )
    want = np.exp(x.astype(np.float64))
    keep = want >= 2.0**-125
    err = _ulp_err(O.pexp(x)[keep], want[keep])
    assert err.max() <= 1.2, err.max()
    sp = O.pexp(np.array([0.0, -0.0, -np.inf, np.nan, -200.0, -104.0], F32))
    assert sp[0] == 1.0 and sp[1] == 1.0 and sp[2] == 0.0 and np.isnan(sp[3]) and sp[4] == 0.0 and sp[5] == 0.0
    # results below 2**-125 flush to +0 (k < -125)
    assert O.pexp(F32(-87.0)) == 0.0 and O.pexp(F32(-86.0)) > 0


def test_plog_accuracy_and_specials():
    rng = np.random.default_rng(2)
    s = np.concatenate(
        [rng.uniform(1, 3e5, 200_000), rng.uniform(0.5, 2, 200_000), 2.0 ** np.arange(-100, 100)]
    ).astype(F32)
    want = np.log(s.astype(np.float64))
    nz = want != 0
    err = _ulp_err(O.plog(s)[nz], want[nz])
    assert err.max() <= 1.5, err.max()
    sp = O.plog(np.array([1.0, 0.0, np.inf, -1.0, np.nan], F32))
    assert (
        bits(sp[0]) == bits(F32(0.0)) and sp[1] == -np.inf and sp[2] == np.inf and np.isnan(sp[3]) and np.isnan(sp[4])
    )


def test_tree64_is_adjacent_pairwise():
    # Values chosen so that different association orders give different sums.
    e = np.zeros(64, F32)
    e[0], e[1], e[2] = F32(1e8), F32(1.0), F32(-1e8)
    e[3:] = F32(0.5)
    # adjacent pairwise: (1e8+1) + (-1e8+0.5) -> ...; sequential sum differs
    seq = F32(0)
    for v in e:
        seq = F32(seq + v)
    want = e.copy()
    while want.size > 1:
        want = (want[0::2] + want[1::2]).astype(F32)
    assert bits(O.tree64(e)) == bits(want[0])
    assert bits(O.tree64(e)) != bits(seq)


def test_oracle_matches_float64_logsumexp():
    rng = np.random.default_rng(3)
    for scale, v in ((1.0, 1000), (600.0, 333), (1.0, 1), (50.0, 64)):
        z = (rng.standard_normal((16, v)) * scale).astype(F32)
        t = rng.integers(0, v, 16)
        logp, lse = O.logp_lse(z, t, temperature=0.9, vocab_size=v, padded_vocab_size=v)
        y = z.astype(np.float64) * np.float64(O.inv_temperature(0.9, 1)[0])
        mx = y.max(1)
        lse64 = mx + np.log(np.exp(y - mx[:, None]).sum(1))
        np.testing.assert_allclose(lse, lse64, rtol=2e-6, atol=2e-6)
        np.testing.assert_allclose(
            logp, np.minimum(y[np.arange(16), t] - lse64, 0), rtol=2e-6, atol=5e-5 * max(1, scale / 10)
        )


def test_oracle_padding_and_targets():
    rng = np.random.default_rng(4)
    z = rng.standard_normal((4, 130)).astype(F32)
    t = np.array([0, 99, -100, 100])  # vocab_size = 100: last is a bad target
    lp, lse = O.logp_lse(z, t, vocab_size=100, padded_vocab_size=192)
    z2 = z.copy()
    z2[:, 100:] = 1e30  # padding lanes never matter
    lp2, lse2 = O.logp_lse(z2, t, vocab_size=100, padded_vocab_size=192)
    assert (bits(lp[:3]) == bits(lp2[:3])).all() and (bits(lse) == bits(lse2)).all()
    assert lp[2] == 0.0 and np.isnan(lp[3]) and np.isfinite(lse).all()


def test_fma_emulation_matches_exact_rationals():
    rng = np.random.default_rng(5)
    a, b, c = (_samples(rng, 300) for _ in range(3))
    c = rng.permutation(c)
    # hard cases: c cancels most of a*b, so the low product bits decide the rounding
    a2 = rng.standard_normal(2000).astype(F32)
    b2 = rng.standard_normal(2000).astype(F32)
    c2 = (-(a2.astype(np.float64) * b2)).astype(F32)
    for x, y, z in ((a, b, c), (a2, b2, c2)):
        got = O.f_fma(x, y, z)
        for xi, yi, zi, gi in zip(x, y, z, got):
            xf, yf, zf = (Fraction(float(O.ftz(v))) for v in (xi, yi, zi))
            want = round_f32_ftz(xf * yf + zf)
            if want == 0 and gi == 0:
                continue
            assert bits(gi) == bits(want), (xi, yi, zi, gi, want)


def test_contraction_would_change_the_exp_and_be_caught():
    """Negative control: an exp whose Horner steps were contracted into FMAs (what
    LLVM does to XLA code without the pin) differs from the contract's pexp."""
    x = -np.random.default_rng(6).uniform(0, 20, 20000).astype(F32)

    def pexp_fma(x):
        xc = np.maximum(x, F32(C.EXP_CLAMP_LO)).astype(F32)
        t = O.f_mul(xc, F32(C.EXP_LOG2E))
        tm = O.f_add(t, F32(C.EXP_ROUND_MAGIC))
        k = O.f_sub(tm, F32(C.EXP_ROUND_MAGIC))
        ki = tm.view(np.int32) - np.int32(C.EXP_ROUND_MAGIC_BITS)
        r = O.f_fma(-k, F32(C.EXP_LN2_LO), O.f_fma(-k, F32(C.EXP_LN2_HI), xc))
        p = np.full_like(r, F32(C.EXP_POLY[0]))
        for c in C.EXP_POLY[1:]:
            p = O.f_fma(p, r, F32(c))
        return (p.view(np.int32) + (ki << np.int32(23))).view(F32)

    differ = (bits(pexp_fma(x)) != bits(O.pexp(x))).mean()
    assert differ > 0.05, differ  # a contracted program is visibly not the contract


def test_reciprocal_rn_is_ieee_division_bitwise():
    """numerics.reciprocal_rn (integer-only fl(1/T), what inv_temperature uses on every backend)
    equals the oracle's IEEE division with FTZ on every mantissa of several exponents and on the
    specials. (XLA:GPU's own f32 division is not correctly rounded; see the function's docstring.)"""
    import jax
    import jax.numpy as jnp

    from detlogp_jax import numerics

    f = jax.jit(numerics.reciprocal_rn)
    for be in (1, 100, 126, 127, 128, 252, 253, 254):
        bits = (np.uint32(be) << 23) | np.arange(1 << 23, dtype=np.uint32)
        t = bits.view(np.float32)
        got = np.asarray(f(jnp.asarray(t)))
        want = O.f_div(np.float32(1.0), t)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), be
    sp = np.array([0.0, -0.0, np.inf, -np.inf, 1e-40, -1e-40, 1.0, -3.0, 2.0**127, 3e38, 1.17549435e-38], np.float32)
    got = np.asarray(f(jnp.asarray(sp)))
    assert np.array_equal(got.view(np.uint32), O.f_div(np.float32(1.0), sp).view(np.uint32))
    assert np.isnan(np.asarray(f(jnp.asarray([np.nan], jnp.float32)))[0])
    rng = np.random.default_rng(3)
    temp = rng.uniform(0.05, 4.0, 4096).astype(np.float32)
    assert np.array_equal(
        np.asarray(numerics.inv_temperature(jnp.asarray(temp), 4096)).view(np.uint32),
        O.inv_temperature(temp, 4096).view(np.uint32),
    )


def test_entropy_statistic_is_the_rescaled_sum_and_leaves_m_s_alone():
    """split_partials(return_entropy=True): m and S are the bytes of the plain call; A is
    sum_c e^(y_c - m) (y_c - m) of each split (float64 of the same y, relative 1e-5) through
    maxima that move within a split, A <= 0; the fold gives log S - A / S of all lanes."""
    rng = np.random.default_rng(7)
    v_pad, vocab = 19200, 19000  # 264 splits of 1-2 tiles
    z = (rng.standard_normal((5, v_pad)) * 3).astype(F32)
    z[0] += np.linspace(0, 30, v_pad, dtype=F32)  # the max moves in every tile
    inv_t = O.inv_temperature(rng.uniform(0.5, 1.5, 5).astype(F32), 5)
    m, s = O.split_partials(z, vocab, v_pad, inv_t)
    m2, s2, a = O.split_partials(z, vocab, v_pad, inv_t, return_entropy=True)
    assert (bits(m) == bits(m2)).all() and (bits(s) == bits(s2)).all() and (a <= 0).all()
    plan = C.split_bounds(v_pad)
    y = O.f_mul(z, inv_t[:, None]).astype(np.float64)
    y[:, vocab:] = -np.inf
    for j in (0, 1, 100, plan.n_split - 10):
        cols = slice(plan.starts[j] * C.TILE_V, plan.ends[j] * C.TILE_V)
        d = y[:, cols] - m[:, j : j + 1].astype(np.float64)
        want = np.where(np.isfinite(d), np.exp(d) * np.where(np.isfinite(d), d, 0), 0).sum(1)
        np.testing.assert_allclose(a[:, j], want, rtol=1e-5, atol=1e-30)
    d = y[:, :vocab] - y[:, :vocab].max(1, keepdims=True)
    p = np.exp(d)
    want_h = np.log(p.sum(1)) - (p * d).sum(1) / p.sum(1)
    np.testing.assert_allclose(O.fold_entropy(m2, s2, a), want_h, rtol=2e-5)


def test_entropy_rescale_rule():
    """resc(A, S, m, m', w): A when the max does not move, +0 for a zero weight (m = -inf:
    no NaN from -inf * 0), else fl(w * fl(A + fl(fl(m - m') * S)))."""
    a, s = np.array([-3.0, 0.0, -3.0, -3.0], F32), np.array([2.0, 0.0, 2.0, 2.0], F32)
    m = np.array([1.0, -np.inf, 1.0, -100.0], F32)
    m_new = np.array([1.0, 5.0, 1.5, 5.0], F32)
    w = np.where(m == m_new, F32(1), O.pexp(O.f_sub(m, m_new))).astype(F32)
    got = O.rescale_a(a, s, m, m_new, w)
    assert got[0] == F32(-3.0) and bits(got[1]) == 0 and bits(got[3]) == 0  # w = pexp(-105) = +0
    want = O.f_mul(w[2], O.f_add(a[2], O.f_mul(O.f_sub(m[2], m_new[2]), s[2])))
    assert bits(got[2]) == bits(want) and abs(float(got[2]) - np.exp(-0.5) * (-3.0 - 0.5 * 2.0)) < 1e-6
