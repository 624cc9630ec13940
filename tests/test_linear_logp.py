"""linear_logp on the reference backend: determinism, batch invariance, correctness."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import detlogp_jax as dl
from detlogp_jax import oracle as O
from tests.helpers import assert_bitwise_equal, bits, row_mismatches

D, V, V_REAL = 48, 200, 190  # D and V deliberately not multiples of 64


def _problem(n, seed=0, d=D, v=V, dtype=jnp.bfloat16, scale=1.0):
    rng = np.random.default_rng(seed)
    # numpy arrays (bf16 via ml_dtypes): slicing them in tests compiles nothing
    h = np.asarray(rng.standard_normal((n, d)) * scale).astype(dtype)
    w = np.asarray(rng.standard_normal((v, d)) * 0.5).astype(dtype)
    b = np.asarray(rng.standard_normal(v) * 0.1, np.float32)
    return h, w, b


def _score(h, w, t, **kw):
    kw.setdefault("vocab_size", V_REAL)
    kw.setdefault("backend", "reference")
    return dl.linear_logp(h, w, t, **kw)


@pytest.fixture(scope="module")
def pool():
    """300 rows with targets, temperatures; each scored alone (M=1)."""
    h, w, b = _problem(300, seed=1)
    rng = np.random.default_rng(2)
    t = rng.integers(0, V_REAL, 300).astype(np.int32)
    t[::17] = -100  # ignored rows mixed in
    temp = rng.uniform(0.5, 1.5, 300).astype(np.float32)
    out = _score(h, w, jnp.asarray(t), bias=b, temperature=jnp.asarray(temp))
    alone_lp, alone_lse = [], []
    for i in range(0, 300, 1):
        o = _score(h[i : i + 1], w, jnp.asarray(t[i : i + 1]), bias=b, temperature=jnp.asarray(temp[i : i + 1]))
        alone_lp.append(np.asarray(o.logp)[0])
        alone_lse.append(np.asarray(o.lse)[0])
    return dict(h=h, w=w, b=b, t=t, temp=temp, batch=out, lp=np.array(alone_lp), lse=np.array(alone_lse))


def test_L1_repeat_calls_identical(pool):
    p = pool
    again = _score(p["h"], p["w"], jnp.asarray(p["t"]), bias=p["b"], temperature=jnp.asarray(p["temp"]))
    assert_bitwise_equal(again.logp, p["batch"].logp, "logp repeat")
    assert_bitwise_equal(again.lse, p["batch"].lse, "lse repeat")


def test_L2_alone_equals_in_batch_300(pool):
    assert_bitwise_equal(pool["batch"].logp, pool["lp"], "logp alone vs batch")
    assert_bitwise_equal(pool["batch"].lse, pool["lse"], "lse alone vs batch")


@pytest.mark.slow
def test_L2_every_position_every_batch_size_1_to_257(pool):
    """Row bytes identical alone vs at every position of batches of sizes 1..257,
    with different neighbours each time (rows drawn by a permutation)."""
    p = pool
    rng = np.random.default_rng(3)
    total_rows = 0
    for n in range(1, 258):
        idx = rng.choice(300, size=n, replace=False)
        o = _score(p["h"][idx], p["w"], jnp.asarray(p["t"][idx]), bias=p["b"], temperature=jnp.asarray(p["temp"][idx]))
        rows_lp, mad = row_mismatches(o.logp, p["lp"][idx])
        rows_lse, mad2 = row_mismatches(o.lse, p["lse"][idx])
        assert rows_lp == 0 and rows_lse == 0, f"N={n}: {rows_lp}/{rows_lse} rows differ, max_abs_diff={max(mad, mad2)}"
        total_rows += n
    assert total_rows == 257 * 258 // 2


def test_L2_batch_4096_with_padding_rows(pool):
    p = pool
    rng = np.random.default_rng(4)
    idx = rng.integers(0, 300, 4096)
    t = p["t"][idx].copy()
    pad_rows = rng.choice(4096, 512, replace=False)
    t[pad_rows] = -100  # padding rows
    h = p["h"][idx].copy()
    h[pad_rows] = 0
    o = _score(h, p["w"], jnp.asarray(t), bias=p["b"], temperature=jnp.asarray(p["temp"][idx]))
    live = np.setdiff1d(np.arange(4096), pad_rows)
    assert_bitwise_equal(np.asarray(o.logp)[live], p["lp"][idx][live], "logp in 4096 batch")
    assert_bitwise_equal(np.asarray(o.lse)[live], p["lse"][idx][live], "lse in 4096 batch")
    for pos in (0, 63, 64, 127, 128, 4095):
        if pos in live:
            assert bits(np.asarray(o.logp)[pos]) == bits(p["lp"][idx[pos]])
    assert (np.asarray(o.logp)[pad_rows] == 0).all()


def test_leading_shape_and_jit(pool):
    p = pool
    h = p["h"][:24].reshape(2, 3, 4, D)
    t = jnp.asarray(p["t"][:24].reshape(2, 3, 4))
    temp = jnp.asarray(p["temp"][:24].reshape(2, 3, 4))
    f = jax.jit(lambda h, t, temp: _score(h, p["w"], t, bias=p["b"], temperature=temp))
    o = f(h, t, temp)
    assert o.logp.shape == (2, 3, 4) and o.lse.shape == (2, 3, 4)
    assert_bitwise_equal(np.asarray(o.logp).reshape(-1), p["lp"][:24], "jit + leading dims")


def test_return_logits_does_not_change_bits_and_oracle_agrees(pool):
    p = pool
    t = jnp.asarray(p["t"])
    temp = jnp.asarray(p["temp"])
    serving = _score(p["h"], p["w"], t, bias=p["b"], temperature=temp, return_logits=True)
    assert serving.logits.shape == (300, V_REAL) and serving.logits.dtype == jnp.float32
    assert_bitwise_equal(serving.logp, p["batch"].logp, "serving vs trainer logp")
    assert_bitwise_equal(serving.lse, p["batch"].lse, "serving vs trainer lse")
    # oracle(returned logits) == backend output, bit for bit
    lp, lse = O.logp_lse(
        np.asarray(serving.logits), p["t"], temperature=p["temp"], vocab_size=V_REAL, padded_vocab_size=V
    )
    assert_bitwise_equal(lp, serving.logp, "oracle logp")
    assert_bitwise_equal(lse, serving.lse, "oracle lse")
    # on XLA:CPU the reference logits themselves follow the documented K walk
    if jax.devices()[0].platform == "cpu":
        want = O.reference_logits(np.asarray(p["h"], np.float32), np.asarray(p["w"], np.float32), np.asarray(p["b"]))
        assert_bitwise_equal(serving.logits, want[:, :V_REAL], "reference logits")


def test_unpadded_weight_declared_padded_equals_padded_weights():
    h, w, b = _problem(37, seed=5, v=V_REAL)
    t = jnp.asarray(np.random.default_rng(6).integers(0, V_REAL, 37))
    unpadded = dl.linear_logp(
        h, w, t, vocab_size=V_REAL, padded_vocab_size=256, backend="reference", return_logits=True
    )
    zero_pad = np.concatenate([w, np.zeros((256 - V_REAL, D), w.dtype)])
    garbage = np.concatenate([w, (np.random.default_rng(7).standard_normal((256 - V_REAL, D)) * 1e3).astype(w.dtype)])
    for padded_w in (zero_pad, garbage):
        o = dl.linear_logp(h, padded_w, t, vocab_size=V_REAL, backend="reference", return_logits=True)
        assert_bitwise_equal(o.logp, unpadded.logp, "padded weight logp")
        assert_bitwise_equal(o.lse, unpadded.lse, "padded weight lse")
        assert_bitwise_equal(o.logits, unpadded.logits, "padded weight logits")
    assert dl.last_provenance().padded_vocab_size == 256


def _float64_logp_lse(h, w, b, t, temp, vocab):
    z = np.asarray(h, np.float64) @ np.asarray(w, np.float64).T
    if b is not None:
        z = z + np.asarray(b, np.float64)
    y = z[:, :vocab] / np.asarray(temp, np.float64).reshape(-1, 1)
    mx = y.max(1)
    lse = mx + np.log(np.exp(y - mx[:, None]).sum(1))
    return y[np.arange(len(t)), t] - lse, lse


@pytest.mark.parametrize(
    "dtype,scale,v,vocab,d",
    [
        (jnp.bfloat16, 1.0, 200, 190, 48),
        (jnp.float32, 1.0, 130, 130, 70),
        (jnp.float32, 60.0, 100, 97, 64),  # |z| up to ~600
        (jnp.bfloat16, 1.0, 1, 1, 16),  # V = 1
    ],
)
def test_correct_vs_float64(dtype, scale, v, vocab, d):
    h, w, b = _problem(33, seed=8, d=d, v=v, dtype=dtype, scale=scale)
    t = np.random.default_rng(9).integers(0, vocab, 33)
    temp = 0.7
    o = dl.linear_logp(h, w, jnp.asarray(t), bias=b, temperature=temp, vocab_size=vocab, backend="reference")
    lp64, lse64 = _float64_logp_lse(h, w, b, t, np.full(33, temp), vocab)
    zmax = np.abs(lse64).max()
    assert zmax > (300 if scale > 1 else 0)
    np.testing.assert_allclose(np.asarray(o.lse), lse64, rtol=3e-6, atol=3e-6 * max(1.0, zmax) * 10)
    np.testing.assert_allclose(np.asarray(o.logp), np.minimum(lp64, 0), rtol=1e-5, atol=1e-5 * max(1.0, zmax) * 10)
    if v == 1:
        assert (np.asarray(o.logp) == 0).all()


def test_per_row_temperature_equals_scalar_rows():
    h, w, b = _problem(10, seed=10)
    t = jnp.asarray(np.arange(10))
    o_rows = dl.linear_logp(
        h, w, t, temperature=jnp.full((10,), 0.6, jnp.float32), vocab_size=V_REAL, backend="reference"
    )
    o_scalar = dl.linear_logp(h, w, t, temperature=0.6, vocab_size=V_REAL, backend="reference")
    assert_bitwise_equal(o_rows.logp, o_scalar.logp, "per-row vs scalar temperature")
