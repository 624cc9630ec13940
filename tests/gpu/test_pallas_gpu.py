"""pallas_sm90 on a real Hopper GPU (skipped elsewhere; see tests/conftest.py).

Quick versions of the ladder's checks (tests/gpu/run_ladder.py runs the full
Qwen3-8B-scale ladder and timings):
* oracle.logp_lse(kernel's own logits) == kernel logp/lse, bit for bit;
* trainer entry (no logits) == serving entry bytes;
* every launch bucket gives the same bytes; a row alone == the row in a batch;
* an unpadded weight + padded_vocab_size == the zero-padded weight.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from detlogp_jax import contract as C
from detlogp_jax import oracle
from tests.helpers import assert_bitwise_equal

pytestmark = pytest.mark.gpu

pk = pytest.importorskip("pallas_kernels")
from pallas_kernels import tuning  # noqa: E402


def _problem(n, d, v, seed=0, bias=True):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((v, d)) * (2.0 / np.sqrt(d)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(v), jnp.float32) if bias else None
    t = rng.integers(0, v, n).astype(np.int32)
    if n > 3:
        t[0], t[1], t[2] = C.IGNORE_INDEX, v - 1, v + 5
    temp = rng.uniform(0.5, 1.5, n).astype(np.float32)
    return h, w, b, t, temp, oracle.inv_temperature(temp, n)


def _entry(h, w, b, t, inv_t, v, vp, **kw):
    m, s, zt, own, lg = pk.partials(
        h, w, b, jnp.asarray(t), jnp.asarray(inv_t), vocab_size=v, padded_vocab_size=vp, **kw
    )
    logp, lse = pk.fold(m, s, zt, jnp.asarray(t), jnp.asarray(inv_t), v)
    return {
        k: (None if x is None else np.asarray(x))
        for k, x in dict(m=m, s=s, z_t=zt, owned=own, logits=lg, logp=logp, lse=lse).items()
    }


SHAPES = [(7, 192, 1001), (130, 320, 50000), (65, 1024, 32000)]


@pytest.mark.parametrize("n,d,v", SHAPES)
def test_oracle_and_entries(n, d, v):
    vp = C.canonical_padded_vocab(v)
    h, w, b, t, temp, inv_t = _problem(n, d, v)
    srv = _entry(h, w, b, t, inv_t, v, vp, return_logits=True)
    trn = _entry(h, w, b, t, inv_t, v, vp)
    rl, rs = oracle.logp_lse(srv["logits"], t, temperature=temp, vocab_size=v, padded_vocab_size=vp)
    assert_bitwise_equal(srv["logp"], rl, "logp vs oracle")
    assert_bitwise_equal(srv["lse"], rs, "lse vs oracle")
    for k in ("m", "s", "z_t", "logp", "lse"):
        assert_bitwise_equal(srv[k], trn[k], f"{k} trainer vs serving")


@pytest.mark.parametrize("n,d,v", SHAPES[:2])
def test_buckets_and_rows_alone(n, d, v):
    vp = C.canonical_padded_vocab(v)
    h, w, b, t, temp, inv_t = _problem(n, d, v, seed=1)
    outs = {bk: _entry(h, w, b, t, inv_t, v, vp, bucket=bk) for bk in sorted(tuning.BUCKETS)}
    first = outs[sorted(outs)[0]]
    for bk, o in outs.items():
        for k in ("m", "s", "logp", "lse"):
            assert_bitwise_equal(o[k], first[k], f"{k} bucket {bk}")
    for r in (0, n // 2, n - 1):
        alone = _entry(h[r : r + 1], w, b, t[r : r + 1], inv_t[r : r + 1], v, vp)
        for k in ("m", "s", "logp", "lse"):
            assert_bitwise_equal(alone[k], first[k][r : r + 1], f"{k} row {r} alone")


def test_unpadded_weight():
    n, d, v = 64, 256, 5000
    vp = C.canonical_padded_vocab(v)
    h, w, b, t, temp, inv_t = _problem(n, d, v, seed=2, bias=False)
    a = _entry(h, w, None, t, inv_t, v, vp, return_logits=True)
    wp = jnp.pad(w, ((0, vp - v), (0, 0)))
    c = _entry(h, wp, None, t, inv_t, v, vp, return_logits=True)
    for k in ("m", "s", "z_t", "logp", "lse"):
        assert_bitwise_equal(a[k], c[k], f"{k} unpadded vs padded")
    assert_bitwise_equal(a["logits"], c["logits"][:, :v], "logits")


def _nan_canonical(x):
    """Bytes with every NaN as one pattern: the GPU's PTX returns the canonical
    NaN where numpy keeps an input's payload (the contract's NaN rows are NaN,
    whatever the payload)."""
    x = np.array(x, np.float32)
    x[np.isnan(x)] = np.float32(np.nan)
    return x


@pytest.mark.parametrize("n_split", [1, 7, 9, 37, 264, 455])
def test_fold_layouts_equal_oracle(n_split):
    """On the GPU the fold's pinned PTX equals oracle.fold bit for bit (NaN
    payloads aside): every knob of sm90_fold (groups of 8, 32 or 64 rows, chunk sizes,
    chain unrolls) on edge rows,
    split counts that are not multiples of the groups or chunks, rows over
    several CTAs; all layouts give the same bytes, NaNs included; a row alone
    gives the bytes it has in the batch."""
    from pallas_kernels import sm90_fold
    from tests.pallas_cases import fold_problem

    n, v = 200, 151936
    m, s, z_t, t, inv_t = fold_problem(n, n_split, v, seed=n_split)
    rl, rs = oracle.fold(m, s, z_t, t, inv_t, v)
    variants = [
        {},
        dict(rows=8),
        dict(chunk=4, unroll=8),
        dict(chunk=128, unroll=n_split),
        dict(rows=64, chunk=6, unroll=5),
    ]
    ref = None
    for knobs in variants:
        if not sm90_fold.staged_fits(n_split, knobs.get("rows", 32)):
            continue
        logp, lse = (np.asarray(x) for x in sm90_fold.fold(m, s, z_t, t, inv_t, v, **knobs))
        assert_bitwise_equal(_nan_canonical(logp), _nan_canonical(rl), f"logp {knobs}")
        assert_bitwise_equal(_nan_canonical(lse), _nan_canonical(rs), f"lse {knobs}")
        if ref is None:
            ref = (logp, lse)
        assert_bitwise_equal(logp, ref[0], f"logp {knobs} vs default")
        assert_bitwise_equal(lse, ref[1], f"lse {knobs} vs default")
    for r in (0, 1, 5, n - 1):  # a row alone == the row in the batch
        logp, lse = sm90_fold.fold(m[r : r + 1], s[r : r + 1], z_t[r : r + 1], t[r : r + 1], inv_t[r : r + 1], v)
        assert_bitwise_equal(np.asarray(logp), ref[0][r : r + 1], f"logp row {r} alone")
        assert_bitwise_equal(np.asarray(lse), ref[1][r : r + 1], f"lse row {r} alone")


@pytest.mark.parametrize("n,d,v", [(7, 192, 1001), (65, 1024, 32000), (600, 512, 32000)])
def test_logits_cols_and_serving_api(n, d, v):
    """logits_cols=vocab (what the serving API asks for): every bucket writes [N, vocab] logits whose
    bytes are the full-width logits' first columns (direct when vocab % 8 == 0), partials unchanged;
    linear_logp(return_logits=True) returns them and its logp/lse are the oracle's of them."""
    from detlogp_jax import linear_logp

    vp = C.canonical_padded_vocab(v)
    h, w, b, t, temp, inv_t = _problem(n, d, v)
    wp = jnp.pad(w, ((0, vp - v), (0, 0)))
    bp = jnp.pad(b, (0, vp - v)) if b is not None else None
    for bk in sorted(tuning.BUCKETS):
        full = _entry(h, wp, bp, t, inv_t, v, vp, return_logits=True, bucket=bk)
        cut = _entry(h, wp, bp, t, inv_t, v, vp, return_logits=True, bucket=bk, logits_cols=v)
        assert cut["logits"].shape == (n, v)
        assert_bitwise_equal(cut["logits"], full["logits"][:, :v], f"logits {bk}")
        for k in ("m", "s", "z_t", "logp", "lse"):
            assert_bitwise_equal(cut[k], full[k], f"{k} {bk}")
    out = linear_logp(
        h,
        wp,
        jnp.asarray(t),
        bias=bp,
        temperature=jnp.asarray(temp),
        vocab_size=v,
        return_logits=True,
        backend="pallas_sm90",
    )
    lg = np.asarray(out.logits)
    assert lg.shape == (n, v)
    rl, rs = oracle.logp_lse(lg, t, temperature=temp, vocab_size=v, padded_vocab_size=vp)
    assert_bitwise_equal(np.asarray(out.logp), rl, "api logp vs oracle")
    assert_bitwise_equal(np.asarray(out.lse), rs, "api lse vs oracle")


def test_inv_temperature_on_device_is_correctly_rounded():
    """The API's fl(1/T) on the GPU equals IEEE division (XLA:GPU's f32 `1 / t` does not:
    ~13% of random T differed on an H200), eagerly and under jit."""
    from detlogp_jax import inputs, numerics

    rng = np.random.default_rng(0)
    t = rng.uniform(0.05, 4.0, 1 << 20).astype(np.float32)
    want = oracle.inv_temperature(t, t.size).view(np.uint32)
    for fn in (lambda x: numerics.inv_temperature(x, t.size), jax.jit(lambda x: inputs.inv_temperature(x, t.size))):
        got = np.asarray(fn(jnp.asarray(t))).view(np.uint32)
        assert int((got != want).sum()) == 0


# --- weight_layout="dv": the Flax/Tunix [D, V] kernel read in place ------------------------------

QWEN_D, QWEN_V_ROWS, QWEN_VOCAB = 4096, 152064, 151936


@functools.lru_cache(maxsize=1)
def _qwen_head():
    """Qwen3-8B lm_head W [152064, 4096] bf16 (zero rows past the vocab), its kernel K = W.T
    materialized as its own [4096, 152064] buffer (before any timed or compared call), and a bias."""
    key = jax.random.key(14)
    kw, kb = jax.random.split(key)
    w = (jax.random.normal(kw, (QWEN_V_ROWS, QWEN_D), jnp.float32) * (2.5 / np.sqrt(QWEN_D))).astype(jnp.bfloat16)
    w = w.at[QWEN_VOCAB:].set(0)
    k = jax.block_until_ready(jax.jit(jnp.transpose)(w))
    b = jax.random.normal(kb, (QWEN_V_ROWS,), jnp.float32)
    return jax.block_until_ready(w), k, b


@jax.jit
def _rows_with_diff(a, b):
    ua, ub = (jax.lax.bitcast_convert_type(x, jnp.uint32) for x in (a, b))
    return jnp.sum(jnp.any(ua != ub, axis=1))


def _rows_differing_on_device(a, b):
    """Rows of two f32 [N, V] arrays whose bytes differ, counted on the GPU (no 2.5 GB host copies)."""
    assert a.shape == b.shape and a.dtype == b.dtype == jnp.float32, (a.shape, b.shape, a.dtype, b.dtype)
    return int(_rows_with_diff(a, b))


@pytest.mark.parametrize("m", [1, 65, 4096])
def test_dv_layout_gives_the_vd_bytes_at_the_qwen_shape(m):
    """linear_logp(h, K, t, weight_layout="dv", backend="pallas_sm90") with K = W.T materialized
    gives the logp / lse / logits bytes of linear_logp(h, W, t) for every bucket forced, without
    and with bias, with per-row temperatures; and the dv call's logp / lse are the oracle's of
    its own logits (the non-transposed wgmma B read must not change a bit)."""
    from detlogp_jax import linear_logp

    w, k, b = _qwen_head()
    rng = np.random.default_rng(m)
    h = jnp.asarray(rng.standard_normal((m, QWEN_D)), jnp.bfloat16)
    t = rng.integers(0, QWEN_VOCAB, m).astype(np.int32)
    if m > 3:
        t[0], t[1], t[2] = C.IGNORE_INDEX, QWEN_VOCAB - 1, 0
    temp = rng.uniform(0.5, 1.5, m).astype(np.float32)
    tj, tempj = jnp.asarray(t), jnp.asarray(temp)
    for bucket in sorted(tuning.BUCKETS):
        for bias in (None, b):
            kw = dict(
                bias=bias,
                temperature=tempj,
                vocab_size=QWEN_VOCAB,
                return_logits=True,
                backend="pallas_sm90",
                tuning={"bucket": bucket},
            )
            vd = linear_logp(h, w, tj, **kw)
            dv = linear_logp(h, k, tj, weight_layout="dv", **kw)
            assert dv.provenance.weight_layout == "dv" and not dv.provenance.fallback
            what = f"M={m} {bucket} bias={bias is not None}"
            for f in ("logp", "lse"):
                assert_bitwise_equal(np.asarray(getattr(dv, f)), np.asarray(getattr(vd, f)), f"{f} dv vs vd {what}")
            bad = _rows_differing_on_device(dv.logits, vd.logits)
            assert bad == 0, f"logits dv vs vd {what}: {bad} rows differ in bytes"
            if bucket == "small":  # the oracle on (up to 64 of) the dv call's own logits
                rows = np.unique(np.linspace(0, m - 1, min(m, 64)).astype(int))
                lg = np.asarray(dv.logits[jnp.asarray(rows)])  # (gathered on the device)
                rl, rs = oracle.logp_lse(
                    lg, t[rows], temperature=temp[rows], vocab_size=QWEN_VOCAB, padded_vocab_size=QWEN_V_ROWS
                )
                assert_bitwise_equal(np.asarray(dv.logp)[rows], rl, f"logp dv vs oracle {what}")
                assert_bitwise_equal(np.asarray(dv.lse)[rows], rs, f"lse dv vs oracle {what}")
            del vd, dv
    # The trainer entry (no logits) reads the kernel in place with the same logp / lse bytes.
    trn = linear_logp(h, k, tj, temperature=tempj, vocab_size=QWEN_VOCAB, backend="pallas_sm90", weight_layout="dv")
    srv = linear_logp(h, w, tj, temperature=tempj, vocab_size=QWEN_VOCAB, backend="pallas_sm90")
    for f in ("logp", "lse"):
        assert_bitwise_equal(np.asarray(getattr(trn, f)), np.asarray(getattr(srv, f)), f"{f} dv trainer M={m}")


# --- the entropy statistic (linear-logp-entropy-v1) in the kernels ------------------------------
# Called through pk.partials(..., return_entropy=True) / pk.fold(..., a=A) directly, not through the
# registry (the H200 validation the registry entry's entropy declaration rests on).


def _same_or_zero_signs(a, b, what):
    """Bitwise equal, except that +0 and -0 count as equal (CONTRACT.md section 9: the sign of a zero
    A never reaches the entropy); NaN == NaN whatever the payload. Returns the zero-sign differences."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    ua, ub = a.view(np.uint32), b.view(np.uint32)
    zero_sign = (ua != ub) & (a == 0) & (b == 0)
    bad = (ua != ub) & ~zero_sign & ~(np.isnan(a) & np.isnan(b))
    assert not bad.any(), f"{what}: {int(bad.reshape(bad.shape[0], -1).any(1).sum())} rows differ in bytes"
    return int(zero_sign.sum())


def _entropy_entry(h, w, b, t, inv_t, *, entropy=True, **kw):
    """pk.partials + pk.fold at the Qwen3-8B head; arrays stay on the device (logits are 2.5 GB at M=4096)."""
    out = pk.partials(
        h, w, b, t, inv_t, vocab_size=QWEN_VOCAB, padded_vocab_size=QWEN_V_ROWS, return_entropy=entropy, **kw
    )
    m, s, zt, own, lg = out[:5]
    res = dict(m=m, s=s, z_t=zt, owned=own, logits=lg)
    if entropy:
        res["a"] = out[5]
        res["logp"], res["lse"], res["entropy"] = pk.fold(m, s, zt, t, inv_t, QWEN_VOCAB, a=out[5])
    else:
        res["logp"], res["lse"] = pk.fold(m, s, zt, t, inv_t, QWEN_VOCAB)
    return jax.block_until_ready(res)


def _np(res, *keys):
    return {k: np.asarray(res[k]) for k in keys}


@pytest.mark.parametrize("m", [1, 65, 4096], ids=lambda m: f"M{m}")
def test_entropy_at_the_qwen_shape(m):
    """The kernels with the entropy statistic at the Qwen3-8B head (D=4096, V_rows=152064, vocab
    151936, bf16), every bucket forced, without and with bias, per-row temperatures, edge targets:
    * (m, S, A) per split and (logp, lse, entropy) == the oracle's from the kernel's own logits (up
      to 64 rows), bit for bit (A: +-0 counted equal, see _same_or_zero_signs);
    * return_entropy off gives the same m/S/z_t/owned/logp/lse and logits bytes;
    * the trainer entry (no logits) gives the serving entry's m/S/z_t/A/logp/lse/entropy bytes;
    * every bucket gives the same A and entropy bytes; probe rows alone (M=1) == inside the batch."""
    w, _, b_full = _qwen_head()
    rng = np.random.default_rng(100 + m)
    h = jnp.asarray(rng.standard_normal((m, QWEN_D)), jnp.bfloat16)
    t = rng.integers(0, QWEN_VOCAB, m).astype(np.int32)
    if m > 3:
        t[0], t[1], t[2] = C.IGNORE_INDEX, QWEN_VOCAB - 1, 0
    temp = rng.uniform(0.5, 1.5, m).astype(np.float32)
    inv_t = oracle.inv_temperature(temp, m)
    tj, itj = jnp.asarray(t), jnp.asarray(inv_t)
    rows = np.unique(np.linspace(0, m - 1, min(m, 64)).astype(int))
    probes = np.unique([0, m // 2, m - 1])
    zero_signs = 0
    for bias in (None, b_full):
        first = None
        alone = [
            _np(_entropy_entry(h[p : p + 1], w, bias, tj[p : p + 1], itj[p : p + 1]), "m", "s", "a", "entropy")
            for p in probes
        ]
        for bucket in sorted(tuning.BUCKETS):
            what = f"M={m} {bucket} bias={bias is not None}"
            kw = dict(bucket=bucket, return_logits=True, logits_cols=QWEN_VOCAB)
            srv = _entropy_entry(h, w, bias, tj, itj, **kw)
            got = _np(srv, "m", "s", "z_t", "owned", "a", "logp", "lse", "entropy")
            # The oracle on the kernel's own logits.
            lg = np.asarray(srv["logits"][jnp.asarray(rows)])
            mo, so, ao = oracle.split_partials(
                oracle.ftz(lg), QWEN_VOCAB, QWEN_V_ROWS, inv_t[rows], return_entropy=True
            )
            assert_bitwise_equal(got["m"][rows], mo, f"m vs oracle {what}")
            assert_bitwise_equal(got["s"][rows], so, f"S vs oracle {what}")
            zero_signs += _same_or_zero_signs(got["a"][rows], ao, f"A vs oracle {what}")
            rl, rs, rh = oracle.logp_lse_entropy(
                lg, t[rows], temperature=temp[rows], vocab_size=QWEN_VOCAB, padded_vocab_size=QWEN_V_ROWS
            )
            assert_bitwise_equal(_nan_canonical(got["logp"][rows]), _nan_canonical(rl), f"logp vs oracle {what}")
            assert_bitwise_equal(got["lse"][rows], rs, f"lse vs oracle {what}")
            assert_bitwise_equal(got["entropy"][rows], rh, f"entropy vs oracle {what}")
            assert np.all(got["entropy"] >= 0) and np.isfinite(got["entropy"]).all(), what
            # return_entropy off: no byte of the contract's outputs moves.
            plain = _entropy_entry(h, w, bias, tj, itj, entropy=False, **kw)
            for k, v in _np(plain, "m", "s", "z_t", "owned", "logp", "lse").items():
                assert_bitwise_equal(
                    np.asarray(v, np.float32), np.asarray(got[k], np.float32), f"{k} entropy off {what}"
                )
            bad = _rows_differing_on_device(plain["logits"], srv["logits"])
            assert bad == 0, f"logits entropy off {what}: {bad} rows differ"
            del plain, srv
            if bias is None:  # the trainer entry (no logits)
                trn = _np(
                    _entropy_entry(h, w, bias, tj, itj, bucket=bucket), "m", "s", "z_t", "a", "logp", "lse", "entropy"
                )
                for k, v in trn.items():
                    assert_bitwise_equal(v, got[k], f"{k} trainer vs serving {what}")
            # Every bucket the same bytes; the probe rows alone the same bytes as in the batch.
            if first is None:
                first = got
            for k in ("a", "entropy", "logp", "lse"):
                assert_bitwise_equal(got[k], first[k], f"{k} {what} vs bucket {sorted(tuning.BUCKETS)[0]}")
            for p, ref in zip(probes, alone):
                for k in ("m", "s", "a", "entropy"):
                    assert_bitwise_equal(got[k][p : p + 1], ref[k], f"{k} row {p} alone vs in the batch {what}")
    if zero_signs:
        import warnings

        warnings.warn(f"M={m}: {zero_signs} A entries differ from the oracle only in the sign of a zero")


FOLD_RANDOM_ROWS = 4096  # random rows of the fold test next to the edge rows


@pytest.mark.parametrize("n_split", [1, 7, 9, 37, 264, 455])
def test_fold_entropy_layouts_equal_oracle(n_split):
    """On the GPU the fold with A (the A terms, the two-sum chain, h = plog(S) - A * rcp(S) with
    rcp = div.rn.ftz.f32) equals oracle.fold / oracle.fold_entropy bit for bit (NaN payloads aside),
    every knob that fits the split count (n_split = 455: A does not fit at rows = 64), edge rows, and 4096 random rows (S_j in [1, 1.2e6], folded S up to ~1e8); all
    layouts give the same bytes; a row alone gives its bytes in the batch."""
    from pallas_kernels import sm90_fold
    from tests.pallas_cases import entropy_fold_problem

    n, v = 200, 151936
    m, s, a, z_t, t, inv_t = entropy_fold_problem(n, n_split, v, seed=n_split)
    rng = np.random.default_rng(n_split)
    nr = FOLD_RANDOM_ROWS
    mr = rng.normal(0, 3, (nr, n_split)).astype(np.float32)
    sr = np.exp(rng.uniform(0, 14, (nr, n_split))).astype(np.float32)  # S_j >= 1, as a chain makes it
    ar = (-sr * rng.uniform(0, 12, (nr, n_split))).astype(np.float32)
    m, s, a = (np.concatenate([x, y]) for x, y in ((m, mr), (s, sr), (a, ar)))
    z_t = np.concatenate([z_t, rng.normal(0, 5, nr).astype(np.float32)])
    t = np.concatenate([t, rng.integers(0, v, nr).astype(np.int32)])
    inv_t = np.concatenate([inv_t, oracle.inv_temperature(rng.uniform(0.3, 2, nr).astype(np.float32), nr)])
    rl, rs = oracle.fold(m, s, z_t, t, inv_t, v)
    rh = oracle.fold_entropy(m, s, a)
    # Fully unrolled where the plan's split counts are (<= 264); at 455 a 64-split trip with a remainder.
    variants = [
        {},
        dict(rows=8),
        dict(chunk=4, unroll=8),
        dict(chunk=128, unroll=n_split if n_split <= 264 else 64),
        dict(rows=64, chunk=6, unroll=5),
    ]
    ref = None
    for knobs in variants:
        if not sm90_fold.staged_fits(n_split, knobs.get("rows", 32), entropy=True):
            continue
        logp, lse, ent = (np.asarray(x) for x in sm90_fold.fold(m, s, z_t, t, inv_t, v, a=a, **knobs))
        assert_bitwise_equal(_nan_canonical(logp), _nan_canonical(rl), f"logp {knobs}")
        assert_bitwise_equal(_nan_canonical(lse), _nan_canonical(rs), f"lse {knobs}")
        assert_bitwise_equal(_nan_canonical(ent), _nan_canonical(rh), f"entropy {knobs}")
        if ref is None:
            ref = (logp, lse, ent)
            plain = sm90_fold.fold(m, s, z_t, t, inv_t, v)  # without A: the same logp / lse bytes
            assert_bitwise_equal(np.asarray(plain[0]), logp, "logp without A")
            assert_bitwise_equal(np.asarray(plain[1]), lse, "lse without A")
        for got, want, name in zip((logp, lse, ent), ref, ("logp", "lse", "entropy")):
            assert_bitwise_equal(got, want, f"{name} {knobs} vs default")
    for r in (0, 1, 9, 11, n + 7):  # a row alone == the row in the batch
        out = sm90_fold.fold(
            m[r : r + 1], s[r : r + 1], z_t[r : r + 1], t[r : r + 1], inv_t[r : r + 1], v, a=a[r : r + 1]
        )
        for got, want, name in zip(out, ref, ("logp", "lse", "entropy")):
            assert_bitwise_equal(np.asarray(got), want[r : r + 1], f"{name} row {r} alone")


def _qwen_rows(m, seed):
    """m rows at the Qwen3-8B head: hidden [m, D] bf16, per-row temperatures, targets (with m > 3:
    an ignored row, the last real column and one past the vocabulary) and fl(1/T) as jax arrays."""
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((m, QWEN_D)), jnp.bfloat16)
    t = rng.integers(0, QWEN_VOCAB, m).astype(np.int32)
    if m > 3:
        t[0], t[1], t[2] = C.IGNORE_INDEX, QWEN_VOCAB - 1, QWEN_VOCAB + 5
    temp = rng.uniform(0.5, 1.5, m).astype(np.float32)
    return h, temp, jnp.asarray(t), jnp.asarray(oracle.inv_temperature(temp, m))


@pytest.mark.parametrize("m", [1, 65, 4096], ids=lambda m: f"M{m}")
def test_fused_forward_equals_partials_and_fold_at_the_qwen_shape(m):
    """pk.forward (the op core's unsharded path: the fold reads the forward's split-major partials
    over its padded rows) == pk.fold(*pk.partials(...)) byte for byte at the Qwen3-8B head, every
    bucket, with bias and per-row T, with and without the entropy; and linear_logp (which serves
    through pk.forward) gives those bytes, in both weight layouts."""
    import detlogp_jax as dl

    w, k_dv, b_full = _qwen_head()
    h, temp, tj, itj = _qwen_rows(m, seed=300 + m)
    kw = dict(vocab_size=QWEN_VOCAB, padded_vocab_size=QWEN_V_ROWS)
    for bias in (None, b_full):
        ref = _np(_entropy_entry(h, w, bias, tj, itj), "logp", "lse", "entropy")
        for bucket in sorted(tuning.BUCKETS):
            for ent in (True, False):
                got = pk.forward(h, w, bias, tj, itj, bucket=bucket, return_entropy=ent, **kw)
                what = f"M={m} bucket={bucket} entropy={ent} bias={bias is not None}"
                for k, x in (("logp", got[0]), ("lse", got[1])) + ((("entropy", got[3]),) if ent else ()):
                    assert_bitwise_equal(_nan_canonical(np.asarray(x)), _nan_canonical(ref[k]), f"{k} {what}")
        api = dl.linear_logp(
            h, w, tj, bias=bias, temperature=temp, vocab_size=QWEN_VOCAB, backend="pallas_sm90", return_entropy=True
        )
        api_dv = dl.linear_logp(
            h,
            k_dv,
            tj,
            bias=bias,
            temperature=temp,
            vocab_size=QWEN_VOCAB,
            backend="pallas_sm90",
            return_entropy=True,
            weight_layout="dv",
        )
        for out, lay in ((api, "vd"), (api_dv, "dv")):
            for k in ("logp", "lse", "entropy"):
                got = _nan_canonical(np.asarray(getattr(out, k)))
                assert_bitwise_equal(got, _nan_canonical(ref[k]), f"linear_logp {k} {lay} M={m}")


@pytest.mark.parametrize("m", [1, 3, 13, 40], ids=lambda m: f"M{m}")
def test_unpadded_rows_equal_padded_rows_at_the_qwen_shape(m):
    """pk.forward with its N rows passed unpadded == the padded launch (unpadded=False) byte for
    byte: logp, lse, entropy and the logits, with bias and per-row T; targets at the vocab's first
    and last real column and at the last row. M <= 64 (decode bucket, [V, D] and [D, V]): the
    forward kernel reads the [N] targets / inv_t by scalar loads and hidden (N rows; 16 at M=13)
    with a box of N rounded up to 8 rows, the fold reads and writes [N] by scalar loads and
    stores (M=40: two fold row blocks, the second partly past N)."""
    w, k_dv, b_full = _qwen_head()
    rng = np.random.default_rng(700 + m)
    h = jnp.asarray(rng.standard_normal((m, QWEN_D)), jnp.bfloat16)
    t = rng.integers(0, QWEN_VOCAB, m).astype(np.int32)
    t[0], t[-1] = (0, QWEN_VOCAB - 1) if m > 1 else (QWEN_VOCAB - 1,) * 2
    temp = rng.uniform(0.5, 1.5, m).astype(np.float32)
    tj, itj = jnp.asarray(t), jnp.asarray(oracle.inv_temperature(temp, m))
    kw = dict(vocab_size=QWEN_VOCAB, padded_vocab_size=QWEN_V_ROWS, return_entropy=True, return_logits=True)
    kw["logits_cols"] = QWEN_VOCAB
    for bucket, weight, layout in (("decode", w, "vd"), ("decode", k_dv, "dv")):
        outs = [
            pk.forward(h, weight, b_full, tj, itj, bucket=bucket, weight_layout=layout, unpadded=u, **kw)
            for u in (True, False)
        ]
        for i, name in ((0, "logp"), (1, "lse"), (3, "entropy")):
            a, b = (_nan_canonical(np.asarray(o[i])) for o in outs)
            assert a.shape == (m,), (name, a.shape)
            assert_bitwise_equal(a, b, f"{name} M={m} {bucket} {layout}")
        assert outs[0][2].shape == (m, QWEN_VOCAB)
        assert _rows_differing_on_device(outs[0][2], outs[1][2]) == 0, f"logits M={m} {bucket} {layout}"
