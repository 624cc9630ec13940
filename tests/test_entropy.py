"""The per-row entropy (`return_entropy=True`, `linear-logp-entropy-v1`): accuracy, bytes
(batch invariance, padding, flags, oracle), backend capability, no cost when off, and
its gradients (hidden, weight in both layouts, bias, temperature) in the chunked backward."""

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import detlogp_jax as dl
from detlogp_jax import backends, grad, numerics, reference
from detlogp_jax import contract as C
from detlogp_jax import oracle as O
from tests.helpers import assert_bitwise_equal, bits, rel_err, row_mismatches

D, V_ROWS, VOCAB, V_PAD = 16, 200, 190, 256  # padding rows in the weight and beyond it


def _problem(n, seed=0, d=D, v=V_ROWS, dtype=np.float32, scale=1.0):
    rng = np.random.default_rng(seed)
    h = (rng.standard_normal((n, d)) * scale).astype(dtype)
    w = (rng.standard_normal((v, d)) * 0.5).astype(dtype)
    b = (rng.standard_normal(v) * 0.1).astype(np.float32)
    return h, w, b


def _ent(h, w, t=None, **kw):
    kw.setdefault("vocab_size", VOCAB)
    kw.setdefault("backend", "reference")
    t = np.zeros(h.shape[:-1], np.int32) if t is None else t
    return dl.linear_logp(h, w, t, return_entropy=True, **kw)


def _f64_entropy(h, w, b, temp, vocab):
    z = np.asarray(h, np.float64) @ np.asarray(w, np.float64).T
    if b is not None:
        z = z + np.asarray(b, np.float64)
    y = z[:, :vocab] / np.broadcast_to(np.asarray(temp, np.float64), (z.shape[0],))[:, None]
    y_max = np.abs(y).max(1)
    y = y - y.max(1, keepdims=True)
    p = np.exp(y)
    s = p.sum(1)
    return np.log(s) - (p * y).sum(1) / s, y_max


# --- accuracy ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,scale,v,vocab,d",
    [
        (np.float32, 1.0, 200, 190, 48),
        (np.float32, 1.0, 130, 130, 70),
        (np.float32, 0.01, 1000, 1000, 16),  # near-uniform: H close to log V
        (np.float32, 60.0, 100, 97, 64),  # |y| up to ~600, peaked rows (H down to 1e-280)
        (np.float32, 1.0, 1, 1, 16),  # V = 1
        (ml_dtypes.bfloat16, 1.0, 200, 190, 48),
        (ml_dtypes.bfloat16, 20.0, 100, 97, 64),
    ],
)
def test_entropy_matches_float64(dtype, scale, v, vocab, d):
    """f32 inputs: relative error <= 2e-5 (logits of natural size); with huge logits the
    bound is the rounding of the scaled logits themselves, 2^-20 * max|y| absolute.
    bf16 inputs: absolute error <= 2e-3. Always >= 0, and exactly +0 at V = 1."""
    h, w, b = _problem(64, seed=8, d=d, v=v, dtype=dtype, scale=scale)
    temp = np.random.default_rng(9).uniform(0.5, 1.5, 64).astype(np.float32)
    o = _ent(h, w, bias=b, temperature=jnp.asarray(temp), vocab_size=vocab)
    got = np.asarray(o.entropy, np.float64)
    want, y_max = _f64_entropy(h, w, b, temp, vocab)
    assert (got >= 0).all() and np.isfinite(got).all()
    err = np.abs(got - want)
    if dtype == np.float32:
        tol = 2e-5 * want + 1e-7 + (2.0**-20 * y_max if scale > 10 else 0.0)
        assert (err <= tol).all(), (err.max(), (err / np.maximum(want, 1e-30)).max())
    else:
        assert err.max() <= 2e-3, err.max()
    if v == 1:
        assert (bits(o.entropy) == 0).all()  # +0.0 exactly
    assert o.entropy.dtype == jnp.float32 and o.entropy.shape == (64,)


def test_entropy_of_uniform_and_of_a_one_hot_row():
    """All-equal logits: H = log(vocab) to a few ulp; a dominant lane: H = +0 exactly."""
    h = np.zeros((2, D), np.float32)
    w = np.ones((V_ROWS, D), np.float32)
    h[1, 0] = 1.0
    w[7, 0] = 200.0  # row 1: one lane 200 above the others (exp(-200) flushes)
    o = _ent(h, w, padded_vocab_size=V_PAD)
    e = np.asarray(o.entropy)
    assert abs(float(e[0]) - np.log(VOCAB)) <= 4e-7 * np.log(VOCAB)
    assert bits(e[1]) == 0


# --- bytes -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool():
    """300 rows (bf16), mixed per-row temperatures, ignored and bad targets; each row alone."""
    h, w, b = _problem(300, seed=1, dtype=ml_dtypes.bfloat16)
    rng = np.random.default_rng(2)
    t = rng.integers(0, VOCAB, 300).astype(np.int32)
    t[::17] = -100
    t[5::23] = VOCAB + 3  # bad target: NaN logp, the entropy is kept
    temp = rng.uniform(0.5, 1.5, 300).astype(np.float32)
    kw = dict(bias=b, padded_vocab_size=V_PAD)
    batch = _ent(h, w, jnp.asarray(t), temperature=jnp.asarray(temp), **kw)
    alone = np.array(
        [
            np.asarray(_ent(h[i : i + 1], w, t[i : i + 1], temperature=jnp.asarray(temp[i : i + 1]), **kw).entropy)[0]
            for i in range(300)
        ]
    )
    return dict(h=h, w=w, b=b, t=t, temp=temp, kw=kw, batch=batch, alone=alone)


SIZES = sorted(set(range(1, 25)) | set(range(25, 300, 17)) | {127, 128, 129, 255, 256, 257, 299, 300})


@pytest.mark.slow
def test_entropy_alone_equals_in_batches_1_to_300(pool):
    """Every size 1..24, then every 17th up to 300 and the compile-bucket edges (each size
    compiles its own small reshape programs, so all 300 would take a minute)."""
    p = pool
    assert_bitwise_equal(p["batch"].entropy, p["alone"], "entropy alone vs batch of 300")
    rng = np.random.default_rng(3)
    for n in SIZES:
        idx = rng.choice(300, size=n, replace=False)
        o = _ent(p["h"][idx], p["w"], p["t"][idx], temperature=jnp.asarray(p["temp"][idx]), **p["kw"])
        rows, mad = row_mismatches(o.entropy, p["alone"][idx])
        assert rows == 0, f"N={n}: {rows} entropy rows differ, max_abs_diff={mad}"


def test_entropy_in_a_4096_batch_at_odd_positions(pool):
    p = pool
    rng = np.random.default_rng(4)
    idx = rng.integers(0, 300, 4096)
    h = p["h"][idx].copy()
    t = p["t"][idx].copy()
    pad_rows = rng.choice(4096, 512, replace=False)
    h[pad_rows] = 0
    t[pad_rows] = -100
    o = _ent(h, p["w"], jnp.asarray(t), temperature=jnp.asarray(p["temp"][idx]), **p["kw"])
    live = np.setdiff1d(np.arange(4096), pad_rows)
    assert_bitwise_equal(np.asarray(o.entropy)[live], p["alone"][idx][live], "entropy in a 4096 batch")
    odd = live[live % 2 == 1]
    assert odd.size > 1000 and (bits(np.asarray(o.entropy)[odd]) == bits(p["alone"][idx][odd])).all()


def test_ignored_and_bad_target_rows_keep_their_entropy(pool):
    p = pool
    t = p["t"]
    lp = np.asarray(p["batch"].logp)
    assert np.isnan(lp[t >= VOCAB]).all() and (lp[t == -100] == 0).all()
    other = np.zeros_like(t)  # the same rows with ordinary targets: the entropy does not depend on them
    o = _ent(p["h"], p["w"], other, temperature=jnp.asarray(p["temp"]), **p["kw"])
    assert_bitwise_equal(o.entropy, p["batch"].entropy, "entropy vs targets")
    assert np.isfinite(np.asarray(p["batch"].entropy)).all()


def test_per_row_temperatures_equal_scalar_runs(pool):
    p = pool
    for temp in (0.6, 1.0, 1.37):
        scalar = _ent(p["h"][:40], p["w"], p["t"][:40], temperature=temp, **p["kw"])
        rows = _ent(p["h"][:40], p["w"], p["t"][:40], temperature=jnp.full((40,), temp, jnp.float32), **p["kw"])
        assert_bitwise_equal(rows.entropy, scalar.entropy, f"per-row vs scalar T={temp}")


def test_flags_change_no_byte_of_the_others(pool):
    p = pool
    h, w, t, temp = p["h"][:50], p["w"], jnp.asarray(p["t"][:50]), jnp.asarray(p["temp"][:50])
    outs = {}
    for logits in (False, True):
        for ent in (False, True):
            outs[logits, ent] = dl.linear_logp(
                h,
                w,
                t,
                temperature=temp,
                vocab_size=VOCAB,
                backend="reference",
                return_logits=logits,
                return_entropy=ent,
                **p["kw"],
            )
    base = outs[False, False]
    assert base.entropy is None and base.provenance.entropy_id is None
    for (logits, ent), o in outs.items():
        assert_bitwise_equal(o.logp, base.logp, f"logp logits={logits} entropy={ent}")
        assert_bitwise_equal(o.lse, base.lse, f"lse logits={logits} entropy={ent}")
        if logits:
            assert_bitwise_equal(o.logits, outs[True, False].logits, f"logits entropy={ent}")
        if ent:
            assert_bitwise_equal(o.entropy, outs[False, True].entropy, f"entropy logits={logits}")
            assert o.provenance.entropy_id == C.ENTROPY_ID
        else:
            assert o.entropy is None


def test_garbage_in_padded_weight_rows_changes_no_entropy_byte():
    h, w, b = _problem(37, seed=5)
    t = np.random.default_rng(6).integers(0, VOCAB, 37).astype(np.int32)
    clean = _ent(h, w[:VOCAB], t, bias=b[:VOCAB], padded_vocab_size=V_PAD, return_logits=True)
    rng = np.random.default_rng(7)
    for fill in ("huge", "nan"):
        wd = np.concatenate([w[:VOCAB], np.zeros((V_PAD - VOCAB, D), np.float32)])
        bd = np.concatenate([b[:VOCAB], np.zeros(V_PAD - VOCAB, np.float32)])
        if fill == "huge":
            wd[VOCAB:] = rng.standard_normal((V_PAD - VOCAB, D)) * 1e30
            bd[VOCAB:] = 1e38
        else:
            wd[VOCAB:] = np.nan
            bd[VOCAB:] = np.nan
        dirty = _ent(h, wd, t, bias=bd, return_logits=True)
        assert_bitwise_equal(dirty.entropy, clean.entropy, f"entropy with {fill} padding rows")
        assert_bitwise_equal(dirty.lse, clean.lse, f"lse with {fill} padding rows")


@pytest.mark.slow
def test_oracle_entropy_from_the_backends_logits_is_bit_exact():
    """oracle.entropy(returned logits) == the backend's entropy, bit for bit: bias (with a
    -inf lane: a masked token), padding, per-row temperatures, the [D, V] layout, V = 1."""
    h, w, b = _problem(45, seed=11)
    b[[3, 150]] = -np.inf
    temp = np.random.default_rng(12).uniform(0.3, 2.0, 45).astype(np.float32)
    t = np.random.default_rng(13).integers(0, VOCAB, 45).astype(np.int32)
    cases = [
        dict(h=h, w=w, bias=b, temperature=jnp.asarray(temp), vocab_size=VOCAB, padded_vocab_size=V_PAD),
        dict(h=h, w=w, temperature=0.7, vocab_size=V_ROWS),
        dict(h=h, w=w[:1], temperature=1.3, vocab_size=1),
        dict(h=h * 40, w=w, bias=b, temperature=jnp.asarray(temp), vocab_size=VOCAB, padded_vocab_size=4096),
    ]
    for i, c in enumerate(cases):
        hh, ww = c.pop("h"), c.pop("w")
        vd, dv = (
            dl.linear_logp(
                hh, wl, t, return_logits=True, return_entropy=True, backend="reference", weight_layout=lay, **c
            )
            for wl, lay in ((ww, "vd"), (np.ascontiguousarray(ww.T), "dv"))
        )
        for x, y, what in zip(vd, dv, ("logp", "lse", "logits")):
            assert_bitwise_equal(x, y, f"case {i}: dv {what}")
        assert_bitwise_equal(vd.entropy, dv.entropy, f"case {i}: dv entropy")
        kw = dict(
            temperature=np.asarray(c["temperature"]),
            vocab_size=c["vocab_size"],
            padded_vocab_size=c.get("padded_vocab_size", ww.shape[0]),
        )
        lp, lse, ent = O.logp_lse_entropy(np.asarray(vd.logits), t, **kw)
        assert_bitwise_equal(lp, vd.logp, f"case {i} logp")
        assert_bitwise_equal(lse, vd.lse, f"case {i} lse")
        assert_bitwise_equal(ent, vd.entropy, f"case {i} oracle entropy")
        assert np.isfinite(np.asarray(vd.entropy)).all()
    # oracle.entropy (no targets) is the same function
    assert_bitwise_equal(O.entropy(np.asarray(vd.logits), **kw), vd.entropy, "oracle.entropy")


def test_oracle_partials_fold_pieces_agree_with_numerics():
    """The JAX chain and fold (numerics, via the reference backend) equal the oracle's on
    multi-tile chains (V_pad = 19200: 264 splits of 1-2 tiles) with a max that moves from
    tile to tile, scattered -inf lanes, all-padding splits (m = -inf) and row 2 at V = 1
    scale; A <= 0 and the entropy >= 0 everywhere."""
    rng = np.random.default_rng(14)
    v_pad, vocab = 19200, 18000  # the last splits are all padding
    z = (rng.standard_normal((6, v_pad)) * 2).astype(np.float32)
    z[0] += np.linspace(0, 40, v_pad, dtype=np.float32)  # the running max moves in every tile
    z[1] -= np.linspace(0, 40, v_pad, dtype=np.float32)  # it never moves after the first
    z[2, ::3] = -np.inf  # masked tokens (never a whole tile)
    z[3] *= 50
    inv_t = O.inv_temperature(rng.uniform(0.5, 1.5, 6).astype(np.float32), 6)
    m, s, a = O.split_partials(z, vocab, v_pad, inv_t, return_entropy=True)
    plan = C.split_bounds(v_pad)
    assert plan.max_tiles_per_split == 2 and np.isneginf(m[:, -1]).all()
    assert (a <= 0).all()
    want = O.fold_entropy(m, s, a)
    _, _, got = numerics.fold(
        jnp.asarray(m),
        jnp.asarray(s),
        jnp.zeros(6),
        jnp.zeros(6, jnp.int32),
        jnp.asarray(inv_t),
        vocab,
        a=jnp.asarray(a),
    )
    assert_bitwise_equal(got, want, "fold entropy")
    assert (np.asarray(want) >= 0).all() and np.isfinite(want).all()
    # the same through the reference backend's own chain: hidden = I picks the logits as weight
    # rows (-inf as -1e30 there: 0 * -inf would be NaN in the GEMM)
    z = np.where(np.isneginf(z), np.float32(-1e30), z)
    w = np.ascontiguousarray(z.T)  # [V_pad, 6]: row c of W is column c of z
    o = dl.linear_logp(
        np.eye(6, dtype=np.float32),
        w,
        np.zeros(6, np.int32),
        temperature=jnp.asarray(1 / inv_t),
        vocab_size=vocab,
        backend="reference",
        return_entropy=True,
        return_logits=True,
    )
    assert_bitwise_equal(o.logits, z[:, :vocab], "identity logits")
    kw = dict(temperature=1 / inv_t, vocab_size=vocab, padded_vocab_size=v_pad)
    assert_bitwise_equal(o.entropy, O.entropy(z, **kw), "reference chain entropy")


def test_nan_row_is_row_local():
    h, w, b = _problem(9, seed=15)
    ok = _ent(h, w, bias=b)
    h2 = h.copy()
    h2[2, 5] = np.nan
    h2[6, 0] = np.inf
    bad = _ent(h2, w, bias=b)
    keep = [0, 1, 3, 4, 5, 7, 8]
    assert_bitwise_equal(np.asarray(bad.entropy)[keep], np.asarray(ok.entropy)[keep], "other rows")
    assert np.isnan(np.asarray(bad.entropy)[2])


def test_empty_batch_and_leading_dims():
    h, w, b = _problem(24, seed=16)
    o = _ent(h[:0], w)
    assert o.entropy.shape == (0,)
    flat = _ent(h, w, bias=b, temperature=0.9)
    o3 = jax.jit(lambda h: _ent(h, w, np.zeros((2, 3, 4), np.int32), bias=b, temperature=0.9).entropy)(
        h.reshape(2, 3, 4, D)
    )
    assert o3.shape == (2, 3, 4)
    assert_bitwise_equal(np.asarray(o3).reshape(-1), flat.entropy, "leading dims under jit")


# --- capability and cost --------------------------------------------------------------


def _no_entropy_backend():
    ref = backends.get("reference")
    return backends.Backend(
        name="noent",
        contract_bearing=True,
        available=lambda: True,
        supports=lambda h, w: (True, ""),
        partials=ref.partials,
        fold=ref.fold,
        layouts=ref.layouts,
        description="a contract backend that does not declare the entropy (test double)",
    )


def test_a_backend_without_the_entropy_refuses_and_auto_falls_back(monkeypatch, fresh_traces):
    monkeypatch.setitem(backends._REGISTRY, "noent", _no_entropy_backend)
    monkeypatch.delitem(backends._LOADED, "noent", raising=False)
    assert backends.Backend.__dataclass_fields__["entropy"].default is False  # an older plugin refuses
    h, w, _ = _problem(6)
    t = np.zeros(6, np.int32)
    plain = dl.linear_logp(h, w, t, backend="noent")  # without the entropy it serves
    assert plain.provenance.backend == "noent" and not plain.provenance.fallback
    with pytest.raises(dl.BackendUnavailableError, match="does not produce the entropy"):
        dl.linear_logp(h, w, t, backend="noent", return_entropy=True)
    monkeypatch.setenv("DETLOGP_BACKEND", "noent")
    with pytest.raises(dl.BackendUnavailableError, match="does not produce the entropy"):
        dl.linear_logp(h, w, t, return_entropy=True)
    monkeypatch.delenv("DETLOGP_BACKEND")
    monkeypatch.setattr(backends, "preferred", lambda: "noent")
    with pytest.warns(UserWarning, match="auto falls back"):
        out = dl.linear_logp(h, w, t, return_entropy=True)
    assert out.provenance.fallback and out.provenance.backend == "reference"
    assert_bitwise_equal(out.entropy, _ent(h, w, t, vocab_size=V_ROWS).entropy, "fallback entropy")
    assert_bitwise_equal(out.logp, plain.logp, "fallback logp")
    with dl.strict_mode(), pytest.raises(dl.StrictModeError, match="does not produce the entropy"):
        dl.linear_logp(h, w, t, return_entropy=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback without the entropy
        assert dl.linear_logp(h, w, t).provenance.backend == "noent"


def test_every_builtin_backend_declares_the_entropy():
    """pallas_sm90 since its H200 validation (pallas_kernels.backend.ENTROPY_VALIDATED), its
    backward's dz kernel with the entropy term; reference and xla always."""
    be = backends.get("pallas_sm90")
    assert be.entropy is True
    if be.dz is not None:
        assert be.dz.entropy is True
    assert backends.get("reference").entropy and backends.get("xla").entropy


def test_return_entropy_false_traces_no_statistic(monkeypatch, fresh_traces):
    """With return_entropy=False neither the forward nor the gradient trace touches the entropy
    program (its functions raise if called), and the jaxpr is smaller than with it."""
    h, w, b = _problem(5)
    t = jnp.zeros(5, jnp.int32)

    def fwd(h, w, ent):
        return dl.linear_logp(h, w, t, bias=b, vocab_size=VOCAB, backend="reference", return_entropy=ent)[:2]

    def loss(h, w):
        o = dl.linear_logp(h, w, t, bias=b, vocab_size=VOCAB, backend="reference")
        return jnp.sum(o.logp) + jnp.sum(o.lse)

    n_with = len(str(jax.make_jaxpr(lambda h, w: fwd(h, w, True))(h, w)))

    def boom(*a, **k):
        raise AssertionError("the entropy statistic was traced with return_entropy=False")

    for name in ("chain_step_entropy", "rescale_a", "entropy_of"):
        monkeypatch.setattr(numerics, name, boom)
    jax.clear_caches()  # cached traces would run no Python: every trace below is fresh
    n_without = len(str(jax.make_jaxpr(lambda h, w: fwd(h, w, False))(h, w)))
    jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(h, w)
    jax.make_jaxpr(jax.grad(lambda T: dl.linear_logp(h, w, t, temperature=T, backend="reference").lse.sum()))(1.1)
    assert n_without < n_with
    with pytest.raises(AssertionError, match="was traced"):
        jax.make_jaxpr(lambda h, w: fwd(h, w, True))(h, w)


def test_partials_without_the_flag_keep_their_five_outputs():
    h, w, b = _problem(3)
    inv_t = numerics.inv_temperature(jnp.ones(3), 3)
    args = (jnp.asarray(h), jnp.asarray(w), jnp.asarray(b), jnp.zeros(3, jnp.int32), inv_t)
    kw = dict(vocab_size=VOCAB, padded_vocab_size=V_PAD)
    assert len(reference.partials(*args, **kw)) == 5
    six = reference.partials(*args, return_entropy=True, **kw)
    assert len(six) == 6 and six[5].shape == six[1].shape
    for x, y in zip(reference.partials(*args, **kw)[:2], six[:2]):
        assert_bitwise_equal(x, y, "m/S with and without the statistic")


# --- gradients ---------------------------------------------------------------------------


def _f64_grads(h, w, b, t, temp, vocab, c_lp, c_lse, c_h, layout="vd"):
    """float64 autodiff of sum(c_lp * logp + c_lse * lse + c_h * entropy) w.r.t. (h, w, b, T)."""
    with jax.enable_x64(True):
        h64, w64, b64 = (jnp.asarray(np.asarray(x, np.float32), jnp.float64) for x in (h, w, b))
        t64 = jnp.asarray(np.asarray(temp, np.float32), jnp.float64)

        def f(h, w, b, temp):
            z = (h @ (w.T if layout == "vd" else w) + b)[:, :vocab]
            y = z / jnp.broadcast_to(temp, t.shape)[:, None]
            lse = jax.nn.logsumexp(y, axis=1)
            ent = lse - jnp.sum(jax.nn.softmax(y, axis=1) * y, axis=1)
            live = (t >= 0) & (t < vocab)
            yt = jnp.take_along_axis(y, jnp.clip(t, 0, vocab - 1)[:, None], axis=1)[:, 0]
            return jnp.sum(jnp.where(live, yt - lse, 0.0) * c_lp + lse * c_lse + ent * c_h)

        return [np.asarray(g) for g in jax.grad(f, argnums=(0, 1, 2, 3))(h64, w64, b64, t64)]


@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("mix", ["entropy", "mixed"])
def test_gradients_of_the_entropy_match_float64(layout, mix):
    """d/d(hidden, weight, bias, T) of sum(c_H * entropy) and of a mixed loss (logp + lse +
    entropy) vs float64 autodiff: relative error <= 1e-4 with f32 inputs, per-row
    temperatures, ignored and bad targets, padding rows; deterministic run to run."""
    n = 23
    h, w, b = _problem(n, seed=21, v=V_PAD)
    rng = np.random.default_rng(22)
    t = rng.integers(0, VOCAB, n).astype(np.int32)
    t[2], t[5] = -100, VOCAB + 1
    temp = jnp.asarray(rng.uniform(0.6, 1.4, n).astype(np.float32))
    c_h = rng.standard_normal(n).astype(np.float32)
    c_lp = rng.standard_normal(n).astype(np.float32) if mix == "mixed" else np.zeros(n, np.float32)
    c_lse = rng.standard_normal(n).astype(np.float32) if mix == "mixed" else np.zeros(n, np.float32)
    wl = w if layout == "vd" else np.ascontiguousarray(w.T)

    def loss(h, w, b, temp):
        o = dl.linear_logp(
            h,
            w,
            t,
            bias=b,
            temperature=temp,
            vocab_size=VOCAB,
            backend="reference",
            weight_layout=layout,
            return_entropy=True,
        )
        return jnp.sum(jnp.nan_to_num(o.logp) * c_lp) + jnp.sum(o.lse * c_lse) + jnp.sum(o.entropy * c_h)

    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    got = g(jnp.asarray(h), jnp.asarray(wl), jnp.asarray(b), temp)
    want = _f64_grads(h, wl, b, t, temp, VOCAB, c_lp, c_lse, c_h, layout)
    for x, e, name in zip(got, want, ("hidden", "weight", "bias", "temperature")):
        assert np.asarray(x).shape == e.shape, name
        assert rel_err(x, e) <= 1e-4, (name, rel_err(x, e))
    v_axis = 0 if layout == "vd" else 1
    assert np.abs(np.take(np.asarray(got[1]), np.arange(VOCAB, V_PAD), axis=v_axis)).max() == 0
    again = g(jnp.asarray(h), jnp.asarray(wl), jnp.asarray(b), temp)
    for x, y in zip(got, again):
        assert_bitwise_equal(np.asarray(x, np.float32), np.asarray(y, np.float32), "gradient repeat")


def test_entropy_gradient_bf16_inputs():
    n = 12
    h, w, b = _problem(n, seed=23, dtype=ml_dtypes.bfloat16)
    t = np.random.default_rng(24).integers(0, VOCAB, n).astype(np.int32)
    c_h = np.random.default_rng(25).standard_normal(n).astype(np.float32)

    def loss(h, w, b):
        o = dl.linear_logp(h, w, t, bias=b, temperature=0.8, vocab_size=VOCAB, backend="reference", return_entropy=True)
        return jnp.sum(o.entropy * c_h)

    got = jax.grad(loss, argnums=(0, 1, 2))(jnp.asarray(h), jnp.asarray(w), jnp.asarray(b))
    want = _f64_grads(h, w, b, t, np.float32(0.8), VOCAB, 0.0, 0.0, c_h)
    for x, e in zip(got, want[:3]):
        assert rel_err(x, e) <= 1e-2


def test_an_unused_entropy_adds_nothing_to_the_gradient():
    """return_entropy=True with a loss on logp/lse only: the same gradient bytes as without."""
    h, w, b = _problem(10, seed=26)
    t = np.random.default_rng(27).integers(0, VOCAB, 10).astype(np.int32)

    def loss(h, w, ent):
        o = dl.linear_logp(h, w, t, bias=b, vocab_size=VOCAB, backend="reference", return_entropy=ent)
        return jnp.sum(jnp.nan_to_num(o.logp)) + 0.5 * jnp.sum(o.lse)

    a = jax.grad(lambda h, w: loss(h, w, False), argnums=(0, 1))(h, w)
    c = jax.grad(lambda h, w: loss(h, w, True), argnums=(0, 1))(h, w)
    for x, y in zip(a, c):
        assert_bitwise_equal(x, y, "gradient with an unused entropy")


def _fake_dz(declares_entropy, calls):
    """A DzKernel test double in XLA (f32): dz = c1 p + c2 onehot (+ c3 p (lp + h))."""

    def fn(hp, w_c, b_c, t_c, inv_t, lse, c1, c2, lo, hi, weight_layout, c3=None, h=None):
        calls.append(c3 is not None)
        z = jnp.einsum("nd,vd->nv", hp, w_c, precision=jax.lax.Precision.HIGHEST)
        if b_c is not None:
            z = z + b_c[None, :]
        cols = jnp.arange(w_c.shape[0])
        live = (cols >= lo) & (cols < hi)
        lp = z * inv_t[:, None] - lse[:, None]
        p = jnp.where(live[None, :], jnp.exp(lp), 0.0)
        onehot = ((cols[None, :] == t_c[:, None]) & live[None, :]).astype(jnp.float32)
        dz = c1[:, None] * p + c2[:, None] * onehot
        if c3 is not None:
            dz = dz + c3[:, None] * p * jnp.where(p > 0, lp + h[:, None], 0.0)
        return jnp.where(live[None, :], dz, 0.0)

    return backends.DzKernel(fn=fn, supports=lambda h, w, chunk, layout: True, row_multiple=8, entropy=declares_entropy)


@pytest.fixture
def fresh_traces():
    """jit caches cleared before and after: a monkeypatched backend is traced anew and no
    cached trace of it outlives the test."""
    jax.clear_caches()
    yield
    jax.clear_caches()


@pytest.mark.slow
@pytest.mark.parametrize("declares", [False, True])
def test_a_dz_kernel_gets_the_entropy_term_only_if_it_declares_it(monkeypatch, fresh_traces, declares):
    calls = []
    ref = backends.get("reference")
    fake = backends.Backend(**{**ref.__dict__, "dz": _fake_dz(declares, calls)})
    monkeypatch.setitem(backends._LOADED, "reference", fake)
    n = 11
    h, w, b = _problem(n, seed=28)
    t = np.random.default_rng(29).integers(0, VOCAB, n).astype(np.int32)
    c_h = np.random.default_rng(30).standard_normal(n).astype(np.float32)

    def loss(h, w, b, c):
        o = dl.linear_logp(h, w, t, bias=b, temperature=0.9, vocab_size=VOCAB, backend="reference", return_entropy=True)
        return jnp.sum(jnp.nan_to_num(o.logp)) + jnp.sum(o.entropy * c)

    got = jax.grad(loss, argnums=(0, 1, 2))(jnp.asarray(h), jnp.asarray(w), jnp.asarray(b), c_h)
    assert calls == ([True] if declares else []), calls  # without the flag: the XLA-formed path
    want = _f64_grads(h, w, b, t, np.float32(0.9), VOCAB, 1.0, 0.0, c_h)
    for x, e in zip(got, want[:3]):
        assert rel_err(x, e) <= 1e-4
    calls.clear()
    jax.grad(lambda h: jnp.sum(jnp.nan_to_num(dl.linear_logp(h, w, t, backend="reference").logp)))(jnp.asarray(h))
    assert calls == [False]  # no entropy cotangent: the kernel serves as before


def test_backward_refuses_an_entropy_cotangent_without_the_entropy():
    h, w, _ = _problem(3)
    z = jnp.zeros(3)
    with pytest.raises(ValueError, match="forward's entropy"):
        grad.backward(h, w, None, jnp.zeros(3, jnp.int32), z + 1, z, z, z, None, vocab_size=VOCAB, g_entropy=z)


def test_contract_doc_states_the_entropy_program():
    import os

    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "CONTRACT.md")).read()
    assert f"`{C.ENTROPY_ID}`" in doc and C.ENTROPY_ID == "linear-logp-entropy-v1"
    for line in (
        "u[c]  = (e[c] == 0) ? +0 : fl(e[c] * d[c])",
        "A     = fl( resc(A, S, m, m', alpha) + tree64(u) )",
        "A = fl( A + resc(A_j, S_j, m_j, M, w_j) )",
        "h       = fl( plog(S) - fl( A * rcp(S) ) )",
        "entropy = (h < 0) ? +0 : h",
        "= fl( w * fl( A + fl( fl(m - m') * S ) ) )",
    ):
        assert line in doc, line
    assert C.contract_constants()["ENTROPY"]["id"] == C.ENTROPY_ID


@pytest.mark.slow
def test_a_fused_forward_serves_the_unsharded_head_with_the_same_bytes(monkeypatch, fresh_traces):
    """A contract backend's `fused_forward` (fold(partials(...)) in one call) is what the op core
    calls for an unsharded head, forward and residual backward, with the arguments partials gets;
    a backend without it is served by partials + fold; both give the same bytes."""
    calls = []
    ref = backends.get("reference")

    def fused(hidden, weight, bias, targets, inv_t, **kw):
        calls.append(sorted(kw))
        parts = ref.partials(hidden, weight, bias, targets, inv_t, **kw)
        a = parts[5] if kw.get("return_entropy") else None
        out = ref.fold(*parts[:3], targets, inv_t, kw["vocab_size"], a=a)
        return out[0], out[1], parts[4], (out[2] if a is not None else None)

    n = 9
    h, w, b = _problem(n, seed=31)
    t = np.random.default_rng(32).integers(0, VOCAB, n).astype(np.int32)
    call = lambda **kw: dl.linear_logp(h, w, t, bias=b, temperature=0.8, vocab_size=VOCAB, backend="reference", **kw)
    want = [call(return_entropy=True, return_logits=True), call()]
    monkeypatch.setitem(backends._LOADED, "reference", backends.Backend(**{**ref.__dict__, "fused_forward": fused}))
    jax.clear_caches()  # a cached trace would run no Python
    got = [call(return_entropy=True, return_logits=True), call()]
    assert len(calls) == 2 and "padded_vocab_size" in calls[0] and "return_entropy" in calls[0], calls
    for g, e in zip(got, want):
        for name in ("logp", "lse", "entropy", "logits"):
            if getattr(e, name) is not None:
                assert_bitwise_equal(np.asarray(getattr(g, name)), np.asarray(getattr(e, name)), name)
    assert got[1].entropy is None and got[1].logits is None
    grad_of = lambda: jax.grad(lambda h: jnp.sum(jnp.nan_to_num(call(residuals="logits").logp)))(jnp.asarray(h))
    g_fused = grad_of()
    assert len(calls) == 3
    monkeypatch.setitem(backends._LOADED, "reference", ref)
    jax.clear_caches()
    assert_bitwise_equal(np.asarray(g_fused), np.asarray(grad_of()), "residual-mode dh")
    assert backends.get("reference").fused_forward is None
